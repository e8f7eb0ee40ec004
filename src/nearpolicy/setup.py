"""Builds what a run needs from the config: policy and tokenizer, task, rollout engine, optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from nearpolicy.config import Config, EngineConfig
from nearpolicy.ops.correction_presets import describe_correction
from nearpolicy.tasks import Problem, Task, make_task


@dataclass
class Session:
    cfg: Config
    model: torch.nn.Module
    tokenizer: object
    task: Task
    engine: object
    optimizer: torch.optim.Optimizer
    template_gguf: Path | None
    engine_dir: Path
    plan: dict = field(default_factory=dict)
    ref_model: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def prompt_ids(self, problem: Problem) -> list[int]:
        """Chat-templated prompt ids (template applied once, generation prompt appended)."""
        return chat_prompt_ids(self.tokenizer, self.cfg.task.system_prompt, problem.question)

    def sync_engine(self, version: int) -> None:
        """Push the trainer's weights to the engine and set its policy version."""
        if self.cfg.engine.kind == "llamacpp":
            path = export_engine_gguf(self.model, self.engine_dir, self.cfg.engine, self.template_gguf, self.tokenizer)
            self.engine.update_weights(path, version)
        else:
            self.engine.update_weights(self.model.state_dict(), version)


def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def chat_prompt_ids(tokenizer, system_prompt: str, question: str) -> list[int]:
    if not question.strip():
        raise ValueError("empty prompt: the task produced a problem with no question text")
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def export_engine_gguf(model: torch.nn.Module, folder: Path, engine: EngineConfig, template: Path | None, tokenizer) -> Path:
    """Write the trainer's weights as the engine's GGUF (engine.precision with engine.tensor_precision)."""
    from nearpolicy.engines.gguf_export import export_gguf

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"policy-{engine.precision}.gguf"
    state = {k: v.detach() for k, v in model.state_dict().items()}
    try:
        export_gguf(state, model.config, path, engine.precision, template, tokenizer=tokenizer,
                    tensor_precision=tuple(engine.tensor_precision.items()))
    except OSError as err:  # export_gguf writes atomically: the file the engine holds is untouched
        kept = f"the previous {path.name} is unchanged" if path.exists() else f"{path.name} was not created"
        raise OSError(err.errno, f"could not write the engine GGUF {path} ({err.strerror or err}); {kept}") from err
    return path


def stop_token_ids(model, tokenizer, template: Path | None, folder: Path) -> set[int]:
    """Every id that ends a response, for every engine: llama.cpp's end-of-generation set (llama_vocab_is_eog over
    the vocabulary) of the GGUF metadata the llama.cpp engine gets (`template`'s, else the one written from
    `tokenizer`), read from a tensor-less GGUF written to `folder`. SmolLM2: {0, 2, 4}, a superset of the HF
    tokenizer's eos (2) and <|im_end|> (2) (invariant 18)."""
    from nearpolicy.engines.gguf_export import export_vocab_gguf
    from nearpolicy.engines.llamacpp import eog_token_ids

    folder.mkdir(parents=True, exist_ok=True)
    return set(eog_token_ids(export_vocab_gguf(model.config, folder / "vocab.gguf", template, tokenizer)))


def build_session(cfg: Config, run_dir: Path, log) -> Session:
    from nearpolicy.models import load_policy, resolve_model

    torch.set_num_threads(cfg.run.threads)
    resolved = resolve_model(cfg.model.path)
    # the task and the teacher's path are checked before the policy loads (tens of seconds), so a typo fails fast
    t = cfg.task
    task = make_task(t.kind, name=t.name, options=t.resolved_options(), path=t.path, train_size=t.train_size,
                     eval_size=t.eval_size, seed=cfg.run.seed, eval_seed=t.eval_seed, skip_bad_lines=t.skip_bad_lines)
    if cfg.distill.teacher is not None:
        try:
            resolve_model(cfg.distill.teacher)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"distill.teacher: {err}") from None
    model, tokenizer = load_policy(cfg.model.path)
    model.float()
    a = cfg.algorithm
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=a.adam_betas, weight_decay=a.weight_decay)
    template = resolved.path if resolved.kind == "gguf" else None
    engine_dir = run_dir / "engine"
    stop_ids = stop_token_ids(model, tokenizer, template, engine_dir)
    probe_prompt = chat_prompt_ids(tokenizer, t.system_prompt, task.train_problem(0).question)
    engine = _make_engine(cfg, model, tokenizer, template, engine_dir, stop_ids, probe_prompt)
    plan = {
        "model_file": str(resolved.path), "model_kind": resolved.kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "engine": f"{cfg.engine.kind}:{_engine_precision(cfg.engine)}",
        "samples_per_step": a.group_size * a.prompts_per_step,
        "samples_per_minibatch": a.group_size * a.prompts_per_step // a.minibatches,
        "total_samples": a.group_size * a.prompts_per_step * cfg.run.steps,
        "eval_problems": len(task.eval_problems()),
        "stop_token_ids": sorted(stop_ids),
    }
    ref_model = None
    if a.kl_coef > 0:  # the reference policy: the model.path weights, frozen (the same after a resume)
        ref_model = load_policy(cfg.model.path)[0].float().eval().requires_grad_(False)
    teacher = None
    if cfg.distill.teacher is not None:
        try:
            teacher, teacher_tokenizer = load_policy(cfg.distill.teacher)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"distill.teacher: {err}") from None
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"distill.teacher {cfg.distill.teacher!r} has a different tokenizer from the policy")
        teacher = teacher.float().eval().requires_grad_(False)
    plan["correction"] = repr(cfg.correction.spec())
    plan["correction_effective"] = describe_correction(cfg.correction.preset, cfg.correction.spec())
    log(f"correction: {plan['correction_effective']}")
    log(f"nearpolicy: {plan['engine']} engine, {plan['parameters'] / 1e6:.0f}M parameters, "
        f"{plan['samples_per_step']} samples/step, run folder {run_dir}")
    return Session(cfg, model, tokenizer, task, engine, optimizer, template, engine_dir, plan, ref_model, teacher)


def _engine_precision(e: EngineConfig) -> str:
    from nearpolicy.engines.precision_map import describe

    return describe(e.precision, tuple(e.tensor_precision.items())) if e.kind == "llamacpp" else e.hf_dtype


def engine_spec(cfg: Config, gguf_path: Path, version: int = 0, threads: int | None = None):
    """The llama.cpp engine of `cfg` over `gguf_path` (engines.llamacpp.EngineSpec)."""
    from nearpolicy.engines.llamacpp import EngineSpec

    e = cfg.engine
    return EngineSpec(str(gguf_path), version, cfg.model.max_context, e.max_parallel_sequences,
                      cfg.run.threads if threads is None else threads, e.kv_cache, e.flash_attention, e.extra_buffers)


def _make_engine(cfg: Config, model, tokenizer, template: Path | None, engine_dir: Path, stop_ids: set[int],
                 probe_prompt: list[int]):
    """The llamacpp engine runs in its own process (a native crash stops that process, not the trainer) and is
    probed on the exported GGUF before it is handed back; the hf engine runs in this process."""
    e = cfg.engine
    if e.kind == "llamacpp":
        from nearpolicy.engines.process import ProcessEngine

        path = export_engine_gguf(model, engine_dir, e, template, tokenizer)
        return ProcessEngine(engine_spec(cfg, path), f"llamacpp:{_engine_precision(e)}",
                             log_path=engine_dir / "llamacpp.log", probe_prompt=probe_prompt)
    from nearpolicy.engines.hf import HFEngine

    return HFEngine(model, stop_ids, dtype=e.hf_dtype, max_parallel_sequences=e.max_parallel_sequences)
