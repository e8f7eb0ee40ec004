"""Pure parts of the benchmark harness: summaries (median / min / max), FLOP arithmetic, targets, and the
markdown report. No model, no timing; tests/test_bench_harness.py exercises all of it.

FLOP conventions (stated once, used everywhere):
- GEMM: an [n, n] x [n, n] fp32 matmul is 2 n^3 FLOPs.
- Decoding compute bound: a generated token costs 2 x parameters FLOPs (one multiply-add per weight; the
  tied embedding counts once, as the LM head matmul; attention over the KV cache is ignored), so the bound is
  GEMM peak / (2 x parameters) tokens/s.
- Training: forward + backward of one token is 6 x parameters + 12 x layers x hidden x sequence length FLOPs
  (Kaplan et al. 2020 / PaLM appendix B: 2N forward, 4N backward, plus the attention score and value matmuls
  taken over the full, not causal, length).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

TARGETS = {
    "rollout_vs_generate": 2.0,  # nearpolicy rollout with log-probs / transformers generate, same batch
    "rollout_vs_decode_bound": 0.40,  # rollout tokens/s / (GEMM peak / (2 x params)) at prompts x G
    "grpo_step_vs_trl": 0.33,  # nearpolicy step time / TRL step time (issue 19)
    "grpo_step_equal_length_vs_trl": 0.33,  # the same, every response exactly the token limit on both sides (issue 39)
    "diagnostics_overhead": 0.02,  # mismatch metrics time / step time
    "trainer_vs_gemm_peak": 0.50,  # achieved forward+backward FLOP/s / GEMM peak
}


def summarize(values: Sequence[float]) -> dict:
    """{"median", "min", "max", "n", "values"} of a non-empty list of measurements. Raises ValueError if empty."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("summarize needs at least one value")
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals), "values": vals}


def gemm_flops_per_s(n: int, seconds: float) -> float:
    """FLOP/s of one [n, n] x [n, n] matmul that took `seconds`."""
    return 2.0 * n**3 / seconds


HF_ARM = "nearpolicy-hf-bf16"  # the GRPO arm with the in-process bf16 engine (docs/results.md sec. 13)
EQUAL_ARMS = ("nearpolicy-equal-length", "trl-equal-length")  # every response exactly L tokens on both sides


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) with linear interpolation between order statistics (numpy's and torch's default
    method). Raises ValueError if empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("quantile needs at least one value")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def length_stats(lengths: Sequence[int], truncated: Sequence[bool]) -> dict:
    """One step's response-length distribution: {"response_tokens" (mean), "response_p50", "response_p90",
    "truncated_share" (share cut at the token limit), "trained_tokens" (sum: the completion tokens the step trains
    on)}, lengths in tokens. Raises ValueError if empty or of different sizes."""
    if len(lengths) != len(truncated) or not lengths:
        raise ValueError(f"{len(lengths)} lengths and {len(truncated)} truncation flags")
    return {"response_tokens": statistics.fmean(lengths), "response_p50": quantile(lengths, 0.5),
            "response_p90": quantile(lengths, 0.9), "truncated_share": sum(map(bool, truncated)) / len(truncated),
            "trained_tokens": float(sum(lengths))}


def seconds_per_1k_tokens(step_s: Sequence[float], trained_tokens: Sequence[float]) -> float:
    """Seconds per 1000 trained completion tokens over a run's timed steps: 1000 x sum(step s) / sum(tokens)."""
    return 1000.0 * sum(step_s) / max(sum(trained_tokens), 1e-9)


def decode_bound_tokens_per_s(gemm_flops: float, parameters: int) -> float:
    """The compute bound for decoding, tokens/s: GEMM peak / (2 x parameters)."""
    return gemm_flops / (2.0 * parameters)


def train_flops_per_token(parameters: int, layers: int, hidden: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one token at sequence length `seq_len`: 6 N + 12 layers hidden seq_len."""
    return 6.0 * parameters + 12.0 * layers * hidden * seq_len


def step_times(rows: list[dict], skip_first: bool = True) -> list[float]:
    """Seconds per GRPO step from nearpolicy metrics.jsonl rows: time/step minus time/eval (the held-out eval
    of the last step is not part of a step); step 0 (the eval-only row) dropped, and the first step (warm-up)
    too when `skip_first` and more than one step ran."""
    steps = [r for r in rows if r.get("step", 0) >= 1 and "time/step" in r]
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    return [r["time/step"] - r.get("time/eval", 0.0) for r in steps]


def ratio(a: dict, b: dict) -> dict:
    """Ratio of two summaries: median / median, with the extreme ratios min_a / max_b and max_a / min_b."""
    return {"median": a["median"] / b["median"], "min": a["min"] / b["max"], "max": a["max"] / b["min"]}


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "missed"


def fmt(s: dict | None, digits: int = 1, scale: float = 1.0) -> str:
    """"median (min-max)" of a summary, values divided by `scale`; "n/a" for None."""
    if s is None:
        return "n/a"
    m, lo, hi = (s[k] / scale for k in ("median", "min", "max"))
    if s.get("n", 2) == 1 or lo == hi:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def fmt_mib(kib: int | float | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.0f}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def derive(res: dict) -> dict:
    """Ratios and target verdicts from the raw results of one harness run (see run_all.py for the layout)."""
    out: dict = {}
    gemm = res["gemm"]["gflops"]
    params = res["model"]["parameters"]
    bound = decode_bound_tokens_per_s(gemm["median"] * 1e9, params)
    out["decode_bound_tokens_per_s"] = bound
    roll = res.get("rollout", {})
    base = roll.get("transformers-generate")
    for name, r in roll.items():
        r["vs_decode_bound"] = r["tokens_per_s"]["median"] / bound
        if base is not None:
            r["vs_generate"] = ratio(r["tokens_per_s"], base["tokens_per_s"])
    grpo = res.get("grpo", {})
    if "nearpolicy" in grpo and "trl" in grpo:
        out["grpo_step_ratio"] = ratio(grpo["nearpolicy"]["step_s"], grpo["trl"]["step_s"])
    if HF_ARM in grpo and "trl" in grpo:
        out["grpo_step_ratio_hf_bf16"] = ratio(grpo[HF_ARM]["step_s"], grpo["trl"]["step_s"])
    if "nearpolicy" in grpo and "trl" in grpo and "s_per_1k_tokens" in grpo["trl"]:
        out["grpo_token_ratio"] = ratio(grpo["nearpolicy"]["s_per_1k_tokens"], grpo["trl"]["s_per_1k_tokens"])
    if all(name in grpo for name in EQUAL_ARMS):
        out["grpo_step_ratio_equal_length"] = ratio(*(grpo[name]["step_s"] for name in EQUAL_ARMS))
    if "nearpolicy" in grpo:
        out["diagnostics_overhead"] = grpo["nearpolicy"]["diagnostics_fraction"]
        if "nearpolicy-no-diagnostics" in grpo:
            out["diagnostics_on_off"] = ratio(grpo["nearpolicy"]["step_s"], grpo["nearpolicy-no-diagnostics"]["step_s"])
    tr = res.get("trainer")
    if tr is not None:
        out["trainer_vs_gemm_peak"] = tr["gflops"]["median"] / gemm["median"]
    return out


def render_markdown(res: dict, d: dict, command: str, notes: str = "", raw: str = "docs/benchmarks.json") -> str:
    """docs/benchmarks.md: machine, settings, tables (median, min-max over runs), targets, command; `raw` names the
    JSON file written beside it (the --out path's)."""
    m, s = res["machine"], res["settings"]
    lines = ["# Benchmarks", "",
             "Written by `bench/run_all.py`; every figure is the median of the runs with (min-max) beside it; ratios "
             f"come from one harness run. Raw numbers: `{raw}`.", "",
             "## Machine", "",
             f"- CPU: {m['cpu']} ({m['cores']} cores visible), {m['memory_gib']:.0f} GiB memory; threads used: {s['threads']}",
             f"- Python {m['python']}; torch {m['torch']}, transformers {m['transformers']}, "
             f"llama-cpp-python {m['llama_cpp']}, TRL {m.get('trl', 'not run')}",
             f"- Date: {m['date']}; repeats: {s['repeats']}{' (--quick: smoke sizes, not results)' if s['quick'] else ''}",
             "", "## Command", "", "```bash", command, "```", ""]
    gemm = res["gemm"]
    lines += ["## Compute bounds (measured in this run)", "",
              f"- fp32 GEMM peak ({gemm['n']}^3 matmul, {s['threads']} threads): {fmt(gemm['gflops'])} GFLOP/s",
              f"- model: {res['model']['name']}, {res['model']['parameters'] / 1e6:.1f}M parameters",
              f"- decoding compute bound = GEMM peak / (2 x parameters) = {d['decode_bound_tokens_per_s']:.0f} tokens/s", ""]
    roll = res.get("rollout", {})
    if roll:
        lines += [f"## 1. Rollout throughput with per-token log-probs", "",
                  f"{s['prompts']} prompts x G = {s['group']} = {s['prompts'] * s['group']} sequences in one batch, up to "
                  f"{s['new_tokens']} new tokens, temperature 1; tokens/s = generated tokens / wall time.", ""]
        rows = []
        for name, r in roll.items():
            vs = r.get("vs_generate")
            rows.append([name, r.get("logprobs", ""), fmt(r["tokens_per_s"]), fmt(r["tokens"], 0),
                         "n/a" if vs is None else f"{vs['median']:.2f}x", f"{100 * r['vs_decode_bound']:.0f}%",
                         fmt_mib(r.get("peak_rss_kib"))])
        lines += [md_table(["configuration", "log-probs", "tokens/s", "tokens per run", "vs generate",
                          "of decode bound", "peak RSS MiB"], rows), ""]
    grpo = res.get("grpo", {})
    if grpo:
        lines += ["## 2. GRPO step time: nearpolicy vs TRL GRPOTrainer", "",
                  f"SmolLM2-135M-Instruct, chain_sum, {s['prompts']} prompts x G = {s['group']}, max {s['grpo_new_tokens']} "
                  f"new tokens, lr {s['lr']}, beta 0, micro-batch {s['micro_batch']}, {s['grpo_steps']} steps per run "
                  "(first step dropped as warm-up when more than one); seconds per step."
                  + (" Both sides update in bf16 (nearpolicy algorithm.trainer_precision = bf16, TRL GRPOConfig(bf16="
                     "True)); rollouts as in the fp32 runs." if s.get("trainer_precision") == "bf16" else ""), ""]
        rows = []
        for name, g in grpo.items():
            ph = g.get("phases", {})
            b = g.get("batch", {})
            quantiles = " / ".join("n/a" if b.get(k) is None else f"{b[k]['median']:.0f}"
                                   for k in ("response_p50", "response_p90"))
            rows.append([name, fmt(g["step_s"], 2), fmt(ph.get("rollout"), 2), fmt(ph.get("update"), 2),
                         fmt(ph.get("sync"), 2), fmt(b.get("response_tokens"), 1), quantiles,
                         fmt(b.get("truncated_share"), 2), fmt(g.get("s_per_1k_tokens"), 2),
                         fmt(b.get("zero_advantage_rows"), 2), fmt_mib(g.get("peak_rss_kib"))])
        lines += [md_table(["system", "s / step", "rollout s", "update s", "weight sync s", "response tokens",
                            "p50 / p90", "truncated", "s / 1k trained tokens", "forward-only rows / constant groups",
                            "peak RSS MiB"], rows), "",
                  "Response tokens: mean completion length per step (each system samples its own, so the work per "
                  "step differs); p50 / p90 and truncated (the share cut at the token limit) are per step, medians "
                  "over runs of each run's mean over its steps; s / 1k trained tokens: a run's step time over the "
                  "completion tokens its steps trained on. The equal-length rows (`--equal-length on`) ignore stop "
                  "tokens on both sides (nearpolicy `sampling.ignore_eos`, TRL `min_new_tokens`), so every response "
                  f"is exactly {s['grpo_new_tokens']} tokens. Forward-only rows / constant groups: for nearpolicy "
                  "`actor/inert_rows`, the share "
                  "of rows its update ran forward only because their gradient is exactly 0 (update.inert_rows: "
                  "zero advantage or no loss token; a mini-batch of such rows keeps one micro-batch's backward); for "
                  "TRL `frac_reward_zero_std`, the share of groups of constant reward, whose rows it runs forward and "
                  "backward. Related, not the same quantity.", ""]
        if "grpo_step_ratio" in d:
            r = d["grpo_step_ratio"]
            lines += [f"nearpolicy / TRL step time: **{r['median']:.2f}** ({r['min']:.2f}-{r['max']:.2f}).", ""]
        if "grpo_token_ratio" in d:
            r = d["grpo_token_ratio"]
            lines += [f"Per trained token (s / 1k trained tokens, nearpolicy / TRL): {r['median']:.2f} "
                      f"({r['min']:.2f}-{r['max']:.2f}).", ""]
        if "grpo_step_ratio_equal_length" in d:
            r = d["grpo_step_ratio_equal_length"]
            lines += [f"Equal length ({' / '.join(EQUAL_ARMS)}: the same tokens sampled, forwarded and trained per "
                      f"step): {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}).", ""]
        if "grpo_step_ratio_hf_bf16" in d:
            r = d["grpo_step_ratio_hf_bf16"]
            lines += [f"With the in-process bf16 engine ({HF_ARM}: `engine.kind=hf`, `engine.hf_dtype=bf16`, "
                      f"run on CPUs with AMX; the target row uses the main job's llama.cpp q8_0 engine): "
                      f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}).", ""]
    tr = res.get("trainer")
    if tr is not None:
        lines += ["## 3. Trainer forward + backward throughput", "",
                  f"fp32 policy, batch [{tr['batch']}, {tr['seq_len']}] (a GRPO micro-batch), log-softmax gather loss, "
                  f"backward; FLOPs = 6 N + 12 layers hidden L per token = {tr['flops_per_token'] / 1e9:.3f} GFLOP/token.", "",
                  md_table(["tokens/s", "GFLOP/s", "of GEMM peak", "peak RSS MiB"],
                         [[fmt(tr["tokens_per_s"]), fmt(tr["gflops"]), f"{100 * d['trainer_vs_gemm_peak']:.0f}%",
                           fmt_mib(tr.get("peak_rss_kib"))]]), ""]
    if "diagnostics_overhead" in d:
        o = d["diagnostics_overhead"]
        lines += ["## 4. Diagnostics overhead", "",
                  "The trainer times the mismatch metrics (`mismatch_metrics` + `mismatch_decomposition`) as "
                  "`time/diagnostics`; `logging.diagnostics = false` switches them off.", "",
                  f"- mismatch metrics / step time (same steps): {fmt(o, 3, scale=0.01)}%"]
        if "diagnostics_on_off" in d:
            r = d["diagnostics_on_off"]
            lines.append(f"- step time on / off (separate runs; differences of a few % are run-to-run noise): "
                         f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
        lines.append("")
    lines += ["## Targets (measured, not asserted)", "", md_table(["target", "measured", "verdict"], targets_rows(res, d)), ""]
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


def targets_rows(res: dict, d: dict) -> list[list[str]]:
    rows = []
    roll = res.get("rollout", {})
    best = max((r for n, r in roll.items() if n.startswith("nearpolicy")), key=lambda r: r["tokens_per_s"]["median"],
               default=None)
    if best is not None and "vs_generate" in best:
        v = best["vs_generate"]["median"]
        rows.append([f"rollout with log-probs >= {TARGETS['rollout_vs_generate']:.0f}x transformers generate ({best['name']})",
                     f"{v:.2f}x", verdict(v, TARGETS["rollout_vs_generate"], True)])
    if best is not None:
        v = best["vs_decode_bound"]
        rows.append([f">= {100 * TARGETS['rollout_vs_decode_bound']:.0f}% of the decoding compute bound ({best['name']})",
                     f"{100 * v:.0f}%", verdict(v, TARGETS["rollout_vs_decode_bound"], True)])
    if "grpo_step_ratio" in d:
        v = d["grpo_step_ratio"]["median"]
        target = TARGETS["grpo_step_vs_trl"]
        rows.append([f"GRPO step <= {target} x TRL's", f"{v:.2f}x", verdict(v, target, False)])
    if "grpo_step_ratio_equal_length" in d:
        v = d["grpo_step_ratio_equal_length"]["median"]
        target = TARGETS["grpo_step_equal_length_vs_trl"]
        rows.append([f"GRPO step at equal length <= {target} x TRL's", f"{v:.2f}x", verdict(v, target, False)])
    if "diagnostics_overhead" in d:
        v = d["diagnostics_overhead"]["median"]
        rows.append(["diagnostics < 2% of step time", f"{100 * v:.3f}%", verdict(v, TARGETS["diagnostics_overhead"], False)])
    if "trainer_vs_gemm_peak" in d:
        v = d["trainer_vs_gemm_peak"]
        rows.append(["trainer forward+backward > 50% of GEMM peak", f"{100 * v:.0f}%",
                     verdict(v, TARGETS["trainer_vs_gemm_peak"], True)])
    return rows
