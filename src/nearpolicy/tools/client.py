"""A synchronous MCP client for the episode loop: one stdio server process kept open, each tool call answered
with an Observation, whatever happens to the tool.

The MCP SDK is async (anyio): the session lives in one task of an event loop on a background thread, which enters
and leaves the client's context itself (anyio's cancel scopes must be exited by the task that entered them) and
serves calls from a queue. A call that times out, a server that dies or answers garbage, an unknown tool: an
Observation with `error` set and the reason as its text; the next call starts a new server when the old one is
gone. Counted in `errors` (by kind) for the run's metrics."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SERVER = (sys.executable, "-m", "nearpolicy.tools.server")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding this nearpolicy package
_CLOSE = object()  # a session's queue item: leave the MCP context (which ends the server)


@dataclass(frozen=True)
class Observation:
    """What the model is shown after a tool call: `text`; `error` is None for a good result, else its kind
    (tool_error: the tool reported a failure; timeout; server_died; protocol: garbage or a transport failure)."""

    text: str
    error: str | None = None


class ToolClient:
    """Tools of one MCP stdio server `command` (default: nearpolicy's own, tools/server.py). `call_timeout_s`
    bounds each call (wall clock); `start_timeout_s` the server's start; `env`: the server's environment variables
    (the SDK's minimal set plus these). Thread-safe; close() ends the server."""

    def __init__(self, command: tuple[str, ...] = DEFAULT_SERVER, *, call_timeout_s: float = 10.0,
                 start_timeout_s: float = 30.0, env: dict[str, str] | None = None):
        self.command, self.call_timeout_s, self.start_timeout_s = tuple(command), call_timeout_s, start_timeout_s
        # the SDK starts a server with a minimal environment; nearpolicy's own server runs this very package
        self.env = env if env is not None or tuple(command) != DEFAULT_SERVER else {"PYTHONPATH": _PACKAGE_ROOT}
        self.errors: Counter = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="nearpolicy-mcp")
        self._thread.start()
        self._session: _Session | None = None  # the session new calls go to
        self._sessions: list[_Session] = []  # every session not yet ended, for close()
        self._lock = threading.Lock()
        self._closed = False

    def tool_names(self) -> list[str]:
        """The server's tools (starts it if needed). Raises RuntimeError when it cannot start."""
        names = self._submit(("list", None, None), self.start_timeout_s)
        if not isinstance(names, list):
            raise RuntimeError(f"MCP server {' '.join(self.command)} did not answer: {names}")
        return names

    def call(self, name: str, arguments: dict) -> Observation:
        """Call tool `name` with `arguments`; never raises for what the tool or its server does (RuntimeError after
        close()). A call still queued when its server ended for another call's sake runs on the next server."""
        for _ in range(3):
            result = self._call_once(name, arguments)
            if not isinstance(result, _NotStarted):
                return result
        return self._failed("server_died", "error: the tool server kept ending before this call could run")

    def _call_once(self, name: str, arguments: dict):
        if self._closed:
            raise RuntimeError("this ToolClient is closed")
        try:
            result = self._submit(("call", name, arguments), self.call_timeout_s + self.start_timeout_s)
        except FutureTimeout:  # the server did not even start or answer the session: a new one next time
            self._restart()
            return self._failed("timeout", f"error: the tool server did not answer within "
                                           f"{self.call_timeout_s + self.start_timeout_s:g} s")
        if isinstance(result, _NotStarted):
            return result
        if isinstance(result, Observation):
            if result.error:
                self.errors[result.error] += 1
            return result
        kind = "server_died" if isinstance(result, _SessionEnded) else "protocol"
        return self._failed(kind, f"error: the tool server failed ({result})")

    def close(self, timeout_s: float = 15.0) -> None:
        """End every server this client started (each session leaves its MCP context, which closes the server's
        stdin, then terminates and kills its process group: the SDK's shutdown), then the event loop."""
        if self._closed:
            return
        self._closed = True
        self._restart()
        deadline = time.monotonic() + timeout_s
        for session in self._sessions:
            try:
                session.task.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - ended with an error or not in time: the loop goes anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # -- the session task ----------------------------------------------------------------------
    def _failed(self, kind: str, text: str) -> Observation:
        self.errors[kind] += 1
        return Observation(text, kind)

    def _submit(self, request: tuple, timeout_s: float):
        with self._lock:
            session = self._session
            if session is None or session.ending or session.task.done():
                session = self._session = _Session()
                session.task = asyncio.run_coroutine_threadsafe(self._serve(session), self._loop)
                self._sessions = [s for s in self._sessions if not s.task.done()] + [session]
            answer: Future = Future()
            self._loop.call_soon_threadsafe(self._enqueue, session, request, answer)
        return answer.result(timeout=timeout_s)

    def _enqueue(self, session: "_Session", request, answer: Future) -> None:
        if session.ending or session.task.done():
            answer.set_result(session.unsent())
        elif session.queue is None:  # the session task has not started yet: keep the order
            self._loop.call_soon(self._enqueue, session, request, answer)
        else:
            session.queue.put_nowait((request, answer))

    def _restart(self) -> None:
        """The current session ends after the call in hand (a close request behind it in its queue)."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.ending = True
            self._loop.call_soon_threadsafe(lambda: session.queue and session.queue.put_nowait((_CLOSE, None)))

    async def _serve(self, session: "_Session") -> None:
        """One server process and its MCP session, answering queued calls until a call times out or fails, the
        server dies, or the session is cancelled (each of which ends this session and its server)."""
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters

        session.queue, pending = asyncio.Queue(), []
        try:
            params = StdioServerParameters(command=self.command[0], args=list(self.command[1:]), env=self.env)
            async with Client(params) as client:
                session.connected = True
                while not (session.ending and session.queue.empty()):  # ended before its close request could queue
                    request, answer = await session.queue.get()
                    if request is _CLOSE:
                        return
                    (kind, name, arguments), pending = request, [answer]
                    try:
                        result = await self._answer(client, kind, name, arguments)
                    except Exception as err:  # noqa: BLE001 - the transport failed under the call
                        closed = "closed" in str(err).lower()
                        result = (_SessionEnded if closed else _Protocol)(f"{type(err).__name__}: {err}")
                    failed = not isinstance(result, (Observation, list)) or result_error(result) == "timeout"
                    session.ending = session.ending or failed
                    answer.set_result(result)
                    pending = []
                    if failed:
                        return  # leaving the context ends this server; the next call starts a new one
        except BaseException as err:  # noqa: BLE001 - the server could not start or died, or we were cancelled
            session.reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            session.ending = True
            ended = _SessionEnded(session.reason)
            for answer in pending:
                if not answer.done():
                    answer.set_result(ended)
            if not isinstance(err, Exception):
                raise
        finally:
            session.ending = True
            for _, answer in _drain(session.queue):  # calls queued behind: run them on the next server
                if answer is not None and not answer.done():
                    answer.set_result(session.unsent())

    async def _answer(self, client, kind: str, name, arguments):
        if kind == "list":
            return [tool.name for tool in (await client.list_tools()).tools]
        try:
            result = await asyncio.wait_for(client.call_tool(name, arguments), self.call_timeout_s)
        except asyncio.TimeoutError:
            return Observation(f"error: the tool {name} did not answer within {self.call_timeout_s:g} s", "timeout")
        text = "\n".join(getattr(part, "text", "") for part in result.content)
        if result.is_error or text.startswith("error:"):
            return Observation(text if text.startswith("error:") else f"error: {text}", "tool_error")
        return Observation(text)


class _SessionEnded(str):
    """The session ended under a call (the server died or could not start); the text says how."""


class _NotStarted(str):
    """The session ended before this queued call was sent: the caller runs it on the next session."""


class _Protocol(str):
    """A live session answered with something that is not a tool result."""


@dataclass
class _Session:
    """One server process's session: its call queue (set by its task), the task, whether it is ending."""

    queue: asyncio.Queue | None = None
    task: Future | None = None
    ending: bool = False
    reason: str = "the tool session ended"  # why it ended, for calls that arrive after
    connected: bool = False  # the server started and answered the MCP handshake

    def unsent(self) -> str:
        """What a call this session never sent gets: run it on the next server, unless this one never started."""
        return _NotStarted(self.reason) if self.connected else _SessionEnded(self.reason)


def result_error(result) -> str | None:
    return result.error if isinstance(result, Observation) else None


def _drain(queue: asyncio.Queue | None) -> list:
    items = []
    while queue is not None and not queue.empty():
        items.append(queue.get_nowait())
    return items
