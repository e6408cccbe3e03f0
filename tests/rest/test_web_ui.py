"""The chat page's files as the front serves them (in process); tests/rest/test_web_ui_browser.py
drives the page itself in headless Chromium."""

import re

from .conftest import make_client
from .test_auth import parse
from xserv_rest import cli


def csp_of(resp) -> dict[str, str]:
    policy = resp.headers["Content-Security-Policy"]
    return {part.split()[0]: part.split(" ", 1)[1] for part in policy.split("; ")}


def test_the_page_and_its_files_come_with_a_strict_policy(client):
    page = client.simulate_get("/")
    assert page.status_code == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    policy = csp_of(page)
    assert policy["script-src"] == "'self'" and policy["default-src"] == "'none'"
    assert policy["img-src"] == "'self' data:"  # attached images are shown from data: URLs, nothing remote
    assert "unsafe" not in page.headers["Content-Security-Policy"]
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert "<script>" not in page.text and not re.search(r"\son\w+=", page.text)  # no inline script or handler
    for name in re.findall(r'(?:src|href)="/web/([^"]+)"', page.text):
        served = client.simulate_get(f"/web/{name}")
        assert served.status_code == 200 and served.headers["Content-Security-Policy"], name
    assert client.simulate_get("/web/chat.js").headers["Content-Type"] == "text/javascript; charset=utf-8"


def test_a_real_model_gets_no_demo_caveat_and_the_demo_model_does(client, fake):
    """The page shows #demo-caveat (hidden until then) for the cards that say random_weights
    (tests/rest/test_web_ui_demo_e2e.py sees it in Chromium on the demo model)."""
    assert re.search(r'<p id="demo-caveat"[^>]* hidden>', client.simulate_get("/").text)
    assert [card["random_weights"] for card in client.simulate_get("/v1/models").json["data"]] == [False]
    fake.engine.random_weights = True
    try:
        assert [card["random_weights"] for card in client.simulate_get("/v1/models").json["data"]] == [True]
    finally:
        fake.engine.random_weights = False


def test_unknown_files_are_404(client):
    for path in ("/web/nothing.js", "/web/index.html", "/web/../app.py", "/index.html"):
        assert client.simulate_get(path).status_code == 404, path


def test_the_page_opens_without_the_api_key_and_the_api_still_needs_it(fake):
    locked = make_client(fake, api_keys=("sesame",))
    for path in ("/", "/web/chat.js", "/web/chat.css"):
        assert locked.simulate_get(path).status_code == 200, path
    assert locked.simulate_get("/v1/models").status_code == 401
    assert locked.simulate_get("/web/nothing.js").status_code == 404


def test_no_web_ui_turns_the_page_off(fake):
    config = cli.config_from_args(parse("--no-web-ui"))
    assert not config.web_ui and cli.config_from_args(parse()).web_ui
    off = make_client(fake, web_ui=False)
    assert off.simulate_get("/").status_code == 404 and off.simulate_get("/web/chat.js").status_code == 404
    assert off.simulate_get("/v1/models").status_code == 200
