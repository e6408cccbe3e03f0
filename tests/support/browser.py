"""Headless Chromium for the chat page's tests: Debian's chromium and chromium-driver, driven by
selenium. `missing()` says why a browser test cannot run here; `headless_chromium()` starts one
with an empty profile and stops it when the block ends."""

import base64
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.processes import REPO

ARTIFACTS = Path(REPO) / ".cache" / "test-artifacts" / "web-ui"  # screenshots, kept after the run
# What a closed network needs: without these Chromium keeps trying to reach Google's hosts.
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,900"]


def executables() -> tuple[str | None, str | None]:
    return shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


def missing() -> str | None:
    """Why no browser test can run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    chromium, driver = executables()
    if chromium is None or driver is None:
        return "no headless Chromium: install Debian's chromium and chromium-driver (.ci/run does)"
    return None


@contextmanager
def headless_chromium(profile: Path) -> Iterator["selenium.webdriver.Chrome"]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = executables()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, for failures
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium for a test module (modules import this fixture); skips where none is."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    with headless_chromium(tmp_path_factory.mktemp("chromium-profile")) as browser:
        yield browser


class ChatPage:
    """The chat page at `url` in `browser`, as a person uses it: type, send, stop, read."""

    def __init__(self, browser, url: str):
        self.browser = browser
        self.url = url

    def open(self, fresh: bool = True) -> None:
        """Loads the page; `fresh`: with nothing in local storage (no conversations, no key)."""
        self.browser.get(self.url + "/")
        if fresh:
            self.browser.execute_script("localStorage.clear()")
            self.browser.get(self.url + "/")

    def by_id(self, element_id: str):
        return self.browser.find_element("id", element_id)

    def all(self, selector: str) -> list:
        return self.browser.find_elements("css selector", selector)

    def wait(self, condition, timeout_s: float = 20, what: str = ""):
        """condition()'s first truthy value, polled until `timeout_s`."""
        from selenium.webdriver.support.wait import WebDriverWait

        message = f"{what or 'condition'} not met; the page's console: {self.browser.get_log('browser')}"
        return WebDriverWait(self.browser, timeout_s, poll_frequency=0.05).until(lambda _: condition(), message)

    def wait_models(self) -> str:
        """The model the page picked, once /v1/models answered."""
        return self.wait(lambda: self.by_id("model").get_attribute("value"), what="a model picked")

    def type(self, text: str) -> None:
        """Sets the message box as typing would (newlines included, which Enter would send)."""
        box = self.by_id("input")
        self.browser.execute_script("arguments[0].value = arguments[1]", box, text)

    def send(self, text: str) -> None:
        self.type(text)
        self.by_id("send").click()

    def answers(self) -> list:
        return self.all("#messages .message.assistant")

    def wait_finished(self, count: int, timeout_s: float = 20):
        """The `count`-th answer once it has finished (its numbers or its error shown)."""
        def finished():
            if not self.by_id("send").is_displayed():  # first: the last redraw comes with it
                return None
            answers = self.answers()
            done = len(answers) >= count and answers[count - 1].find_elements("css selector", ".stats > *")
            return answers[count - 1] if done else None
        return self.wait(finished, timeout_s, f"answer {count} finished")

    def screenshot(self, name: str) -> tuple[int, float]:
        """Saves the page as ARTIFACTS/name; (distinct colours, share of pixels unlike the most
        common one) of the saved PNG, decoded by the browser in a blank tab."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        assert self.browser.save_screenshot(str(path))
        self.browser.switch_to.new_window("tab")
        try:
            return self.browser.execute_async_script(COUNT_COLOURS, base64.b64encode(path.read_bytes()).decode())
        finally:
            self.browser.close()
            self.browser.switch_to.window(self.browser.window_handles[0])


COUNT_COLOURS = """
const [data, done] = arguments;
const image = new Image();
image.onload = () => {
  const canvas = document.createElement("canvas");
  [canvas.width, canvas.height] = [image.width, image.height];
  const context = canvas.getContext("2d");
  context.drawImage(image, 0, 0);
  const pixels = new Uint32Array(context.getImageData(0, 0, image.width, image.height).data.buffer);
  const counts = new Map();
  for (const p of pixels) counts.set(p, (counts.get(p) ?? 0) + 1);
  done([counts.size, 1 - Math.max(...counts.values()) / pixels.length]);
};
image.src = "data:image/png;base64," + data;"""


def text_of(element) -> str:
    """All the text in an element, shown or folded away."""
    return element.get_attribute("textContent")
