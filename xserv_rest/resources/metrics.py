"""GET /metrics: Prometheus text format, all gunicorn workers added up."""

import falcon

from xserv_rest.metrics import CONTENT_TYPE, Metrics


class MetricsResource:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE
        resp.data = self.metrics.exposition()
