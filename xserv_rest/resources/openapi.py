"""GET /openapi.json: the OpenAPI 3.1 document of this server's API (xserv_rest/openapi.py)."""

import falcon

from xserv_rest.config import RestConfig
from xserv_rest.openapi import openapi_document


class OpenApi:
    def __init__(self, config: RestConfig):
        self.document = openapi_document(config)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.document
