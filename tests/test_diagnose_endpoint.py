"""`nearpolicy diagnose --endpoint` against in-process stub servers: the client's protocol handling and every error it
names (no log-probs, a different tokenizer, truncated or malformed answers, timeouts, an unreachable server), and the
whole measurement on a stub engine whose log-probs are the reference's plus a known offset, so k3 is known exactly.
The real servers (llama-cpp-python's, vLLM's) are in tests/test_diagnose_endpoint_servers.py."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time

import pytest
from endpoint_stub import StubEngine, free_port, http_stub

from nearpolicy.diagnosis.endpoint_client import MAX_TOKEN_ID, EndpointClient, EndpointError, SampleRequest
from nearpolicy.diagnosis.endpoint_tokens import piece_index, resolve

REQUEST = SampleRequest(0, 0, (1, 9690, 198), "<|im_start|>user\n", 3, 1.0, 1.0, 0, 7, 2, (0, 2, 4))


def _choice(ids=(28, 253, 2), text=None, finish="stop", logprobs=True, usage=None, tokenizer=None):
    text = text if text is not None else (tokenizer.decode(list(ids)) if tokenizer else "x")
    lp = {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids),
          "top_logprobs": [{f"token_id:{i}": -0.5, "token_id:17": -1.5} for i in ids]} if logprobs else None
    answer = {"choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}]}
    if usage is not None:
        answer["usage"] = usage
    return answer


def _sample(answer, timeout_s: float = 5.0):
    with http_stub(lambda method, path, body: (200, answer)) as (url, _):
        return EndpointClient(url, timeout_s).sample("m", REQUEST)


def _error(answer, status: int = 200, timeout_s: float = 5.0) -> EndpointError:
    with http_stub(lambda method, path, body: (status, answer)) as (url, _):
        with pytest.raises(EndpointError) as err:
            EndpointClient(url, timeout_s).sample("m", REQUEST)
    return err.value


def test_ids_go_in_and_come_out_and_every_sampler_knob_is_sent():
    with http_stub(lambda method, path, body: (200, _choice(usage={"completion_tokens": 3}))) as (url, requests):
        s = EndpointClient(url + "/v1/").sample("m", REQUEST)
    body = requests[0][2]
    assert requests[0][1] == "/v1/completions" and body["prompt"] == [1, 9690, 198]
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["repetition_penalty"],
            body["repeat_penalty"], body["seed"], body["n"], body["logprobs"]) == (1.0, 1.0, 0, 0.0, 1.0, 1.0, 7, 1, 2)
    assert body["stop_token_ids"] == [0, 2, 4] and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert s.completion_ids == [28, 253, 2] and s.pieces is None and s.prompt_sent_as == "ids"
    assert s.logprobs == [-0.5] * 3 and s.top[0] == {28: -0.5, 17: -1.5}


def test_a_server_that_refuses_id_prompts_gets_text_from_then_on():
    def handle(method, path, body):
        if isinstance(body["prompt"], list):
            return 422, {"error": {"message": "prompt: Input should be a valid string"}}
        return 200, {"choices": [{"text": "ab", "finish_reason": "length", "logprobs": {
            "tokens": ["a", "b", "c"], "token_logprobs": [-1.0, -9999.0, -0.1], "top_logprobs": [{"a": -1.0}] * 3}}]}

    with http_stub(handle) as (url, requests):
        client = EndpointClient(url)
        first, second = client.sample("m", REQUEST), client.sample("m", REQUEST)
    assert [type(r[2]["prompt"]).__name__ for r in requests] == ["list", "str", "str"]
    assert requests[1][2]["prompt"] == "<|im_start|>user\n"
    assert first.prompt_sent_as == second.prompt_sent_as == "text" and first.completion_ids is None
    assert first.pieces == ["a", "b", "c"] and first.logprobs[1] == -math.inf  # vLLM's -9999: probability 0


@pytest.mark.parametrize("answer, cause, words", [
    (_choice(logprobs=False), "no_logprobs", "no per-token log-probs"),
    (b"<html>bad gateway</html>", "malformed", "not JSON"),
    ({"object": "error"}, "malformed", "no choices[0]"),
    (_choice(finish=None), "truncated", "cut short"),
    (_choice(finish="length", ids=(28, 253)), "truncated", "after 2 of 3 tokens"),
    (_choice(usage={"completion_tokens": 9}), "truncated", "usage says 9"),
    (_choice(ids=(28, 253, 2, 5)), "malformed", "more than max_tokens"),
])
def test_bad_answers_are_errors_that_name_their_cause(answer, cause, words):
    err = _error(answer)
    assert err.cause == cause and words in str(err)


def test_a_connection_closed_before_or_during_the_answer_is_truncated():
    body = json.dumps(_choice()).encode()
    cut = _error(("cut", body[: len(body) // 2]))
    assert cut.cause == "truncated" and "mid-answer" in str(cut)
    closed = _error(("close",))
    assert closed.cause == "truncated" and "closed" in str(closed).lower()


def _with(path: tuple, value):
    """_choice() with the field at `path` (keys / indices from the answer down) set to `value`."""
    answer = _choice()
    *parents, last = path
    node = answer
    for key in parents:
        node = node[key]
    node[last] = value
    return answer


LP = ("choices", 0, "logprobs")


@pytest.mark.parametrize("answer, words", [
    (_with(LP + ("token_logprobs",), [-0.5, 2.0, -0.5]), "2.0 is above 0"),  # the reviewer's 2.0, 5.0, 1e308: exit 1
    (_with(LP + ("token_logprobs",), [-0.5, 1e308, -0.5]), "above 0"),
    (_with(LP + ("token_logprobs",), [-0.5, math.inf, -0.5]), "inf is above 0"),  # was silently dropped
    (_with(LP + ("token_logprobs",), [-0.5, math.nan, -0.5]), "not a number"),
    (_with(LP + ("token_logprobs",), [-0.5, True, -0.5]), "True is not a number"),
    (_with(LP + ("top_logprobs",), [{"token_id:28": 5.0}] * 3), "5.0 is above 0"),
    (_with(LP, [{"token_logprobs": [-0.5] * 3}]), "logprobs is not an object"),  # was AttributeError: internal
    (_with(LP, "token_logprobs"), "logprobs is not an object"),
    (_with(LP + ("token_logprobs",), "-0.5"), "token_logprobs is not a list"),
    (_with(("usage",), [3]), "usage is not an object"),
    (_with(("choices", 0, "text"), 7), "text is not a string"),
    (_with(LP + ("top_logprobs",), [{"token_id:1000000000": -0.5}] * 3), "'token_id:1000000000' is not a token id"),
    (_with(LP + ("tokens",), ["token_id:28", "token_id:-1", "token_id:2"]), "'token_id:-1' is not a token id"),
    (_with(("choices", 0, "token_ids"), [True, 253, 2]), "token_ids holds something other than token ids"),
    (_with(("choices", 0, "token_ids"), [28, MAX_TOKEN_ID, 2]), "token_ids holds something other than token ids"),
    (b"[" * 100_000, "not JSON"),  # was RecursionError in json.loads: internal
])
def test_answers_of_the_wrong_type_or_impossible_values_are_malformed(answer, words):
    """Never a traceback or `internal`, and never a verdict: a log-prob above 0 once gave exit 1 "rejected"."""
    err = _error(answer)
    assert err.cause == "malformed" and words in str(err)


def test_an_id_the_reference_vocabulary_lacks_is_a_tokenizer_mismatch_even_in_the_top_log_probs(smollm2_tokenizer):
    vocab = len(smollm2_tokenizer)
    answer = _choice(tokenizer=smollm2_tokenizer)
    answer["choices"][0]["logprobs"]["top_logprobs"] = [{f"token_id:{vocab + 7}": -0.5}] * 3  # was IndexError later
    listed = _sample(answer)
    with pytest.raises(EndpointError, match=rf"outside the reference vocabulary \[0, {vocab}\)") as err:
        resolve([listed], smollm2_tokenizer, {0, 2, 4})
    assert err.value.cause == "tokenizer"


@pytest.mark.parametrize("drip", ["body", "headers"])
def test_a_server_that_drips_its_answer_times_out_on_the_wall_clock(drip):
    """--timeout is per request: urllib's timeout bounds each socket read, which a byte every 0.2 s never trips."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)  # the thread ends even if no client comes
    done = threading.Event()

    def serve():
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(5)
            connection.recv(65536)  # the request
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            if drip == "body":
                connection.sendall(head)
            for byte in (head if drip == "headers" else b" " * 1000)[:25]:  # 5 s, then it closes
                if done.wait(0.2):
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:  # the client gave up
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(EndpointError) as err:
            EndpointClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0).models()
        elapsed = time.monotonic() - t0
    finally:
        done.set()
        thread.join(timeout=2)
        listener.close()
    assert err.value.cause == "timeout" and "within 1 s" in str(err.value)
    assert 0.9 < elapsed < 2.0 and not thread.is_alive()


def test_lengths_that_disagree_are_malformed():
    answer = _choice()
    answer["choices"][0]["logprobs"]["token_logprobs"].pop()
    assert _error(answer).cause == "malformed"


def test_http_errors_carry_the_servers_message_and_slow_servers_time_out():
    err = _error({"error": {"message": "engine overloaded"}}, 503)
    assert err.cause == "http" and "engine overloaded" in str(err) and "HTTP 503" in str(err)
    # llama-cpp-python started with --logits_all false; vLLM asked for more than --max-logprobs
    err = _error({"error": {"message": "logprobs is not supported for models created with logits_all=False"}}, 500)
    assert err.cause == "no_logprobs" and "logits_all=False" in str(err) and "HTTP 500" in str(err)
    err = _error({"error": {"message": "Requested sample logprobs of 21, which is greater than max allowed: 20"}}, 400)
    assert err.cause == "no_logprobs" and "max allowed: 20" in str(err)
    err = _error(("sleep", 2.0, _choice()), timeout_s=0.5)
    assert err.cause == "timeout" and "0.5 s" in str(err)
    with pytest.raises(EndpointError) as down:
        EndpointClient(f"http://127.0.0.1:{free_port()}").models()
    assert down.value.cause == "unreachable" and "is a server listening there?" in str(down.value)


def test_a_server_with_another_tokenizer_is_refused(smollm2_tokenizer):
    good = _sample(_choice(tokenizer=smollm2_tokenizer))
    resolved, identity = resolve([good], smollm2_tokenizer, {0, 2, 4})
    assert resolved[0].completion_ids == [28, 253, 2] and identity.text_disagreements == 0
    other = _sample(_choice(text="completely different words"))
    with pytest.raises(EndpointError, match="different tokenizer") as err:
        resolve([other, other], smollm2_tokenizer, {0, 2, 4})
    assert err.value.cause == "tokenizer"
    strings = _sample({"choices": [{"text": "", "finish_reason": "length", "logprobs": {
        "tokens": ["\u4e2d\u6587\u5b57", "\u00ff\u00fe", "zzqx\u0101"], "token_logprobs": [-1.0] * 3,
        "top_logprobs": [{}] * 3}}]})
    with pytest.raises(EndpointError, match="vocabulary"):
        resolve([strings], smollm2_tokenizer, {0, 2, 4})


def test_token_strings_map_to_ids_only_where_one_id_spells_them(smollm2_tokenizer):
    index = piece_index(smollm2_tokenizer)
    ids = smollm2_tokenizer("The sum is 7.", add_special_tokens=False)["input_ids"]
    assert [index[smollm2_tokenizer.decode([i])] for i in ids] == ids
    assert "" not in index and not any("\ufffd" in p for p in index)
    assert index["<|im_end|>"] == 2  # HF spells special tokens; llama.cpp prints them as "", which maps to nothing


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _diagnose(tiny_model_dir, url, tmp_path, *extra):
    cmd = [sys.executable, "-m", "nearpolicy", "diagnose", "--endpoint", url, "--model", str(tiny_model_dir),
           "--set", "sampling.max_new_tokens=12", "--set", "logging.progress=false", "--set", "run.threads=1",
           "--prompts", "3", "--group", "4", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
           "--top-logprobs", "3", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return done, json.loads((tmp_path / "r.json").read_text())


@pytest.mark.slow  # three CLI runs of the tiny model
def test_known_offsets_give_known_k3_and_a_hotter_sampler_is_caught(tiny, tiny_model_dir, tmp_path):
    model, tokenizer = tiny
    with http_stub(StubEngine(model, tokenizer)) as (url, _):
        honest, report = _diagnose(tiny_model_dir, url, tmp_path / "honest")
    assert honest.returncode == 0, honest.stderr[-3000:]
    row = report["endpoint_row"]
    assert report["verdict"] == "admitted" and row["tokens"] == 144 and row["k3"] < 1e-9
    assert report["checks"]["distribution"]["kl_lower"] < 1e-9 and report["checks"]["distribution"]["top1_agree"] == 1
    assert report["retokenization"]["ids_from"] == "server ids" and report["retokenization"]["prompt_sent_as"] == "ids"
    assert "| endpoint: stub |" in honest.stdout and "endpoint admitted" in honest.stdout
    # every engine log-prob 0.1 nats above the reference's: log r = -0.1, k3 = e^-0.1 - 1 + 0.1 at every token
    with http_stub(StubEngine(model, tokenizer, offset=0.1)) as (url, _):
        shifted, report = _diagnose(tiny_model_dir, url, tmp_path / "shifted", "--budget-k3", "1e-3")
    assert shifted.returncode == 1 and report["verdict"] == "rejected"
    assert report["endpoint_row"]["k3"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-4)
    assert report["endpoint_row"]["k1"] == pytest.approx(0.1, rel=1e-4)
    # the server samples at 2.0 while the client claims 1.0; its raw log-probs still match the reference's exactly
    with http_stub(StubEngine(model, tokenizer, temperature=2.0)) as (url, _):
        hot, report = _diagnose(tiny_model_dir, url, tmp_path / "hot")
    assert hot.returncode == 1 and report["endpoint_row"]["k3"] < 1e-9
    assert not report["checks"]["sampler"]["passed"] and report["checks"]["sampler"]["z"] < -4
    assert any("temperature" in reason for reason in report["reasons"])


@pytest.mark.slow  # two in-process diagnoses of the tiny model (about 20 s)
def test_the_reference_scores_at_the_runs_trainer_precision(tiny, tiny_model_dir, tmp_path):
    """An fp32 server holding the reference's own weights: at trainer_precision = fp32 the mismatch is float rounding;
    at bf16 the reference's body runs under autocast, as the run's trainer would, and the bf16 error shows in the
    mismatch, while the checks of the server's sampler still compare it with the exact fp32 model."""
    from nearpolicy.config.schema import load_config
    from nearpolicy.diagnosis.endpoint import EndpointSettings, run_endpoint_diagnosis
    from nearpolicy.diagnosis.run import DiagnoseSettings

    model, tokenizer = tiny
    diff = {}
    with http_stub(StubEngine(model, tokenizer)) as (url, _):
        for precision in ("fp32", "bf16"):
            cfg = load_config(None, [f"model.path='{tiny_model_dir}'", "sampling.max_new_tokens=12", "run.threads=1",
                                     "logging.progress=false", f"algorithm.trainer_precision={precision}"])
            diagnose = DiagnoseSettings(prompts=2, group_size=4, out=str(tmp_path / precision), progress=False)
            report, _ = run_endpoint_diagnosis(cfg, EndpointSettings(url, top_logprobs=3, diagnose=diagnose),
                                               log=lambda _: None)
            diff[precision] = report["endpoint_row"]["abs_logprob_diff_p90"]  # |reference - server|, nats
            exact = report["checks"]["distribution"]  # the sampler checks judge the server against the fp32 model
            assert exact["kl_lower"] < 1e-9 and exact["top1_agree"] == 1 and report["checks"]["sampler"]["passed"]
    assert diff["fp32"] < 1e-5  # measured 1.9e-6 fp32, 0.048 bf16
    assert diff["bf16"] > 1e-3


def _mutated(engine: StubEngine, mutate):
    """`engine`'s handler with each /v1/completions answer's choices[0].logprobs passed through `mutate` first."""

    def handle(method, path, body):
        status, answer = engine(method, path, body)
        if path.endswith("/completions") and status == 200:
            mutate(answer["choices"][0]["logprobs"])
        return status, answer

    return handle


def _blank(value, first: int | None = None):
    def mutate(lp):
        lp["token_logprobs"][:first] = [value] * len(lp["token_logprobs"][:first])
    return mutate


@pytest.mark.slow  # four CLI runs of the tiny model
@pytest.mark.parametrize("mutate, code, cause, words", [
    (_blank(None), 2, "no_logprobs", "only 0 of 48 sampled tokens carry a finite log-prob"),  # was exit 0, 0 tokens
    (_blank(-math.inf), 2, "no_logprobs", "only 0 of 48 sampled tokens"),
    (_blank(-9999.0), 2, "no_logprobs", "only 0 of 48 sampled tokens"),  # vLLM's -inf
    (_blank(None, first=1), 0, None, None),  # 44 of 48 >= 90 %: measured on those 44
], ids=["none", "-inf", "vllm-9999", "one-per-completion"])
def test_a_server_without_finite_log_probs_gets_no_verdict(tiny, tiny_model_dir, tmp_path, mutate, code, cause, words):
    model, tokenizer = tiny
    with http_stub(_mutated(StubEngine(model, tokenizer), mutate)) as (url, _):
        done, report = _diagnose(tiny_model_dir, url, tmp_path, "--prompts", "2", "--group", "2")
    assert done.returncode == code, done.stderr[-3000:]
    if code == 2:
        assert report["verdict"] is None and report["error"]["cause"] == cause and words in report["error"]["message"]
    else:
        assert report["verdict"] == "admitted" and report["endpoint_row"]["tokens"] == 44
        assert report["endpoint_row"]["k3"] < 1e-9


def test_a_failure_midway_gives_no_verdict_and_no_report(tiny, tiny_model_dir, tmp_path):
    model, tokenizer = tiny
    with http_stub(StubEngine(model, tokenizer, fail_after=5)) as (url, _):
        done, report = _diagnose(tiny_model_dir, url, tmp_path)
    assert done.returncode == 2 and "engine crashed" in done.stderr and "no verdict" in done.stderr
    assert report["verdict"] is None and report["error"]["cause"] == "http" and "endpoint_row" not in report
    assert not (tmp_path / "out" / "endpoint.json").exists()


def test_cli_refuses_local_options_and_reports_an_unreachable_server_as_exit_2(tmp_path):
    base = [sys.executable, "-m", "nearpolicy", "diagnose", "--endpoint", f"http://127.0.0.1:{free_port()}",
            "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "out")]
    mixed = subprocess.run(base + ["--candidates", "llamacpp:f32"], capture_output=True, text=True, timeout=120)
    assert mixed.returncode == 2 and "--candidates: not with --endpoint" in mixed.stderr
    down = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert down.returncode == 2 and "endpoint unreachable" in down.stderr
    assert json.loads((tmp_path / "r.json").read_text())["error"]["cause"] == "unreachable"
    bad = subprocess.run(base + ["--top-logprobs", "50"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--top-logprobs must be in [0, 20]" in bad.stderr


def test_an_unexpected_error_is_no_verdict_never_a_rejection(monkeypatch, tmp_path, capsys):
    """A bug inside the measurement must not exit 1, which a CI gate reads as "rejected"."""
    from nearpolicy import cli
    from nearpolicy.diagnosis import endpoint

    def broken(cfg, settings, log=print):
        raise KeyError("a bug")

    monkeypatch.setattr(endpoint, "run_endpoint_diagnosis", broken)
    code = cli.main(["diagnose", "--endpoint", "http://127.0.0.1:9", "--json", str(tmp_path / "r.json"),
                     "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 2 and report["verdict"] is None and report["error"]["cause"] == "internal"
    assert "KeyError" in report["error"]["message"] and "Traceback" in capsys.readouterr().err


def test_diagnose_help_names_the_no_verdict_exit_status(capsys):
    from nearpolicy import cli

    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit 0 when every candidate is admitted, 1 when one is rejected, 2 when there is no verdict" in text
