"""What the per-sequence mismatch metrics (ops/diagnostics.sequence_mismatch_metrics, logged as mismatch/seq_*) cost
against a training step. Real steps of a config (default the main job's, configs/main.toml: llama.cpp q8_0 rollouts,
4 prompts x G = 8, up to 64 new tokens) run in process; the trainer's call of the metrics is timed where it happens
(metrics plus their float conversion), and the same call on the same step's tensors is then re-timed `--repeats` times
for a precise median. Fraction = median call / median step wall time (the first step, warm-up, dropped when more than
one ran). Writes docs/bench/seq_mismatch_cost.json and prints one line:

    .venv/bin/python bench/seq_mismatch_cost.py --steps 4 --repeats 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nearpolicy.config.schema import load_config
from nearpolicy.doctor import cpu_model
from nearpolicy.training import phases
from nearpolicy.training.trainer import open_trainer

TARGET = 0.005  # issue 44: under 0.5 % of a step


class TimedMetrics:
    """Stands in for phases.sequence_mismatch_metrics: times each call (and the floats the trainer takes of it) and
    keeps the last call's tensors."""

    def __init__(self, fn):
        self.fn, self.seconds, self.last = fn, [], None

    def __call__(self, pi_logprobs, mu_logprobs, defined):
        started = time.perf_counter()
        out = self.fn(pi_logprobs, mu_logprobs, defined)
        floats = [float(v) for v in out.values()]  # noqa: F841 (timed: the trainer takes them)
        self.seconds.append(time.perf_counter() - started)
        self.last = (pi_logprobs, mu_logprobs, defined)
        return out


def retime(fn, args: tuple, repeats: int) -> list[float]:
    """Seconds of `repeats` calls of fn(*args) with the floats taken, after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        floats = [float(v) for v in fn(*args).values()]  # noqa: F841
        times.append(time.perf_counter() - started)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/main.toml")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides, key=value")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="docs/bench/seq_mismatch_cost.json")
    args = parser.parse_args()
    timed = TimedMetrics(phases.sequence_mismatch_metrics)
    phases.sequence_mismatch_metrics = timed  # the name mismatch_diagnostics calls
    with tempfile.TemporaryDirectory() as folder:
        cfg = load_config(Path(args.config), [f"run.output_dir='{folder}'", "run.name=seq-cost",
                                              f"run.steps={args.steps}", "logging.tensorboard=false",
                                              "logging.progress=false", "logging.eval_every=1000",
                                              "logging.checkpoint_every=1000", *args.set])
        trainer = open_trainer(cfg, log=lambda _: None)
        step_s, shapes = [], []
        try:
            for _ in range(args.steps):
                started = time.perf_counter()
                trainer.train_step()
                step_s.append(time.perf_counter() - started)
                shapes.append([*timed.last[2].shape, int(timed.last[2].sum())])
                trainer.state.step += 1
        finally:
            trainer.close()
    kept = slice(1, None) if args.steps > 1 else slice(None)
    retimed = retime(timed.fn, timed.last, args.repeats)
    step = statistics.median(step_s[kept])
    call = statistics.median(retimed)
    result = {
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "config": args.config, "sets": args.set,
        "steps": args.steps, "repeats": args.repeats,
        "batch_rows_width_tokens": shapes, "step_seconds": step_s, "in_step_call_seconds": timed.seconds,
        "retimed_call_seconds": {"median": call, "min": min(retimed), "max": max(retimed)},
        "median_step_seconds": step, "fraction_of_step": call / step,
        "fraction_of_step_in_step_calls": statistics.median(timed.seconds[kept]) / step, "target": TARGET,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    rows, width, tokens = shapes[-1]
    print(f"sequence_mismatch_metrics on [{rows}, {width}] ({tokens} tokens): {call * 1e3:.3f} ms "
          f"(in-step calls median {statistics.median(timed.seconds[kept]) * 1e3:.3f} ms); step {step:.2f} s; "
          f"{100 * call / step:.4f} % of a step (target < {100 * TARGET:g} %)")


if __name__ == "__main__":
    main()
