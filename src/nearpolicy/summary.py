"""Markdown summary of a run folder's metrics.jsonl: eval accuracy, mismatch over the run, step timings."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

MISMATCH_KEYS = ["mismatch/k1", "mismatch/k3", "mismatch/chi2", "mismatch/ess", "mismatch/max_abs_logprob_diff",
                 "mismatch/mean_abs_logprob_diff", "mismatch/prob_corr", "mismatch/frac_ratio_outside_0.5_2",
                 "correction/frac_high"]
TIME_KEYS = ["time/rollout", "time/score", "time/recompute", "time/update", "time/sync", "time/eval", "time/step",
             "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s"]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return rows


def _stats(rows: list[dict], key: str) -> tuple[float, float, float, float] | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return None
    return min(values), statistics.median(values), statistics.fmean(values), max(values)


def effective_correction(plan: dict) -> str | None:
    """The run's effective mismatch correction as plan.json records it (None for runs from before the record)."""
    return plan.get("correction_effective") or plan.get("correction")


def _plan(run_dir: Path) -> dict:
    try:
        plan = json.loads((Path(run_dir) / "plan.json").read_text())
    except (OSError, ValueError):
        return {}
    return plan if isinstance(plan, dict) else {}


def summarize(run_dir: Path) -> str:
    """Markdown: the effective correction (from plan.json), eval accuracy per eval step, min / median / mean / max
    of the main metrics and the training time. Raises FileNotFoundError without metrics.jsonl."""
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "reward/mean" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    correction = effective_correction(_plan(run_dir))
    out = [f"### Run `{Path(run_dir).name}`: {len(steps)} training steps", "",
           f"Correction: {correction or 'not recorded (no plan.json)'}", "",
           "| step | eval accuracy (greedy, held-out) |", "|---|---|"]
    out += [f"| {s} | {a:.3f} |" for s, a in evals]
    out += ["", "| metric | min | median | mean | max |", "|---|---|---|---|---|"]
    for key in ["reward/mean", "reward/unscorable", "reward/timeouts", "response/length_mean", "entropy",
                *MISMATCH_KEYS, *TIME_KEYS]:
        st = _stats(steps, key)
        if st is not None:
            out.append(f"| {key} | " + " | ".join(f"{v:.4g}" for v in st) + " |")
    train_seconds = sum(r.get("time/step", 0.0) for r in steps)
    out += ["", f"Training time (sum of step times, evals included): {train_seconds / 60:.1f} min."]
    return "\n".join(out)
