"""`xserv engine` flags become the EngineConfig the engine is built from."""

import argparse
import importlib
import os
import subprocess
import sys

import pytest

from xserv_cli.main import SUBCOMMANDS, main
from xserv_engine.config import EngineConfig
from xserv_engine.errors import InvalidRequest
from xserv_engine.server import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_the_engine_config_defaults():
    args = parse("--model", "/models/qwen3")
    assert (args.host, args.port, args.drain_grace, args.log_level) == ("127.0.0.1", 50051, 30.0, "warning")
    assert (args.metrics_port, args.grpc_token, args.grpc_token_file) == (None, None, None)
    assert cli.engine_config_from_args(args) == EngineConfig(model="/models/qwen3")


def test_every_engine_flag_reaches_the_config():
    args = parse("--model", "/m", "--dtype", "bfloat16", "--device", "cuda:1", "--max-model-len", "4096",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--max-queued-requests", "3",
                 "--block-size", "32", "--num-kv-blocks", "100", "--kv-cache-memory-gb", "0.5",
                 "--gpu-memory-utilization", "0.8", "--no-prefix-caching", "--attention-backend", "torch",
                 "--seed", "7", "--served-model-name", "qwen3-8b", "--enforce-eager")
    assert cli.engine_config_from_args(args) == EngineConfig(
        model="/m", dtype="bfloat16", device="cuda:1", max_model_len=4096, max_num_seqs=8,
        max_num_batched_tokens=512, max_queued_requests=3, block_size=32, num_kv_blocks=100,
        kv_cache_memory_gb=0.5, gpu_memory_utilization=0.8, enable_prefix_caching=False,
        attention_backend="torch", enforce_eager=True, seed=7, model_id="qwen3-8b")


def test_engine_flags_can_be_reused_without_the_address():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)  # e.g. `xserv up`'s REST port
    cli.add_engine_arguments(parser)
    cli.add_serving_arguments(parser)
    args = parser.parse_args(["--model", "/m", "--port", "9000", "--max-num-seqs", "4"])
    assert args.port == 9000 and cli.engine_config_from_args(args).max_num_seqs == 4


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_flag_of_every_command_says_what_it_does(command):
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    assert [a.option_strings for a in parser._actions if not a.help] == []  # argparse lists them nowhere else


def test_help_lists_the_flags():
    result = subprocess.run([sys.executable, "-m", "xserv_cli", "engine", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--model", "--port", "--drain-grace", "--max-queued-requests", "--no-prefix-caching"):
        assert flag in result.stdout


def test_up_hands_the_same_token_to_the_engine_and_the_front():
    from xserv_cli import up

    for flag, value in (("--grpc-token", "t0k"), ("--grpc-token-file", "/run/secrets/token")):
        parser = argparse.ArgumentParser()
        up.add_arguments(parser)
        engine, rest = up.child_commands(parser.parse_args([flag, value, "--metrics-port", "9100"]))
        assert engine[-4:] == ["--metrics-port", "9100", flag, value]
        assert rest[-2:] == [flag, value] and "--metrics-port" not in rest


def test_up_log_level_reaches_both_children_only_when_given():
    from xserv_cli import up

    def children(*argv):
        parser = argparse.ArgumentParser()
        up.add_arguments(parser)
        return up.child_commands(parser.parse_args(list(argv)))

    engine, rest = children()
    assert "--log-level" not in engine and rest[rest.index("--log-level") + 1] == "info"
    engine, rest = children("--log-level", "warning")
    assert rest[rest.index("--log-level") + 1] == "warning"


def test_vllms_spelling_also_disables_prefix_caching():
    config = cli.engine_config_from_args(parse("--model", "/m", "--no-enable-prefix-caching"))
    assert config.enable_prefix_caching is False


def test_lora_flags_reach_the_config_in_both_of_vllms_forms():
    args = parse("--model", "/m", "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", '
                 '"base_model_name": "qwen3"}', "--lora-modules", "more=/a/more", "--max-lora-rank", "32")
    config = cli.engine_config_from_args(args)
    assert config.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"), ("more", "/a/more"))
    assert (config.enable_lora, config.max_lora_rank) == (True, 32)
    assert cli.engine_config_from_args(parse("--model", "/m", "--enable-lora")).enable_lora
    assert not cli.engine_config_from_args(parse("--model", "/m")).enable_lora
    for bad in ("sql", "=/a", "sql=", '{"name": "x"}', "{broken"):
        with pytest.raises(InvalidRequest, match="--lora-modules takes NAME=PATH") as caught:
            cli.engine_config_from_args(parse("--model", "/m", "--lora-modules", bad))
        assert caught.value.field == "lora_modules"


def test_up_forwards_the_lora_flags_to_the_engine():
    from xserv_cli import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--lora-modules", "a=/x", "b=/y", "--max-lora-rank", "8"])
    engine_cmd, _ = up.child_commands(args)
    assert engine_cmd[engine_cmd.index("--lora-modules"):][:6] == ["--lora-modules", "a=/x", "--lora-modules", "b=/y",
                                                                    "--max-lora-rank", "8"]


def test_tool_call_parser_reaches_the_config_and_up_forwards_it():
    assert cli.engine_config_from_args(parse("--model", "/m")).tool_call_parser == "auto"
    config = cli.engine_config_from_args(parse("--model", "/m", "--tool-call-parser", "qwen3_coder"))
    assert config.tool_call_parser == "qwen3_coder"
    with pytest.raises(SystemExit):
        parse("--model", "/m", "--tool-call-parser", "mistral")
    from xserv_cli import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    engine_cmd, rest_cmd = up.child_commands(parser.parse_args(["--tool-call-parser", "hermes"]))
    assert engine_cmd[engine_cmd.index("--tool-call-parser"):][:2] == ["--tool-call-parser", "hermes"]
    assert "--tool-call-parser" not in rest_cmd


def test_scheduling_policy_reaches_the_config_and_up_forwards_it():
    assert cli.engine_config_from_args(parse("--model", "/m")).scheduling_policy == "fcfs"
    config = cli.engine_config_from_args(parse("--model", "/m", "--scheduling-policy", "priority"))
    assert config.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parse("--model", "/m", "--scheduling-policy", "lifo")
    from xserv_cli import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    engine_cmd, rest_cmd = up.child_commands(parser.parse_args(["--scheduling-policy", "priority"]))
    assert engine_cmd[engine_cmd.index("--scheduling-policy"):][:2] == ["--scheduling-policy", "priority"]
    assert "--scheduling-policy" not in rest_cmd


@pytest.mark.parametrize("given, kept", [(None, "ERROR"), ("DEBUG", "DEBUG")])
def test_grpc_logs_only_its_errors_unless_the_user_asks_for_more(monkeypatch, given, kept):
    """grpc's INFO lines ("I1207 ... Got goaway ...") went to stderr on every Ctrl-C of `xserv up`."""
    if given is None:
        monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    else:
        monkeypatch.setenv("GRPC_VERBOSITY", given)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert os.environ["GRPC_VERBOSITY"] == kept


def test_limit_mm_per_prompt_takes_vllms_json_and_up_forwards_it():
    assert cli.engine_config_from_args(parse("--model", "/m")).limit_mm_per_prompt == 999  # vLLM's default
    config = cli.engine_config_from_args(parse("--model", "/m", "--limit-mm-per-prompt", '{"image": 2, "video": 0}'))
    assert config.limit_mm_per_prompt == 2
    for bad in ('{"video": 1}', "4", '{"image": -1}', '{"image": "2"}', "{"):
        with pytest.raises(SystemExit):
            parse("--model", "/m", "--limit-mm-per-prompt", bad)
    from xserv_cli import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    engine_cmd, rest_cmd = up.child_commands(parser.parse_args(["--limit-mm-per-prompt", '{"image": 3}']))
    assert engine_cmd[engine_cmd.index("--limit-mm-per-prompt"):][:2] == ["--limit-mm-per-prompt", '{"image": 3}']
    assert "--limit-mm-per-prompt" not in rest_cmd
