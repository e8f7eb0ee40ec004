"""The llama.cpp engine in its own process (engines/process.py): the same results as in process, and a real native
crash of that process (a null-pointer read: SIGSEGV; abort(): SIGABRT) reported with its signal, phase and log,
while the trainer's process carries on."""

from __future__ import annotations

from dataclasses import astuple, dataclass

import pytest

from nearpolicy.engines.base import EngineError
from nearpolicy.engines.llamacpp import EngineSpec
from nearpolicy.engines.process import CRASH_HOOK, EngineDied, ProcessEngine, exit_description
from nearpolicy.types import GenerationRequest, SamplingParams

PROMPT = [1, 9690, 28, 2, 504, 8]
SAMPLING = SamplingParams(1.0, 1.0, 0, 8)


def _spec(path, extra_buffers: bool = False) -> EngineSpec:
    return EngineSpec(str(path), 0, 128, 8, 1, "f32", False, extra_buffers)


def _process(path, tmp_path, **kwargs) -> ProcessEngine:
    return ProcessEngine(_spec(path), "llamacpp:q8_0", log_path=tmp_path / "llamacpp.log", probe_prompt=PROMPT,
                         **kwargs)


def test_process_engine_matches_the_in_process_engine_bit_for_bit(tiny_gguf_factory, tmp_path):
    path = tiny_gguf_factory("q8_0")
    local = _spec(path).open()
    remote = _process(path, tmp_path)
    try:
        requests = [GenerationRequest(0, tuple(PROMPT), 3), GenerationRequest(1, tuple(PROMPT[:4]), 2)]
        a, b = local.generate(requests, SAMPLING, seed=7), remote.generate(requests, SAMPLING, seed=7)
        assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
        assert [r.rollout_logprobs for r in a] == [r.rollout_logprobs for r in b]  # exact: same kernels, same seed
        counts = local.take_decode_counts()
        assert remote.take_decode_counts() == counts and counts.calls > 0  # the child's counts cross the pipe
        assert local.greedy([PROMPT], 5) == remote.greedy([PROMPT], 5)
        assert local.score(PROMPT, [5, 6, 7], SAMPLING) == remote.score(PROMPT, [5, 6, 7], SAMPLING)
        stop_ids = {t for t in range(local.n_vocab) if local.is_stop_token(t)}
        assert remote.stop_token_ids() == stop_ids and {0, 2}.issubset(stop_ids)
        remote.update_weights(tiny_gguf_factory("f32"), 3)
        assert remote.version == 3
        reloaded = _spec(tiny_gguf_factory("f32")).open()
        assert remote.score(PROMPT, [5, 6, 7], SAMPLING) == reloaded.score(PROMPT, [5, 6, 7], SAMPLING)
        reloaded.close()
    finally:
        local.close()
        remote.close()
    assert not remote._proc.is_alive()


class _Uncounted:
    """An engine without take_decode_counts (as vLLM's): everything else the llama.cpp engine's."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        if name in ("engine", "take_decode_counts"):
            raise AttributeError(name)
        return getattr(self.engine, name)


@dataclass(frozen=True)
class _UncountedSpec(EngineSpec):
    def open(self):
        return _Uncounted(super().open())


def test_an_engine_that_does_not_count_decode_calls_reports_none_through_the_process(tiny_gguf_factory, tmp_path):
    remote = ProcessEngine(_UncountedSpec(*astuple(_spec(tiny_gguf_factory("f32")))), "uncounted")
    try:
        remote.generate([GenerationRequest(0, tuple(PROMPT), 2)], SAMPLING, seed=0)
        assert remote.take_decode_counts() is None  # no metric rather than an AttributeError from the child
    finally:
        remote.close()


@pytest.mark.parametrize("method, phase, signame", [("generate", "rollout", "SIGSEGV"), ("greedy", "eval", "SIGSEGV"),
                                                    ("update_weights", "weight sync", "SIGABRT")])
def test_a_native_crash_in_the_engine_process_is_reported_not_suffered(tiny_gguf_factory, tmp_path, monkeypatch,
                                                                        method, phase, signame):
    monkeypatch.setenv(CRASH_HOOK, f"{method}:2:{signame}")
    path = tiny_gguf_factory("q8_0")
    engine = _process(path, tmp_path)
    calls = {"generate": lambda: engine.generate([GenerationRequest(0, tuple(PROMPT), 2)], SAMPLING, 0),
             "greedy": lambda: engine.greedy([PROMPT], 4), "update_weights": lambda: engine.update_weights(path, 1)}
    calls[method]()  # the first call works
    with pytest.raises(EngineDied) as died:
        calls[method]()
    err = died.value
    assert (err.engine, err.signal_name, err.phase) == ("llamacpp:q8_0", signame, phase)
    assert str(err).startswith(f"engine llamacpp:q8_0 died with {signame} during {phase}; last lines of its log:")
    log = (tmp_path / "llamacpp.log").read_text()
    assert "llama_model_loader" in log or "load_tensors" in log  # llama.cpp's own log reached the file
    if signame == "SIGSEGV":
        assert "Fatal Python error: Segmentation fault" in log  # faulthandler's stack of the child
    with pytest.raises(EngineDied):  # and stays dead: every later call says so
        engine.greedy([PROMPT], 2)
    engine.close()


def test_a_crash_in_the_startup_probe_fails_the_start(tiny_gguf_factory, tmp_path, monkeypatch):
    monkeypatch.setenv(CRASH_HOOK, "probe:1")
    with pytest.raises(EngineDied, match=r"^engine llamacpp:q8_0 died with SIGSEGV during startup probe"):
        _process(tiny_gguf_factory("q8_0"), tmp_path)


def test_an_unloadable_file_is_an_engine_error_naming_it(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(EngineError, match=r"llama.cpp could not load .*bad.gguf"):
        _process(bad, tmp_path)


def test_engine_errors_raised_in_the_child_come_back_unchanged(tiny_gguf_factory, tmp_path):
    engine = _process(tiny_gguf_factory("q8_0"), tmp_path)
    with pytest.raises(EngineError, match=r"exceeds the context of 128 tokens per sequence"):
        engine.score(PROMPT, list(range(5, 200)), SAMPLING)
    assert engine.greedy([PROMPT], 2)  # still serving
    engine.close()


def test_exit_descriptions():
    assert [exit_description(c) for c in (-11, -4, -6, -9, 1, 0)] == [
        "SIGSEGV", "SIGILL", "SIGABRT", "SIGKILL", "exit code 1", "exit code 0"]


def test_the_crash_report_shows_only_the_newest_engine_process_log(tiny_gguf_factory, tmp_path, monkeypatch):
    """The log is appended by every engine process of a run (a resume starts a new one): a report never shows an
    earlier process's crash."""
    monkeypatch.setenv(CRASH_HOOK, "greedy:1:SIGILL")
    first = _process(tiny_gguf_factory("q8_0"), tmp_path)
    with pytest.raises(EngineDied, match="SIGILL"):
        first.greedy([PROMPT], 2)
    monkeypatch.setenv(CRASH_HOOK, "greedy:1:SIGKILL")
    second = _process(tiny_gguf_factory("q8_0"), tmp_path)
    with pytest.raises(EngineDied) as died:
        second.greedy([PROMPT], 2)
    assert died.value.signal_name == "SIGKILL" and died.value.log_tail
    assert not any("Fatal Python error" in line for line in died.value.log_tail)  # that was the first process
    assert "Fatal Python error: Illegal instruction" in (tmp_path / "llamacpp.log").read_text()


def test_the_engine_process_is_outside_the_trainers_process_group(tiny_gguf_factory, tmp_path):
    import os

    engine = _process(tiny_gguf_factory("q8_0"), tmp_path)
    assert os.getpgid(engine.pid) == engine.pid != os.getpgid(0)
    engine.close()
