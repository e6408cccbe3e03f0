"""gunicorn settings for the REST front; usable as `gunicorn -c python:xserv_rest.gunicorn_conf`.

`xserv rest` starts from these and overrides bind, workers, threads, log level and drain grace
from its flags.
"""

import math

from xserv_rest.config import RestConfig

_defaults = RestConfig()

bind = [f"{_defaults.host}:{_defaults.port}"]
# gthread: each request gets a thread. The sync worker would serve one stream per process and
# kill it at `timeout`; gthread workers heartbeat from their main loop, so a stream may run
# for as long as the engine generates. Ours closes its listeners as soon as a drain starts.
worker_class = "xserv_rest.gunicorn_worker.DrainingThreadWorker"
workers = _defaults.workers
threads = _defaults.threads
# A worker accepts no more connections than it has threads, so a connection never waits inside
# a busy worker while another has free threads (with room for more connections than threads,
# accepts bunch up on one worker and some streams wait seconds: docs/benchmarks-log.md, "Concurrency
# sweep"). The price: no idle keep-alive connections are kept.
worker_connections = threads
keepalive = 0
timeout = 60  # seconds a worker's main loop may go silent before the master restarts it
graceful_timeout = math.ceil(_defaults.drain_grace_s)  # on SIGTERM, running streams get this long (whole seconds)
loglevel = _defaults.log_level
accesslog = None  # the app logs one line per request (xserv.rest.access)
errorlog = "-"
proc_name = "xserv-rest"
# gunicorn's control socket lives at one path per user: several fronts on a host would fight over it.
control_socket_disable = True


def settings(config: RestConfig) -> dict:
    """This module's settings with config's bind, processes, threads, log level and drain grace,
    and, with a metrics directory, the hook that retires a dead worker's metric files."""
    values = {name: value for name, value in globals().items()
              if not name.startswith("_") and name not in ("settings", "RestConfig", "math")}
    values.update(bind=[f"{config.host}:{config.port}"], workers=config.workers, threads=config.threads,
                  worker_connections=config.threads, loglevel=config.log_level,
                  graceful_timeout=math.ceil(config.drain_grace_s))
    if config.metrics_dir:
        values["child_exit"] = _metrics_child_exit(config.metrics_dir)
    return values


def _metrics_child_exit(metrics_dir: str):
    def child_exit(server, worker) -> None:
        from prometheus_client import multiprocess  # the master imports it only once the dir is set

        multiprocess.mark_process_dead(worker.pid, metrics_dir)

    return child_exit
