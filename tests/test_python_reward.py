"""task.reward_function (tasks/python_reward.py): loading "module:function" and "file.py:function", the keyword
arguments a function gets, the start-up checks and their messages, per-sample errors and the time limit in the
scoring process, JSONL lines without an answer, the start-up description of a task, and switching task.kind /
task.name on top of configs/main.toml."""

from __future__ import annotations

import json
import math
import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from nearpolicy.config.schema import load_config
from nearpolicy.tasks import make_task, safe_score
from nearpolicy.tasks.factory import describe_task
from nearpolicy.tasks.python_reward import PythonRewardTask, check_reward, load_reward_function
from nearpolicy.tasks.scoring import BoundedScorer

MAIN_TOML = Path(__file__).parents[1] / "configs" / "main.toml"
REWARDS = """
import time

CALLS = []

def parity(completion, answer):
    return 0.25 + 0.5 * (len(completion) % 2)

def everything(**kwargs):
    CALLS.append(kwargs)
    return 1.0

def echo_answer(prompt, completion, answer, entry):
    return 1.0 if completion == answer and entry["answer"] == answer and prompt.startswith("Q") else 0.0

def by_text(completion):
    if completion == "raise":
        raise KeyError("boom")
    if completion == "sleep":
        time.sleep(30)
    return {"str": "0.5", "none": None, "big": 1.5, "nan": float("nan"), "true": True}.get(completion, 0.5)

def returns_str(completion):
    return "0.5"

def returns_big(completion):
    return 1.5

def raises(completion):
    raise RuntimeError("no judge reachable")

def no_completion(prompt, answer):
    return 0.0

def extra_required(completion, tokenizer):
    return 0.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def _jsonl(tmp_path: Path, rows: list[dict], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"Q{i}: what is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


def test_a_module_on_sys_path_and_a_file_path_give_the_same_function(rewards_file, monkeypatch):
    monkeypatch.syspath_prepend(str(rewards_file.parent))
    by_module, arguments = load_reward_function("my_rewards:parity")
    by_file, _ = load_reward_function(f"{rewards_file}:parity")
    assert arguments == ("completion", "answer")
    assert by_module("abc", "x") == by_file("abc", "x") == 0.75


def test_a_module_in_the_current_folder_is_found_without_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards.py").write_text("def f(completion):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert load_reward_function("cwd_rewards:f")[0]("x") == 0.5
    assert str(tmp_path) in sys.path  # what the spawned scoring process inherits


def test_the_function_gets_the_keyword_arguments_it_declares(rewards_file, tmp_path):
    task = make_task("jsonl", path=_jsonl(tmp_path, _rows(6)), eval_size=2, reward_function=f"{rewards_file}:everything")
    problem = task.eval_problems()[0]
    assert task.score("resp", problem) == 1.0
    module = sys.modules["nearpolicy_reward_my_rewards"]
    # the first call is the start-up check: the first training problem, its answer as the completion
    first = task.train_problem(0)
    assert module.CALLS[0] == {"prompt": first.question, "completion": first.answer, "answer": first.answer,
                               "entry": first.entry}
    assert module.CALLS[-1] == {"prompt": problem.question, "completion": "resp", "answer": problem.answer,
                                "entry": problem.entry}
    echo = make_task("jsonl", path=_jsonl(tmp_path, _rows(6)), eval_size=2, reward_function=f"{rewards_file}:echo_answer")
    assert echo.score(problem.answer, problem) == 1.0 and echo.score(problem.answer + "0", problem) == 0.0


@pytest.mark.parametrize("spec,needle", [
    ("no_colon_here", "expected 'module:function'"),
    ("not_a_module_anywhere_xyz:f", "no module named 'not_a_module_anywhere_xyz' on sys.path"),
    ("FILE:missing", "has no attribute 'missing'"),
    ("FILE:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
    ("FILE:no_completion", "it takes no `completion` keyword parameter, the one it must take of the keyword"),
    ("FILE:extra_required", "required parameter(s) ['tokenizer'] are not among the keyword arguments"),
    ("FILE:returns_str", "failed on a sample (the first training problem"),
    ("FILE:returns_big", "returned 1.5, outside [0, 1]"),
    ("FILE:raises", "RuntimeError: no judge reachable"),
    ("missing_file.py:f", "does not exist"),
])
def test_a_bad_hook_stops_the_start_naming_task_reward_function(rewards_file, tmp_path, spec, needle):
    spec = spec.replace("FILE", str(rewards_file))
    with pytest.raises(ValueError, match=r"task\.reward_function") as err:
        make_task("jsonl", path=_jsonl(tmp_path, _rows(6)), eval_size=2, reward_function=spec)
    assert needle in str(err.value)


def test_a_module_exiting_at_import_or_a_hanging_check_stops_the_start_naming_the_key(tmp_path, monkeypatch):
    from nearpolicy.tasks import python_reward

    (tmp_path / "exits.py").write_text("import sys\nsys.exit('I exit at import')\n")
    with pytest.raises(ValueError, match=r"task\.reward_function .*exits\.py.*SystemExit: I exit at import"):
        load_reward_function(f"{tmp_path / 'exits.py'}:f")
    (tmp_path / "hangs.py").write_text("import time\ndef reward(completion):\n    time.sleep(30)\n    return 0.0\n")
    monkeypatch.setattr(python_reward, "CHECK_S", 0.5)
    with pytest.raises(ValueError, match=r"task\.reward_function .* failed on a sample .*TimeoutError: no answer "
                                         r"within 0\.5 s"):
        make_task("jsonl", path=_jsonl(tmp_path, _rows(6)), eval_size=2, reward_function=f"{tmp_path / 'hangs.py'}:reward")


def test_an_import_error_inside_the_module_is_not_called_a_missing_module(tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import not_installed_dependency_xyz\ndef f(completion):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="importing module 'needs_dep' failed: ModuleNotFoundError"):
        load_reward_function("needs_dep:f")


def test_a_bad_return_value_makes_that_sample_unscorable(rewards_file, tmp_path):
    task = make_task("jsonl", path=_jsonl(tmp_path, _rows(6)), eval_size=2, reward_function=f"{rewards_file}:by_text")
    problem = task.eval_problems()[0]
    assert safe_score(task, "fine", problem) == (0.5, None)
    assert safe_score(task, "true", problem) == (1.0, None)  # a bool is 0 / 1
    for text, error in [("str", "TypeError: reward function"), ("none", "returned NoneType None"),
                        ("big", "outside [0, 1]"), ("nan", "returned nan, outside [0, 1]"), ("raise", "KeyError")]:
        reward, message = safe_score(task, text, problem)
        assert math.isnan(reward) and error in message, (text, message)


def test_check_reward_accepts_numbers_in_range_only():
    assert check_reward("m:f", 0) == 0.0 and check_reward("m:f", 1) == 1.0
    with pytest.raises(TypeError, match="returned str '0.5'"):
        check_reward("m:f", "0.5")
    with pytest.raises(ValueError, match="outside"):
        check_reward("m:f", -0.01)


def test_in_the_scoring_process_each_call_is_time_limited_and_errors_are_counted(rewards_file, tmp_path):
    task = make_task("jsonl", path=_jsonl(tmp_path, _rows(6)), eval_size=2, reward_function=f"{rewards_file}:by_text")
    clone = pickle.loads(pickle.dumps(task))  # what the scoring process receives: the function is imported again
    assert clone._function is None and clone.train_size == task.train_size
    problem = task.eval_problems()[0]
    scorer = BoundedScorer(task, timeout_s=1.0)
    try:
        results = scorer.score([("fine", problem), ("raise", problem), ("sleep", problem), ("true", problem)])
    finally:
        scorer.close()
    assert [(r.reward, r.status) for r in results[::3]] == [(0.5, "ok"), (1.0, "ok")]
    assert math.isnan(results[1].reward) and results[1].status == "error" and "KeyError" in results[1].message
    assert (results[2].reward, results[2].status) == (0.0, "timeout")


def test_jsonl_lines_may_leave_out_the_answer_only_with_a_reward_function(rewards_file, tmp_path):
    path = _jsonl(tmp_path, [{"prompt": f"Q{i}", "topic": "x"} for i in range(6)])
    with pytest.raises(ValueError, match=r"missing key\(s\) \['answer'\]"):
        make_task("jsonl", path=path, eval_size=2)
    task = make_task("jsonl", path=path, eval_size=2, reward_function=f"{rewards_file}:parity")
    problem = task.eval_problems()[0]
    assert problem.answer == "" and problem.entry["topic"] == "x"
    assert task.score("ab", problem) == 0.25


def test_a_reasoning_gym_task_takes_a_reward_function_too(rewards_file):
    task = make_task("reasoning_gym", name="chain_sum", options={}, train_size=10, eval_size=2,
                     reward_function=f"{rewards_file}:parity")
    assert isinstance(task, PythonRewardTask) and task.dropped_overlap == 10 - task.train_size
    assert task.score("abc", task.eval_problems()[0]) == 0.75


def test_the_start_up_line_gives_the_split_the_skipped_lines_and_the_reward(rewards_file, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rows(9)[:4]) + "not json\n"
                    + "".join(json.dumps(row) + "\n" for row in _rows(9)[4:]) + '{"answer": 1}\n')
    plain = make_task("jsonl", path=path, eval_size=3, skip_bad_lines=True)
    assert describe_task(plain) == ("task jsonl:data.jsonl: 6 train / 3 eval problems, skipped 2 bad line(s) 5, 11; "
                                    "reward: the dataset's answer check")
    hooked = make_task("jsonl", path=path, eval_size=3, skip_bad_lines=True, reward_function=f"{rewards_file}:parity")
    assert describe_task(hooked).endswith(f"skipped 2 bad line(s) 5, 11; reward: task.reward_function "
                                          f"{rewards_file}:parity")


def test_switching_task_name_or_kind_over_main_toml_drops_its_options(tmp_path):
    assert load_config(MAIN_TOML).task.options == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    other = load_config(MAIN_TOML, ["task.name=basic_arithmetic"]).task
    assert other.options is None and other.resolved_options() == {}
    built = make_task(other.kind, name=other.name, options=other.resolved_options(), train_size=4, eval_size=2)
    assert built.name == "basic_arithmetic"
    data = _jsonl(tmp_path, _rows(4))
    jsonl = load_config(MAIN_TOML, ["task.kind=jsonl", f"task.path='{data}'"]).task
    assert jsonl.resolved_options() == {}
    assert make_task(jsonl.kind, options=jsonl.resolved_options(), path=jsonl.path, eval_size=2).train_size == 2
    # the same dataset keeps the file's options; new options set with the switch apply alone
    assert load_config(MAIN_TOML, ["task.name=chain_sum"]).task.options["min_terms"] == 2
    assert load_config(MAIN_TOML, ["task.name=basic_arithmetic", "task.options.min_terms=3"]).task.options == {
        "min_terms": 3}


def test_options_on_a_jsonl_task_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="task.options applies only to kind 'reasoning_gym'; remove it"):
        make_task("jsonl", path=_jsonl(tmp_path, _rows(4)), options={"min_terms": 2}, eval_size=2)


def test_the_config_rejects_a_malformed_spec():
    from nearpolicy.config.schema import ConfigError

    with pytest.raises(ConfigError, match="task.reward_function"):
        load_config(None, ["task.reward_function='just_a_name'"])
    assert load_config(None, ["task.reward_function='pkg.mod:fn'"]).task.reward_function == "pkg.mod:fn"

