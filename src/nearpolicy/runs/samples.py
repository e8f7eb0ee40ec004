"""RUN/samples.jsonl and RUN/eval_outcomes.jsonl: what the policy answered at each evaluation, for a person to read
(the report shows it), and every eval problem's reward, for the arena's paired bootstrap over problems x seeds.

At every eval (step 0, every logging.eval_every steps and the last step) the first SAMPLES_PER_EVAL held-out
problems, the same ones each time, are written to samples.jsonl one JSON object per line:

    {"step": int, "index": int (position in the eval set), "prompt": str (the problem's text, without the system
     prompt and chat template), "answer": str (the reference answer), "response": str (the greedy response text the
     reward saw), "reward": float in [0, 1] or null (unscorable), "status": "ok" | "error" | "timeout",
     "message": str (only when the status is not "ok")}

and one line per eval to eval_outcomes.jsonl, every eval problem's reward in eval-set order (index i is samples.jsonl's
"index" i; a timeout is 0, as in eval/accuracy, whose value is the mean of the non-null rewards):

    {"step": int, "rewards": [float in [0, 1] or null (unscorable), one per eval problem]}

Both files are appended one line per write and cut back alike on a resume (SampleLog). They are informational:
`read_samples` and `read_outcomes` skip a line they cannot read with a warning instead of failing."""

from __future__ import annotations

import json
import math
from nearpolicy.files import write_atomically
from pathlib import Path

__all__ = ["OUTCOMES", "SAMPLES", "SAMPLES_PER_EVAL", "SampleLog", "read_outcomes", "read_samples"]

SAMPLES = "samples.jsonl"
OUTCOMES = "eval_outcomes.jsonl"
SAMPLES_PER_EVAL = 4


class SampleLog:
    """Appends eval samples to run_dir/samples.jsonl and each eval's rewards to run_dir/eval_outcomes.jsonl.

    `resumed_at` is the step the run continues from (0 for a fresh start): in both files rows of steps the run
    evaluates again are dropped at construction, those after `resumed_at` (the eval of the checkpointed step itself
    was written before its checkpoint); lines it cannot read are kept as they are. A start over (0) moves an existing
    file aside to samples.before-restart.jsonl and eval_outcomes.before-restart.jsonl."""

    def __init__(self, run_dir: Path, resumed_at: int = 0):
        self.path = Path(run_dir) / SAMPLES
        self.outcomes_path = Path(run_dir) / OUTCOMES
        for path in (self.path, self.outcomes_path):
            _cut_back(path, resumed_at)

    def write(self, rows: list[dict]) -> None:
        """Append `rows` (the fields of the module docstring); a NaN or infinite reward is written as null."""
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row | {"reward": _number(row.get("reward"))}) + "\n")

    def write_outcomes(self, step: int, rewards: list[float]) -> None:
        """Append the eval of `step`'s line to eval_outcomes.jsonl: `rewards`, one per eval problem in eval-set order
        (floats; NaN or infinite, the unscorable, written as null), in one write of one line."""
        line = json.dumps({"step": step, "rewards": [_number(r) for r in rewards]}) + "\n"
        with self.outcomes_path.open("a") as f:
            f.write(line)


def _number(reward: float | None) -> float | None:
    """The reward as written: null for None, NaN or an infinity."""
    return reward if reward is not None and math.isfinite(reward) else None


def _cut_back(path: Path, resumed_at: int) -> None:
    """SampleLog's resume rule for one file: a start over (0) moves it aside to NAME.before-restart.jsonl; a resume
    rewrites it (atomically) without the rows of steps after `resumed_at`."""
    if not path.exists():
        return
    if resumed_at == 0:  # a start over: the earlier start's rows are kept aside, like its metrics
        path.replace(path.with_name(f"{path.stem}.before-restart{path.suffix}"))
        return
    keep = [line for line in path.read_bytes().splitlines(keepends=True) if _kept(line, resumed_at)]
    write_atomically(path, b"".join(line if line.endswith(b"\n") else line + b"\n" for line in keep))


def _kept(line: bytes, resumed_at: int) -> bool:
    """Whether a resume keeps this line: every line but a row of a step after `resumed_at` (evaluated again);
    a line that cannot be read stays as it is (the file is never made to lose what it cannot parse)."""
    try:
        row = json.loads(line)
    except ValueError:
        return bool(line.strip())
    step = row.get("step") if isinstance(row, dict) else None
    return not (isinstance(step, int) and not isinstance(step, bool) and step > resumed_at)


def _is_step(row) -> bool:
    return isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)


def _is_outcome(row) -> bool:
    rewards = row.get("rewards") if _is_step(row) else None
    return isinstance(rewards, list) and all(
        r is None or (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)) for r in rewards)


def _read_rows(path: Path, valid, what: str) -> tuple[list[dict], list[str]]:
    """(the rows of the JSONL file `path` that `valid` accepts, in step order (stable), warnings): no file gives
    ([], []); a line `valid` refuses is skipped with a warning naming the file, the line and `what` it is not."""
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
        if not valid(row):
            warnings.append(f"{path}: skipped line {number}, not {what}")
            continue
        rows.append(row)
    return sorted(rows, key=lambda row: row["step"]), warnings


def read_samples(run_dir: Path) -> tuple[list[dict], list[str]]:
    """(rows of run_dir/samples.jsonl in step order, warnings). No file gives ([], []); a line that is not a JSON
    object with an integer "step" is skipped with a warning naming the file and line."""
    return _read_rows(Path(run_dir) / SAMPLES, _is_step, "a sample object with an integer 'step'")


def read_outcomes(run_dir: Path) -> tuple[list[dict], list[str]]:
    """(rows {"step": int, "rewards": [float | None]} of run_dir/eval_outcomes.jsonl in step order, warnings). No
    file gives ([], []) (a run from before the file existed); a line that is not such an object (rewards finite
    numbers or null) is skipped with a warning naming the file and line."""
    return _read_rows(Path(run_dir) / OUTCOMES, _is_outcome,
                      "an outcome object with an integer 'step' and a list 'rewards' of numbers or null")
