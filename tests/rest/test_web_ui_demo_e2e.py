"""The chat page in a real headless Chromium against `xserv up` on the demo model: an answer
streams in and completes, and Stop frees the engine's KV blocks (the page's abort is a client
hang-up, which makes the engine abort the request)."""

import subprocess
import time

import grpc
import pytest

from tests.support.browser import ChatPage, browser, text_of  # noqa: F401 (browser: a fixture)
from tests.support.processes import served
from xserv.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def up(browser):  # the browser first: without one the module skips before the engine starts
    with served("up", "--workers", "1", "--threads", "8", "--num-kv-blocks", "256", "--max-model-len", "1024",
                "--log-level", "warning", stdout=subprocess.PIPE, text=True) as up:
        with grpc.insecure_channel(up.grpc_address) as channel:
            yield up, engine_pb2_grpc.EngineServiceStub(channel)


@pytest.fixture
def page(browser, up):
    page = ChatPage(browser, up[0].url)
    page.open()
    return page


def model_info(up) -> engine_pb2.GetModelInfoResponse:
    return up[1].GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)


def set_max_tokens(page, count: int) -> None:
    page.by_id("settings-toggle").click()
    page.by_id("max-tokens").send_keys(str(count))
    page.by_id("settings-toggle").click()


def written(answer) -> str:
    """What the model wrote so far, thinking included."""
    return text_of(answer.find_element("css selector", ".content")) + text_of(
        answer.find_element("css selector", ".reasoning-text"))


def test_the_banner_names_the_page(up):
    banner = [up[0].process.stdout.readline() for _ in range(6)]
    assert banner[4] == f"  chat page    {up[0].url}/  (open it in a browser)\n", banner


def test_the_page_says_the_demo_model_is_random_and_how_to_serve_a_real_one(page, up):
    assert page.wait_models() == model_info(up).model_id and model_info(up).random_weights
    caveat = page.wait(lambda: page.by_id("demo-caveat").is_displayed() and page.by_id("demo-caveat"),
                       what="the demo caveat")
    assert "weights are random" in caveat.text and "random text" in caveat.text
    assert caveat.find_element("css selector", "code").text == "xserv up --model DIR"


def test_a_demo_answer_streams_in_and_completes(page, up):
    assert page.wait_models() == model_info(up).model_id
    set_max_tokens(page, 24)
    page.send("Hello!")
    answer = page.wait_finished(1, timeout_s=120)
    numbers = text_of(answer.find_element("css selector", ".numbers"))
    assert numbers.startswith("24 tokens · ") and " tokens/s · prompt " in numbers, numbers
    assert written(answer).strip() and "stopped at the token limit" in numbers
    assert page.screenshot("demo-answer.png")[0] > 50


def test_stop_frees_the_engines_kv_blocks(page, up):
    page.wait_models()
    set_max_tokens(page, 900)
    page.send("Tell me a long story")
    page.wait(lambda: page.answers() and len(written(page.answers()[0])) > 20, timeout_s=120, what="text streaming in")
    info = model_info(up)
    assert info.num_running == 1 and info.kv_blocks_free < info.kv_blocks_total
    page.by_id("stop").click()
    deadline = time.monotonic() + 3
    while (info := model_info(up)).kv_blocks_free < info.kv_blocks_total or info.num_running:
        assert time.monotonic() < deadline, f"KV blocks still held 3 s after Stop: {info.kv_blocks_free}/{info.kv_blocks_total}"
        time.sleep(0.05)
    answer = page.wait_finished(1)
    assert "Stopped." in text_of(answer) and written(answer)
