"""The chat page in a real headless Chromium, against `xserv rest` in front of the scripted fake
engine (fake_grpc_engine.py), whose answers are known: what a person sees and what reaches the
engine. tests/rest/test_web_ui_demo_e2e.py does the same against `xserv up` on the demo model."""

import base64
import subprocess
import sys

import pytest

from tests.support.browser import ChatPage, browser, text_of  # noqa: F401 (browser: a fixture)
from tests.support.images import png
from tests.support.processes import REPO, free_port, served, stop_process, wait_http_ok
from .fake_grpc_engine import MODEL_ID

pytestmark = pytest.mark.e2e


@pytest.fixture
def page(browser, front):
    page = ChatPage(browser, front)
    page.open()
    assert page.wait_models() == MODEL_ID
    return page


def last_request(fake, after: int):
    """The Generate request the page sent after the fake had `after` requests."""
    return fake.engine.requests[after]


def test_a_model_with_real_weights_gets_no_demo_caveat(page):
    assert not page.by_id("demo-caveat").is_displayed()


def test_a_message_streams_in_and_completes(page, fake):
    before = len(fake.engine.requests)
    page.send("Say hello")
    answer = page.wait_finished(1)
    assert answer.find_element("css selector", ".content").text == "Hello world"
    assert text_of(answer.find_element("css selector", ".numbers")).startswith("4 tokens · ")
    assert "prompt 7 tokens" in text_of(answer)
    request = last_request(fake, before)
    assert request.chat.messages[-1].content == "Say hello" and request.chat.enable_thinking
    assert [m.text for m in page.all("#messages .message.user .text")] == ["Say hello"]


def test_stop_mid_stream_cancels_the_engine_call_and_keeps_what_came(page, fake):
    before = len(fake.engine.requests)
    page.send("Count slow")
    page.wait(lambda: "t2" in text_of(page.answers()[0]), what="three tokens streamed in")
    assert page.by_id("stop").is_displayed() and not page.by_id("send").is_displayed()
    page.by_id("stop").click()
    request_id = last_request(fake, before).request_id
    assert fake.engine.wait_cancelled(request_id, timeout_s=5) is not None, "the engine call went on"
    answer = page.wait_finished(1)
    assert "Stopped." in text_of(answer) and text_of(answer.find_element("css selector", ".content")).startswith("t0 t1 t2")


def test_reasoning_is_folded_away_and_the_tool_call_shows(page):
    page.send("What is the weather in Paris? tools")
    answer = page.wait_finished(1)
    thinking = answer.find_element("css selector", "details.thinking")
    reasoning = thinking.find_element("css selector", ".reasoning-text")
    assert thinking.get_attribute("open") is None and not reasoning.is_displayed()
    assert text_of(reasoning) == "I should call the tool."
    thinking.find_element("css selector", "summary").click()
    assert reasoning.is_displayed() and reasoning.text == "I should call the tool."
    call = answer.find_element("css selector", ".tool-call")
    assert call.find_element("css selector", ".tool-name").text == "Tool call get_weather"
    assert '"city": "Paris"' in call.find_element("css selector", "pre").text
    assert answer.find_element("css selector", ".content").text == ""


INJECTION = ('<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script> '
             '[click](javascript:window.pwned=3) <b>bold?</b> echo')


def test_markup_in_the_answer_and_the_question_stays_text(page):
    page.send(INJECTION)
    answer = page.wait_finished(1)
    said = INJECTION[:-len("echo")].strip()
    assert answer.find_element("css selector", ".content").text == said
    assert page.all("#messages img, #messages script, #messages b, #messages a") == []
    assert page.all("#messages .message.user .text")[0].text == INJECTION
    assert page.browser.execute_script("return window.pwned") is None


MARKDOWN = """# Plan
Some **bold**, *italic* and `code`, and [a link](https://example.com/x).

1. first
2. second

```python
print("<b>hi</b>")
```

| a | b |
|---|---|
| 1 | 2 |
echo"""


def test_markdown_and_code_blocks_are_rendered(page):
    page.send(MARKDOWN)
    content = page.wait_finished(1).find_element("css selector", ".content")
    assert content.find_element("css selector", "h1").text == "Plan"
    assert [e.text for e in content.find_elements("css selector", "p strong, p em, p code")] == ["bold", "italic", "code"]
    link = content.find_element("css selector", "a")
    assert (link.text, link.get_attribute("href"), link.get_attribute("rel")) == (
        "a link", "https://example.com/x", "noopener noreferrer")
    assert [li.text for li in content.find_elements("css selector", "ol li")] == ["first", "second"]
    code = content.find_element("css selector", ".code-block pre code")
    assert text_of(code) == 'print("<b>hi</b>")' and code.get_attribute("data-language") == "python"
    assert [td.text for td in content.find_elements("css selector", "table td")] == ["1", "2"]


def test_settings_reach_the_engine(page, fake):
    page.by_id("settings-toggle").click()
    page.by_id("system-prompt").send_keys("You are terse.")
    for field, value in (("temperature", "0.3"), ("top-p", "0.9"), ("max-tokens", "3")):
        page.by_id(field).send_keys(value)
    page.by_id("thinking").click()
    before = len(fake.engine.requests)
    page.send("Hi")
    answer = page.wait_finished(1)
    request = last_request(fake, before)
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "You are terse."), ("user", "Hi")]
    assert request.params.max_tokens == 3 and request.chat.enable_thinking is False
    assert request.params.temperature == pytest.approx(0.3) and request.params.top_p == pytest.approx(0.9)
    assert answer.find_element("css selector", ".content").text == "Hello wor"
    assert "stopped at the token limit" in text_of(answer)
    page.open(fresh=False)  # settings outlive a reload
    assert page.by_id("max-tokens").get_attribute("value") == "3" and not page.by_id("thinking").is_selected()


def test_history_goes_with_each_turn_and_the_last_question_can_be_edited(page, fake):
    page.send("first")
    page.wait_finished(1)
    page.send("second")
    page.wait_finished(2)
    assert len(page.all("#messages .message.user .edit")) == 1  # on the last question only
    page.all("#messages .message.user")[-1].find_element("css selector", ".edit").click()
    editor = page.browser.find_element("css selector", "#messages .editor")
    editor.clear()
    editor.send_keys("second, edited echo")
    before = len(fake.engine.requests)
    page.browser.find_element("css selector", "#messages .send-edit").click()
    answer = page.wait_finished(2)
    assert answer.find_element("css selector", ".content").text == "second, edited"
    assert [m.text for m in page.all("#messages .message.user .text")] == ["first", "second, edited echo"]
    assert len(page.answers()) == 2
    request = last_request(fake, before)
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("user", "first"), ("assistant", "Hello world"), ("user", "second, edited echo")]


def test_conversations_are_kept_in_the_browser(page):
    page.send("remember me")
    page.wait_finished(1)
    page.open(fresh=False)
    page.wait(lambda: page.answers(), what="the conversation back after a reload")
    assert page.all("#messages .message.user .text")[0].text == "remember me"
    page.by_id("new-chat").click()
    assert page.answers() == []
    page.send("another")
    page.wait_finished(1)
    titles = [e.text for e in page.all("#conversations .open")]
    assert titles == ["another", "remember me"]
    page.all("#conversations .open")[1].click()
    assert page.all("#messages .message.user .text")[0].text == "remember me"
    page.all("#conversations .delete")[1].click()
    assert [e.text for e in page.all("#conversations .open")] == ["another"]


@pytest.mark.parametrize("ending, shown", [
    ("error:unavailable", "Service unavailable (503): the engine is unavailable"),
    ("error:invalid", "Bad request (400): "),
    ("error:internal", "Server error (500): internal server error"),
    ("midstream", "Service unavailable (503): "),
])
def test_errors_are_shown_in_words(page, ending, shown):
    page.send(f"Hi {ending}")
    answer = page.wait_finished(1)
    assert answer.find_element("css selector", ".error").text.startswith(shown)
    assert "secret stack detail" not in text_of(answer)


def test_an_engine_that_is_down_is_said_so(browser):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "xserv_cli", "rest", "--engine", f"127.0.0.1:{free_port()}",
                                "--port", str(port), "--workers", "1", "--threads", "4", "--log-level", "warning"],
                               cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/", process, timeout_s=30)
        page = ChatPage(browser, url)
        page.open()
        status = page.by_id("server-status")
        page.wait(lambda: "unavailable" in status.text, what="the status naming the engine")
        assert status.text.startswith("Cannot list the models. Service unavailable (503): the engine is unavailable")
        page.send("Hi")
        assert page.wait_finished(1).find_element("css selector", ".error").text.startswith(
            "Service unavailable (503): the engine is unavailable")
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def locked_front(fake):
    with served("rest", "--engine", fake.address, "--workers", "1", "--threads", "8", "--api-key", "sesame",
                "--log-level", "warning", timeout_s=30) as front:
        yield front.url


def give_key(page, key: str) -> None:
    dialog = page.by_id("key-dialog")
    page.wait(dialog.is_displayed, what="the API key prompt")
    page.by_id("key-input").send_keys(key)
    page.by_id("key-save").click()


def test_the_page_asks_for_the_api_key_and_works_with_it(browser, locked_front, fake):
    page = ChatPage(browser, locked_front)
    page.open()
    give_key(page, "wrong")
    page.wait(lambda: "Incorrect API key" in page.by_id("key-reason").text, what="the key refused")
    give_key(page, "sesame")
    assert page.wait_models() == MODEL_ID and not page.by_id("key-dialog").is_displayed()
    page.send("Hi")
    assert page.wait_finished(1).find_element("css selector", ".content").text == "Hello world"
    page.browser.execute_script("localStorage.setItem('xserv.chat.apiKey', 'stale')")
    page.send("again")  # a key that stops working: the prompt again, then the answer
    give_key(page, "sesame")
    assert page.wait_finished(2).find_element("css selector", ".content").text == "Hello world"


def test_the_page_loads_nothing_from_elsewhere(page):
    page.send("Hi")
    page.wait_finished(1)
    names = page.browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert names and all(name.startswith(page.url + "/") for name in names), names
    assert page.browser.get_log("browser") == []  # no script error, no policy violation


def test_a_screenshot_of_a_finished_answer(page):
    page.send(MARKDOWN)
    page.wait_finished(1)
    colours, unlike_background = page.screenshot("finished-answer.png")
    assert colours > 50 and unlike_background > 0.05, (colours, unlike_background)


PASTE = """
const [box, data] = arguments;
const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
box.dispatchEvent(new ClipboardEvent("paste", { clipboardData: transfer, bubbles: true, cancelable: true }));"""
SIZE = "return [arguments[0].naturalWidth, arguments[0].naturalHeight]"


def paste(page, data: bytes) -> None:
    page.browser.execute_script(PASTE, page.by_id("input"), base64.b64encode(data).decode())


def previews(page, count: int) -> list:
    return page.wait(lambda: (lambda shown: shown if len(shown) == count else None)(page.all("#attachments img")),
                     what=f"{count} image(s) waiting to be sent")


def test_attached_and_pasted_images_are_shown_and_sent(page, fake, tmp_path):
    red, blue = png(6, 4, (255, 0, 0)), png(3, 5, (0, 0, 255))
    (tmp_path / "red.png").write_bytes(red)
    page.by_id("attach").send_keys(str(tmp_path / "red.png"))
    previews(page, 1)
    paste(page, blue)
    paste(page, png(2, 2))
    page.all("#attachments .remove")[2].click()  # the last one, changed my mind
    previews(page, 2)
    before = len(fake.engine.requests)
    page.send("What are these?")
    page.wait_finished(1)
    parts = last_request(fake, before).chat.messages[-1].parts
    assert [part.image.data for part in parts[:2]] == [red, blue] and parts[2].text == "What are these?"
    assert not page.by_id("attachments").is_displayed()
    shown = page.all("#messages .message.user .images img")
    assert [page.browser.execute_script(SIZE, image) for image in shown] == [[6, 4], [3, 5]]  # decoded, not blocked
    page.open(fresh=False)
    page.wait(lambda: page.answers(), what="the conversation back after a reload")
    assert len(page.all("#messages .message.user .images img")) == 2


def test_an_image_the_server_refuses_is_explained(page):
    for _ in range(3):  # the fake engine takes at most 2
        paste(page, png())
    previews(page, 3)
    page.send("Too many?")
    answer = page.wait_finished(1)
    assert "Bad request (400): messages[0].content[2]: at most 2 image(s) per prompt" in text_of(answer)


def test_an_image_alone_is_a_message(page, fake):
    paste(page, png(5, 5))
    previews(page, 1)
    before = len(fake.engine.requests)
    page.by_id("send").click()  # no text: the image is the question
    page.wait_finished(1)
    parts = last_request(fake, before).chat.messages[-1].parts
    assert [part.WhichOneof("part") for part in parts] == ["image"] and parts[0].image.data == png(5, 5)
    assert [e.text for e in page.all("#conversations .open")] == ["Image"]
