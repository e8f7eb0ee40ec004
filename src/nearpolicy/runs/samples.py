"""RUN/samples.jsonl: what the policy answered at each evaluation, for a person to read (the report shows it).

At every eval (step 0, every logging.eval_every steps and the last step) the first SAMPLES_PER_EVAL held-out
problems, the same ones each time, are written one JSON object per line:

    {"step": int, "index": int (position in the eval set), "prompt": str (the problem's text, without the system
     prompt and chat template), "answer": str (the reference answer), "response": str (the greedy response text the
     reward saw), "reward": float in [0, 1] or null (unscorable), "status": "ok" | "error" | "timeout",
     "message": str (only when the status is not "ok")}

The file is informational: `read_samples` skips a line it cannot read with a warning instead of failing."""

from __future__ import annotations

import json
import math
from nearpolicy.files import write_atomically
from pathlib import Path

__all__ = ["SAMPLES", "SAMPLES_PER_EVAL", "SampleLog", "read_samples"]

SAMPLES = "samples.jsonl"
SAMPLES_PER_EVAL = 4


class SampleLog:
    """Appends eval samples to run_dir/samples.jsonl.

    `resumed_at` is the step the run continues from (0 for a fresh start): rows of steps the run evaluates again are
    dropped at construction, those after `resumed_at` (the eval of the checkpointed step itself was written before
    its checkpoint); lines it cannot read are kept as they are. A start over (0) moves an existing file aside to
    samples.before-restart.jsonl."""

    def __init__(self, run_dir: Path, resumed_at: int = 0):
        self.path = Path(run_dir) / SAMPLES
        if not self.path.exists():
            return
        if resumed_at == 0:  # a start over: the earlier start's samples are kept aside, like its metrics
            self.path.replace(self.path.with_name("samples.before-restart.jsonl"))
            return
        keep = [line for line in self.path.read_bytes().splitlines(keepends=True) if _kept(line, resumed_at)]
        write_atomically(self.path, b"".join(line if line.endswith(b"\n") else line + b"\n" for line in keep))

    def write(self, rows: list[dict]) -> None:
        """Append `rows` (the fields of the module docstring); a NaN or infinite reward is written as null."""
        with self.path.open("a") as f:
            for row in rows:
                reward = row.get("reward")
                clean = row | {"reward": reward if reward is not None and math.isfinite(reward) else None}
                f.write(json.dumps(clean) + "\n")


def _kept(line: bytes, resumed_at: int) -> bool:
    """Whether a resume keeps this line: every line but a sample of a step after `resumed_at` (evaluated again);
    a line that cannot be read stays as it is (the file is never made to lose what it cannot parse)."""
    try:
        row = json.loads(line)
    except ValueError:
        return bool(line.strip())
    step = row.get("step") if isinstance(row, dict) else None
    return not (isinstance(step, int) and not isinstance(step, bool) and step > resumed_at)


def read_samples(run_dir: Path) -> tuple[list[dict], list[str]]:
    """(rows of run_dir/samples.jsonl in step order, warnings). No file gives ([], []); a line that is not a JSON
    object with an integer "step" is skipped with a warning naming the file and line."""
    path = Path(run_dir) / SAMPLES
    if not path.is_file():
        return [], []
    rows, warnings = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        return [], [f"cannot read {path}: {err}"]
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            warnings.append(f"{path}: skipped line {number}, not a sample object with an integer 'step'")
            continue
        rows.append(row)
    return sorted(rows, key=lambda row: row["step"]), warnings
