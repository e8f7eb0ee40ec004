"""The shared-prompt path (model/policy.py; DualKV, "Shared-Prompt Flash Attention for Efficient RL Training with Large
Rollouts and Long Contexts"): each group's prompt runs once and the group's completions attend to that one prefix.
It is exact, so against the padded path (every row runs prompt + completion) it must give the same log-probs,
entropy, gradient of every parameter, update metrics and Trainer metrics, to float32 rounding, on the tiny llama of
conftest.py: unequal and empty completions, several groups per micro-batch, a group split across micro-batches,
interleaved rows, prompts of different lengths, every policy loss, several correction families, the KL penalty."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from nearpolicy.batching import collate, forward_tokens, packs_completions
from nearpolicy.ops.correction_presets import correction_spec
from nearpolicy.ops.losses import POLICY_LOSSES, PolicyLossParams, required_aggregation
from nearpolicy.model.policy import recompute_logprobs, sequence_logprobs
from nearpolicy.types import Rollout, SamplingParams
from nearpolicy.training.update import UpdateSettings, policy_update

SAMPLING = SamplingParams(0.9, 1.0, 0, 8)
LOGPROB_ATOL = 2e-5  # nats, on log-probs of about -10 (measured: at most 4e-6)
GRAD_RTOL = 2e-5  # |g_shared - g_padded| / |g_padded| per parameter (measured: at most 5e-6; reordering and
# re-padding the padded path's own rows moves it by up to 2e-6)
VOCAB, PAD = 49152, 2


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    return load_policy(str(tiny_model_dir))[0]


def _rollouts(groups: list[tuple[int, list[int]]], seed: int = 0, shuffle: bool = False,
              logprobs: torch.Tensor | None = None) -> list[Rollout]:
    """Groups of (prompt length, completion lengths), random ids; rollout log-probs from `logprobs` [B, T] (the
    trainer's, offset by the caller) or -10."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, (n_prompt, lengths) in enumerate(groups):
        prompt = torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist()
        for k, n in enumerate(lengths):
            out.append(Rollout(group, k, prompt, torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-10.0] * n,
                               [0] * n, "length"))
    if shuffle:
        random.Random(seed).shuffle(out)
    if logprobs is not None:
        for i, r in enumerate(out):
            r.rollout_logprobs = logprobs[i, : len(r.completion_ids)].tolist()
    return out


def _both(rollouts):
    return collate(rollouts, PAD, VOCAB, shared_prompt=False), collate(rollouts, PAD, VOCAB, shared_prompt=True)


def _assert_grads_equal(padded: dict, shared: dict) -> None:
    assert sum(float(g.norm()) for g in padded.values()) > 0  # a zero gradient would prove nothing
    for name, g in padded.items():
        assert float((shared[name] - g).norm()) <= GRAD_RTOL * float(g.norm()), name


def _forward_backward(model, batch):
    model = copy.deepcopy(model)
    logprobs, entropy = sequence_logprobs(model, batch, SAMPLING)
    advantages = torch.linspace(-1.0, 1.5, len(batch))[:, None]
    loss = -torch.where(batch.mask, advantages * logprobs, 0.0).sum() / batch.mask.sum()
    loss.backward()
    return logprobs.detach(), entropy, {n: p.grad for n, p in model.named_parameters()}


GROUPS = {
    "unequal lengths, an empty completion": ([(6, [5, 0, 9, 1, 3])], False),
    "several groups, prompts of different lengths": ([(4, [3, 7]), (11, [2, 2, 6]), (7, [1])], False),
    "rows of groups interleaved": ([(4, [3, 7, 2]), (9, [5, 1, 4])], True),
    "one-token and empty completions only": ([(5, [1, 1]), (3, [0, 1]), (8, [0, 0])], False),
}


@pytest.mark.parametrize("layout", ["packed", "padded rows"])
@pytest.mark.parametrize("case", GROUPS)
def test_logprobs_entropy_and_every_gradient_equal_the_padded_path(model, case, layout, monkeypatch):
    monkeypatch.setattr("nearpolicy.model.policy.packs_completions", lambda *args: layout == "packed")
    groups, shuffle = GROUPS[case]
    padded, shared = _both(_rollouts(groups, shuffle=shuffle))
    lp_p, ent_p, grads_p = _forward_backward(model, padded)
    lp_s, ent_s, grads_s = _forward_backward(model, shared)
    # every position, padding included (0 on both paths)
    assert torch.allclose(lp_s, lp_p, rtol=0, atol=LOGPROB_ATOL)
    assert torch.allclose(ent_s, ent_p, rtol=0, atol=LOGPROB_ATOL)
    _assert_grads_equal(grads_p, grads_s)
    # the prompt's token embeddings get their gradient only through the shared prefix: it must not be cut
    prompt_ids = torch.unique(torch.cat([shared.input_ids[i, : int(n)] for i, n in enumerate(shared.prompt_lengths)]))
    assert grads_s["model.embed_tokens.weight"][prompt_ids].abs().sum(1).min() > 0


def test_a_packed_group_runs_its_prompt_in_the_same_forward_only_when_the_prompt_is_no_longer(model, monkeypatch):
    """A short prompt joins its packed completions' row (one forward, P + N rows a product); a prompt longer than the
    N packed tokens runs first and the completions attend to its cache (the (P + N)^2 mask would cost more). The
    case "several groups, prompts of different lengths" above checks both against the padded path."""
    from nearpolicy.model import policy

    monkeypatch.setattr("nearpolicy.model.policy.packs_completions", lambda *args: True)
    seen = []
    for name in ("_packed", "_packed_on_cache"):
        run = getattr(policy, name)
        monkeypatch.setattr(policy, name, lambda *args, run=run, name=name: seen.append(name) or run(*args))
    _, shared = _both(_rollouts([(4, [3, 7]), (11, [2, 2, 6])]))  # 2 + 6 steps >= 4; 1 + 1 + 5 < 11
    with torch.no_grad():
        sequence_logprobs(model, shared, SAMPLING)
    assert seen == ["_packed", "_packed_on_cache"]


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_the_lm_head_runs_only_at_completion_positions_and_equals_the_full_logits(model, shared_prompt):
    """The LM head sees only the positions that predict a completion token: there the log-probs equal those of the
    model's full [B, L, V] logits; padding of shorter completions holds 0."""
    rollouts = _rollouts([(6, [5, 0, 9, 1]), (4, [3, 7])])
    batch = collate(rollouts, PAD, VOCAB, shared_prompt=shared_prompt)
    logprobs, entropy = sequence_logprobs(model, batch, SAMPLING)
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    reference = torch.log_softmax(torch.gather(full, 1, batch.logit_positions.unsqueeze(-1).expand(-1, -1, VOCAB))
                                  / SAMPLING.temperature, dim=-1)
    expected = torch.gather(reference, -1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(reference.exp() * reference).sum(-1)
    assert int(batch.mask.sum()) == 25 and int((~batch.mask).sum()) > 0
    assert torch.allclose(logprobs[batch.mask], expected[batch.mask], rtol=0, atol=LOGPROB_ATOL)
    assert torch.allclose(entropy[batch.mask], expected_entropy[batch.mask], rtol=0, atol=LOGPROB_ATOL)
    assert float(logprobs[~batch.mask].abs().max()) == 0.0 and float(entropy[~batch.mask].abs().max()) == 0.0


def test_completions_are_packed_when_that_is_cheaper():
    """tokens x 6 hidden + attention pairs, SmolLM2's width (576) and the main job's prompt (54 tokens)."""
    # equal lengths: nothing to save, and packing widens every token's attention to all 8 rows
    assert not packs_completions(torch.full((8,), 39), 54, 576)  # 312 (3456 + 54 + 312) > 312 (3456 + 54 + 39)
    # 2 and 39 steps: packing runs 41 tokens instead of 78
    assert packs_completions(torch.tensor([2, 39]), 54, 576)  # 41 (3510 + 41) <= 78 (3510 + 39)
    # long completions: attention over the packed row would dominate
    assert not packs_completions(torch.tensor([4000] * 7 + [3000]), 54, 576)


def test_prompt_groups_follow_the_prompt_ids():
    rollouts = _rollouts([(4, [2, 3]), (5, [1]), (4, [2])], shuffle=True)
    batch = collate(rollouts, PAD, VOCAB)
    first = {}
    for i, r in enumerate(rollouts):
        assert int(batch.prompt_group[i]) == first.setdefault(tuple(r.prompt_ids), len(first))
    assert batch.select(slice(1, 3)).prompt_group.tolist() == batch.prompt_group[1:3].tolist()
    assert collate(rollouts, PAD, VOCAB, shared_prompt=False).prompt_group is None
    assert batch.completion_lengths.tolist() == [len(r.completion_ids) for r in rollouts]
    assert batch.prompt_lengths.tolist() == [len(r.prompt_ids) for r in rollouts]


def test_forward_tokens_counts_computed_and_padding_tokens(monkeypatch):
    """Group A: prompt 5, completions 3, 0, 7; group B: prompt 2, completion 4 (hand-counted; hidden 64)."""
    padded, shared = _both(_rollouts([(5, [3, 0, 7]), (2, [4])]))
    # padded, one micro-batch: 4 rows x 12 = 48 tokens, of which 48 - (8 + 5 + 12 + 6) = 17 padding
    assert forward_tokens(padded, 4, 64) == (48, 17)
    # micro-batches of 2 rows: [A0, A1] 2 x 8 (3 padding), [A2, B0] 2 x 12 (6)
    assert forward_tokens(padded, 2, 64) == (40, 9)
    # shared, packed (the cheaper here): A runs 5 + 2 + 0 + 6 steps, B 2 + 3; no padding
    assert forward_tokens(shared, 4, 64) == (18, 0)
    assert forward_tokens(shared, 4, 64, pack=True) == (18, 0)
    # shared, rows padded to the group's longest: A runs 5 + 3 rows x 6 steps (padding 18 - 8 = 10), B 2 + 3
    assert forward_tokens(shared, 4, 64, pack=False) == (28, 10)
    # micro-batches of 2: [A0, A1] 5 + 2 x 2 (2 padding), [A2] 5 + 6, [B0] 2 + 3
    assert forward_tokens(shared, 2, 64, pack=False) == (25, 2)
    monkeypatch.setattr("nearpolicy.batching.packs_completions", lambda *args: False)
    assert forward_tokens(shared, 4, 64) == (28, 10)  # pack=None follows the cost model


def _update(model, batch, settings, advantages, ref_model=None):
    """policy_update at lr 0 (the weights stay): metrics, each mini-batch's gradients, the logprobs it reports."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = []
    optimizer.step = lambda: captured.append({n: p.grad.clone() for n, p in model.named_parameters()})
    fused = settings.minibatches == 1 and not settings.needs_batch_statistics
    old = None if fused else recompute_logprobs(model, batch, SAMPLING, settings.micro_batch_size)[0]
    result = policy_update(model, optimizer, batch, old, advantages, SAMPLING, settings, ref_model=ref_model)
    return result, captured


# 3 groups of 4 in micro-batches of 3: groups split across micro-batches, and micro-batches holding two groups
UPDATE_GROUPS = [(6, [5, 0, 9, 3]), (10, [2, 7, 7, 1]), (4, [4, 6, 0, 8])]


@pytest.fixture(scope="module")
def update_batches(model):
    """(padded, shared) batches whose rollout log-probs are the trainer's plus a seeded N(0, 0.3) offset, so the
    corrections weigh, truncate and mask real mismatches; and the advantages [B]."""
    base = collate(_rollouts(UPDATE_GROUPS, seed=1), PAD, VOCAB, shared_prompt=False)
    trainer = recompute_logprobs(model, base, SAMPLING, 12)[0]
    offset = 0.3 * torch.randn(trainer.shape, generator=torch.Generator().manual_seed(2))
    batches = _both(_rollouts(UPDATE_GROUPS, seed=1, logprobs=trainer + offset))
    return batches, torch.randn(len(base), generator=torch.Generator().manual_seed(3))


def _settings(loss="ppo_clip", correction="tis", minibatches=1, kl_coef=0.0) -> UpdateSettings:
    params = PolicyLossParams(0.2, 0.28, 3.0, kl_coef=kl_coef)
    return UpdateSettings(minibatches, 3, 1e9, loss, params, required_aggregation(loss) or "token-mean", None,
                          correction_spec(correction))


def _assert_updates_equal(model, batches, advantages, settings, ref_model=None):
    (res_p, grads_p), (res_s, grads_s) = (_update(model, b, settings, advantages, ref_model) for b in batches)
    assert res_s.metrics.keys() == res_p.metrics.keys()
    for key, value in res_p.metrics.items():
        # sequence-level weights (seq_mis, seq_tis_rs, bypass_pg_is) exponentiate a sum of per-token log-ratios, so
        # float32 rounding of the log-probs (a few 1e-6 nats, summed over a sequence) shows as ~2e-5 relative here
        assert res_s.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    mask = batches[0].mask
    assert torch.allclose(res_s.logprobs[mask], res_p.logprobs[mask], rtol=0, atol=LOGPROB_ATOL)
    assert len(grads_s) == len(grads_p) == settings.minibatches
    for g_p, g_s in zip(grads_p, grads_s):
        _assert_grads_equal(g_p, g_s)


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_every_policy_loss_through_the_update_equals_the_padded_path(model, update_batches, loss):
    batches, advantages = update_batches
    correction = "off" if loss.startswith("pnpo") else "tis"
    _assert_updates_equal(model, batches, advantages, _settings(loss, correction))


@pytest.mark.parametrize("loss,correction", [("ppo_clip", "tis_snis"), ("ppo_clip", "seq_mis"),
                                             ("ppo_clip", "seq_tis_rs"), ("ppo_clip", "minpro"),
                                             ("reinforce", "bypass_pg_is")])
def test_correction_families_through_the_update_equal_the_padded_path(model, update_batches, loss, correction):
    batches, advantages = update_batches
    _assert_updates_equal(model, batches, advantages, _settings(loss, correction))


@pytest.mark.parametrize("layout", ["packed", "padded rows"])
def test_two_minibatches_with_the_kl_penalty_equal_the_padded_path(model, update_batches, layout, monkeypatch):
    """Recomputed old log-probs, two optimizer steps, and the reference model's log-probs (shared path too)."""
    monkeypatch.setattr("nearpolicy.model.policy.packs_completions", lambda *args: layout == "packed")
    batches, advantages = update_batches
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    _assert_updates_equal(model, batches, advantages, _settings(minibatches=2, kl_coef=0.1), ref_model)


def test_trainer_metrics_with_and_without_the_shared_prompt_agree(tiny_model_dir, tmp_path):
    """Two steps of the real Trainer (hf engine, KL penalty, self-normalised correction: recompute, update and
    reference all on the chosen path) give the same metrics with algorithm.shared_prompt on and off."""
    from test_trainer_families import _run

    sets = ("algorithm.kl_coef=0.05", "correction.preset=tis_snis", "algorithm.micro_batch_size=3")
    runs = [_run(tiny_model_dir, tmp_path / f"shared-{on}", "run", f"algorithm.shared_prompt={on}", *sets)[0]
            for on in ("false", "true")]
    for row_p, row_s in zip(*runs):
        for key, value in row_p.items():
            if key.startswith(("time/", "throughput/", "memory/")):
                continue
            assert row_s[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
