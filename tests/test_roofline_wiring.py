"""The rollout's roofline wired in (engines/roofline.py): per step rollout/roofline_s and rollout/roofline_share from
the engine's counted decode calls and the rates measured at the source's start, against hand-computed values; absent
for an engine that does not count its calls' shapes; the run summary, the report's header and the doctor show them.

Hand-computed numbers (as tests/test_roofline.py): N = 100M parameters, 30 layers, query width 576, 144 MB of
weights, 23040 cached bytes per token; 200 GFLOP/s and 10 GB/s. A call of 32 sequences over 3200 positions:
flops 6.4e9 + 4 x 30 x 576 x 3200 = 6.621184e9 -> 0.03310592 s, bytes 144e6 + 23040 x 3200 = 217.728e6 -> 0.0217728 s
(compute bound). A call of 1 sequence over 120 positions: flops 2e8 + 8294400 -> 0.001041472 s, bytes 144e6 + 2764800
-> 0.01467648 s (memory bound)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import nearpolicy.rollouts.inline as inline
from nearpolicy.engines.base import DecodeCounts
from nearpolicy.engines.roofline import (DecodeShape, DecodeStep, MachineRates, roofline_metrics, roofline_seconds,
                                         synchronous_decode_steps)
from nearpolicy.rollouts.inline import InlineRollouts
from nearpolicy.tasks.base import Problem
from nearpolicy.types import Rollout, SamplingParams

SHAPE = DecodeShape(parameters=100_000_000, layers=30, query_width=576, weight_bytes=144e6, kv_bytes_per_token=23040)
RATES = MachineRates(peak_flops=200e9, bandwidth=10e9, threads=2)
STEPS = (DecodeStep(32, 3200), DecodeStep(1, 120), DecodeStep(1, 120))
ROOFLINE_S = 0.03310592 + 2 * 0.01467648  # each call at its larger term
EXPECTED = {"rollout/roofline_s": ROOFLINE_S, "rollout/roofline_share": ROOFLINE_S / 2.5,
            "rollout/roofline_compute_s": 0.03310592 + 2 * 0.001041472,
            "rollout/roofline_memory_s": 0.0217728 + 2 * 0.01467648, "rollout/roofline_memory_bound_calls": 2.0,
            "rollout/roofline_peak_gflops": 200.0, "rollout/roofline_bandwidth_gbs": 10.0}


def _approx(expected: dict) -> dict:
    return {key: pytest.approx(value, rel=1e-12) for key, value in expected.items()}


def test_roofline_metrics_equal_hand_computed_values():
    assert roofline_metrics(SHAPE, STEPS, RATES, 2.5) == _approx(EXPECTED)
    without = {k: v for k, v in EXPECTED.items() if k != "rollout/roofline_share"}
    assert roofline_metrics(SHAPE, STEPS, RATES, None) == _approx(without)  # no measured time: no share
    with pytest.raises(ValueError):
        roofline_metrics(SHAPE, STEPS, RATES, 0.0)


def test_machine_rates_from_the_probes_units():
    rates = MachineRates.of(13.5, {"copy": 12.0, "triad": 17.25}, threads=2)  # the faster STREAM kernel's
    assert rates == MachineRates(13.5e9, 17.25e9, 2)
    assert rates.describe() == "GEMM peak 13.5 GFLOP/s (fp32, 2 threads), memory bandwidth 17.2 GB/s"


def test_decode_counts_add_their_calls_shapes():
    a = DecodeCounts(1, 32, 32, (STEPS[0],), SHAPE)
    b = DecodeCounts(2, 2, 64, STEPS[1:])  # a replica's calls; the shape is the model's, the same
    assert a + b == DecodeCounts(3, 34, 96, STEPS, SHAPE)
    assert (a + b).roofline_steps() == (SHAPE, STEPS)
    assert DecodeCounts(3, 34, 96, STEPS[:2], SHAPE).roofline_steps() is None  # a call without its shape
    assert DecodeCounts(3, 34, 96, STEPS).roofline_steps() is None  # no model shape


class _Task:
    def train_problem(self, i: int) -> Problem:
        return Problem(f"q{i}", "1", {})


class _Engine:
    """Samples one token per sequence; `counts` is what each take_decode_counts returns in turn."""

    version = 0

    def __init__(self, counts: list[DecodeCounts]):
        self.counts = counts

    def generate(self, requests, sampling, seed):
        return [Rollout(r.group_id, k, list(r.prompt_ids), [5], [-1.0], [0], "length")
                for r in requests for k in range(r.n)]

    def take_decode_counts(self) -> DecodeCounts:
        return self.counts.pop(0)


class _Uncounted(_Engine):
    take_decode_counts = None  # as vllm or the fake engines: no such method


def _source(engine) -> InlineRollouts:
    return InlineRollouts(engine, lambda: None, _Task(), lambda p: [1, 2, 3], SamplingParams(max_new_tokens=4),
                          group_size=2, prompts_per_step=2, seed=0)


def _clock(monkeypatch, *readings: float) -> None:
    monkeypatch.setattr(inline, "time", SimpleNamespace(perf_counter=iter(readings).__next__))


def test_a_counting_engines_step_reports_its_roofline_share_of_generates_time(monkeypatch):
    monkeypatch.setattr(inline, "measure_rates", lambda: RATES)
    source = _source(_Engine([DecodeCounts(shape=SHAPE), DecodeCounts(3, 34, 12, STEPS, SHAPE)]))
    source.start(0, 0, None)  # the start's take has the shape: the rates are measured once, here
    assert source.rates == RATES
    _clock(monkeypatch, 10.0, 12.5)  # generate took 2.5 s
    metrics = source.collect(0, 0, 0).metrics
    decode = {"rollout/decode_calls": 3.0, "rollout/decode_batch_mean": 34 / 3, "rollout/decode_occupancy": 34 / 12}
    assert metrics == _approx(decode | EXPECTED)


def test_no_roofline_metric_for_an_engine_that_does_not_count_shapes(monkeypatch):
    def never():
        raise AssertionError("no rates are measured for an engine without shapes")

    monkeypatch.setattr(inline, "measure_rates", never)
    source = _source(_Uncounted([]))
    source.start(0, 0, None)
    assert source.rates is None and source.collect(0, 0, 0).metrics == {}  # vllm, fakes: no decode metric at all
    source = _source(_Engine([DecodeCounts(), DecodeCounts(2, 3, 8)]))  # hf: calls counted, shapes not
    source.start(0, 0, None)
    assert source.collect(0, 0, 0).metrics == {"rollout/decode_calls": 2.0, "rollout/decode_batch_mean": 1.5,
                                                "rollout/decode_occupancy": 3 / 8}


def test_the_llamacpp_engines_step_is_bounded_by_its_own_calls(tiny_gguf_factory, monkeypatch):
    """The real engine through the source: one wave (8 samples in 8 slots), so the calls are those of
    roofline.synchronous_decode_steps over the rollouts' prompt and completion lengths, at the engine's shape."""
    from nearpolicy.engines.llamacpp import LlamaCppEngine

    monkeypatch.setattr(inline, "measure_rates", lambda: RATES)
    engine = LlamaCppEngine(tiny_gguf_factory("q8_0"), max_context=64, max_parallel_sequences=8, threads=2,
                            kv_cache="f16")
    source = InlineRollouts(engine, lambda: None, _Task(), lambda p: [1, 504, 3287, 28, int(p.question[1:]) + 7],
                            SamplingParams(1.0, 1.0, 0, 12), group_size=4, prompts_per_step=2, seed=3)
    try:
        source.start(0, 0, None)
        clock = iter([100.0, 104.0])  # generate: 4 s
        monkeypatch.setattr(inline, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        got = source.collect(0, 0, 0)
    finally:
        engine.close()
    steps = synchronous_decode_steps([len(r.prompt_ids) for r in got.rollouts],
                                     [len(r.completion_ids) for r in got.rollouts])
    assert got.metrics["rollout/decode_calls"] == len(steps) > 0
    bound = roofline_seconds(engine.decode_shape, steps, RATES.peak_flops, RATES.bandwidth)["seconds"]
    assert engine.decode_shape.kv_bytes_per_token == 2 * 2 * 32 * 2  # K and V, 2 layers, 2 heads x 16, f16
    assert got.metrics["rollout/roofline_s"] == pytest.approx(bound, rel=1e-12)
    assert got.metrics["rollout/roofline_share"] == pytest.approx(bound / 4.0, rel=1e-12)


def _run(folder: Path, shares: list[float | None]) -> Path:
    folder.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    for step, share in enumerate(shares, 1):
        row = {"step": step, "reward/mean": 0.5, "time/rollout": 2.0, "time/step": 3.0}
        if share is not None:
            row |= {"rollout/roofline_share": share, "rollout/roofline_s": 2.0 * share,
                    "rollout/roofline_peak_gflops": 13.84, "rollout/roofline_bandwidth_gbs": 17.26}
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_the_summary_and_the_report_show_the_share_averaged_over_steps(tmp_path):
    from nearpolicy.runs.report import NOT_RECORDED, load_run, run_summary
    from nearpolicy.runs.summary import summarize

    run = _run(tmp_path / "counted", [0.40, 0.45, 0.65])
    said = ("50.0% of the bound (mean of 3 steps; min 40.0%, max 65.0%); GEMM peak 13.8 GFLOP/s, memory bandwidth "
            "17.3 GB/s")
    text = summarize(run)
    assert f"Rollout against its roofline bound (rollout/roofline_share, engines/roofline.py): {said}." in text
    assert "| rollout/roofline_share | 0.4 | 0.45 | 0.5 | 0.65 |" in text
    assert run_summary(load_run(run))["rollout vs roofline bound"] == said
    plain = _run(tmp_path / "uncounted", [None, None])
    assert "roofline" not in summarize(plain)
    assert run_summary(load_run(plain))["rollout vs roofline bound"] == NOT_RECORDED


def test_the_doctor_prints_the_two_rates(monkeypatch, tmp_path):
    import nearpolicy.doctor as doctor_module

    monkeypatch.setattr(doctor_module, "gemm_gflops", lambda dtype: 1.0)
    monkeypatch.setattr(doctor_module, "memory_bandwidth", lambda: {"copy": 1.0, "triad": 1.0})
    rates = MachineRates.of(13.5, {"copy": 12.0, "triad": 17.25}, 2)
    monkeypatch.setattr(doctor_module, "measure_rates", lambda: rates)
    lines = [check.line() for check in doctor_module.checks(tmp_path, probe=False)]
    rates = [line for line in lines if "roofline rates" in line]
    assert len(rates) == 1 and rates[0].startswith("[ok  ] roofline rates")
    assert "GEMM peak 13.5 GFLOP/s (fp32, 2 threads), memory bandwidth 17.2 GB/s" in rates[0]


def test_the_gemm_peak_is_one_threads_fastest_product_times_the_threads(monkeypatch):
    """measure_rates on 3 threads: the GEMM probe runs on 1 thread (best=True) and torch's count is restored."""
    import torch

    import nearpolicy.engines.roofline as roofline_module

    seen = []
    monkeypatch.setattr(roofline_module, "gemm_gflops", lambda dtype, best: seen.append(
        (dtype, best, torch.get_num_threads())) or 40.0)
    monkeypatch.setattr(roofline_module, "memory_bandwidth", lambda: {"copy": 12.0, "triad": 9.0})
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        rates = roofline_module.measure_rates()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert seen == [(torch.float32, True, 1)]
    assert rates == MachineRates(peak_flops=120e9, bandwidth=12e9, threads=3)


def test_the_best_gemm_rate_is_the_fastest_products(monkeypatch):
    """A clock that advances 1 s per reading: each product reads 1 s, the loop 2 readings per product; with
    seconds=4.5 the loop runs products while the elapsed reading stays under 4.5 s."""
    import itertools

    import torch

    import nearpolicy.engines.roofline as roofline_module

    ticks = itertools.count()
    monkeypatch.setattr(roofline_module.time, "perf_counter", lambda: float(next(ticks)))
    flops = 2 * 8**3
    # readings: t0 = 0; loop check 1 (elapsed 1), product end 2; check 3, end 4; check 5 (elapsed 5): stop at 6
    assert roofline_module.gemm_gflops(torch.float32, n=8, seconds=4.5, best=True) == pytest.approx(flops / 1e9)
    ticks = itertools.count()
    assert roofline_module.gemm_gflops(torch.float32, n=8, seconds=4.5) == pytest.approx(2 * flops / 6 / 1e9)
