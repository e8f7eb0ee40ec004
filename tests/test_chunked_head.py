"""The chunked LM head (ops/chunked_head.py) equals the unchunked head + fused log-prob / entropy node: a hand-checked
case, values and gradients (hidden, weight, bias) against a float64 reference across block shapes, temperatures,
softcaps and both outputs, gradcheck in float64; and through model/policy.py: tied and untied llamas, LoRA, the
shared-prompt and padded paths, ECHO's raw log-probs, Gemma 3's head (its body scales the input embeddings; the head
is plain hidden @ W^T, then the final-logit softcap) against model(...).logits; and when the chunked path applies."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import nearpolicy.model.policy as policy
from nearpolicy.batching import collate
from nearpolicy.ops.chunked_head import block_shape, chunked_logprobs_and_entropy
from nearpolicy.ops.fused_logprobs import fused_logprobs_and_entropy
from nearpolicy.types import Rollout, SamplingParams

VOCAB = 1000


def _reference(hidden, weight, bias, ids, temperature, softcap):
    """log pi(y) and entropy in float64 from the full logits (the unfused definition)."""
    z = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    logp = torch.log_softmax(z / temperature, dim=-1)
    return logp.gather(-1, ids[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _head(dtype, n=37, hidden=16, vocab=VOCAB, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_(True)
    w = (0.7 * torch.randn(vocab, hidden, generator=g, dtype=dtype)).requires_grad_(True)
    b = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_(True) if bias else None
    return h, w, b, torch.randint(0, vocab, (n,), generator=g)


def test_a_hand_checked_case_across_two_chunks():
    """z = [0, ln 2, ln 3, ln 2]: p = [1, 2, 3, 2] / 8, split into chunks of 2 columns."""
    z = torch.tensor([0.0, math.log(2), math.log(3), math.log(2)])
    weight = torch.stack([z, torch.zeros(4)], dim=1)  # [V = 4, H = 2]; hidden [1, 0] picks z
    hidden, ids = torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([2, 0])
    picked, entropy = chunked_logprobs_and_entropy(hidden, weight, None, ids, 1.0, block=(1, 2))
    p = torch.tensor([1.0, 2.0, 3.0, 2.0]) / 8
    assert torch.allclose(picked, torch.log(torch.tensor([3 / 8, 1 / 8])), atol=1e-6, rtol=0)
    assert torch.allclose(entropy, -(p * p.log()).sum().expand(2), atol=1e-6, rtol=0)


@pytest.mark.parametrize("block", [(10, 96), (37, 1000), (4, 250), (64, 4096)])
@pytest.mark.parametrize("temperature,softcap,bias", [(1.0, None, False), (0.7, None, True), (1.3, 4.0, False),
                                                      (0.8, 2.5, True)])
@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0), (0.6, -0.4)])
def test_values_and_gradients_equal_the_unchunked_head_float32(block, temperature, softcap, bias, weights):
    h, w, b, ids = _head(torch.float32, bias=bias)
    params = [h, w] + ([b] if bias else [])
    g = torch.Generator().manual_seed(1)
    w_picked, w_entropy = (torch.randn(ids.shape, generator=g) * c for c in weights)

    picked, entropy = chunked_logprobs_and_entropy(h, w, b, ids, temperature, softcap, True, block=block)
    (w_picked * picked + w_entropy * entropy).sum().backward()
    chunked_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    z = torch.nn.functional.linear(h, w, b)
    z = z if softcap is None else torch.tanh(z / softcap) * softcap
    ref_picked, ref_entropy = fused_logprobs_and_entropy(z, ids, temperature, entropy_grad=True)
    (w_picked * ref_picked + w_entropy * ref_entropy).sum().backward()
    assert torch.allclose(picked, ref_picked, atol=1e-5, rtol=0)
    assert torch.allclose(entropy, ref_entropy, atol=1e-5, rtol=0)
    exact = [p.detach().double().requires_grad_(True) for p in params]
    ex_picked, ex_entropy = _reference(exact[0], exact[1], exact[2] if bias else None, ids, temperature, softcap)
    (w_picked.double() * ex_picked + w_entropy.double() * ex_entropy).sum().backward()
    for got, unchunked, ex in zip(chunked_grads, [p.grad for p in params], exact):
        # float32 rounding: the chunked head is as close to float64 as the unchunked one
        scale = float(ex.grad.abs().max())
        assert float((got.double() - ex.grad).abs().max()) <= 1e-5 * max(scale, 1.0)
        assert float((got - unchunked).abs().max()) <= 1e-5 * max(scale, 1.0)


def test_gradcheck_float64_both_outputs_bias_and_softcap():
    h, w, b, ids = _head(torch.float64, n=5, hidden=3, vocab=13, bias=True)
    for temperature, softcap in ((1.0, None), (0.8, 3.0)):
        assert torch.autograd.gradcheck(
            lambda h, w, b: chunked_logprobs_and_entropy(h, w, b, ids, temperature, softcap, True, block=(2, 4)),
            (h, w, b))


def test_a_chunk_of_minus_infinity_logits_adds_nothing():
    """Columns whose bias is -inf (probability 0) fill a whole chunk: values and gradients stay those of the fused
    node, finite, with 0 gradient there."""
    h, w, _, ids = _head(torch.float64, n=6, vocab=40)
    bias = torch.zeros(40, dtype=torch.float64)
    bias[:16] = float("-inf")
    ids = ids.clamp_min(16)
    picked, entropy = chunked_logprobs_and_entropy(h, w, bias, ids, 1.0, None, True, block=(3, 8))
    (picked.sum() + entropy.sum()).backward()
    ref_h = h.detach().clone().requires_grad_(True)
    ref_picked, ref_entropy = fused_logprobs_and_entropy(ref_h @ w.detach().T + bias, ids, 1.0, entropy_grad=True)
    (ref_picked.sum() + ref_entropy.sum()).backward()
    assert torch.allclose(picked, ref_picked, atol=1e-12) and torch.allclose(entropy, ref_entropy, atol=1e-12)
    assert torch.allclose(h.grad, ref_h.grad, atol=1e-12) and bool(torch.isfinite(w.grad).all())


def test_entropy_is_detached_unless_asked_and_errors():
    h, w, _, ids = _head(torch.float32)
    picked, entropy = chunked_logprobs_and_entropy(h, w, None, ids, 1.0)
    assert picked.requires_grad and not entropy.requires_grad
    with torch.no_grad():
        assert not chunked_logprobs_and_entropy(h, w, None, ids, 1.0, entropy_grad=True)[1].requires_grad
    for bad in (dict(temperature=0.0), dict(temperature=float("nan")), dict(softcap=-1.0), dict(softcap=float("inf")),
                dict(token_ids=ids[:-1]), dict(block=(0, 8)), dict(token_ids=ids.clone().fill_(VOCAB)),
                dict(token_ids=ids.clone().fill_(-1)), dict(hidden=h.bfloat16())):
        args = dict(hidden=h, weight=w, bias=None, token_ids=ids, temperature=1.0) | bad
        with pytest.raises(ValueError):
            chunked_logprobs_and_entropy(**args)


def test_block_shape_keeps_a_block_within_its_budget():
    for rows, vocab in ((1040, 262144), (1040, 49152), (20000, 262144), (3, 262144), (1, 100)):
        r, c = block_shape(rows, vocab, 32 * 2**20)
        assert 1 <= r <= rows and 1 <= c <= vocab and (r * c * 4 <= 32 * 2**20 or c == vocab)
    assert block_shape(1040, 262144, 32 * 2**20) == (1040, 8192 - 256)


# --- through model/policy.py ---------------------------------------------------------------------------------------

SAMPLING = SamplingParams(0.8, 1.0, 0, 8)


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                        initializer_range=0.2, max_position_embeddings=256))


def _gemma(softcap: float | None):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=64,
                              final_logit_softcapping=softcap, initializer_range=0.2, tie_word_embeddings=True,
                              max_position_embeddings=256)
    return Gemma3ForCausalLM(config).float()


def _batch(shared: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, (n_prompt, lengths) in enumerate([(6, [5, 0, 9, 1]), (4, [3, 7])]):
        prompt = torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist()
        out += [Rollout(group, k, prompt, torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-1.0] * n, [0] * n,
                        "length") for k, n in enumerate(lengths)]
    return collate(out, 2, VOCAB, shared_prompt=shared)


def _run(model, batch, chunked: bool, monkeypatch, raw: bool = False, entropy_grad: bool = True,
         sampling: SamplingParams = SAMPLING):
    """(log-probs, entropy[, raw], {parameter: grad}) of a weighted loss, the head forced chunked or unchunked."""
    model = copy.deepcopy(model)
    monkeypatch.setattr(policy, "FULL_LOGITS_BUDGET", 0 if chunked else float("inf"))
    monkeypatch.setattr("nearpolicy.ops.chunked_head.BLOCK_BYTES", 4 * 5 * 1024)  # blocks of 5 x 1024: many
    assert policy.uses_chunked_head(model, 25, sampling) == chunked
    fn = policy.sequence_logprobs_with_raw if raw else policy.sequence_logprobs
    outputs = fn(model, batch, sampling, entropy_grad)
    weights = torch.linspace(-1.0, 1.5, batch.completion_ids.numel()).reshape(batch.completion_ids.shape)
    loss = sum((w * o).sum() for w, o in zip((weights, 0.3 * weights.flip(0), 0.5 - weights), outputs))
    loss.backward()
    return [o.detach() for o in outputs], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(model, batch, monkeypatch, **kwargs):
    values, grads = _run(model, batch, True, monkeypatch, **kwargs)
    ref_values, ref_grads = _run(model, batch, False, monkeypatch, **kwargs)
    for got, ref in zip(values, ref_values):
        assert torch.allclose(got, ref, atol=2e-5, rtol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    assert sum(float(g.norm()) for g in ref_grads.values()) > 0
    for name, g in ref_grads.items():
        assert float((grads[name] - g).norm()) <= 2e-5 * float(g.norm()) + 1e-7, name


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_sequence_logprobs_chunked_equals_unchunked_llama(tied, shared, monkeypatch):
    _assert_equal(_llama(tied), _batch(shared), monkeypatch)


@pytest.mark.parametrize("sampling", [SAMPLING, SamplingParams(1.0)])
def test_raw_logprobs_for_echo_chunked_equal_unchunked(sampling, monkeypatch):
    _assert_equal(_llama(True), _batch(True), monkeypatch, raw=True, entropy_grad=False, sampling=sampling)


def test_lora_adapter_gradients_chunked_equal_unchunked(monkeypatch):
    from nearpolicy.model.lora import attach_lora

    model = attach_lora(_llama(True), 4, 8.0, 0.0, ("q_proj", "v_proj", "down_proj"), seed=0).model
    with torch.no_grad():  # lora_B starts at 0: give the adapter a gradient path that is not trivially zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    _assert_equal(model, _batch(True), monkeypatch)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("shared", [False, True])
def test_gemma3_head_is_plain_matmul_then_softcap_and_chunked_equals_unchunked(softcap, shared, monkeypatch):
    model, batch = _gemma(softcap), _batch(shared)
    hidden, valid = policy.completion_hidden(model, batch)
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.gather(full, 1, batch.logit_positions.unsqueeze(-1).expand(-1, -1, VOCAB))[valid]
    assert torch.allclose(policy.head_logits(model, hidden).detach(), expected, atol=2e-5, rtol=0)
    assert softcap is None or float(expected.abs().max()) < softcap  # the softcap did apply
    _assert_equal(model, batch, monkeypatch)


def test_when_the_chunked_head_applies(monkeypatch):
    model = _llama(True)
    monkeypatch.setattr(policy, "FULL_LOGITS_BUDGET", 100 * VOCAB * 4)
    assert not policy.uses_chunked_head(model, 100, SAMPLING)
    assert policy.uses_chunked_head(model, 101, SAMPLING)
    assert not policy.uses_chunked_head(model, 101, SamplingParams(1.0, 0.9, 0))  # top-p: a kept set
    assert not policy.uses_chunked_head(model, 101, SamplingParams(1.0, 1.0, 50))  # top-k
    assert policy.uses_chunked_head(model, 101, SamplingParams(1.0, 1.0, VOCAB))  # top-k = V keeps every token
    handle = model.get_output_embeddings().register_forward_hook(lambda *args: None)
    assert not policy.uses_chunked_head(model, 101, SAMPLING)  # a hook would be skipped: unchunked
    handle.remove()

    class Wrapped(torch.nn.Linear):
        pass

    model.lm_head.__class__ = Wrapped  # e.g. a LoRA- or quantization-wrapped head runs its own forward
    assert not policy.uses_chunked_head(model, 101, SAMPLING)


def test_an_unknown_output_logit_transform_is_refused():
    model = _llama(True)
    model.config.logits_scaling = 8.0  # Granite's
    with pytest.raises(ValueError, match="logits_scaling"):
        policy.head_logits(model, torch.zeros(1, 32))
    model.config.logits_scaling = 1.0
    assert policy.head_softcap(model.config) is None
