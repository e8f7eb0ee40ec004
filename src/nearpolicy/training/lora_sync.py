"""[lora] runs (docs/lora.md): the frozen base is the engine's own weights, only the adapter syncs, and every sync is
proven by the engine's scores of a fixed probe.

- `open_lora` (from training/assemble.build_session): for an engine that loads a GGUF, the policy is exported once
  at engine.precision as the engine's GGUF, its tensors dequantized back into the policy (so the trainer's frozen
  base equals the engine's weights bit for bit), then PEFT's adapter is attached (model/lora.py).
- `AdapterWeights`: what each sync hands engine.update_weights, an engines/base.LoraAdapter: the adapter written as a
  GGUF LoRA adapter file (engines/gguf/lora_adapter.py) for llama.cpp, as a PEFT folder for vLLM, the adapter's
  tensors for hf.
- `AdapterProof`: after each sync the engine scores a fixed probe (teacher forced, RolloutEngine.score at temperature
  1, no truncation) and the trainer's adapted policy scores it too (float32, no dropout). Two checks, both needed:
  agreement: the mean |engine - trainer| over the probe's tokens is at most the precision's tolerance tol (the
  engine computes the trainer's adapted policy up to its own arithmetic: a wrong tensor, q / k permutation, scale or
  base fails it); delivery, exact: the engine's scores are deterministic, so once the trainer's adapted policy has
  moved from its frozen base (from the previous proven version) by more than MOVED nats/token, the engine's scores
  must differ from its own base scores (measured before the first adapter) and from its scores at the previous proof.
  A withheld or zeroed adapter leaves the engine's scores bit for bit its base's, a stale one bit for bit the previous
  version's, whatever tol is. At version 0 (lora_B = 0: the adapted policy is the base exactly) only agreement applies:
  it proves the engine's base is the trainer's within tol. A failed proof raises AdapterProofError naming the
  adapter version; it is not a staleness report (training/guards.py never sees it).
- `ProvenRollouts`: the run's RolloutSource with the proof after every publish (and at start: the adapter of the
  start version is delivered and proven before the first rollout)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from nearpolicy.engines.base import LoraAdapter, RolloutEngine
from nearpolicy.engines.factory import kind_of
from nearpolicy.engines.gguf.lora_adapter import export_lora_gguf
from nearpolicy.model.lora import LoraPolicy, attach_lora, frozen_engine_base
from nearpolicy.rollouts.base import RolloutSource, StepSamples
from nearpolicy.tasks import Problem
from nearpolicy.types import SamplingParams

PROOF_TOLERANCE = {"f32": 5e-3, "fp32": 1e-4, "f16": 1e-2, "bf16": 0.1, "q8_0": 0.25, "q5_0": 0.25, "q4_0": 0.25,
                   "q4_1": 0.25, "mxfp4": 0.25}
"""Default agreement tolerance per engine precision (llama.cpp's GGUF types at an f16 KV cache, the hf and vllm
engines' fp32 / bf16): mean |engine - trainer| nats per probe token, about 3x the largest mean gap measured with the
trainer's base = the engine's (tiny test model and SmolLM2-135M, random adapters; docs/lora.md, "Tolerances"). A kind
whose arithmetic needs another figure at a precision says so in its EngineKind.lora_tolerances (vllm bf16)."""
MOVED = 1e-4
"""nats/token (mean over the probe): a trainer-side change this large must change the engine's scores (delivery)."""
PROBE_TEXT = " Let me add the numbers one at a time. The answer is 12."
PROBE_PROMPTS = 1
PROBE_CONTEXT = 16  # prompt tokens kept before PROBE_TEXT: the proof's cost is two forwards of the probe
_RAW = SamplingParams()  # temperature 1, no top-k / top-p: the policy's own log-probs


class AdapterProofError(RuntimeError):
    """The engine's scores after an adapter sync do not prove it holds the trainer's adapted policy (module
    docstring). `version`: the adapter version synced; `gap`, `engine_shift`, `shift`: mean |engine - trainer|,
    |engine - base|, |trainer - base| over the probe (nats/token); `tolerance`: the tolerance (nats/token)."""

    def __init__(self, version: int, gap: float, engine_shift: float, shift: float, tolerance: float, why: str):
        super().__init__(version, gap, engine_shift, shift, tolerance, why)
        self.version, self.gap, self.engine_shift, self.shift = version, gap, engine_shift, shift
        self.tolerance, self.why = tolerance, why

    def __str__(self) -> str:
        return (f"LoRA adapter version {self.version} is not proven on the engine: {self.why} (probe, nats/token: "
                f"mean |engine - trainer| {self.gap:.3g}, |engine - base| {self.engine_shift:.3g}, |trainer - base| "
                f"{self.shift:.3g}, tolerance {self.tolerance:.3g}; docs/lora.md). The run stops: rollouts from this "
                "engine would not be the trained policy's")


def proof_tolerance(configured: float | None, precisions: set[str], kind_tolerances: tuple = ()) -> float:
    """`configured` (lora.proof_tolerance), else the largest default among the engine's `precisions` (its precision
    and every per-tensor override): the kind's own figure (`kind_tolerances`, (precision, nats/token) pairs of
    EngineKind.lora_tolerances) where it has one, else PROOF_TOLERANCE's."""
    defaults = PROOF_TOLERANCE | dict(kind_tolerances)
    return configured if configured is not None else max(defaults[p] for p in precisions)


def open_lora(cfg, model: torch.nn.Module, tokenizer, template_gguf: Path | None, engine_dir: Path,
              log=print) -> LoraPolicy:
    """Make `model` (float32, model.path's weights) the frozen engine base and attach cfg.lora's adapter (seeded by
    run.seed). For an engine kind that loads a GGUF the model is written once as the engine's GGUF (engine.precision,
    tensor_precision, export_rounding; engines/gguf/export.export_model_gguf into `engine_dir`) and that file's
    dequantized tensors replace the model's (engines/gguf/dequantize.py): the engine starts on that file. Raises
    ValueError when the GGUF does not fit the model, or as model/lora.attach_lora."""
    e, gguf = cfg.engine, None
    if kind_of(e.kind).loads == "gguf":
        started = time.perf_counter()
        gguf = frozen_engine_base(model, engine_dir, e.precision, tuple(e.tensor_precision.items()), template_gguf,
                                  tokenizer, e.export_rounding, cfg.run.seed)
        log(f"LoRA: the frozen base is the engine's GGUF {gguf.name}, dequantized "
            f"({time.perf_counter() - started:.1f} s)")
    c = cfg.lora
    lora = attach_lora(model, c.rank, c.alpha, c.dropout, tuple(c.target_modules), cfg.run.seed, gguf)
    n = sum(p.numel() for p in lora.parameters())
    log(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: {n / 1e6:.2f}M trainable "
        f"parameters ({4 * n / 2**20:.1f} MiB float32)")
    return lora


def adapter_weights(cfg, session) -> "AdapterWeights":
    """The in-process engine's adapter writer of a training `session` (training/assemble.Session with .lora), made
    once and kept as session.engine_gguf: the adapter in the form the engine kind reads (EngineKind.lora_adapter),
    files in <engine_dir>."""
    if session.engine_gguf is None:
        session.engine_gguf = AdapterWeights(session.lora, kind_of(cfg.engine.kind).lora_adapter, session.engine_dir)
    return session.engine_gguf


def lora_rollouts(cfg, session, inner: RolloutSource, log=print) -> "ProvenRollouts":
    """`inner` with every adapter sync of `session` (training/assemble.Session with .lora) proven (ProvenRollouts)
    on the probe of the task's first PROBE_PROMPTS training prompts, at the engine precision's tolerance
    (lora.proof_tolerance overrides it)."""
    e, kind = cfg.engine, kind_of(cfg.engine.kind)
    precisions = {getattr(e, kind.config_precision), *e.tensor_precision.values()}
    tolerance = proof_tolerance(cfg.lora.proof_tolerance, precisions, kind.lora_tolerances)
    prompts = [session.prompt_ids(session.task.train_problem(i)) for i in range(PROBE_PROMPTS)]
    proof = AdapterProof(session.lora, probe_sequences(prompts, session.tokenizer), tolerance)
    return ProvenRollouts(inner, proof, adapter_weights(cfg, session), log)


ADAPTER_FORMS = ("gguf", "tensors", "peft_dir")  # the LoraAdapter field an engine reads (EngineKind.lora_adapter)


class AdapterWeights:
    """Each call: the trainer's current adapter as an engines/base.LoraAdapter in `form` (ADAPTER_FORMS): "gguf":
    written to `folder`/adapter.gguf (engines/gguf/lora_adapter.py; replaced atomically each sync); "peft_dir": PEFT's
    save_pretrained into a new folder `folder`/peft-adapter-N per sync (the one before it is kept, as an engine may
    still finish requests under it; older ones are deleted); "tensors": its tensors. `write_s`: the last write's
    seconds. Raises ValueError for another form."""

    def __init__(self, lora: LoraPolicy, form: str, folder: Path):
        if form not in ADAPTER_FORMS:
            raise ValueError(f"adapter form {form!r}: one of {', '.join(ADAPTER_FORMS)}")
        self.lora, self.form, self.folder, self.write_s = lora, form, Path(folder), 0.0
        self.path, self.syncs = self.folder / "adapter.gguf", 0

    def __call__(self) -> LoraAdapter:
        if self.form == "peft_dir":
            return LoraAdapter(peft_dir=str(self._write_peft()), scale=self.lora.scale)
        tensors = self.lora.adapter_tensors()
        if self.form == "tensors":
            return LoraAdapter(tensors=tensors, scale=self.lora.scale)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.write_s = export_lora_gguf(tensors, self.lora.model.config, self.path, self.lora.alpha)
        return LoraAdapter(gguf=str(self.path), scale=self.lora.scale)

    def _write_peft(self) -> Path:
        """The adapter as a PEFT folder of its own (adapter_config.json + adapter_model.safetensors, float32)."""
        started = time.perf_counter()
        if self.syncs == 0:  # a previous process's folders (a resumed run counts from 1 again)
            for stale in self.folder.glob("peft-adapter-*"):
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale)
                else:
                    stale.unlink()
        self.syncs += 1
        target = self.folder / f"peft-adapter-{self.syncs}"
        self.lora.peft_model.save_pretrained(str(target))
        shutil.rmtree(self.folder / f"peft-adapter-{self.syncs - 2}", ignore_errors=True)
        self.write_s = time.perf_counter() - started
        return target


@torch.no_grad()
def policy_logprobs(model: torch.nn.Module, probe: list[tuple[list[int], list[int]]]) -> np.ndarray:
    """The model's log-probs (nats, float64 log-softmax of float32 logits, temperature 1) of each probe completion's
    tokens after its prompt, concatenated: [sum of completion lengths]. One forward of the rows right-padded (a row's
    tokens never see its padding); eval mode (no dropout)."""
    rows = [p + c for p, c in probe]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        model.train(was_training)
    out = []
    for i, (prompt, completion) in enumerate(probe):
        lp = torch.log_softmax(logits[i, len(prompt) - 1:len(prompt) + len(completion) - 1].double(), dim=-1)
        out.append(lp.gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy())
    return np.concatenate(out)


def engine_logprobs(engine: RolloutEngine, probe: list[tuple[list[int], list[int]]]) -> np.ndarray:
    """The engine's teacher-forced log-probs of the probe (RolloutEngine.score, temperature 1), concatenated."""
    return np.concatenate([np.asarray(engine.score(p, c, _RAW), dtype=np.float64) for p, c in probe])


class AdapterProof:
    """The proof of each adapter sync (module docstring) for `lora` over `probe` ((prompt ids, completion ids) pairs)
    at `tolerance` nats/token. The trainer's base log-probs (adapter disabled) are computed once; the engine's base
    scores by `measure_engine_base` on the engine before any adapter reaches it."""

    def __init__(self, lora: LoraPolicy, probe: list[tuple[list[int], list[int]]], tolerance: float):
        self.lora, self.probe, self.tolerance = lora, probe, tolerance
        with lora.base_only():
            self.base = policy_logprobs(lora.model, probe)
        self.engine_base: np.ndarray | None = None
        self.previous: tuple[int, np.ndarray, np.ndarray] | None = None  # version, trainer's and engine's scores

    def measure_engine_base(self, engine: RolloutEngine) -> None:
        """Score the probe with `engine` while it holds the frozen base alone (before the first adapter sync)."""
        self.engine_base = engine_logprobs(engine, self.probe)

    def check(self, engine: RolloutEngine, version: int) -> dict[str, float]:
        """Prove that `engine` holds adapter `version`; returns lora/proof_gap (mean |engine - trainer|),
        proof_shift (mean |trainer - base|), proof_engine_shift (mean |engine - engine base|), all nats per probe
        token, and proof_s (seconds). Raises AdapterProofError naming the version and what the engine's scores look
        like: bit for bit its base's (withheld or zeroed), bit for bit the previous version's (stale), or too far from
        the trainer's (agreement)."""
        started = time.perf_counter()
        theirs, ours = engine_logprobs(engine, self.probe), policy_logprobs(self.lora.model, self.probe)
        engine_base = theirs if self.engine_base is None else self.engine_base
        gap, engine_shift, shift = (float(np.mean(np.abs(x - y))) for x, y in
                                    ((theirs, ours), (theirs, engine_base), (ours, self.base)))
        why = None
        if shift > MOVED and np.array_equal(theirs, engine_base):
            why = ("the engine scores bit for bit as its frozen base although the trainer's adapter moved the probe "
                   "(the adapter was withheld from the engine, or reached it zeroed)")
        elif (self.previous is not None and np.mean(np.abs(ours - self.previous[1])) > MOVED
              and np.array_equal(theirs, self.previous[2])):
            why = (f"the engine scores bit for bit as at adapter version {self.previous[0]} although the trainer's "
                   "adapter changed since (a stale adapter)")
        elif gap > self.tolerance:
            why = (f"the engine's log-probs are {gap:.3g} nats/token from the trainer's adapted policy, above the "
                   "tolerance (the adapter or base it computes with is not the trainer's)")
        if why is not None:
            raise AdapterProofError(version, gap, engine_shift, shift, self.tolerance, why)
        self.previous = (version, ours, theirs)
        return {"lora/proof_gap": gap, "lora/proof_shift": shift, "lora/proof_engine_shift": engine_shift,
                "lora/proof_s": time.perf_counter() - started}


def probe_sequences(prompt_ids: list[list[int]], tokenizer) -> list[tuple[list[int], list[int]]]:
    """The fixed probe: the last PROBE_CONTEXT tokens of each prompt (the task's first PROBE_PROMPTS training prompts:
    the question's end and the assistant turn's opening) followed by PROBE_TEXT's ids."""
    completion = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    return [(list(p)[-PROBE_CONTEXT:], completion) for p in prompt_ids]


class ProvenRollouts:
    """RolloutSource: `inner`, with the adapter sync proven after every publish (AdapterProof) and at start (the
    adapter of the start version delivered and proven before any rollout). step_metrics adds the last proof's
    lora/* metrics (the sync whose adapter sampled the step) and lora/sync_s, lora/adapter_write_s (seconds).
    Raises AdapterProofError from start and publish."""

    def __init__(self, inner: RolloutSource, proof: AdapterProof, weights: AdapterWeights, log=print):
        self.inner, self.proof, self.weights, self.log = inner, proof, weights, log
        self.last: dict[str, float] = {}

    def start(self, version: int, data_position: int, state: dict | None) -> None:
        self.proof.measure_engine_base(self.inner.eval_engine())  # a fresh engine: the frozen base alone
        self.inner.start(version, data_position, state)
        self.publish(version)
        self.log(f"LoRA: adapter version {version} proven on the engine (probe gap "
                 f"{self.last['lora/proof_gap']:.2g} nats/token, tolerance {self.proof.tolerance:g})")

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        return self.inner.collect(step, version, data_position)

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        return self.inner.step_metrics(old_logprobs, rollout_logprobs, defined, versions, version) | self.last

    def publish(self, version: int) -> None:
        started = time.perf_counter()
        self.inner.publish(version)
        synced = time.perf_counter() - started
        self.last = self.proof.check(self.inner.eval_engine(), version) | {
            "lora/sync_s": synced, "lora/adapter_write_s": self.weights.write_s}

    def eval_engine(self) -> RolloutEngine:
        return self.inner.eval_engine()

    def evaluate(self, engine: RolloutEngine, problems: list[Problem], score: Callable) -> tuple[list, list, dict]:
        return self.inner.evaluate(engine, problems, score)

    def state_dict(self) -> dict | None:
        return self.inner.state_dict()

    def close(self) -> None:
        self.inner.close()
