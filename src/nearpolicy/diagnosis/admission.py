"""Admission check: a budget on the token-mean k3 KL(mu || pi) calibrated against the noise floor, a verdict
per candidate, and a greedy search for the cheapest mixed-precision recipe that fits (docs/math.md sec. 18).

Default budget: keep the normalised ESS of *sequence* importance weights at or above `seq_ess_min` (0.5, the
resync threshold DLC uses) for responses of `response_tokens` tokens. For small per-token log-ratios with
E_mu[r] = 1, log w = sum_t log r_t is close to normal with variance 2 L k3, so ESS_seq = exp(-2 L k3) and the
budget is k3 <= ln(1 / seq_ess_min) / (2 L). Alternatives: an absolute k3, or a multiple of the floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

from nearpolicy.diagnosis.sensitivity import UnitSensitivity
from nearpolicy.engines.gguf.export import QTYPES


@dataclass(frozen=True)
class Budget:
    k3: float  # nats per token
    rule: str
    floor_k3: float
    kind: str = "absolute"  # which rule set k3: "seq_ess", "absolute" or "floor_multiple"
    seq_ess_min: float | None = None  # seq_ess: the sequence-ESS floor, at response_tokens tokens
    response_tokens: int | None = None
    floor_multiple: float | None = None  # floor_multiple: k3 <= this x floor_k3


def make_budget(floor_k3: float, response_tokens: int, *, absolute: float | None = None,
                floor_multiple: float | None = None, seq_ess_min: float = 0.5) -> Budget:
    """The k3 budget. Raises ValueError for a non-positive value or when both alternatives are given."""
    if absolute is not None and floor_multiple is not None:
        raise ValueError("give an absolute k3 budget or a multiple of the floor, not both")
    if absolute is not None:
        if not absolute > 0:
            raise ValueError(f"the k3 budget must be > 0, got {absolute}")
        return Budget(absolute, f"absolute k3 <= {absolute:.3g}", floor_k3, "absolute")
    if floor_multiple is not None:
        if not floor_multiple > 1:
            raise ValueError(f"the floor multiple must be > 1, got {floor_multiple}")
        return Budget(floor_multiple * floor_k3, f"{floor_multiple:g} x the noise floor k3 {floor_k3:.3g}", floor_k3,
                      "floor_multiple", floor_multiple=floor_multiple)
    if not 0 < seq_ess_min < 1 or response_tokens < 1:
        raise ValueError(f"need 0 < seq_ess_min < 1 and response_tokens >= 1, got {seq_ess_min}, {response_tokens}")
    k3 = math.log(1 / seq_ess_min) / (2 * response_tokens)
    return Budget(k3, f"sequence ESS >= {seq_ess_min:g} at {response_tokens} tokens: k3 <= ln(1/{seq_ess_min:g}) / "
                      f"(2 x {response_tokens}) = {k3:.3g}", floor_k3, "seq_ess", seq_ess_min, response_tokens)


def admitted(k3: float, budget: Budget) -> bool:
    return math.isfinite(k3) and k3 <= budget.k3


def verdict_line(candidate: str, k3: float, budget: Budget) -> str:
    """Why `candidate` (with token-mean k3, nats/token) is admitted or rejected, in the terms of the budget's rule,
    e.g. "llamacpp:q4_1 rejected: sequence ESS at 64 tokens 0.2 < 0.5 (exp(-2 x 64 x k3), k3 0.0126 > 0.00542)".
    The sequence ESS is the rule's model exp(-2 L k3) (module docstring), the quantity the verdict compares."""
    ok = admitted(k3, budget)
    verdict, above = ("admitted", "<=") if ok else ("rejected", ">")
    if not math.isfinite(k3):
        return f"{candidate} rejected: k3 is {k3} (not finite)"
    if budget.kind == "seq_ess":
        n = budget.response_tokens
        ess = math.exp(-2 * n * k3)
        return (f"{candidate} {verdict}: sequence ESS at {n} tokens {ess:.3g} {'>=' if ok else '<'} "
                f"{budget.seq_ess_min:g} (exp(-2 x {n} x k3), k3 {k3:.3g} {above} {budget.k3:.3g})")
    if budget.kind == "floor_multiple" and budget.floor_k3 > 0:
        return (f"{candidate} {verdict}: k3 {k3:.3g} is {k3 / budget.floor_k3:.3g} x the noise floor "
                f"{budget.floor_k3:.3g} ({above} {budget.floor_multiple:g} x, the budget {budget.k3:.3g})")
    return f"{candidate} {verdict}: k3 {k3:.3g} {above} the budget {budget.k3:.3g}"


def bits_per_weight(precision: str) -> float:
    block, size = gguf.GGML_QUANT_SIZES[QTYPES[precision][0]]
    return 8.0 * size / block


@dataclass(frozen=True)
class Recipe:
    precision: str  # the candidate's precision for every other tensor
    promoted: tuple[str, ...]  # units kept at `promote_to`
    promote_to: str
    predicted_k3: float  # teacher-forced prediction (see propose_recipe)
    extra_bytes: float  # weight bytes added by the promotions

    @property
    def overrides(self) -> tuple[tuple[str, str], ...]:
        return tuple((unit, self.promote_to) for unit in self.promoted)


def propose_recipe(precision: str, reference_k3: float, full_k3: float, units: list[UnitSensitivity],
                   target_k3: float, promote_to: str = "f16", skip: int = 0) -> Recipe | None:
    """Greedy cheapest recipe: promote units to `promote_to` in order of added k3 per extra byte until the
    predicted k3 is <= target_k3; `skip` forces that many extra promotions (after a failed verification).

    Prediction: the excess full_k3 - reference_k3 is attributed to the units in proportion to their added k3
    (so promoting every unit predicts reference_k3 even when the effects do not add up exactly). Tensor kinds
    overlap the blocks, so only blocks and embeddings / output are promoted. None when nothing can reach target."""
    extra_bits = bits_per_weight(promote_to) - bits_per_weight(precision)
    pool = [u for u in units if u.kind == "block" or u.unit in ("embeddings", "output")]
    pool.sort(key=lambda u: max(u.added_k3, 0.0) / max(u.parameters * extra_bits, 1.0), reverse=True)
    total_added = sum(max(u.added_k3, 0.0) for u in pool) or 1.0
    excess = max(full_k3 - reference_k3, 0.0)
    predicted, chosen = full_k3, []
    for unit in pool:
        if predicted <= target_k3:
            if skip <= 0:
                break
            skip -= 1
        chosen.append(unit)
        predicted -= excess * max(unit.added_k3, 0.0) / total_added
    if predicted > target_k3 * (1 + 1e-9):
        return None
    extra = sum(u.parameters for u in chosen) * extra_bits / 8
    return Recipe(precision, tuple(u.unit for u in chosen), promote_to, predicted, extra)
