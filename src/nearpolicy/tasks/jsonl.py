"""A task read from a JSONL file of ``{"prompt": str, "answer": str | number}`` lines, scored with
math-verify (symbolic equivalence: "0.5" == "\\frac{1}{2}")."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

from nearpolicy.tasks.answers import extract_final_answer, last_boxed
from nearpolicy.tasks.base import Problem, wrap_index

__all__ = ["JsonlTask", "math_equal"]

_TIMEOUT_S = 5  # math-verify's own per-call limit; only usable on the main thread (signal.alarm)


def _timeout() -> int | None:
    """math-verify's signal-based timeout works only on the main thread; elsewhere run without."""
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_math(text: str) -> list:
    """math-verify parse of ``text``; a bare value is read as LaTeX (``$text$``) first.

    Bare text goes through LaTeX first because math-verify's plain-expression reader keeps only the
    last number ("2\\pi" -> 2, "(1, 2)" -> 2), which would let wrong answers match.
    """
    from math_verify import parse

    timeout = _timeout()
    if "$" in text or "\\boxed" in text or "\\fbox" in text:
        return parse(text, parsing_timeout=timeout)
    parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed if parsed else parse(text, parsing_timeout=timeout)


def math_equal(reference: str, response: str) -> float:
    """1.0 iff the final answer extracted from ``response`` is math-equivalent to ``reference``.

    Only ``response`` is read for the prediction. A reference that math-verify cannot parse into a
    math object (empty result, or only raw-string fallbacks) always gives 0.0. Never raises for
    string inputs (math-verify's errors and timeouts give 0.0).
    """
    from math_verify import parse, verify

    gold = _parse_math(reference)
    if not any(not isinstance(g, str) for g in gold):
        return 0.0
    extracted = extract_final_answer(response)
    if extracted is None:
        return 0.0
    pred = _parse_math(extracted)
    if not pred and last_boxed(response) is not None:
        pred = parse(response, parsing_timeout=_timeout())  # math-verify's own \boxed{} reading
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=_timeout()) else 0.0


def _read_line(data: bytes, answer_required: bool = True) -> dict | str:
    """The item on one line, or a string saying what is wrong with it (an absent "answer" is "" when not
    ``answer_required``)."""
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (byte {exc.object[exc.start]:#04x} at column {exc.start + 1})"
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg})"
    except RecursionError:
        return "invalid JSON (nested deeper than Python's recursion limit)"
    if not isinstance(item, dict):
        return f"expected a JSON object, got {type(item).__name__}"
    missing = [key for key in ("prompt", "answer")[: 2 if answer_required else 1] if key not in item]
    if missing:
        return f"missing key(s) {missing}"
    prompt, answer = item["prompt"], item.setdefault("answer", "")
    if not isinstance(prompt, str):
        return f"'prompt' must be a string, got {type(prompt).__name__}"
    if not prompt.strip():
        return "'prompt' is empty"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"'answer' must be a string or a number, got {type(answer).__name__}"
    return item


class JsonlTask:
    """Problems from a JSONL file, split into a held-out eval subset and a training pool, disjoint by prompt.

    The split is by prompt identity (the exact "prompt" string): ``eval_size`` distinct prompts (at most half of
    the distinct prompts; ``self.eval_size`` is the size used) are drawn with ``random.Random(eval_seed)`` and held
    out, each once (its first line); every line whose prompt is held out leaves the training pool, and
    ``self.dropped_overlap`` counts the lines dropped that way beyond the eval's own (OpenRLHF #1089: split by line
    index, a repeated prompt landed in both). The rest, shuffled with ``random.Random(seed)``, form the training
    pool (a prompt repeated there stays repeated). A file without repeated prompts splits exactly as by line.
    Blank lines are ignored. Other keys of a line are kept in ``Problem.entry``; with ``answer_required=False``
    (a task.reward_function scores the responses) a line may leave out "answer" ("").

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names task.path).
        ValueError: bad lines (naming the file and the 1-based line numbers) unless
            ``skip_bad_lines``, in which case they are skipped and listed in ``self.skipped_lines``;
            no usable lines; ``eval_size`` < 0.
    """

    def __init__(
        self,
        path: str | Path,
        eval_size: int,
        seed: int,
        eval_seed: int,
        skip_bad_lines: bool = False,
        answer_required: bool = True,
    ) -> None:
        self.path, self.answer_required = Path(path), answer_required
        if not self.path.is_file():
            raise FileNotFoundError(f"task.path {self.path} does not exist")
        if eval_size < 0:
            raise ValueError(f"task.eval_size must be >= 0, got {eval_size}")
        self.name = f"jsonl:{self.path.name}"
        self.skipped_lines: list[int] = []
        problems = self._load(skip_bad_lines)
        first = {}  # prompt -> its first line's index, in file order
        for i, problem in enumerate(problems):
            first.setdefault(problem.question, i)
        if eval_size >= 1 and len(first) < 2:
            raise ValueError(f"{path}: {len(first)} distinct prompt(s) in {len(problems)} usable line(s); a held-out "
                             "eval split needs at least 2")
        self.eval_size = min(eval_size, max(1, len(first) // 2)) if eval_size else 0
        order = list(first.values())
        random.Random(eval_seed).shuffle(order)
        held_out = {problems[i].question for i in order[: self.eval_size]}
        self._eval = [problems[i] for i in sorted(order[: self.eval_size])]
        self._train = [p for p in problems if p.question not in held_out]
        self.dropped_overlap = len(problems) - len(self._train) - len(self._eval)
        random.Random(seed).shuffle(self._train)

    def _load(self, skip_bad_lines: bool) -> list[Problem]:
        problems: list[Problem] = []
        errors: list[str] = []
        with self.path.open("rb") as handle:  # decoded per line, so bad UTF-8 is reported with its line number
            for lineno, data in enumerate(handle, start=1):
                if not data.strip():
                    continue
                item = _read_line(data, self.answer_required)
                if isinstance(item, str):
                    self.skipped_lines.append(lineno)
                    errors.append(f"line {lineno}: {item}")
                    continue
                problems.append(Problem(item["prompt"], str(item["answer"]), item))
        if errors and not skip_bad_lines:
            shown = "; ".join(errors[:10]) + ("; ..." if len(errors) > 10 else "")
            raise ValueError(
                f"{self.path}: {len(errors)} bad line(s) at {self.skipped_lines}: {shown} "
                "(set task.skip_bad_lines to skip them)"
            )
        if not problems:
            detail = f" ({len(errors)} bad line(s) skipped)" if errors else ""
            raise ValueError(f"{self.path}: no usable problems{detail}")
        return problems

    def train_problem(self, index: int) -> Problem:
        """Training problem ``index`` (modulo the pool size). Raises ValueError if index < 0."""
        return self._train[wrap_index(index, len(self._train))]

    @property
    def train_size(self) -> int:
        """Number of distinct training problems."""
        return len(self._train)

    def eval_problems(self) -> list[Problem]:
        """The held-out eval problems in file order (a new list each call)."""
        return list(self._eval)

    def warm_up(self) -> None:
        """Import math-verify and its parsers (seconds), so that a scoring process's first reward call is not
        charged for them (tasks/scoring.py)."""
        math_equal("1", "1")

    def score(self, response: str, problem: Problem) -> float:
        """1.0 if ``response``'s final answer is math-equivalent to the reference, else 0.0."""
        return math_equal(problem.answer, response)
