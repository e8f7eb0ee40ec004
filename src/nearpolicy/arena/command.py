"""`nearpolicy arena ARENA.toml [--out DIR] [--dry-run] [--only CELL_GLOB ...] [--page] [--workers N] [--adopt DIR]`:
the sub-command's parser and handler (cli.py adds it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Run a grid of ordinary training runs from one base config: corrections x mismatch sources x seeds (the ARENA.toml
file; format in docs/arena.md, the shipped grid in configs/arena.toml). Every cell is a validated config (the base
file with the arena's --set overrides), trained with the same data order per seed, budget and held-out eval. Cells
run one after another in this process, or with --workers N up to N at a time, each in a child process (this process
keeps the state and forwards SIGINT / SIGTERM to them; a child that crashes fails only its cell);
Ray workers are not supported (a cell's own rollout.backend = "ray" still works). The state is kept in
OUT/arena-state.json: run the same command again after an interruption and finished cells are skipped, an
interrupted cell resumes from its last checkpoint, a failed one is tried again; a changed arena file is refused,
naming what changed. A failed cell is recorded (divergence: non-finite steps; else an infrastructure failure) and
the arena goes on. At the end (and after an interruption) OUT/arena.md, arena.json and a self-contained arena.html
hold the table (final and best held-out accuracy as mean +- sd over seeds, diverged, median k3, fraction of tokens
the correction changed, step time), every comparison paired by seed (difference, 95 % CI, minimum detectable
difference at 80 % power; a CI containing 0 is "no difference detected"), and plots of eval accuracy and k3 over
steps. Progress (cell i/N, its step, the arena's ETA) goes to stderr; each cell's start-up log to OUT/logs/CELL.log.

--adopt DIR (repeatable) first takes, instead of running them, the pending cells that another arena's folder DIR
already finished (done or diverged) with the identical config (run.output_dir aside): their run folders and logs are
copied into OUT and their records carried over; each cell refused says why (not in DIR, not final there, or the first
config key that differs, with both values). DIR is only read; with --dry-run nothing is copied.

With arena.sequential = true the cells run seed by seed, and after each seed from arena.min_seeds on a sequential
rule judges every comparison (or those arena.stop_for names) of the arena.stop_on outcome at the level 0.05 / K (K
looks; Bonferroni: a false "difference detected" has probability <= 0.05 per comparison over all looks): settled when
its CI excludes 0, or contains 0 with an MDE <= arena.target_mde. Once every judged comparison is settled the
remaining seeds' cells are recorded as skipped and the arena ends; the looks go to OUT/arena-sequential.json and the
page. --dry-run states the rule.
With --workers N, only cells of the same seed run at a time (each look needs its seed's cells finished).

Exit codes: 0 every selected cell done, diverged or skipped; 1 a cell failed; 2 a bad or changed arena file; 130 / 143
stopped by SIGINT / SIGTERM (run again to continue)."""


def add_arena_parser(sub) -> None:
    a = sub.add_parser("arena", help="a grid of runs: corrections x mismatch sources x seeds, resumable, one table",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("arena", type=Path, metavar="ARENA.toml", help="the arena file (e.g. configs/arena.toml)")
    a.add_argument("--out", type=Path, help="output folder (default: the file's arena.out, else runs/arena-<stem>)")
    a.add_argument("--dry-run", action="store_true",
                   help="list the cells (status, overrides), the estimated budget and the sequential rule, if "
                        "on; run and write nothing")
    a.add_argument("--only", metavar="CELL_GLOB", action="append",
                   help="run only the cells whose id correction/source/sSEED matches, e.g. 'off/*' or '*/q4_1/s0'; "
                        "repeatable: a cell runs when it matches any")
    a.add_argument("--page", action="store_true",
                   help="only (re)write arena.md, arena.json and arena.html from the cells run so far")
    a.add_argument("--workers", type=int, default=1, metavar="N",
                   help="run up to N cells at a time, each in a child process (default 1: one after another in this "
                        "process); with arena.sequential = true only cells of the same seed run together. Keep N x "
                        "run.threads within the CPU count (a warning says when it is not, --dry-run too)")
    a.add_argument("--adopt", type=Path, action="append", metavar="DIR",
                   help="before running, copy in the pending cells another arena folder DIR finished (done or "
                        "diverged) with the identical config; repeatable; DIR is only read (docs/arena.md)")
    a.set_defaults(func=arena_command)


def arena_command(args: argparse.Namespace) -> int:
    from nearpolicy.arena.spec import ArenaError, load_arena

    if args.workers < 1:
        print(f"error: --workers must be at least 1 (got {args.workers})", file=sys.stderr)
        return 2
    try:
        spec = load_arena(args.arena, args.out)
        adoptable: list[str] = []
        if args.adopt:
            from nearpolicy.arena.adopt import adopt_into

            adoptable = adopt_into(spec, args.adopt, args.only, args.dry_run,
                                   lambda msg: print(msg, file=sys.stderr, flush=True))
        if args.dry_run:
            from nearpolicy.arena.runner import dry_run, start_refusals

            print(dry_run(spec, args.only, args.workers, set(adoptable)), end="")
            refused = start_refusals(spec, args.only, set(adoptable))
            for cell, why in refused.items():
                print(f"error: cell {cell} (and its other seeds) would be refused at start: {why}", file=sys.stderr)
            return 2 if refused else 0
        if args.page:
            from nearpolicy.arena.page import write_page
            from nearpolicy.arena.state import ArenaState

            for warning in write_page(spec, ArenaState.open(spec.out, spec)):
                print(f"warning: {warning}", file=sys.stderr)
            print(f"wrote {spec.out / 'arena.md'}, arena.json and arena.html", file=sys.stderr)
            return 0
        from nearpolicy.arena.runner import run_arena

        return run_arena(spec, args.only, workers=args.workers)
    except ArenaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # between cells (a cell's own run stops gracefully); the state file is intact
        print("arena interrupted; run the same command again to continue", file=sys.stderr)
        return 130
