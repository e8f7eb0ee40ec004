"""Assembles what a run needs from the config, one function each: the task, the sampling parameters, the policy
session (policy, tokenizer, optimizer, reference, teacher), the in-process engine, the weights the engines load,
and the rollout source (rollouts/: inline or replicas). `assemble` builds them all for the Trainer."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nearpolicy.training.allocator import reuse_freed_memory
from nearpolicy.config.schema import Config
from nearpolicy.engines.factory import EngineInputs, EngineRequest, kind_of, llamacpp_spec
from nearpolicy.engines.factory import build_engine as build_engine_of
from nearpolicy.training.guards import check_task_prompts
from nearpolicy.model.load import chat_prompt_ids, pad_token_id, stop_token_ids
from nearpolicy.model.lora import LoraPolicy
from nearpolicy.ops.correction_presets import describe_correction
from nearpolicy.rollouts.base import RolloutSource
from nearpolicy.rollouts.mixture import adaptive_mixture, dataset_pools
from nearpolicy.tasks import Problem, Task, make_task
from nearpolicy.tasks.factory import describe_task
from nearpolicy.training.distillation import GradientProbe, UpdateDistill
from nearpolicy.training.lora_sync import adapter_weights, lora_rollouts, open_lora
from nearpolicy.training.xrpo import xrpo_rollouts
from nearpolicy.types import SamplingParams


@dataclass
class Session:
    """The trainer's side of a run: policy, tokenizer, task, optimizer, frozen reference / teacher, the engine
    folder and the run plan. The engines live in the rollout source."""

    cfg: Config
    model: torch.nn.Module
    tokenizer: object
    task: Task
    optimizer: torch.optim.Optimizer
    template_gguf: Path | None
    engine_dir: Path
    stop_ids: set[int]
    plan: dict = field(default_factory=dict)
    ref_model: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None
    engine_gguf: Callable[[], object] | None = None  # the in-process engine's GGUF or [lora] adapter (engine_weights)
    distill: UpdateDistill | None = None  # what the update adds for [distill] (update_distill)
    lora: LoraPolicy | None = None  # [lora]: the adapter on the engine's frozen base (training/lora_sync.py)

    @property
    def checkpointed(self) -> torch.nn.Module:
        """What a checkpoint saves and a resume restores: the policy, or under [lora] the adapter alone."""
        return self.model if self.lora is None else self.lora.checkpoint_view()

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def prompt_ids(self, problem: Problem) -> list[int]:
        """Chat-templated prompt ids (template applied once, generation prompt appended)."""
        task = self.cfg.task
        return chat_prompt_ids(self.tokenizer, task.system_prompt, problem.question, task.example)

    def episode_prompt_ids(self, problem: Problem) -> list[int]:
        """An episode's first prompt: episode.system_prompt, the worked episode.example, the question."""
        e = self.cfg.episode
        return chat_prompt_ids(self.tokenizer, e.system_prompt, problem.question, e.example)


def build_task(cfg: Config) -> Task:
    """The task of cfg.task (seeded by run.seed). Raises what tasks.make_task raises."""
    t = cfg.task
    return make_task(t.kind, name=t.name, options=t.resolved_options(), path=t.path, train_size=t.train_size,
                     eval_size=t.eval_size, seed=cfg.run.seed, eval_seed=t.eval_seed, skip_bad_lines=t.skip_bad_lines,
                     reward_function=t.reward_function)


def sampling_params(cfg: Config) -> SamplingParams:
    """The sampling transform of cfg.sampling (engines sample with it; the trainer's log-probs use it)."""
    s = cfg.sampling
    return SamplingParams(s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.ignore_eos)


def build_session(cfg: Config, run_dir: Path, log) -> Session:
    """Load the policy (float32), its optimizer, reference and teacher, and build the task. The task and the
    teacher's path are checked before the policy loads (tens of seconds), so a typo fails fast."""
    from nearpolicy.model.load import load_policy
    from nearpolicy.model.templates import use_chat_template

    torch.set_num_threads(cfg.run.threads)
    reuse_freed_memory(cfg.run.reuse_freed_memory)
    resolved, task = checked_before_loading(cfg)
    log(describe_task(task))
    log(f"loading the policy {resolved.path} ({resolved.kind}) in float32...")
    model, tokenizer = load_policy(cfg.model.path)
    use_chat_template(tokenizer, cfg.model.chat_template)
    model.float()
    a = cfg.algorithm
    if a.precision_alignment == "engine":
        from nearpolicy.model.aligned import align_model

        e = cfg.engine
        aligned = align_model(model, e.precision, tuple(e.tensor_precision.items()), e.kv_cache,
                              rounding=e.export_rounding, seed=cfg.run.seed)
        log(f"precision alignment: the trainer's forward emulates the {engine_request(cfg).label} engine "
            f"({sum(p != 'f32' for p in aligned.precisions.values())} quantized modules, {e.kv_cache} KV cache)")
    template = resolved.path if resolved.kind == "gguf" else None
    engine_dir = run_dir / "engine"
    lora = None if not cfg.lora.enabled else open_lora(cfg, model, tokenizer, template, engine_dir, log)
    # fused AdamW: one vectorized pass over the parameters (0.1 s vs 0.8 s per step for 135M on 2 cores). It leaves
    # their version counters alone, which the aligned trainer's weight cache keys on: that one keeps torch's loop.
    optimizer = torch.optim.AdamW(model.parameters() if lora is None else lora.parameters(),
                                  lr=a.lr if lora is None else cfg.lora.lr, betas=a.adam_betas,
                                  weight_decay=a.weight_decay, fused=a.precision_alignment != "engine")
    stop_ids = stop_token_ids(model, tokenizer, template, engine_dir)
    ref_model = None
    if a.kl_coef > 0 or a.turn_credit == "trace":  # the reference policy: the model.path weights, frozen
        log("loading the reference policy (algorithm.kl_coef > 0 or turn_credit = 'trace')...")
        ref_model = load_policy(cfg.model.path)[0].float().eval().requires_grad_(False)
    teacher = _load_teacher(cfg, tokenizer, log)
    plan = _plan(cfg, resolved, model, task, stop_ids)
    log(f"correction: {plan['correction_effective']}")
    log(f"nearpolicy: {plan['engine']} engine, {plan['parameters'] / 1e6:.0f}M parameters, trainer in "
        f"{a.trainer_precision}, {plan['samples_per_step']} samples/step, run folder {run_dir}, pid {os.getpid()}")
    session = Session(cfg, model, tokenizer, task, optimizer, template, engine_dir, stop_ids, plan, ref_model, teacher,
                      distill=update_distill(cfg, optimizer, teacher), lora=lora)
    # every prompt must fit the context before any engine starts (its startup probe would fail less clearly)
    check_task_prompts(task, session.prompt_ids, cfg.model.max_context, cfg.sampling.max_new_tokens)
    if cfg.episode.enabled:  # an episode's prompt + its whole budget must fit too
        check_task_prompts(task, session.episode_prompt_ids, cfg.model.max_context, cfg.episode.max_tokens)
    return session


def update_distill(cfg: Config, optimizer: torch.optim.Optimizer,
                   teacher: torch.nn.Module | None) -> UpdateDistill | None:
    """What the update adds for [distill] (training/distillation.py): the teacher for the forward KL (divergence =
    "forward") and R-OPD's gradient probe on the parameters the optimizer trains (ropd; the adapter's under [lora]);
    None when neither is on."""
    d = cfg.distill
    forward = teacher if d.divergence == "forward" else None
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    probe = GradientProbe(trained, d.ropd_sketch, cfg.run.seed) if d.ropd else None
    return None if forward is None and probe is None else UpdateDistill(forward, d.coef, d.forward_top_k, probe)


def _load_teacher(cfg: Config, tokenizer, log=print) -> torch.nn.Module | None:
    if cfg.distill.teacher is None:
        return None
    from nearpolicy.model.identity import teacher_error
    from nearpolicy.model.load import load_policy

    log(f"loading the teacher {cfg.distill.teacher}...")
    try:
        teacher, teacher_tokenizer = load_policy(cfg.distill.teacher, "distill.teacher")
    except (FileNotFoundError, ValueError) as err:
        raise teacher_error(str(err)) from None
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"distill.teacher {cfg.distill.teacher!r} has a different tokenizer from the policy")
    return teacher.float().eval().requires_grad_(False)


def _plan(cfg: Config, resolved, model, task: Task, stop_ids: set[int]) -> dict:
    return run_plan(cfg, resolved, task) | {"parameters": sum(p.numel() for p in model.parameters()),
                                            "stop_token_ids": sorted(stop_ids)}


def run_plan(cfg: Config, resolved, task: Task) -> dict:
    """The run plan's values that need no model (`nearpolicy train --dry-run` prints them); the run's plan.json adds
    the parameter count and the stop-token ids."""
    a = cfg.algorithm
    return {
        "model_file": str(resolved.path), "model_kind": resolved.kind,
        "engine": engine_request(cfg).label,
        "eval_policy": "trainer:fp32" if cfg.logging.eval_policy == "trainer" else "rollout engine",
        "samples_per_step": a.group_size * a.prompts_per_step,
        "samples_per_minibatch": a.group_size * a.prompts_per_step // a.minibatches,
        "total_samples": a.group_size * a.prompts_per_step * cfg.run.steps,
        "eval_problems": len(task.eval_problems()),
        "correction": repr(cfg.correction.spec()),
        "correction_effective": describe_correction(cfg.correction.preset, cfg.correction.spec()),
    } | ({"episodes": _describe_episodes(cfg)} if cfg.episode.enabled else {})


def _describe_episodes(cfg: Config) -> str:
    e = cfg.episode
    server = " ".join(e.server) or "python -m nearpolicy.tools.server"
    return (f"up to {e.max_turns} turns, {e.max_tokens} tokens ({e.turn_tokens} a turn), tools from `{server}`, "
            f"{len(e.example)} example message(s)")


def dry_plan(cfg: Config) -> dict:
    """run_plan without loading a model (seconds). Raises what checked_before_loading raises."""
    return run_plan(cfg, *checked_before_loading(cfg))


def checked_before_loading(cfg: Config):
    """(resolved model.path, task), checked before any model loads: the configured pieces run the architecture, the
    task builds (an adaptive mixture finds each dataset's training problems), distill.teacher has the policy's
    vocabulary size. Raises FileNotFoundError / ValueError naming the key."""
    from nearpolicy.model.identity import check_support, check_teacher, model_facts
    from nearpolicy.model.load import resolve_model

    resolved = resolve_model(cfg.model.path)
    check_support(model_facts(resolved), cfg)  # an architecture a configured piece cannot run
    task = build_task(cfg)
    if cfg.task.mixture == "adaptive":
        dataset_pools(task, cfg.task.resolved_options())
    if cfg.distill.teacher is not None:
        check_teacher(model_facts(resolved), cfg.distill.teacher)
    return resolved, task


def engine_request(cfg: Config, threads: int | None = None) -> EngineRequest:
    """The engine of cfg.engine as the factory's plain fields (run.threads unless `threads`; [lora]'s rank)."""
    threads, rank = cfg.run.threads if threads is None else threads, cfg.lora.rank if cfg.lora.enabled else 0
    return cfg.engine.request(max_context=cfg.model.max_context, seed=cfg.run.seed, threads=threads, lora_rank=rank)


def gguf_writer(cfg: Config, session: Session) -> Callable[[Path], Path]:
    """folder -> the path of the trainer's current weights written there as the engine's GGUF (engine.precision
    with engine.tensor_precision; engines/gguf/export.export_model_gguf)."""
    from nearpolicy.engines.gguf.export import export_model_gguf

    e = cfg.engine
    return lambda folder: export_model_gguf(session.model, folder, e.precision, tuple(e.tensor_precision.items()),
                                            session.template_gguf, session.tokenizer, e.export_rounding, cfg.run.seed)


def engine_weights(cfg: Config, session: Session, log=print) -> Callable[[], object]:
    """What the in-process engine loads on a weight sync: its GGUF, written whole the first time and rewritten in
    place after that (llamacpp: one engines/gguf/inplace.EngineGGUF per session), or the state dict (hf; vllm, whose
    engine writes it as an HF folder and reloads it in place)."""
    if session.lora is not None:  # only the adapter syncs
        return adapter_weights(cfg, session)
    if kind_of(cfg.engine.kind).loads == "state_dict":
        return lambda: session.model.state_dict()
    if session.engine_gguf is None:
        from nearpolicy.engines.gguf.inplace import EngineGGUF

        e = cfg.engine
        session.engine_gguf = EngineGGUF(session.model, session.engine_dir, e.precision,
                                         tuple(e.tensor_precision.items()), session.template_gguf, session.tokenizer,
                                         e.export_rounding, cfg.run.seed, log=log)
    return session.engine_gguf


def build_engine(cfg: Config, session: Session, log=print):
    """The in-process engine on the trainer's current weights (engines/factory.py). Kinds that load a GGUF get
    the trainer's weights exported first; engines in their own process are probed before they are handed back.
    Raises EngineError for vllm when .venv-vllm is missing (naming `make vllm-env`)."""
    request = engine_request(cfg)
    gguf = None
    if kind_of(request.kind).loads == "gguf":
        log(f"exporting the policy to GGUF ({request.precision_label}) and starting the {request.kind} engine "
            "process...")
        # the first call writes the whole file; [lora]: the frozen base's file, written once (training/lora_sync.py)
        gguf = engine_weights(cfg, session, log)() if session.lora is None else session.lora.base_gguf
    else:
        log(f"starting the {request.label} engine...")
    model = session.model if session.lora is None else session.lora.plain_model(merged=False)  # [lora]: the base
    inputs = EngineInputs(gguf, model, stop_ids=session.stop_ids, workdir=session.engine_dir,
                          probe_prompt=session.prompt_ids(session.task.train_problem(0)))
    return build_engine_of(request, inputs)


def policy_engine(session: Session):
    """An hf engine on a copy of the trainer's current fp32 policy (the eval of logging.eval_policy = "trainer")."""
    request = EngineRequest("hf", "fp32", max_parallel_sequences=session.cfg.engine.max_parallel_sequences)
    model = session.model if session.lora is None else session.lora.plain_model(merged=True)  # [lora]: merged
    return build_engine_of(request, EngineInputs(model=model, stop_ids=session.stop_ids))


def build_rollouts(cfg: Config, session: Session, engine, log=print) -> RolloutSource:
    """The rollout source over `engine` (the in-process engine): inline with rollout.engines = 0, else engine
    replicas (local processes or Ray actors) that the source starts in its `start`."""
    sampling = sampling_params(cfg)
    if cfg.episode.enabled:
        return build_episodes(cfg, session, engine, sampling, log)
    if not cfg.rollout.engines:
        from nearpolicy.rollouts.inline import InlineRollouts

        a = cfg.algorithm
        source = InlineRollouts(engine, engine_weights(cfg, session, log), session.task, session.prompt_ids, sampling,
                                a.group_size, a.prompts_per_step, cfg.run.seed)
        if (t := cfg.task).mixture == "adaptive":  # the mixture draws each step's problems (rollouts/mixture.py)
            source = adaptive_mixture(source, t.resolved_options(), t.mixture_decay, t.mixture_floor, cfg.run.seed)
        source = ropd_switch(cfg, session, source, log) if cfg.distill.ropd else source
        return group_replay(cfg, session, source, log) if cfg.popo.enabled else xrpo_rollouts(cfg, session, source, log)
    from nearpolicy.rollouts.replicas import ReplicaRollouts

    return ReplicaRollouts(replica_settings(cfg), engine, gguf_writer(cfg, session), session.engine_dir / "published",
                           _replica_spec(cfg), session.task, session.prompt_ids, sampling, log)


def group_replay(cfg: Config, session: Session, inner: RolloutSource, log=print) -> RolloutSource:
    """POPO's group replay over `inner` (rollouts/replay.GroupReplay). It scores the fresh groups with a bounded scorer
    of its own (the task's reward, task.reward_timeout_s; the trainer scores the step's groups again with its own)."""
    from nearpolicy.rollouts.replay import GroupReplay, ReplaySettings
    from nearpolicy.tasks.scoring import BoundedScorer
    from nearpolicy.training.phases import score_texts

    scorer, p = BoundedScorer(session.task, cfg.task.reward_timeout_s), cfg.popo

    def score(rollouts, problems) -> list[float]:
        return [result.reward for result in score_texts(scorer, session.tokenizer, [r.response_ids() for r in rollouts],
                                                        [problems[r.group_id] for r in rollouts], "POPO", log)]

    return GroupReplay(inner, score, session.task.train_problem,
                       ReplaySettings(p.buffer_groups, p.max_age, p.recency_decay), scorer.close)


def ropd_switch(cfg: Config, session: Session, inner: RolloutSource, log=print) -> RolloutSource:
    """R-OPD's curriculum over `inner` (rollouts/curriculum.InitialPolicySwitch): the trigger reads the update's
    gradient probe (Session.distill.probe); once it fires, samples come from initial_policy_rollouts."""
    from nearpolicy.rollouts.curriculum import InitialPolicySwitch

    d = cfg.distill
    return InitialPolicySwitch(inner, session.distill.probe.take, lambda: initial_policy_rollouts(cfg, session, log),
                               d.ropd_z, d.ropd_patience, log)


def initial_policy_rollouts(cfg: Config, session: Session, log=print) -> RolloutSource:
    """R-OPD's initial-policy samples: synchronous rollouts from a second in-process engine on the initial policy
    (model.path, loaded and exported at engine.precision as the step-0 engine was), never synced; the step's problems
    and seeds as the inline source's (engine files under <run>/engine/initial)."""
    from nearpolicy.model.load import load_policy
    from nearpolicy.rollouts.inline import InlineRollouts

    log("R-OPD: starting a second engine on the initial policy (model.path)...")
    initial = load_policy(cfg.model.path)[0].float().eval().requires_grad_(False)
    request, folder, e, a = engine_request(cfg), session.engine_dir / "initial", cfg.engine, cfg.algorithm
    folder.mkdir(parents=True, exist_ok=True)
    gguf = None
    if kind_of(request.kind).loads == "gguf":
        from nearpolicy.engines.gguf.export import export_model_gguf

        gguf = export_model_gguf(initial, folder, e.precision, tuple(e.tensor_precision.items()), session.template_gguf,
                                 session.tokenizer, e.export_rounding, cfg.run.seed)
    engine = build_engine_of(request, EngineInputs(gguf, initial, stop_ids=session.stop_ids, workdir=folder,
                                                   probe_prompt=session.prompt_ids(session.task.train_problem(0))))

    def never_synced():
        raise RuntimeError("R-OPD's initial-policy engine keeps the step-0 weights: it is never synced")

    return InlineRollouts(engine, never_synced, session.task, session.prompt_ids, sampling_params(cfg), a.group_size,
                          a.prompts_per_step, cfg.run.seed)


def replica_settings(cfg: Config):
    """The replica sources' settings (rollouts/replicas.ReplicaSettings) from [rollout], [algorithm], run.seed and
    engine.max_parallel_sequences."""
    from nearpolicy.rollouts.replicas import ReplicaSettings

    r, a = cfg.rollout, cfg.algorithm
    return ReplicaSettings(r.engines, r.backend, r.ray_address, r.staleness, r.partial, r.overprovision, r.resync_ess,
                           a.group_size, a.prompts_per_step, cfg.run.seed, cfg.engine.max_parallel_sequences)


def _replica_spec(cfg: Config) -> Callable:
    """(GGUF path, version) -> the EngineSpec of an engine replica (rollout.engine_threads threads)."""
    request = engine_request(cfg, threads=cfg.rollout.engine_threads)
    return lambda path, version: llamacpp_spec(request, path, version)


def build_episodes(cfg: Config, session: Session, engine, sampling: SamplingParams, log=print):
    """The episode source over `engine`: rollouts/episodes.py (synchronous) with rollout.engines = 0, else
    rollouts/episode_replicas.py (each replica runs its episodes with its own tools). Tools: episode.server (empty:
    nearpolicy's own MCP server); the chat template's tool framing, rendered once."""
    from nearpolicy.rollouts.episodes import EpisodeLimits, EpisodeRollouts, EpisodeSetup
    from nearpolicy.tools.protocol import ObservationFraming

    e, a = cfg.episode, cfg.algorithm
    framing = ObservationFraming.from_template(session.tokenizer, e.observation_chars)
    episodes = EpisodeSetup(session.tokenizer, framing, frozenset(session.stop_ids),
                            EpisodeLimits(e.max_turns, e.max_tokens, e.turn_tokens), tuple(e.server), e.call_timeout_s)
    runner = episodes.runner()
    if cfg.rollout.engines:
        from nearpolicy.rollouts.episode_replicas import EpisodeReplicaRollouts

        return EpisodeReplicaRollouts(replica_settings(cfg), engine, gguf_writer(cfg, session),
                                      session.engine_dir / "published", _replica_spec(cfg), session.task,
                                      session.episode_prompt_ids, session.prompt_ids, sampling, episodes, runner, log,
                                      e.eval_without_tool, cfg.sampling.max_new_tokens)
    return EpisodeRollouts(engine, engine_weights(cfg, session, log), session.task, session.episode_prompt_ids,
                           session.prompt_ids, runner, sampling, a.group_size, a.prompts_per_step, cfg.run.seed,
                           e.eval_without_tool, cfg.sampling.max_new_tokens)


def assemble(cfg: Config, run_dir: Path, log=print) -> tuple[Session, RolloutSource]:
    """Everything a Trainer runs on: the session and its rollout source (with the in-process engine)."""
    session = build_session(cfg, run_dir, log)
    rollouts = build_rollouts(cfg, session, build_engine(cfg, session, log), log)
    return session, rollouts if session.lora is None else lora_rollouts(cfg, session, rollouts, log)  # syncs proven
