"""Mismatch diagnostics added for issue 4: the per-step split into numerical discrepancy and policy lag,
|dlogp| quantiles, the per-position profile and the sequence ESS, each against a per-token loop."""

from __future__ import annotations

import math

import torch

from nearpolicy.ops.diagnostics import mismatch_decomposition


def _k3(log_r: list[float]) -> float:
    return sum(math.exp(x) - 1 - x for x in log_r) / len(log_r)


def _ess(log_r: list[float]) -> float:
    w = [math.exp(x) for x in log_r]
    return sum(w) ** 2 / (len(w) * sum(x * x for x in w))


def test_components_match_a_per_token_loop_and_ignore_masked_positions():
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    old = rollout + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    current = old + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    defined = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    current[~defined] = float("nan")  # masked values must not leak
    rollout[0, 4] = float("inf")
    out = mismatch_decomposition(current, old, rollout, defined)
    idx = defined.nonzero().tolist()
    disc = [float(old[i, j] - rollout[i, j]) for i, j in idx]
    lag = [float(current[i, j] - old[i, j]) for i, j in idx]
    total = [d + l for d, l in zip(disc, lag)]
    for name, values in {"discrepancy": disc, "lag": lag, "total": total}.items():
        assert float(out[f"{name}_k3"]) == pytest_approx(_k3(values))
        assert float(out[f"{name}_ess"]) == pytest_approx(_ess(values))


def test_no_lag_means_total_equals_discrepancy():
    rollout = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.1, -1.9, -0.5]])
    out = mismatch_decomposition(old.clone(), old, rollout, torch.ones(1, 3, dtype=torch.bool))
    assert float(out["lag_k3"]) == 0.0 and float(out["lag_ess"]) == 1.0
    assert float(out["total_k3"]) == float(out["discrepancy_k3"]) > 0


def pytest_approx(x: float):
    import pytest

    return pytest.approx(x, rel=1e-12, abs=1e-15)


def _inputs():
    g = torch.Generator().manual_seed(7)
    mu = -torch.rand(4, 10, generator=g, dtype=torch.float64) * 3
    pi = mu + 0.2 * torch.randn(4, 10, generator=g, dtype=torch.float64)
    lengths = [10, 7, 3, 0]
    defined = torch.tensor([[t < n for t in range(10)] for n in lengths])
    pi[~defined] = float("nan")
    return pi, mu, defined


def test_quantiles_positions_and_sequence_ess_match_loops():
    from nearpolicy.ops.diagnostics import logprob_diff_quantiles, mismatch_by_position, sequence_ess

    pi, mu, defined = _inputs()
    diffs = sorted(abs(float(pi[i, t] - mu[i, t])) for i, t in defined.nonzero().tolist())
    q = logprob_diff_quantiles(pi, mu, defined)
    n = len(diffs)
    for name, level in (("p50", 0.5), ("p90", 0.9)):
        pos = level * (n - 1)  # linear interpolation, as numpy / torch
        lo = int(pos)
        expected = diffs[lo] + (pos - lo) * (diffs[min(lo + 1, n - 1)] - diffs[lo])
        assert float(q[name]) == pytest_approx(expected)
    assert float(q["max"]) == diffs[-1]

    prof = mismatch_by_position(pi, mu, defined, bucket=4)
    assert prof["start"].tolist() == [0.0, 4.0, 8.0]
    for b, start in enumerate((0, 4, 8)):
        cells = [(i, t) for i, t in defined.nonzero().tolist() if start <= t < start + 4]
        log_r = [float(pi[i, t] - mu[i, t]) for i, t in cells]
        assert float(prof["k3"][b]) == pytest_approx(_k3(log_r))
        assert float(prof["tokens"][b]) == len(cells)

    seq_w = [math.exp(sum(float(pi[i, t] - mu[i, t]) for t in range(10) if defined[i, t])) for i in range(3)]
    expected = sum(seq_w) ** 2 / (3 * sum(w * w for w in seq_w))  # row 3 has no token: left out
    assert float(sequence_ess(pi, mu, defined)) == pytest_approx(expected)
    assert float(sequence_ess(pi, mu, torch.zeros_like(defined))) == 1.0


def test_k3_standard_error_matches_the_cluster_formula_by_hand():
    from nearpolicy.ops.diagnostics import k3_standard_error

    pi, mu, defined = _inputs()
    per_seq = []
    for i in range(4):
        log_r = [float(pi[i, t] - mu[i, t]) for t in range(10) if defined[i, t]]
        if log_r:
            per_seq.append((sum(math.exp(x) - 1 - x for x in log_r), len(log_r)))
    total_s, total_n, m = sum(s for s, _ in per_seq), sum(n for _, n in per_seq), len(per_seq)
    k3 = total_s / total_n
    expected = math.sqrt(m / (m - 1) * sum((s - k3 * n) ** 2 for s, n in per_seq)) / total_n
    assert float(k3_standard_error(pi, mu, defined)) == pytest_approx(expected)
    one_row = torch.zeros_like(defined)
    one_row[0, :3] = True
    assert float(k3_standard_error(pi, mu, one_row)) == 0.0
