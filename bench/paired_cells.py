"""Paired comparisons of arena cells where the arena's own page has too few seeds (it asks for 3): for each pair of
arms, the final eval accuracy and the eval AUC, paired over the held-out problems and the seeds both arms ran
(arena/paired.paired_bootstrap: problems x seeds, 10 000 replicates; with one seed it speaks of these problems at this
seed only, and the seed-to-seed spread is not in it), with the 95 % CI, the MDE at 80 % power and McNemar's
discordant counts of the final eval (problems only A solved / only B solved, summed over the seeds).

    .venv/bin/python bench/paired_cells.py docs/arena-runs/arena-lora.tar.gz r8/q4_1:full/q4_1 r8/q8_0:full/q8_0

A pair is ARM/SOURCE:ARM/SOURCE (A minus B); the seeds are those both have finished (every eval of a cell recorded in
its eval_outcomes.jsonl). The AUC is each problem's mean reward over the eval curve (trapezoid from step 0 to the last
eval, divided by the steps: arena/outcomes.trapezoid), then averaged like the accuracy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from lora_table import arena_cells

from nearpolicy.arena.outcomes import trapezoid
from nearpolicy.arena.paired import paired_bootstrap
from nearpolicy.runs.samples import read_outcomes


def evals(cell: Path) -> dict[int, np.ndarray]:
    """step -> rewards [P] of the cell's evals (runs/samples.read_outcomes; an unscorable reward is NaN)."""
    rows, _ = read_outcomes(cell)
    return {r["step"]: np.asarray(r["rewards"], dtype=np.float64) for r in rows}


def auc(curve: dict[int, np.ndarray]) -> np.ndarray:
    """Per problem [P]: the arena's trapezoid (arena/outcomes.trapezoid) of its reward from step 0 to the last eval."""
    steps = sorted(curve)
    return np.array([trapezoid([(s, curve[s][p]) for s in steps], steps[-1]) for p in range(len(curve[steps[0]]))])


def finished(cells: Path, arm: str, source: str) -> dict[int, dict[int, np.ndarray]]:
    """seed -> eval curve of every finished cell of arm/source (its last eval at the last step of its run)."""
    out = {}
    for cell in sorted(cells.glob(f"{arm}__{source}__s*")):
        steps = json.loads((cell / "config.json").read_text())["run"]["steps"]
        curve = evals(cell)
        if steps in curve:
            out[int(cell.name.rsplit("__s", 1)[1])] = curve
    return out


def compare(cells: Path, pair: str) -> list[str]:
    """The lines of one pair A:B (module docstring)."""
    sides = pair.split(":")
    if len(sides) != 2 or any(len(side.split("/")) != 2 for side in sides):
        raise SystemExit(f"{pair!r}: a pair is ARM/SOURCE:ARM/SOURCE, e.g. r8/q4_1:full/q4_1")
    (arm_a, source_a), (arm_b, source_b) = (side.split("/") for side in sides)
    a, b = finished(cells, arm_a, source_a), finished(cells, arm_b, source_b)
    for side, runs in ((sides[0], a), (sides[1], b)):
        if not runs:
            raise SystemExit(f"{side}: no finished cell {side.replace('/', '__')}__s* in {cells}")
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return [f"| {pair} | no seed finished in both | | | | |"]
    lines = []
    for name, outcome in (("final", lambda c: c[max(c)]), ("eval AUC", auc)):
        x, y = (np.stack([outcome(side[s]) for s in seeds]) for side in (a, b))
        p = paired_bootstrap(x, y, seeds)
        verdict = "difference detected" if p.detected else "no difference detected"
        extra = ""
        if name == "final":
            extra = f"; {int(((x > 0.5) & (y < 0.5)).sum())} / {int(((x < 0.5) & (y > 0.5)).sum())} discordant"
        lines.append(f"| {pair} | {name} | {', '.join(map(str, seeds))} | {x.mean():.3f} vs {y.mean():.3f} | "
                     f"{p.difference:+.3f} [{p.low:+.3f}, {p.high:+.3f}], MDE {p.mde:.3f} | {verdict}{extra} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arena", type=Path, help="the arena folder, or its tar.gz package")
    parser.add_argument("pairs", nargs="+", help="ARM/SOURCE:ARM/SOURCE (A minus B)")
    args = parser.parse_args()
    header = ["| A:B | outcome | seeds | A vs B | A - B, 95 % CI (problems x seeds), MDE | verdict |",
              "|---|---|---|---|---|---|"]
    with arena_cells(args.arena) as cells:
        print("\n".join(header + [line for pair in args.pairs for line in compare(cells, pair)]))


if __name__ == "__main__":
    main()
