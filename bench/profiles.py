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
    return ["Decode steps by the number of sequences in the call (one token each; the batch shrinks as sequences "
            "stop, so a run's tokens/s mixes these rates): for llama.cpp the sequences still generating, rates from "
            "llama_decode time only; for the hf engine the rows of its batch (finished rows stay until the live "
            "ones fall under 3/4 of them), rates from its decode-step time only.", "",
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


def _why(res: dict, d: dict, missed: list[str]) -> list[str]:
    """One paragraph per missed speed target, computed from this run's profiles."""
    out = []
    roll, bound = res.get("rollout", {}), d.get("decode_bound_tokens_per_s")
    nps = {n: r for n, r in roll.items() if n.startswith("nearpolicy")}
    best_name = max(nps, key=lambda n: nps[n]["tokens_per_s"]["median"], default=None)
    if "rollout vs the decoding compute bound" in missed and best_name:
        p = nps[best_name].get("profile") or {}
        share = p.get("forward_s", 0) / p["total_s"] if p.get("total_s") else 0.0
        from nearpolicy.engines.factory import kind_of

        kind = best_name.split()[-1].split(":")[0]  # "nearpolicy llamacpp:q8_0" -> "llamacpp"
        llama = kind_of(kind).loads == "gguf"  # a GGUF-loading engine: llama.cpp's decode call; else hf's torch steps
        where = "llama.cpp's decode call" if llama else "the hf engine's prefill and decode steps (torch forward)"
        engine = "llama.cpp" if llama else "the decode step"
        text = (f"**Rollout vs the decoding bound.** {100 * share:.0f}% of {best_name}'s rollout time is inside "
                f"{where}, so the gap is {engine}'s speed at the batch it is given, not nearpolicy's "
                "sampling loop. That batch shrinks as sequences stop (one GRPO step's prompts x G sequences, no new "
                "requests to refill the slots), and a decode call with few sequences costs much more per token than a "
                "full one.")
        steps = p.get("decode_steps")
        if steps and bound:
            buckets = decode_step_buckets(steps)
            calls, tokens = sum(b[2] for b in buckets), sum(b[3] for b in buckets)
            full, tail = buckets[-1], buckets[0]
            text += (f" Here the mean decode call carried {tokens / calls:.1f} sequences; calls with {full[0]}-{full[1]} "
                     f"sequences ran at {full[3] / full[4]:.0f} tokens/s ({100 * full[3] / full[4] / bound:.0f}% of the "
                     f"bound), calls with {tail[0]}-{tail[1]} at {tail[3] / tail[4]:.0f} tokens/s "
                     f"({100 * tail[3] / tail[4] / bound:.0f}%). ")
            text += ("Where even full calls stay below the target, the gap is llama.cpp's own arithmetic rate: the "
                     "bound is torch's fp32 GEMM peak, which uses AVX-512 where the CPU has it, while the pinned "
                     "llama.cpp build runs AVX2 kernels (docs/results.md sec. 6)." if llama else
                     "A decode step reads every weight once whatever its batch, so the calls of the rollout's tail, "
                     "with few sequences left, cost almost as much as full ones: their floor is the memory "
                     "bandwidth, not the arithmetic the bound counts (docs/results.md sec. 13).")
        else:
            text += " The decode-step profile by batch size was not recorded in this run (see docs/bench/decode-steps.md)."
        out += [text, ""]
    grpo = res.get("grpo", {})
    if "GRPO step vs TRL" in missed and "phases" in grpo.get("nearpolicy", {}) and "trl" in grpo:
        step, ph = grpo["nearpolicy"]["step_s"]["median"], grpo["nearpolicy"]["phases"]
        update, trl = ph["update"]["median"], grpo["trl"]["step_s"]["median"]
        engine = ph["rollout"]["median"] + ph["sync"]["median"]
        out += [f"**GRPO step vs TRL.** The update (forward + backward over prompt and completion tokens: the same "
                f"PyTorch model and the same kind of tokens TRL updates on) takes {update:.1f} s of nearpolicy's "
                f"{step:.1f} s step; the {TARGETS['grpo_step_vs_trl']:.2f}x target allows "
                f"{TARGETS['grpo_step_vs_trl'] * trl:.1f} s in all ({update / trl:.2f}x TRL's {trl:.1f} s for the update "
                f"alone), so {step - TARGETS['grpo_step_vs_trl'] * trl:.1f} s would have to go. Rollout plus "
                f"weight sync take {engine:.1f} s, against about {trl - update:.1f} s that TRL spends outside an update "
                "of the same length (its generate and log-prob forward; estimated as TRL's step minus nearpolicy's "
                "update, TRL's phases are not timed separately).", ""]
    return out


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
    if d.get("grpo_step_ratio_equal_length", {}).get("median", 0) > TARGETS["grpo_step_equal_length_vs_trl"]:
        missed.append("GRPO step vs TRL at equal length")
    if d.get("diagnostics_overhead", {}).get("median", 0) > TARGETS["diagnostics_overhead"]:
        missed.append("diagnostics overhead")
    if d.get("trainer_vs_gemm_peak", 1) < TARGETS["trainer_vs_gemm_peak"]:
        missed.append("trainer vs GEMM peak")
    lines = ["## Where the time goes", ""]
    lines.append(f"Targets missed in this run: {', '.join(missed)}." if missed else "All targets met in this run.")
    lines.append("")
    lines += _why(res, d, missed)
    lines += (_rollout_profile(roll) + _decode_step_profile(roll, d.get("decode_bound_tokens_per_s"))
              + _grpo_profile(res.get("grpo", {})) + _trainer_profile(res.get("trainer")))
    if res.get("failures"):
        lines += ["## Failed measurements", ""] + [f"- `{f}`" for f in res["failures"]] + [""]
    return "\n".join(lines)
