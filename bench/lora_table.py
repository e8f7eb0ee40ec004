"""The LoRA table of docs/results.md (issue 40 item 5) from the cells of configs/arena-lora.toml: per cell (arm x
engine precision x seed) the greedy eval accuracy at each eval step, k3 of the engine against the trainer early and
late, the weight sync's time and share of the step, the trainer's and its child processes' peak RSS, the step time.

    .venv/bin/python bench/lora_table.py docs/arena-runs/arena-lora.tar.gz > docs/bench/lora-table.md

The argument is the arena's folder or its package (tar.gz holding <name>/cells/...). Figures per cell:
- eval: `eval/accuracy` at steps 0, 10, 20, 30 (256 held-out problems);
- k3: `mismatch/k3` (nats/token), median over steps 1-5 and over the last 5 steps;
- sync: mean `time/sync` over the training steps (full fine-tuning: re-quantize and reload the GGUF; LoRA: adapter
  write + load + the delivery proof), with LoRA's parts `lora/sync_s` (write + load) and `lora/proof_s`, and the
  sync's share of the mean step time over the steps without an eval;
- step: mean `time/step` over the steps without an eval (seconds);
- RSS: the largest `memory/peak_rss_mib` (trainer) and `memory/children_peak_rss_mib` (its child processes: the
  engine, the reward scorer, multiprocessing's resource tracker) of the run; "-" for runs without these metrics.
"""

from __future__ import annotations

import argparse
import statistics
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nearpolicy.runs.folder import read_metrics

EVAL_STEPS = (0, 10, 20, 30)


def cell_rows(cell: Path) -> list[dict]:
    """The cell's metrics rows in step order (runs/folder.read_metrics)."""
    return sorted(read_metrics(cell).rows, key=lambda r: r["step"])


@contextmanager
def arena_cells(arena: Path) -> Iterator[Path]:
    """The cells folder of an arena folder, or of its tar.gz package (unpacked into a temporary folder while open)."""
    if arena.is_dir():
        yield arena / "cells"
        return
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(arena) as tar:
        tar.extractall(tmp, filter="data")
        (folder,) = [p for p in Path(tmp).iterdir() if (p / "cells").is_dir()]
        yield folder / "cells"


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def cell_figures(rows: list[dict]) -> dict[str, float | list]:
    """The table's figures of one cell (module docstring) from its metrics rows."""
    train = [r for r in rows if "time/step" in r]
    plain = [r for r in train if "eval/accuracy" not in r]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None}
    k3 = [r["mismatch/k3"] for r in train if r.get("mismatch/k3") is not None]
    step_s = _mean([r["time/step"] for r in plain])
    sync_s = _mean([r["time/sync"] for r in train if "time/sync" in r])
    return {
        "eval": [evals.get(s) for s in EVAL_STEPS], "k3_early": statistics.median(k3[:5]) if k3 else float("nan"),
        "k3_late": statistics.median(k3[-5:]) if k3 else float("nan"), "sync_s": sync_s, "step_s": step_s,
        "sync_share": sync_s / step_s, "lora_sync_s": _mean([r["lora/sync_s"] for r in train if "lora/sync_s" in r]),
        "proof_s": _mean([r["lora/proof_s"] for r in train if "lora/proof_s" in r]),
        "rss_mib": max((r["memory/peak_rss_mib"] for r in train if "memory/peak_rss_mib" in r), default=float("nan")),
        "engine_rss_mib": max((r["memory/children_peak_rss_mib"] for r in train if "memory/children_peak_rss_mib" in r),
                              default=float("nan")),
        "steps": len(train),
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def table(cells: Path) -> str:
    """A markdown table, one line per cell folder <arm>__<source>__s<seed> under `cells`."""
    head = ("| cell | steps | eval at " + " / ".join(map(str, EVAL_STEPS)) + " | k3 early / late | sync s (LoRA: "
            "write+load, proof) | sync share | step s | peak RSS trainer / child processes MiB |")
    lines = [head, "|" + "---|" * 8]
    for cell in sorted(p for p in cells.iterdir() if (p / "metrics.jsonl").is_file()):
        f = cell_figures(cell_rows(cell))
        evals = " / ".join(_fmt(v, ".3f") for v in f["eval"])
        parts = "" if f["lora_sync_s"] != f["lora_sync_s"] else f" ({f['lora_sync_s']:.3f}, {f['proof_s']:.2f})"
        lines.append(f"| {cell.name.replace('__', '/')} | {f['steps']} | {evals} | {_fmt(f['k3_early'], '.2e')} / "
                     f"{_fmt(f['k3_late'], '.2e')} | {f['sync_s']:.2f}{parts} | {f['sync_share']:.1%} | "
                     f"{f['step_s']:.1f} | {_fmt(f['rss_mib'], '.0f')} / {_fmt(f['engine_rss_mib'], '.0f')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arena", type=Path, help="the arena folder, or its tar.gz package")
    with arena_cells(parser.parse_args().arena) as cells:
        print(table(cells))


if __name__ == "__main__":
    main()
