"""The log-prob contract on a second architecture: a tiny random Gemma 3 (sliding-window and global layers, Gemma's
(1 + w) norms, tied head) in the transformers engine (its generic stepper on transformers' own cache) and in the
vLLM engine (own process and environment), each against the trainer's float32 forward. llama.cpp on Gemma 3 is
tests/test_gguf_architectures.py; the real gemma-3-270m through every engine is the slow test at the end.

Bounds: the transformers engine computes what the trainer computes up to float32 summation order (1e-4 nats, as
for llama in tests/test_hf_decode.py); vLLM fp32 likewise (1e-4, tests/test_vllm_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_contract import max_gap, trainer_logprobs

from nearpolicy.engines.hf import HFEngine
from nearpolicy.types import GenerationRequest, SamplingParams

# head_dim 64: the smallest vLLM's CPU attention kernel takes; sliding window 8 so the window is crossed
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
            max_position_embeddings=512, initializer_range=0.2, bos_token_id=2, eos_token_id=1, pad_token_id=0)
STOP_IDS = {1, 106}
PROMPT = [2, 105, 17, 300, 41, 7, 106, 9, 105, 88]
T1 = SamplingParams(1.0, 1.0, 0, 20)
T07 = SamplingParams(0.7, 0.9, 20, 20)


@pytest.fixture(scope="module")
def tiny_gemma():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(**TINY, layer_types=["sliding_attention", "full_attention"] * 2)
    model = Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():  # norms off zero so a missing (1 + w) would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return model


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(0, tuple(PROMPT), 4), GenerationRequest(1, tuple(PROMPT[:5]), 4)]


@pytest.mark.parametrize("sampling", [T1, T07], ids=["T1", "T0.7-topk20-topp0.9"])
def test_hf_engine_rollout_logprobs_on_gemma3_are_the_trainers(tiny_gemma, sampling):
    engine = HFEngine(tiny_gemma, STOP_IDS, dtype="fp32")
    rollouts = engine.generate(_requests(), sampling, seed=3)
    assert len(rollouts) == 8 and max(len(r.completion_ids) for r in rollouts) > TINY["sliding_window"]
    assert max_gap(tiny_gemma, rollouts, sampling) < 1e-4
    for r in rollouts:
        assert not set(r.completion_ids[:-1]) & STOP_IDS


def test_hf_engine_greedy_and_weight_sync_on_gemma3(tiny_gemma):
    engine = HFEngine(tiny_gemma, STOP_IDS, dtype="fp32")
    with torch.no_grad():
        want = tiny_gemma.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=sorted(STOP_IDS), pad_token_id=0)[0, len(PROMPT):].tolist()
    assert engine.greedy([PROMPT], 12) == [want]
    moved = {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_gemma.state_dict().items()}
    engine.update_weights(moved, 1)
    shifted = HFEngine(tiny_gemma, STOP_IDS, dtype="fp32")
    shifted.model.load_state_dict(moved)
    completion = engine.greedy([PROMPT], 12)[0]
    got = np.asarray(engine.score(PROMPT, completion, T1))
    assert np.abs(got - trainer_logprobs(shifted.model, PROMPT, completion, T1)).max() < 1e-4
    assert np.abs(got - trainer_logprobs(tiny_gemma, PROMPT, completion, T1)).max() > 1e-3  # the sync mattered


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [T1, T07], ids=["T1", "T0.7-topk20-topp0.9"])
def test_vllm_rollout_logprobs_on_gemma3_are_the_trainers(tiny_gemma, sampling, tmp_path):
    from nearpolicy.engines.vllm_engine import VLLMProcessEngine

    engine = VLLMProcessEngine(tiny_gemma.config, tiny_gemma.state_dict(), tmp_path / "weights", stop_ids=STOP_IDS,
                               max_context=512, max_parallel_sequences=8, threads=1, kv_cache_gib=0.25,
                               log_path=tmp_path / "vllm.log", probe_prompt=PROMPT)
    try:
        rollouts = engine.generate(_requests(), sampling, seed=3)
    finally:
        engine.close()
    assert len(rollouts) == 8 and max(len(r.completion_ids) for r in rollouts) > TINY["sliding_window"]
    assert max_gap(tiny_gemma, rollouts, sampling) < 1e-4


def test_the_aligned_trainer_refuses_gemma3(tiny_gemma):
    """model/aligned.py emulates llama.cpp's llama graph: on Gemma 3 it refuses (diagnose then skips its aligned
    column) instead of patching a rotary embedding whose signature differs."""
    from nearpolicy.model.aligned import align_model

    with pytest.raises(ValueError, match="emulates llama.cpp's llama graph; this model is gemma3_text"):
        align_model(tiny_gemma, "q8_0")


@pytest.mark.slow
def test_the_real_gemma3_270m_in_llama_cpp_at_f32_gives_the_trainers_logprobs(tmp_path):
    """gemma-3-270m (model.path 'gemma3-270m', the trainer's float32 weights) exported at f32 with the shipped GGUF
    as template: llama.cpp's log-probs (f32 KV cache) of an English text, teacher-forced, within 2e-2 nats of the
    trainer's at every token (measured 2.1e-3 max here, 4.5e-3 on another text; ggml's float16 GELU table is most
    of the gap)."""
    from nearpolicy.engines.gguf.export import export_gguf
    from nearpolicy.engines.llamacpp import LlamaCppEngine
    from nearpolicy.model.load import load_policy, resolve_model

    torch.set_num_threads(2)
    model, tokenizer = load_policy("gemma3-270m")
    model.eval()
    path = export_gguf(model.state_dict(), model.config, tmp_path / "gemma-f32.gguf", "f32",
                       resolve_model("gemma3-270m").path).path
    ids = tokenizer("The river flows past the old mill, where the miller counts his sacks of grain and the children "
                    "watch the wheel turn slowly in the cold morning light.")["input_ids"]
    engine = LlamaCppEngine(path, max_context=128, max_parallel_sequences=1, threads=2, kv_cache="f32",
                            adaptive_threads=False)
    try:
        got = np.asarray(engine.score(ids[:4], ids[4:], T1))
    finally:
        engine.close()
    want = trainer_logprobs(model, ids[:4], ids[4:], T1)
    assert len(ids) > 24 and np.abs(got - want).max() < 2e-2, float(np.abs(got - want).max())
