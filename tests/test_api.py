"""The Python API (api.py) end to end on the tiny model with the in-process hf engine: a JSONL task scored by a
reward function written to tmp_path; the rewards logged (training and eval), the metrics returned, samples.jsonl
and eval_outcomes.jsonl, and the report's samples; errors; and the `__main__` guard a script needs."""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nearpolicy
from nearpolicy.runs.report import write_report
from nearpolicy.runs.samples import read_outcomes

PROMPTS = [f"Q{i}: is 1 < {i} & {i} > 0?" for i in range(12)]  # characters the report must escape
REWARD = """
import json
from pathlib import Path

ANSWERS = {row["prompt"]: row["answer"] for row in map(json.loads, Path(DATA).read_text().splitlines())}

def reward(prompt, completion, answer):
    if ANSWERS[prompt] != answer:  # the problem's own prompt and answer are passed in
        raise ValueError("prompt and answer do not belong together")
    return 0.25 + 0.5 * (len(completion) % 2)
"""


def parity_reward(text: str) -> float:
    return 0.25 + 0.5 * (len(text) % 2)


def _setup(tmp_path: Path, model_dir: Path, *sets: str):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n" for i, p in enumerate(PROMPTS)))
    (tmp_path / "my_reward.py").write_text(f"DATA = {str(data)!r}\n" + textwrap.dedent(REWARD))
    return nearpolicy.load_config(None, [
        f"model.path='{model_dir}'", f"run.output_dir='{tmp_path / 'runs'}'", "run.name=api", "run.steps=2",
        "run.threads=1", "engine.kind=hf", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
        "algorithm.micro_batch_size=4", "sampling.max_new_tokens=6", "model.max_context=256", "task.kind=jsonl",
        f"task.path='{data}'", "task.eval_size=4", f"task.reward_function='{tmp_path / 'my_reward.py'}:reward'",
        "logging.eval_every=100", "logging.tensorboard=false", "logging.progress=false", *sets])


def test_a_python_reward_trains_through_the_api_and_its_rewards_are_logged(tiny_model_dir, tmp_path):
    cfg = _setup(tmp_path, tiny_model_dir)
    lines: list[str] = []
    result = nearpolicy.train(cfg, progress=False, log=lines.append)

    assert result.exit_code == 0 and not result.stopped
    assert result.run_dir == tmp_path / "runs" / "api"
    assert f"task jsonl:data.jsonl: 8 train / 4 eval problems; reward: task.reward_function {cfg.task.reward_function}" \
        in lines
    assert [row["step"] for row in result.metrics] == [0, 1, 2]
    first, last = result.metrics[0]["eval/accuracy"], result.metrics[2]["eval/accuracy"]
    best_step = max((0, 2), key=lambda step: result.metrics[step]["eval/accuracy"])  # the first of equals
    assert f"step 0 eval accuracy {first:.3f}" in lines and f"step 2 eval accuracy {last:.3f}" in lines
    assert lines[-1] == result.message and result.message.startswith(
        f"done: eval accuracy {first:.3f} (step 0) -> {last:.3f} (step 2), best "
        f"{result.metrics[best_step]['eval/accuracy']:.3f} (step {best_step}); metrics in ")
    assert "; to train further, resume with more steps: " in result.message  # a constant lr: --resume extends it
    assert result.final is result.metrics[-1] and "eval/accuracy" in result.final
    assert nearpolicy.read_metrics(result.run_dir) == result.metrics

    for row in result.metrics[1:]:  # 8 rewards of 0.25 or 0.75: mean and (unbiased) std follow from the odd count
        assert row["reward/unscorable"] == 0 and row["reward/timeouts"] == 0
        odd = (row["reward/mean"] - 0.25) / 0.5 * 8
        assert odd == pytest.approx(round(odd), abs=1e-5) and 0 <= round(odd) <= 8
        k = round(odd)
        assert row["reward/std"] == pytest.approx(0.5 * math.sqrt(k * (8 - k) / (8 * 7)), abs=1e-6)

    samples = nearpolicy.read_samples(result.run_dir)
    assert [(s["step"], s["index"]) for s in samples] == [(0, i) for i in range(4)] + [(2, i) for i in range(4)]
    assert all(set(s) == {"step", "index", "prompt", "answer", "response", "reward", "status"} for s in samples)
    answers = {p: str(i) for i, p in enumerate(PROMPTS)}
    for s in samples:  # the reward logged is the function's value on the response logged
        assert s["status"] == "ok" and s["reward"] == parity_reward(s["response"])
        assert s["answer"] == answers[s["prompt"]]
    for step in (0, 2):  # the 4 samples are the whole eval set here, so eval/accuracy is their mean reward
        rewards = [s["reward"] for s in samples if s["step"] == step]
        assert result.metrics[step]["eval/accuracy"] == pytest.approx(sum(rewards) / 4, abs=1e-9)

    write_report([result.run_dir], tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    section = page[page.index("<h2>Eval samples</h2>"):]
    assert section.index("eval at step 2") < section.index("eval at step 0")  # newest first
    assert html.escape(samples[-1]["prompt"]) in section and samples[-1]["prompt"] not in section  # escaped
    assert section.count("<tr>") == 2 * (1 + 4)  # two evals: a header and 4 samples each



def test_every_eval_records_every_eval_problems_reward_beside_the_first_samples(tiny_model_dir, tmp_path):
    cfg = _setup(tmp_path, tiny_model_dir, "task.eval_size=6")  # more eval problems than samples.jsonl keeps
    result = nearpolicy.train(cfg, progress=False, log=lambda _: None)
    assert result.exit_code == 0
    outcomes, warnings = read_outcomes(result.run_dir)
    assert warnings == [] and [row["step"] for row in outcomes] == [0, 2]  # one row per eval
    samples = nearpolicy.read_samples(result.run_dir)
    assert [(s["step"], s["index"]) for s in samples] == [(0, i) for i in range(4)] + [(2, i) for i in range(4)]
    for row in outcomes:
        rewards = row["rewards"]
        assert len(rewards) == 6 and set(rewards) <= {0.25, 0.75}  # one per eval problem, the parity reward's values
        assert rewards[:4] == [s["reward"] for s in samples if s["step"] == row["step"]]  # same order as samples
        assert result.metrics[row["step"]]["eval/accuracy"] == pytest.approx(sum(rewards) / 6, abs=1e-9)

def test_train_refuses_an_existing_run_with_a_training_error(tmp_path):
    cfg = nearpolicy.load_config(None, [f"run.output_dir='{tmp_path}'", "run.name=taken"])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # steps logged: not a restart
    with pytest.raises(nearpolicy.TrainingError, match="holds a run that logged steps up to 1") as err:
        nearpolicy.train(cfg, log=lambda _: None)
    assert err.value.exit_code == 2 and err.value.run_dir == tmp_path / "taken"


def test_a_bad_reward_function_is_a_start_up_training_error(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in PROMPTS))
    cfg = nearpolicy.load_config(None, [f"run.output_dir='{tmp_path}'", "task.kind=jsonl", f"task.path='{data}'",
                                        "task.reward_function='no_such_module_xyz:reward'"])
    with pytest.raises(nearpolicy.TrainingError, match="no module named 'no_such_module_xyz'") as err:
        nearpolicy.train(cfg, log=lambda _: None)
    assert err.value.exit_code == 2 and not (tmp_path / cfg.run.name).exists()  # no folder left behind


def test_config_and_read_metrics_from_the_package(tmp_path):
    cfg = nearpolicy.Config(run={"steps": 5}, task={"kind": "jsonl", "path": "data.jsonl"})
    assert (cfg.run.steps, cfg.task.kind, cfg.task.options) == (5, "jsonl", None)
    assert nearpolicy.load_config(None, ["run.steps=3"]).run.steps == 3
    with pytest.raises(nearpolicy.ConfigError, match="run.stepz"):
        nearpolicy.load_config(None, ["run.stepz=3"])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 0}\n{"step": 2, "rew')
    with pytest.warns(UserWarning, match="skipped line 3, cut short"):
        assert nearpolicy.read_metrics(tmp_path) == [{"step": 0}, {"step": 1, "reward/mean": 0.5}]


def test_train_in_a_child_importing_the_script_exits_naming_the_guard(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(SystemExit, match='if __name__ == "__main__":'):
        nearpolicy.train(nearpolicy.Config())


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_to_add_it(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in PROMPTS))
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import nearpolicy
        cfg = nearpolicy.load_config(None, ["model.path='{tiny_model_dir}'", "run.output_dir='{tmp_path}'",
                                            "engine.kind=hf", "run.steps=1", "run.threads=1", "task.kind=jsonl",
                                            "task.path='{data}'", "task.eval_size=2", "sampling.max_new_tokens=4",
                                            "logging.tensorboard=false", "model.max_context=256"])
        nearpolicy.train(cfg, progress=False)
        """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert (f"TrainingError: {script} calls nearpolicy.train without an `if __name__ == \"__main__\":` block"
            in proc.stderr)
    assert "scoring process" not in proc.stderr  # refused before anything started
    assert not (tmp_path / "grpo-smollm2-chain-sum").exists()  # the default run.name the script uses
    guarded = tmp_path / "guarded.py"
    guarded.write_text(script.read_text().replace("nearpolicy.train(cfg, progress=False)",
                                                  "if __name__ == '__main__':\n    nearpolicy.train(cfg, progress=False)"))
    proc = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_reward_module_that_cannot_load_in_the_scoring_process_is_a_training_error(tiny_model_dir, tmp_path):
    (tmp_path / "childfail.py").write_text(textwrap.dedent("""
        import multiprocessing
        if multiprocessing.parent_process() is not None:  # fine at the start-up check, broken in the child
            raise ImportError("this module cannot load in a child process")
        def reward(completion):
            return 0.5
        """))
    cfg = _setup(tmp_path, tiny_model_dir, f"task.reward_function='{tmp_path / 'childfail.py'}:reward'")
    with pytest.raises(nearpolicy.TrainingError) as err:
        nearpolicy.train(cfg, progress=False, log=lambda _: None)
    assert err.value.exit_code == 1
    assert str(err.value).startswith("error: the scoring process exited while starting (exit code 1); its error is "
                                     f"above (task.reward_function '{tmp_path / 'childfail.py'}:reward' runs there) "
                                     "at step 0; ")
    with pytest.raises(TypeError, match="nearpolicy.train takes a Config .*got str 'configs/main.toml'"):
        nearpolicy.train("configs/main.toml")
