"""The llama.cpp engine's thread count follows the idle cores (engines/cpu_load.py), and its results do not
depend on the thread count, so adapting it changes speed only."""

from __future__ import annotations

import itertools

import pytest

from nearpolicy.engines import cpu_load
from nearpolicy.engines.llamacpp import LlamaCppEngine
from nearpolicy.types import GenerationRequest, SamplingParams

PROMPT = (1, 9690, 28, 2, 504, 8)


def test_free_cores_is_the_idle_share_of_the_window(monkeypatch):
    monkeypatch.setattr(cpu_load, "_allowed_cpus", lambda: {0, 1, 2, 3})
    reads = iter([(100, 1000), (130, 1100)])  # 30 of 100 jiffies idle: 0.3 x 4 cores
    assert cpu_load.free_cores(0.0, read=lambda: next(reads)) == pytest.approx(1.2, rel=1e-12)
    assert cpu_load.free_cores(0.0, read=lambda: None) is None
    same = itertools.repeat((5, 50))
    assert cpu_load.free_cores(0.0, read=lambda: next(same)) is None  # no time passed: unknown, not 0


@pytest.mark.parametrize("configured, free, expected", [(2, 2.0, 2), (2, 1.4, 1), (2, 1.6, 2), (2, 0.1, 1),
                                                        (4, 3.0, 3), (1, 8.0, 1), (2, None, 2)])
def test_fit_threads_rounds_the_free_cores_within_one_and_the_configured_count(configured, free, expected):
    assert cpu_load.fit_threads(configured, free) == expected


def test_proc_stat_reads_on_this_machine():
    idle, total = cpu_load._cpu_times()
    assert 0 <= idle <= total and total > 0


def test_only_the_cpus_this_process_may_use_count(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  30 0 30 140 0 0 0 0\ncpu0 10 0 10 80 0 0 0 0\ncpu1 20 0 20 60 0 0 0 0\nintr 5\n")
    assert cpu_load._cpu_times(str(stat), cpus={1}) == (60, 100)
    assert cpu_load._cpu_times(str(stat), cpus={0, 1}) == (140, 200)  # the aggregate line is not counted twice


def test_thread_count_changes_no_result_and_is_set_per_call(tiny_gguf_factory, monkeypatch):
    engine = LlamaCppEngine(tiny_gguf_factory("q8_0"), max_context=64, max_parallel_sequences=4, threads=2)
    requests = [GenerationRequest(0, PROMPT, 3)]
    sampling = SamplingParams(1.0, 1.0, 0, 8)
    try:
        results = {}
        for free in (2.0, 0.3):
            monkeypatch.setattr("nearpolicy.engines.llamacpp.free_cores", lambda free=free: free)
            out = engine.generate(requests, sampling, seed=5)
            results[engine.threads_used] = [(r.completion_ids, r.rollout_logprobs) for r in out]
            assert engine.greedy([list(PROMPT)], 6) == engine.greedy([list(PROMPT)], 6)
        assert sorted(results) == [1, 2]
        assert results[1] == results[2]  # bit for bit
        engine.adaptive_threads = False
        monkeypatch.setattr("nearpolicy.engines.llamacpp.free_cores", lambda: 2.0)
        engine.generate(requests, sampling, seed=5)
        assert engine.threads_used == 1  # not adapted: left as the last call set it
    finally:
        engine.close()
