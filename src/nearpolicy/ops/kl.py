"""KL-to-reference penalty estimators, each documented by the gradient it produces.

Shapes: logprobs, ref_logprobs, old_logprobs, mask [B, T]. `logprobs` = log pi_theta (current, with grad);
`ref_logprobs` = log pi_ref (frozen reference, detached); `old_logprobs` = log pi_old of the distribution the
tokens were sampled from (the loss's proximal log-probs, detached). With d = lp - lref (nats) and the
importance ratio r = exp(lp - lo) (log-ratio clamped to +-20), the target is

    grad KL(pi_theta || pi_ref) = E_{y ~ pi_theta}[ d(y) grad lp(y) ] = E_{y ~ pi_old}[ r(y) d(y) grad lp(y) ].

So an estimator used as a loss has the right expected gradient on- and off-policy iff its per-sample gradient
is r d grad lp (up to terms of zero expectation). Derivation and the estimators' sources: docs/math.md sec. 8.
Every estimator has one signature (logprobs, ref_logprobs, old_logprobs) -> per-token penalty [B, T] with
grad; `kl_penalty_tokens` masks by selection and dispatches through the registry."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nearpolicy.ops.masked import SAFETY_BOUND, clamped_exp, select
from nearpolicy.registry import Registry

KlFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KlFn] = Registry("KL estimator")

K3_MAX = 10.0  # verl low_var_kl clamps the k3 value to [-10, 10]


def _k3(d: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-d) + d - 1 with -d clamped to +-20, value clamped to [-10, 10] (verl low_var_kl)."""
    x = (-d).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return (torch.exp(x) - x - 1).clamp(-K3_MAX, K3_MAX)


def _straight_through(value: torch.Tensor, coef: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """A penalty whose value is `value` and whose gradient is coef * grad lp (both detached)."""
    return value.detach() + coef.detach() * (logprobs - logprobs.detach())


@KL_ESTIMATORS.register("k1", summary="value d = lp - lref; gradient grad lp: expected gradient 0 on-policy "
                        "(wrong as a loss)", source="Schulman 2020 'Approximating KL divergence'; verl kl_penalty k1")
def k1_kl(logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    del old
    return logprobs - ref


@KL_ESTIMATORS.register("k2", summary="value d^2/2; gradient d grad lp: grad KL(pi||pi_ref) on-policy only "
                        "(biased when samples come from pi_old)", source="Schulman 2020; verl kl_penalty mse/k2")
def k2_kl(logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    del old
    d = logprobs - ref
    return 0.5 * d * d


@KL_ESTIMATORS.register("k3", summary="value exp(-d) + d - 1 (low_var_kl); gradient (1 - pi_ref/pi) grad lp: "
                        "grad of the FORWARD KL(pi_ref||pi), wrong as a loss",
                        source="Schulman 2020; verl low_var_kl; bias: OpenRLHF #1309, TRL #6503")
def k3_kl(logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    del old
    return _k3(logprobs - ref)


@KL_ESTIMATORS.register("k1+", summary="value d; gradient d grad lp (straight-through): grad KL(pi||pi_ref) "
                        "on-policy only", source="verl kl_penalty 'k1+' (value of k1, gradient of k2)")
def k1_plus_kl(logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    del old
    d = (logprobs - ref).detach()
    return _straight_through(d, d, logprobs)


@KL_ESTIMATORS.register("k3+", summary="value k3; gradient d grad lp (straight-through, = low_var_kl+): "
                        "grad KL(pi||pi_ref) on-policy only", source="verl kl_penalty 'k3+' / 'low_var_kl+'")
def k3_plus_kl(logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    del old
    d = (logprobs - ref).detach()
    return _straight_through(_k3(d), d, logprobs)


@KL_ESTIMATORS.register("k2_is", summary="value sg(r) d^2/2, r = pi/pi_old; gradient r d grad lp: "
                        "grad KL(pi||pi_ref) on- and off-policy", source="k2's gradient with the importance ratio, "
                        "derived in docs/math.md sec. 8")
def k2_is_kl(logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    ratio = clamped_exp(logprobs.detach() - old)
    d = logprobs - ref
    return ratio * 0.5 * d * d


@KL_ESTIMATORS.register("k3_is", summary="value r k3, r = pi/pi_old (unbiased for KL(pi||pi_ref) off-policy); "
                        "gradient r d grad lp: grad KL(pi||pi_ref) on- and off-policy (default)",
                        source="DeepSeek-V3.2 arXiv:2512.02556 sec. 3.1; slime #1004; TRL "
                        "use_bias_correction_kl (#6503)")
def k3_is_kl(logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    d = (logprobs - ref).detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = clamped_exp(logprobs.detach() - old)
    return _straight_through(ratio * _k3(d), ratio * d, logprobs)


def kl_penalty_tokens(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k3_is",
                      proximal_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) penalty [B, T] of the registered `estimator` (nats; with grad through
    logprobs; 0 at masked positions, which are never read). logprobs [B, T] float (with grad), ref_logprobs and
    proximal_logprobs [B, T] (detached here; proximal_logprobs None = on-policy, old = logprobs.detach(), so r = 1).
    Raises KeyError for an unknown estimator (the message lists the valid names)."""
    fn = KL_ESTIMATORS.get(estimator)
    mask = mask.bool()
    lp = select(logprobs, mask)
    ref = select(ref_logprobs.detach().to(lp.dtype), mask)
    old = lp.detach() if proximal_logprobs is None else select(proximal_logprobs.detach().to(lp.dtype), mask)
    return select(fn(lp, ref, old), mask)
