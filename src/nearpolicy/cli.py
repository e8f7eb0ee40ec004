"""Command line: `nearpolicy train CONFIG.toml [--set key=value ...] [--resume]`, `nearpolicy list`,
`nearpolicy summary RUN_DIR`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _train(args: argparse.Namespace) -> int:
    from nearpolicy.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set or [])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from nearpolicy.trainer import RunExistsError, Trainer

    try:
        trainer = Trainer(cfg, resume=args.resume, log=lambda msg: print(msg, file=sys.stderr))
    except (RunExistsError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from nearpolicy.engines.base import EngineError
    from nearpolicy.runs import list_checkpoints
    from nearpolicy.signals import GracefulStop, StopRequested

    try:
        with GracefulStop() as stop:
            run_dir = trainer.fit(stop)
    except StopRequested as stopped:
        print(f"{stopped}", file=sys.stderr)
        return stopped.exit_code
    except (KeyboardInterrupt, EngineError, ValueError, FloatingPointError, OSError) as err:
        saved = list_checkpoints(trainer.run_dir)
        where = (f"the last checkpoint {saved[-1]} is intact (continue with --resume)" if saved
                 else "no checkpoint was written yet")
        reason = "interrupted" if isinstance(err, KeyboardInterrupt) else f"error: {err}"
        print(f"{reason} at step {trainer.state.step}; {where}", file=sys.stderr)
        return 130 if isinstance(err, KeyboardInterrupt) else 1
    print(f"done: metrics in {run_dir / 'metrics.jsonl'}, checkpoints in {run_dir / 'checkpoints'}", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace) -> int:
    from nearpolicy.ops.advantages import ADVANTAGES
    from nearpolicy.ops.correction_presets import CORRECTIONS
    from nearpolicy.ops.losses import POLICY_LOSSES

    for registry in (ADVANTAGES, POLICY_LOSSES, CORRECTIONS):
        print(f"{registry.family}{'es' if registry.family.endswith('s') else 's'}:")
        for entry in registry:
            print(f"  {entry.name:<28} {entry.summary}  [{entry.source}]")
    return 0


def _summary(args: argparse.Namespace) -> int:
    from nearpolicy.summary import summarize

    try:
        print(summarize(args.run_dir))
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nearpolicy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run GRPO training from a TOML config")
    train.add_argument("config", type=Path, nargs="?", help="TOML config (omit for the embedded defaults)")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. run.steps=5")
    train.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    train.set_defaults(func=_train)
    lister = sub.add_parser("list", help="list registered advantage estimators, losses and corrections")
    lister.set_defaults(func=_list)
    summary = sub.add_parser("summary", help="markdown summary of a run folder (accuracy, mismatch, timings)")
    summary.add_argument("run_dir", type=Path)
    summary.set_defaults(func=_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output cut short by a closed pipe (`nearpolicy list | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
