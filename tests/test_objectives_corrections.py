"""Composable mismatch corrections, presets, decoupled / bypass modes (float64, loop references)."""

import itertools
import math

import pytest
import torch

from nearpolicy.ops.correction_presets import CORRECTIONS, correction_spec
from nearpolicy.ops.corrections import (ACTIONS, LEVELS, CorrectionSpec, RejectionRule, correct, correction_log_ratio,
                                        mismatch_correction)
from nearpolicy.ops.losses import PolicyLossInput, PolicyLossParams, policy_loss, required_aggregation
from nearpolicy.ops.masked import aggregation_denominator
from nearpolicy.ops.proximal import proximal_logprobs

torch.set_default_dtype(torch.float64)  # for module-level constants; tests: conftest._default_dtype
DEFAULT_DTYPE = torch.float64
RULES = (RejectionRule("k3", "seq_mean", upper=0.05), RejectionRule("k1", "token", -0.6, 0.6),
         RejectionRule("k2", "seq_max", upper=0.3), RejectionRule.ratio("seq_sum", 0.3, 3.0))


def _case(seed=0, B=6, T=8, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.2 * torch.randn(B, T, generator=g)
    rollout = old + scale * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False
    has = torch.rand(B, T, generator=g) > 0.1
    return lp, old, rollout, mask, has


def _ref_correct(spec, log_rho, defined, mask):
    """Plain-Python reference of `correct`: (weights, keep) as nested lists."""
    B, T = log_rho.shape
    W, K = [], []
    for i in range(B):
        d = [bool(defined[i, t] and mask[i, t]) for t in range(T)]
        lr = [max(-20.0, min(20.0, float(log_rho[i, t]))) if d[t] else 0.0 for t in range(T)]
        n = sum(d)
        stats = {"log_ratio": lr, "k1": [-x for x in lr], "k2": [0.5 * x * x for x in lr],
                 "k3": [math.exp(x) - 1 - x for x in lr]}
        seq_reject = False
        tok_reject = [False] * T
        for rule in spec.rejections:
            st = [stats[rule.statistic][t] for t in range(T)]
            vals = [st[t] for t in range(T) if d[t]]
            if rule.level == "token":
                for t in range(T):
                    tok_reject[t] |= d[t] and not rule.lower <= st[t] <= rule.upper
                continue
            agg = {"seq_sum": sum(vals), "seq_mean": sum(vals) / n if n else 0.0,
                   "seq_max": max(vals) if vals else 0.0}[rule.level]
            seq_reject |= not rule.lower <= agg <= rule.upper
        if spec.veto is not None:
            seq_reject |= any(d[t] and lr[t] < math.log(spec.veto) for t in range(T))
        wrow, krow = [], []
        for t in range(T):
            if spec.level == "token":
                level = lr[t]
            elif spec.level == "sequence":
                level = max(-20.0, min(20.0, sum(lr)))
            elif spec.level == "geometric":
                level = sum(lr) / n if n else 0.0
            elif spec.level == "prefix_geometric":
                c = sum(d[: t + 1])
                level = sum(lr[: t + 1]) / c if c else 0.0
            else:
                prev = [lr[j] for j in range(t + (1 if spec.prefix_inclusive else 0)) if d[j]]
                level = min(prev) if prev else 0.0
            ratio = math.exp(max(-20.0, min(20.0, level)))
            reject = tok_reject[t] or seq_reject
            w = {"off": 1.0, "none": ratio, "truncate": min(max(ratio, spec.lower), spec.upper), "mask": ratio}[spec.action]
            if spec.action == "mask" and not spec.lower <= ratio <= spec.upper and (d[t] or spec.level != "token"):
                reject = True
            if spec.level == "token" and not d[t]:
                w = 1.0
            w = (1 - spec.mix) + spec.mix * w
            keep = bool(mask[i, t]) and not reject
            wrow.append(w if keep else (0.0 if mask[i, t] else 1.0))
            krow.append(keep)
        W.append(wrow)
        K.append(krow)
    return torch.tensor(W), torch.tensor(K)


SPECS = [CorrectionSpec(level, action, 0.7, 1.5) for level, action in itertools.product(LEVELS, ACTIONS)]
SPECS += [CorrectionSpec("prefix_min", "none", prefix_inclusive=True), CorrectionSpec("token", "truncate", 0.5, 2.0, veto=0.5),
          CorrectionSpec("geometric", "mask", 0.8, 1.2, rejections=RULES), CorrectionSpec("token", "none", rejections=RULES, mix=0.3)]
SPECS += [CorrectionSpec("token", "off", rejections=(rule,)) for rule in RULES]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.level}-{s.action}-{len(s.rejections)}-{s.veto}-{s.mix}")
@pytest.mark.parametrize("seed", [0, 1])
def test_correct_matches_loop_reference(spec, seed):
    lp, old, rollout, mask, has = _case(seed, scale=0.4 if seed else 0.15)
    log_rho, defined = correction_log_ratio("decoupled", lp, old, rollout, mask, has)
    out = correct(spec, log_rho, defined, mask)
    w_ref, k_ref = _ref_correct(spec, log_rho, defined, mask)
    assert torch.equal(out.keep, k_ref)
    assert torch.allclose(out.weights, w_ref, rtol=1e-13, atol=0)
    assert not out.weights.requires_grad


def test_rejection_rules_are_not_vacuous_on_the_random_case():
    lp, old, rollout, mask, has = _case(1, scale=0.4)
    log_rho, defined = correction_log_ratio("decoupled", lp, old, rollout, mask, has)
    for rule in RULES:
        keep = correct(CorrectionSpec(rejections=(rule,)), log_rho, defined, mask).keep
        assert 0 < (mask & ~keep).sum() < mask.sum(), rule


def test_hand_computed_levels():
    rho = torch.tensor([[2.0, 0.5, 4.0, 1.0]])
    log_rho = rho.log()
    defined = torch.tensor([[True, True, True, False]])  # last token: no engine log-prob
    mask = torch.ones(1, 4, dtype=torch.bool)
    w = lambda level, **kw: correct(CorrectionSpec(level, "none", **kw), log_rho, defined, mask).weights[0]  # noqa: E731
    assert torch.allclose(w("token"), torch.tensor([2.0, 0.5, 4.0, 1.0]), rtol=1e-15)
    assert torch.allclose(w("sequence"), torch.full((4,), 4.0), rtol=1e-15)
    assert torch.allclose(w("geometric"), torch.full((4,), 4.0 ** (1 / 3)), rtol=1e-15)  # over defined tokens only
    assert torch.allclose(w("prefix_min"), torch.tensor([1.0, 2.0, 0.5, 0.5]), rtol=1e-15)
    assert torch.allclose(w("prefix_min", prefix_inclusive=True), torch.tensor([2.0, 0.5, 0.5, 0.5]), rtol=1e-15)
    assert torch.allclose(w("prefix_geometric"), torch.tensor([2.0, 1.0, 4 ** (1 / 3), 4 ** (1 / 3)]), rtol=1e-15)
    seq_mis = correct(CorrectionSpec("sequence", "mask", 0.0, 2.0), log_rho, defined, mask)
    assert not seq_mis.keep.any() and torch.equal(seq_mis.weights, torch.zeros(1, 4))
    tis = correct(correction_spec("tis"), log_rho, defined, mask).weights[0]
    assert torch.allclose(tis, torch.tensor([2.0, 0.5, 2.0, 1.0]), rtol=1e-15)
    icepop = correct(correction_spec("icepop"), log_rho, defined, mask)
    assert torch.allclose(icepop.weights[0], torch.tensor([2.0, 0.5, 4.0, 1.0]), rtol=1e-15) and icepop.keep.all()
    mis = correct(correction_spec("token_mis"), log_rho, defined, mask)
    assert torch.equal(mis.keep[0], torch.tensor([True, True, False, True]))
    assert mis.metrics["correction/rejected_frac"].item() == pytest.approx(1 / 3)
    veto = correct(CorrectionSpec(veto=0.6), log_rho, defined, mask)  # 0.5 < 0.6 vetoes the sequence
    assert not veto.keep.any() and veto.metrics["correction/vetoed"].item() == 1.0


def test_geo_rs_and_seq_mask_tis_hand_computed():
    log_rho = torch.tensor([[0.0015, -0.0005], [0.0004, 0.0004], [0.0030, 0.0]])  # geometric means 5e-4, 4e-4, 1.5e-3
    ones = torch.ones(3, 2, dtype=torch.bool)
    geo = correct(correction_spec("geo_rs"), log_rho, ones, ones)
    assert torch.equal(geo.keep.all(-1), torch.tensor([True, True, False]))
    assert torch.equal(geo.weights, torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    smt = correct(correction_spec("seq_mask_tis"), log_rho, ones, ones)  # bounds [0.999, 1.002]: all kept
    assert smt.keep.all() and torch.allclose(smt.weights, log_rho.exp(), rtol=1e-15)
    lr, two = torch.tensor([[-0.5, -0.2, 0.0]]), torch.tensor([[True, True, False]])  # third token: no engine log-prob
    keep = lambda lower: correct(CorrectionSpec(rejections=(RejectionRule("log_ratio", "seq_max", lower),)), lr, two,  # noqa: E731
                                 torch.ones(1, 3, dtype=torch.bool)).keep.all().item()
    assert keep(-0.3) and not keep(-0.1)  # max over defined tokens is -0.2
    k3 = correct(correction_spec("k3_rs"), torch.tensor([[0.5, 0.5], [0.1, -0.1]]), ones[:2], ones[:2])
    assert torch.equal(k3.keep.all(-1), torch.tensor([False, True]))  # mean k3 0.149 > 0.01, 0.005 <= 0.01


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_all_ratios_one_every_preset_equals_the_uncorrected_loss(name):
    lp, _, _, mask, has = _case(3)
    old = lp.detach().clone() - 0.0
    spec = correction_spec(name)
    result = mismatch_correction(spec, lp, old, old.clone(), mask, has)
    prox = proximal_logprobs("old", spec.mode, lp, old, old.clone(), has)
    assert torch.equal(result.weights, torch.ones_like(lp)) and torch.equal(result.keep, mask)
    adv = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(1))
    for loss_name in ("ppo_clip", "reinforce", "gspo"):
        mode = required_aggregation(loss_name) or "token-mean"
        a, _ = policy_loss(loss_name, PolicyLossInput(lp + 0.1, prox, adv, result.keep, result.keep.sum(), result.weights),
                           PolicyLossParams(), mode, aggregation_denominator(result.keep, mode))
        b, _ = policy_loss(loss_name, PolicyLossInput(lp + 0.1, old, adv, mask, mask.sum()), PolicyLossParams(), mode,
                           aggregation_denominator(mask, mode))
        assert a.item() == b.item()


@pytest.mark.parametrize("level", LEVELS)
def test_infinite_bounds_are_a_no_op(level):
    lp, old, rollout, mask, has = _case(4)
    log_rho, defined = correction_log_ratio("decoupled", lp, old, rollout, mask, has)
    plain = correct(CorrectionSpec(level, "none"), log_rho, defined, mask)
    for action in ("truncate", "mask"):
        out = correct(CorrectionSpec(level, action, 0.0, math.inf), log_rho, defined, mask)
        assert torch.equal(out.weights, plain.weights) and torch.equal(out.keep, plain.keep)
    rules = tuple(RejectionRule(s, lv) for s in ("log_ratio", "k1", "k2", "k3") for lv in ("token", "seq_sum", "seq_mean", "seq_max"))
    out = correct(CorrectionSpec(level, "none", rejections=rules), log_rho, defined, mask)
    assert torch.equal(out.weights, plain.weights) and torch.equal(out.keep, mask)


@pytest.mark.parametrize("spec", SPECS[:: 3], ids=lambda s: f"{s.level}-{s.action}")
def test_nan_inf_at_masked_or_missing_positions_change_nothing(spec):
    lp, old, rollout, mask, has = _case(5)
    base = mismatch_correction(spec, lp, old, rollout, mask, has)
    bad_roll = rollout.masked_fill(~has, float("nan")).masked_fill(~mask, float("-inf"))
    bad_old = old.masked_fill(~mask, float("inf"))
    out = mismatch_correction(spec, lp, bad_old, bad_roll, mask, has)
    assert torch.equal(out.weights, base.weights) and torch.equal(out.keep, base.keep)
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_missing_engine_logprob_gets_weight_exactly_one_and_is_never_rejected():
    log_rho = torch.tensor([[3.0, 0.0]])
    defined = torch.tensor([[True, False]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for action in ACTIONS:
        out = correct(CorrectionSpec("token", action, 1.5, 2.0, rejections=(RejectionRule("k1", "token", -0.1, 0.1),)),
                      log_rho, defined, mask)
        assert out.weights[0, 1].item() == 1.0 and out.keep[0, 1]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.level}-{s.action}-{len(s.rejections)}")
def test_micro_batch_rows_equal_full_batch_rows(spec):
    lp, old, rollout, mask, has = _case(6)
    full = mismatch_correction(spec, lp, old, rollout, mask, has)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part = mismatch_correction(spec, lp[rows], old[rows], rollout[rows], mask[rows], has[rows])
        assert torch.equal(part.weights, full.weights[rows]) and torch.equal(part.keep, full.keep[rows])


def test_decoupled_and_bypass_modes_use_the_right_logprobs():
    lp, old, rollout, mask, has = _case(7)
    lp.requires_grad_(True)
    dec, d_def = correction_log_ratio("decoupled", lp, old, rollout, mask, has)
    byp, _ = correction_log_ratio("bypass", lp, old, rollout, mask, has)
    assert torch.equal(dec, torch.where(d_def, old - rollout, 0.0))
    assert torch.equal(byp, torch.where(d_def, lp.detach() - rollout, 0.0)) and not byp.requires_grad
    assert torch.equal(proximal_logprobs("old", "decoupled", lp, old, rollout, has), old)
    assert torch.equal(proximal_logprobs("old", "bypass", lp, old, rollout, has), torch.where(has, rollout, old))
    out = mismatch_correction(correction_spec("tis", mode="bypass"), lp, old, rollout, mask, has)
    assert not out.weights.requires_grad
    old_g = old.clone().requires_grad_(True)  # invariant 11: pi_old, detached, even if it carries a graph
    dec_out = mismatch_correction(correction_spec("token_is"), lp, old_g, rollout, mask, has)
    expected = torch.where(mask & has, torch.exp(old - rollout), 1.0)
    assert not dec_out.weights.requires_grad and torch.allclose(dec_out.weights, expected, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="bypass"):
        correction_log_ratio("both", lp, old, rollout, mask, has)


def test_areal_decoupled_loss_matches_loop_reference():
    """sum_t rho_t * PPOclip(r_t) / N with rho = exp(old - rollout), r = exp(lp - old) (AReaL decoupled PPO)."""
    lp, old, rollout, mask, has = _case(8)
    has = torch.ones_like(mask)
    adv = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(2))
    out = mismatch_correction(correction_spec("token_is"), lp, old, rollout, mask, has)
    loss, _ = policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, out.keep, mask.sum(), out.weights),
                          PolicyLossParams(0.2, 0.2, None))
    total = 0.0
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        r, rho, a = math.exp(lp[i, t] - old[i, t]), math.exp(old[i, t] - rollout[i, t]), float(adv[i])
        total += rho * max(-a * r, -a * min(max(r, 0.8), 1.2))
    assert loss.item() == pytest.approx(total / mask.sum().item(), rel=1e-12)


def test_mix_interpolates_between_uncorrected_and_corrected_loss():
    lp, old, rollout, mask, has = _case(9)
    adv = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(3))

    def loss(mix):
        out = mismatch_correction(CorrectionSpec("token", "truncate", 0.0, 2.0, mix=mix), lp, old, rollout, mask, has)
        return policy_loss("ppo_clip", PolicyLossInput(lp, old, adv, mask, mask.sum(), out.weights), PolicyLossParams())[0]

    assert loss(0.3).item() == pytest.approx(0.7 * loss(0.0).item() + 0.3 * loss(1.0).item(), rel=1e-12)


def test_registry_and_spec_validation():
    assert {"tis", "token_mis", "seq_tis", "seq_mis", "icepop", "geo_rs", "seq_mask_tis", "k3_rs", "minpro", "pnpo_weight"} <= set(
        CORRECTIONS.names())
    assert correction_spec("tis", upper=8.0).upper == 8.0
    for entry in CORRECTIONS:
        assert entry.summary and entry.source and isinstance(entry.fn(), CorrectionSpec)
    with pytest.raises(KeyError, match="icepop"):
        correction_spec("nope")
    with pytest.raises(ValueError, match="lower < upper"):
        CorrectionSpec("token", "truncate", 2.0, 1.0)
    with pytest.raises(ValueError, match="veto"):
        CorrectionSpec(veto=1.5)
    with pytest.raises(ValueError, match="level"):
        CorrectionSpec("prefix", "none")
