"""algorithm.trainer_precision = "bf16" (model/policy.trainer_compute): the transformer body under torch.autocast in
bfloat16, the LM head and log-softmax in fp32, weights and gradients fp32; on conftest's tiny llama."""

from __future__ import annotations

import copy

import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.model.policy import completion_hidden, head_logits, sequence_logprobs, trainer_compute
from nearpolicy.types import Rollout, SamplingParams

VOCAB, PAD = 49152, 2
SAMPLING = SamplingParams(1.0, 1.0, 0)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    return load_policy(str(tiny_model_dir))[0]


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for group, (n_prompt, lengths) in enumerate([(7, [5, 9, 3, 12]), (4, [6, 2])]):
        prompt = torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist()
        rollouts += [Rollout(group, k, prompt, torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-10.0] * n,
                             [0] * n, "length") for k, n in enumerate(lengths)]
    return collate(rollouts, PAD, VOCAB)


def _logprobs_and_grads(model, batch, precision: str):
    """As the update runs it: the forward under trainer_compute, the backward outside it."""
    model = copy.deepcopy(model)
    with trainer_compute(precision):
        logprobs, _ = sequence_logprobs(model, batch, SAMPLING)
    advantages = torch.linspace(-1.0, 1.5, len(batch))[:, None]
    (-torch.where(batch.mask, advantages * logprobs, 0.0).sum() / batch.mask.sum()).backward()
    return logprobs.detach(), {name: p.grad for name, p in model.named_parameters()}


class _GradientRecorder:
    """An optimizer stand-in for policy_update: step() keeps a copy of every gradient, nothing moves."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=True)

    def step(self):
        self.grads = {name: p.grad.clone() for name, p in self.model.named_parameters()}


def test_bf16_moves_the_logprobs_a_little_and_keeps_fp32_gradients_close_to_the_fp32_ones(model):
    batch = _batch()
    exact, exact_grads = _logprobs_and_grads(model, batch, "fp32")
    bf16, grads = _logprobs_and_grads(model, batch, "bf16")
    assert bf16.dtype == torch.float32
    d = (bf16 - exact)[batch.mask].abs()
    # autocast acted (bf16 keeps 8 mantissa bits: nothing stays within float32 rounding) and the fp32 head keeps the
    # error to the body's: measured mean 0.019-0.025, max 0.06-0.15 nats (batch seeds 0-2) on log-probs of about -10
    # from this random model's large activations (initializer_range 0.2)
    assert float(d.mean()) > 1e-3
    assert float(d.mean()) < 0.05 and float(d.max()) < 0.3
    for name, g in grads.items():
        assert g.dtype == torch.float32 and bool(torch.isfinite(g).all()), name
    flat, exact_flat = torch.cat([g.flatten() for g in grads.values()]), torch.cat(
        [g.flatten() for g in exact_grads.values()])
    assert float(torch.nn.functional.cosine_similarity(flat, exact_flat, dim=0)) > 0.995  # measured 0.9994-0.9997


def test_the_lm_head_runs_in_fp32_under_bf16(model):
    batch = _batch(1)
    with torch.no_grad():
        hidden, _ = completion_hidden(model, batch)
        exact = head_logits(model, hidden)
        with trainer_compute("bf16"):
            kept = head_logits(model, hidden)
            autocast_head = model.get_output_embeddings()(hidden)  # what the head would be without head_in_fp32
    assert torch.equal(kept, exact)
    assert autocast_head.dtype == torch.bfloat16 and not torch.equal(autocast_head.float(), exact)


def _update_gradients(model, batch, precision: str):
    from nearpolicy.ops.correction_presets import correction_spec
    from nearpolicy.ops.losses import PolicyLossParams
    from nearpolicy.training.update import UpdateSettings, policy_update

    model = copy.deepcopy(model)
    settings = UpdateSettings(1, 4, 1e9, "ppo_clip", PolicyLossParams(0.2, 0.28, 3.0), "token-mean", None,
                              correction_spec("tis"), trainer_precision=precision)
    recorder = _GradientRecorder(model)
    advantages = torch.linspace(-1.0, 1.5, len(batch))
    policy_update(model, recorder, batch, None, advantages, SAMPLING, settings)
    return recorder.grads


def test_the_update_backward_leaves_autocast_so_the_chunked_head_gradient_stays_fp32(model, monkeypatch):
    """The chunked head (ops/chunked_head.py) recomputes its logits in the backward; run under autocast, that
    recomputation would be bf16 (here 1.2 % off the full head's gradient when the whole update ran under it).
    policy_update runs only the forwards under trainer_compute, so both heads give the same bf16 gradient."""
    from nearpolicy.model import policy

    batch = _batch(2)
    monkeypatch.setattr(policy, "FULL_LOGITS_BUDGET", float("inf"))
    full = _update_gradients(model, batch, "bf16")
    monkeypatch.setattr(policy, "FULL_LOGITS_BUDGET", 0)
    chunked = _update_gradients(model, batch, "bf16")
    for name, g in full.items():
        assert float((chunked[name] - g).norm()) <= 1e-4 * float(g.norm()), name


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="unknown trainer precision 'fp16'; valid: fp32, bf16"):
        trainer_compute("fp16")


def test_bf16_beside_the_aligned_trainer_is_refused():
    from nearpolicy.config.schema import load_config

    with pytest.raises(ValueError, match="trainer_precision = 'bf16' beside precision_alignment = 'engine'"):
        load_config(None, ["algorithm.trainer_precision=bf16", "algorithm.precision_alignment=engine",
                           "engine.precision=q8_0", "engine.flash_attention=false"])
    with pytest.raises(ValueError, match="trainer_precision"):
        load_config(None, ["algorithm.trainer_precision=fp16"])


@pytest.mark.slow
def test_the_trainer_recomputes_in_bf16_so_an_exact_engine_shows_a_mismatch(tiny_model_dir, tmp_path):
    """The hf engine in fp32 holds the trainer's own weights, so at fp32 the mismatch is float32 rounding; with
    trainer_precision = bf16 the recompute (and so mismatch/*) runs under autocast and the mismatch appears."""
    from tiny_trainer import step, tiny_trainer

    k3 = {}
    for precision in ("fp32", "bf16"):
        said = []
        trainer, _ = tiny_trainer(tiny_model_dir, tmp_path, precision, [f"algorithm.trainer_precision={precision}",
                                                                       "engine.hf_dtype=fp32"],
                                  lambda task: task, lambda engine: engine, log=said.append)
        assert [line for line in said if f"parameters, trainer in {precision}, " in line]  # the start-up line says it
        try:
            row = step(trainer)
        finally:
            trainer.close()
        assert row["actor/skipped_minibatches"] == 0
        k3[precision] = row["mismatch/mean_abs_logprob_diff"]
    assert k3["fp32"] < 1e-4
    assert k3["bf16"] > 3 * max(k3["fp32"], 1e-5)


@pytest.mark.slow  # two in-process diagnose measurements of the tiny model
def test_diagnose_scores_a_candidate_with_the_trainer_at_the_runs_precision(tiny_model_dir, tmp_path):
    """The hf engine in fp32 holds the trainer's own weights: diagnose's k3 is float rounding at trainer_precision =
    fp32 and shows the bf16 body's error at bf16 (diagnosis/measure.py scores under trainer_compute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nearpolicy.diagnosis.candidates import parse_candidate
    from nearpolicy.diagnosis.measure import DiagnoseContext, measure_candidate

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    diff = {}
    for precision in ("fp32", "bf16"):
        ctx = DiagnoseContext(model=model, tokenizer=tokenizer, template_gguf=None, prompts=[[5, 6, 7], [8, 9]],
                              group_size=2, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True),
                              workdir=tmp_path / precision, max_context=64, threads=1, trainer_precision=precision)
        diff[precision] = measure_candidate(ctx, parse_candidate("hf:fp32")).metrics["abs_logprob_diff_p90"]
    assert diff["fp32"] < 1e-5  # measured 2.8e-6 fp32, 0.035 bf16
    assert diff["bf16"] > 1e-3
