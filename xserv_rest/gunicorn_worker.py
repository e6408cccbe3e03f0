"""gunicorn's gthread worker, with a prompt refusal while it drains.

On SIGTERM gthread stops accepting but keeps its listening sockets open until its last stream
ends, so a new connection would wait unanswered in the kernel backlog for up to the whole
grace period. Closing them as soon as the worker stops accepting makes new connections fail
at once (clients and load balancers retry elsewhere) while running streams finish.
"""

from gunicorn.workers.gthread import ThreadWorker


class DrainingThreadWorker(ThreadWorker):
    def set_accept_enabled(self, enabled: bool) -> None:
        super().set_accept_enabled(enabled)
        if not enabled and not self.alive:
            for sock in self.sockets:
                sock.close()
