"""The transport of `diagnose --endpoint`'s client (endpoint_client.py): a wall-clock deadline per request. urllib's
own timeout bounds each socket operation only, so a server that drips its headers or body a byte at a time would
never time out; Deadline shuts the request's socket down when the time is up, and the connections below register
their socket with it as soon as they connect."""

from __future__ import annotations

import contextlib
import functools
import http.client
import socket
import threading
import time
import urllib.request


class Deadline:
    """The wall-clock limit of one request: when `seconds` have passed, every socket it watches is shut down, which
    ends a read still waiting on it (a server that drips bytes passes every per-operation socket timeout)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def passed(self) -> bool:
        return time.monotonic() >= self.end

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
        if self.passed():
            self._expire()

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):  # socket.socket's own shutdown: for TLS too, without unwrapping
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Watched:
    """A connection whose socket its request's Deadline watches (mixed into HTTP(S)Connection)."""

    def __init__(self, *args, deadline: Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self):
        super().connect()
        self._deadline.watch(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
    pass


class DeadlineHandler:
    """Mixed into urllib's HTTP(S) handlers: their connections are _Watched by `deadline`."""

    def __init__(self, deadline: Deadline):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        watched = _WatchedHTTPS if issubclass(http_class, http.client.HTTPSConnection) else _WatchedHTTP
        return super().do_open(functools.partial(watched, deadline=self.deadline), req, **kwargs)


class WatchedHTTPHandler(DeadlineHandler, urllib.request.HTTPHandler):
    pass


class WatchedHTTPSHandler(DeadlineHandler, urllib.request.HTTPSHandler):
    pass
