"""sampling.ignore_eos (types.SamplingParams): an end-of-generation token does not end a training response, the
distribution and its log-probs are unchanged, and eval (greedy) still stops. Every token is made a stop token here,
so that a response without the option has exactly one token and with it exactly max_new_tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.config.schema import load_config
from nearpolicy.model.policy import sequence_logprobs
from nearpolicy.training.assemble import sampling_params
from nearpolicy.types import GenerationRequest, SamplingParams

PROMPTS = [(1, 504, 3287, 28, 1085, 6001), (1, 2683, 359, 253, 5356)]
LIMIT = 6


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    model, tokenizer = load_policy(str(tiny_model_dir))
    return model.eval(), tokenizer


def _check(engine, model, bound: float) -> None:
    requests = [GenerationRequest(i, p, 3) for i, p in enumerate(PROMPTS)]
    stopped = engine.generate(requests, SamplingParams(1.0, 1.0, 0, LIMIT), seed=5)
    sampling = SamplingParams(1.0, 1.0, 0, LIMIT, ignore_eos=True)
    full = engine.generate(requests, sampling, seed=5)
    assert [(len(r.completion_ids), r.finish_reason) for r in stopped] == [(1, "stop")] * 6
    assert [(len(r.completion_ids), r.finish_reason) for r in full] == [(LIMIT, "length")] * 6
    # the same seed draws the same first token: ignoring the stop changes what follows, not the distribution
    assert [r.completion_ids[0] for r in full] == [r.completion_ids[0] for r in stopped]
    assert np.allclose([r.rollout_logprobs[0] for r in full], [r.rollout_logprobs[0] for r in stopped], atol=1e-12)
    batch = collate(full, pad_id=0, vocab_size=49152)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, batch, sampling)  # the trainer's: no stop anywhere in its transform
    assert (logprobs - batch.rollout_logprobs).abs()[batch.mask].max().item() < bound
    assert [len(c) for c in engine.greedy([list(p) for p in PROMPTS], LIMIT)] == [1, 1]  # eval still stops


def test_llamacpp_engine_runs_past_end_of_generation_tokens_with_ignore_eos(tiny_gguf_factory, tiny_policy,
                                                                           monkeypatch):
    import nearpolicy.engines.llamacpp as llamacpp

    monkeypatch.setattr(llamacpp, "is_eog", lambda vocab, token: True)
    engine = llamacpp.LlamaCppEngine(tiny_gguf_factory("f32"), max_context=128, max_parallel_sequences=8, threads=2,
                                     kv_cache="f32")
    try:
        _check(engine, tiny_policy[0], bound=5e-5)  # test_engines.F32_BOUND
    finally:
        engine.close()


def test_hf_engine_runs_past_stop_ids_with_ignore_eos(tiny_policy):
    from nearpolicy.engines.hf import HFEngine

    model = tiny_policy[0]
    engine = HFEngine(model, set(range(model.config.vocab_size)), max_parallel_sequences=8)
    _check(engine, model, bound=5e-5)
    engine.close()


def test_config_sampling_ignore_eos_reaches_the_engines_sampling_params():
    assert sampling_params(load_config(None)).ignore_eos is False
    assert sampling_params(load_config(None, ["sampling.ignore_eos=true"])).ignore_eos is True
