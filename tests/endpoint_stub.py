"""Test helpers for `diagnose --endpoint`: an in-process OpenAI-style /v1/completions stub whose answers a test
controls (a function of the request), a stub engine that samples from a transformers model with known log-prob
offsets, a proxy that rewrites requests on their way to a real server, and a managed server process (free port,
readiness probe with a deadline, killed with its process group on exit)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_stub(handle):
    """Serve `handle(method, path, body dict | None) -> (status, payload)` (payload: dict -> JSON, bytes as is,
    ("sleep", seconds, payload), ("cut", bytes): that much of a longer body, then the connection closes, or
    ("close",): the connection closes with no answer) on a free port; yields the base URL and the list of requests
    (method, path, body)."""
    requests: list[tuple[str, str, dict | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            requests.append((method, self.path, body))
            status, payload = handle(method, self.path, body)
            if isinstance(payload, tuple) and payload[0] == "sleep":
                time.sleep(payload[1])
                payload = payload[2]
            self.close_connection = isinstance(payload, tuple)
            if payload == ("close",):
                return
            data = payload[1] if isinstance(payload, tuple) else payload
            data = data if isinstance(data, bytes) else json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data) + (1000 if isinstance(payload, tuple) else 0)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(data)

        def do_GET(self):
            self._answer("GET")

        def do_POST(self):
            self._answer("POST")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield url, requests
    finally:
        server.shutdown()
        server.server_close()


class StubEngine:
    """Samples from `model` (a transformers causal LM) like a vLLM server with ids in and out: at `temperature`
    (None: the request's) with raw log-probs reported as log p + `offset` (nats), top-k raw log-probs, seeded by the
    request's seed. `fail_after`: answer that many completions, then HTTP 500."""

    def __init__(self, model, tokenizer, offset: float = 0.0, temperature: float | None = None,
                 fail_after: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.offset, self.temperature, self.fail_after = offset, temperature, fail_after
        self.answered = 0
        self.lock = threading.Lock()

    def __call__(self, method: str, path: str, body: dict | None):
        if path.endswith("/models"):
            return 200, {"object": "list", "data": [{"id": "stub"}]}
        with self.lock:
            if self.fail_after is not None and self.answered >= self.fail_after:
                return 500, {"error": {"message": "engine crashed"}}
            self.answered += 1
            return 200, self._complete(body)

    def _complete(self, body: dict) -> dict:
        import torch

        generator = torch.Generator().manual_seed(int(body["seed"]))
        temperature = self.temperature or body["temperature"]
        ids, out, lps, tops = list(body["prompt"]), [], [], []
        with torch.no_grad():
            for _ in range(body["max_tokens"]):
                logits = self.model(torch.tensor([ids])).logits[0, -1].double()
                raw = torch.log_softmax(logits, -1)
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
                top = torch.topk(raw, body["logprobs"]).indices.tolist()
                tops.append({f"token_id:{i}": float(raw[i]) + self.offset for i in {*top, token}})
                lps.append(float(raw[token]) + self.offset)
                ids.append(token)
                out.append(token)
        text = self.tokenizer.decode(out, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return {"choices": [{"index": 0, "text": text, "finish_reason": "length", "token_ids": out,
                             "prompt_token_ids": list(body["prompt"]),
                             "logprobs": {"tokens": [f"token_id:{t}" for t in out], "token_logprobs": lps,
                                          "top_logprobs": tops, "text_offset": [0] * len(out)}}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(out)}}


@contextlib.contextmanager
def rewriting_proxy(upstream: str, changes: dict):
    """A proxy to `upstream` that sets `changes` in every /v1/completions request body: a server (or gateway) that
    samples with other settings than the client asked for."""

    def handle(method: str, path: str, body: dict | None):
        if path.endswith("/completions") and body is not None:
            body = body | changes
        request = urllib.request.Request(upstream + path, method=method, headers={"Content-Type": "application/json"},
                                         data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    with http_stub(handle) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(command: list[str], port: int, log_path: Path, ready_s: float, env: dict | None = None):
    """Start `command` (a server listening on `port`) in its own process group, wait until GET /v1/models answers
    (at most `ready_s` seconds; a server that exits or never answers fails with its log's tail), yield its URL, and
    stop the whole group on exit (SIGTERM, then SIGKILL after 15 s)."""
    log = open(log_path, "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env=os.environ | (env or {}))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited with {process.returncode}: {log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"server not ready after {ready_s} s: {log_path.read_text()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)
        log.close()
