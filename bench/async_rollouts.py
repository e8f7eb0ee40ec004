"""Synchronous vs asynchronous rollouts on the main job's model and task with a long-tailed response length.

Each configuration trains the same number of samples (`--steps` x 4 prompts x G = 4) through the real CLI, from
the same start, and reports the training wall time (sum of step times, evals excluded), generated tokens/s,
how long the trainer waited for rollouts, token staleness, and the final held-out eval accuracy (so speed is not
bought with quality). On this 2-core machine the synchronous run gives both cores to whichever phase runs; the
asynchronous runs give one core to the engine replica and one to the trainer.

    .venv/bin/python bench/async_rollouts.py [--steps 8] [--max-new-tokens 128] [--out docs/bench/async_rollouts.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "sync (inline engine, 2 threads each phase)": ["run.threads=2"],
    "eta=1": ["run.threads=1", "rollout.engines=1", "rollout.staleness=1"],
    "eta=2": ["run.threads=1", "rollout.engines=1", "rollout.staleness=2"],
    "eta=1 + partial rollouts, over-provision 2": ["run.threads=1", "rollout.engines=1", "rollout.staleness=1",
                                                   "rollout.partial=true", "rollout.overprovision=2"],
    "eta=2 + partial rollouts, over-provision 2": ["run.threads=1", "rollout.engines=1", "rollout.staleness=2",
                                                   "rollout.partial=true", "rollout.overprovision=2"],
}


def run(name: str, sets: list[str], args, out_dir: Path) -> dict:
    run_name = "bench-" + "".join(c if c.isalnum() else "-" for c in name)[:40]
    common = [f"run.output_dir='{out_dir}'", f"run.name={run_name}", f"run.steps={args.steps}",
              "algorithm.prompts_per_step=4", "algorithm.group_size=4", f"sampling.max_new_tokens={args.max_new_tokens}",
              f"task.eval_size={args.eval_size}", f"logging.eval_every={args.steps}", "logging.checkpoint_every=1000",
              "logging.progress=false", "logging.tensorboard=false", "rollout.resync_ess=0",
              "algorithm.lr=2e-5", "algorithm.lr_schedule=constant", "algorithm.warmup_steps=0"]  # not main.toml's recipe
    cmd = [sys.executable, "-m", "nearpolicy", "train", "configs/main.toml"]
    for s in common + sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / run_name / "metrics.jsonl").read_text().splitlines()]
    steps = rows[1:]
    train_s = sum(r["time/step"] - r.get("time/eval", 0.0) for r in steps)
    tokens = sum(r["response/length_mean"] * 16 for r in steps)
    return {
        "config": name, "command_wall_s": wall, "train_s": train_s, "trained_tokens": tokens,
        "tokens_per_s": tokens / train_s, "trainer_wait_s": sum(r["time/rollout"] for r in steps),
        "mean_response_tokens": tokens / (16 * len(steps)),
        "max_response_tokens": max(r["response/length_max"] for r in steps),
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in steps) / len(steps),
        "off_policy_token_frac": sum(r.get("staleness/off_policy_token_frac", 0.0) for r in steps) / len(steps),
        "eval_accuracy_start": rows[0]["eval/accuracy"], "eval_accuracy_end": steps[-1]["eval/accuracy"],
        # live sequences per engine decode call, and of the engine's slots (engines/base.DecodeCounts)
        "decode_batch_mean": _call_weighted(steps, "rollout/decode_batch_mean"),
        "decode_occupancy": _call_weighted(steps, "rollout/decode_occupancy"),
    }


def _call_weighted(steps: list[dict], key: str) -> float | None:
    """The steps' `key` averaged with each step's decode calls as weights (None when no step has it)."""
    pairs = [(r[key], r["rollout/decode_calls"]) for r in steps if key in r and r.get("rollout/decode_calls")]
    return sum(v * n for v, n in pairs) / sum(n for _, n in pairs) if pairs else None


def _occupancy(r: dict) -> str:
    if r.get("decode_batch_mean") is None:
        return "n/a"
    return f"{r['decode_batch_mean']:.1f} ({r['decode_occupancy']:.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--only", nargs="*", help="run only these configuration names")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/async_rollouts.json"))
    args = parser.parse_args()
    out_dir = Path("runs/bench-async")
    shutil.rmtree(out_dir, ignore_errors=True)
    results = []
    for name, sets in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        results.append(run(name, sets, args, out_dir))
        r = results[-1]
        print(f"{name}: {r['train_s']:.0f} s, {r['tokens_per_s']:.1f} tok/s, eval {r['eval_accuracy_end']:.3f}", flush=True)
    base = results[0]["train_s"]
    lines = ["| configuration | train s | speed-up | tokens/s | trainer wait s | mean / max response | staleness mean | "
             "off-policy tokens | decode batch (occupancy) | eval start -> end |", "|---" * 10 + "|"]
    for r in results:
        lines.append(f"| {r['config']} | {r['train_s']:.0f} | {base / r['train_s']:.2f}x | {r['tokens_per_s']:.1f} | "
                     f"{r['trainer_wait_s']:.0f} | {r['mean_response_tokens']:.0f} / {r['max_response_tokens']:.0f} | "
                     f"{r['staleness_mean']:.2f} | {r['off_policy_token_frac']:.0%} | {_occupancy(r)} | "
                     f"{r['eval_accuracy_start']:.3f} -> {r['eval_accuracy_end']:.3f} |")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                    "steps": args.steps, "max_new_tokens": args.max_new_tokens, "results": results,
                                    "table": lines}, indent=2) + "\n")


if __name__ == "__main__":
    main()
