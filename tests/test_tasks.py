"""Tests for the task layer: answer extraction, scoring (invariant 12), splits and errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nearpolicy.tasks import Problem, Task, make_task, safe_score
from nearpolicy.tasks.factory import describe_task
from nearpolicy.tasks.answers import extract_final_answer
from nearpolicy.tasks.jsonl import JsonlTask
from nearpolicy.tasks.reasoning_gym import ReasoningGymTask


# ---------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (r"So the result is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{\{1, \{2\}\}}", r"\{1, \{2\}\}"),
        (r"\boxed{x^{2^{3}}+1}", r"x^{2^{3}}+1"),
        (r"final: \fbox{7}", "7"),
        (r"first \boxed{1}, then corrected: \boxed{2}", "2"),
        (r"$\boxed{5}$ and an unclosed \boxed{9", "5"),
        ("The answer is 42.", "42"),
        ("so the final answer is $3.5$. Done.", "3.5"),
        ("Answer: -3", "-3"),
        ("answer: 4\nlater\nANSWER: 5.", "5"),
        ("**Answer:** 17", "17"),
        ("**Answer: 18**", "18"),
        ("I counted 3 apples, then -12.5 more.", "-12.5"),
        ("5-3 = 2", "2"),
        ("It is 1,234,567 in total", "1234567"),
        ("I have no idea what to say.", None),
        ("", None),
        (r"\boxed{}", None),
    ],
)
def test_extract_final_answer(response: str, expected: str | None) -> None:
    assert extract_final_answer(response) == expected


def test_boxed_beats_answer_line_and_numbers() -> None:
    assert extract_final_answer("Answer: 3\n\\boxed{4}\n then 99") == "4"
    assert extract_final_answer("The answer is 8.\nAnswer: 9\n100") == "9"


# ---------------------------------------------------------------- reasoning-gym
@pytest.fixture(scope="module")
def chain_sum() -> ReasoningGymTask:
    return ReasoningGymTask("chain_sum", {}, train_size=200, eval_size=50, seed=0, eval_seed=1)


def test_reasoning_gym_is_a_task(chain_sum: ReasoningGymTask) -> None:
    assert isinstance(chain_sum, Task)
    assert chain_sum.name == "chain_sum"


def test_chain_sum_correct_is_one_wrong_is_zero(chain_sum: ReasoningGymTask) -> None:
    for problem in chain_sum.eval_problems()[:20]:
        answer = problem.entry["answer"]
        # n + 1 never contains n: reasoning-gym gives partial credit when it does
        wrong = str(int(answer) + 1)
        assert chain_sum.score(f"Working...\n\\boxed{{{answer}}}", problem) == 1.0
        assert chain_sum.score(f"The answer is {answer}.", problem) == 1.0
        assert chain_sum.score(f"\\boxed{{{wrong}}}", problem) == 0.0
        assert chain_sum.score("I cannot solve this.", problem) == 0.0


def test_only_the_response_is_scored(chain_sum: ReasoningGymTask) -> None:
    base = chain_sum.eval_problems()[0]
    answer = base.entry["answer"]
    leaky = Problem(f"{base.question} (hint: the answer is {answer})", answer, base.entry)
    assert chain_sum.score("I am not sure.", leaky) == 0.0
    assert chain_sum.score(f"Answer: {answer}", leaky) == 1.0


def test_reasoning_gym_split_disjoint_and_deterministic(chain_sum: ReasoningGymTask) -> None:
    eval_questions = {p.question for p in chain_sum.eval_problems()}
    train = [chain_sum.train_problem(i) for i in range(chain_sum.train_size)]
    assert not eval_questions & {p.question for p in train}
    assert chain_sum.dropped_overlap == 200 - chain_sum.train_size
    again = ReasoningGymTask("chain_sum", {}, train_size=200, eval_size=50, seed=0, eval_seed=1)
    eval_q = [p.question for p in chain_sum.eval_problems()]
    assert [p.question for p in again.eval_problems()] == eval_q
    assert again.train_problem(7) == chain_sum.train_problem(7)
    assert chain_sum.train_problem(chain_sum.train_size + 3) == chain_sum.train_problem(3)
    other = ReasoningGymTask("chain_sum", {}, train_size=200, eval_size=50, seed=5, eval_seed=1)
    assert [other.train_problem(i).question for i in range(20)] != [p.question for p in train[:20]]
    with pytest.raises(ValueError, match=">= 0"):
        chain_sum.train_problem(-1)


def test_reasoning_gym_errors() -> None:
    with pytest.raises(ValueError, match=r"task\.name.*no_such_dataset"):
        ReasoningGymTask("no_such_dataset", {}, 10, 5, 0, 1)
    with pytest.raises(ValueError, match=r"task\.options.*bogus"):
        ReasoningGymTask("chain_sum", {"bogus": 1}, 10, 5, 0, 1)
    with pytest.raises(ValueError, match=r"task\.options.*min_terms"):
        ReasoningGymTask("chain_sum", {"min_terms": 0}, 10, 5, 0, 1)
    with pytest.raises(ValueError, match=r"task\.options.*seed"):
        ReasoningGymTask("chain_sum", {"seed": 3}, 10, 5, 0, 1)
    # One term of one digit: only 10 distinct questions, all of them in a 200-item eval set.
    tiny = {"min_terms": 1, "max_terms": 1, "min_digits": 1, "max_digits": 1}
    with pytest.raises(ValueError, match="chain_sum.*too few distinct problems"):
        ReasoningGymTask("chain_sum", tiny, 30, 200, 0, 1)


# ---------------------------------------------------------------- jsonl
def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _rows(n: int) -> list[str]:
    return [json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) for i in range(n)]


@pytest.mark.parametrize(
    ("reference", "response", "expected"),
    [
        ("0.5", r"So \boxed{\frac{1}{2}}", 1.0),
        (r"\frac{1}{2}", "The answer is 0.5.", 1.0),
        ("2\\pi", r"\boxed{2\pi}", 1.0),
        ("2\\pi", r"\boxed{2}", 0.0),  # a bare parse of "2\pi" would keep only the 2
        ("(1, 2)", r"\boxed{2}", 0.0),
        ("\\sqrt{2}/2", r"\boxed{\frac{\sqrt{2}}{2}}", 1.0),
        ("12", "Answer: 12", 1.0),
        ("12", "Answer: 13", 0.0),
        ("12", "no answer here", 0.0),
    ],
)
def test_math_verify_equivalence(
    tmp_path: Path, reference: str, response: str, expected: float
) -> None:
    task = JsonlTask(_write(tmp_path, [json.dumps({"prompt": "q", "answer": reference})]), 0, 0, 1)
    assert task.score(response, task.train_problem(0)) == expected


@pytest.mark.parametrize("reference", ["", "}{", "\\frac{", "$\\frac{$", "???"])
def test_unparseable_reference_never_scores_one(tmp_path: Path, reference: str) -> None:
    task = JsonlTask(_write(tmp_path, [json.dumps({"prompt": "q", "answer": reference})]), 0, 0, 1)
    problem = task.train_problem(0)
    for response in [reference, f"\\boxed{{{reference}}}", f"Answer: {reference}", "0", ""]:
        assert task.score(response, problem) == 0.0


def test_math_verify_scoring_works_off_the_main_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from nearpolicy.tasks.jsonl import math_equal

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(math_equal, ["0.5", "3"], [r"\boxed{\frac{1}{2}}", "Answer: 4"]))
    assert results == [1.0, 0.0]


def test_jsonl_only_the_response_is_scored(tmp_path: Path) -> None:
    task = JsonlTask(_write(tmp_path, [json.dumps({"prompt": "q", "answer": "17"})]), 0, 0, 1)
    leaky = Problem("The answer is 17. What is the answer?", "17", {"prompt": "", "answer": "17"})
    assert task.score("I do not know.", leaky) == 0.0
    assert task.score("Answer: 17", leaky) == 1.0


def test_jsonl_bad_lines_reported(tmp_path: Path) -> None:
    lines = _rows(4)
    lines.insert(1, "{not json")  # line 2
    lines.insert(3, json.dumps({"prompt": "no answer key"}))  # line 4
    lines.append(json.dumps({"prompt": "", "answer": 1}))  # line 7
    lines.append(json.dumps({"prompt": 5, "answer": 1}))  # line 8
    path = _write(tmp_path, lines)
    with pytest.raises(ValueError, match=r"data\.jsonl.*\[2, 4, 7, 8\]"):
        JsonlTask(path, 1, 0, 1)
    task = JsonlTask(path, 1, 0, 1, skip_bad_lines=True)
    assert task.skipped_lines == [2, 4, 7, 8]
    assert task.train_size + len(task.eval_problems()) == 4


def test_a_jsonl_line_nested_past_the_recursion_limit_is_a_bad_line_not_a_crash(tmp_path: Path) -> None:
    lines = _rows(3)
    lines.insert(1, '{"prompt": "x", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}")  # line 2
    path = _write(tmp_path, lines)
    with pytest.raises(ValueError, match=r"data\.jsonl.*\[2\]"):
        JsonlTask(path, 1, 0, 1)
    assert JsonlTask(path, 1, 0, 1, skip_bad_lines=True).skipped_lines == [2]


def test_jsonl_empty_file_and_nothing_left(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no usable problems"):
        JsonlTask(_write(tmp_path, [""]), 1, 0, 1)
    with pytest.raises(ValueError, match="no usable problems"):
        JsonlTask(_write(tmp_path, ["[1, 2]", "{}"]), 1, 0, 1, skip_bad_lines=True)


def test_jsonl_split_disjoint_and_deterministic(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(20))
    task = JsonlTask(path, 5, seed=0, eval_seed=1)
    eval_q = [p.question for p in task.eval_problems()]
    train_q = [task.train_problem(i).question for i in range(task.train_size)]
    assert len(eval_q) == 5 and task.train_size == 15
    assert not set(eval_q) & set(train_q)
    assert sorted(eval_q + train_q) == sorted(json.loads(r)["prompt"] for r in _rows(20))
    again = JsonlTask(path, 5, seed=0, eval_seed=1)
    assert [p.question for p in again.eval_problems()] == eval_q
    assert [again.train_problem(i).question for i in range(15)] == train_q
    assert task.train_problem(15 + 2) == task.train_problem(2)
    assert JsonlTask(path, 100, 0, 1).eval_size == 10  # at most half the file


def test_jsonl_split_is_by_prompt_so_a_repeated_prompt_never_lands_in_both(tmp_path: Path) -> None:
    """OpenRLHF #1089: 50 lines of 40 distinct prompts (prompts 0-9 twice); split by line index, 6 of 10 eval
    questions were also trained on. By prompt: none is, and the lines dropped for it are counted and reported."""
    lines = _rows(40) + _rows(10)
    task = JsonlTask(_write(tmp_path, lines), 10, seed=0, eval_seed=1)
    eval_q = [p.question for p in task.eval_problems()]
    train_q = [task.train_problem(i).question for i in range(task.train_size)]
    assert len(eval_q) == len(set(eval_q)) == 10 and not set(eval_q) & set(train_q)
    counts = {q: sum(json.loads(line)["prompt"] == q for line in lines) for q in eval_q}
    assert task.dropped_overlap == sum(counts.values()) - 10 > 0  # the held-out prompts' second lines
    assert task.train_size == 50 - sum(counts.values())
    assert sorted(set(train_q) | set(eval_q)) == sorted(json.loads(r)["prompt"] for r in _rows(40))
    assert f"{task.dropped_overlap} training problem(s) dropped as duplicates of eval problems" in describe_task(task)
    # a file without repeats splits as it did by line: its eval lines are the same
    plain = JsonlTask(_write(tmp_path, _rows(40)), 10, seed=0, eval_seed=1)
    order = list(range(40))
    random.Random(1).shuffle(order)
    assert [p.question for p in plain.eval_problems()] == [f"What is {i} + {i}?" for i in sorted(order[:10])]
    assert plain.dropped_overlap == 0 and plain.train_size == 30
    assert JsonlTask(_write(tmp_path, lines[:2] + lines[:2]), 5, 0, 1).eval_size == 1  # half the distinct prompts


# ---------------------------------------------------------------- factory and safe_score
def test_make_task(tmp_path: Path) -> None:
    task = make_task("jsonl", path=_write(tmp_path, _rows(6)), eval_size=2, seed=0, eval_seed=1)
    assert isinstance(task, JsonlTask) and len(task.eval_problems()) == 2
    rg = make_task("reasoning_gym", name="chain_sum", options={}, train_size=10, eval_size=2)
    assert isinstance(rg, ReasoningGymTask)
    with pytest.raises(ValueError, match="unknown task kind 'nope'.*reasoning_gym, jsonl"):
        make_task("nope")


class _Exploding:
    name = "exploding"

    def train_problem(self, index: int) -> Problem:
        return Problem("q", "1", {})

    def eval_problems(self) -> list[Problem]:
        return []

    def score(self, response: str, problem: Problem) -> float:
        if response == "nan":
            return float("nan")
        raise RuntimeError("checker broke")


def test_safe_score(chain_sum: ReasoningGymTask) -> None:
    problem = Problem("q", "1", {})
    reward, error = safe_score(_Exploding(), "x", problem)  # unscorable: NaN (left out of group statistics), not 0
    assert math.isnan(reward) and error == "RuntimeError: checker broke"
    reward, error = safe_score(_Exploding(), "nan", problem)
    assert math.isnan(reward) and error is not None and error.startswith("ValueError")
    real = chain_sum.eval_problems()[0]
    assert safe_score(chain_sum, f"Answer: {real.answer}", real) == (1.0, None)


# ---------------------------------------------------------------- fuzzing
_TOKENS = list("0123456789-+.,$*{}\\ \n:abx") + [
    "\\boxed{", "\\fbox{", "\\frac", "Answer:", "**", "The answer is "
]
_TEXT = st.lists(st.sampled_from(_TOKENS), max_size=30).map("".join) | st.text(max_size=60)


@settings(max_examples=300, deadline=None)
@given(_TEXT)
def test_fuzz_extract_never_raises(text: str) -> None:
    answer = extract_final_answer(text)
    assert answer is None or (answer and answer == answer.strip())


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_TEXT)
def test_fuzz_scores_in_unit_interval(chain_sum: ReasoningGymTask, text: str) -> None:
    problem = chain_sum.eval_problems()[0]
    assert 0.0 <= chain_sum.score(text, problem) <= 1.0


@settings(max_examples=60, deadline=None)
@given(_TEXT, st.sampled_from(["0.5", "12", r"\frac{1}{3}", "x^2+1", ""]))
def test_fuzz_math_verify_score_in_unit_interval(text: str, reference: str) -> None:
    from nearpolicy.tasks.jsonl import math_equal

    assert math_equal(reference, text) in (0.0, 1.0)


def test_partial_credit_of_reasoning_gym_scorer_is_not_a_reward():
    """chain_sum's scorer gives 0.5 to "-5" when the answer is "5"; a wrong answer must score 0."""
    task = ReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                            train_size=50, eval_size=10, seed=0, eval_seed=1)
    problem = task.eval_problems()[0]
    assert task.score(f"Answer: {problem.answer}", problem) == 1.0
    assert task.score(f"Answer: -{problem.answer}" if not problem.answer.startswith("-") else f"Answer: 1{problem.answer}", problem) == 0.0
    assert task.score(f"Answer: 1{problem.answer.lstrip('-')}", problem) == 0.0


def test_jsonl_with_one_usable_line_is_rejected_instead_of_an_empty_eval(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    with pytest.raises(ValueError, match="at least 2"):
        JsonlTask(path, eval_size=10, seed=0, eval_seed=1)
    path.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')
    task = JsonlTask(path, eval_size=10, seed=0, eval_seed=1)
    assert len(task.eval_problems()) == 1 and task.train_size == 1
