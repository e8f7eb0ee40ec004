"""A tiny arena through the real training API: 2 corrections x 2 mismatch sources x 1 seed x 2 steps on the tiny
random model with the hf engine (fp32, the trainer's own numerics), one source clean and one with engine.logit_noise.
The table must hold what the runs' metrics.jsonl say; finished cells are never re-run; an interrupted cell resumes
from its checkpoint through the ordinary resume path."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from nearpolicy.api import run_training
from nearpolicy.arena.runner import run_arena
from nearpolicy.arena.spec import load_arena
from nearpolicy.arena.table import collapsed
from nearpolicy.config.schema import Config

REWARD = '''
def reward(completion: str, **kwargs) -> float:
    """1 for a response of an even number of characters: the tiny random model earns it about half the time."""
    return float(len(completion) % 2 == 0)
'''

ARENA = """
[arena]
base = "base.toml"
seeds = [0]

[corrections]
off = { preset = "off" }
tis = { preset = "tis" }

[sources]
clean = { set = ["engine.logit_noise=0.0"] }
noise = { set = ["engine.logit_noise=0.5"], note = "k3 about 0.5^2 / 2 on the near-uniform tiny model" }
"""


def _base(model_dir: Path, folder: Path) -> str:
    return f"""
[run]
steps = 2
threads = 1
[model]
path = "{model_dir}"
max_context = 256
[engine]
kind = "hf"
[algorithm]
prompts_per_step = 2
group_size = 4
micro_batch_size = 4
[sampling]
max_new_tokens = 6
[task]
eval_size = 4
train_size = 50
reward_function = "{folder / 'rewards.py'}:reward"
[logging]
eval_every = 1
checkpoint_every = 1
tensorboard = false
"""


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _dose_standard_error(rows: list[dict]) -> float:
    """Standard error of a noise cell's k3 median (2 steps: the mean of the two step means). On the near-uniform
    tiny model at T = 1, a token drawn from softmax(l + sigma z) has x = log pi - log mu ~ N(-sigma^2 / 2, sigma^2)
    (V large), so its k3 = e^x - 1 - x has mean sigma^2 / 2 and variance Var(e^x) + Var(x) - 2 Cov(e^x, x) =
    (e^(sigma^2) - 1) + sigma^2 - 2 sigma^2 = 0.0340 at sigma = 0.5 (0.0339 in a 20000-draw simulation); each
    step's k3 is the mean over its mismatch/tokens."""
    counts = [r["mismatch/tokens"] for r in rows if "reward/mean" in r]
    assert len(counts) == 2
    variance = math.exp(0.25) - 1 - 0.25
    return 0.5 * math.sqrt(sum(variance / n for n in counts))


@pytest.mark.slow
def test_a_tiny_arena_runs_resumes_and_tabulates_its_runs_metrics(tiny_model_dir, tmp_path, capsys):
    from nearpolicy.cli import main

    (tmp_path / "rewards.py").write_text(REWARD)
    (tmp_path / "base.toml").write_text(_base(tiny_model_dir, tmp_path))
    path = tmp_path / "arena.toml"
    path.write_text(ARENA)
    out = tmp_path / "out"
    assert main(["arena", str(path), "--out", str(out), "--only", "off/*"]) == 0
    spec = load_arena(path, out)
    cells = {c.id: c for c in spec.cells}
    off_metrics = {cid: (cells[cid].run_dir / "metrics.jsonl").read_text() for cid in ("off/clean/s0", "off/noise/s0")}

    def interrupted(cfg, resume, log, progress):  # tis/noise stops after its first step (checkpointed), as on SIGTERM
        if cfg.run.name != "tis__noise__s0":
            return run_training(cfg, resume, log, progress)
        short = Config.model_validate(cfg.model_dump() | {"run": cfg.run.model_dump() | {"steps": 1}})
        run_training(short, resume, log, progress)
        return 143, "stopped by SIGTERM at step 1"

    assert run_arena(spec, say=lambda _: None, train=interrupted) == 143
    assert main(["arena", str(path), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "arena 1/4 off/clean/s0: done earlier, not run again" in err
    state = json.loads((out / "arena-state.json").read_text())["cells"]
    assert {cid: (r["status"], r["attempts"]) for cid, r in state.items()} == {
        "off/clean/s0": ("done", 1), "off/noise/s0": ("done", 1), "tis/clean/s0": ("done", 1),
        "tis/noise/s0": ("done", 2)}
    assert {cid: (cells[cid].run_dir / "metrics.jsonl").read_text() for cid in off_metrics} == off_metrics
    resumed = cells["tis/noise/s0"].run_dir
    assert json.loads((resumed / "plan.json").read_text())["resumed_at_step"] == 1
    assert [r["step"] for r in _rows(resumed)] == [0, 1, 2]
    assert not (resumed / "checkpoints").exists() and not (resumed / "engine").exists()  # deleted once finished

    data = json.loads((out / "arena.json").read_text())
    for result in data["cells"]:
        rows = _rows(cells[result["id"]].run_dir)
        accuracy = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
        k3 = [r["mismatch/k3"] for r in rows if "reward/mean" in r]
        assert (result["final_accuracy"], result["best_accuracy"]) == (accuracy[-1], max(accuracy))
        assert result["k3_median"] == pytest.approx(statistics.median(k3), rel=1e-12)
        assert result["step_seconds"] == pytest.approx(statistics.fmean(r["time/step"] for r in rows if r["step"]))
        assert result["diverged"] is collapsed(accuracy[0], accuracy[-1], 4) and result["steps"] == 2
        if result["source"] == "noise":  # the dose, within 3 standard errors stated from the run's token counts
            assert result["k3_median"] == pytest.approx(0.5**2 / 2, abs=3 * _dose_standard_error(rows))
        else:  # the hf fp32 engine and the trainer: the same numerics
            assert result["k3_median"] < 1e-5
        if result["correction"] == "off":
            assert result["changed_fraction"] == 0.0
        else:
            want = statistics.fmean(r["correction/rejected_frac"] + r["correction/frac_high"] + r["correction/frac_low"]
                                    for r in rows if "reward/mean" in r)
            assert result["changed_fraction"] == pytest.approx(want)
    md = (out / "arena.md").read_text()
    assert "| tis | noise | 1/1 |" in md and "not established: 1 seed; at least 3 needed" in md
    assert (out / "arena.html").read_text().count("data:image/png;base64,") == 2
