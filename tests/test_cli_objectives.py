"""A 3-step `nearpolicy train` through the real CLI for a few families of corrections, losses and advantages, on
the tiny model with a q4_0 llama.cpp engine so that the mismatch is real (end-to-end smokes)."""

from __future__ import annotations

import json

import pytest
import torch

from test_cli import _base, _metrics, _train

pytestmark = pytest.mark.slow

# End-to-end smokes through the real CLI and llama.cpp; every registered correction, loss, advantage and KL
# estimator also runs in process with a known mismatch (test_trainer_families.py), which is where the per-family
# checks live.
FAMILIES = {
    "token-tis": ["correction.preset=tis"],
    "ewma-proximal": ["correction.preset=tis", "correction.proximal=ewma", "correction.ewma_decay=0.5"],
    "mc-grpo-kl-sumnorm": ["algorithm.advantage=mc_grpo", "algorithm.group_size=3", "algorithm.kl_coef=0.01",
                           "algorithm.aggregation='seq-mean-token-sum-norm'", "algorithm.minibatches=3",
                           "algorithm.micro_batch_size=1"],
}


def test_on_policy_distillation_run(tiny_gguf_factory, tmp_path):
    teacher = tiny_gguf_factory("f16")
    extra = ["engine.precision=q4_0", "run.steps=2", f"distill.teacher='{teacher}'", "algorithm.loss=importance_sampling",
             "correction.preset=bypass_ppo_clip"]
    proc = _train(_base(tiny_gguf_factory("f32"), tmp_path, "opd", *extra), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(tmp_path / "opd")
    # At step 1 the teacher (f16 copy of the initial weights) equals pi_old up to f16 rounding, so the teacher KL
    # mean(log mu - log teacher) must equal the measured k1 mismatch mean(log mu - log pi_old) of the q4_0 engine.
    first = rows[1]
    assert first["distill/teacher_kl"] == pytest.approx(first["mismatch/k1"], abs=0.01)
    assert first["mismatch/k1"] > 0.05  # q4_0 on the tiny random model: a large, real mismatch
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:])  # the distillation advantage drives an update


@pytest.mark.parametrize("family", list(FAMILIES))
def test_three_step_run_per_family(tiny_gguf_factory, tmp_path, family):
    extra = ["engine.precision=q4_0", "run.steps=3", "logging.eval_every=3", "logging.checkpoint_every=3",
             *FAMILIES[family]]
    proc = _train(_base(tiny_gguf_factory("f32"), tmp_path, family, *extra), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(tmp_path / family)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["actor/loss"] is not None and row["actor/grad_norm"] is not None  # finite (None = NaN/inf)
        assert row["mismatch/k3"] > 0  # q4_0 engine vs fp32 trainer: a real mismatch was measured
    plan = json.loads((tmp_path / family / "plan.json").read_text())
    assert "CorrectionSpec" in plan["correction"]
    if family == "ewma-proximal":  # 3 steps of one optimizer step each: W = 1 + 0.5 + 0.25 + 0.125
        from safetensors.torch import load_file

        extra = load_file(str(tmp_path / family / "checkpoints" / "step_000003" / "extra.safetensors"))
        assert extra["ewma.weight_sum"].item() == 1.875 and all(r["actor/skipped_minibatches"] == 0 for r in rows[1:])
        assert len(extra) > 2


def test_unknown_correction_preset_is_rejected_with_the_valid_names(tmp_path):
    proc = _train(["--set", "correction.preset=tiss"], tmp_path)
    assert proc.returncode == 2 and "correction.preset" in proc.stderr and "tis" in proc.stderr


def test_list_prints_every_registry():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "nearpolicy", "list"], capture_output=True, text=True, check=True).stdout
    for name in ("grpo", "mc_grpo", "ppo_clip", "gspo", "cispo", "tis", "icepop", "geo_rs", "minpro", "bypass_pg_is",
                 "tis_snis", "seq_tis_snis"):
        assert f"  {name} " in out


def test_ewma_proximal_run_resumes_with_the_saved_average(tiny_gguf_factory, tmp_path):
    """Two steps, then --resume to three: the step-3 EWMA is one bias-corrected step from the restored step-2
    EWMA towards the step-3 weights (a restart from the weights would give weight_sum 1.5, not 1.875)."""
    from safetensors.torch import load_file

    extra = ["engine.precision=q4_0", "correction.proximal=ewma", "correction.ewma_decay=0.5", "logging.keep_checkpoints=5"]
    proc = _train(_base(tiny_gguf_factory("f32"), tmp_path, "ewma-resume", *extra), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _train([*_base(tiny_gguf_factory("f32"), tmp_path, "ewma-resume", *extra, "run.steps=3"), "--resume"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no PPO-EWMA" not in proc.stdout + proc.stderr
    ckpt = tmp_path / "ewma-resume" / "checkpoints"
    e2, e3 = (load_file(str(ckpt / f"step_00000{k}" / "extra.safetensors")) for k in (2, 3))
    model3 = load_file(str(ckpt / "step_000003" / "model.safetensors"))
    assert e2["ewma.weight_sum"].item() == 1.75 and e3["ewma.weight_sum"].item() == 1.875
    checked = 0
    for key, value in e3.items():
        name = key.removeprefix("ewma.")
        if key == "ewma.weight_sum" or name not in model3:
            continue
        expected = (0.5 * 1.75 / 1.875) * e2[key].double() + model3[name].double() / 1.875
        assert torch.allclose(value.double(), expected, rtol=1e-6, atol=1e-7), name
        checked += 1
    assert checked > 5
