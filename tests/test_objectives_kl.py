"""KL-penalty estimators by exact expectation over a 4-token categorical (float64): the expected gradient
sum_y pi_old(y) grad penalty(y) against autograd of the true KL(pi || pi_ref) (invariant 15; docs/math.md sec. 8)."""

import math

import pytest
import torch

from nearpolicy.config.schema import load_config
from nearpolicy.ops.kl import KL_ESTIMATORS, kl_penalty_tokens

LOGITS = [1.0, 0.0, -1.0, 0.5]
REF_LOGITS = [0.0, 1.0, 0.0, -1.0]
SHIFTED_OLD_LOGITS = [1.5, -0.5, -1.0, 0.5]  # pi_old = softmax(logits + [0.5, -0.5, 0, 0])
RIGHT_BOTH = ("k3_is", "k2_is")
RIGHT_ON_POLICY = ("k2", "k1+", "k3+")


def _grad(fn) -> torch.Tensor:
    z = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    return torch.autograd.grad(fn(z), z)[0]


def _true_kl(z: torch.Tensor) -> torch.Tensor:
    lp, lref = z.log_softmax(-1), torch.tensor(REF_LOGITS, dtype=torch.float64).log_softmax(-1)
    return (lp.exp() * (lp - lref)).sum()


def _forward_kl(z: torch.Tensor) -> torch.Tensor:
    lp, lref = z.log_softmax(-1), torch.tensor(REF_LOGITS, dtype=torch.float64).log_softmax(-1)
    return (lref.exp() * (lref - lp)).sum()


def _expected_penalty(estimator: str, old_logits: list[float] | None):
    """z -> sum_y pi_old(y) penalty(y), each sampled token y a [1, 1] batch with its own log-probs."""
    def fn(z: torch.Tensor) -> torch.Tensor:
        lp = z.log_softmax(-1)
        lo = lp.detach() if old_logits is None else torch.tensor(old_logits, dtype=torch.float64).log_softmax(-1)
        lref = torch.tensor(REF_LOGITS, dtype=torch.float64).log_softmax(-1)
        mask = torch.ones(1, 1, dtype=torch.bool)
        return sum(lo[y].exp() * kl_penalty_tokens(lp[y].view(1, 1), lref[y].view(1, 1), mask, estimator,
                                                   lo[y].view(1, 1)).sum() for y in range(4))
    return fn


def _relative_error(estimator: str, old_logits: list[float] | None) -> float:
    expected, truth = _grad(_expected_penalty(estimator, old_logits)), _grad(_true_kl)
    return float((expected - truth).norm() / truth.norm())


def _softmax(logits: list[float]) -> list[float]:
    e = [math.exp(x) for x in logits]
    return [x / sum(e) for x in e]


def _closed_form_error(coef, old_logits: list[float] | None) -> float:
    """The same relative error derived by hand, without kl.py or autograd: a penalty whose per-sample gradient is
    c(y) grad lp(y), grad_z lp(y) = e_y - pi, has expected gradient G_j = pi_old_j c_j - pi_j sum_y pi_old_y c_y;
    grad KL(pi || pi_ref)_j = pi_j (d_j - sum_y pi_y d_y), d = log pi - log pi_ref. `coef`: pi, pi_ref, d -> c."""
    pi, ref = _softmax(LOGITS), _softmax(REF_LOGITS)
    old = pi if old_logits is None else _softmax(old_logits)
    d = [math.log(p) - math.log(r) for p, r in zip(pi, ref)]
    c = coef(pi, ref, d)
    mean_c, mean_d = sum(o * x for o, x in zip(old, c)), sum(p * x for p, x in zip(pi, d))
    g = [o * x - p * mean_c for o, x, p in zip(old, c, pi)]
    truth = [p * (x - mean_d) for p, x in zip(pi, d)]
    return math.dist(g, truth) / math.hypot(*truth)


K2_COEF = lambda pi, ref, d: d  # noqa: E731 - k2, k1+ and k3+: per-sample gradient d grad lp
K3_COEF = lambda pi, ref, d: [1 - r / p for p, r in zip(pi, ref)]  # noqa: E731 - k3: (1 - pi_ref / pi) grad lp


@pytest.mark.parametrize("old_logits", [None, SHIFTED_OLD_LOGITS], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("estimator", RIGHT_BOTH)
def test_is_weighted_estimators_have_the_reverse_kl_gradient_on_and_off_policy(estimator, old_logits):
    assert _relative_error(estimator, old_logits) < 1e-10


@pytest.mark.parametrize("estimator", RIGHT_ON_POLICY)
def test_k2_gradient_estimators_are_right_on_policy_only(estimator):
    assert _relative_error(estimator, None) < 1e-10
    off = _closed_form_error(K2_COEF, SHIFTED_OLD_LOGITS)
    assert off == pytest.approx(0.36618, abs=1e-5)  # issue 13: 0.37
    assert _relative_error(estimator, SHIFTED_OLD_LOGITS) == pytest.approx(off, rel=1e-10)


def test_k3_has_the_forward_kl_gradient_and_k1_none():
    """The known biases (OpenRLHF #1309, TRL #6503): k3's expected gradient is grad KL(pi_ref || pi), 0.34 off
    grad KL(pi || pi_ref) on-policy and 0.43 from the shifted pi_old; k1's expected gradient is 0."""
    on, off = _closed_form_error(K3_COEF, None), _closed_form_error(K3_COEF, SHIFTED_OLD_LOGITS)
    assert (on, off) == pytest.approx((0.33771, 0.42740), abs=1e-5)
    assert _relative_error("k3", None) == pytest.approx(on, rel=1e-10)
    assert _relative_error("k3", SHIFTED_OLD_LOGITS) == pytest.approx(off, rel=1e-10)
    forward = _grad(_forward_kl)
    assert torch.allclose(_grad(_expected_penalty("k3", None)), forward, rtol=1e-10, atol=1e-12)
    assert _grad(_expected_penalty("k1", None)).abs().max() < 1e-12


def test_k3_is_value_is_unbiased_off_policy():
    """sum_y pi_old(y) r(y) k3(y) = KL(pi || pi_ref) exactly (DeepSeek-V3.2 arXiv:2512.02556 sec. 3.1)."""
    z = torch.tensor(LOGITS, dtype=torch.float64)
    value = _expected_penalty("k3_is", SHIFTED_OLD_LOGITS)(z)
    assert value.item() == pytest.approx(_true_kl(z).item(), rel=1e-12)
    assert value.item() == pytest.approx(0.5467, abs=1e-4)


def test_every_estimator_is_classified_and_the_default_is_right_off_policy():
    assert set(KL_ESTIMATORS.names()) == {*RIGHT_BOTH, *RIGHT_ON_POLICY, "k1", "k3"}
    assert load_config(None).algorithm.kl_estimator in RIGHT_BOTH
    from nearpolicy.ops.losses import PolicyLossParams

    assert PolicyLossParams().kl_estimator in RIGHT_BOTH


def test_list_states_each_estimators_gradient(capsys):
    from nearpolicy.cli import main

    details = {}
    for name in KL_ESTIMATORS.names():  # `list NAME`: the whole entry (`list` cuts lines at 100 columns)
        assert main(["list", name]) == 0
        details[name] = " ".join(capsys.readouterr().out.split())
        assert "gradient" in details[name], name
    assert "on- and off-policy" in details["k3_is"] and "FORWARD" in details["k3"]
