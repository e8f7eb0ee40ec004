"""Engine log-prob contract against the trainer, on the tiny random llama (invariants 1, 2, 3, 9)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from nearpolicy.batching import collate
from nearpolicy.engines.llamacpp import LlamaCppEngine
from nearpolicy.model.policy import sequence_logprobs
from nearpolicy.types import GenerationRequest, SamplingParams

# Measured on this machine (tiny model, f32 GGUF, f32 KV cache, no flash attention, vs transformers fp32):
# max |delta log p| about 7e-6 nats.
F32_BOUND = 5e-5
PROMPTS = [(1, 504, 3287, 28, 1085, 6001), (1, 2683, 359, 253, 5356)]


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    model, tokenizer = load_policy(str(tiny_model_dir))
    return model.eval(), tokenizer


def _engine(path, parallel=8, kv_cache="f32"):
    return LlamaCppEngine(path, max_context=128, max_parallel_sequences=parallel, threads=2, kv_cache=kv_cache)


def _trainer_logprobs(model, rollouts, sampling):
    batch = collate(rollouts, pad_id=0, vocab_size=49152)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, batch, sampling)
    return logprobs, batch


@pytest.mark.parametrize("sampling", [SamplingParams(1.0, 1.0, 0, 12), SamplingParams(0.7, 0.9, 0, 12),
                                      SamplingParams(1.3, 1.0, 40, 12), SamplingParams(0.8, 0.95, 100, 12)],
                         ids=["T1", "T0.7-p0.9", "T1.3-k40", "T0.8-p0.95-k100"])
def test_f32_engine_logprobs_equal_trainer_logprobs_under_the_sampling_transform(tiny_gguf_factory, tiny_policy, sampling):
    engine = _engine(tiny_gguf_factory("f32"))
    rollouts = engine.generate([GenerationRequest(i, p, 3) for i, p in enumerate(PROMPTS)], sampling, seed=3)
    engine.close()
    logprobs, batch = _trainer_logprobs(tiny_policy[0], rollouts, sampling)
    diff = (logprobs - batch.rollout_logprobs).abs()[batch.mask]
    assert diff.numel() == sum(len(r.completion_ids) for r in rollouts) > 0
    assert diff.max().item() < F32_BOUND
    if sampling.temperature != 1.0:  # a raw log-prob divided by T would be far off
        raw, _ = _trainer_logprobs(tiny_policy[0], rollouts, SamplingParams(1.0, 1.0, 0, 12))
        assert ((raw / sampling.temperature - batch.rollout_logprobs).abs()[batch.mask]).max() > 0.1


def test_rollout_logprob_is_looked_up_by_the_sampled_id(tiny_gguf_factory):
    sampling = SamplingParams(1.0, 1.0, 0, 8)
    engine = _engine(tiny_gguf_factory("f32"))
    rollout = engine.generate([GenerationRequest(0, PROMPTS[0], 1)], sampling, seed=0)[0]
    scored = engine.score(rollout.prompt_ids, rollout.completion_ids, sampling)
    engine.close()
    assert np.allclose(scored, rollout.rollout_logprobs, rtol=0, atol=F32_BOUND)


def test_group_shares_the_prompt_and_rollouts_carry_exact_metadata(tiny_gguf_factory):
    engine = _engine(tiny_gguf_factory("f32"), parallel=4)  # 2 groups of 3 do not fit: two waves
    engine.version = 7
    sampling = SamplingParams(1.0, 1.0, 0, 5)
    out = engine.generate([GenerationRequest(10 + i, p, 3) for i, p in enumerate(PROMPTS)], sampling, seed=1)
    again = engine.generate([GenerationRequest(10 + i, p, 3) for i, p in enumerate(PROMPTS)], sampling, seed=1)
    engine.close()
    assert [(r.group_id, r.sample_index) for r in out] == [(10, 0), (10, 1), (10, 2), (11, 0), (11, 1), (11, 2)]
    assert all(tuple(r.prompt_ids) == PROMPTS[r.group_id - 10] for r in out)
    assert all(r.versions == [7] * len(r.completion_ids) for r in out)
    assert all(r.finish_reason == "length" and len(r.completion_ids) == 5 for r in out)  # random tiny model
    assert [r.completion_ids for r in out] == [r.completion_ids for r in again]  # seeded
    assert len({tuple(r.completion_ids) for r in out}) > 1


def test_engine_stop_ids_cover_the_tokenizer_stop_tokens(tiny_gguf_factory, smollm2_tokenizer):
    engine = _engine(tiny_gguf_factory("f32"))
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert engine.is_stop_token(smollm2_tokenizer.eos_token_id) and engine.is_stop_token(im_end)
    assert not engine.is_stop_token(smollm2_tokenizer.convert_tokens_to_ids("the"))
    engine.close()


def test_every_engine_stops_on_llamacpps_complete_end_of_generation_set(tiny_policy, tiny_gguf_factory, smollm2_gguf,
                                                                       tmp_path):
    """SmolLM2's llama.cpp EOG set is {0 <|endoftext|>, 2 <|im_end|>, 4 <reponame>}; the hf engine used to stop on
    {2} only. Held against the llama.cpp engine over the whole vocabulary, for a GGUF with the template's metadata
    and for one whose metadata was written from the HF tokenizer (an HF-folder model)."""
    from nearpolicy.engines.gguf.export import export_gguf
    from nearpolicy.engines.hf import HFEngine
    from nearpolicy.model.load import stop_token_ids

    model, tokenizer = tiny_policy
    from_tokenizer = tmp_path / "from-tokenizer.gguf"
    export_gguf(model.state_dict(), model.config, from_tokenizer, "f32", None, tokenizer=tokenizer)
    for gguf_file, template in ((tiny_gguf_factory("f32"), smollm2_gguf), (from_tokenizer, None)):
        engine = _engine(gguf_file)
        llama_stops = {t for t in range(engine.n_vocab) if engine.is_stop_token(t)}
        engine.close()
        hf = HFEngine(model, stop_token_ids(model, tokenizer, template, tmp_path / "vocab"))
        assert llama_stops == {t for t in range(engine.n_vocab) if hf.is_stop_token(t)} == {0, 2, 4}
        hf.close()


def test_chat_template_applied_once_with_at_most_one_bos(smollm2_tokenizer):
    from nearpolicy.model.load import chat_prompt_ids

    ids = chat_prompt_ids(smollm2_tokenizer, "Be brief.", "What is 2 + 3?")
    start = smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(start) == 3  # system, user, assistant generation prompt
    if smollm2_tokenizer.bos_token_id is not None and smollm2_tokenizer.bos_token_id != start:
        assert ids.count(smollm2_tokenizer.bos_token_id) <= 1
    text = smollm2_tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and text.count("What is 2 + 3?") == 1
    with pytest.raises(ValueError, match="empty prompt"):
        chat_prompt_ids(smollm2_tokenizer, "Be brief.", "   ")


def test_out_of_vocabulary_prompt_is_rejected(tiny_gguf_factory):
    from nearpolicy.engines.base import EngineError

    engine = _engine(tiny_gguf_factory("f32"))
    with pytest.raises(EngineError, match="outside the engine vocabulary"):
        engine.generate([GenerationRequest(0, (1, 10**6), 1)], SamplingParams(max_new_tokens=2), seed=0)
    with pytest.raises(EngineError, match="exceeds the context"):
        engine.generate([GenerationRequest(0, tuple(range(1, 200)), 1)], SamplingParams(max_new_tokens=2), seed=0)
    engine.close()


def test_decode_counts_are_generates_decode_calls_after_the_prefill(tiny_gguf_factory):
    """Limits of 2 and 4 tokens after prompts of 6 and 5: the prefill gives both their first token, then decode calls
    hold [both], [the second], [the second]: 3 calls, 4 live sequences, 3 x 4 slots; each call's KV positions
    attended are prompt + tokens so far: 7 + 6, then 5 + 2, then 5 + 3. With one slot, each is its own wave. The
    counts carry the tiny model's roofline shape (conftest.TINY_CONFIG, an f32 GGUF and f32 cache)."""
    from conftest import TINY_CONFIG

    from nearpolicy.engines.base import DecodeCounts
    from nearpolicy.engines.roofline import DecodeShape, DecodeStep

    c = TINY_CONFIG
    d, kv_width = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    layer = 2 * d * d + 2 * d * kv_width + 3 * d * c["intermediate_size"] + 2 * d  # q o, k v, mlp, two norms
    n = c["vocab_size"] * d + c["num_hidden_layers"] * layer + d  # tied embedding once, final norm
    shape = DecodeShape(parameters=n, layers=2, query_width=d, weight_bytes=4.0 * n,
                        kv_bytes_per_token=2 * 2 * kv_width * 4)  # K and V, 2 layers, float32
    sampling = SamplingParams(1.0, 1.0, 0, 8)
    requests = [GenerationRequest(0, PROMPTS[0], 1, max_new_tokens=2), GenerationRequest(1, PROMPTS[1], 1, max_new_tokens=4)]
    engine = _engine(tiny_gguf_factory("f32"), parallel=4)
    out = engine.generate(requests, sampling, seed=0)
    engine.greedy([list(PROMPTS[0])], 5)  # neither the eval nor scoring is counted
    engine.score(list(PROMPTS[0]), [5, 6], sampling)
    assert [(r.finish_reason, len(r.completion_ids)) for r in out] == [("length", 2), ("length", 4)]
    counts = engine.take_decode_counts()
    assert counts == DecodeCounts(calls=3, sequences=4, slots=12, shape=shape,
                                  steps=(DecodeStep(2, 7 + 6), DecodeStep(1, 5 + 2), DecodeStep(1, 5 + 3)))
    assert counts.metrics() == {"rollout/decode_calls": 3.0, "rollout/decode_batch_mean": 4 / 3,
                                "rollout/decode_occupancy": 1 / 3}
    assert engine.take_decode_counts() == DecodeCounts(shape=shape)  # taken: the count restarts
    engine.close()
    engine = _engine(tiny_gguf_factory("f32"), parallel=1)
    engine.generate(requests, sampling, seed=0)
    assert engine.take_decode_counts() == DecodeCounts(  # every call full; the second prompt's prefill is no call
        calls=1 + 3, sequences=4, slots=4, shape=shape,
        steps=(DecodeStep(1, 6 + 1), DecodeStep(1, 5 + 1), DecodeStep(1, 5 + 2), DecodeStep(1, 5 + 3)))
    engine.close()


def test_decode_counts_without_a_call_and_for_an_engine_that_does_not_count():
    from nearpolicy.engines.base import DecodeCounts, take_decode_counts

    assert DecodeCounts().metrics() == {"rollout/decode_calls": 0.0}  # no batch to average
    assert DecodeCounts(2, 3, 8) + DecodeCounts(1, 1, 4) == DecodeCounts(3, 4, 12)
    assert DecodeCounts(2, 3, 8).roofline_steps() is None  # calls without shapes (hf): no roofline, no guess
    assert take_decode_counts(object()) is None  # vllm, fakes: no rollout/decode_* metric


# -- weight sync (invariant 9) --------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["f32", "q8_0"])
def test_sync_matches_a_fresh_engine_and_is_idempotent(tiny_model_dir, tiny_gguf_factory, tmp_path, precision):
    from nearpolicy.engines.gguf.export import export_gguf
    from nearpolicy.model.load import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    sampling = SamplingParams(1.0, 1.0, 0, 8)
    prompt, completion = list(PROMPTS[0]), [400, 500, 600, 700, 2]
    engine = _engine(tiny_gguf_factory(precision))
    before = engine.score(prompt, completion, sampling)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path / f"synced-{precision}.gguf"
    export_gguf(model.state_dict(), model.config, path, precision, template_gguf=tiny_gguf_factory("f32"))
    engine.update_weights(path, version=1)
    after = engine.score(prompt, completion, sampling)
    fresh = _engine(path)
    assert after == fresh.score(prompt, completion, sampling)  # exactly a fresh engine on the same file
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-3  # the new weights are in use
    first_bytes = path.read_bytes()
    export_gguf(model.state_dict(), model.config, path, precision, template_gguf=tiny_gguf_factory("f32"))
    engine.update_weights(path, version=2)
    assert path.read_bytes() == first_bytes and engine.score(prompt, completion, sampling) == after
    assert engine.version == 2
    engine.close()
    fresh.close()


# -- the transformers engine: same contract --------------------------------------------------------
@pytest.mark.parametrize("dtype,bound", [("fp32", 5e-5), ("bf16", 0.25)])
def test_hf_engine_logprobs_match_the_trainer(tiny_policy, dtype, bound):
    """fp32: the trainer's numerics. bf16: within 0.25 nats of the fp32 trainer (bf16 weights and cache; 0.068
    measured), and within 0.05 of the trainer's one-pass forward on the same bf16 weights (7e-6 measured; the cached
    decode may round up to 0.04 apart, as the score check below), where scoring each token one position off, or
    under the other prompt's cache, is nats off on average: the bounds resolve the bugs they are there to catch."""
    import copy

    from nearpolicy.engines.hf import HFEngine

    model = tiny_policy[0]
    sampling = SamplingParams(0.8, 0.95, 0, 8)
    engine = HFEngine(model, {2}, dtype=dtype, max_parallel_sequences=4)
    rollouts = engine.generate([GenerationRequest(i, p, 3) for i, p in enumerate(PROMPTS)], sampling, seed=0)
    assert [(r.group_id, r.sample_index) for r in rollouts] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    logprobs, batch = _trainer_logprobs(model, rollouts, sampling)
    diff = (logprobs - batch.rollout_logprobs).abs()[batch.mask]
    assert diff.max().item() < bound
    if dtype == "bf16":  # bf16 weights and cache are a real, measurable mismatch
        assert diff.max().item() > 1e-3
        same_weights, _ = _trainer_logprobs(copy.deepcopy(model).to(torch.bfloat16), rollouts, sampling)
        assert (same_weights.float() - batch.rollout_logprobs).abs()[batch.mask].max().item() < 0.05
        later = batch.mask[:, 1:] & batch.mask[:, :-1]  # one position off (measured 1.8 nats on average)
        assert (logprobs[:, 1:] - batch.rollout_logprobs[:, :-1]).abs()[later].mean().item() > 20 * 0.05
        swapped = [replace(r, prompt_ids=list(PROMPTS[1 - r.group_id])) for r in rollouts]  # the other row's cache
        wrong_row = _trainer_logprobs(model, swapped, sampling)[0]  # (measured 3.2 nats on average)
        assert (wrong_row - batch.rollout_logprobs).abs()[batch.mask].mean().item() > 20 * 0.05
    scored = engine.score(rollouts[0].prompt_ids, rollouts[0].completion_ids, sampling)
    # bf16: the cached decode and the one-pass forward round differently (measured up to 0.04 nats)
    assert np.allclose(scored, rollouts[0].rollout_logprobs, rtol=0, atol=0.1 if dtype == "bf16" else 5e-5)


def test_greedy_of_zero_tokens_is_empty_and_a_closed_engine_says_so(tiny_gguf_factory):
    from nearpolicy.engines.base import EngineError

    engine = LlamaCppEngine(tiny_gguf_factory("f32"), max_context=64, max_parallel_sequences=2, threads=1)
    assert engine.greedy([list(PROMPTS[0]), list(PROMPTS[1])], 0) == [[], []]
    assert [len(ids) for ids in engine.greedy([list(PROMPTS[0])], 1)] == [1]
    engine.close()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=2)
    for call in (lambda: engine.greedy([list(PROMPTS[0])], 2), lambda: engine.score(list(PROMPTS[0]), [5], sampling),
                 lambda: engine.generate([GenerationRequest(0, tuple(PROMPTS[0]), 1)], sampling, seed=0)):
        with pytest.raises(EngineError, match="is closed"):
            call()


def test_greedy_refills_finished_slots_and_every_id_is_the_trainers_argmax(tiny_gguf_factory, tiny_policy):
    """Continuous batching (engines/llama_context.greedy_continuous): 7 prompts through 3 KV streams, sequences
    ending at different steps (a stop rule on the ids), so finished slots are refilled while others decode. Every
    id must be the trainer's argmax at its position (f32 engine: within 1e-4 of the max logit; a row handed to the
    wrong sequence would be off by whole logits), and each completion ends at its first stop id or the limit."""
    from nearpolicy.engines.llama_context import greedy_continuous

    engine = LlamaCppEngine(tiny_gguf_factory("f32"), max_context=128, max_parallel_sequences=3, threads=2,
                            kv_cache="f32", adaptive_threads=False)
    prompts = [tuple(PROMPTS[i % 2][: 3 + i % 4]) + (100 + i,) for i in range(7)]
    stops = lambda tok: tok % 3 == 0  # noqa: E731  about a third of ids end a sequence
    out = greedy_continuous(engine._greedy_context(64), prompts, 6, stops, kv_reuse=False)
    engine.close()
    assert len(out) == 7 and len({len(ids) for ids in out}) > 1  # sequences ended at different steps
    for prompt, ids in zip(prompts, out):
        assert all(not stops(t) for t in ids[:-1]) and (stops(ids[-1]) or len(ids) == 6)
        with torch.no_grad():
            logits = tiny_policy[0](input_ids=torch.tensor([list(prompt) + ids])).logits[0, len(prompt) - 1 : -1]
        picked = logits.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert (logits.max(-1).values - picked).max().item() < 1e-4


def test_greedy_evaluates_a_shared_prompt_prefix_once_and_every_id_is_still_the_trainers_argmax(tiny_gguf_factory,
                                                                                                 tiny_policy):
    """The eval's prompts share a system prompt and chat template (43 of chain_sum's 54 tokens): greedy_continuous
    evaluates that prefix once into the spare stream and copies it into each sequence's stream, so each prompt
    prefills only its tail. 9 prompts with a 10-id shared prefix through 3 streams (later prompts join refilled
    slots, which get the prefix copied too): the decoded prompt ids drop from 9 x 13 to 10 + 9 x 3, and every id is
    the trainer's argmax on the whole prompt (f32: within 1e-4 of the max logit; a missing or misplaced prefix would
    be off by whole logits). A prefix shorter than SHARED_PREFIX_MIN is prefilled per prompt, as before."""
    from nearpolicy.engines.llama_context import SHARED_PREFIX_MIN, greedy_continuous, shared_prefix_length

    prefix = (1, 504, 3287, 28, 1085, 6001, 2683, 359, 253, 5356)
    prompts = [prefix + (100 + i, 200 + i % 3, 300 + i) for i in range(9)]
    assert shared_prefix_length(prompts) == 10 >= SHARED_PREFIX_MIN > 3 and shared_prefix_length([]) == 0
    assert shared_prefix_length([(1, 2, 3), (1, 2, 3)]) == 2  # each prompt keeps its last id
    engine = LlamaCppEngine(tiny_gguf_factory("f32"), max_context=128, max_parallel_sequences=3, threads=2,
                            kv_cache="f32", adaptive_threads=False)
    ctx = engine._greedy_context(64)
    decoded = []
    original = ctx.decode
    ctx.decode = lambda entries: (decoded.append(entries), original(entries))[1]
    stops = lambda tok: tok % 3 == 0  # noqa: E731  sequences end at different steps, so slots are refilled
    out = greedy_continuous(ctx, prompts, 6, stops, kv_reuse=True)
    # prompt ids at positions 0-11 (the last, 12, is decoded with its logits): the prefix once, then 2 per prompt
    assert sum(1 for call in decoded for _, pos, _, _ in call if pos < 12) == 10 + 9 * 2
    short = [prefix[:3] + (100 + i, 7) for i in range(4)]
    decoded.clear()
    out_short = greedy_continuous(ctx, short, 2, stops, kv_reuse=False)
    assert sum(1 for call in decoded for _, pos, _, _ in call if pos < 4) == 4 * 4  # no sharing below the minimum
    engine.close()
    for prompt, ids in list(zip(prompts, out)) + list(zip(short, out_short)):
        assert ids and all(not stops(t) for t in ids[:-1])
        with torch.no_grad():
            logits = tiny_policy[0](input_ids=torch.tensor([list(prompt) + ids])).logits[0, len(prompt) - 1 : -1]
        picked = logits.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert (logits.max(-1).values - picked).max().item() < 1e-4


@pytest.mark.parametrize("spare", [True, False], ids=["swap-through-spare", "no-spare"])
def test_packed_streams_keep_every_sequence_on_its_own_cache(tiny_gguf_factory, tiny_policy, spare):
    """Sampling packs the live sequences into the lowest KV streams before each decode step (KVContext.pack): groups
    with different token limits end at different steps, so later groups' streams move into the holes. Every
    log-prob must still be the trainer's (f32: within F32_BOUND; a stream moved wrongly attends over another
    sequence's cache, off by far more), and each kept cache must hold what `cached` says: a second call continuing
    every sequence reuses its cache (prefill_reused) and still matches the trainer. Without a spare stream a
    displaced finished cache is overwritten and must not be offered for reuse."""
    sampling = SamplingParams(1.0, 1.0, 0, 12)
    engine = _engine(tiny_gguf_factory("f32"), parallel=12)
    engine._sampling_context(64)
    if not spare:
        engine._sampler.spare = None
    limits = [3, 12, 5, 9]
    first = engine.generate([GenerationRequest(i, PROMPTS[i % 2], 3, limits[i]) for i in range(4)], sampling, seed=5)
    assert [len(r.completion_ids) for r in first] == [n for n in limits for _ in range(3)]
    follow = [GenerationRequest(10 + k, tuple(r.prompt_ids) + tuple(r.completion_ids) + (17,), 1, 4)
              for k, r in enumerate(first)]
    second = engine.generate(follow, sampling, seed=6)
    engine.close()
    reused = [r.extras.get("prefill_reused", 0) for r in second]
    expected = [len(r.prompt_ids) + len(r.completion_ids) - 1 for r in first]
    if spare:
        assert reused == expected  # every kept cache was where `cached` said
    else:
        assert 0 < sum(v > 0 for v in reused) < len(reused)
        assert all(v in (0, e) for v, e in zip(reused, expected))
    for rollouts in (first, second):
        logprobs, batch = _trainer_logprobs(tiny_policy[0], rollouts, sampling)
        assert (logprobs - batch.rollout_logprobs).abs()[batch.mask].max().item() < F32_BOUND


def test_requests_beyond_the_slots_join_as_soon_as_their_group_fits(tiny_gguf_factory, tiny_policy):
    """Continuous batching (LlamaCppEngine.stream): 4 slots, groups of 2 with token limits 2, 9, 5, 3. The third
    group takes the first group's slots when it finishes, the fourth the third's, while the second still decodes:
    9 decode calls (the third group's prompt joins call 2, the fourth's call 7, and the fourth's last token comes
    from call 9) against 8 + 4 = 12 in two waves; every log-prob is the trainer's (an admitted prompt evaluated
    into the wrong stream, or copied wrongly, would be off by far more than F32_BOUND)."""
    sampling = SamplingParams(1.0, 1.0, 0, 12)
    limits = [2, 9, 5, 3]
    engine = _engine(tiny_gguf_factory("f32"), parallel=4)
    out = engine.generate([GenerationRequest(i, PROMPTS[i % 2] + (50 + i,), 2, n) for i, n in enumerate(limits)],
                          sampling, seed=11)
    counts = engine.take_decode_counts()
    engine.close()
    assert [(r.group_id, r.sample_index, len(r.completion_ids)) for r in out] == [
        (g, k, n) for g, n in enumerate(limits) for k in range(2)]
    assert counts.calls == 9
    logprobs, batch = _trainer_logprobs(tiny_policy[0], out, sampling)
    assert (logprobs - batch.rollout_logprobs).abs()[batch.mask].max().item() < F32_BOUND


def test_a_refused_context_growth_keeps_the_engine_and_later_syncs_working(tiny_gguf_factory):
    """llama.cpp refusing a larger sampling context (memory) raises EngineError with the current context kept, and
    the refused size is not remembered: the next weight sync loads at the size that worked."""
    from nearpolicy.engines.base import EngineError

    path = tiny_gguf_factory("f32")
    engine = LlamaCppEngine(path, max_context=1024, max_parallel_sequences=4, threads=2, kv_cache="f32")
    real = engine._context

    def refusing(n_seq, cells, unified):
        if cells > 256:
            raise EngineError("llama.cpp could not create a context")
        return real(n_seq, cells, unified)

    engine._context = refusing
    with pytest.raises(EngineError, match="could not create"):
        engine._sampling_context(600)
    assert engine._sampler.cells_per_seq == 256
    engine.update_weights(path, 1)
    out = engine.generate([GenerationRequest(0, PROMPTS[0], 2)], SamplingParams(1.0, 1.0, 0, 4), seed=0)
    engine.close()
    assert [len(r.completion_ids) for r in out] == [4, 4]
