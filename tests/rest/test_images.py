"""Images in chat completions: every accepted form of image_url reaches the engine as the image's
bytes, and every refused one is a 400 naming the part, quickly, with no worker left hanging."""

import base64
import http.server
import threading
import time

import falcon.testing
import pytest

from tests.support.images import png
from xserv_rest.app import create_app
from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient
from xserv_engine.media import MediaPolicy

from .conftest import make_client

RED, BLUE = png(6, 4, (255, 0, 0)), png(3, 5, (0, 0, 255))
SLOW_S = 3.0  # how long the test server's /slow.png takes to answer


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(client, *parts, role: str = "user", messages: list | None = None):
    messages = (messages or []) + [{"role": role, "content": [{"type": "text", "text": "What is this?"}, *parts]}]
    return client.simulate_post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})


def images_received(fake) -> list[bytes]:
    """The image bytes of the engine's latest Generate call, in order."""
    return [part.image.data for message in fake.engine.requests[-1].chat.messages for part in message.parts
            if part.HasField("image")]


def refusal(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json["error"]


class ImageHost(http.server.BaseHTTPRequestHandler):
    """/red.png, /blue.png, /slow.png (RED after SLOW_S), /away.png (a redirect to another host),
    /missing.png (404)."""

    def do_GET(self):
        if self.path == "/away.png":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/red.png")
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(SLOW_S)
        body = {"/red.png": RED, "/blue.png": BLUE, "/slow.png": RED}.get(self.path)
        try:
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")
        except (BrokenPipeError, ConnectionResetError):  # the front gave up on /slow.png
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "red.png").write_bytes(RED)
    (root / "secret.png").write_bytes(BLUE)
    (root / "allowed" / "link.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def media_client(fake, media_dir):
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), allowed_local_path=str(media_dir / "allowed"),
                         fetch_timeout_s=1.0, max_bytes=4096)
    return make_client(fake, media=policy)


def test_data_urls_reach_the_engine_as_the_images_bytes_in_order(client, fake):
    answer = ask(client, image(data_url(RED)), {"type": "text", "text": "and"}, image(data_url(BLUE, "image/jpeg")))
    assert answer.status_code == 200, answer.text
    assert images_received(fake) == [RED, BLUE]
    parts = fake.engine.requests[-1].chat.messages[-1].parts
    assert [part.WhichOneof("part") for part in parts] == ["text", "image", "text", "image"]
    assert parts[0].text == "What is this?" and parts[2].text == "and"


def test_an_http_url_on_an_allowed_host_is_fetched(media_client, fake, image_host):
    answer = ask(media_client, image(f"{image_host}/blue.png"))
    assert answer.status_code == 200, answer.text
    assert images_received(fake) == [BLUE]


def test_a_file_url_under_the_allowed_path_is_read(media_client, fake, media_dir):
    answer = ask(media_client, image((media_dir / "allowed" / "red.png").as_uri()))
    assert answer.status_code == 200, answer.text
    assert images_received(fake) == [RED]


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,not*base64", "base64 is invalid"),
    ("data:image/png,plain", "must be base64-encoded"),
    ("data:text/plain;base64,aGk=", "must hold an image, not text/plain"),
    ("{host}/missing.png", "HTTP 404"),
    ("http://localhost:1/red.png", "'localhost' is not in --allowed-media-domains"),
    ("{host}/away.png", "'localhost' is not in --allowed-media-domains"),  # a redirect to another host
    ("{dir}/secret.png", "not under --allowed-local-media-path"),
    ("{dir}/allowed/../secret.png", "not under --allowed-local-media-path"),
    ("{dir}/allowed/link.png", "not under --allowed-local-media-path"),  # a symbolic link out of it
    ("{dir}/allowed/none.png", "cannot read the file"),
    ("ftp://127.0.0.1/red.png", "must be a data: URL"),
    ("http://[::1/red.png", "the URL is malformed (Invalid IPv6 URL)"),
    ("{dir}/allowed/%00.png", "the URL is malformed (embedded null byte)"),
])
def test_bad_image_urls_are_400s_naming_the_part(media_client, image_host, media_dir, url, words):
    url = url.format(host=image_host, dir=media_dir.as_uri())
    error = refusal(ask(media_client, image(data_url(RED)), image(url)))
    assert error["param"] == "messages[0].content[2].image_url"
    assert words in error["message"]


def test_an_image_over_the_size_cap_is_refused_however_it_comes(media_client, fake):
    large = png(64, 64) + bytes(8192)
    error = refusal(ask(media_client, image(data_url(large))))
    assert "larger than this server's limit of 4096 bytes" in error["message"]


def test_a_slow_fetch_is_cut_at_the_timeout_and_other_requests_go_on(media_client, image_host):
    outcome = {}
    started = time.monotonic()
    slow = threading.Thread(target=lambda: outcome.update(answer=ask(media_client, image(f"{image_host}/slow.png"))))
    slow.start()
    quick = ask(media_client, image(data_url(RED)))  # while the slow one waits
    assert quick.status_code == 200 and time.monotonic() - started < 1.0
    slow.join(timeout=SLOW_S)
    assert time.monotonic() - started < 2.0  # the 1 s timeout, not the server's 3 s
    assert "took longer than 1 s" in refusal(outcome["answer"])["message"]


def test_without_the_flags_only_data_urls_are_taken(client, media_dir, image_host):
    for url, flag in ((f"{image_host}/red.png", "--allowed-media-domains"),
                      ((media_dir / "allowed" / "red.png").as_uri(), "--allowed-local-media-path")):
        error = refusal(ask(client, image(url)))
        assert flag in error["message"] and error["param"] == "messages[0].content[1].image_url"


@pytest.mark.parametrize("part, kind", [
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video_url"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
])
def test_video_audio_and_file_parts_are_refused_by_name(client, part, kind):
    error = refusal(ask(client, part))
    assert error["param"] == "messages[0].content[1]"
    assert f"is a part of type {kind}: xserv reads text and images only" in error["message"]


@pytest.mark.parametrize("reported_limit", [2, 999], ids=["refused-by-the-front", "refused-by-the-engine"])
def test_too_many_images_and_images_in_a_system_message_are_refused(fake, reported_limit, media_dir):
    """The front refuses what GetModelInfo says the model cannot take before it loads any image;
    the engine refuses it too (its limit is 2 either way), in the same words."""
    fake.engine.reported_image_limit = reported_limit
    try:
        client = make_client(fake)
        local = image((media_dir / "allowed" / "red.png").as_uri())  # refused if loaded: a later check's error
        error = refusal(ask(client, image(data_url(RED)), image(data_url(BLUE)),
                            image(data_url(RED)) if reported_limit > 2 else local))
        assert error["param"] == "messages[0].content[3]"
        assert error["message"] == ("messages[0].content[3]: at most 2 image(s) per prompt (the engine's "
                                    "--limit-mm-per-prompt)")
        error = refusal(ask(client, image(data_url(RED)), role="developer"))
        assert error["param"] == "messages[0].content[1]"
        assert error["message"].startswith("messages[0].content[1]: a system message cannot hold images")
    finally:
        fake.engine.reported_image_limit = 2


def test_a_model_that_takes_no_images_is_refused_before_any_is_loaded(fake, media_dir):
    fake.engine.reported_image_limit = 0
    try:
        client = make_client(fake)
        error = refusal(ask(client, image((media_dir / "allowed" / "red.png").as_uri())))  # no file: allowed here
        assert error["message"] == "messages[0].content[1]: the served model does not accept images"
        tokenize = client.simulate_post("/tokenize", json={"messages": [
            {"role": "user", "content": [image(data_url(RED))]}]})
        assert refusal(tokenize)["param"] == "messages[0].content[0]"
    finally:
        fake.engine.reported_image_limit = 2


def test_a_text_only_model_answers_an_image_with_a_400(demo_dir):
    """The real engine with the text-only demo checkpoint, behind the front."""
    from tests.server.harness import ServerThread
    from xserv_engine.config import EngineConfig
    from xserv_engine.engine.engine_thread import EngineThread
    from xserv_engine.engine.llm_engine import LLMEngine

    server = ServerThread()
    llm = LLMEngine(EngineConfig(model=str(demo_dir), dtype="float32", device="cpu", max_model_len=256,
                                 num_kv_blocks=32), progress=False)
    server.load(EngineThread(llm))
    try:
        config = RestConfig(engines=(f"127.0.0.1:{server.server.port}",))
        client = falcon.testing.TestClient(create_app(config, EngineClient.from_config(config)))
        error = refusal(ask(client, image(data_url(RED))))
        assert error == {"message": "messages[0].content[1]: the served model does not accept images",
                         "type": "invalid_request_error",
                         "param": "messages[0].content[1]", "code": None}
        assert ask(client).status_code == 200  # the same chat without the image is answered
    finally:
        server.close()


# -- the Responses API's input_image --

def respond(client, *parts, role: str = "user", **fields):
    body = {"input": [{"role": role, "content": [{"type": "input_text", "text": "What is this?"}, *parts]}],
            "max_output_tokens": 2, **fields}
    return client.simulate_post("/v1/responses", json=body)


def input_image(url: str, **fields) -> dict:
    return {"type": "input_image", "image_url": url, **fields}


def test_input_images_reach_the_engine_and_stay_in_the_conversation(client, fake):
    first = respond(client, input_image(data_url(RED), detail="high"), input_image(data_url(BLUE)))
    assert first.status_code == 200, first.text
    assert images_received(fake) == [RED, BLUE]
    parts = fake.engine.requests[-1].chat.messages[-1].parts
    assert [part.WhichOneof("part") for part in parts] == ["text", "image", "image"]
    later = client.simulate_post("/v1/responses", json={"input": "And now?", "previous_response_id": first.json["id"],
                                                         "max_output_tokens": 2})
    assert later.status_code == 200, later.text
    assert images_received(fake) == [RED, BLUE]  # the earlier turn's images, sent again


@pytest.mark.parametrize("part, role, param, words", [
    ({"type": "input_file", "file_id": "file-1"}, "user", "input[0].content[1]", "is a part of type input_file"),
    ({"type": "input_image", "file_id": "file-1"}, "user", "input[0].content[1].image_url", "required"),
    (input_image(data_url(RED), file_id="file-1"), "user", "input[0].content[1].file_id", "no file store"),
    (input_image(data_url(RED)), "assistant", "input[0]", "an assistant message, which cannot hold images"),
    (input_image("data:image/png;base64,@@"), "user", "input", "base64 is invalid"),
    (input_image("https://example.com/cat.png"), "user", "input", "--allowed-media-domains"),
    (input_image(data_url(RED)), "system", "input", "input: a system message cannot hold images"),
])
def test_bad_input_images_are_400s(client, part, role, param, words):
    error = refusal(respond(client, part, role=role))
    assert error["param"] == param and words in error["message"]
