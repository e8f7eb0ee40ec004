"""The figures docs/arena.md cites from the committed arena cells (docs/arena-runs/*.tar.gz: each cell's metrics.jsonl
and the arena's state), printed as plain lines. The paired statements come from the regenerated pages instead
(`nearpolicy arena ... --page`, docs/arena.md's last section).

    .venv/bin/python bench/arena_figures.py > docs/arena-runs/figures.txt

Per arena: machine time and per-cell wall time (the state: every attempt of a cell counted), mean seconds per step
of each cell (`time/step`, eval steps included) and per arm (mean over the seeds), the median phase times over every
step of every cell, the mean over a cell's steps of `response/frac_truncated`. Then the cells the page's prose names.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARENAS = (("arena-shipped", "arena"), ("arena-staleness", "arena-staleness"), ("arena-mc-grpo", "arena-mc-grpo"),
          ("arena-mc-grpo-power", "arena-mc-grpo-power"), ("arena-mc-grpo-128", "arena-mc-grpo-128"))
FAILED = 0.6  # a final accuracy below it: a failed run (every finished G = 8 grpo cell of the power arena >= 0.676)


def _rows(cell: Path) -> list[dict]:
    """The cell's training steps (rows with `time/step`), in step order."""
    rows = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "time/step" in r), key=lambda r: r["step"])


def _span(values, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def _arm(cell: str) -> tuple[str, str]:
    """(arm, source) of a cell folder name <arm>__<source>__s<seed>."""
    arm, source, _ = cell.split("__")
    return arm, source


def arena_lines(name: str, folder: Path) -> list[str]:
    state = json.loads((folder / "arena-state.json").read_text())
    done = {key: cell for key, cell in state["cells"].items() if cell["status"] == "done"}
    minutes = [cell["seconds"] / 60 for cell in done.values()]
    retried = sorted(key for key, cell in done.items() if cell["attempts"] > 1)
    cells = {p.name: _rows(p) for p in sorted((folder / "cells").iterdir()) if (p / "metrics.jsonl").is_file()}
    step_s = {c: statistics.mean(r["time/step"] for r in rows) for c, rows in cells.items()}
    by_arm = defaultdict(list)
    for c, s in step_s.items():
        by_arm[_arm(c)].append(s)
    lines = [f"{name}: machine time {state['seconds']:.0f} s ({state['seconds'] / 3600:.2f} h); {len(done)} of "
             f"{len(state['cells'])} cells done, {_span(minutes, '{:.1f}')} min each (cells run twice: "
             f"{', '.join(retried) or 'none'})",
             f"{name}: mean s/step per cell {_span(step_s.values(), '{:.1f}')}"]
    for source in sorted({s for _, s in by_arm}):
        means = {arm: statistics.mean(v) for (arm, s), v in sorted(by_arm.items()) if s == source}
        lines.append(f"{name}: mean s/step over the seeds under {source}: "
                     + ", ".join(f"{arm} {m:.1f}" for arm, m in means.items()))
    every = [r for rows in cells.values() for r in rows]
    lines.append(f"{name}: median over every step of every cell: " + ", ".join(
        f"{phase} {statistics.median(r[f'time/{phase}'] for r in every if f'time/{phase}' in r):.1f} s"
        for phase in ("rollout", "update", "sync")) + ", eval " +
        f"{statistics.median(r['time/eval'] for r in every if 'time/eval' in r):.1f} s")
    cut = [statistics.mean(r["response/frac_truncated"] for r in rows) for rows in cells.values()]
    lines.append(f"{name}: response/frac_truncated, mean over a cell's steps: {_span(cut)}")
    return lines + NAMED[name](cells)


def _shipped(cells: dict[str, list[dict]]) -> list[str]:
    lines = []
    for c in ("tis__q4_1__s0", "tis__noise05__s0"):
        k3 = [round(r["mismatch/k3"], 3) for r in cells[c]]
        lines.append(f"arena-shipped {c}: mismatch/k3 at steps 1-5 {k3[:5]}, step 10 {k3[9]}, step 12 {k3[11]}")
    c = cells["token_mis__noise05__s1"]
    lines.append(f"arena-shipped token_mis__noise05__s1: entropy at the last step {c[-1]['entropy']:.2f}")
    return lines


def _staleness(cells: dict[str, list[dict]]) -> list[str]:
    lines = []
    for eta in ("eta1", "eta4"):
        group = {c: rows for c, rows in cells.items() if _arm(c)[1] == eta}
        lag = [statistics.mean(r["staleness/mean"] for r in rows) for rows in group.values()]
        stale = [statistics.median(r["mismatch/stale_k3"] for r in rows if "mismatch/stale_k3" in r)
                 for rows in group.values()]
        dropped = sorted({rows[-1]["async/dropped_stale_groups_total"] for rows in group.values()})
        later = [r["async/trainer_wait_s"] for rows in group.values() for r in rows[1:]]
        waits, short = [w for w in later if w > 1], [w for w in later if w <= 1]
        first = [rows[0]["async/trainer_wait_s"] for rows in group.values()]
        lines.append(f"arena-staleness {eta}: staleness/mean per cell {_span(lag)} (max "
                     f"{max(r['staleness/max'] for rows in group.values() for r in rows)}); mismatch/stale_k3 median "
                     f"per cell {_span(stale, '{:.4f}')}; dropped stale groups per run {dropped}; trainer wait at "
                     f"step 1 {_span(first, '{:.0f}')} s, then " + (
                         f"{_span(waits, '{:.0f}')} s at {len(waits)} steps" if waits else "over 1 s at no step")
                     + f" (the other {len(short)} steps under {max(short):.1f} s)")
        for arm in ("bypass", "decoupled"):
            rows_of = [rows for c, rows in group.items() if _arm(c)[0] == arm]
            clip = [statistics.mean(r["actor/pg_clipfrac"] for r in rows) for rows in rows_of]
            weight = [statistics.mean(r["correction/weight_mean"] for r in rows) for rows in rows_of]
            lines.append(f"arena-staleness {arm}/{eta}: actor/pg_clipfrac mean per cell {_span(clip, '{:.3f}')}, "
                         f"correction/weight_mean mean per cell {_span(weight, '{:.3f}')}")
    return lines


def _mc_grpo(cells: dict[str, list[dict]]) -> list[str]:
    k3 = [statistics.median(r["mismatch/k3"] for r in rows) for rows in cells.values()]
    lines = [f"arena-mc-grpo: mismatch/k3 median per cell (q8_0, synchronous) {_span(k3, '{:.4f}')}"]
    for source in ("G2", "G8"):
        entropy = [rows[-1]["entropy"] for c, rows in cells.items() if c.startswith(f"grpo__{source}__")]
        lines.append(f"arena-mc-grpo grpo/{source}: entropy at the last step {_span(entropy)}")
    c = cells["mc_grpo__G2__s0"]
    lines.append(f"arena-mc-grpo mc_grpo__G2__s0: response/length_mean step 1 {c[0]['response/length_mean']:.1f}, "
                 f"last step {c[-1]['response/length_mean']:.1f}")
    return lines


def _ranks(values: list[float]) -> list[float]:
    """Average ranks (1-based; ties share their mean rank)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _truncation_and_final(name: str, cells: dict[str, list[dict]]) -> list[str]:
    """Per finished cell (its last row at the arena's last step, with eval/accuracy), the truncated share over its last
    10 steps against its final accuracy: their rank (Spearman) correlation, per arm the shares and the failed runs."""
    last = max(rows[-1]["step"] for rows in cells.values() if rows)
    ended = {c: rows for c, rows in cells.items() if rows and rows[-1]["step"] == last and "eval/accuracy" in rows[-1]}
    late = {c: statistics.mean(r["response/frac_truncated"] for r in rows[-10:]) for c, rows in ended.items()}
    final = {c: rows[-1]["eval/accuracy"] for c, rows in ended.items()}
    keys = sorted(ended)
    rho = statistics.correlation(_ranks([late[c] for c in keys]), _ranks([final[c] for c in keys]))
    lines = [f"{name}: rank correlation of a cell's truncated share over its last 10 steps with its final accuracy "
             f"{rho:+.2f} over {len(keys)} cells"]
    for arm in sorted({_arm(c) for c in keys}):
        mine = [c for c in keys if _arm(c) == arm]
        failed = [f"{c.rsplit('__', 1)[1]} {final[c]:.3f} (cut {late[c]:.2f})" for c in mine if final[c] < FAILED]
        lines.append(f"{name} {'/'.join(arm)}: last-10-step truncated share {_span([late[c] for c in mine])}; "
                     f"final below {FAILED}: {', '.join(failed) or 'none'} of {len(mine)}")
    return lines


NAMED = {"arena-shipped": _shipped, "arena-staleness": _staleness, "arena-mc-grpo": _mc_grpo,
         "arena-mc-grpo-power": lambda cells: _truncation_and_final("arena-mc-grpo-power", cells),
         "arena-mc-grpo-128": lambda cells: _truncation_and_final("arena-mc-grpo-128", cells)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=ROOT / "docs/arena-runs", help="folder of the arena-*.tar.gz")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="arena-figures-") as tmp:
        for name, folder in ARENAS:
            with tarfile.open(args.runs / f"{name}.tar.gz") as tar:
                tar.extractall(tmp, filter="data")
            print("\n".join(arena_lines(name, Path(tmp) / folder)))


if __name__ == "__main__":
    main()
