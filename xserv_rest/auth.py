"""API keys: with --api-key / --api-key-file, every route needs "Authorization: Bearer <key>"
except /health, /metrics and /openapi.json, which stay open (probes and scrapers carry no key), as
in vLLM, and the chat page (/ and /web/...), which holds no data and asks for the key itself. Unlike vLLM, which guards only /v1, the tokenizer, rerank and score routes are guarded
too: they run the engine.
"""

import hmac

import falcon

from xserv_rest.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", ""})  # "": the page, at /
OPEN_PREFIX = "/web/"  # the page's scripts and styles


class ApiKeyCheck:
    def __init__(self, api_keys: tuple[str, ...]):
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.path.rstrip("/") in OPEN_PATHS or req.path.startswith(OPEN_PREFIX):
            return
        given = req.get_header("Authorization")
        if given is None:
            raise _unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer YOUR_KEY'.")
        # Compared in constant time, and against every key, so timing tells nothing about them.
        matches = [hmac.compare_digest(given.encode("utf-8", "replace"), key) for key in self.expected]
        if not any(matches):
            raise _unauthorized("Incorrect API key provided.")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
