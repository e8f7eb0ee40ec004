"""`nearpolicy gradbias CONFIG [--set ...] [--out DIR] [--sources ...] [--corrections ...] [--replicates N]
[--warmup K] [--sketch-dim M]` and `nearpolicy gradbias --analyze FOLDER` (re-table a stored measurement)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nearpolicy.gradbias.sketch import DEFAULT_DIM
from nearpolicy.gradbias.sources import DEFAULT_CORRECTIONS, DEFAULT_SOURCES


def _gradbias(args: argparse.Namespace) -> int:
    from nearpolicy.config.schema import ConfigError
    from nearpolicy.engines.base import EngineError

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    try:
        if args.analyze is not None:
            from nearpolicy.gradbias.table import analyze, markdown, write_outputs

            table = analyze(args.analyze)
            write_outputs(table, args.analyze)
        else:
            from nearpolicy.gradbias.run import GradbiasSettings, run_gradbias
            from nearpolicy.gradbias.table import markdown

            settings = GradbiasSettings(args.out, tuple(args.sources), tuple(args.corrections), args.replicates,
                                        args.warmup, None if args.sketch_dim == 0 else args.sketch_dim,
                                        progress=not args.no_progress)
            table = run_gradbias(args.config, args.set or [], settings, log)
    except (ConfigError, ValueError, FileNotFoundError, EngineError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(markdown(table))
    log(f"wrote {args.analyze or args.out}/gradbias.json, .md, .png and .html")
    return 0


def add_gradbias_parser(sub) -> None:
    g = sub.add_parser("gradbias", help="each correction's policy gradient on engine samples against the on-policy "
                       "gradient at the same weights: bias, variance, cosine, with intervals",
                       description="Sample replicate batches from each mismatch source and from the trainer's own fp32 "
                       "policy at one set of weights (after --warmup training steps of the config), and measure each "
                       "correction's gradient against the on-policy one (docs/gradbias.md). Resumable: a rerun with "
                       "the same --out and settings skips the replicates already stored.")
    g.add_argument("config", type=Path, nargs="?", help="TOML config (default: embedded)")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    g.add_argument("--out", type=Path, default=Path("runs/gradbias"), help="output folder (default runs/gradbias)")
    g.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES),
                   help=f"mismatch sources (default: {' '.join(DEFAULT_SOURCES)}; forms: f32, bf16, stale, "
                   "noise<std>, a GGUF precision)")
    g.add_argument("--corrections", nargs="+", default=list(DEFAULT_CORRECTIONS),
                   help=f"corrections, 'off' first (default: {' '.join(DEFAULT_CORRECTIONS)}; any preset of "
                   "`nearpolicy list`; decoupled = areal_cap; a3po = token_is with correction.proximal = a3po)")
    g.add_argument("--replicates", type=int, default=24, help="replicate batches per source (default 24)")
    g.add_argument("--warmup", type=int, default=4, help="training steps before the measured weights (default 4)")
    g.add_argument("--sketch-dim", type=int, default=DEFAULT_DIM,
                   help=f"count-sketch dimension of a stored gradient (default {DEFAULT_DIM}; 0: full gradient)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--analyze", type=Path, metavar="FOLDER",
                   help="re-table a stored measurement (its grams.npz and effects.json) without sampling; rewrites "
                   "gradbias.json, .md, .png and .html in FOLDER")
    g.set_defaults(func=_gradbias)
