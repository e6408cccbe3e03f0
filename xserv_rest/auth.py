"""API keys: with --api-key / --api-key-file, every /v1 route needs "Authorization: Bearer <key>".

/health, /metrics and /openapi.json stay open (probes and scrapers carry no key), as in vLLM.
"""

import hmac

import falcon

from xserv_rest.errors import ApiError

PROTECTED_PREFIX = "/v1/"


class ApiKeyCheck:
    def __init__(self, api_keys: tuple[str, ...]):
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not (req.path + "/").startswith(PROTECTED_PREFIX):
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
