"""The shared-prompt path under a sliding window (Gemma 3; batching.packs_completions' `window`). A group whose prompt
+ longest completion passes the window must give what the model's own forward gives: packed, it attended past the
window (the packed 4-D mask has none; 0.57 nats off on this tiny model), so such a group runs as padded rows on the
shared prompt's cache, whose masks transformers builds per layer type. A group inside the window may still pack."""

from __future__ import annotations

import pytest
import torch

from nearpolicy import batching
from nearpolicy.batching import collate
from nearpolicy.model import policy
from nearpolicy.types import Rollout, SamplingParams

VOCAB, PAD, WINDOW = 256, 0, 4
SAMPLING = SamplingParams(1.0, 1.0, 0, 16)
ATOL = 2e-5  # nats, float32 (measured: at most 2e-6)


@pytest.fixture(scope="module")
def gemma():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
                              max_position_embeddings=128, pad_token_id=PAD)
    return Gemma3ForCausalLM(config).float().eval()


def _batch(groups: list[tuple[int, list[int]]], shared: bool):
    g = torch.Generator().manual_seed(1)
    out = []
    for group, (n_prompt, lengths) in enumerate(groups):
        prompt = torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist()
        out += [Rollout(group, k, prompt, torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-1.0] * n, [0] * n,
                        "length") for k, n in enumerate(lengths)]
    return collate(out, PAD, VOCAB, shared_prompt=shared)


def _reference(model, batch) -> torch.Tensor:
    """Log-probs [B, T] of the completion ids from each row's own full forward (no batching, no cache)."""
    out = torch.zeros(batch.completion_ids.shape)
    for i in range(len(batch)):
        n = int(batch.attention_mask[i].sum())
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids[i:i + 1, :n]).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        for t in range(int(batch.completion_lengths[i])):
            out[i, t] = logp[int(batch.logit_positions[i, t]), int(batch.completion_ids[i, t])]
    return out


CASES = {
    "prompt longer than the window": [(7, [3, 5, 1])],
    "prompt inside, completions cross the window": [(2, [6, 4, 5])],
    "one group inside, one crossing": [(2, [1, 2]), (3, [5, 0, 4])],
}


@pytest.mark.parametrize("layout", ["packed where allowed", "padded rows"])
@pytest.mark.parametrize("case", CASES)
def test_groups_past_the_sliding_window_equal_the_models_own_forward(gemma, case, layout, monkeypatch):
    # a huge width makes packing the cheaper layout wherever the window allows it
    choose = (lambda s, n, h, w: batching.packs_completions(s, n, 10**9, w)) if layout != "padded rows" else \
        (lambda *args: False)
    monkeypatch.setattr("nearpolicy.model.policy.packs_completions", choose)
    batch = _batch(CASES[case], shared=True)
    with torch.no_grad():
        logprobs, _ = policy.sequence_logprobs(gemma, batch, SAMPLING)
    expected = _reference(gemma, batch)
    assert float((logprobs - expected)[batch.mask].abs().max()) <= ATOL


def test_a_group_inside_the_window_packs_and_one_past_it_runs_as_padded_rows(gemma, monkeypatch):
    monkeypatch.setattr("nearpolicy.model.policy.packs_completions",
                        lambda s, n, h, w: batching.packs_completions(s, n, 10**9, w))
    packed = []
    run_packed = policy._packed
    monkeypatch.setattr(policy, "_packed", lambda model, prompt, ids, steps: packed.append(len(steps))
                        or run_packed(model, prompt, ids, steps))
    batch = _batch([(2, [1, 3]), (3, [5, 0, 4])], shared=True)
    with torch.no_grad():
        policy.sequence_logprobs(gemma, batch, SAMPLING)
    assert packed == [2]  # 2 prompt + 2 steps fit the window of 4; 3 + 4 do not


def test_packing_is_refused_past_the_window_and_the_config_names_it():
    from types import SimpleNamespace

    steps = torch.tensor([3, 1])
    assert batching.packs_completions(steps, 1, 10**9, window=4)
    assert not batching.packs_completions(steps, 2, 10**9, window=4)
    assert batching.packs_completions(steps, 2, 10**9, window=None)
    assert policy.sliding_window(SimpleNamespace(sliding_window=512)) == 512
    assert policy.sliding_window(SimpleNamespace(sliding_window=None)) is None
    assert policy.sliding_window(SimpleNamespace()) is None
    assert policy.sliding_window(SimpleNamespace(sliding_window=4, use_sliding_window=False)) is None
