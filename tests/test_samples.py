"""samples.jsonl and eval_outcomes.jsonl (runs/samples.py): the rows an eval writes (training.phases.eval_samples; every
problem's reward), NaN as null, the truncation on resume, the lenient readers, and the report's "Eval samples" section
(newest evals first, HTML-escaped)."""

from __future__ import annotations

import json
import math
import re

import pytest

from nearpolicy.training.phases import eval_samples
from nearpolicy.runs.report import SAMPLE_EVALS, Run, load_run, samples_section
from nearpolicy.runs.samples import SAMPLES_PER_EVAL, SampleLog, read_outcomes, read_samples
from nearpolicy.tasks import Problem
from nearpolicy.tasks.scoring import ScoreResult


class _Tokenizer:
    """decode: the ids as letters; a special token (0) is dropped when asked, as the reward's text drops it."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 and skip_special_tokens else chr(ord("a") + i) for i in ids)


def _row(step: int, index: int = 0, **extra) -> dict:
    return {"step": step, "index": index, "prompt": f"p{index}", "answer": "1", "response": "r", "reward": 1.0,
            "status": "ok"} | extra


def test_eval_samples_are_the_first_problems_with_the_text_the_reward_saw():
    problems = [Problem(f"q{i}", str(i), {}) for i in range(6)]
    completions = [[0, 1, 2], [3], [], [4, 0], [5], [6]]
    results = [ScoreResult(1.0, "ok"), ScoreResult(math.nan, "error", "KeyError: x"), ScoreResult(0.0, "timeout", "t"),
               ScoreResult(0.5, "ok"), ScoreResult(0.0, "ok"), ScoreResult(0.0, "ok")]
    rows = eval_samples(7, _Tokenizer(), problems, completions, results)
    assert len(rows) == SAMPLES_PER_EVAL == 4
    assert rows[0] == {"step": 7, "index": 0, "prompt": "q0", "answer": "0", "response": "bc", "reward": 1.0,
                       "status": "ok"}
    assert rows[1]["status"] == "error" and rows[1]["message"] == "KeyError: x" and math.isnan(rows[1]["reward"])
    assert rows[2]["response"] == "" and rows[3]["response"] == "e"
    assert len(eval_samples(7, _Tokenizer(), problems[:2], completions[:2], results[:2])) == 2


def test_the_log_writes_nan_as_null_and_reads_back_in_step_order(tmp_path):
    log = SampleLog(tmp_path)
    log.write([_row(10), _row(0, reward=math.nan, status="error", message="m")])
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert json.loads(lines[1])["reward"] is None
    rows, warnings = read_samples(tmp_path)
    assert [r["step"] for r in rows] == [0, 10] and warnings == []


@pytest.mark.parametrize("resumed_at,kept", [(0, []), (10, [0, 10]), (20, [0, 10, 20])])
def test_a_resume_drops_the_samples_of_the_evals_it_runs_again(tmp_path, resumed_at, kept):
    SampleLog(tmp_path).write([_row(0), _row(10), _row(20)])
    SampleLog(tmp_path, resumed_at=resumed_at)
    assert [r["step"] for r in read_samples(tmp_path)[0]] == kept
    aside = tmp_path / "samples.before-restart.jsonl"  # a start over keeps the earlier start's samples aside
    if resumed_at == 0:
        assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [0, 10, 20]
    else:
        assert not aside.exists()


def test_a_resume_keeps_the_lines_it_cannot_read(tmp_path):
    text = json.dumps(_row(0)).encode() + b"\n\xff\xfe not utf-8\n" + json.dumps(_row(20)).encode() + b"\n[1]\n"
    (tmp_path / "samples.jsonl").write_bytes(text)
    SampleLog(tmp_path, resumed_at=10)
    assert (tmp_path / "samples.jsonl").read_bytes() == (json.dumps(_row(0)).encode() + b"\n\xff\xfe not utf-8\n"
                                                         + b"[1]\n")


def test_unreadable_lines_are_skipped_with_a_warning(tmp_path):
    assert read_samples(tmp_path) == ([], [])
    (tmp_path / "samples.jsonl").write_text(json.dumps(_row(0)) + '\n[1]\n{"step": "x"}\n\n{"step": 2, "resp')
    rows, warnings = read_samples(tmp_path)
    assert [r["step"] for r in rows] == [0]
    assert [w.split(": ")[1] for w in warnings] == ["skipped line 2, not a sample object with an integer 'step'",
                                                   "skipped line 3, not a sample object with an integer 'step'",
                                                   "skipped line 5, not a sample object with an integer 'step'"]



def test_the_outcome_log_writes_one_line_per_eval_with_every_reward_nan_as_null(tmp_path):
    log = SampleLog(tmp_path)
    log.write_outcomes(10, [1.0, 0.0, 0.5])
    log.write_outcomes(0, [math.nan, math.inf, 0.25])
    lines = (tmp_path / "eval_outcomes.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 10, "rewards": [1.0, 0.0, 0.5]},
                                                    {"step": 0, "rewards": [None, None, 0.25]}]
    assert read_outcomes(tmp_path) == ([{"step": 0, "rewards": [None, None, 0.25]},
                                        {"step": 10, "rewards": [1.0, 0.0, 0.5]}], [])


@pytest.mark.parametrize("resumed_at,kept", [(0, []), (10, [0, 10]), (20, [0, 10, 20])])
def test_a_resume_cuts_the_outcomes_back_as_it_cuts_the_samples(tmp_path, resumed_at, kept):
    log = SampleLog(tmp_path)
    for step in (0, 10, 20):
        log.write([_row(step)])
        log.write_outcomes(step, [1.0, 0.0])
    with (tmp_path / "eval_outcomes.jsonl").open("a") as f:
        f.write("not json\n")
    SampleLog(tmp_path, resumed_at=resumed_at)
    rows, warnings = read_outcomes(tmp_path)
    assert [r["step"] for r in rows] == kept == [r["step"] for r in read_samples(tmp_path)[0]]
    aside = tmp_path / "eval_outcomes.before-restart.jsonl"
    if resumed_at == 0:  # a start over moves the earlier start's outcomes aside, unreadable line and all
        assert aside.read_text().splitlines()[-1] == "not json" and warnings == []
        assert [json.loads(line)["step"] for line in aside.read_text().splitlines()[:3]] == [0, 10, 20]
    else:  # the line it cannot read is kept, and skipped by the reader with a warning
        assert not aside.exists() and warnings == [f"{tmp_path / 'eval_outcomes.jsonl'}: skipped line {len(kept) + 1}, "
                                                   "not an outcome object with an integer 'step' and a list 'rewards' "
                                                   "of numbers or null"]


def test_the_outcome_reader_skips_rows_that_are_not_step_and_rewards(tmp_path):
    assert read_outcomes(tmp_path) == ([], [])  # a run from before the file existed
    good = {"step": 2, "rewards": [1, None, 0.5]}
    bad = [{"step": 1}, {"step": True, "rewards": []}, {"step": 3, "rewards": ["1"]}, {"step": 4, "rewards": 1.0},
           {"step": 5, "rewards": [True]}]
    (tmp_path / "eval_outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good, *bad]))
    rows, warnings = read_outcomes(tmp_path)
    assert rows == [good] and [w.split(": ")[1].split(",")[0] for w in warnings] == [f"skipped line {n}"
                                                                                   for n in range(2, 7)]

def test_the_report_shows_the_newest_evals_escaped():
    rows = [_row(step, i, prompt=f"<script>alert({step})</script>", response="a & b") for step in (0, 10, 20, 30)
            for i in range(2)]
    rows.append(_row(30, 2, reward=None, status="timeout", message="reward call exceeded 1 s"))
    page = samples_section([Run("r", [{"step": 0}], samples=rows)])
    shown = [int(step) for step in re.findall(r"eval at step (\d+)", page)]
    assert shown == [30, 20, 10] and len(shown) == SAMPLE_EVALS
    assert "<script>" not in page and "&lt;script&gt;alert(30)&lt;/script&gt;" in page and "a &amp; b" in page
    assert "unscorable (timeout: reward call exceeded 1 s)" in page
    assert page.count("<tr>") == 3 * 1 + 2 + 2 + 3  # a header per eval, then its samples
    empty = samples_section([Run("a", [{"step": 0}]), Run("b", [{"step": 0}], samples=rows[:1])])
    assert "<h3>a</h3><p class='note'>not recorded in this run (samples.jsonl)</p>" in empty
    assert "<h3>b</h3><h4>eval at step 0</h4>" in empty


def test_a_long_response_is_cut():
    page = samples_section([Run("r", [{"step": 0}], samples=[_row(0, response="x" * 5000)])])
    assert "x" * 800 + "..." in page and "x" * 801 not in page


def test_load_run_reads_the_samples_and_their_warnings(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    (tmp_path / "samples.jsonl").write_text(json.dumps(_row(0)) + "\nnot json\n")
    run = load_run(tmp_path)
    assert run.samples == [_row(0)] and run.warnings == [f"{tmp_path / 'samples.jsonl'}: skipped line 2, not a "
                                                         "sample object with an integer 'step'"]
