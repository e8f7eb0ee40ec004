"""How much of the loss under logit noise sigma = 2 a correction recovers, from the committed cells: each arm at sigma
= 2 (docs/arena-runs/arena-dose-sigma2.tar.gz) against `off` on the noise-free f32 engine (arena-dose.tar.gz), the
final accuracy paired over problems x seeds (arena/paired.paired_bootstrap on each cell's step-30 eval outcomes) and
over seeds (paired_seeds). docs/arena.md, "Corrections at the breaking doses", cites its output, committed as
docs/arena-runs/dose-recovery.txt:

    .venv/bin/python bench/dose_recovery.py > docs/arena-runs/dose-recovery.txt
"""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

import numpy as np

from nearpolicy.arena.paired import paired_bootstrap, paired_seeds
from nearpolicy.runs.samples import read_outcomes

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "docs/arena-runs"
SEEDS = (0, 1, 2)


def final_outcomes(cell: Path) -> np.ndarray:
    """The rewards [P] of the cell's last eval (NaN: unscorable), from its eval_outcomes.jsonl (runs/samples.py)."""
    rows, _ = read_outcomes(cell)
    rewards = rows[-1]["rewards"]  # in step order: the last eval's
    return np.array([np.nan if r is None else r for r in rewards], dtype=float)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dose-recovery-") as tmp:
        for name in ("arena-dose", "arena-dose-sigma2"):
            with tarfile.open(RUNS / f"{name}.tar.gz") as tar:
                tar.extractall(tmp, filter="data")
        base = np.stack([final_outcomes(Path(tmp) / "arena-dose/cells" / f"off__f32__s{s}") for s in SEEDS])
        for arm in ("off", "tis", "icepop"):
            a = np.stack([final_outcomes(Path(tmp) / "arena-dose-sigma2/cells" / f"{arm}__noise2__s{s}") for s in SEEDS])
            boot = paired_bootstrap(a, base, list(SEEDS))
            seeds = paired_seeds({s: float(np.nanmean(a[i])) for i, s in enumerate(SEEDS)},
                                 {s: float(np.nanmean(base[i])) for i, s in enumerate(SEEDS)})
            print(f"{arm} at sigma 2 minus off on f32, final accuracy: {boot.difference:+.3f}; problems x seeds CI "
                  f"[{boot.low:+.3f}, {boot.high:+.3f}], MDE {boot.mde:.3f}; seeds CI [{seeds.low:+.3f}, "
                  f"{seeds.high:+.3f}], MDE {seeds.mde:.3f}")


if __name__ == "__main__":
    main()
