"""End to end: the real `xserv engine` process serving PEFT LoRA adapters: lora_name on Generate,
adapters loaded and unloaded at runtime over gRPC (stubs and grpcurl), and the errors a client
gets, each with its status and the field it names."""

import json
import re
import subprocess

import grpc
import pytest
from xserv.v1 import engine_pb2

from tests.engine.conftest import save_hf_model
from tests.engine.test_lora import ATTENTION, peft_greedy, prompt
from tests.support.grpc_errors import bad_fields
from tests.support.lora_adapter import write_lora_adapter

from .engine_process import GRPCURL, start_engine
from .test_engine_observability import logged, scrape

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("lora-rpc")
    (root / "base").mkdir()
    save_hf_model(root / "base", demo_dir, tie=True)
    return {
        "dir": root / "base",
        "all": (root / "all", write_lora_adapter(root / "base", root / "all", rank=8, alpha=16, seed=1)),
        "qv": (root / "qv", write_lora_adapter(root / "base", root / "qv", targets=ATTENTION, rank=4, alpha=8,
                                               seed=2)),
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory, model):
    process = start_engine(tmp_path_factory, "--model", str(model["dir"]), "--dtype", "float32",
                           "--lora-modules", f"all={model['all'][0]}", "--max-lora-rank", "16", "--log-level", "info", "--metrics-port", "0")
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", process.log_text()).group(1)
    process.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield process
    assert process.stop() == 0


def greedy(engine, ids, lora_name="", max_tokens=10) -> list[int]:
    request = engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=ids), lora_name=lora_name,
                                         params=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))
    return [t for message in engine.stub.Generate(request, timeout=60) for t in message.token_ids]


def test_generate_with_lora_name_answers_as_peft_and_the_base_model_stays_itself(engine, model):
    info = engine.model_info()
    assert info.lora_enabled and info.max_lora_rank == 16
    assert [(a.name, a.path, a.rank) for a in info.lora_adapters] == [("all", str(model["all"][0]), 8)]
    ids = prompt(21, 15)
    adapted = greedy(engine, ids, "all")
    assert adapted == peft_greedy(model["all"][1], ids, 10)
    assert greedy(engine, ids) == peft_greedy(model["all"][1], ids, 10, base=True) != adapted
    assert logged(engine, " lora=all") and logged(engine, " lora=-")  # each call's request log line
    metrics = scrape(engine)
    assert metrics['xserv_lora_requests_total{lora_name="all"}'] >= 1.0
    assert metrics["xserv_lora_adapters_loaded"] == 1.0


def test_an_adapter_not_loaded_is_not_found_naming_lora_name(engine):
    with pytest.raises(grpc.RpcError) as caught:
        greedy(engine, prompt(1, 4), "nope")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope' is not loaded (loaded: all)" in caught.value.details()
    assert [field for field, _ in bad_fields(caught.value)] == ["lora_name"]


def test_adapters_load_and_unload_at_runtime(engine, model):
    reply = engine.stub.LoadLoraAdapter(engine_pb2.LoadLoraAdapterRequest(lora_name="qv", lora_path=str(model["qv"][0])),
                                        timeout=60)
    assert (reply.adapter.name, reply.adapter.rank) == ("qv", 4)
    ids = prompt(22, 9)
    assert greedy(engine, ids, "qv") == peft_greedy(model["qv"][1], ids, 10)
    assert [a.name for a in engine.model_info().lora_adapters] == ["all", "qv"]
    engine.stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name="qv"), timeout=10)
    assert [a.name for a in engine.model_info().lora_adapters] == ["all"]
    with pytest.raises(grpc.RpcError) as caught:
        greedy(engine, ids, "qv")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as caught:
        engine.stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name="qv"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("name, path, field, message", [
    ("all", "qv", "lora_name", "'all' is already the name of a loaded adapter"),
    ("", "qv", "lora_name", "the adapter's name is empty"),
    ("x", "", "lora_path", "the adapter's directory is empty"),
    ("x", "/nowhere", "lora_path", "/nowhere has no adapter_config.json"),
    ("x", "big", "lora_path", "rank 32 is above --max-lora-rank 16"),
])
def test_a_load_it_cannot_do_is_invalid_argument_naming_the_field(engine, model, tmp_path, name, path, field,
                                                                  message):
    if path == "qv":
        path = str(model["qv"][0])
    elif path == "big":
        write_lora_adapter(model["dir"], tmp_path / "big", targets=ATTENTION, rank=32, alpha=8)
        path = str(tmp_path / "big")
    with pytest.raises(grpc.RpcError) as caught:
        engine.stub.LoadLoraAdapter(engine_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    assert [f for f, _ in bad_fields(caught.value)] == [field]
    assert [a.name for a in engine.model_info().lora_adapters] == ["all"]


def test_grpcurl_loads_an_adapter_and_generates_with_it(engine, model):
    def call(method, body):
        done = subprocess.run([GRPCURL, "-plaintext", "-d", json.dumps(body), engine.address,
                               f"xserv.v1.EngineService/{method}"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    loaded = json.loads(call("LoadLoraAdapter", {"lora_name": "cli", "lora_path": str(model["qv"][0])}))
    assert loaded["adapter"]["name"] == "cli" and loaded["adapter"]["rank"] == 4
    ids = prompt(23, 6)
    out = call("Generate", {"token_ids": {"ids": ids}, "lora_name": "cli",
                            "params": {"max_tokens": 10, "temperature": 0, "ignore_eos": True}})
    messages = [json.loads(chunk) for chunk in out.replace("}\n{", "}\x00{").split("\x00")]
    assert [int(t) for m in messages for t in m.get("token_ids", [])] == peft_greedy(model["qv"][1], ids, 10)
    call("UnloadLoraAdapter", {"lora_name": "cli"})
