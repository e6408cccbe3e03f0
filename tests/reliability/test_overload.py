"""More concurrent requests than the engine queue holds, through the real `xserv up` started with
a gRPC token (which it hands to the engine and the front alike): some get 429 with Retry-After,
the others complete, nothing hangs."""

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from xserv.v1 import engine_pb2

from .processes import completion, running_up, wait_blocks_free

pytestmark = pytest.mark.e2e

CONCURRENT = 16
TOKEN = "overload-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    directory = tmp_path_factory.mktemp("up")
    (directory / "token").write_text(TOKEN + "\n")
    with running_up(directory / "up.log", "--max-num-seqs", "1", "--max-queued-requests", "2",
                    "--grpc-token-file", str(directory / "token")) as process:
        yield process


def test_the_engine_wants_the_token_and_the_front_has_it(up):
    with pytest.raises(grpc.RpcError) as info:
        up.engine.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert up.engine.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5, metadata=AUTH).kv_blocks_total == 256
    assert completion(up.url, max_tokens=2).status_code == 200


def test_overload_gets_429_with_retry_after_and_the_rest_complete(up):
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        responses = list(pool.map(lambda i: completion(up.url, max_tokens=24, seed=i), range(CONCURRENT)))
    elapsed = time.monotonic() - started
    statuses = collections.Counter(r.status_code for r in responses)
    print(f"overload: {CONCURRENT} at once -> {dict(statuses)} in {elapsed:.1f} s")
    assert set(statuses) == {200, 429}
    for response in responses:
        if response.status_code == 429:
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["choices"][0]["finish_reason"] == "length"
    assert elapsed < 120
    info = wait_blocks_free(up.engine, timeout_s=5, metadata=AUTH)
    assert info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0
