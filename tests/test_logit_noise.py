"""engine.logit_noise: the engine samples from logits + seeded N(0, std^2) noise and reports the log-prob under that
noisy distribution, so the mismatch against the trainer's clean distribution has a known size:
E_z KL(mu || pi) = std^2 / 2 (1 - sum p^2) + O(std^4) at T = 1 (engines/sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest

from nearpolicy.engines.sampling import perturb_logits, sample_rows, transformed_log_softmax
from nearpolicy.types import GenerationRequest, SamplingParams


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_zero_noise_draws_exactly_what_it_drew_before():
    logits = np.random.default_rng(0).normal(0, 2, size=(5, 40)).astype(np.float32)
    for sp in (SamplingParams(), SamplingParams(temperature=0.7, top_k=10)):
        a = sample_rows(logits, sp, np.random.default_rng(7))
        b = sample_rows(logits, sp, np.random.default_rng(7), logit_noise=0.0)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_reported_logprob_is_that_of_the_noisy_distribution_it_sampled_from():
    logits = np.random.default_rng(1).normal(0, 2, size=(6, 30)).astype(np.float32)
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    ids, lps = sample_rows(logits, sp, np.random.default_rng(3), logit_noise=0.4)
    replay = np.random.default_rng(3)
    noisy = logits.astype(np.float64) + 0.4 * replay.standard_normal(logits.shape)  # drawn first, then the uniforms
    want = np.stack([transformed_log_softmax(row, sp) for row in noisy])
    assert np.allclose(lps, want[np.arange(6), ids], rtol=0, atol=1e-12)
    clean = np.stack([transformed_log_softmax(row, sp) for row in logits])
    assert not np.allclose(lps, clean[np.arange(6), ids], rtol=0, atol=1e-3)
    again = sample_rows(logits, sp, np.random.default_rng(3), logit_noise=0.4)  # seeded: reproducible
    assert np.array_equal(again[0], ids) and np.array_equal(again[1], lps)


def test_perturb_logits_rejects_a_negative_std():
    with pytest.raises(ValueError, match=">= 0"):
        perturb_logits(np.zeros((1, 3)), -0.1, np.random.default_rng(0))


@pytest.mark.parametrize("std", [0.1, 0.2])
def test_mismatch_has_the_known_size_std2_over_2_times_1_minus_sum_p2(std):
    """A fixed 50-token distribution p (exactly computable): the exact KL(mu_z || p) averaged over 20000 noise draws
    and the k3 estimate from the sampler's own draws and reported log-probs, E_mu[pi/mu - 1 - log(pi/mu)] = KL(mu ||
    pi), both match std^2 / 2 (1 - sum p^2) within 5 % (the O(std^4) term and 1 % Monte Carlo error)."""
    rng = np.random.default_rng(11)
    row = rng.normal(0, 1.0, size=50)
    p = np.exp(_log_softmax(row))
    known = std**2 / 2 * (1 - (p * p).sum())
    n = 20000
    logits = np.tile(row, (n, 1))
    ids, mu_lp = sample_rows(logits, SamplingParams(), np.random.default_rng(5), logit_noise=std)
    pi_lp = _log_softmax(row)[ids]
    log_r = pi_lp - mu_lp
    k3 = float(np.mean(np.exp(log_r) - 1 - log_r))
    z = np.random.default_rng(6).standard_normal((n, 50))
    mu = _log_softmax(row + std * z)
    exact = float(np.mean((np.exp(mu) * (mu - _log_softmax(row))).sum(-1)))
    assert exact == pytest.approx(known, rel=0.05)
    assert k3 == pytest.approx(known, rel=0.05)


def _k3(engine, prompts, sampling, seed=0):
    """Token-mean k3 of the engine's clean teacher-forced log-probs (pi) against its reported rollout ones (mu)."""
    rollouts = engine.generate([GenerationRequest(i, tuple(p), 4) for i, p in enumerate(prompts)], sampling, seed)
    log_r = np.concatenate([np.array(engine.score(r.prompt_ids, r.completion_ids, sampling))
                            - np.array(r.rollout_logprobs) for r in rollouts])
    return float(np.mean(np.exp(log_r) - 1 - log_r)), rollouts


PROMPTS = [[1, 520, 33, 2000], [1, 77, 91], [1, 4000, 12, 13, 14], [1, 9]]


def test_hf_engine_samples_with_the_configured_noise(tiny_model_dir):
    """The tiny random model is near-uniform (entropy about 9.5 nats of 10.8), so 1 - sum p^2 is about 1 and the
    measured k3 is about std^2 / 2 = 0.045 at std 0.3 (256 tokens: about 9 % standard error; seeded); std 0 gives the
    engine's own float noise (under 1e-6)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nearpolicy.engines.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    sampling = SamplingParams(max_new_tokens=16)
    noisy, first = _k3(HFEngine(model, {2}, logit_noise=0.3), PROMPTS, sampling)
    assert noisy == pytest.approx(0.3**2 / 2, rel=0.25)
    again = HFEngine(model, {2}, logit_noise=0.3).generate(
        [GenerationRequest(i, tuple(p), 4) for i, p in enumerate(PROMPTS)], sampling, 0)
    assert [r.completion_ids for r in again] == [r.completion_ids for r in first]  # seeded: reproducible
    clean, _ = _k3(HFEngine(model, {2}), PROMPTS[:1], sampling)
    assert clean < 1e-6
    with pytest.raises(ValueError, match="logit_noise"):
        HFEngine(model, {2}, logit_noise=-1.0)


def test_llamacpp_engine_samples_with_the_configured_noise(tiny_gguf_factory):
    """The llama.cpp engine (f32 GGUF of the tiny model), opened through EngineSpec as training opens it."""
    from nearpolicy.engines.llamacpp import EngineSpec

    path = str(tiny_gguf_factory("f32"))
    sampling = SamplingParams(max_new_tokens=16)
    engine = EngineSpec(path, 0, 256, 8, 1, "f32", False, logit_noise=0.3).open()
    try:
        noisy, _ = _k3(engine, PROMPTS, sampling)
    finally:
        engine.close()
    assert noisy == pytest.approx(0.3**2 / 2, rel=0.25)
    engine = EngineSpec(path, 0, 256, 8, 1, "f32", False).open()
    try:
        clean, _ = _k3(engine, PROMPTS[:1], sampling)
    finally:
        engine.close()
    assert clean < 1e-4


def test_config_key_is_validated_and_documented():
    from nearpolicy.config.schema import ConfigError, load_config
    from nearpolicy.config.reference import config_reference

    assert load_config(None, ["engine.logit_noise=0.5"]).engine.logit_noise == 0.5
    with pytest.raises(ConfigError, match="engine.logit_noise"):
        load_config(None, ["engine.logit_noise=-0.1"])
    assert "engine.logit_noise = 0.0    [float; >= 0, <= 10]" in config_reference()
