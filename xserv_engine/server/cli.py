"""`xserv engine`: serve one model replica over gRPC.

Other commands that start an engine (`xserv up`) reuse the pieces: add_engine_arguments()
(every model / cache / scheduling flag), add_serving_arguments() (drain grace, log level) and
engine_config_from_args(); add_listen_arguments() (--host / --port) is separate so they can pick
their own names for the address.
"""

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys

from xserv_engine.config import EngineConfig
from xserv_engine.errors import InvalidRequest
from xserv_engine.media import add_media_arguments, media_policy_from_args
from xserv_engine.server.vllm_worker.mm_processors import MM_PROCESSORS
from xserv_engine.openmp import wait_briefly
from xserv_engine.tokenizer.tool_call_parsers import TOOL_CALL_PARSERS
from xserv_engine.tracing import INSTALL_HINT, TracingUnavailable, check_available

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
DEFAULT_LOG_LEVEL = "warning"  # startup, shutdown and problems; "info" adds a line per request
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_listen_arguments(parser)
    add_engine_arguments(parser)
    add_serving_arguments(parser)
    add_tls_arguments(parser)
    add_media_arguments(parser)  # for SMG's media_refs, which the engine fetches itself
    add_mm_processor_argument(parser)


def add_mm_processor_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mm-processor", choices=tuple(MM_PROCESSORS), default="inprocess",
                        help="who preprocesses the images of requests from SMG: " + "; ".join(
                            f"{name}: {what}" for name, what in MM_PROCESSORS.items()) + " (default: %(default)s)")


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (gRPC between hosts; docs/scale-out.md)")
    group.add_argument("--grpc-tls-cert", default=None, metavar="PEM",
                       help="serve gRPC over TLS with this certificate chain (with --grpc-tls-key)")
    group.add_argument("--grpc-tls-key", default=None, metavar="PEM", help="the private key of --grpc-tls-cert")
    group.add_argument("--grpc-tls-client-ca", default=None, metavar="PEM",
                       help="mTLS: refuse clients without a certificate signed by this CA")


def add_listen_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC address")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=int, default=50051, help="port to bind (default: %(default)s)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face Qwen3 checkpoint directory (default: the random-weight demo model)")
    group.add_argument("--served-model-name", default=None,
                       help="model id reported to clients (default: the directory name)")
    group.add_argument("--dtype", default=_DEFAULTS["dtype"], choices=("auto", "float32", "bfloat16", "float16"),
                       help="the weights' and activations' dtype; auto: bfloat16 on CUDA and on CPUs with "
                            "AVX512-BF16 or AMX, else float32 (default: %(default)s)")
    group.add_argument("--device", default=_DEFAULTS["device"], help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    group.add_argument("--quantization", default=None, choices=("int8", "int4"),
                       help="int8: weights quantized to 8 bits per output channel at load, activations per token "
                            "(W8A8, as vLLM's and SGLang's CPU w8a8_int8); int4: weights quantized to 4 bits per "
                            "group of 128 input channels at load (asymmetric), activations in the dtype; CPU only. "
                            "compressed-tensors int8 and W4A16, AWQ and GPTQ checkpoints are served as written "
                            "without it (default: the checkpoint's precision)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's, capped at 8192)")
    group.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"],
                       help="most sequences in one batch (default: %(default)s)")
    group.add_argument("--scheduling-policy", default=_DEFAULTS["scheduling_policy"], choices=("fcfs", "priority"),
                       help="fcfs: requests run in arrival order; priority: by each request's priority, lower "
                            "first (vLLM's convention), then arrival, and running requests of a lower priority are "
                            "preempted first, also to admit a higher one (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS["max_num_batched_tokens"],
                       help="most tokens in one forward pass; a longer prompt is prefilled in chunks over "
                            "several steps, beside the running streams (default: %(default)s)")
    group.add_argument("--max-queued-requests", type=int, default=_DEFAULTS["max_queued_requests"],
                       help="waiting requests beyond which new ones get RESOURCE_EXHAUSTED (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"],
                       help="tokens per KV-cache block (default: 64 on the torch path, 256 with flash-attn)")
    group.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV-cache blocks (default: sized from --kv-cache-memory-gb)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=_DEFAULTS["kv_cache_memory_gb"],
                       help="KV-cache budget in GiB (default: the engine sizes it for the device)")
    group.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS["gpu_memory_utilization"],
                       help="fraction of GPU memory the engine may use (default: %(default)s)")
    group.add_argument("--no-enable-prefix-caching", "--no-prefix-caching", dest="no_prefix_caching",
                       action="store_true", help="disable prefix caching (the first spelling is vLLM's)")
    group.add_argument("--mamba-track-interval", type=int, default=None, metavar="TOKENS",
                       help="hybrid models (Qwen3.5, Qwen3-Next): the prefix cache keeps the linear-attention "
                            "states every TOKENS tokens of a prompt, and at its last full block, so a later "
                            "prompt resumes there (a multiple of --block-size; default: every block; SGLang's flag)")
    group.add_argument("--mamba-snapshot-slots", type=int, default=None, metavar="N",
                       help="hybrid models: how many such snapshots the prefix cache holds, least recently used "
                            "evicted first, 0 to turn hybrid prefix caching off (default: as many as a quarter of "
                            "the KV-cache budget holds; the size of one is logged at start)")
    group.add_argument("--attention-backend", default=_DEFAULTS["attention_backend"],
                       choices=("auto", "torch", "flash", "triton"),
                       help="auto: flash-attn on CUDA when installed, else Triton (CUDA), else torch (default: auto)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="every decode step runs torch op by op (vLLM's flag): no CUDA graphs on CUDA, no native "
                            "decode kernel on the CPU")
    group.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                       help="max_tokens of a request that sets none (default: the model's generation_config.json "
                            "max_new_tokens if it has one, else the rest of the context)")
    group.add_argument("--sampling-defaults", default=_DEFAULTS["sampling_defaults"], choices=("model", "openai"),
                       help="model: a request's unset temperature, top_p, top_k, min_p and repetition_penalty take "
                            "the values the model's generation_config.json recommends (as vLLM and SGLang do); "
                            "openai: temperature 1 and no top-p, top-k or min-p (default: %(default)s)")
    group.add_argument("--seed", type=int, default=_DEFAULTS["seed"], help="engine seed (default: %(default)s)")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (vLLM's flag): those of --lora-modules, and any loaded later "
                            "with LoadLoraAdapter (REST: POST /v1/load_lora_adapter)")
    group.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                       help="PEFT LoRA adapters to load at start, each selected by its NAME (a request's "
                            "lora_name; REST: its \"model\"), or in vLLM's JSON form {\"name\": NAME, \"path\": PATH}; "
                            "implies --enable-lora")
    group.add_argument("--max-lora-rank", type=int, default=_DEFAULTS["max_lora_rank"],
                       help="largest adapter rank accepted (default: %(default)s)")
    group.add_argument("--runner", default=_DEFAULTS["runner"], choices=("auto", "generate", "pooling", "score"),
                       help="generate: text generation (Generate); pooling: embeddings (Embed) of an embedding "
                            "model such as Qwen3-Embedding; score: relevance scores (Score) of a reranker such as "
                            "Qwen3-Reranker; auto: pooling when the model directory has a sentence-transformers "
                            "pooling config (modules.json), else generate (default: %(default)s)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding, as vLLM spells it: {\"method\": \"ngram\", "
                            "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}, "
                            "or {\"model\": DRAFT_DIR, \"num_speculative_tokens\": 4} for a draft model, or "
                            "{\"method\": \"mtp\", \"num_speculative_tokens\": 1} for a Qwen3.5 checkpoint's own "
                            "multi-token-prediction layer (mtp.*); "
                            "drafts are checked in one forward pass while at most disable_by_batch_size (default 8) "
                            "sequences decode and, with disable_when_slower (default true), at batch sizes where "
                            "speculating was measured faster than plain decoding. Greedy output is unchanged, "
                            "sampling keeps the model's distribution (default: off)")
    group.add_argument("--tool-call-parser", default=_DEFAULTS["tool_call_parser"], choices=TOOL_CALL_PARSERS,
                       help="the format of the model's tool calls (vLLM's names): hermes or qwen3, Qwen3's JSON; "
                            "qwen3_coder, Qwen3-Coder's XML (<function=...><parameter=...>, values typed by the "
                            "tools' schemas); auto: the one the model's chat template asks for (default: %(default)s)")
    group.add_argument("--limit-mm-per-prompt", type=_limit_mm_per_prompt, default=None,
                       metavar="JSON", help="most images one prompt may hold, as vLLM spells it: '{\"image\": 4}'; a "
                                            "prompt with more gets INVALID_ARGUMENT (REST: 400). Only images are "
                                            "served: video and audio may only be 0 (default: "
                                            f"{{\"image\": {_DEFAULTS['limit_mm_per_prompt']}}}, vLLM's)")
    group.add_argument("--language-model-only", action="store_true",
                       help="serve a vision-language checkpoint's text model alone (vLLM's flag): its vision "
                            "tower is not loaded, and images are refused")
    group.add_argument("--stream-interval", type=_stream_interval, default="auto", metavar="N|auto",
                       help="send each stream's tokens every N steps (its first and last token at once); "
                            "auto: every token while at most 8 streams decode, then every "
                            "ceil(streams / 8) steps, at most 8 (default: %(default)s)")


def _stream_interval(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or auto, got {value!r}")
    return number


def _limit_mm_per_prompt(value: str) -> str:
    """The flag's text, checked (`xserv up` forwards it as given)."""
    image_limit(value)
    return value


def image_limit(value: str | None) -> int:
    """vLLM's '{"image": N}' -> N; other modalities only as 0, since only images are served."""
    if value is None:
        return _DEFAULTS["limit_mm_per_prompt"]
    try:
        limits = json.loads(value)
    except ValueError:
        limits = None
    if not isinstance(limits, dict) or not all(type(n) is int and n >= 0 for n in limits.values()):
        raise argparse.ArgumentTypeError(f"expected a JSON object of counts such as '{{\"image\": 4}}', got {value!r}")
    served = {name: n for name, n in limits.items() if name != "image" and n}
    if served:
        raise argparse.ArgumentTypeError(f"only images are served; {', '.join(served)} may only be 0")
    return limits.get("image", _DEFAULTS["limit_mm_per_prompt"])


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serving")
    group.add_argument("--drain-grace", type=float, default=30.0,
                       help="seconds running streams get to finish after SIGTERM / SIGINT (default: %(default)s)")
    group.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, choices=("debug", "info", "warning", "error"),
                       help="warning: startup, shutdown and problems; info adds one line per request; "
                            f"error: errors only (default: {DEFAULT_LOG_LEVEL})")
    group.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics on --host:PORT/metrics; 0 picks a free port (default: off)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export OpenTelemetry traces to this OTLP gRPC collector (HOST:PORT or http://HOST:PORT; "
                            f"https:// for TLS); needs {INSTALL_HINT} (default: off)")
    token = group.add_mutually_exclusive_group()
    token.add_argument("--grpc-token", default=None,
                       help="require the metadata 'authorization: Bearer TOKEN' on EngineService calls")
    token.add_argument("--grpc-token-file", default=None, metavar="PATH",
                       help="like --grpc-token, the token read from the first line of PATH")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Builds the config; with no --model this builds the demo checkpoint first (once, cached)."""
    model, model_id = args.model, args.served_model_name
    if model is None:
        from xserv_engine.demo import MODEL_ID, default_model_dir

        model, model_id = default_model_dir(), model_id or MODEL_ID
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        scheduling_policy=args.scheduling_policy,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued_requests=args.max_queued_requests,
        stream_interval=args.stream_interval,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        mamba_track_interval=args.mamba_track_interval,
        mamba_snapshot_slots=args.mamba_snapshot_slots,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        default_max_tokens=args.default_max_tokens,
        sampling_defaults=args.sampling_defaults,
        model_id=model_id,
        runner=args.runner,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        lora_modules=tuple(_lora_module(spec) for spec in args.lora_modules or ()),
        max_lora_rank=args.max_lora_rank,
        tool_call_parser=args.tool_call_parser,
        speculative_config=args.speculative_config,
        limit_mm_per_prompt=image_limit(args.limit_mm_per_prompt),
        language_model_only=args.language_model_only,
    )


def _lora_module(spec: str) -> tuple[str, str]:
    """NAME=PATH, or vLLM's JSON form {"name": NAME, "path": PATH, ...}."""
    if spec.lstrip().startswith("{"):
        try:
            fields = json.loads(spec)
            name, path, sep = fields.get("name"), fields.get("path"), "="
        except (ValueError, AttributeError):
            name = path = sep = None
    else:
        name, sep, path = spec.partition("=")
    if not sep or not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise InvalidRequest("lora_modules", f"--lora-modules takes NAME=PATH or {{\"name\": ..., \"path\": ...}}, "
                                             f"got {spec!r}")
    return name, path


def configure_logging(level_name: str) -> None:
    """At the default `warning` the server's own startup and shutdown lines still show, and so do
    the start's slow steps (logger xserv.engine.startup: the one-time native build, the warm-up);
    the per-request lines (logger xserv.engine.requests, INFO) need `info` or `debug`."""
    level = getattr(logging, level_name.upper())
    logging.basicConfig(level=level, format=LOG_FORMAT)
    if level == logging.WARNING:
        for name in ("xserv.engine.server", "xserv.engine.startup"):
            logging.getLogger(name).setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    wait_briefly()  # before anything imports torch
    from xserv_engine.server.auth import read_token
    from xserv_engine.server.serve import serve, still_loading
    from xserv_engine.server.tls import tls_from_args

    try:
        token = read_token(args.grpc_token, args.grpc_token_file)
        tls = tls_from_args(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_client_ca)
        media = media_policy_from_args(args)
        if args.otlp_traces_endpoint is not None:
            check_available()
    except (OSError, ValueError, TracingUnavailable) as exc:
        logging.getLogger("xserv.engine.server").error("%s", exc)
        return 1

    def load_engine():
        from xserv_engine.engine.engine_thread import EngineThread
        from xserv_engine.engine.llm_engine import LLMEngine

        return EngineThread(LLMEngine(engine_config_from_args(args)))

    code = asyncio.run(serve(load_engine, args.host, args.port, args.drain_grace, token, args.metrics_port, tls,
                             args.otlp_traces_endpoint, media, args.mm_processor))
    if still_loading():
        # stopped while the model loaded: the loading thread is still inside torch's native code,
        # and finalizing the interpreter under it aborts the process ("terminate called without
        # an active exception", exit -6); end here, with the logs flushed
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
