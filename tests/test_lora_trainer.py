"""[lora] through the real Trainer on the tiny model (docs/lora.md): the config's defaults and refusals; a run on the
llama.cpp engine process at q8_0 trains only the adapter on the engine's own base, proves every sync and logs the
proof; an engine that stops taking the adapter stops the run with AdapterProofError naming the version."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.engines.base import LoraAdapter
from nearpolicy.engines.fake import OffsetEngine
from nearpolicy.training.lora_sync import PROOF_TOLERANCE, AdapterProofError
from test_trainer_families import LengthParityTask


def test_no_lora_section_is_full_fine_tuning_and_combinations_are_refused():
    """No [lora] table: off; a lora.* key or an empty [lora] table: on; enabled = false in the table: off."""
    from nearpolicy.config.schema import config_from_data

    assert not load_config(None).lora.enabled
    assert config_from_data({"lora": {}}).lora.enabled and not config_from_data({"lora": {"enabled": False}}).lora.enabled
    cfg = load_config(None, ["lora.rank=4", "lora.target_modules=['q_proj','v_proj']"])
    assert cfg.lora.enabled
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules, cfg.lora.lr) == (4, 16.0, ("q_proj", "v_proj"), 1e-4)
    assert config_from_data(cfg.model_dump(mode="json")) == cfg  # a run's config.json reads back the same
    assert load_config(None, ["lora.rank=4", "engine.kind=vllm"]).engine.kind == "vllm"  # vLLM takes adapters
    for sets, said in ((["rollout.engines=1"], "rollout.engines >= 1"),
                       (["mipu.enabled=true"], "mipu.enabled"),
                       (["algorithm.precision_alignment='engine'"], "precision_alignment"),
                       (["lora.target_modules=['lm_head']"], "lora.target_modules"),
                       (["lora.rank=0"], "lora.rank")):
        with pytest.raises(ConfigError, match=said):
            load_config(None, ["lora.rank=4", *sets])


class _Withholding(OffsetEngine):
    """Passes the first `passes` adapter syncs to the engine and drops the later ones (the engine keeps its
    adapter), as a broken delivery would."""

    def __init__(self, engine, passes: int):
        super().__init__(engine)
        self.passes = passes

    def update_weights(self, source, version: int) -> None:
        if isinstance(source, LoraAdapter):
            self.passes -= 1
            if self.passes < 0:
                return
        super().update_weights(source, version)


def _trainer(model_dir, out, name, *sets, passes: int | None = None, resume: bool = False):
    from nearpolicy.training import assemble as setup
    from nearpolicy.training.lora_sync import lora_rollouts
    from nearpolicy.training.trainer import open_trainer

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        session.task = LengthParityTask(session.task)
        engine = setup.build_engine(cfg, session)
        engine = engine if passes is None else _Withholding(engine, passes)
        return session, lora_rollouts(cfg, session, setup.build_rollouts(cfg, session, engine, log), log)

    cfg = load_config(None, [f"model.path='{model_dir}'", f"run.output_dir='{out}'", f"run.name={name}", "run.steps=2",
                             "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                             "algorithm.micro_batch_size=4", "sampling.max_new_tokens=6", "task.eval_size=2",
                             "task.train_size=50", "logging.eval_every=100", "logging.checkpoint_every=100",
                             "logging.tensorboard=false", "logging.progress=false", "model.max_context=256",
                             "engine.precision='q8_0'", "lora.rank=4", "lora.lr=0.02", *sets])
    return open_trainer(cfg, resume=resume, log=lambda _: None, build=build)


def _step(trainer) -> dict[str, float]:
    row = trainer.train_step()
    trainer.state.step += 1
    return row


@pytest.mark.slow
def test_a_lora_run_trains_the_adapter_on_the_engines_base_and_proves_every_sync(tiny_model_dir, tmp_path):
    """Two steps on the llama.cpp q8_0 engine process: the frozen base stays the engine GGUF's dequantized tensors
    bit for bit, the adapter moves, only the adapter is in the optimizer, each step logs a proof within the q8_0
    tolerance, and the trainer's log-probs of the samples agree with the engine's (k3 < 0.05 nats/token)."""
    from nearpolicy.engines.gguf.dequantize import read_gguf_weights

    trainer = _trainer(tiny_model_dir, tmp_path, "lora")
    try:
        lora = trainer.s.lora
        before = lora.adapter_state()
        engine_base = read_gguf_weights(lora.base_gguf, lora.model.config, list(lora.base_state()))
        rows = [_step(trainer) for _ in range(2)]
        base = lora.base_state()
        assert all(torch.equal(base[k], v) for k, v in engine_base.items())
        after = lora.adapter_state()
        assert any(not torch.equal(before[k], after[k]) for k in before if ".lora_B." in k)
        assert rows[1]["lora/proof_shift"] > 0  # the adapter synced after step 1 moved the policy
        for row in rows:
            assert 0 <= row["lora/proof_gap"] <= PROOF_TOLERANCE["q8_0"]
        assert trainer.s.optimizer.param_groups[0]["params"][0].requires_grad
        assert sum(len(g["params"]) for g in trainer.s.optimizer.param_groups) == len(before)
        assert abs(rows[0]["mismatch/k3"]) < 0.05 and np.isfinite(rows[1]["actor/loss"])
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_run_whose_engine_stops_taking_the_adapter_stops_with_the_proof_error(tiny_model_dir, tmp_path):
    """Version 0 reaches the engine (and is proven at start); the adapter of version 1 is dropped on the way: the
    sync after step 1 raises AdapterProofError naming version 1 (withheld), not a staleness report."""
    trainer = _trainer(tiny_model_dir, tmp_path, "withheld", "engine.kind=hf", passes=1)
    try:
        with pytest.raises(AdapterProofError, match=r"LoRA adapter version 1 is not proven.*withheld"):
            _step(trainer)
    finally:
        trainer.close()


@pytest.mark.slow
def test_checkpoints_hold_the_adapter_resume_reproduces_and_export_writes_adapter_and_merged(tiny_model_dir,
                                                                                          tmp_path):
    """The step-1 checkpoint holds the adapter's 28 tensors (and their AdamW state) only; resuming from it gives step
    2 bit for bit as the uninterrupted run (same samples, same adapter); `nearpolicy export` of it writes the PEFT
    folder, the GGUF adapter, the run's engine base and the merged HF model, whose policy is the trainer's at step
    1 (1e-5 nats/token)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nearpolicy.runs.export import export_run
    from nearpolicy.training.lora_sync import policy_logprobs

    probe = [(list(range(100, 112)), list(range(300, 310)))]
    trainer = _trainer(tiny_model_dir, tmp_path, "resume")
    try:
        _step(trainer)
        saved = trainer.checkpoint()
        at_one = policy_logprobs(trainer.s.lora.model, probe)
        second = _step(trainer)
        adapter = trainer.s.lora.adapter_state()
    finally:
        trainer.close()
    weights = load_file(str(saved / "model.safetensors"))
    assert sorted(weights) == sorted(adapter) and len(weights) == 28
    assert len(load_file(str(saved / "optimizer.safetensors"))) == 2 * 28 + 28  # exp_avg, exp_avg_sq, step
    again = _trainer(tiny_model_dir, tmp_path, "resume", resume=True)
    try:
        assert again.state.step == 1
        row = _step(again)
        assert all(torch.equal(again.s.lora.adapter_state()[k], v) for k, v in adapter.items())
        for key in ("reward/mean", "actor/loss", "lora/proof_gap", "lora/proof_shift"):
            assert row[key] == second[key], key
    finally:
        again.close()
    exported = export_run(tmp_path / "resume", step=1, out=tmp_path / "exported", ggufs=(), log=lambda _: None)
    folder = exported.folder
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter.gguf",
                 "base/policy-q8_0.gguf", "model.safetensors", "config.json"):
        assert (folder / name).is_file(), name
    merged = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert np.max(np.abs(policy_logprobs(merged, probe) - at_one)) < 1e-5
