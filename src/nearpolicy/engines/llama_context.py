"""One llama.cpp context of the llama.cpp engine: its KV cache, the batch it decodes with, and the ids each KV
sequence holds (for continuation, engines/kv_reuse.py).

Both of the engine's contexts keep one KV stream per sequence (llama.cpp's kv_unified = false). In one cache unified
over all sequences every decode step attends over every live cell, masked, so its attention work grows with the
number of sequences times their length; a stream attends over its own cells only. Sampling shares a group's prompt,
evaluated once, by copying the leader's stream into the group's other streams (llama_memory_seq_cp across streams
copies the whole stream buffer, so contexts are sized to the call: `cells_per_seq` a power of two). llama.cpp decodes a
batch as one micro-batch per run of consecutive streams, so the live sequences are packed into the lowest streams
before each decode step (`KVContext.pack`). Measured: docs/results.md sec. 2."""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nearpolicy.engines.base import LLAMA_MAX_SEQ, DecodeCounts, EngineError
from nearpolicy.engines.kv_reuse import Cached, plan_slots
from nearpolicy.engines.roofline import DecodeShape, DecodeStep, kv_bytes_per_token
from nearpolicy.types import GenerationRequest


@dataclass
class Seq:
    """One sequence being decoded: its slot in the KV cache and what it produced so far."""

    request: GenerationRequest
    sample_index: int
    seq_id: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    reused: int = 0  # prompt tokens whose KV cache this sequence continued (engines/kv_reuse.py)

    @property
    def next_pos(self) -> int:
        return len(self.request.prompt_ids) + len(self.ids) - 1


class KVContext:
    """A llama.cpp context of `n_seq` sequences x `cells_per_seq` KV cells each, one cache unified over them or
    one stream per sequence (`unified`). With streams and room under llama.cpp's sequence limit it has one more,
    spare, stream (`spare`: its id) that `pack` swaps through. `kv_type` is a ggml_type id (llamacpp.KV_CACHE_TYPES).
    Raises EngineError when llama.cpp cannot create it."""

    def __init__(self, lib, model, n_vocab: int, *, n_seq: int, cells_per_seq: int, unified: bool, threads: int,
                 kv_type: int, flash_attention: bool):
        self.lib, self.n_vocab, self.n_seq, self.cells_per_seq = lib, n_vocab, n_seq, cells_per_seq
        self.unified = unified
        self.spare = n_seq if not unified and n_seq < LLAMA_MAX_SEQ else None
        n_streams = n_seq + (self.spare is not None)
        cparams = lib.llama_context_default_params()
        self.n_batch = max(512, n_streams)
        cparams.n_ctx = cells_per_seq * n_streams
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = n_streams
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = unified
        cparams.type_k = cparams.type_v = kv_type
        # llama.cpp's CPU flash attention rounds Q to f16 (about 7e-3 nats of extra mismatch at f32): a choice
        cparams.flash_attn_type = 1 if flash_attention else 0
        self.ctx = lib.llama_init_from_model(model, cparams)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not create a context of {n_seq} x {cells_per_seq} KV cells")
        self.threads = threads
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.cached: dict[int, Cached] = {}  # KV sequence id -> the ids its cache holds (a fresh context: none)

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
        if self.ctx:
            self.lib.llama_free(self.ctx)
        self.ctx = self.batch = None

    def set_threads(self, n: int) -> None:
        if n != self.threads:
            self.lib.llama_set_n_threads(self.ctx, n, n)
            self.threads = n

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (token, pos, seq_id, want_logits) entries in chunks of n_batch; returns the logits rows
        [n_wanted, V] float32 in entry order. Raises EngineError for an id outside the vocabulary or a failed call."""
        lib, rows = self.lib, []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            b = self.batch
            for i, (tok, pos, seq, want) in enumerate(chunk):
                if not 0 <= tok < self.n_vocab:
                    raise EngineError(f"token id {tok} outside the engine vocabulary [0, {self.n_vocab})")
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want)
                b.seq_id[i][0] = seq
            b.n_tokens = len(chunk)
            rc = lib.llama_decode(self.ctx, b)
            if rc != 0:
                raise EngineError(f"llama_decode failed with code {rc} (context of {self.cells_per_seq} tokens per "
                                  "sequence exceeded?)")
            n_out = sum(1 for *_, want in chunk if want)
            if n_out:
                ptr = lib.llama_get_logits(self.ctx)
                rows.append(np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy())
        return np.concatenate(rows) if rows else np.empty((0, self.n_vocab), np.float32)

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.cached = {}

    def clear_slot(self, slot: int) -> None:
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), slot, -1, -1)
        self.cached.pop(slot, None)

    def copy_stream(self, src: int, dst: int) -> None:
        """Copy sequence `src`'s whole stream over `dst`'s (llama.cpp queues the buffer copy for the next decode, and
        runs queued copies in order)."""
        self.lib.llama_memory_seq_cp(self.lib.llama_get_memory(self.ctx), src, dst, -1, -1)

    def pack(self, active: list[Seq], parked: list[Seq]) -> None:
        """Move the `active` sequences into streams 0..len(active)-1 before a decode step (a no-op in a unified
        cache). llama.cpp splits a batch over split streams into one micro-batch per run of consecutive streams: 16
        live sequences in every other stream decoded 3.9x slower than in 16 consecutive ones (SmolLM2, f16, 2
        threads). A stream a mover needs that holds a kept cache (`cached`, or a `parked` finished sequence not yet
        kept) is swapped into the mover's old stream through the spare stream, so the cache survives for a
        continuation; with no spare it is overwritten (the parked sequence's seq_id becomes -1, never kept).
        Updates each moved Seq's seq_id and the `cached` map."""
        n = len(active)
        if self.unified or all(s.seq_id < n for s in active):
            return
        mem = self.lib.llama_get_memory(self.ctx)
        holes = iter(sorted(set(range(n)) - {s.seq_id for s in active}))
        owner = {s.seq_id: s for s in parked if s.seq_id >= 0}
        for s in sorted((s for s in active if s.seq_id >= n), key=lambda s: s.seq_id):
            hole, old = next(holes), s.seq_id
            displaced, held = owner.pop(hole, None), self.cached.pop(hole, None)
            self.cached.pop(old, None)
            if (displaced is not None or held is not None) and self.spare is not None:
                self.copy_stream(hole, self.spare)
                self.copy_stream(old, hole)
                self.copy_stream(self.spare, old)
                self.lib.llama_memory_seq_rm(mem, self.spare, -1, -1)
                if displaced is not None:
                    displaced.seq_id = old
                if held is not None:
                    self.cached[old] = held
            else:
                self.copy_stream(old, hole)
                self.lib.llama_memory_seq_rm(mem, old, -1, -1)
                if displaced is not None:
                    displaced.seq_id = -1
            s.seq_id = hole

    def prefill(self, seqs: list[Seq], kv_reuse: bool) -> np.ndarray:
        """Give each sequence a KV slot (a cached one it continues, when `kv_reuse`), evaluate each group's prompt (or
        its new tail) once, share it with the group; returns the last prompt token's logits row per sequence [n, V]."""
        lib = self.lib
        mem = lib.llama_get_memory(self.ctx)
        leaders: dict[int, Seq] = {}
        for s in seqs:
            leaders.setdefault(id(s.request), s)
        plan = plan_slots(self.cached if kv_reuse else {}, [s.request.prompt_ids for s in seqs],
                          [leaders[id(s.request)] is s for s in seqs], self.n_seq)
        for s, slot, reused in zip(seqs, plan.slots, plan.reused):
            s.seq_id, s.reused = slot, reused
        keep = dict(zip(plan.slots, plan.reused))  # a continued sequence keeps its prompt's part; others are cleared
        for slot in range(self.n_seq) if any(plan.reused) else ():
            lib.llama_memory_seq_rm(mem, slot, keep.get(slot, 0), -1)
        if not any(plan.reused):
            self.reset()
        self.cached = {}
        entries = []
        for lead in leaders.values():
            p = lead.request.prompt_ids
            entries += [(t, i, lead.seq_id, i == len(p) - 1) for i, t in enumerate(p) if i >= lead.reused]
        rows = self.decode(entries)  # one logits row per leader, in leader order
        row_of = {key: k for k, key in enumerate(leaders)}
        for s in seqs:
            lead = leaders[id(s.request)]
            if s is not lead:
                lib.llama_memory_seq_cp(mem, lead.seq_id, s.seq_id, -1, -1)
        return rows[[row_of[id(s.request)] for s in seqs]]

    def decode_step(self, live: list[Seq], admitted: list[Seq], finished: list[Seq]) -> np.ndarray:
        """One decode call of continuous batching: a token for every live sequence (packed into streams
        0..len(live)-1 by `pack` first; `live` is sorted by stream here), and the prompts of the `admitted` groups,
        each evaluated once by its first sample in the next free stream and copied to its group's other streams (a
        `finished` sequence whose stream is taken gets seq_id -1: never kept). Returns the logits rows
        [len(live) + len(admitted), V] float32: live first, by stream, then admitted in order."""
        live.sort(key=lambda s: s.seq_id)  # llama.cpp takes consecutive streams in batch order
        leaders: dict[int, Seq] = {}
        for s in admitted:
            leaders.setdefault(id(s.request), s)
        occupied = {s.seq_id for s in live}
        free = iter(slot for slot in range(self.n_seq) if slot not in occupied)
        owner = {s.seq_id: s for s in finished if s.seq_id >= 0}
        for s in sorted(admitted, key=lambda s: leaders[id(s.request)] is not s):  # leaders first: one micro-batch
            s.seq_id = next(free)
            if s.seq_id in owner:  # its cache is overwritten: never kept, never continued
                owner.pop(s.seq_id).seq_id = -1
            self.clear_slot(s.seq_id)
        entries = [(s.ids[-1], s.next_pos, s.seq_id, True) for s in live]
        for lead in leaders.values():
            p = lead.request.prompt_ids
            entries += [(t, i, lead.seq_id, i == len(p) - 1) for i, t in enumerate(p)]
        rows = self.decode(entries)
        for s in admitted:
            if leaders[id(s.request)] is not s:
                self.copy_stream(leaders[id(s.request)].seq_id, s.seq_id)
        lead_row = {key: len(live) + k for k, key in enumerate(leaders)}
        return rows[list(range(len(live))) + [lead_row[id(s.request)] for s in admitted]]

    def keep(self, seqs: list[Seq]) -> None:
        """Record the ids each finished sequence's KV slot holds: the prompt and every sampled id but the last (not for
        a sequence whose cache `pack` overwrote: seq_id -1)."""
        self.cached.update({s.seq_id: Cached(tuple(s.request.prompt_ids) + tuple(s.ids[:-1]),
                                             len(s.request.prompt_ids)) for s in seqs if s.seq_id >= 0})


SHARED_PREFIX_MIN = 8  # fewer shared prompt tokens than this are prefilled per prompt (the copy is not worth it)


def shared_prefix_length(prompts: list[tuple[int, ...]]) -> int:
    """The number of leading ids every prompt shares, at most the shortest prompt's length - 1 (each prompt keeps
    one id of its own, whose logits start its completion); 0 for no prompts."""
    if not prompts:
        return 0
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def greedy_continuous(ctx: KVContext, prompts: list[tuple[int, ...]], max_new_tokens: int,
                      is_stop: Callable[[int], bool], kv_reuse: bool) -> list[list[int]]:
    """Argmax completions [len(prompts)] of at most `max_new_tokens` ids each (the stop id included when emitted),
    decoded ctx.n_seq at a time with continuous batching: a finished sequence's slot is cleared and refilled with the
    next prompt, whose prefill joins the next decode call, so the batch stays full until the queue drains. The first
    ctx.n_seq prompts may continue cached sequences (`kv_reuse`); later ones are prefilled from scratch.
    When no prompt continues a cache and every prompt starts with the same SHARED_PREFIX_MIN or more ids (a task's
    system prompt and chat template: 43 of chain_sum's 54 tokens on SmolLM2), that prefix is evaluated once into the
    spare stream and copied into each sequence's stream (llama_memory_seq_cp), so each prompt prefills only its own
    tail: the eval's prefill shrinks by the shared share (docs/results.md sec. 2).
    With kv_cache = "f16" llama.cpp's logits depend slightly on how a prompt is split across decode calls (up to
    about 0.6 in a logit, measured on SmolLM2), so a near-tie may resolve differently with other prompts in flight;
    at f32 KV the result does not depend on the batch."""
    seqs = [Seq(GenerationRequest(i, tuple(p), 1), 0, 0) for i, p in enumerate(prompts)]
    if not seqs or max_new_tokens <= 0:
        return [[] for _ in seqs]
    queue = deque(seqs[ctx.n_seq :])
    active = seqs[: ctx.n_seq]
    shared = _shared_prefix(ctx, [tuple(p) for p in prompts], kv_reuse)
    logits = ctx.prefill(active, kv_reuse) if not shared else _prefill_tails(ctx, active, shared)
    while active:
        for s, tok in zip(active, np.argmax(logits, axis=1).tolist()):
            s.ids.append(tok)
            if is_stop(tok) or len(s.ids) >= max_new_tokens:
                s.finish = "done"
        done = [s for s in active if s.finish]
        active = [s for s in active if s.finish is None]
        admitted = []
        for slot in (s.seq_id for s in done):
            if not queue:
                break
            ctx.clear_slot(slot)
            if shared:
                ctx.copy_stream(ctx.spare, slot)
            admitted.append(queue.popleft())
            admitted[-1].seq_id = slot
        ctx.keep([s for s in done if s.seq_id not in {a.seq_id for a in admitted}])
        if not admitted:  # the queue has drained: keep the live streams consecutive (KVContext.pack)
            ctx.pack(active, [])  # may swap through the spare stream: the shared prefix is not needed any more
        fresh = {id(s) for s in admitted}
        active = sorted(active + admitted, key=lambda s: s.seq_id)  # llama.cpp takes consecutive streams in order
        entries = []
        for s in active:  # one logits row each: the last sampled id, or an admitted prompt's last token
            p = s.request.prompt_ids
            entries += ([(t, i, s.seq_id, i == len(p) - 1) for i, t in enumerate(p) if i >= shared] if id(s) in fresh
                        else [(s.ids[-1], s.next_pos, s.seq_id, True)])
        if active:
            logits = ctx.decode(entries)
    if shared:
        ctx.clear_slot(ctx.spare)
    return [s.ids for s in seqs]


def _shared_prefix(ctx: KVContext, prompts: list[tuple[int, ...]], kv_reuse: bool) -> int:
    """How many leading prompt ids greedy_continuous evaluates once for all prompts: shared_prefix_length when the
    context has a spare stream to hold them, it is at least SHARED_PREFIX_MIN, and no prompt of the first wave would
    continue a kept cache (a continuation reuses more); else 0."""
    if ctx.unified or ctx.spare is None:
        return 0
    n = shared_prefix_length(prompts)
    if n < SHARED_PREFIX_MIN:
        return 0
    first = prompts[: ctx.n_seq]
    if kv_reuse and any(plan_slots(ctx.cached, first, [True] * len(first), ctx.n_seq).reused):
        return 0
    return n


def _prefill_tails(ctx: KVContext, seqs: list[Seq], shared: int) -> np.ndarray:
    """The first wave of greedy_continuous with a shared prefix: the prefix's ids into the spare stream (no logits),
    copied into streams 0..len(seqs)-1, then every prompt's tail from position `shared` in one decode call (llama.cpp
    runs queued stream copies before it); returns the last prompt token's logits row per sequence [n, V]."""
    ctx.reset()
    prefix = seqs[0].request.prompt_ids[:shared]
    ctx.decode([(t, i, ctx.spare, False) for i, t in enumerate(prefix)])
    entries = []
    for slot, s in enumerate(seqs):
        s.seq_id = slot
        ctx.copy_stream(ctx.spare, slot)
        p = s.request.prompt_ids
        entries += [(t, i, slot, i == len(p) - 1) for i, t in enumerate(p) if i >= shared]
    return ctx.decode(entries)


KV_VALUE_BYTES = {"f32": 4.0, "f16": 2.0}  # bytes per cached K or V value, by engine.kv_cache


def decode_shape(lib, model, kv_cache: str) -> DecodeShape | None:
    """The roofline's view of a loaded llama.cpp model (engines/roofline.py): llama.cpp's parameter count and tensor
    bytes (a tied embedding is one tensor: counted once, as the LM head), layers, query width = heads x the key
    length (`<arch>.attention.key_length`, else n_embd / heads), and the `kv_cache` type's bytes per token position
    (every layer's full length: a sliding-window layer is overcounted). None for a cache type KV_VALUE_BYTES lacks."""
    if kv_cache not in KV_VALUE_BYTES:
        return None
    layers, heads, kv_heads = (lib.llama_model_n_layer(model), lib.llama_model_n_head(model),
                               lib.llama_model_n_head_kv(model))
    head_dim = lib.llama_model_n_embd(model) // max(heads, 1)
    buf = ctypes.create_string_buffer(64)
    if lib.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf)) > 0:
        key = buf.value + b".attention.key_length"
        if lib.llama_model_meta_val_str(model, key, buf, len(buf)) > 0:
            head_dim = int(buf.value)
    return DecodeShape(int(lib.llama_model_n_params(model)), layers, heads * head_dim,
                       float(lib.llama_model_size(model)), kv_bytes_per_token(layers, kv_heads, head_dim,
                                                                              KV_VALUE_BYTES[kv_cache]))


def decode_call(live: list[Seq], slots: int) -> DecodeCounts:
    """The DecodeCounts of one decode call of `live` sequences (`slots`: the engine's max_parallel_sequences), its
    DecodeStep included: each live sequence's token at next_pos attends over next_pos + 1 KV positions (its prompt and
    tokens so far). The engine adds its model's DecodeShape when the counts are taken."""
    return DecodeCounts(1, len(live), slots, (DecodeStep(len(live), sum(s.next_pos + 1 for s in live)),))
