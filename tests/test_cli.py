"""`nearpolicy train` through the real CLI on the tiny model: a 2-step run, resume, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEP_KEYS = {"reward/mean", "reward/std", "response/length_mean", "entropy", "mismatch/k1", "mismatch/k3",
             "mismatch/ess", "mismatch/max_abs_logprob_diff", "mismatch/prob_corr", "mismatch/frac_ratio_outside_0.5_2",
             "time/rollout", "time/update", "time/sync", "time/diagnostics", "throughput/rollout_tokens_per_s", "actor/loss"}


def _train(args, cwd):
    return subprocess.run([sys.executable, "-m", "nearpolicy", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def _base(model_path: Path, out: Path, name: str, *extra: str) -> list[str]:
    sets = [f"model.path='{model_path}'", f"run.output_dir='{out}'", f"run.name={name}", "run.steps=2",
            "algorithm.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=2",
            "sampling.max_new_tokens=6", "task.eval_size=4", "task.train_size=50", "logging.eval_every=2",
            "logging.checkpoint_every=1", "model.max_context=256", *extra]
    return [arg for s in sets for arg in ("--set", s)]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_step_run_then_resume(tiny_gguf_factory, tmp_path):
    model = tiny_gguf_factory("f32")
    proc = _train(_base(model, tmp_path, "smoke", "engine.precision=q8_0"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    startup = ["loading the policy", "exporting the policy to GGUF (q8_0) and starting the llamacpp engine",
               "step 0: greedy eval"]  # each slow start-up phase is announced, in order
    assert sorted(startup, key=proc.stderr.find) == startup and all(line in proc.stderr for line in startup)
    run = tmp_path / "smoke"
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2]
    for row in rows[1:]:
        assert STEP_KEYS <= row.keys()
        # k3 = mean(r) - 1 + k1 and ESS = mean(r)^2 / (chi2 + 1): the logged ESS agrees with k1, k3 and chi2
        # (the values themselves against a known offset: test_trainer_families); q8_0 vs fp32 is a real mismatch
        mean_r = row["mismatch/k3"] + 1 - row["mismatch/k1"]
        assert row["mismatch/ess"] == pytest.approx(mean_r**2 / (row["mismatch/chi2"] + 1), rel=1e-9)
        assert row["mismatch/k3"] > 0 and row["mismatch/ess"] < 1
        assert row["policy/version"] == row["step"]
        # one wave of 4 sequences: the prefill samples each one's first token, every decode call one more token of
        # each live sequence, until the longest is done; occupancy is of engine.max_parallel_sequences = 64
        assert row["rollout/decode_calls"] == row["response/length_max"] - 1
        assert row["rollout/decode_calls"] * row["rollout/decode_batch_mean"] == pytest.approx(
            4 * (row["response/length_mean"] - 1), rel=1e-12)
        assert row["rollout/decode_occupancy"] == pytest.approx(row["rollout/decode_batch_mean"] / 64, rel=1e-12)
        # the roofline (engines/roofline.py): per call the larger of two terms, so between the larger of their sums
        # and their total; its share is of generate's time, inside the step's time/rollout; rates measured once
        bound, terms = row["rollout/roofline_s"], (row["rollout/roofline_compute_s"], row["rollout/roofline_memory_s"])
        assert max(terms) * (1 - 1e-12) <= bound <= sum(terms) * (1 + 1e-12) and bound > 0
        assert 0 < bound / row["rollout/roofline_share"] <= row["time/rollout"]
        assert [row[k] for k in ("rollout/roofline_peak_gflops", "rollout/roofline_bandwidth_gbs")] == [
            rows[1]["rollout/roofline_peak_gflops"], rows[1]["rollout/roofline_bandwidth_gbs"]]
    assert (run / "checkpoints" / "step_000002" / "model.safetensors").exists()
    plan = json.loads((run / "plan.json").read_text())  # working_dir: where relative paths are read on --resume RUN_DIR
    assert plan["samples_per_step"] == 4 and plan["working_dir"] == str(tmp_path.resolve())
    assert json.loads((run / "config.json").read_text())["engine"]["precision"] == "q8_0"
    assert any((run / "tensorboard").iterdir())

    again = _train(_base(model, tmp_path, "smoke", "engine.precision=q8_0"), tmp_path)
    assert again.returncode == 2 and "--resume" in again.stderr
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2]  # nothing written was lost

    resumed = _train(_base(model, tmp_path, "smoke", "engine.precision=q8_0", "run.steps=3") + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_000002" in resumed.stderr
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["policy/version"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_hf_engine_run_from_an_hf_folder(tiny_model_dir, tmp_path):
    proc = _train(_base(tiny_model_dir, tmp_path, "hf", "engine.kind=hf", "run.steps=1"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = _metrics(tmp_path / "hf")[1]
    assert row["mismatch/max_abs_logprob_diff"] < 1e-3  # fp32 engine, same weights


@pytest.mark.parametrize("override,needle", [("algorithm.lrr=1", "unknown key 'algorithm.lrr'"),
                                             ("sampling.temperature=0", "sampling.temperature")])
def test_bad_config_exits_2_naming_the_key(tmp_path, override, needle):
    proc = _train(["--set", override], tmp_path)
    assert proc.returncode == 2 and needle in proc.stderr


def test_resume_refuses_a_changed_config_and_skips_a_damaged_checkpoint(tiny_gguf_factory, tmp_path):
    model = tiny_gguf_factory("f32")
    assert _train(_base(model, tmp_path, "r"), tmp_path).returncode == 0
    run = tmp_path / "r"
    changed = _train(_base(model, tmp_path, "r", "algorithm.lr=1e-3") + ["--resume"], tmp_path)
    assert changed.returncode == 2 and "algorithm.lr" in changed.stderr
    newest = run / "checkpoints" / "step_000002" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a truncated file
    resumed = _train(_base(model, tmp_path, "r", "run.steps=3") + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000002 is not loadable" in resumed.stderr and "resumed from" in resumed.stderr
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3]  # step 2 re-run from the step-1 checkpoint


def test_diagnostics_off_drops_the_mismatch_metrics_and_keeps_their_timer(tiny_model_dir, tmp_path):
    proc = _train(_base(tiny_model_dir, tmp_path, "nodiag", "engine.kind=hf", "run.steps=1",
                        "logging.diagnostics=false"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = _metrics(tmp_path / "nodiag")[1]
    assert not any(k.startswith("mismatch/") for k in row)
    assert "time/diagnostics" in row and "actor/loss" in row
