"""`nearpolicy gradbias`: sample replicate batches from each mismatch source and from the trainer's own policy at
one set of weights, store every correction's gradient sketch, then the Gram matrices and the table (table.py).

Folder OUT: warmup/ (the config's own training run of `warmup` steps whose final weights are measured; its start
is the stale source's weights), replicates/<source>_<n>.npz (one batch's sketches, token effects and facts; a
rerun with the same settings skips the ones already there), grams.npz and effects.json (all the table needs,
small enough to commit), gradbias.json, gradbias.html and gradbias.png."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from nearpolicy.config.schema import Config, load_config
from nearpolicy.gradbias.measure import SampledBatch, batch_gradients
from nearpolicy.gradbias.sketch import DEFAULT_DIM, GradientSketch
from nearpolicy.gradbias.sources import (DEFAULT_CORRECTIONS, DEFAULT_SOURCES, SourceSpec, correction_overrides,
                                         parse_source)
from nearpolicy.training.update import UpdateSettings

REFERENCE = "reference"


@dataclass(frozen=True)
class GradbiasSettings:
    """What a measurement runs: source and correction names (sources.py), replicate batches per source, warm-up
    training steps before the measured weights, sketch dimension (None: full gradient), output folder."""

    out: Path
    sources: tuple[str, ...] = DEFAULT_SOURCES
    corrections: tuple[str, ...] = DEFAULT_CORRECTIONS
    replicates: int = 24
    warmup: int = 4
    sketch_dim: int | None = DEFAULT_DIM
    progress: bool = True

    def __post_init__(self) -> None:
        if self.replicates < 3:
            raise ValueError(f"--replicates must be >= 3 (the jackknife leaves one out of at least two), got "
                             f"{self.replicates}")
        if self.sketch_dim is not None and self.sketch_dim < 1:
            raise ValueError(f"--sketch-dim must be >= 1 (0: the full gradient), got {self.sketch_dim}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.corrections or self.corrections[0] != "off":
            raise ValueError("the first correction must be 'off' (the token effects are measured against it)")
        if len(set(self.corrections)) != len(self.corrections) or len(set(self.sources)) != len(self.sources):
            raise ValueError("a source or correction is named twice")
        specs = [parse_source(s) for s in self.sources]
        if any(s.stale for s in specs) and self.warmup == 0:
            raise ValueError("the stale source needs --warmup >= 1 (its weights are the warm-up's start)")
        for name in self.corrections:
            correction_overrides(name)

    def identity(self) -> dict:
        """What must match for a rerun to reuse stored replicates."""
        return {"sources": list(self.sources), "corrections": list(self.corrections), "warmup": self.warmup,
                "sketch_dim": self.sketch_dim}


def arm_settings(config: Path | None, sets: list[str], corrections: tuple[str, ...]) -> dict[str, UpdateSettings]:
    """Each correction's UpdateSettings: the config with the correction's overrides on top. Raises ConfigError or
    ValueError (coefficients.unsupported)."""
    from nearpolicy.gradbias.coefficients import unsupported
    from nearpolicy.training.trainer import update_settings

    arms = {}
    own_proximal = any(s.split("=")[0].strip() == "correction.proximal" for s in sets)
    for name in corrections:
        overrides = [o for o in correction_overrides(name) if not (own_proximal and o == "correction.proximal=old")]
        settings = update_settings(load_config(config, [*sets, *overrides]))
        why = unsupported(settings)
        if why is not None:
            raise ValueError(f"correction {name!r}: gradbias cannot measure {why}")
        arms[name] = settings
    return arms


def _check_config(cfg: Config) -> None:
    if cfg.episode.enabled:
        raise ValueError("gradbias measures single-turn batches; episode.enabled = true is not supported")
    if cfg.algorithm.precision_alignment != "off":
        raise ValueError("gradbias measures the fp32 trainer; set algorithm.precision_alignment = 'off'")
    if cfg.algorithm.trainer_precision != "fp32":
        raise ValueError("gradbias measures the fp32 trainer's gradients; set algorithm.trainer_precision = 'fp32'")


def _warm_session(cfg: Config, warm: Config, settings: GradbiasSettings, log):
    """(session at the measured weights, the warm-up's starting state dict or None, the trainer's version, the
    warm-up's last eval or None)."""
    from nearpolicy.model.load import load_model_weights
    from nearpolicy.runs.export import ExportError, find_checkpoint
    from nearpolicy.signals import StopRequested
    from nearpolicy.training.assemble import build_session
    from nearpolicy.training.trainer import open_trainer

    k = settings.warmup
    if k == 0:
        return build_session(cfg, settings.out / "session", log), None, 0, None
    run_dir = settings.out / "warmup"
    try:
        step, checkpoint = find_checkpoint(run_dir, k)
    except ExportError:
        checkpoint = None
    if checkpoint is not None:  # measured before: the same weights again
        session = build_session(warm, run_dir, log)
        start = {n: t.detach().clone() for n, t in session.model.state_dict().items()}
        load_model_weights(checkpoint, session.model)
        log(f"measured weights: {checkpoint} (the warm-up's step {step})")
        return session, start, k, _last_accuracy(run_dir)
    log(f"warm-up: {k} training steps of the config before the weights are measured ({run_dir})")
    trainer = open_trainer(warm, resume=run_dir.exists(), log=log)
    start = {n: t.detach().clone() for n, t in trainer.s.model.state_dict().items()}
    try:  # the config's own run (its learning-rate schedule included), stopped after step k with a checkpoint
        trainer.fit(_StopAfter(trainer, k), progress=settings.progress)
    except StopRequested:
        pass
    finally:
        trainer.close()
    return trainer.s, start, trainer.state.version, _last_accuracy(run_dir)


class _StopAfter:
    """A Trainer.fit `stop` that asks for a stop once the trainer has completed `steps` steps."""

    def __init__(self, trainer, steps: int):
        self.trainer, self.steps = trainer, steps

    @property
    def signum(self) -> int | None:
        return signal.SIGINT if self.trainer.state.step >= self.steps else None


def _last_accuracy(run_dir: Path) -> dict | None:
    """The warm-up's last eval: {"step", "accuracy"}, or None."""
    from nearpolicy.runs.folder import read_metrics

    rows = [r for r in read_metrics(run_dir).rows if r.get("eval/accuracy") is not None]
    return {"step": rows[-1]["step"], "accuracy": float(rows[-1]["eval/accuracy"])} if rows else None


def _open_engine(spec: SourceSpec, cfg: Config, session, version: int, start: dict | None, folder: Path):
    """The source's engine on the measured weights, or for the stale source on the warm-up's starting weights
    `start` at version 0 (exported to GGUF for kinds that load one)."""
    import copy

    from nearpolicy.engines.factory import EngineInputs, build_engine, kind_of
    from nearpolicy.training.assemble import engine_request

    kind = kind_of(spec.kind)
    model = session.model
    if spec.stale:
        model = copy.deepcopy(session.model)
        model.load_state_dict(start)
    request = replace(engine_request(cfg), kind=spec.kind, precision=spec.precision, tensor_precision=(),
                      logit_noise=spec.logit_noise, version=0 if spec.stale else version)
    gguf = None
    if kind.loads == "gguf":
        from nearpolicy.engines.gguf.export import export_model_gguf

        gguf = export_model_gguf(model, folder / spec.name, spec.precision, (), session.template_gguf,
                                 session.tokenizer, cfg.engine.export_rounding, cfg.run.seed)
    return build_engine(request, EngineInputs(gguf, model, stop_ids=session.stop_ids, workdir=folder / spec.name,
                                              probe_prompt=session.prompt_ids(session.task.train_problem(0))))


def _sample(engine, session, cfg: Config, scorer, n: int, seed: int, base: int, sampling, log=print) -> SampledBatch:
    """Replicate n's batch from `engine`: the groups of training problems base + n P + j (j < P), sampled with
    `seed`, scored and turned into advantages as a training step does."""
    from nearpolicy.batching import collate
    from nearpolicy.training.phases import score_texts
    from nearpolicy.training.trainer import step_advantages
    from nearpolicy.types import GenerationRequest

    a = cfg.algorithm
    problems = {base + n * a.prompts_per_step + j: session.task.train_problem(base + n * a.prompts_per_step + j)
                for j in range(a.prompts_per_step)}
    requests = [GenerationRequest(gid, tuple(session.prompt_ids(p)), a.group_size) for gid, p in problems.items()]
    rollouts = engine.generate(requests, sampling, seed)
    results = score_texts(scorer, session.tokenizer, [r.response_ids() for r in rollouts],
                          [problems[r.group_id] for r in rollouts], f"gradbias replicate {n}", log)
    for r, result in zip(rollouts, results):
        r.reward = result.reward
    batch = collate(rollouts, session.pad_id, session.vocab_size, cfg.algorithm.shared_prompt)
    _, adv, advantages, _ = step_advantages(cfg, session, rollouts, batch, sampling, problems)
    return SampledBatch(rollouts, batch, advantages, adv.keep)


def replicate_seed(run_seed: int, source_is_reference: bool, n: int) -> int:
    """The sampling seed of replicate n: every source shares one stream, the reference has its own."""
    return int(np.random.SeedSequence([run_seed, 1 if source_is_reference else 2, n]).generate_state(1)[0])


def _check_folder(out: Path, identity: dict) -> None:
    meta = out / "settings.json"
    if meta.exists():
        stored = json.loads(meta.read_text())
        if stored != identity:
            raise ValueError(f"{out} holds a measurement with other settings ({stored}); choose another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        from nearpolicy.runs.folder import write_json

        write_json(meta, identity)


def run_gradbias(config: Path | None, sets: list[str], settings: GradbiasSettings, log=print) -> dict:
    """Measure (module docstring) and return the table (table.analyze). Raises ConfigError / ValueError for bad
    settings before anything loads, EngineError when an engine does not start."""
    from tqdm import tqdm

    from nearpolicy.gradbias.table import analyze, write_outputs
    from nearpolicy.tasks.scoring import BoundedScorer
    from nearpolicy.training.assemble import sampling_params
    from nearpolicy.training.trainer import kl_reference

    cfg = load_config(config, sets)
    _check_config(cfg)
    arms = arm_settings(config, sets, settings.corrections)
    specs = [parse_source(s) for s in settings.sources]
    import hashlib

    measured = cfg.model_dump(mode="json")
    measured["run"].pop("output_dir", None)
    _check_folder(settings.out, settings.identity() | {"config_sha256": hashlib.sha256(
        json.dumps(measured, sort_keys=True, default=str).encode()).hexdigest()})
    k = settings.warmup
    warm = load_config(config, [*sets, f"run.output_dir={settings.out}", "run.name=warmup"])
    session, start, version, accuracy = _warm_session(cfg, warm, settings, log)
    sampling = sampling_params(cfg)
    model = session.model.train()
    sketch = GradientSketch([p for p in model.parameters() if p.requires_grad], settings.sketch_dim, cfg.run.seed)
    folder = settings.out / "replicates"
    folder.mkdir(exist_ok=True)
    engines: dict[str, object] = {}
    scorer = BoundedScorer(session.task, cfg.task.reward_timeout_s)
    base = settings.warmup * cfg.algorithm.prompts_per_step  # the data after the warm-up's
    jobs = [(n, name) for n in range(settings.replicates) for name in (REFERENCE, *settings.sources)]
    bar = tqdm(jobs, desc="gradbias", disable=not settings.progress, dynamic_ncols=True)
    try:
        for n, name in bar:
            path = folder / f"{name}_{n:03d}.npz"
            if path.exists():
                continue
            bar.set_postfix(source=name, replicate=n)
            spec = parse_source("f32") if name == REFERENCE else parse_source(name)
            key = "f32" if name == REFERENCE else name
            if key not in engines:
                engines[key] = _open_engine(spec, cfg, session, version, start, settings.out / "engine")
            t0 = time.perf_counter()
            sampled = _sample(engines[key], session, cfg, scorer, n, replicate_seed(cfg.run.seed, name == REFERENCE, n),
                              base, sampling, log)
            t1 = time.perf_counter()
            own = {"off": arms["off"]} if name == REFERENCE else arms
            result = batch_gradients(model, sketch, sampled, sampling, own, version, cfg.algorithm.micro_batch_size,
                                     kl_reference(cfg, session))
            facts = result.facts | {"sample_s": t1 - t0, "gradient_s": time.perf_counter() - t1}
            _save_replicate(path, result, facts)
    finally:
        bar.close()
        scorer.close()
        for engine in engines.values():
            engine.close()
    meta = {"config": str(config) if config else None, "set": list(sets), **settings.identity(),
            "replicates": settings.replicates, "trainer_version": version, "warmup_last_eval": accuracy,
            "parameters": sketch.parameters, "sketch_distortion": sketch.distortion,
            "sources": {s.name: s.label for s in specs}, "batch": {"prompts": cfg.algorithm.prompts_per_step,
                                                                  "group_size": cfg.algorithm.group_size},
            "loss": cfg.algorithm.loss, "aggregation": cfg.algorithm.aggregation,
            "advantage": cfg.algorithm.advantage}
    collect_grams(folder, settings, meta, settings.out)
    table = analyze(settings.out)
    write_outputs(table, settings.out)
    return table


def _save_replicate(path: Path, result, facts: dict) -> None:
    from nearpolicy.files import atomic_path

    names = list(result.sketches)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, sketches=np.stack([result.sketches[k] for k in names]).astype(np.float32),
                     names=np.array(names), effects=np.array([result.effects[k] for k in names], float),
                     facts=json.dumps(facts))


def complete_replicates(folder: Path, settings: GradbiasSettings) -> int:
    """How many leading replicates (0, 1, ...) are stored for the reference and every source."""
    n = 0
    while n < settings.replicates and all((folder / f"{s}_{n:03d}.npz").exists()
                                          for s in (REFERENCE, *settings.sources)):
        n += 1
    return n


def collect_grams(folder: Path, settings: GradbiasSettings, meta: dict, out: Path) -> None:
    """grams.npz: per source, the Gram matrix [(1 + A) N, (1 + A) N] float64 of the reference's N sketches and its
    A corrections' (block order: reference, then corrections in settings order; within a block, replicate n);
    effects.json: per source, per-replicate facts and per-correction (changed fraction, ESS), and `meta`."""
    from nearpolicy.files import atomic_path, write_atomically

    n = complete_replicates(folder, settings)
    if n < 2:
        raise ValueError(f"{folder} holds fewer than 2 replicates measured for every source")
    meta = meta | {"replicates": n}
    ref = [np.load(folder / f"{REFERENCE}_{i:03d}.npz") for i in range(n)]
    x = np.stack([r["sketches"][0] for r in ref]).astype(np.float64)
    grams, effects = {}, {"meta": meta, "reference": [json.loads(str(r["facts"])) for r in ref], "sources": {}}
    for source in settings.sources:
        reps = [np.load(folder / f"{source}_{i:03d}.npz") for i in range(n)]
        blocks = [x] + [np.stack([r["sketches"][a] for r in reps]).astype(np.float64)
                        for a in range(len(settings.corrections))]
        stacked = np.concatenate(blocks)
        grams[source] = stacked @ stacked.T
        effects["sources"][source] = {
            "facts": [json.loads(str(r["facts"])) for r in reps],
            "effects": {c: [list(map(float, r["effects"][a])) for r in reps] for a, c in enumerate(settings.corrections)}}
    with atomic_path(out / "grams.npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, corrections=np.array(settings.corrections), replicates=n, **grams)
    write_atomically(out / "effects.json", json.dumps(effects, indent=1).replace("NaN", "null"))
