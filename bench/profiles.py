"""The "where the time goes" section of docs/benchmarks.md, written from the profiles the workers collect:
the share of rollout time in the model evaluation call (timer around llama.cpp's decode / the torch forward),
the torch profiler's top operators of one trainer forward + backward, and the GRPO phase timings.
Pure: takes the results dict, returns markdown."""

from __future__ import annotations

from harness import TARGETS, md_table, fmt


def _rollout_profile(roll: dict) -> list[str]:
    rows = []
    for name, r in roll.items():
        p = r.get("profile")
        if p and p.get("total_s"):
            share = p["forward_s"] / p["total_s"]
            rows.append([name, p["forward"], f"{100 * share:.0f}%", f"{100 * (1 - share):.0f}%"])
    if not rows:
        return []
    return ["Rollout: share of the run spent in the model evaluation call (timer around it in the same runs); the "
            "rest is sampling, log-prob extraction and bookkeeping.", "",
            md_table(["configuration", "model evaluation", "share", "rest"], rows), ""]


def decode_step_buckets(steps: dict, bucket: int = 8) -> list[tuple[int, int, int, float, float]]:
    """Decode calls grouped by active sequences (1-8, 9-16, ...): (low, high, calls, tokens, seconds).
    `steps` maps "sequences in the call" (str or int) to [calls, seconds]."""
    out: dict[int, list[float]] = {}
    for n, (calls, seconds) in steps.items():
        b = (int(n) - 1) // bucket
        acc = out.setdefault(b, [0, 0, 0.0])
        acc[0] += calls
        acc[1] += calls * int(n)
        acc[2] += seconds
    return [(b * bucket + 1, (b + 1) * bucket, int(c), int(t), s) for b, (c, t, s) in sorted(out.items())]


def _decode_step_profile(roll: dict, bound: float | None) -> list[str]:
    rows = []
    for name, r in roll.items():
        steps = (r.get("profile") or {}).get("decode_steps")
        if not steps:
            continue
        for low, high, calls, tokens, seconds in decode_step_buckets(steps):
            rate = tokens / seconds if seconds else 0.0
            rows.append([name, f"{low}-{high}", str(calls), f"{1e3 * seconds / calls:.0f}", f"{rate:.0f}",
                         "n/a" if not bound else f"{100 * rate / bound:.0f}%"])
    if not rows:
        return []
    return ["llama.cpp decode steps by the number of sequences still generating (one token each; the batch shrinks "
            "as sequences stop, so a run's tokens/s mixes these rates). Rates are llama_decode time only.", "",
            md_table(["configuration", "active sequences", "decode calls", "ms / call", "tokens/s", "of decode bound"],
                     rows), ""]


def _trainer_profile(tr: dict) -> list[str]:
    if not tr or not tr.get("profile"):
        return []
    rows = [[f"`{e['op']}`", f"{e['self_ms']:.1f}", f"{100 * e['share']:.1f}%"] for e in tr["profile"]]
    return ["Trainer forward + backward: torch profiler, self CPU time of the top operators in one step.", "",
            md_table(["operator", "self ms", "share"], rows), ""]


def _grpo_profile(grpo: dict) -> list[str]:
    g = grpo.get("nearpolicy")
    if not g or "phases" not in g:
        return []
    step = g["step_s"]["median"]
    rows = [[k, fmt(v, 2), f"{100 * v['median'] / step:.0f}%"] for k, v in g["phases"].items()]
    rest = step - sum(v["median"] for v in g["phases"].values())
    rows.append(["scoring, collation, logging (rest)", f"{rest:.2f}", f"{100 * rest / step:.0f}%"])
    return ["nearpolicy GRPO step by phase (the trainer's own timers, `time/*` in metrics.jsonl).", "",
            md_table(["phase", "s / step", "share"], rows), ""]


def notes(res: dict, d: dict) -> str:
    """Missed targets and the profiles that explain them; always includes the profiles for reference."""
    missed = []
    roll = res.get("rollout", {})
    nps = {n: r for n, r in roll.items() if n.startswith("nearpolicy")}
    best = max(nps.values(), key=lambda r: r["tokens_per_s"]["median"], default=None)
    if best is not None and best.get("vs_generate", {}).get("median", 1e9) < TARGETS["rollout_vs_generate"]:
        missed.append("rollout vs generate")
    if best is not None and best["vs_decode_bound"] < TARGETS["rollout_vs_decode_bound"]:
        missed.append("rollout vs the decoding compute bound")
    if d.get("grpo_step_ratio", {}).get("median", 0) > TARGETS["grpo_step_vs_trl"]:
        missed.append("GRPO step vs TRL")
    if d.get("diagnostics_overhead", {}).get("median", 0) > TARGETS["diagnostics_overhead"]:
        missed.append("diagnostics overhead")
    if d.get("trainer_vs_gemm_peak", 1) < TARGETS["trainer_vs_gemm_peak"]:
        missed.append("trainer vs GEMM peak")
    lines = ["## Where the time goes", ""]
    lines.append(f"Targets missed in this run: {', '.join(missed)}." if missed else "All targets met in this run.")
    lines.append("")
    lines += (_rollout_profile(roll) + _decode_step_profile(roll, d.get("decode_bound_tokens_per_s"))
              + _grpo_profile(res.get("grpo", {})) + _trainer_profile(res.get("trainer")))
    if res.get("failures"):
        lines += ["## Failed measurements", ""] + [f"- `{f}`" for f in res["failures"]] + [""]
    return "\n".join(lines)
