"""Notices clients that hang up while their request waits on the engine.

A streaming response finds out on its next write, but a non-streaming one writes nothing until
the end, and a stream can sit silent in the engine's queue. So each worker process runs one
thread that watches the sockets of requests in flight (epoll) and, when a client's side reads
EOF or resets, calls that request's callback, which cancels its gRPC call.
"""

import logging
import os
import selectors
import socket
import threading
from typing import Callable

log = logging.getLogger("xserv.rest")


class DisconnectWatcher:
    """One per worker process; its thread starts on first use (after gunicorn forks)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_send: socket.socket | None = None

    def watch(self, sock: socket.socket | None, on_disconnect: Callable[[], None]) -> Callable[[], None]:
        """Call on_disconnect (on the watcher thread) if `sock`'s peer goes away; returns the
        function that stops watching. Without a socket (an in-process test client) it does nothing."""
        if sock is None or not hasattr(sock, "fileno") or sock.fileno() < 0:
            return lambda: None
        self._ensure_thread()
        key = _Watch(sock, on_disconnect)
        with self._lock:
            self._selector.register(sock, selectors.EVENT_READ, key)
        self._wake()
        return lambda: self._unwatch(key)

    def _unwatch(self, key: "_Watch") -> bool:
        """Stop watching; True if this call stopped it (so exactly one caller acts on it)."""
        with self._lock:
            if not key.active:
                return False
            key.active = False
            self._selector.unregister(key.sock)
            return True

    def _ensure_thread(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            self._selector = selectors.DefaultSelector()
            wake_recv, self._wake_send = socket.socketpair()
            wake_recv.setblocking(False)
            self._selector.register(wake_recv, selectors.EVENT_READ, None)
            threading.Thread(target=self._run, args=(self._selector, wake_recv),
                             name="xserv-disconnect-watcher", daemon=True).start()
            self._pid = os.getpid()

    def _wake(self) -> None:
        try:
            self._wake_send.send(b"\0")
        except BlockingIOError:
            pass  # already awake

    def _run(self, selector: selectors.BaseSelector, wake_recv: socket.socket) -> None:
        while True:
            for key, _ in selector.select(timeout=1.0):
                watch = key.data
                if watch is None:
                    _drain(wake_recv)
                elif not watch.active:
                    continue
                elif _peer_gone(watch.sock):
                    if self._unwatch(watch):
                        watch.on_disconnect()
                else:
                    self._unwatch(watch)  # the client sent more bytes: not ours to read


class _Watch:
    def __init__(self, sock: socket.socket, on_disconnect: Callable[[], None]):
        self.sock = sock
        self.on_disconnect = on_disconnect
        self.active = True


def _peer_gone(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ValueError:  # TLS sockets cannot peek; their clients are noticed on write only
        return False
    except OSError:
        return True


def _drain(wake_recv: socket.socket) -> None:
    try:
        while wake_recv.recv(4096):
            pass
    except BlockingIOError:
        pass
