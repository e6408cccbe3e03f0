"""The WSGI entry point for running the front under the gunicorn CLI directly:

    gunicorn -c python:xserv_rest.gunicorn_conf 'xserv_rest.wsgi:application(engine="127.0.0.1:50051")'

`xserv rest` does the same programmatically (xserv_rest/cli.py). Here /metrics shows the worker
that answers only, unless PROMETHEUS_MULTIPROC_DIR is set and metrics_dir names it.
"""

import falcon

from xserv_rest.app import create_app
from xserv_rest.config import DEFAULT_ENGINE, RestConfig, parse_engines
from xserv_rest.engine_client import EngineClient


def application(engine: str = DEFAULT_ENGINE, **options) -> falcon.App:
    """An app factory; `options` are other RestConfig fields (max_body_bytes=..., api_keys=(...)...)."""
    config = RestConfig(engines=parse_engines(engine), **options)
    return create_app(config, EngineClient.from_config(config))
