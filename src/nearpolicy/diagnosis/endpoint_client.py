"""A client of an OpenAI-compatible `/v1/completions` server (vLLM, llama-cpp-python's server, SGLang, ...) that
samples with per-token log-probs for `nearpolicy diagnose --endpoint` (diagnosis/endpoint.py; docs/diagnose.md).

Token-in/token-out where the server allows it: the prompt goes as a list of token ids (vLLM accepts it; a server
that refuses it, such as llama-cpp-python's, whose `prompt` is text only, gets the prompt's text and every later
request goes as text, recorded as `prompt_sent_as = "text"`), and the sampled ids come back from `token_ids`
(vLLM's `return_token_ids`) or from tokens spelled `token_id:N` (vLLM's `return_tokens_as_token_ids`); a server that
returns neither gives token strings (`pieces`), which diagnosis/endpoint_tokens.py maps to ids. The sampler's
every knob is sent explicitly (temperature, top-p, top-k, min-p 0, repetition penalties 1), since servers fill
what a request leaves out with their own defaults (llama-cpp-python: temperature 0.8, top-k 40, min-p 0.05,
repeat penalty 1.1; vLLM: the model's generation_config.json).

Every failure raises EndpointError with a `cause` ("unreachable", "timeout", "http", "no_logprobs", "malformed",
"truncated", "model") and a message naming it; nothing partial is returned. An HTTP error whose message is about
log-probs (llama-cpp-python started with --logits_all false, more top log-probs than vLLM's --max-logprobs) is
"no_logprobs"; a connection closed before or during the answer is "truncated". `--timeout` bounds each request's
wall-clock time, headers and body included (endpoint_transport.Deadline: urllib's own timeout bounds each socket operation only, so a
server that drips bytes would never time out). Whatever the server sends is checked before it is used: a field of
the wrong type, a log-prob above 0 (beyond LOGPROB_ROUNDING), +inf or NaN, a token id that is negative, a bool or
absurd (>= MAX_TOKEN_ID) is "malformed", never an exception of another kind. Stdlib only (urllib, threads).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nearpolicy.diagnosis.endpoint_transport import Deadline, WatchedHTTPHandler, WatchedHTTPSHandler

ENGINE_ZERO = -9000.0  # a listed log-prob at or below this is "probability 0" (vLLM writes -9999.0 for -inf)
LOGPROB_ROUNDING = 1e-4  # nats a log-prob may lie above 0 by rounding; more is not a log-prob ("malformed")
MAX_TOKEN_ID = 1 << 24  # no tokenizer has this many ids (the largest hold about 2**18): a bigger one is not an id
_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


class EndpointError(RuntimeError):
    """The endpoint could not be measured; `cause` names why (module docstring). Never carries a measurement."""

    def __init__(self, cause: str, message: str):
        super().__init__(f"endpoint {cause}: {message}")
        self.cause = cause


@dataclass(frozen=True)
class SampleRequest:
    """One completion to draw: prompt ids (and their text, sent when the server takes text only), the sampler the
    client claims, its seed, and how many top log-probs to ask for."""

    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    prompt_text: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    top_logprobs: int
    stop_ids: tuple[int, ...]


@dataclass
class EndpointSample:
    """What the server returned for one SampleRequest. `completion_ids` [T] when the server gave ids (else None and
    `pieces` [T] holds its token strings); `logprobs` [T] the server's log-prob of each returned token (nats; None
    where it sent none); `top` [T] the listed log-probs per position, keyed by id (int) or, from a text-only server,
    by token string; `prompt_echo` the prompt ids the server reports it ran (None when it does not say)."""

    request: SampleRequest
    text: str
    completion_ids: list[int] | None
    pieces: list[str] | None
    logprobs: list[float | None]
    top: list[dict]
    finish_reason: str
    prompt_sent_as: str
    prompt_echo: list[int] | None = None
    usage: dict = field(default_factory=dict)


class EndpointClient:
    """HTTP client of one server. `url`: the server's base (`http://host:port` or `.../v1`); `timeout_s`: seconds
    per request (connect and read); `api_key`: sent as a Bearer token when given."""

    def __init__(self, url: str, timeout_s: float = 120.0, api_key: str | None = None):
        if not re.match(r"^https?://", url):
            raise ValueError(f"--endpoint {url!r}: expected an http:// or https:// URL")
        base = url.rstrip("/")
        self.v1 = base if base.endswith("/v1") else base + "/v1"
        self.root = self.v1[: -len("/v1")]
        self.timeout_s, self.api_key = timeout_s, api_key
        self.prompt_as_text = False

    def _call(self, method: str, url: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.api_key}"}
                                                          if self.api_key else {})
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        deadline = Deadline(self.timeout_s)
        opener = urllib.request.build_opener(WatchedHTTPHandler(deadline), WatchedHTTPSHandler(deadline))
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            message = _server_message(err)  # its body is read within the deadline too
            if deadline.passed():
                raise self._timed_out(method, url) from None
            raise EndpointError("http", f"{method} {url} answered HTTP {err.code}: {message}") from None
        except (OSError, http.client.HTTPException) as err:  # urllib.error.URLError is an OSError
            raise self._failure(method, url, err, deadline.passed()) from None
        finally:
            deadline.cancel()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: arrays or objects nested too deep to parse
            raise EndpointError("malformed", f"{method} {url} answered something that is not JSON: "
                                             f"{raw[:200]!r}") from None

    def _timed_out(self, method: str, url: str) -> EndpointError:
        return EndpointError("timeout", f"{method} {url} gave no complete answer within {self.timeout_s:g} s "
                                        "(--timeout)")

    def _failure(self, method: str, url: str, err: Exception, expired: bool) -> EndpointError:
        """The EndpointError of a request that raised `err`; `expired`: its deadline had passed (the watchdog shut
        the socket, whatever error the read then gave)."""
        reason = err.reason if isinstance(err, urllib.error.URLError) else err
        if expired or isinstance(reason, TimeoutError):  # socket.timeout is TimeoutError
            return self._timed_out(method, url)
        if isinstance(err, urllib.error.URLError):
            if isinstance(reason, ConnectionResetError):  # accepted, then closed without an answer
                return EndpointError("truncated", f"{method} {url}: the server closed the connection without an "
                                                  f"answer ({reason})")
            return EndpointError("unreachable", f"{method} {url}: {reason} (is a server listening there? "
                                                "docs/diagnose.md shows the llama_cpp.server and vLLM commands)")
        if isinstance(err, (OSError, http.client.IncompleteRead)):  # reset or closed mid-answer
            return EndpointError("truncated", f"{method} {url}: the connection broke mid-answer ({err!r})")
        return EndpointError("malformed", f"{method} {url}: not an HTTP answer ({err!r})")

    def models(self) -> list[str]:
        """The model names GET /v1/models lists. Raises EndpointError (unreachable, timeout, http, malformed)."""
        listing = self._call("GET", f"{self.v1}/models")
        try:
            return [str(m["id"]) for m in listing["data"]]
        except (KeyError, TypeError):
            raise EndpointError("malformed", f"GET {self.v1}/models: no data[].id in {str(listing)[:200]}") from None

    def server_tokenize(self, text: str) -> list[int] | None:
        """The server's own token ids of `text` where it offers a tokenize route (llama-cpp-python's
        POST /extras/tokenize, vLLM's POST /tokenize); None where neither answers."""
        for url, body in ((f"{self.root}/extras/tokenize", {"input": text}),
                          (f"{self.root}/tokenize", {"prompt": text, "add_special_tokens": False})):
            try:
                answer = self._call("POST", url, body)
            except EndpointError:
                continue
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if isinstance(tokens, list) and all(_is_id(t) for t in tokens):
                return tokens
        return None

    def sample(self, model: str, request: SampleRequest) -> EndpointSample:
        """Draw one completion. Sends ids first; on the first refusal that names the prompt, switches to text for
        this and every later request. Raises EndpointError (see the module docstring)."""
        if not self.prompt_as_text:
            try:
                return self._sample(model, request, as_text=False)
            except EndpointError as err:
                if err.cause != "http" or "prompt" not in str(err).lower():
                    raise
                self.prompt_as_text = True
        return self._sample(model, request, as_text=True)

    def sample_all(self, model: str, requests: list[SampleRequest], concurrency: int = 4,
                   on_sample=lambda: None) -> list[EndpointSample]:
        """Every request, `concurrency` at a time (the first alone, to settle ids vs text), in request order. Any
        failure raises EndpointError and nothing is returned."""
        if not requests:
            return []
        first = self.sample(model, requests[0])
        on_sample()

        def one(r: SampleRequest) -> EndpointSample:
            out = self.sample(model, r)
            on_sample()
            return out

        pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
        futures = [pool.submit(one, r) for r in requests[1:]]
        try:
            return [first, *(f.result() for f in futures)]
        finally:  # on a failure the queued requests are dropped, not sent
            pool.shutdown(wait=True, cancel_futures=True)

    def _sample(self, model: str, r: SampleRequest, as_text: bool) -> EndpointSample:
        body = {"model": model, "prompt": r.prompt_text if as_text else list(r.prompt_ids), "max_tokens": r.max_tokens,
                "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "min_p": 0.0, "typical_p": 1.0,
                "repetition_penalty": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "seed": r.seed, "n": 1, "logprobs": r.top_logprobs, "echo": False, "stream": False,
                "stop_token_ids": list(r.stop_ids), "skip_special_tokens": False,
                "spaces_between_special_tokens": False, "return_token_ids": True, "return_tokens_as_token_ids": True}
        try:
            answer = self._call("POST", f"{self.v1}/completions", body)
        except EndpointError as err:  # a server that refuses log-probs says so in an HTTP error
            said = str(err).lower()
            if err.cause == "http" and "logprob" in said and "prompt" not in said:
                raise EndpointError("no_logprobs", f"the server refused per-token log-probs ({err}); "
                                    "llama-cpp-python needs --logits_all true, vLLM --max-logprobs >= --top-logprobs") \
                    from None
            raise
        return parse_choice(answer, r, "text" if as_text else "ids")


def _server_message(err: urllib.error.HTTPError) -> str:
    try:
        body = err.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return str(err.reason)
    try:
        parsed = json.loads(body)
        inner = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        message = inner.get("message") or inner.get("detail") if isinstance(inner, dict) else inner
        body = str(message or parsed)
    except (ValueError, RecursionError):
        pass
    return " ".join(body.split())[:400]


def parse_choice(answer: dict, r: SampleRequest, sent_as: str) -> EndpointSample:
    """The EndpointSample of a /v1/completions answer to request `r`. Raises EndpointError: `no_logprobs` when the
    answer carries no per-token log-probs, `malformed` when a field has the wrong type, the fields disagree in
    length, a log-prob is not one (a non-number, NaN, +inf, or above 0 by more than LOGPROB_ROUNDING) or a token id is
    not one (negative, a bool, >= MAX_TOKEN_ID), `truncated` when the completion ended for another reason than a stop
    or the token limit, or holds fewer tokens than the limit that ended it or than its usage reports. A sampled
    token's log-prob of None, -inf or <= ENGINE_ZERO is kept as None / -inf: endpoint.py counts it as missing."""
    where = f"prompt {r.prompt_index} sample {r.sample_index}"
    try:
        choice = answer["choices"][0]
        text = choice.get("text")
        logprobs = choice.get("logprobs")
        finish = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise EndpointError("malformed", f"{where}: no choices[0] in the answer {str(answer)[:200]}") from None
    if not (logprobs is None or isinstance(logprobs, dict)):
        raise EndpointError("malformed", f"{where}: choices[0].logprobs is not an object: {str(logprobs)[:80]}")
    if not logprobs or logprobs.get("token_logprobs") is None:
        raise EndpointError("no_logprobs", f"{where}: the server returned no per-token log-probs (asked for "
                                           f"logprobs={r.top_logprobs}); llama-cpp-python needs logits_all=True, "
                                           "vLLM --max-logprobs >= the number asked")
    text = "" if text is None else text
    values, usage = logprobs["token_logprobs"], {} if answer.get("usage") is None else answer["usage"]
    tokens, tops = logprobs.get("tokens") or [], logprobs.get("top_logprobs") or [None] * _length(values)
    for name, value, kind, called in (("token_logprobs", values, list, "a list"), ("tokens", tokens, list, "a list"),
                                      ("text", text, str, "a string"), ("top_logprobs", tops, list, "a list"),
                                      ("usage", usage, dict, "an object")):
        if not isinstance(value, kind):
            raise EndpointError("malformed", f"{where}: {name} is not {called}: {str(value)[:80]}")
    if not all(isinstance(t, str) for t in tokens):
        raise EndpointError("malformed", f"{where}: tokens holds something other than strings: {str(tokens)[:80]}")
    ids = _completion_ids(choice.get("token_ids"), tokens, where)
    n = len(ids) if ids is not None else len(tokens)
    if not (len(values) == len(tops) == n) or (tokens and len(tokens) != n):
        raise EndpointError("malformed", f"{where}: {n} tokens but {len(values)} log-probs and {len(tops)} "
                                         "top-log-prob entries")
    _check_complete(finish, n, r, usage, where)
    return EndpointSample(r, text, ids, None if ids is not None else [str(t) for t in tokens],
                          [_number(v, where) for v in values], [_top_entries(t, where) for t in tops], finish,
                          sent_as, _ids_or_none(choice.get("prompt_token_ids")), usage)


def _length(value) -> int:
    return len(value) if isinstance(value, list) else 0


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_TOKEN_ID


def _token_id(key: str, where: str) -> int | None:
    """The id N of a token spelled `token_id:N` (vLLM's return_tokens_as_token_ids), None for any other string;
    a negative or absurd N is malformed."""
    m = _TOKEN_ID.match(key)
    if m is None:
        return None
    if len(m.group(1)) > 9 or not _is_id(int(m.group(1))):  # 9 digits: int() of a huge string is slow or refused
        raise EndpointError("malformed", f"{where}: {key[:40]!r} is not a token id (0 <= id < {MAX_TOKEN_ID})")
    return int(m.group(1))


def _completion_ids(token_ids, tokens: list, where: str) -> list[int] | None:
    if token_ids is not None:
        if not (isinstance(token_ids, list) and all(_is_id(t) for t in token_ids)):
            raise EndpointError("malformed", f"{where}: token_ids holds something other than token ids "
                                             f"(0 <= id < {MAX_TOKEN_ID}): {str(token_ids)[:80]}")
        return list(token_ids)
    matched = [_token_id(t, where) for t in tokens]
    if tokens and all(m is not None for m in matched):
        return matched
    return None


def _check_complete(finish, n: int, r: SampleRequest, usage: dict, where: str) -> None:
    if finish not in ("stop", "length"):
        raise EndpointError("truncated", f"{where}: finish_reason {finish!r} (expected 'stop' or 'length'): the "
                                         "completion was cut short")
    if finish == "length" and n < r.max_tokens:
        raise EndpointError("truncated", f"{where}: finish_reason 'length' after {n} of {r.max_tokens} tokens")
    if n > r.max_tokens:
        raise EndpointError("malformed", f"{where}: {n} tokens returned, more than max_tokens {r.max_tokens}")
    reported = usage.get("completion_tokens")
    if _is_id(reported) and reported not in (n, n + 1):  # + 1: a server that drops the stop token
        raise EndpointError("truncated", f"{where}: usage says {reported} completion tokens, the answer holds {n}")


def _number(value, where: str) -> float | None:
    """A log-prob the server sent (nats): None kept, <= ENGINE_ZERO (vLLM's -9999.0 for -inf) as -inf; anything
    that is not a log-prob raises EndpointError("malformed")."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise EndpointError("malformed", f"{where}: log-prob {value!r} is not a number")
    if value > LOGPROB_ROUNDING:  # +inf too
        raise EndpointError("malformed", f"{where}: log-prob {value!r} is above 0: not a log-prob")
    return float(value) if value > ENGINE_ZERO else -math.inf


def _top_entries(top, where: str) -> dict:
    if top is None:
        return {}
    if not isinstance(top, dict):
        raise EndpointError("malformed", f"{where}: top_logprobs entry {str(top)[:80]} is not an object")
    out = {}
    for key, value in top.items():
        i = _token_id(key, where)
        out[key if i is None else i] = _number(value, where)
    return out


def _ids_or_none(values) -> list[int] | None:
    return list(values) if isinstance(values, list) and all(_is_id(v) for v in values) else None
