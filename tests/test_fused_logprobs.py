"""The fused log-prob + entropy node equals the unfused log_softmax -> gather graph, values and gradients."""

import pytest
import torch

from nearpolicy.ops.fused_logprobs import fused_logprobs_and_entropy


def unfused(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked, -(logp.exp() * logp).sum(-1)


def _inputs(dtype, shape=(3, 5, 97), seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, generator=g, dtype=dtype)).requires_grad_(True)
    ids = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return logits, ids


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0), (0.6, -0.4)])
def test_values_and_gradients_equal_the_unfused_graph_float32(temperature, weights):
    logits, ids = _inputs(torch.float32)
    ref_logits = logits.detach().clone().requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    w_picked, w_entropy = (torch.randn(ids.shape, generator=g) * w for w in weights)

    picked, entropy = fused_logprobs_and_entropy(logits, ids, temperature, entropy_grad=True)
    ref_picked, ref_entropy = unfused(ref_logits, ids, temperature)
    assert torch.allclose(picked, ref_picked, atol=2e-6, rtol=0)
    assert torch.allclose(entropy, ref_entropy, atol=2e-6, rtol=0)

    (w_picked * picked + w_entropy * entropy).sum().backward()
    (w_picked * ref_picked + w_entropy * ref_entropy).sum().backward()
    # float32 rounding (measured up to 2.4e-6 from a float64 reference on gradients of size ~2)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=5e-6, rtol=0)
    exact = logits.detach().double().requires_grad_(True)
    ex_picked, ex_entropy = unfused(exact, ids, temperature)
    (w_picked.double() * ex_picked + w_entropy.double() * ex_entropy).sum().backward()
    assert torch.allclose(logits.grad.double(), exact.grad, atol=5e-6, rtol=0)


def test_gradcheck_float64_both_outputs():
    logits, ids = _inputs(torch.float64, shape=(4, 11))
    for temperature in (1.0, 0.8):
        assert torch.autograd.gradcheck(
            lambda z: fused_logprobs_and_entropy(z, ids, temperature, entropy_grad=True), (logits,))


def test_entropy_is_detached_unless_asked_and_logprob_gradient_alone_is_exact():
    logits, ids = _inputs(torch.float64)
    picked, entropy = fused_logprobs_and_entropy(logits, ids, 0.9)
    assert picked.requires_grad and not entropy.requires_grad
    picked.sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    unfused(ref, ids, 0.9)[0].sum().backward()
    assert torch.allclose(logits.grad, ref.grad, rtol=0, atol=1e-12)


def test_large_logits_stay_finite():
    """logsumexp's max shift: logits of 1e4 would overflow a naive exp."""
    logits, ids = _inputs(torch.float32, scale=1e4)
    picked, entropy = fused_logprobs_and_entropy(logits, ids, 1.0, entropy_grad=True)
    (picked.sum() + entropy.sum()).backward()
    assert torch.isfinite(picked).all() and torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    assert float(entropy.detach().min()) >= -1e-4


def test_bad_input_is_refused():
    logits, ids = _inputs(torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs_and_entropy(logits, ids, 0.0)
    with pytest.raises(ValueError, match="disagree"):
        fused_logprobs_and_entropy(logits, ids[:, :2], 1.0)


def test_the_trainer_entry_point_uses_it_only_without_top_k_and_top_p(monkeypatch):
    """token_logprobs_and_entropy: fused (no kept set) and unfused (top-k) give the same numbers where both apply."""
    from nearpolicy.ops import logprobs

    calls = []
    monkeypatch.setattr(logprobs, "fused_logprobs_and_entropy",
                        lambda *a, **k: calls.append(1) or fused_logprobs_and_entropy(*a, **k))
    logits, ids = _inputs(torch.float64)
    fused = logprobs.token_logprobs_and_entropy(logits, ids, 0.7)
    assert calls == [1]
    via_kept_set = logprobs.token_logprobs_and_entropy(logits, ids, 0.7, top_k=5)
    assert calls == [1]
    ref = unfused(logits, ids, 0.7)
    assert torch.allclose(fused[0], ref[0], rtol=0, atol=1e-12) and torch.allclose(fused[1], ref[1], rtol=0, atol=1e-12)
    # top-k renormalises over 5 tokens: the unfused kept-set path ran, so the entropies differ
    assert not torch.allclose(via_kept_set[1], ref[1], atol=1e-6)


def test_a_minus_inf_logit_gives_finite_values_and_gradients_like_the_unfused_path():
    """A token of probability exactly 0 (logit -inf): 0 log 0 = 0 in the entropy and in its gradient."""
    logits, ids = _inputs(torch.float64, shape=(3, 40))
    with torch.no_grad():
        logits[:, 7] = float("-inf")
    ids = torch.where(ids == 7, 8, ids)
    picked, entropy = fused_logprobs_and_entropy(logits, ids, 0.8, entropy_grad=True)
    (picked.sum() + 0.5 * entropy.sum()).backward()
    finite = logits.detach().masked_fill(torch.isinf(logits.detach()), -1e30)
    ref_logits = finite.clone().requires_grad_(True)
    ref_picked, ref_entropy = unfused(ref_logits, ids, 0.8)
    (ref_picked.sum() + 0.5 * ref_entropy.sum()).backward()
    assert torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    assert torch.allclose(picked, ref_picked, rtol=0, atol=1e-12) and torch.allclose(entropy, ref_entropy, rtol=0, atol=1e-12)
    assert torch.allclose(logits.grad, ref_logits.grad, rtol=0, atol=1e-12)
    assert float(logits.grad[:, 7].abs().max()) == 0.0


def test_an_unused_entropy_costs_no_entropy_gradient(monkeypatch):
    """The entropy detached (the trainer without an entropy bonus): backward gets grad_entropy = None, so it does not
    build the entropy's [n, V] coefficient (set_materialize_grads(False))."""
    from nearpolicy.ops import fused_logprobs

    seen = []
    backward = fused_logprobs._LogprobEntropy.backward

    def spy(ctx, grad_picked, grad_entropy):
        seen.append(grad_entropy is None)
        return backward(ctx, grad_picked, grad_entropy)

    monkeypatch.setattr(fused_logprobs._LogprobEntropy, "backward", staticmethod(spy))
    logits, ids = _inputs(torch.float32)
    picked, entropy = fused_logprobs_and_entropy(logits, ids, 1.0)
    picked.sum().backward()
    assert seen == [True]
