"""The config's checks that are more than a range: names a registry must know, rules across fields and sections,
`--set` parsing and the error message naming the key. config/schema.py declares the schema and calls these; the choice
lists themselves live beside the code that uses them (ops/ registries and tuples, engines/)."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ValidationError

from nearpolicy.engines.factory import ENGINES, kind_of
from nearpolicy.engines.gguf.kquant import KQUANTS
from nearpolicy.ops.advantages import GROUP_RELATIVE
from nearpolicy.ops.correction_presets import drop_replaced_preset_fields
from nearpolicy.ops.losses import required_aggregation
from nearpolicy.registry import Registry, did_you_mean


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key."""


@dataclass(frozen=True)
class RegisteredName:
    """Field metadata: the value must be a name of `registry` (or one of `aliases`). Validates the field (through
    pydantic's AfterValidator) and tells `nearpolicy config` the choices; both read the registry itself."""

    registry: Registry
    aliases: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [*self.aliases, *self.registry.names()]

    def __call__(self, value: str) -> str:
        if value not in self.names():
            hint = did_you_mean(value, self.names())
            raise ValueError(f"unknown name {value!r}{hint}; valid: {', '.join(self.names())}")
        return value


def registered(registry: Registry, aliases: tuple[str, ...] = ()) -> Any:
    """The field type `str` restricted to the names of `registry` (plus `aliases`)."""
    name = RegisteredName(registry, aliases)
    return Annotated[str, AfterValidator(name), name]


def betas_in_range(value: tuple[float, float]) -> tuple[float, float]:
    if not all(0 <= b < 1 for b in value):
        raise ValueError(f"each Adam beta must be in [0, 1), got {value}")
    return value


def aggregation_fits_loss(data: Any) -> Any:
    """Before validation of [algorithm]: a sequence-level loss (gspo) takes its one aggregation when none is set,
    and refuses any other."""
    required = required_aggregation(data["loss"]) if isinstance(data, dict) and isinstance(data.get("loss"), str) else None
    if required is not None and data.get("aggregation", required) != required:
        raise ValueError(f"algorithm.aggregation = {data['aggregation']!r} weighs each sequence by its length, but "
                         f"loss {data['loss']!r} is sequence-level: set {required!r} or leave it unset")
    return data if required is None else {**data, "aggregation": required}


def check_batch_divides(a) -> None:
    samples = a.group_size * a.prompts_per_step
    if samples % a.minibatches:
        raise ValueError(f"algorithm.minibatches ({a.minibatches}) must divide group_size * prompts_per_step ({samples})")
    if a.data_policy == "top_variance_k" and a.data_policy_top_k >= a.prompts_per_step:  # it would select nothing
        raise ValueError(f"algorithm.data_policy_top_k ({a.data_policy_top_k}) keeps every group of a step of "
                         f"prompts_per_step = {a.prompts_per_step}: top_variance_k would drop only constant groups; "
                         "lower it, or use data_policy = 'drop_zero_variance'")


def check_correction(c) -> None:
    """[correction]: the spec builds, and DLC centring and a non-"old" proximal have the decoupled mode they need."""
    spec = c.spec()
    if c.center != "none" and spec.mode != "decoupled":
        raise ValueError("correction.center (DLC) needs mode = 'decoupled': in bypass mode the engine's log-probs "
                         "are also the PPO proximal, and shifting them would move the clip window")
    if c.proximal != "old" and spec.mode != "decoupled":
        raise ValueError(f"correction.proximal = {c.proximal!r} needs mode = 'decoupled': in bypass mode the "
                         "engine's log-probs are the proximal")


def check_rollout(r) -> None:
    if r.engines == 0 and (r.staleness or r.partial or r.overprovision or r.backend == "ray"):
        raise ValueError("staleness, partial, overprovision and backend = 'ray' need rollout.engines >= 1")
    if r.partial and r.staleness < 1:
        raise ValueError("partial rollouts keep tokens across a weight update, so they need rollout.staleness >= 1")
    for name, amount in r.trainer_resources.items():
        if name in ("CPU", "GPU", "memory") or not amount >= 0:
            raise ValueError(f"rollout.trainer_resources: {name} = {amount} is not a custom Ray resource amount "
                             ">= 0 (CPU, GPU and memory are not accepted here)")


def check_turn_credit(a) -> None:
    """[algorithm]: trace and rtpo normalise like grpo, so they need algorithm.advantage = 'grpo'."""
    if a.turn_credit != "outcome" and getattr(a, "advantage", "grpo") != "grpo":
        raise ValueError(f"algorithm.turn_credit = {a.turn_credit!r} normalises per group like grpo: set "
                         f"algorithm.advantage = 'grpo' (it is {a.advantage!r})")


def check_distill(d):
    """[distill]: the forward-KL and R-OPD keys need a teacher and each other (a key that would do nothing is refused)."""
    if d.teacher is None and (d.divergence != "reverse" or d.ropd):
        raise ValueError("distill.divergence = 'forward' and distill.ropd need a teacher: set distill.teacher")
    if d.forward_top_k and d.divergence != "forward":
        raise ValueError(f"distill.forward_top_k = {d.forward_top_k} sets the forward KL's top-k: it needs "
                         "distill.divergence = 'forward'")
    if d.ropd and d.divergence != "forward":
        raise ValueError("distill.ropd = true trains on the initial policy's samples after its switch, where the reverse "
                         "KL's advantage (the sampler's log-prob minus the teacher's) no longer measures the student: "
                         "set distill.divergence = 'forward'")


def check_distill_fits(cfg) -> None:
    """Rules across sections for [distill]: the forward KL needs the student's full sampling distribution (no
    sampling.top_k / top_p) and is not combined with ECHO yet; R-OPD's switch runs on the synchronous single-turn
    source and estimates the gradient noise from >= 2 micro-batches of a mini-batch."""
    d, a, s = cfg.distill, cfg.algorithm, cfg.sampling
    if d.divergence == "forward" and (s.top_k > 0 or s.top_p < 1):
        raise ValueError(f"distill.divergence = 'forward' needs the student's whole next-token distribution, but "
                         f"sampling.top_k = {s.top_k} / sampling.top_p = {s.top_p} give 0 outside a kept set (KL(teacher "
                         "|| student) would be infinite): set sampling.top_k = 0 and sampling.top_p = 1, or "
                         "divergence = 'reverse'")
    if d.divergence == "forward" and a.observation_loss_coef > 0:
        raise ValueError("distill.divergence = 'forward' is not combined with algorithm.observation_loss_coef > 0 yet")
    if d.ropd and (cfg.rollout.engines or cfg.episode.enabled):
        raise ValueError("distill.ropd = true switches the synchronous single-turn source only: set rollout.engines = 0 "
                         "and episode.enabled = false")
    micro_batches = -(-(a.group_size * a.prompts_per_step // a.minibatches) // a.micro_batch_size)
    if d.ropd and micro_batches < 2:
        raise ValueError(f"distill.ropd = true estimates the gradient noise from the micro-batches of a mini-batch, "
                         f"which has {micro_batches}: set algorithm.micro_batch_size below the mini-batch's "
                         f"{a.group_size * a.prompts_per_step // a.minibatches} samples")


def check_sections_agree(cfg) -> None:
    """Rules across sections: replicas run llama.cpp; llama.cpp's sequence limit; a group fits one batch; episodes
    run on llamacpp (the synchronous engine or the replicas) or hf; a group-relative estimator needs groups of two or
    more unless a teacher alone gives the signal (distill.reward_weight = 0); MIPU needs synchronous single-turn
    rollouts, and backtracking no PPO-EWMA."""
    e, a = cfg.engine, cfg.algorithm
    kind = kind_of(e.kind)
    if cfg.episode.enabled and not kind.episodes:
        raise ValueError(f"episode.enabled is not supported with engine.kind = {e.kind!r} yet (untested): use "
                         f"{' or '.join(k.name for k in ENGINES.values() if k.episodes)}")
    if cfg.rollout.engines and not kind.replicas:
        raise ValueError(f"rollout.engines >= 1 runs engine replicas, which engine.kind = {e.kind!r} cannot: set "
                         f"engine.kind = {' or '.join(repr(k.name) for k in ENGINES.values() if k.replicas)}")
    if kind.max_parallel is not None and e.max_parallel_sequences > kind.max_parallel:
        raise ValueError(f"engine.max_parallel_sequences = {e.max_parallel_sequences} exceeds {kind.max_parallel_why}; "
                         f"use at most {kind.max_parallel}")
    if a.warmup_steps and a.warmup_steps >= cfg.run.steps:
        raise ValueError(f"algorithm.warmup_steps ({a.warmup_steps}) must be below run.steps ({cfg.run.steps}): the "
                         f"learning rate would never reach algorithm.lr (for a short run add --set "
                         f"algorithm.warmup_steps={max(cfg.run.steps - 1, 0)})")
    if a.precision_alignment == "engine" and e.precision in KQUANTS:
        raise ValueError(f"algorithm.precision_alignment = 'engine' emulates one GGUF type per tensor; engine.precision "
                         f"= {e.precision!r} is a K-quant whose per-tensor mix llama.cpp chooses: use a per-tensor type "
                         "(q8_0, q4_1, ...) or precision_alignment = 'off'")
    if a.precision_alignment == "engine" and (not kind.alignable or e.flash_attention):
        raise ValueError("algorithm.precision_alignment = 'engine' emulates llama.cpp without flash attention: set "
                         "engine.kind = 'llamacpp' and engine.flash_attention = false, or precision_alignment = 'off'")
    if a.precision_alignment == "engine" and a.trainer_precision != "fp32":
        raise ValueError(f"algorithm.trainer_precision = {a.trainer_precision!r} beside precision_alignment = 'engine': "
                         "the aligned forward computes llama.cpp's own rounding, which autocast would replace; use "
                         "trainer_precision = 'fp32' with the aligned trainer")
    if a.group_size == 1 and a.advantage in GROUP_RELATIVE and (cfg.distill.teacher is None or cfg.distill.reward_weight):
        raise ValueError(f"algorithm.group_size = 1 with algorithm.advantage = {a.advantage!r}: a group-relative "
                         "estimator gives a group of one advantage 0, so the run would train on nothing; set "
                         "algorithm.group_size >= 2, or algorithm.advantage = 'reinforce'")
    if a.group_size > e.max_parallel_sequences:
        raise ValueError(f"algorithm.group_size ({a.group_size}) exceeds engine.max_parallel_sequences "
                         f"({e.max_parallel_sequences}): a group is decoded in one batch")
    if not cfg.episode.enabled and (a.turn_credit != "outcome" or a.observation_loss_coef > 0):
        raise ValueError(f"algorithm.turn_credit = {a.turn_credit!r} / observation_loss_coef = "
                         f"{a.observation_loss_coef} act on the turns and tool observations of multi-turn episodes: "
                         "set episode.enabled = true, or turn_credit = 'outcome' and observation_loss_coef = 0")
    if a.turn_credit != "outcome" and cfg.distill.teacher is not None:
        raise ValueError(f"algorithm.turn_credit = {a.turn_credit!r} gives token advantages, which distillation "
                         "(distill.teacher) does not combine yet: use turn_credit = 'outcome' with a teacher")
    if cfg.mipu.enabled and (cfg.rollout.engines or cfg.episode.enabled):
        raise ValueError("mipu.enabled re-scores each step's samples with the in-process engine right after the weight "
                         "sync: it needs synchronous single-turn rollouts (rollout.engines = 0, episode.enabled = false)")
    if cfg.mipu.enabled and cfg.mipu.max_tries > 1 and cfg.correction.proximal == "ewma":
        raise ValueError("mipu.max_tries > 1 shrinks an update after its optimizer steps, which the PPO-EWMA average "
                         "has already taken in: use mipu.max_tries = 1 with correction.proximal = 'ewma'")
    check_distill_fits(cfg)
    check_popo(cfg)
    check_xrpo(cfg)


def check_popo(cfg) -> None:
    """[popo]'s rules across sections (rollouts/replay.py; docs/math.md sec. 25): replayed tokens are stale, so the
    update must weight them by pi_prox / mu under the PPO clip around pi_prox (correction.mode = 'decoupled', an action
    other than 'off', mix > 0); a group-relative estimator (a constant group has no signal only there); and the
    synchronous single-turn full-model loop it is built for. Raises ValueError naming the keys."""
    if not cfg.popo.enabled:
        return
    c, spec = cfg.correction, cfg.correction.spec()
    if spec.mode != "decoupled" or spec.action == "off" or spec.mix == 0:
        raise ValueError(f"popo.enabled replays tokens sampled by older weights, which the update must weight by "
                         f"pi_old / mu (decoupled importance sampling): the correction (preset {c.preset!r} with the "
                         f"keys set over it) has correction.mode = {spec.mode!r}, correction.action = "
                         f"{spec.action!r}, correction.mix = {spec.mix}; use correction.mode = 'decoupled' with an action other than 'off' and mix > 0 "
                         "(e.g. correction.preset = 'tis')")
    if cfg.algorithm.advantage not in GROUP_RELATIVE:
        raise ValueError(f"popo.enabled replaces the groups a group-relative estimator gives no signal; "
                         f"algorithm.advantage = {cfg.algorithm.advantage!r} is not one: use one of "
                         f"{', '.join(sorted(GROUP_RELATIVE))}")
    others = {"rollout.engines >= 1": cfg.rollout.engines > 0, "episode.enabled": cfg.episode.enabled,
              "lora.enabled": cfg.lora.enabled, "mipu.enabled": cfg.mipu.enabled, "distill.ropd": cfg.distill.ropd,
              "distill.teacher": cfg.distill.teacher is not None}
    if on := [name for name, set_ in others.items() if set_]:
        raise ValueError(f"popo.enabled is not combined with {', '.join(on)} yet (built for synchronous single-turn "
                         "rollouts of the full model): remove popo.enabled or those settings")


def refuse_unused(section, prefix: str, names: list[str], off: str, on: bool) -> None:
    """Refuse `prefix`.NAME values off their defaults that nothing reads while `on` is false (the setting `off`
    names): a silently ignored setting is a mistake the user should hear of. Raises ValueError naming them."""
    fields = type(section).model_fields
    changed = [n for n in names if getattr(section, n) != fields[n].default]
    if changed and not on:
        raise ValueError(f"{', '.join(f'{prefix}.{n}' for n in changed)} has no effect while {off}: remove it, or "
                         f"change {off.split(' = ')[0]}")


def check_xrpo(cfg) -> None:
    """[xrpo]'s rules across sections: something to do (novelty or allocate); a first round of 2 <= first_round <
    algorithm.group_size and seeding only with the allocator; synchronous single-turn rollouts of the full model with
    outcome advantages [N] (rollout.engines = 0, no episodes; no POPO replay, whose group ids are data positions; no
    distillation, whose advantages are per token; no LoRA or MIPU: not combined yet). Raises ValueError naming the
    keys."""
    x, a = cfg.xrpo, cfg.algorithm
    refuse_unused(x, "xrpo", [k for k in type(x).model_fields if k != "enabled"], "xrpo.enabled = false", x.enabled)
    if not x.enabled:
        return
    refuse_unused(x, "xrpo", ["novelty_lambda", "novelty_kappa"], "xrpo.novelty = false", x.novelty)
    refuse_unused(x, "xrpo", ["first_round", "alpha", "exploration"], "xrpo.allocate = false", x.allocate)
    if not (x.novelty or x.allocate):
        raise ValueError("[xrpo] with xrpo.novelty = false and xrpo.allocate = false does nothing: turn one on, or set "
                         "xrpo.enabled = false")
    if x.seeding and not x.allocate:
        raise ValueError("xrpo.seeding samples a zero-reward prompt's extra rollouts, which the allocator gives: set "
                         "xrpo.allocate = true, or xrpo.seeding = false")
    first = x.first_round_of(a.group_size)
    if x.allocate and not first < a.group_size:
        lower = "xrpo.first_round lower, " if first > 2 else ""  # 2 is its least: a group's variance needs 2
        said = f"xrpo.first_round = {first}" if x.first_round is not None else f"xrpo.first_round (unset: {first})"
        raise ValueError(f"{said} leaves no rollouts to allocate: it must be below algorithm.group_size "
                         f"({a.group_size}); set {lower}algorithm.group_size >= {first + 1}, or xrpo.allocate = false")
    others = {"rollout.engines >= 1": cfg.rollout.engines > 0, "episode.enabled": cfg.episode.enabled,
              "popo.enabled": cfg.popo.enabled, "distill.teacher": cfg.distill.teacher is not None,
              "distill.ropd": cfg.distill.ropd, "lora.enabled": cfg.lora.enabled, "mipu.enabled": cfg.mipu.enabled,
              "task.mixture = 'adaptive' (with xrpo.allocate)": x.allocate and cfg.task.mixture == "adaptive"}
    if on := [name for name, set_ in others.items() if set_]:
        raise ValueError(f"[xrpo] is not combined with {', '.join(on)} yet (built for synchronous single-turn rollouts "
                         "of the full model, outcome advantages): remove [xrpo] or those settings")


def check_task(t):
    """[task]: kind = 'jsonl' needs a path. Returns the section (a model validator)."""
    if t.kind == "jsonl" and t.path is None:
        raise ValueError("task.path is required when task.kind = 'jsonl'")
    return t


def drop_replaced_task_options(section: dict | None, default, overrides: list[tuple[str, list[str], Any]]) -> None:
    """Config layering (config.load_config): when the upper layer's `overrides` ((text, keys, value) of each --set)
    change task.kind or task.name from the lower layer's raw [task] `section` (`default`: the TaskConfig defaults),
    drop that section's task.options (in place): they are the keyword options of the lower layer's dataset
    (configs/main.toml's chain_sum options would be refused by another dataset and by kind = 'jsonl'). Options the
    upper layer sets itself still apply."""
    if not isinstance(section, dict) or "options" not in section:
        return
    if any(keys == ["task", key] and value != section.get(key, getattr(default, key))
           for _, keys, value in overrides for key in ("kind", "name")):
        del section["options"]


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file as a dict: TOML, or JSON for a `.json` file (a run's config.json, so that a new run can start
    from a finished run's whole config). Raises ConfigError naming the file when it is missing, unreadable, not
    valid or (JSON) not an object."""
    if Path(path).suffix.lower() != ".json":
        return read_toml(path)
    text = _config_text(path)
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested deeper than Python recurses
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a JSON object, not {type(data).__name__}")
    return data


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a repeated key is an error, as TOML has it (json.loads keeps the last)."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def read_toml(path: Path) -> dict[str, Any]:
    """A config file's TOML as a dict. Raises ConfigError naming the file when it is missing, unreadable or not TOML."""
    text = _config_text(path)
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as err:  # RecursionError: nested deeper than Python recurses
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def _config_text(path: Path) -> str:
    """A config file's text (UTF-8). Raises ConfigError naming the file when it is missing or unreadable."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None


def apply_overrides(data: dict[str, Any], overrides, default_preset: str, default_task) -> None:
    """Apply `--set` overrides to the config dict `data` in place. An override of correction.preset drops the
    lower layer's preset fields it does not set itself (ops.correction_presets.drop_replaced_preset_fields); one of
    task.kind or task.name drops the lower layer's task.options (drop_replaced_task_options; `default_task`: the
    TaskConfig defaults). Raises ConfigError for a malformed override."""
    parsed = [(item, *parse_override(item)) for item in overrides]
    drop_replaced_preset_fields(data.get("correction"), default_preset,
                                {tuple(keys[1:]): value for _, keys, value in parsed if keys[0] == "correction"})
    drop_replaced_task_options(data.get("task"), default_task, parsed)
    for item, keys, value in parsed:
        node = data
        for part in keys[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: {part!r} is not a section")
        node[keys[-1]] = value


def parse_override(text: str) -> tuple[list[str], Any]:
    """"a.b=value" -> (["a", "b"], value); the value is read as a TOML literal, else kept as a string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"--set has an empty key part in {key!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw
    return path, value


def _keys_beside(schema: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the section `loc` (a key's location without the key) in `schema`; [] past a leaf."""
    for part in loc:
        field = schema.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        schema = annotation
    return list(schema.model_fields)


def describe_errors(err: ValidationError, path, schema: type[BaseModel] | None = None) -> str:
    """One message for a failed validation, each problem naming its key (`path`: the config file, or None); an
    unknown key or choice gets a "did you mean" hint (the keys beside it come from `schema`, the Config class)."""
    where = f"{path}: " if path else ""
    lines = []
    for problem in err.errors():
        key = ".".join(str(p) for p in problem["loc"])
        if problem["type"] == "extra_forbidden":
            beside = _keys_beside(schema, problem["loc"][:-1]) if schema is not None else []
            section = "".join(f"{p}." for p in problem["loc"][:-1])
            lines.append(f"unknown key '{key}'{did_you_mean(problem['loc'][-1], beside, section)}")
        elif problem["type"] == "literal_error":
            choices = re.findall(r"'([^']*)'", str(problem.get("ctx", {}).get("expected", "")))
            lines.append(f"'{key}': {problem['msg']} (got {problem.get('input')!r})"
                         f"{did_you_mean(problem.get('input'), choices)}")
        elif len(problem["loc"]) <= 1 and (not key or isinstance(problem.get("input"), dict)):
            # a rule across sections or over one section: its own message names the keys
            lines.append(problem["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"'{key}': {problem['msg']} (got {problem.get('input')!r})")
    return where + "invalid config: " + "; ".join(lines)
