"""[lora] on the vLLM engine (docs/lora.md): the adapter reaches vLLM's own LoRA path (its CPU build: punica_cpu) as a
PEFT folder per sync, a LoRARequest per policy version. A tiny random llama (tests/test_vllm_engine.py's, float32):
vLLM's teacher-forced log-probs under the adapter are the trainer's PEFT adapted policy's (1e-4 nats/token; measured
about 3e-6 max), a second adapter version replaces the first (the old one removed), and the sync proof passes on good
syncs and fails on a withheld and on a stale adapter. The engine starts without LoRA, as a [lora] run's does, so the
first adapter reopens it (its base scores stay bit for bit). The vLLM tests are `slow` and need .venv-vllm."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from test_lora import _probe, _randomise
from test_vllm_engine import PROMPT, _start, _tiny_model

from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.engines.base import EngineError, LoraAdapter
from nearpolicy.engines.factory import kind_of
from nearpolicy.engines.gguf.lora_adapter import LLAMA_TARGETS
from nearpolicy.model.lora import attach_lora
from nearpolicy.training.lora_sync import (PROOF_TOLERANCE, AdapterProof, AdapterProofError, AdapterWeights,
                                           engine_logprobs, policy_logprobs, proof_tolerance)


def _has_vllm() -> bool:
    from nearpolicy.engines.vllm_engine import vllm_python

    try:
        vllm_python()
    except EngineError:
        return False
    return True


needs_vllm = pytest.mark.skipif(not _has_vllm(), reason=".venv-vllm is missing (make vllm-env)")


def _lora(rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = LLAMA_TARGETS):
    return attach_lora(_tiny_model(), rank, alpha, 0.0, targets, seed=0, base_gguf=None)


def test_vllm_takes_adapters_as_peft_folders(tmp_path):
    """The kind's facts: vllm takes LoRA adapters, as a PEFT folder; [lora] with engine.kind = vllm is accepted."""
    assert "lora" in kind_of("vllm").options and kind_of("vllm").lora_adapter == "peft_dir"
    assert (kind_of("llamacpp").lora_adapter, kind_of("hf").lora_adapter) == ("gguf", "tensors")
    cfg = load_config(None, ["lora.rank=4", "engine.kind=vllm"])
    assert cfg.lora.enabled and cfg.engine.kind == "vllm"
    bf16, fp32 = ({"bf16"}, kind_of("vllm").lora_tolerances), ({"fp32"}, kind_of("vllm").lora_tolerances)
    assert (proof_tolerance(None, *bf16), proof_tolerance(None, *fp32), proof_tolerance(0.5, *bf16)) == (0.2, 1e-4, 0.5)
    assert proof_tolerance(None, {"bf16"}, kind_of("hf").lora_tolerances) == PROOF_TOLERANCE["bf16"] == 0.1


def test_adapter_weights_write_a_peft_folder_per_sync(tmp_path):
    """Each sync: a new PEFT folder (r, lora_alpha, every target); the previous folder is kept (a request may still
    run under it), older ones deleted. A bad form is refused."""
    lora = _lora(rank=4, alpha=8.0)
    weights = AdapterWeights(lora, "peft_dir", tmp_path)
    folders = [weights().peft_dir for _ in range(3)]
    assert len(set(folders)) == 3 and weights.write_s > 0
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["peft-adapter-2", "peft-adapter-3"]
    settings = json.loads((tmp_path / "peft-adapter-3" / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"]) == (4, 8.0)
    assert sorted(settings["target_modules"]) == sorted(LLAMA_TARGETS)
    assert (tmp_path / "peft-adapter-3" / "adapter_model.safetensors").is_file()
    with pytest.raises(ValueError, match="adapter form 'npz'"):
        AdapterWeights(lora, "npz", tmp_path)
    (tmp_path / "peft-adapter-9").mkdir()  # a later process (a resumed run) removes every earlier process's folder
    (tmp_path / "peft-adapter-1").write_text("not a folder")  # or a file in the way of its first folder
    resumed = AdapterWeights(lora, "peft_dir", tmp_path)
    assert Path(resumed().peft_dir).name == "peft-adapter-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peft-adapter-1"]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """(engine, its base scores of the probe measured before any adapter): one vLLM start (no LoRA) for the module."""
    if not _has_vllm():
        pytest.skip(".venv-vllm is missing (make vllm-env)")
    folder = tmp_path_factory.mktemp("vllm-lora")
    engine = _start(_tiny_model(), folder / "weights")
    yield engine, engine_logprobs(engine, _probe())
    engine.close()


@pytest.mark.slow
@needs_vllm
def test_vllm_computes_the_trainers_adapted_policy_and_each_sync_is_proven(started, tmp_path):
    """Version 0 (lora_B = 0) proves the engine's base; version 1 withheld fails (the engine scores as its base);
    version 1 delivered: vLLM's scores are the PEFT adapted policy's to 1e-4 nats (max over 30 tokens) while the adapter
    moves them by > 0.1; version 2 replaces it (scores follow, version 1's adapter removed); version 3 withheld fails
    as stale."""
    engine, engine_base = started
    lora, probe = _lora(), _probe()
    weights = AdapterWeights(lora, "peft_dir", tmp_path)
    proof = AdapterProof(lora, probe, PROOF_TOLERANCE["fp32"])
    proof.engine_base = engine_base
    engine.update_weights(weights(), 0)  # LoRA off so far: this reopens the engine with LoRA on
    assert proof.check(engine, 0)["lora/proof_gap"] < PROOF_TOLERANCE["fp32"]
    _randomise(lora, 0.3, seed=1)
    with pytest.raises(AdapterProofError, match="version 1 is not proven.*frozen base"):
        proof.check(engine, 1)
    scores = {}
    for version, seed in ((1, 1), (2, 2)):
        _randomise(lora, 0.3, seed=seed)
        adapter = weights()
        started_s = time.perf_counter()
        engine.update_weights(adapter, version)
        load_s = time.perf_counter() - started_s
        ours, theirs = policy_logprobs(lora.model, probe), engine_logprobs(engine, probe)
        gap = float(np.abs(theirs - ours).max())
        print(f"version {version}: max |vLLM - trainer| {gap:.2g} nats, mean {np.abs(theirs - ours).mean():.2g}, "
              f"moved {np.abs(theirs - engine_base).mean():.3g} nats/token, write {weights.write_s * 1e3:.0f} ms, "
              f"update_weights {load_s * 1e3:.0f} ms")
        assert gap < 1e-4 and np.abs(theirs - engine_base).mean() > 0.1
        assert len(engine.loaded_adapters()) == 1  # the previous version's adapter is removed at the swap
        assert proof.check(engine, version)["lora/proof_gap"] < PROOF_TOLERANCE["fp32"]
        scores[version] = theirs
    assert np.abs(scores[2] - scores[1]).mean() > 0.1
    _randomise(lora, 0.3, seed=3)
    with pytest.raises(AdapterProofError, match="version 3 is not proven.*version 2"):
        proof.check(engine, 3)


@pytest.mark.slow
@needs_vllm
def test_vllm_samples_under_the_adapter_and_refuses_a_bad_adapter(started, tmp_path):
    """generate runs under the adapter (rank 4 on q, v and up only: vLLM's packed qkv / gate_up layers take a subset):
    its sampled ids' log-probs are the adapted policy's; a LoraAdapter without peft_dir is a TypeError, a folder that
    is no PEFT adapter an EngineError naming it."""
    from engine_contract import max_gap

    from nearpolicy.types import GenerationRequest, SamplingParams

    engine, _ = started
    lora = _lora(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"))
    _randomise(lora, 0.3, seed=5)
    engine.update_weights(AdapterWeights(lora, "peft_dir", tmp_path)(), 5)
    sampling = SamplingParams(1.0, 1.0, 0, 12)
    rollouts = engine.generate([GenerationRequest(0, tuple(PROMPT), 2)], sampling, seed=0)
    with lora.base_only():
        assert max_gap(lora.model, rollouts, sampling) > 0.05  # not the base's log-probs
    assert max_gap(lora.model, rollouts, sampling) < 1e-4 and all(r.versions == [5] * len(r.completion_ids)
                                                                  for r in rollouts)
    with pytest.raises(TypeError, match="peft_dir"):
        engine.update_weights(LoraAdapter(gguf="x.gguf"), 6)
    with pytest.raises(EngineError, match="not a PEFT LoRA adapter folder"):
        engine.update_weights(LoraAdapter(peft_dir=str(tmp_path / "nowhere")), 6)


@pytest.mark.slow
@needs_vllm
def test_two_lora_trainer_steps_on_vllm(tmp_path, smollm2_tokenizer):
    """The real Trainer with [lora] and engine.kind = vllm (fp32): the engine starts on the frozen base, the adapter
    of each version reaches it (proof within the fp32 tolerance, the adapter synced after step 1 moves the policy)
    and the rollout log-probs of step 1 are the trainer's adapted policy's to 1e-4 nats."""
    from test_trainer_families import LengthParityTask

    from nearpolicy.training import assemble as setup
    from nearpolicy.training.lora_sync import lora_rollouts
    from nearpolicy.training.trainer import open_trainer

    folder = tmp_path / "tiny-vllm"
    _tiny_model().save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        session.task = LengthParityTask(session.task)
        engine = setup.build_engine(cfg, session, log)
        return session, lora_rollouts(cfg, session, setup.build_rollouts(cfg, session, engine, log), log)

    cfg = load_config(None, [f"model.path='{folder}'", f"run.output_dir='{tmp_path}'", "run.name=vllm-lora",
                             "run.steps=2", "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                             "algorithm.micro_batch_size=4", "sampling.max_new_tokens=8", "task.eval_size=2",
                             "task.train_size=50", "logging.eval_every=100", "logging.checkpoint_every=100",
                             "logging.tensorboard=false", "logging.progress=false", "model.max_context=256",
                             "engine.kind=vllm", "engine.vllm_kv_cache_gib=0.25", "lora.rank=4", "lora.lr=0.02"])
    trainer = open_trainer(cfg, log=lambda _: None, build=build)
    rows = []
    try:
        for _ in range(2):
            rows.append(trainer.train_step())
            trainer.state.step += 1
    finally:
        trainer.close()
    print("; ".join(f"step {i}: proof gap {r['lora/proof_gap']:.2g}, sync {r['lora/sync_s'] * 1e3:.0f} ms, adapter "
                    f"write {r['lora/adapter_write_s'] * 1e3:.0f} ms, proof {r['lora/proof_s']:.2f} s"
                    for i, r in enumerate(rows)))
    assert rows[1]["lora/proof_shift"] > 1e-4 and rows[1]["lora/proof_engine_shift"] > 1e-4
    for row in rows:
        assert row["lora/proof_gap"] <= PROOF_TOLERANCE["fp32"]
        assert row["mismatch/tokens"] > 0 and row["mismatch/max_abs_logprob_diff"] < 1e-4
        assert np.isfinite(row["actor/loss"])


def test_a_lora_run_opens_the_engine_with_its_rank_so_the_first_adapter_needs_no_reopen() -> None:
    from nearpolicy.training.assemble import engine_request

    assert engine_request(load_config(None, ["engine.kind='vllm'", "lora.rank=4"])).lora_rank == 4
    assert engine_request(load_config(None, ["engine.kind='vllm'"])).lora_rank == 0


def test_a_rank_vllm_cannot_take_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"lora\.rank = 600: engine\.kind = 'vllm' takes LoRA ranks up to 512"):
        load_config(None, ["engine.kind='vllm'", "lora.rank=600"])
    assert load_config(None, ["engine.kind='vllm'", "lora.rank=512"]).lora.rank == 512
    assert load_config(None, ["lora.rank=600"]).lora.rank == 600  # llama.cpp takes it
