"""GET /: the chat page, and its files under /web/, read once from the package (xserv_rest/web).

Every answer carries a Content-Security-Policy that allows scripts, styles and requests from this
server only: no inline script, no event-handler attribute, nothing remote; images also from data:
URLs (the pictures a person attaches, shown from the browser's own copy). The page builds model
output with textContent, never innerHTML; the policy is the second wall.
"""

from importlib import resources

import falcon

CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
PAGE = "index.html"


def read_web_files() -> dict[str, bytes]:
    """name -> bytes of each file the page is made of."""
    folder = resources.files("xserv_rest") / "web"
    return {item.name: item.read_bytes() for item in folder.iterdir()
            if item.is_file() and item.name[item.name.rfind("."):] in MEDIA_TYPES}


class WebUi:
    def __init__(self):
        self.files = read_web_files()

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._send(resp, PAGE)

    def on_get_file(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        if name not in self.files or name == PAGE:
            raise falcon.HTTPNotFound()
        self._send(resp, name)

    def _send(self, resp: falcon.Response, name: str) -> None:
        resp.data = self.files[name]
        resp.content_type = MEDIA_TYPES[name[name.rfind("."):]]
        resp.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Referrer-Policy", "no-referrer")
        resp.cache_control = ["no-cache"]  # a new xserv's page, not a stale one, after an upgrade


def add_web_ui_routes(app: falcon.App) -> None:
    web_ui = WebUi()
    app.add_route("/", web_ui)
    app.add_route("/web/{name}", web_ui, suffix="file")
