"""The checks, verdict, JSON report and markdown table of `diagnose --endpoint` (diagnosis/endpoint.py,
docs/diagnose.md).

Verdict: the endpoint is admitted when every check passes:
- **k3**: the token-mean k3 KL(mu || pi) on the sampled tokens <= the budget (diagnosis/admission.py, the same rule
  as `nearpolicy diagnose`);
- **distribution**: the mean per-position lower bound on KL(mu || pi) that the server's top-k log-probs imply
  (ops/distribution_checks.topk_bounds) <= the budget; a bound, so no sampling noise can push it over;
- **sampler temperature**: the maximum-likelihood temperature of the sampled tokens under the reference's logits is
  within TEMPERATURE_TOLERANCE of the claimed one, or not significantly off (|z| <= TEMPERATURE_Z);
- **support**: no sampled token lies outside the claimed top-k / top-p support by more than the tolerances
  (TOPK_GAP_TOLERANCE nats of scaled logit, TOPP_EXCESS_TOLERANCE of probability mass), which absorb the engine's
  numerical difference at the boundary.
The re-tokenization row is reported, never part of k3 nor of the verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from nearpolicy.diagnosis.admission import admitted, make_budget, verdict_line
from nearpolicy.ops.distribution_checks import fit_temperature

TEMPERATURE_TOLERANCE = 0.05  # relative difference of the fitted temperature that counts as a different sampler
TEMPERATURE_Z = 4.0  # ... when also this many standard errors off (score test)
TOPK_GAP_TOLERANCE = 0.5  # nats of scaled logit below the k-th largest
TOPP_EXCESS_TOLERANCE = 0.02  # probability mass ranked above the token beyond top_p


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float(values[mask].mean()) if mask.any() else float("nan")


def checks(scored: dict, claimed, diagnose_settings, response_tokens: int, k: int) -> dict:
    """The sampler, support and distribution checks from endpoint.score's output, each a JSON-ready dict with
    `passed`, and the budget (admission.make_budget) they and k3 are judged against."""
    budget = make_budget(math.nan, response_tokens, absolute=diagnose_settings.budget_k3,
                         seq_ess_min=diagnose_settings.budget_seq_ess)
    fit = {key: float(v) for key, v in fit_temperature(scored["fit"], claimed.temperature).items()}
    off = abs(fit["temperature"] - claimed.temperature) > TEMPERATURE_TOLERANCE * claimed.temperature
    sampler = fit | {"claimed": claimed.temperature, "passed": not (off and abs(fit["z"]) > TEMPERATURE_Z)}
    s = scored["support"]
    active = (0 < claimed.top_k) or claimed.top_p < 1.0
    violation = s["outside"] & ((s["topk_gap"] > TOPK_GAP_TOLERANCE) | (s["topp_excess"] > TOPP_EXCESS_TOLERANCE))
    support = {"active": active, "top_k": claimed.top_k, "top_p": claimed.top_p, "tokens": int(len(s["outside"])),
               "outside": int(s["outside"].sum()), "violations": int(violation.sum()),
               "max_topk_gap": float(s["topk_gap"].max()) if len(s["topk_gap"]) else 0.0,
               "max_topp_excess": float(s["topp_excess"].max()) if active and len(s["topp_excess"]) else 0.0,
               "passed": not bool(violation.any())}
    b = scored["bounds"]
    listed = b["defined"] & (b["listed"] > 0)
    distribution = {"available": bool(listed.any()), "top_logprobs": k, "positions": int(listed.sum()),
                    "passed": True}
    if listed.any():
        distribution |= {key: _mean(b[key], listed) for key in ("tv_lower", "kl_lower", "kl_reverse_lower",
                                                                "engine_mass", "ref_mass", "top1_agree",
                                                                "topk_overlap")}
        distribution |= {"tv_lower_max": float(b["tv_lower"][listed].max()),
                         "kl_lower_max": float(b["kl_lower"][listed].max()),
                         "passed": distribution["kl_lower"] <= budget.k3}
    return {"budget": budget, "sampler": sampler, "support": support, "distribution": distribution}


def retokenization_row(identity, delta: dict) -> dict:
    """The re-tokenization (token identity) row: how ids were obtained and what a text round trip changes."""
    return {"ids_from": identity.ids_from, "prompt_sent_as": identity.prompt_sent_as,
            "completions": identity.completions, "unmapped_completions": identity.unmapped_completions,
            "dropped_top_entries": identity.dropped_top_entries, "text_disagreements": identity.text_disagreements,
            **identity.details, **delta}


def endpoint_report(ctx, settings, served: str, url: str, reference: str, result, found: dict, drift: dict) -> dict:
    """The JSON report (strict JSON: NaN and inf as null): the endpoint's row (CandidateResult keys), each check,
    the budget, the verdict and its reasons, and what was sent."""
    budget = found["budget"]
    k3_ok = admitted(result.metrics["k3"], budget)
    reasons = [] if k3_ok else [verdict_line(result.candidate, result.metrics["k3"], budget)]
    if not found["distribution"]["passed"]:
        reasons.append(f"the server's top-{settings.top_logprobs} log-probs prove KL(mu || pi) >= "
                       f"{found['distribution']['kl_lower']:.3g} nats/token on average, over the budget {budget.k3:.3g}")
    if not found["sampler"]["passed"]:
        s = found["sampler"]
        reasons.append(f"the sampled tokens were drawn at temperature {s['temperature']:.3g} ± {s['se']:.2g}, not "
                       f"the claimed {s['claimed']:g} (score test z = {s['z']:.1f})")
    if not found["support"]["passed"]:
        s = found["support"]
        reasons.append(f"{s['violations']} of {s['tokens']} sampled tokens lie outside the claimed support (top-k "
                       f"{s['top_k']}, top-p {s['top_p']:g}): top-k gap up to {s['max_topk_gap']:.3g} nats, "
                       f"mass above them up to top-p + {s['max_topp_excess']:.3g}")
    ok = not reasons
    report = {"kind": "endpoint", "endpoint": url, "served_model": served, "reference_model": reference,
              "weights": str(settings.diagnose.weights) if settings.diagnose.weights else None,
              "logprobs_mode": settings.logprobs_mode, "prompts": len(ctx.prompts), "group_size": ctx.group_size,
              "sampling": asdict(ctx.sampling), "budget": asdict(budget),
              "endpoint_row": result.row() | {"admitted": ok}, "by_position": result.by_position,
              "checks": {"k3": {"k3": result.metrics["k3"], "budget": budget.k3, "passed": k3_ok},
                         "distribution": found["distribution"], "sampler": found["sampler"],
                         "support": found["support"]},
              "retokenization": drift, "admitted": ok, "verdict": "admitted" if ok else "rejected",
              "reasons": reasons or [verdict_line(result.candidate, result.metrics["k3"], budget)],
              "exit_code": 0 if ok else 1}
    return strict_json(report)


def strict_json(value):
    """`value` with every non-finite float replaced by None (JSON has no NaN / inf), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def endpoint_markdown(report: dict) -> str:
    """The verdict table (the same columns as `nearpolicy diagnose`), one row per check, then the verdict's reasons:
    what the command prints on stdout."""
    b, r, c, d = report["budget"], report["endpoint_row"], report["checks"], report["retokenization"]
    verdict = "admitted" if report["admitted"] else "REJECTED"
    lines = [f"endpoint {report['endpoint']} (model {report['served_model']}; prompt sent as {d['prompt_sent_as']}, "
             f"sampled ids from {d['ids_from']}; log-probs {report['logprobs_mode']})",
             f"budget: {b['rule']}", "",
             "| candidate | k3 (± s.e.) | k1 | chi2 | ESS | seq ESS | p99 abs dlogp | max abs dlogp | "
             "outside [0.5,2] | tokens | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|",
             f"| {r['candidate']} | {_fmt(r['k3'], '.3g')} ± {_fmt(r['k3_se'], '.1g')} | {_fmt(r['k1'], '.3g')} | "
             f"{_fmt(r['chi2'], '.3g')} | {_fmt(r['ess'], '.4f')} | {_fmt(r['seq_ess'], '.3f')} | "
             f"{_fmt(r['abs_logprob_diff_p99'], '.3g')} | {_fmt(r['abs_logprob_diff_max'], '.3g')} | "
             f"{_fmt(r['frac_ratio_outside_0.5_2'], '.2%')} | {r['tokens']:.0f} | {verdict} |", "",
             "| check | result | passed |", "|---|---|---|"]
    lines += [f"| {name} | {text} | {mark} |" for name, text, mark in _check_rows(c, d)]
    lines += ["", *(f"- {reason}" for reason in report["reasons"])]
    return "\n".join(lines)


def _check_rows(c: dict, d: dict):
    pass_mark = lambda ok: "yes" if ok else "**NO**"  # noqa: E731
    k3 = c["k3"]
    yield "k3 <= budget", f"{_fmt(k3['k3'], '.3g')} vs {_fmt(k3['budget'], '.3g')}", pass_mark(k3["passed"])
    dist = c["distribution"]
    if dist["available"]:
        text = (f"{dist['positions']} positions, top-{dist['top_logprobs']}: KL(mu‖pi) >= {_fmt(dist['kl_lower'], '.3g')} "
                f"(max {_fmt(dist['kl_lower_max'], '.3g')}), TV >= {_fmt(dist['tv_lower'], '.3g')} (max "
                f"{_fmt(dist['tv_lower_max'], '.3g')}); top-k mass engine {_fmt(dist['engine_mass'], '.4f')} / "
                f"reference {_fmt(dist['ref_mass'], '.4f')}; top-1 agree {_fmt(dist['top1_agree'], '.2%')}, "
                f"top-k overlap {_fmt(dist['topk_overlap'], '.2%')}")
    else:
        text = "n/a: the server listed no top log-probs"
    yield "full distribution (top-k bounds)", text, pass_mark(dist["passed"])
    s = c["sampler"]
    yield ("sampler temperature (ML fit)", f"{_fmt(s['temperature'], '.4g')} ± {_fmt(s['se'], '.2g')} (claimed "
           f"{s['claimed']:g}; z = {_fmt(s['z'], '.2f')})", pass_mark(s["passed"]))
    sup = c["support"]
    text = (f"{sup['outside']} of {sup['tokens']} outside top-k {sup['top_k']} / top-p {sup['top_p']:g} "
            f"({sup['violations']} beyond the tolerances)" if sup["active"] else "n/a: no top-k / top-p claimed")
    yield "sampled token inside the claimed support", text, pass_mark(sup["passed"])
    text = (f"ids from {d['ids_from']}; {d['unmapped_completions']} of {d['completions']} completions unmapped "
            f"(left out); prompts drifted {d.get('prompts_drifted', 0)} of {d.get('prompts', '-')} "
            f"({d.get('prompt_ids_from', '-')}); a text round trip changes {d.get('completions_changed', 0)} of "
            f"{d.get('completions_checked', 0)} completions")
    if d.get("completions_changed"):
        text += f" (mean abs seq log p change {_fmt(d.get('seq_logprob_delta_mean_abs'), '.3g')} nats)"
    yield "re-tokenization (not in k3)", text, "info"
