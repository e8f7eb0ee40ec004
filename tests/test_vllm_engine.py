"""The vLLM engine (engines/vllm_engine.py, engines/vllm_child.py) against the trainer: a tiny random llama (head
dim 64, the smallest vLLM's CPU attention kernel takes; tied embeddings like SmolLM2) in vLLM fp32 in its own
environment (.venv-vllm) and process, and the same weights in transformers fp32. The log-probs of the sampled ids
must be the trainer's under the sampling transform (1e-4 nats), after a weight sync too; each weight-sync fix (tied
head, prefix cache) is shown to matter by leaving it out; every sample gets its own random stream; a native crash
of the engine process is reported, not suffered; two real Trainer steps run on vLLM rollouts.

One engine start (about 12 s) serves the module; each test first syncs the weights it needs. The vLLM tests are
`slow` (make test runs them and builds .venv-vllm first; make test-fast leaves them out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_contract import max_gap, trainer_logprobs

from nearpolicy.engines.process import CRASH_HOOK, EngineDied
from nearpolicy.engines.vllm_child import sample_seeds
from nearpolicy.engines.vllm_engine import VLLMProcessEngine, vllm_python
from nearpolicy.types import GenerationRequest, SamplingParams

VLLM_TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
STOP_IDS = {0, 2, 4}
PROMPT = [1, 9690, 28, 2, 504, 8]
T1 = SamplingParams(1.0, 1.0, 0, 16)
T07 = SamplingParams(0.7, 0.9, 20, 16)


def _tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**VLLM_TINY)).float().eval()


def _start(model, folder, **kwargs) -> VLLMProcessEngine:
    return VLLMProcessEngine(model.config, model.state_dict(), folder, stop_ids=STOP_IDS, max_context=512,
                             max_parallel_sequences=16, threads=1, kv_cache_gib=0.25,
                             log_path=folder.parent / "vllm.log", probe_prompt=PROMPT, **kwargs)


@pytest.fixture(scope="module")
def model():
    return _tiny_model()


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    eng = _start(model, tmp_path_factory.mktemp("vllm") / "weights")
    yield eng
    eng.close()


def _perturbed(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """Every weight of `model` moved by scale x N(0, 1) (in place: the trainer's new weights); its state dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.state_dict()


@pytest.mark.slow
def test_the_vllm_environment_exists():
    """CI builds .venv-vllm (make test depends on make vllm-env): nothing here is skipped for want of it."""
    python = vllm_python()
    assert python.is_file() and (python.parent.parent / ".installed").is_file()


def test_sample_seeds_give_every_sample_its_own_stream():
    """vLLM seeds sample k of an n-sample request with seed + k: per-request seeds s, s + 1 would share streams.
    The derived seeds are distinct within a call (also for a repeated group id) and across step seeds."""
    requests = [GenerationRequest(g, (1, 2), 8) for g in (0, 1, 2, 1)]
    step0, step1 = sample_seeds(requests, 0), sample_seeds(requests, 1)
    flat = [s for group in step0 + step1 for s in group]
    assert len(set(flat)) == len(flat) == 64 and all(0 <= s < 2**63 for s in flat)
    assert sample_seeds(requests, 0) == step0  # deterministic
    assert sample_seeds(requests[:1], 0)[0] == step0[0]  # a sample's stream does not depend on the batch


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [T1, T07], ids=["T1", "T0.7-topk20-topp0.9"])
def test_rollout_logprobs_are_the_trainers(engine, model, sampling):
    engine.update_weights(model.state_dict(), 0)
    requests = [GenerationRequest(0, tuple(PROMPT), 4), GenerationRequest(1, tuple(PROMPT[:4]), 4)]
    rollouts = engine.generate(requests, sampling, seed=3)
    assert [(r.group_id, r.sample_index) for r in rollouts] == [(g, k) for g in (0, 1) for k in range(4)]
    assert max_gap(model, rollouts, sampling) < 1e-4
    for r in rollouts:
        assert r.versions == [0] * len(r.completion_ids) and r.prompt_ids == list(requests[r.group_id].prompt_ids)
        stopped = r.completion_ids[-1] in STOP_IDS
        assert r.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(r.completion_ids) == sampling.max_new_tokens
        assert not set(r.completion_ids[:-1]) & STOP_IDS  # nothing after a stop id
    if sampling.top_k:  # every sampled id is inside the kept set (finite trainer log-prob)
        assert all(np.isfinite(trainer_logprobs(model, r.prompt_ids, r.completion_ids, sampling)).all()
                   for r in rollouts)


@pytest.mark.slow
def test_score_and_greedy_are_the_trainers(engine, model):
    engine.update_weights(model.state_dict(), 0)
    for sampling in (T1, T07, SamplingParams(0.5, 1.0, 5, 16)):
        sampled = engine.generate([GenerationRequest(0, tuple(PROMPT), 1)], sampling, seed=2)[0].completion_ids
        for completion in (sampled, [17215, 1387, 33463, 45531, 2]):  # inside the kept set; any ids (-inf outside)
            got = np.asarray(engine.score(PROMPT, completion, sampling))
            want = trainer_logprobs(model, PROMPT, completion, sampling)
            finite = np.isfinite(want)
            assert (np.isfinite(got) == finite).all() and np.abs(got[finite] - want[finite]).max(initial=0) < 1e-4
        assert np.isfinite(got).all() if sampling is T1 else finite.sum() < len(completion)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want_greedy = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=sorted(STOP_IDS),
                                     pad_token_id=2)[0, len(PROMPT):].tolist()
    assert engine.greedy([PROMPT], 6) == [want_greedy]


@pytest.mark.slow
def test_samples_have_distinct_streams_and_a_seed_repeats_them(engine, model):
    engine.update_weights(model.state_dict(), 0)
    same = [GenerationRequest(0, tuple(PROMPT), 4), GenerationRequest(1, tuple(PROMPT), 4)]
    a = engine.generate(same, T1, seed=5)
    assert len({tuple(r.completion_ids) for r in a}) == 8  # 8 samples of one prompt: 8 different responses
    b = engine.generate(same, T1, seed=5)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.rollout_logprobs for r in a] == [r.rollout_logprobs for r in b]  # bit-identical for the same seed
    alone = engine.generate(same[1:], T1, seed=5)
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in a[4:]]  # batch-independent
    other = engine.generate(same, T1, seed=6)
    assert not {tuple(r.completion_ids) for r in other} & {tuple(r.completion_ids) for r in a}


@pytest.mark.slow
def test_sync_after_a_full_perturbation_of_every_weight(engine, tmp_path):
    trainer = _tiny_model()
    engine.update_weights(trainer.state_dict(), 0)
    before = engine.score(PROMPT, [5, 6, 7, 8], T1)
    new = _perturbed(trainer, 0.05, seed=1)
    assert max(abs(a - b) for a, b in zip(before, trainer_logprobs(trainer, PROMPT, [5, 6, 7, 8], T1))) > 0.1
    engine.update_weights(new, 7)
    rollouts = engine.generate([GenerationRequest(0, tuple(PROMPT), 4)], T07, seed=1)
    assert max_gap(trainer, rollouts, T07) < 1e-4
    assert all(r.versions == [7] * len(r.completion_ids) for r in rollouts) and engine.version == 7
    got = np.asarray(engine.score(PROMPT, [5, 6, 7, 8], T1))
    assert np.abs(got - trainer_logprobs(trainer, PROMPT, [5, 6, 7, 8], T1)).max() < 1e-4
    engine.update_weights(new, 8)  # the same weights twice change nothing
    assert engine.score(PROMPT, [5, 6, 7, 8], T1) == got.tolist()


@pytest.mark.slow
def test_the_tied_head_trap_matters(engine):
    """Without re-running the tied lm_head's prepacking after a reload, generation uses the old embedding as the
    output layer: far off the new model. With it, 1e-4."""
    trainer = _tiny_model()
    engine.update_weights(trainer.state_dict(), 0)
    new = _perturbed(trainer, 0.05, seed=2)
    engine.update_weights(new, 1, unsafe_skip=("tied_head",))
    prompt = (1, 504, 8, 9690)  # a prompt the engine has not seen: the prefix cache plays no part
    stale = engine.generate([GenerationRequest(0, prompt, 4)], T1, seed=0)
    assert max_gap(trainer, stale, T1) > 0.05
    engine.update_weights(new, 2)
    fixed = engine.generate([GenerationRequest(0, prompt, 4)], T1, seed=0)
    assert max_gap(trainer, fixed, T1) < 1e-4


@pytest.mark.slow
def test_the_prefix_cache_trap_matters(engine):
    """A prompt sampled before a sync keeps its KV blocks of the old weights in vLLM's prefix cache unless the cache
    is reset: the same prompt after the sync is then sampled from a mix of old and new weights."""
    trainer = _tiny_model()
    engine.update_weights(trainer.state_dict(), 0)
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(5, 49000, 300))  # more than one KV block
    engine.generate([GenerationRequest(0, prompt, 2)], T1, seed=0)  # its blocks enter the prefix cache
    new = _perturbed(trainer, 0.05, seed=3)
    engine.update_weights(new, 1, unsafe_skip=("prefix_cache",))
    stale = engine.generate([GenerationRequest(0, prompt, 2)], T1, seed=0)
    assert max_gap(trainer, stale, T1) > 0.05
    engine.update_weights(trainer.state_dict(), 0)
    engine.generate([GenerationRequest(0, prompt, 2)], T1, seed=0)
    engine.update_weights(new, 2)
    fixed = engine.generate([GenerationRequest(0, prompt, 2)], T1, seed=0)
    assert max_gap(trainer, fixed, T1) < 1e-4


@pytest.mark.slow
def test_a_segfault_in_the_vllm_process_is_reported_not_suffered(model, tmp_path, monkeypatch):
    monkeypatch.setenv(CRASH_HOOK, "generate:2:SIGSEGV")
    eng = _start(model, tmp_path / "weights")
    try:
        assert len(eng.generate([GenerationRequest(0, tuple(PROMPT), 2)], T1, 0)) == 2  # the first call works
        with pytest.raises(EngineDied) as died:
            eng.generate([GenerationRequest(0, tuple(PROMPT), 2)], T1, 0)
        assert (died.value.engine, died.value.signal_name, died.value.phase) == ("vllm:fp32", "SIGSEGV", "rollout")
        assert "Fatal Python error: Segmentation fault" in (tmp_path / "vllm.log").read_text()
        with pytest.raises(EngineDied):
            eng.greedy([PROMPT], 2)
    finally:
        eng.close()
    assert not eng._proc.is_alive()


class LengthParityTask:
    """The run's task scored by the response's length parity (the tiny random model earns it about half the time, so
    groups have non-zero advantages and the update moves the weights). Module-level: the scoring process unpickles
    it."""

    def __init__(self, task):
        self.task = task

    def score(self, response: str, problem) -> float:
        return float(len(response) % 2 == 0)

    def __getattr__(self, name):
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)


@pytest.mark.slow
def test_two_trainer_steps_on_vllm_rollouts(tmp_path, smollm2_tokenizer):
    """The real Trainer (training.assemble.build_engine with engine.kind = vllm): the rollout log-probs of step 1 (after the
    first weight sync, at lr 1e-3) are still the trainer's to 1e-4 nats, and the engine's version follows."""
    from nearpolicy.training import assemble as setup
    from nearpolicy.config.schema import load_config
    from nearpolicy.training.trainer import open_trainer

    folder = tmp_path / "tiny-vllm"
    _tiny_model().save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    engines = []

    def build(cfg, run_dir, log):
        session = setup.build_session(cfg, run_dir, log)
        session.task = LengthParityTask(session.task)
        engines.append(setup.build_engine(cfg, session, log))
        return session, setup.build_rollouts(cfg, session, engines[0], log)

    cfg = load_config(None, [f"model.path='{folder}'", f"run.output_dir='{tmp_path}'", "run.name=vllm", "run.steps=2",
                             "run.threads=1", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                             "algorithm.micro_batch_size=4", "algorithm.lr=1e-3", "sampling.max_new_tokens=8",
                             "task.eval_size=2", "task.train_size=50", "logging.eval_every=100",
                             "logging.checkpoint_every=100", "logging.tensorboard=false", "logging.progress=false",
                             "model.max_context=256", "engine.kind=vllm", "engine.vllm_kv_cache_gib=0.25"])
    trainer = open_trainer(cfg, log=lambda _: None, build=build)
    rows = []
    try:
        for _ in range(2):
            rows.append(trainer.train_step())
            trainer.state.step += 1
        assert engines[0].label == "vllm:fp32" and engines[0].version == 2
    finally:
        trainer.close()
    for row in rows:
        assert row["mismatch/tokens"] > 0 and row["mismatch/max_abs_logprob_diff"] < 1e-4
        assert np.isfinite(row["actor/loss"]) and row["actor/grad_norm"] > 0


def test_a_missing_vllm_environment_names_make_vllm_env(monkeypatch, tmp_path):
    from nearpolicy.engines.base import EngineError

    monkeypatch.setenv("NEARPOLICY_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(EngineError, match=r"needs the vLLM environment \.venv-vllm .*run `make vllm-env`"):
        vllm_python()


@pytest.mark.slow
def test_diagnose_measures_a_vllm_candidate_at_the_noise_floor(tmp_path, smollm2_tokenizer):
    """diagnosis/measure.py with the candidate vllm:fp32: the trainer's and vLLM's log-probs of the sampled tokens
    agree, so k3 is at float32 noise (under 1e-8 nats/token) and every ratio is within 1e-4 of 1."""
    from nearpolicy.diagnosis.candidates import parse_candidate
    from nearpolicy.diagnosis.measure import DiagnoseContext, measure_candidate

    model = _tiny_model().requires_grad_(False)
    ctx = DiagnoseContext(model, smollm2_tokenizer, None, [PROMPT, PROMPT[:4]], 4, T1, tmp_path, threads=1,
                          max_context=256, micro_batch_size=4, max_parallel=8, vllm_kv_cache_gib=0.25)
    result = measure_candidate(ctx, parse_candidate("vllm:fp32"))
    m = result.metrics
    assert result.candidate == "vllm:fp32" and m["sequences"] == 8 and m["tokens"] > 8
    assert abs(m["k3"]) < 1e-8 and m["abs_logprob_diff_max"] < 1e-4 and m["ess"] > 0.99999
