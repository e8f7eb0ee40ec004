"""Markdown summary of a run folder's metrics.jsonl: eval accuracy, mismatch over the run, step timings, and the
rollout's share of its roofline bound where the engine counts its decode calls."""

from __future__ import annotations

import statistics
from pathlib import Path

from nearpolicy.runs.folder import finite_points, is_finite_number, read_json_object, read_metrics

MISMATCH_KEYS = ["mismatch/k1", "mismatch/k3", "mismatch/chi2", "mismatch/ess", "mismatch/max_abs_logprob_diff",
                 "mismatch/mean_abs_logprob_diff", "mismatch/prob_corr", "mismatch/frac_ratio_outside_0.5_2",
                 "mismatch/seq_log_ppl_diff", "mismatch/seq_log_ppl_abs_diff", "mismatch/seq_ppl_ratio",
                 "mismatch/seq_chi2"]  # per sequence: verl's rollout_corr names (docs/math.md sec. 22)
ROOFLINE_KEYS = ["rollout/roofline_share", "rollout/roofline_s"]  # engines/roofline.py; engines that count calls
TIME_KEYS = ["time/rollout", "time/score", "time/recompute", "time/update", "time/sync", "time/eval", "time/step",
             "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s"]


def _stats(rows: list[dict], key: str) -> tuple[float, float, float, float] | None:
    values = [value for _, value in finite_points(rows, key)]
    if not values:
        return None
    return min(values), statistics.median(values), statistics.fmean(values), max(values)


def roofline_text(steps: list[dict]) -> str | None:
    """The rollout against its roofline bound (engines/roofline.py), or None when no step records
    rollout/roofline_share (an engine that does not count its decode calls' shapes): the share's mean over the steps
    that record it, its min and max, and the two rates the bound used (each distinct value: a resumed run measured
    them again), e.g. "42.0% of the bound (mean of 3 steps; min 40.1%, max 44.0%); GEMM peak 13.8 GFLOP/s, memory
    bandwidth 17.3 GB/s"."""
    shares = [value for _, value in finite_points(steps, "rollout/roofline_share")]
    if not shares:
        return None
    rates = []
    for key, unit, name in (("rollout/roofline_peak_gflops", "GFLOP/s", "GEMM peak"),
                            ("rollout/roofline_bandwidth_gbs", "GB/s", "memory bandwidth")):
        values = dict.fromkeys(f"{value:.1f}" for _, value in finite_points(steps, key))
        rates.append(f"{name} {', '.join(values) or 'not recorded'} {unit}")
    return (f"{100 * statistics.fmean(shares):.1f}% of the bound (mean of {len(shares)} steps; min "
            f"{100 * min(shares):.1f}%, max {100 * max(shares):.1f}%); " + ", ".join(rates))


def effective_correction(plan: dict) -> str | None:
    """The run's effective mismatch correction as plan.json records it (None for runs from before the record)."""
    return plan.get("correction_effective") or plan.get("correction")


def describe_run(config: dict, plan: dict) -> dict[str, str]:
    """What the run is, from config.json and plan.json (dicts; empty when absent): the engine and its precision, the
    model the eval runs, the policy update (advantage, loss, aggregation; the trainer's precision unless fp32), the
    learning rate and its schedule, the KL term (estimator x coefficient), the effective correction and the proximal
    policy. A field neither file records is "not recorded"."""
    section = lambda name: config.get(name) if isinstance(config.get(name), dict) else {}  # noqa: E731
    a, c = section("algorithm"), section("correction")
    absent = "not recorded"
    update = " / ".join(str(a[k]) for k in ("advantage", "loss", "aggregation") if k in a) or absent
    if a.get("trainer_precision", "fp32") != "fp32":  # its log-probs, and so mismatch/*, carry the bf16 error
        update += f", trainer in {a['trainer_precision']}"
    kl = f"{a['kl_estimator']} x {_number(a.get('kl_coef', 0))}" if "kl_estimator" in a else absent
    if a.get("kl_coef") == 0:
        kl += " (off)"
    return {"engine": str(plan.get("engine") or absent), "eval policy": str(plan.get("eval_policy") or absent),
            "update": update, "learning rate": _learning_rate(a), "KL": kl,
            "correction": str(effective_correction(plan) or absent), "proximal": str(c.get("proximal") or absent)}


def _number(value) -> str:
    """A config value as the summary prints it: %g for a number, else as written (a hand-edited config.json)."""
    return f"{value:g}" if is_finite_number(value) else str(value)


def _learning_rate(algorithm: dict) -> str:
    """algorithm.lr and its schedule, e.g. "1e-05, cosine to 0 after 2 warmup steps" ("not recorded" without lr;
    a config.json written before the schedule keys existed ran at a constant rate; a value that is not a number is
    printed as written, and the floor is left out unless lr and min_lr_ratio are both numbers)."""
    if algorithm.get("lr") is None:
        return "not recorded"
    lr, schedule = algorithm["lr"], algorithm.get("lr_schedule") or "constant"
    text = f"{_number(lr)}, {schedule}"
    floor = algorithm.get("min_lr_ratio", 0.0)
    if schedule != "constant" and is_finite_number(lr) and is_finite_number(floor):
        text += f" to {lr * floor:g}"
    warmup = algorithm.get("warmup_steps", 0)
    return text + (f" after {warmup} warmup steps" if warmup else "")


def _model_and_task(config: dict) -> dict[str, str]:
    """model.path and the task (kind, dataset or file, reward) of config.json ("not recorded" without it)."""
    model, task = config.get("model"), config.get("task")
    model, task = (model if isinstance(model, dict) else {}), (task if isinstance(task, dict) else {})
    data = task.get("path") if task.get("kind") == "jsonl" else task.get("name")
    reward = f"task.reward_function {task['reward_function']}" if task.get("reward_function") else "answer check"
    return {"model": str(model.get("path") or "not recorded"),
            "task": f"{task['kind']}:{data}, reward: {reward}" if task.get("kind") else "not recorded"}


def training_seconds(rows: list[dict]) -> float:
    """Seconds of training in metrics rows: the sum of the steps' time/step (their evals included) plus the step-0
    eval's time/eval; non-numbers skipped. `nearpolicy summary` and `report` both give this figure."""
    seconds = sum(value for _, value in finite_points(rows, "time/step"))
    return seconds + sum(value for _, value in finite_points([r for r in rows if r.get("step") == 0], "time/eval"))


def summarize(run_dir: Path, warn=None) -> str:
    """Markdown: what the run is (describe_run: engine precision, update, KL, effective correction, proximal),
    eval accuracy per eval step, min / median / mean / max of the main metrics (every correction/* metric the run
    records among them) and the training time. metrics.jsonl is read by runs.folder.read_metrics; `warn(message)` gets
    its warnings (a cut-short last line). Raises runs.folder.RunFolderError for a missing or damaged file."""
    metrics = read_metrics(run_dir)
    for warning in metrics.warnings:
        (warn or print)(warning)
    rows = metrics.rows
    steps = [r for r in rows if "reward/mean" in r]
    evals = finite_points(rows, "eval/accuracy")
    config = read_json_object(Path(run_dir) / "config.json")
    description = describe_run(config, read_json_object(Path(run_dir) / "plan.json"))
    planned = config["run"].get("steps") if isinstance(config.get("run"), dict) else None
    done = f"{len(steps)} of {planned}" if isinstance(planned, int) and planned > len(steps) else str(len(steps))
    out = [f"### Run `{Path(run_dir).name}`: {done} training steps", ""]
    out += [f"- {name}: {value}" for name, value in (_model_and_task(config) | description).items()]
    out += ["", "| step | eval accuracy (greedy, held-out) |", "|---|---|"]
    out += [f"| {s} | {a:.3f} |" for s, a in evals]
    out += ["", "| metric | min | median | mean | max |", "|---|---|---|---|---|"]
    recorded = {key for row in steps for key in row}
    for key in ["reward/mean", "reward/unscorable", "reward/timeouts", "response/length_mean", "entropy",
                *MISMATCH_KEYS, *sorted(k for k in recorded if k.startswith("correction/")), *TIME_KEYS,
                *ROOFLINE_KEYS]:
        st = _stats(steps, key)
        if st is not None:
            out.append(f"| {key} | " + " | ".join(f"{v:.4g}" for v in st) + " |")
    out += ["", f"Training time (sum of step times, evals included): {training_seconds(rows) / 60:.1f} min."]
    if (roofline := roofline_text(steps)) is not None:
        out.append(f"Rollout against its roofline bound (rollout/roofline_share, engines/roofline.py): {roofline}.")
    return "\n".join(out)
