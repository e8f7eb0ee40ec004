"""The transformers engine's decode steppers (engines/hf_decode.py) against the transformers forward, and the hf
engine's sampling loop: completions end at their first stop id, tokens reach the right sample, log-probs are the
trainer's at fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nearpolicy.engines.hf import HFEngine
from nearpolicy.engines.hf_decode import LlamaStepper, TransformersStepper, left_padded
from nearpolicy.types import GenerationRequest, SamplingParams

PROMPTS = [(1, 504, 3287, 28, 1085, 6001), (1, 2683, 359), (1, 9, 77, 4000, 12)]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _reference_logits(model, ids: list[int]) -> torch.Tensor:
    """The transformers forward over the whole sequence, no cache: logits [V] after its last token."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("stepper_class", [LlamaStepper, TransformersStepper])
def test_stepper_logits_equal_the_transformers_forward_through_steps_and_compaction(tiny_model, stepper_class):
    """Prompts of 6, 3 and 5 tokens (left padding), 7 sequences (prompt rows 0 0 1 2 2 2 1), then steps with
    different tokens per row, dropping rows twice (reordered). Every row's logits must equal the full forward of
    its own prompt + fed tokens: a cache column, position or mask off by one, or a row given another row's cache,
    moves the logits by far more than 1e-4."""
    stepper = stepper_class(tiny_model)
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    sequences = [list(PROMPTS[r]) for r in rows.tolist()]
    logits = stepper.start(PROMPTS, rows, 6 + 8, pad_id=2)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        for seq, row_logits in zip(sequences, logits):
            assert torch.allclose(row_logits, _reference_logits(tiny_model, seq), atol=1e-4, rtol=0)
        if step == 2:
            kept = torch.tensor([5, 0, 3, 2, 6])
            stepper.keep(kept)
            sequences = [sequences[i] for i in kept.tolist()]
        if step == 4:
            stepper.keep(torch.tensor([1, 3]))
            sequences = [sequences[1], sequences[3]]
        fed = torch.randint(5, 40000, (len(sequences),), generator=generator)
        for seq, tok in zip(sequences, fed.tolist()):
            seq.append(tok)
        logits = stepper.step(fed)


def test_llama_stepper_reuses_its_buffers_within_twice_the_call_and_remakes_them_otherwise(tiny_model):
    """Buffers are kept while they hold the call and are at most twice its rows and columns (a compaction copies
    whole buffers), else made at the call's size; each row still gets its own prompt's logits."""
    stepper = LlamaStepper(tiny_model)
    shapes = []
    for prompts, rows, capacity in [(PROMPTS[1:2], torch.tensor([0, 0]), 5), (PROMPTS, torch.arange(3).repeat(3), 12),
                                    (PROMPTS[:2], torch.tensor([0, 1, 1, 0, 1]), 8), (PROMPTS[:1], torch.tensor([0]), 8)]:
        logits = stepper.start(prompts, rows, capacity, pad_id=2)
        for r, row_logits in zip(rows.tolist(), logits):
            assert torch.allclose(row_logits, _reference_logits(tiny_model, list(prompts[r])), atol=1e-4, rtol=0)
        shapes.append((tuple(stepper._buffers[0][0][0].shape), stepper._buffers[0][0][0].data_ptr()))
    assert [shape[0] for shape, _ in shapes] == [2, 9, 9, 1] and [shape[2] for shape, _ in shapes] == [5, 12, 12, 8]
    assert shapes[2][1] == shapes[1][1]  # reused, not made anew


def test_buffers_made_in_inference_mode_serve_a_later_call_outside_it(tiny_model):
    stepper = LlamaStepper(tiny_model)
    with torch.inference_mode():
        stepper.start(PROMPTS[:1], torch.tensor([0, 0]), 9, pad_id=2)
    logits = stepper.start(PROMPTS[:1], torch.tensor([0, 0]), 9, pad_id=2)
    stepper.step(torch.tensor([5, 6]))
    assert torch.allclose(logits[0], _reference_logits(tiny_model, list(PROMPTS[0])), atol=1e-4, rtol=0)


def test_left_padding_refuses_an_empty_prompt():
    ids, valid, positions = left_padded([(5, 6, 7), (8,)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and valid.tolist() == [[True] * 3, [False, False, True]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    with pytest.raises(ValueError, match="at least one prompt token"):
        left_padded([(5,), ()], pad_id=0)


@pytest.mark.parametrize("parallel", [16, 5])
def test_hf_engine_completions_end_at_their_first_stop_with_the_trainers_logprobs(tiny_model, parallel):
    """Stop ids are every id below 2500 (about 5 % of the vocabulary), so the 12 samples end at many different
    steps and the batch is compacted several times. Each completion must hold no stop id but possibly its last,
    end by 'stop' exactly when its last id is one, else reach its limit; and every log-prob must be the trainer's
    log-softmax at that position (fp32, within 5e-5): a token handed to the wrong sample fails this. parallel 5
    splits the requests into chunks of whole requests."""
    stops = set(range(2500))
    engine = HFEngine(tiny_model, stops, max_parallel_sequences=parallel)
    sampling = SamplingParams(1.0, 1.0, 0, 24)
    requests = [GenerationRequest(i, p, 4, max_new_tokens=24 - 6 * i) for i, p in enumerate(PROMPTS)]
    rollouts = engine.generate(requests, sampling, seed=1)
    assert [(r.group_id, r.sample_index) for r in rollouts] == [(g, k) for g in range(3) for k in range(4)]
    lengths = set()
    for r in rollouts:
        limit = 24 - 6 * r.group_id
        ids = r.completion_ids
        assert 1 <= len(ids) <= limit and not any(t in stops for t in ids[:-1])
        assert r.finish_reason == ("stop" if ids[-1] in stops else "length")
        assert r.finish_reason == "stop" or len(ids) == limit
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.tensor([list(r.prompt_ids) + ids])).logits[0].float()
        reference = torch.log_softmax(logits[len(r.prompt_ids) - 1 : -1], -1)[torch.arange(len(ids)), ids]
        assert np.allclose(r.rollout_logprobs, reference.numpy(), atol=5e-5, rtol=0)
        lengths.add(len(ids))
    assert len(lengths) >= 4  # the samples did end at different steps
    counts = engine.take_decode_counts()
    assert counts.calls > 0 and 0 < counts.sequences <= counts.calls * len(rollouts)
    assert engine.take_decode_counts().calls == 0


def test_hf_engine_greedy_is_the_transformers_argmax(tiny_model):
    engine = HFEngine(tiny_model, {0}, max_parallel_sequences=2)
    outs = engine.greedy([list(p) for p in PROMPTS], 5)
    for prompt, out in zip(PROMPTS, outs):
        seq = list(prompt)
        for tok in out:
            assert tok == int(_reference_logits(tiny_model, seq).argmax())
            seq.append(tok)
    assert engine.greedy([list(PROMPTS[0])], 0) == [[]]


def test_hf_engine_weight_sync_reaches_the_packed_weights(tiny_model):
    """update_weights must re-pack: the stepper's joined, packed projections are copies of the weights."""
    engine = HFEngine(tiny_model, {0})
    before = engine.greedy([list(PROMPTS[0])], 4)
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    for k in state:
        if "mlp" in k or "proj" in k:
            state[k] = torch.randn(state[k].shape, generator=generator) * 0.5
    engine.update_weights(state, version=1)
    changed = engine._stepper.start([PROMPTS[0]], torch.tensor([0]), 8, pad_id=0)[0]
    reference = engine.model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    assert torch.allclose(changed, reference, atol=1e-4, rtol=0)
    assert engine.version == 1 and engine.greedy([list(PROMPTS[0])], 4) != before


def _tiny(config_class, model_class, **extra):
    from nearpolicy.model.load import load_policy  # noqa: F401  (the package's transformers settings)

    torch.manual_seed(1)
    config = config_class(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=False, **extra)
    return model_class(config).eval()


def test_llama_with_attention_bias_and_an_untied_head_and_a_qwen2_model():
    """The joined q/k/v projection carries their biases (a Llama config with attention_bias), an untied LM head is
    the one read; a Qwen2 model (not Llama: TransformersStepper) runs through its own forward. Each against the
    transformers forward as above."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = _tiny(LlamaConfig, LlamaForCausalLM, attention_bias=True)
    for name, param in llama.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(param, std=0.5)  # zero biases would hide a dropped one
    qwen = _tiny(Qwen2Config, Qwen2ForCausalLM)
    from nearpolicy.engines.hf_decode import make_stepper

    for model, kind in [(llama, LlamaStepper), (qwen, TransformersStepper)]:
        stepper = make_stepper(model)
        assert type(stepper) is kind
        rows = torch.tensor([0, 1, 1])
        sequences = [list(PROMPTS[r]) for r in rows.tolist()]
        logits = stepper.start(PROMPTS[:2], rows, 6 + 3, pad_id=2)
        for fed in ([7, 8, 9], [10, 11, 12]):
            for seq, row_logits in zip(sequences, logits):
                assert torch.allclose(row_logits, _reference_logits(model, seq), atol=1e-4, rtol=0)
            for seq, tok in zip(sequences, fed):
                seq.append(tok)
            logits = stepper.step(torch.tensor(fed))


def test_a_group_larger_than_max_parallel_keeps_occupancy_at_most_one(tiny_model):
    engine = HFEngine(tiny_model, set(range(100)), max_parallel_sequences=4)
    rollouts = engine.generate([GenerationRequest(0, PROMPTS[0], 10)], SamplingParams(1.0, 1.0, 0, 6), seed=0)
    assert len(rollouts) == 10
    metrics = engine.take_decode_counts().metrics()
    assert 0 < metrics["rollout/decode_occupancy"] <= 1


def test_a_refused_state_dict_still_leaves_the_packed_weights_equal_to_the_model(tiny_model):
    """load_state_dict copies the tensors it can before raising on a bad shape: the packed copies must follow."""
    engine = HFEngine(tiny_model, {0})
    state = {k: torch.randn(v.shape) * 0.3 for k, v in tiny_model.state_dict().items() if "mlp" in k}
    state["model.norm.weight"] = torch.ones(3)  # wrong shape
    with pytest.raises(RuntimeError):
        engine.update_weights(state, version=1)
    stepped = engine._stepper.start([PROMPTS[0]], torch.tensor([0]), 8, pad_id=0)[0]
    reference = engine.model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    assert torch.allclose(stepped, reference, atol=1e-4, rtol=0)


def test_a_hybrid_model_whose_cache_cannot_drop_rows_samples_through_the_plain_forward():
    """Jamba (attention + Mamba layers): its cache's linear-attention layers cannot select rows, so each sample
    prefills its own prompt and no row is dropped; log-probs equal the full forward's (fp32)."""
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    model = JambaForCausalLM(JambaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                         attn_layer_offset=1, expert_layer_period=2, num_experts=2,
                                         mamba_d_state=8)).eval()
    engine = HFEngine(model, set(range(50)))
    assert type(engine._stepper) is TransformersStepper
    prompts = [(1, 200, 300), (1, 77)]
    rollouts = engine.generate([GenerationRequest(i, p, 3) for i, p in enumerate(prompts)],
                               SamplingParams(1.0, 1.0, 0, 6), seed=0)
    assert not engine._stepper.can_drop_rows
    for r in rollouts:
        ids = list(r.prompt_ids) + r.completion_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        reference = torch.log_softmax(logits[len(r.prompt_ids) - 1 : -1], -1)[torch.arange(len(r.completion_ids)),
                                                                           r.completion_ids]
        assert np.allclose(r.rollout_logprobs, reference.numpy(), atol=1e-4, rtol=0)


def test_without_onednn_packing_the_stepper_falls_back_to_plain_linear(tiny_model, monkeypatch):
    """A CPU or torch build where the packed linear does not run (checked once per dtype, _packing_works) must get
    the same logits through F.linear."""
    from nearpolicy.engines import hf_decode

    monkeypatch.setattr(hf_decode, "_packing_works", lambda dtype: False)
    stepper = LlamaStepper(tiny_model)
    assert all(linear.packed is None for linear in [stepper.head] + [layer[1] for layer in stepper.layers])
    logits = stepper.start(PROMPTS[:2], torch.tensor([0, 1]), 9, pad_id=2)
    for prompt, row_logits in zip(PROMPTS[:2], logits):
        assert torch.allclose(row_logits, _reference_logits(tiny_model, list(prompt)), atol=1e-4, rtol=0)
