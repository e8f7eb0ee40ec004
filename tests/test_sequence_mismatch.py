"""The per-sequence mismatch family (ops/diagnostics.sequence_mismatch_metrics, verl's rollout_corr perplexity
metrics; docs/math.md sec. 22): each metric against values computed by hand on small tensors with uneven lengths, an
empty response and masked tokens; the trainer's mismatch/seq_* through one real Trainer step on the offset engine;
what `nearpolicy diagnose` reports.

Sign: d = log PPL trainer - log PPL engine = mean log mu - mean log pi, so an engine reporting log mu = log pi + c
gives d = c."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nearpolicy.diagnosis.candidates import parse_candidate
from nearpolicy.diagnosis.measure import summarise
from nearpolicy.diagnosis.run import sequence_table
from nearpolicy.ops.diagnostics import sequence_mismatch_metrics
from test_trainer_families import _run

NAN = float("nan")
# four rows of width 5: 3 tokens; 1 token; empty; 3 defined around a masked one. Undefined cells hold garbage.
PI = [[-1.0, -2.0, -0.5, 7.0, 7.0], [-0.1, NAN, 9.0, 9.0, 9.0], [-4.0, -4.0, NAN, 0.0, 0.0],
      [-2.0, 99.0, -1.0, -3.0, NAN]]
MU = [[-1.2, -1.5, -0.5, NAN, NAN], [-0.3, NAN, NAN, NAN, NAN], [NAN] * 5, [-2.5, NAN, -1.0, -2.0, NAN]]
DEFINED = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]]
# the defined tokens of each non-empty row, copied by hand from the lists above
ROWS = [([-1.0, -2.0, -0.5], [-1.2, -1.5, -0.5]), ([-0.1], [-0.3]), ([-2.0, -1.0, -3.0], [-2.5, -1.0, -2.0])]


def _metrics(pi=PI, mu=MU, defined=DEFINED, dtype=torch.float32) -> dict[str, float]:
    out = sequence_mismatch_metrics(torch.tensor(pi, dtype=dtype), torch.tensor(mu, dtype=dtype),
                                    torch.tensor(defined, dtype=torch.bool))
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in out.values())
    return {k: float(v) for k, v in out.items()}


def _by_hand(rows: list[tuple[list[float], list[float]]]) -> dict[str, float]:
    """Every metric from the plain definitions, one sequence at a time."""
    train = [-sum(p) / len(p) for p, _ in rows]  # log PPL = mean negative log-prob (nats / token)
    roll = [-sum(m) / len(m) for _, m in rows]
    d = [t - r for t, r in zip(train, roll)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    seq_log_w = [sum(p) - sum(m) for p, m in rows]
    return {"seq_training_ppl": mean([math.exp(t) for t in train]),
            "seq_rollout_ppl": mean([math.exp(r) for r in roll]),
            "seq_training_log_ppl": mean(train), "seq_rollout_log_ppl": mean(roll), "seq_log_ppl_diff": mean(d),
            "seq_log_ppl_abs_diff": mean([abs(x) for x in d]), "seq_log_ppl_diff_max": max(d),
            "seq_log_ppl_diff_min": min(d), "seq_ppl_ratio": mean([math.exp(x) for x in d]),
            "seq_chi2": mean([math.exp(2 * w) for w in seq_log_w]) - 1}


def test_each_metric_matches_the_hand_computed_value():
    got = _metrics()
    # the three differences by hand: row 0: 3.5/3 - 3.2/3, row 1: 0.1 - 0.3, row 3: 6/3 - 5.5/3
    assert got["seq_log_ppl_diff"] == pytest.approx((0.1 - 0.2 + 1 / 6) / 3, abs=1e-6)
    assert got["seq_log_ppl_abs_diff"] == pytest.approx((0.1 + 0.2 + 1 / 6) / 3, abs=1e-6)
    assert got["seq_log_ppl_diff_min"] == pytest.approx(-0.2, abs=1e-6)
    assert got["seq_log_ppl_diff_max"] == pytest.approx(1 / 6, abs=1e-6)
    assert got["seq_chi2"] == pytest.approx((math.exp(-0.6) + math.exp(0.4) + math.exp(-1.0)) / 3 - 1, abs=1e-6)
    expected = _by_hand(ROWS)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert got["seq_count"] == 3 and got["seq_empty_count"] == 1  # the empty row is counted, not averaged


def test_empty_row_and_padding_change_nothing():
    without_empty = [row for row, keep in zip(zip(PI, MU, DEFINED), (1, 1, 0, 1)) if keep]
    pi, mu, defined = (list(x) for x in zip(*without_empty))
    plain = _metrics(pi, mu, defined)
    padded = _metrics([r + [5.0, NAN] for r in PI], [r + [NAN, -1.0] for r in MU], [r + [0, 0] for r in DEFINED])
    full = _metrics()
    for key in plain:
        if key != "seq_empty_count":
            assert full[key] == plain[key] and padded[key] == full[key], key
    assert plain["seq_empty_count"] == 0 and padded["seq_empty_count"] == 1


def test_identical_logprobs_give_no_mismatch_and_a_constant_offset_is_the_difference():
    pi = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, 0.0]], dtype=torch.float64)
    defined = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    same = sequence_mismatch_metrics(pi, pi, defined)
    assert float(same["seq_log_ppl_diff"]) == 0 and float(same["seq_log_ppl_abs_diff"]) == 0
    assert float(same["seq_ppl_ratio"]) == 1 and float(same["seq_chi2"]) == 0
    assert float(same["seq_training_ppl"]) == float(same["seq_rollout_ppl"])
    c = 0.25  # engine log mu = log pi + c on every token: d = c; sequence weight prod pi / mu = exp(-c n)
    shifted = sequence_mismatch_metrics(pi, pi + c, defined)
    for key in ("seq_log_ppl_diff", "seq_log_ppl_diff_max", "seq_log_ppl_diff_min", "seq_log_ppl_abs_diff"):
        assert float(shifted[key]) == pytest.approx(c, abs=1e-12), key
    assert float(shifted["seq_ppl_ratio"]) == pytest.approx(math.exp(c), rel=1e-12)
    assert float(shifted["seq_chi2"]) == pytest.approx((math.exp(-2 * c * 3) + math.exp(-2 * c * 2)) / 2 - 1, rel=1e-12)
    assert float(shifted["seq_training_log_ppl"] - shifted["seq_rollout_log_ppl"]) == pytest.approx(c, abs=1e-12)


def test_no_defined_token_gives_neutral_values_and_the_sequence_weight_is_clamped():
    none = _metrics(defined=[[0] * 5] * 4)
    assert none["seq_count"] == 0 and none["seq_empty_count"] == 4
    assert none["seq_training_ppl"] == none["seq_rollout_ppl"] == none["seq_ppl_ratio"] == 1.0
    assert all(none[k] == 0 for k in ("seq_training_log_ppl", "seq_log_ppl_diff", "seq_log_ppl_abs_diff",
                                      "seq_log_ppl_diff_max", "seq_log_ppl_diff_min", "seq_chi2"))
    # a 30-token sequence with log pi - log mu = 1 per token: sum 30, clamped to 20 before exp(2 x .)
    long = _metrics([[0.0] * 30], [[-1.0] * 30], [[1] * 30], dtype=torch.float64)
    assert long["seq_chi2"] == pytest.approx(math.exp(40) - 1, rel=1e-12)
    assert long["seq_log_ppl_diff"] == pytest.approx(-1.0, abs=1e-12)  # the trainer is less surprised than the engine


def test_results_are_detached():
    pi = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = sequence_mismatch_metrics(pi, torch.tensor([[-1.5, -2.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert not any(v.requires_grad for v in out.values())


def test_diagnose_reports_the_family_and_prints_its_table():
    pi, mu, defined = torch.tensor(PI), torch.tensor(MU), torch.tensor(DEFINED, dtype=torch.bool)
    result = summarise(parse_candidate("llamacpp:q8_0"), pi, mu, defined, bucket=2, seconds=1.0)
    expected = _by_hand(ROWS)
    for key, value in expected.items():
        assert result.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert result.metrics["seq_empty_count"] == 1
    header, _, row = sequence_table([result.row()])
    assert header.startswith("| candidate | trainer PPL | engine PPL | log-PPL diff d |")
    assert row.startswith(f"| llamacpp:q8_0 | {expected['seq_training_ppl']:.4g} | {expected['seq_rollout_ppl']:.4g} | "
                          f"{expected['seq_log_ppl_diff']:.3g} |") and row.endswith(" | 1 |")


@pytest.mark.parametrize("shift", [-0.3, 0.2])
def test_trainer_step_logs_the_offset_as_the_log_perplexity_difference(tiny_model_dir, tmp_path, shift):
    """The offset engine reports log mu = log pi_old + shift (hf fp32 on the trainer's weights: about 1e-6 nats
    apart), so every sequence has d = shift, PPL ratio exp(shift) and sequence weight exp(-shift n_i)."""
    rows, offsets = _run(tiny_model_dir, tmp_path, "seq", shift=shift, steps=1, per_sequence=True)
    row, lengths = rows[0], [len(o) for o in offsets[0]]
    assert row["mismatch/seq_count"] == sum(n > 0 for n in lengths)
    assert row["mismatch/seq_empty_count"] == sum(n == 0 for n in lengths)
    for key in ("seq_log_ppl_diff", "seq_log_ppl_diff_max", "seq_log_ppl_diff_min"):
        assert row[f"mismatch/{key}"] == pytest.approx(shift, abs=1e-5), key
    assert row["mismatch/seq_log_ppl_abs_diff"] == pytest.approx(abs(shift), abs=1e-5)
    assert row["mismatch/seq_training_log_ppl"] - row["mismatch/seq_rollout_log_ppl"] == pytest.approx(shift, abs=1e-5)
    assert row["mismatch/seq_ppl_ratio"] == pytest.approx(math.exp(shift), rel=1e-5)
    chi2 = float(np.mean([math.exp(-2 * shift * n) for n in lengths if n > 0])) - 1
    assert row["mismatch/seq_chi2"] == pytest.approx(chi2, rel=1e-4)
