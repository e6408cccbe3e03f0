"""End to end: `xserv up --lora-modules` on a tiny random Qwen3 checkpoint with a PEFT adapter
(random A and B, so that it visibly changes the answers), used through the openai SDK as a vLLM
user would: the adapter is a model of its own in /v1/models, selected by "model", and adapters
are loaded and unloaded at runtime with vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter."""

import subprocess
from pathlib import Path

import openai
import pytest
import requests

from tests.support.processes import served

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_dir) -> tuple[Path, Path]:
    """(the model's directory, its adapter's directory)."""
    from tests.engine.conftest import save_hf_model
    from tests.support.lora_adapter import write_lora_adapter

    model_dir, adapter_dir = tmp_path_factory.mktemp("lora-base"), tmp_path_factory.mktemp("lora-adapter")
    save_hf_model(model_dir, demo_dir, tie=True)
    write_lora_adapter(model_dir, adapter_dir)
    return model_dir, adapter_dir


@pytest.fixture(scope="module")
def up(checkpoint):
    """Two gunicorn workers, so that a worker may serve an adapter the other one loaded."""
    model_dir, adapter_dir = checkpoint
    with served("up", "--model", str(model_dir), "--lora-modules", f"sql={adapter_dir}", "--workers", "2",
                "--num-kv-blocks", "64", "--max-model-len", "512", "--dtype", "float32", "--log-level", "warning",
                stdout=subprocess.PIPE, text=True) as up:
        yield up


@pytest.fixture(scope="module")
def banner(up) -> list[str]:
    """The lines `xserv up` prints once both processes are ready."""
    return [up.process.stdout.readline() for _ in range(5)]


@pytest.fixture(scope="module")
def sdk(up):
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def answer(sdk, model: str) -> dict:
    """The greedy answer's message; 12 tokens whatever the random model writes."""
    reply = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert reply.model == model and reply.usage.completion_tokens == 12
    return reply.choices[0].message.model_dump()


def test_up_names_the_adapters_in_its_banner(banner):
    assert banner[0].startswith("xserv up: serving ")
    assert banner[3].strip() == 'LoRA         sql  (a request\'s "model" picks one)'
    assert banner[4].startswith("  try: curl ")


def test_the_adapter_is_a_model_of_its_own(sdk, checkpoint):
    base, adapter = sdk.models.list().data
    assert adapter.id == "sql" and adapter.model_extra["parent"] == base.id and base.model_extra["parent"] is None
    assert Path(adapter.model_extra["root"]) == checkpoint[1]
    assert sdk.models.retrieve("sql").id == "sql"
    with_adapter = answer(sdk, "sql")
    assert with_adapter != answer(sdk, base.id)
    chunks = list(sdk.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert {chunk.model for chunk in chunks} == {"sql"}
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == with_adapter["content"]


def test_adapters_loaded_and_unloaded_at_runtime(sdk, up, checkpoint):
    adapter_dir = checkpoint[1]
    resp = requests.post(f"{up.url}/v1/load_lora_adapter", json={"lora_name": "sql-2", "lora_path": str(adapter_dir)},
                         timeout=60)
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'sql-2' added successfully.")
    assert answer(sdk, "sql-2") == answer(sdk, "sql")  # the same weights under another name
    assert [model.id for model in sdk.models.list().data][1:] == ["sql", "sql-2"]

    resp = requests.post(f"{up.url}/v1/unload_lora_adapter", json={"lora_name": "sql-2"}, timeout=60)
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'sql-2' removed successfully.")
    with pytest.raises(openai.NotFoundError) as raised:
        answer(sdk, "sql-2")
    assert (raised.value.body["code"], raised.value.body["param"]) == ("model_not_found", "model")
    assert [model.id for model in sdk.models.list().data][1:] == ["sql"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "ADAPTER"}, 400, "lora_name"),  # taken
    ("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/nonexistent/adapter"}, 400, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": "nobody"}, 404, "lora_name"),
])
def test_the_engine_s_refusals_in_openai_s_format(up, checkpoint, path, body, status, param):
    body = {key: str(checkpoint[1]) if value == "ADAPTER" else value for key, value in body.items()}
    resp = requests.post(up.url + path, json=body, timeout=60)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["message"]
