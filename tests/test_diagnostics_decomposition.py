"""The per-step split of log(pi_theta / mu) into numerical discrepancy and policy lag (issue 4)."""

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
