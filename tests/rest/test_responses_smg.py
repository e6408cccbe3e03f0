"""Past one front host, docs/rest.md sends /v1/responses to the SGLang Model Gateway, which keeps
the conversations itself: its Responses API over one real xserv engine (gRPC mode)."""

from openai import OpenAI
import pytest

from tests.scaleout.gateway import Gateway
from tests.scaleout.test_gateway import MODEL
from tests.server.engine_process import EngineProcess

pytestmark = pytest.mark.e2e


def test_smg_serves_responses_with_previous_response_id_over_an_xserv_engine(tmp_path):
    engine = EngineProcess("--block-size", "16", log_path=tmp_path / "engine.log")
    try:
        engine.wait_serving()
        gateway = Gateway([engine.address], "--history-backend", "memory", log_path=tmp_path / "smg.log")
        try:
            gateway.wait_ready(MODEL, workers=1, timeout=120)
            sdk = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
            first = sdk.responses.create(model=MODEL, input="Hello!", max_output_tokens=8)
            second = sdk.responses.create(model=MODEL, input="Again", previous_response_id=first.id,
                                          max_output_tokens=8)
            assert first.usage.output_tokens == 8
            # the second prompt holds the first turn (question and answer), then the new question
            assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
            assert sdk.responses.retrieve(first.id).id == first.id
        finally:
            gateway.stop()
    finally:
        engine.stop()
