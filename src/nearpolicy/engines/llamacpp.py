"""llama.cpp rollout engine on llama-cpp-python's low-level API, with our own sampling loop.

Each returned log-prob is log softmax of the transformed logits the token was drawn from (engines/sampling.py),
looked up by the sampled id (invariants 1, 2). A group of n samples evaluates its prompt once into one
sequence, copies that KV stream to the other n - 1 sequences, and the whole wave of sequences is decoded as one
multi-sequence batch, the live ones packed into consecutive streams (engines/llama_context.py). Weight sync =
load a new GGUF (engines/gguf/export.py) into a fresh model and context, or, when the trainer rewrote the mapped file's
tensors in place (engines/gguf/inplace.py), clear every KV cache: no cache of the old weights survives (invariant 9)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from nearpolicy.engines.base import LLAMA_MAX_SEQ, DecodeCounts, EngineError, LoraAdapter, RewrittenGGUF, file_id
from nearpolicy.engines.cpu_load import fit_threads, free_cores
from nearpolicy.engines.llama_lib import eog_ids, is_eog, load_lib, set_log_file
from nearpolicy.engines.llama_context import KVContext, Seq, decode_call, decode_shape, greedy_continuous
from nearpolicy.engines.sampling import sample_rows, transformed_log_softmax
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams

KV_CACHE_TYPES = {"f32": 0, "f16": 1}  # KV-cache dtype -> ggml_type id (config engine.kv_cache)


@dataclass(frozen=True)
class EngineSpec:
    """How to open a llama.cpp engine (picklable: sent to engine processes and Ray actors)."""

    gguf_path: str
    version: int
    max_context: int
    max_parallel_sequences: int
    threads: int
    kv_cache: str
    flash_attention: bool
    extra_buffers: bool = False
    adaptive_threads: bool = True
    logit_noise: float = 0.0

    def open(self) -> "LlamaCppEngine":
        return LlamaCppEngine(Path(self.gguf_path), max_context=self.max_context,
                              max_parallel_sequences=self.max_parallel_sequences, threads=self.threads,
                              version=self.version, kv_cache=self.kv_cache, flash_attention=self.flash_attention,
                              extra_buffers=self.extra_buffers, adaptive_threads=self.adaptive_threads,
                              logit_noise=self.logit_noise)

    def log_to(self, fd: int, first_load: bool) -> None:
        """llama.cpp's own log to `fd`: the first load in full, later reloads (weight syncs) by their warnings."""
        set_log_file(fd, min_level=2 if first_load else 3)


class LlamaCppEngine:
    """Rollout engine over one GGUF file. `max_context` bounds prompt + completion per sequence (tokens);
    `kv_cache` is the KV-cache dtype ("f16", llama.cpp's default, or "f32"); `flash_attention` enables
    llama.cpp's flash-attention kernel (faster on long contexts, rounds queries to f16); `extra_buffers` lets
    llama.cpp move weights into its "extra" buffer types (CPU repacking, AMX) at load. Off by default: with AMX
    compiled in, the AMX buffer's first matmul faults on some Xeon hosts (ggml-org/llama.cpp#20824).
    `adaptive_threads`: each generate / greedy call runs on at most the cores other processes leave idle
    (engines/cpu_load.py; `threads_used` says how many the last call had). `logit_noise` (std, logit units,
    >= 0): training samples are drawn from logits + seeded Gaussian noise and their log-probs reported under
    that noisy distribution (engines/sampling.py; config engine.logit_noise); greedy and score are unaffected.
    `kv_reuse`: a prompt continuing a sequence of the previous call (an episode's next turn) keeps its KV cache and
    decodes only the new tokens (engines/kv_reuse.py); a rollout's extras["prefill_reused"] counts those saved.
    generate counts its decode calls after the prefill (`take_decode_counts`); greedy and score are not counted.
    `unified_kv`: sample in one KV cache unified over all sequences instead of one stream per sequence (the default,
    faster: engines/llama_context.py); kept for comparison (bench/kv_layout.py)."""

    def __init__(self, gguf_path: Path, *, max_context: int = 1024, max_parallel_sequences: int = 64,
                 threads: int = 2, version: int = 0, unified_kv: bool = False, kv_cache: str = "f16",
                 flash_attention: bool = False, extra_buffers: bool = False, adaptive_threads: bool = True,
                 logit_noise: float = 0.0, kv_reuse: bool = True):
        if not 1 <= max_parallel_sequences <= LLAMA_MAX_SEQ:
            raise ValueError(f"engine.max_parallel_sequences = {max_parallel_sequences} is outside llama.cpp's range "
                             f"[1, {LLAMA_MAX_SEQ}] (LLAMA_MAX_SEQ sequences per context)")
        if kv_cache not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache must be one of {sorted(KV_CACHE_TYPES)}, got {kv_cache!r}")
        if not logit_noise >= 0:
            raise ValueError(f"logit_noise must be >= 0, got {logit_noise}")
        self.max_context, self.kv_reuse, self.max_parallel = max_context, kv_reuse, max_parallel_sequences
        self.threads, self.unified_kv, self.kv_cache = threads, unified_kv, kv_cache
        self.flash_attention, self.extra_buffers, self.adaptive_threads = flash_attention, extra_buffers, adaptive_threads
        self.logit_noise, self.version, self.path = float(logit_noise), version, Path(gguf_path)
        self._model = self._sampler = self._greedy = None
        self._adapter = None  # the LoRA adapter set on every context (engines/llama_adapter.py), or None
        self._decode_counts = DecodeCounts()
        self._sampling_cells = 0  # the most KV cells per sequence a sampling call has needed (_sampling_context)
        self._load(self.path)

    # -- lifecycle -------------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        lib = load_lib()
        if not path.is_file():
            raise EngineError(f"GGUF file not found: {path}")
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = self.extra_buffers
        mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP  # the weights are the file's pages (in-place sync)
        loaded_file = file_id(path)
        model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise EngineError(f"llama.cpp could not load {path} (corrupt or unsupported GGUF)")
        self._model = model
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.decode_shape = decode_shape(lib, model, self.kv_cache)  # the roofline's view of the model
        try:
            self._sampler = self._context(self.max_parallel, self._cells_for(self._sampling_cells), self.unified_kv)
        except EngineError:
            lib.llama_model_free(model)
            self._model = None
            raise EngineError(f"llama.cpp could not create a context for {path}") from None
        self._greedy: KVContext | None = None  # one stream per sequence, made on the first greedy call
        self.threads_used = self.threads  # a new context starts at the configured count
        self.path, self._file_id = path, loaded_file
        # the weights are the mapped file's pages only on the CPU backend without extra buffers (GPU builds copy them)
        self._reads_the_file = not self.extra_buffers and not lib.llama_supports_gpu_offload()

    def _context(self, n_seq: int, cells_per_seq: int, unified: bool) -> KVContext:
        ctx = KVContext(load_lib(), self._model, self.n_vocab, n_seq=n_seq, cells_per_seq=cells_per_seq,
                        unified=unified, threads=self.threads,
                        kv_type=KV_CACHE_TYPES[self.kv_cache], flash_attention=self.flash_attention)
        if self._adapter is not None:  # a context made after an adapter sync runs with that adapter too
            self._adapter.set_on(ctx.ctx)
        return ctx

    def close(self) -> None:
        for ctx in (self._sampler, self._greedy):
            if ctx is not None:
                ctx.close()
        if self._adapter is not None:
            self._adapter.free()
            self._adapter = None
        if self._model:
            load_lib().llama_model_free(self._model)
        self._model = self._sampler = self._greedy = None

    def update_weights(self, source: Path | str | RewrittenGGUF, version: int) -> None:
        """New weights, every cache of the previous ones dropped. `source`: a GGUF path (engines/gguf/export.py), loaded into
        a fresh model; or a RewrittenGGUF (engines/gguf/inplace.py): when it names the file this engine maps (and no extra
        buffer holds a copy of its weights), the model stays and its next decode reads the new bytes, else the
        engine loads source.path. A LoraAdapter (source.gguf) replaces the adapter on the unchanged base
        (`_swap_adapter`); a model reload drops it. Raises TypeError for another source, EngineError when the file
        cannot load."""
        if isinstance(source, LoraAdapter):
            self._swap_adapter(source)
            self.version = version
            return
        if isinstance(source, RewrittenGGUF):
            if self._model is not None and self._reads_the_file and source.file_id == self._file_id:
                for ctx in (self._sampler, self._greedy):
                    if ctx is not None:
                        ctx.reset()
                self.version = version
                return
            source = source.path
        if not isinstance(source, (str, Path)):
            raise TypeError("the llama.cpp engine syncs from a GGUF path (see engines/gguf/export.py)")
        self.close()
        self._load(Path(source))
        self.version = version

    def _swap_adapter(self, source: LoraAdapter) -> None:
        """Load the adapter file source.gguf, set it on every context, clear every KV cache (keys and values of the
        old adapter must not survive), then free the previous adapter; `adapter_load_s` is the load's seconds. Raises
        TypeError without source.gguf, EngineError when llama.cpp refuses the file (the previous adapter stays)."""
        from nearpolicy.engines.llama_adapter import LlamaAdapter

        if source.gguf is None:
            raise TypeError("the llama.cpp engine loads a LoRA adapter from a GGUF file (LoraAdapter.gguf)")
        self._require_open()
        new = LlamaAdapter(load_lib(), self._model, source.gguf)
        for ctx in (self._sampler, self._greedy):
            if ctx is not None:
                new.set_on(ctx.ctx)
                ctx.reset()
        old, self._adapter, self.adapter_load_s = self._adapter, new, new.seconds
        if old is not None:
            old.free()

    # -- low-level decode ------------------------------------------------------------------------
    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """The sampling context's decode (llama_context.KVContext.decode): logits rows [n_wanted, V] float32."""
        return self._sampler.decode(tokens)

    def _fit_threads(self, ctx: KVContext) -> None:
        """Run the next call on at most the idle cores (engines/cpu_load.py), never above `threads`."""
        if self.adaptive_threads:
            ctx.set_threads(fit_threads(self.threads, free_cores()))
        self.threads_used = ctx.threads

    def _require_open(self) -> None:
        if self._model is None:
            raise EngineError(f"the llama.cpp engine for {self.path} is closed")

    def _check_prompt(self, prompt: tuple[int, ...] | list[int], new_tokens: int) -> None:
        if len(prompt) + new_tokens > self.max_context:
            raise EngineError(
                f"prompt of {len(prompt)} tokens + {new_tokens} new tokens exceeds the context of "
                f"{self.max_context} tokens per sequence (model.max_context)"
            )

    def check_request(self, request: GenerationRequest, sampling: SamplingParams) -> None:
        """Raise EngineError when `request` can never run here: a group larger than max_parallel_sequences, or a
        prompt + token limit over model.max_context."""
        if request.n > self.max_parallel:
            raise EngineError(f"group of {request.n} samples exceeds engine.max_parallel_sequences="
                              f"{self.max_parallel}")
        self._check_prompt(request.prompt_ids, request.token_limit(sampling.max_new_tokens))

    def _cells_for(self, cells_per_seq: int) -> int:
        """KV cells per sequence for a call needing `cells_per_seq`: a power of two from 256 up, at most max_context
        (a stream copy moves the whole stream, so streams are no larger than the calls need)."""
        return min(self.max_context, max(256, 1 << max(cells_per_seq - 1, 0).bit_length()))

    def _greedy_context(self, cells_per_seq: int) -> KVContext:
        """The greedy context (one KV stream per sequence), made again, larger, when a call needs more cells per
        sequence than it has (`_cells_for`)."""
        if self._greedy is None or self._greedy.cells_per_seq < cells_per_seq:
            if self._greedy is not None:
                self._greedy.close()
                self._greedy = None
            self._greedy = self._context(self.max_parallel, self._cells_for(cells_per_seq), unified=False)
        return self._greedy

    def _sampling_context(self, cells_per_seq: int) -> KVContext:
        """The sampling context, made again, larger, when a call needs more cells per sequence than it has (its kept
        caches go with it: a continuation is then prefilled from scratch). The size is remembered across weight
        syncs, so an episode's longer later turns grow it once per engine, not once per step. Raises EngineError
        (the current context kept) when llama.cpp cannot make the larger one."""
        if self._sampler.cells_per_seq < cells_per_seq:
            larger = self._context(self.max_parallel, self._cells_for(cells_per_seq), self.unified_kv)
            self._sampler.close()
            self._sampler = larger
        self._sampling_cells = max(self._sampling_cells, cells_per_seq)  # only once llama.cpp has made it
        return self._sampler

    # -- public API ------------------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int,
                 interrupt: Callable[[], bool] | None = None) -> list[Rollout]:
        """Sample `n` completions per request. Rollouts come back ordered by (request, sample index). Requests
        that do not fit in max_parallel_sequences at once join, in order, as soon as finished sequences free slots
        for their whole group (continuous batching, `stream`). `interrupt` is polled before every decode step;
        once it returns True, every unfinished sequence (and every request not started) comes back as it is, with
        finish_reason "interrupted". Raises EngineError for a group larger than max_parallel_sequences or a prompt
        that does not fit model.max_context."""
        for r in requests:
            self.check_request(r, sampling)
        requests = [replace(r) for r in requests]  # distinct objects: emit names a request by identity
        waiting = deque(requests)

        def pull(free_slots: int, cells: int) -> list[GenerationRequest]:
            taken = []
            while waiting and waiting[0].n <= free_slots:
                free_slots -= waiting[0].n
                taken.append(waiting.popleft())
            return taken

        done: dict[int, list[Rollout]] = {}
        need = max((r.kv_cells(sampling.max_new_tokens) for r in requests), default=0)
        self.stream(pull, lambda r, rollouts: done.__setitem__(id(r), rollouts), sampling, seed, interrupt, need)
        return [x for r in requests for x in done.get(id(r)) or self._unstarted(r)]

    def stream(self, pull: Callable[[int, int], list[GenerationRequest]],
               emit: Callable[[GenerationRequest, list[Rollout]], None], sampling: SamplingParams, seed: int,
               interrupt: Callable[[], bool] | None = None, cells_per_seq: int = 0) -> None:
        """Continuous batching: decode until no sequence is live and `pull` has nothing more. `pull(free_slots,
        cells)` is asked before the first and after every decode step for requests to start now: whole groups, at
        most `free_slots` samples in all, each needing at most `cells` KV cells per sequence (prompt + token limit;
        a larger one raises EngineError); they are prefilled in the next decode call beside the live sequences.
        `emit(request, rollouts)` is called once per request when all of its samples have finished, rollouts
        ordered by sample index. The first requests may continue cached sequences (kv_reuse); later ones are
        prefilled from scratch, in the slots finished sequences freed. The context holds at least `cells_per_seq`
        cells per sequence. `interrupt` as in `generate` (requests not yet pulled are left to the caller)."""
        self._require_open()
        rng = np.random.default_rng(seed)
        ctx = self._sampling_context(cells_per_seq)
        self._fit_threads(ctx)
        limit = lambda s: s.request.token_limit(sampling.max_new_tokens)  # noqa: E731
        live = self._new_seqs(pull(self.max_parallel, ctx.cells_per_seq), ctx.cells_per_seq, sampling)
        started, finished, emitted = list(live), [], set()
        if not live or (interrupt and interrupt()):
            self._emit(started, emitted, emit)
            return
        logits = ctx.prefill(live, self.kv_reuse)
        while live:
            ids, lps = sample_rows(logits, sampling, rng, self.logit_noise)
            for s, tok, lp in zip(live, ids.tolist(), lps.tolist()):
                s.ids.append(tok)
                s.logprobs.append(lp)
                if is_eog(self._vocab, tok) and not sampling.ignore_eos:
                    s.finish = "stop"
                elif len(s.ids) >= limit(s):
                    s.finish = "length"
            finished += [s for s in live if s.finish is not None]
            live = [s for s in live if s.finish is None]
            running = {id(s.request) for s in live}
            self._emit([s for s in started if id(s.request) not in running], emitted, emit)
            if interrupt and interrupt():
                break
            ctx.pack(live, finished)
            admitted = self._new_seqs(pull(self.max_parallel - len(live), ctx.cells_per_seq), ctx.cells_per_seq,
                                      sampling)
            if not live and not admitted:
                break
            logits = ctx.decode_step(live, admitted, finished)
            if live:
                self._decode_counts += decode_call(live, self.max_parallel)
            live += admitted
            started += admitted
        ctx.keep([s for s in started if s.seq_id >= 0])  # finished and interrupted: their caches stay
        self._emit(started, emitted, emit)

    def _new_seqs(self, requests: list[GenerationRequest], cells: int, sampling: SamplingParams) -> list[Seq]:
        for r in requests:
            if (need := r.kv_cells(sampling.max_new_tokens)) > cells:
                raise EngineError(f"group {r.group_id} needs {need} KV cells per sequence; the stream's context "
                                  f"holds {cells}")
        return [Seq(r, k, 0) for r in requests for k in range(r.n)]

    def _emit(self, seqs: list[Seq], emitted: set[int], emit) -> None:
        """Emit each request of `seqs` not emitted yet, with all its samples by sample index; a sample not finished
        comes back as it is, finish "interrupted"."""
        groups: dict[int, list[Seq]] = {}
        for s in seqs:
            if id(s.request) not in emitted:
                groups.setdefault(id(s.request), []).append(s)
        for key, group in groups.items():
            emitted.add(key)
            for s in group:
                s.finish = s.finish or "interrupted"
            emit(group[0].request, [self._to_rollout(s) for s in sorted(group, key=lambda s: s.sample_index)])

    def _unstarted(self, r: GenerationRequest) -> list[Rollout]:
        return [self._to_rollout(Seq(r, k, 0, finish="interrupted")) for k in range(r.n)]

    def take_decode_counts(self) -> DecodeCounts:
        """generate's decode calls after the prefill since the last take (engines/base.DecodeCounts), each call's
        DecodeStep and the model's DecodeShape with them (the rollout's roofline); then zero."""
        counts, self._decode_counts = self._decode_counts, DecodeCounts()
        return replace(counts, shape=self.decode_shape)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Argmax completions (stop token included when emitted), for evaluation: in the greedy context, one KV
        stream per sequence, with continuous batching (llama_context.greedy_continuous)."""
        self._require_open()
        for p in prompts:
            self._check_prompt(p, max_new_tokens)
        ctx = self._greedy_context(max((len(p) for p in prompts), default=0) + max_new_tokens)
        self._fit_threads(ctx)
        return greedy_continuous(ctx, [tuple(p) for p in prompts], max_new_tokens, self.is_stop_token, self.kv_reuse)

    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingParams) -> list[float]:
        """Teacher-forced engine log-probs [T] of `completion_ids` under the sampling transform (nats)."""
        self._require_open()
        if not completion_ids:
            return []
        ids = list(prompt_ids) + list(completion_ids)
        self._check_prompt(prompt_ids, len(completion_ids))
        self._sampling_context(len(ids))
        self._sampler.reset()
        n_prompt = len(prompt_ids)
        rows = self._decode([(t, i, 0, i >= n_prompt - 1 and i < len(ids) - 1) for i, t in enumerate(ids)])
        return [float(transformed_log_softmax(row, sampling)[tok]) for row, tok in zip(rows, completion_ids)]

    def is_stop_token(self, token: int) -> bool:
        return is_eog(self._vocab, token)

    def stop_token_ids(self) -> frozenset[int]:
        """Every id this engine ends a response on (llama_vocab_is_eog over its vocabulary)."""
        return eog_ids(self._vocab)

    def _to_rollout(self, s: Seq) -> Rollout:
        return Rollout(
            group_id=s.request.group_id, sample_index=s.sample_index, prompt_ids=list(s.request.prompt_ids),
            completion_ids=s.ids, rollout_logprobs=list(s.logprobs), versions=[self.version] * len(s.ids),
            finish_reason=s.finish, extras={"prefill_reused": s.reused} if s.reused else {},  # type: ignore[arg-type]
        )
