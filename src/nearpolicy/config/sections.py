"""The config sections that need no registry: the base Section (frozen, unknown keys rejected, field docs from the
string under each field), [rollout], [distill], [episode], [mipu] and the multi-turn keys of [algorithm]
(TurnCreditFields, the base of config.AlgorithmConfig). config/schema.py assembles the whole schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from nearpolicy.config.checks import check_distill, check_rollout, check_turn_credit, refuse_unused, registered
from nearpolicy.ops.mipu import MIPU_LEVELS
from nearpolicy.ops.turn_credit import DEFAULT_ANSWER_FORMAT, TURN_CREDIT, TurnCreditParams


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)


class RolloutConfig(Section):
    """Where rollouts come from: inline in the trainer process (engines = 0, synchronous) or engine replicas
    running beside the trainer with bounded staleness (rollouts/scheduler.py)."""

    backend: Literal["local", "ray"] = "local"
    """local: replicas are processes on this machine; ray: Ray actors on the cluster ray.init reaches."""
    engines: int = Field(0, ge=0, le=64)
    """Engine replicas; 0 = the engine runs inline, synchronously (the default)."""
    staleness: int = Field(0, ge=0, le=16)
    """eta: a trained token is at most this many policy versions old; 0 = synchronous."""
    partial: StrictBool = False
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
        check_rollout(self)
        return self


class DistillConfig(Section):
    """On-policy distillation: per-token reverse KL (or forward KL) to a teacher on the student's samples, and
    R-OPD's switch to the initial policy's samples (docs/math.md sec. 15)."""

    teacher: str | None = None
    """Teacher model ("smollm2", a GGUF or an HF folder with the same tokenizer); None = no distillation."""
    divergence: Literal["reverse", "forward"] = "reverse"
    """reverse: KL(student || teacher) as token advantages on the sampled tokens (Tinker's OPD); forward:
    KL(teacher || student) over the teacher's whole next-token distribution at each response position, a loss term
    with its gradient through the student's log-probs only (logged as distill/forward_kl; no advantage from the
    teacher, distill.discount unused). Forward needs the teacher's distribution: exact from its logits (the teacher
    runs in process), or its top-k (forward_top_k); it refuses sampling.top_k / top_p (the student's sampling
    distribution is 0 outside its kept set: the divergence would be infinite)."""
    coef: float = Field(1.0, gt=0)
    """reverse: token advantage A_t = -coef (log mu(y_t) - log pi_teacher(y_t)) (+ discounted future terms);
    forward: the loss adds coef x the forward KL, aggregated as the policy loss (algorithm.aggregation)."""
    discount: float = Field(0.0, ge=0, le=1)
    """gamma in [0, 1]: A_t also sums the later model tokens' terms, discounted by gamma per model token between
    (tool observations take no step; 0 = per token only; docs/math.md sec. 15)."""
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task's GRPO-family advantage added to the distillation advantage (0 = pure distillation)."""
    forward_top_k: int = Field(0, ge=0)
    """divergence = forward: 0 = the exact forward KL over the whole vocabulary; k >= 1 = over the teacher's k most
    likely tokens, renormalised (an approximation: the teacher's mass outside them is dropped; what an engine teacher
    returning top-k log-probs allows; k >= the vocabulary is exact)."""
    ropd: StrictBool = False
    """R-OPD's curriculum (reconstructed from the abstract of the R-OPD paper): once the mean gradient's change between
    consecutive steps is within ropd_z standard errors of the micro-batch noise ropd_patience steps in a row, the
    samples come from the initial policy (a second engine on the model.path weights, never synced) for the rest of
    the run. Needs divergence = forward, inline single-turn rollouts and >= 2 micro-batches per mini-batch. Logged:
    distill/ropd_grad_change, ropd_grad_noise, ropd_streak, ropd_switched (kept in checkpoints)."""
    ropd_z: float = Field(1.0, gt=0)
    """R-OPD: quiet when ||gbar_t - gbar_{t-1}|| <= z sqrt(SE_t^2 + SE_{t-1}^2), SE the standard error of a step's mean
    gradient over its first mini-batch's micro-batches (ops/ropd.py)."""
    ropd_patience: int = Field(2, ge=1)
    """R-OPD: consecutive quiet steps that trigger the switch."""
    ropd_sketch: int = Field(4096, ge=16, le=65536)
    """R-OPD: gradient coordinates the trigger reads (a fixed, seeded random subset; all of them when the model has
    fewer); the previous step's mean over them is kept in the checkpoint."""

    @model_validator(mode="after")
    def _consistent(self) -> "DistillConfig":
        check_distill(self)
        return self


MIPU_REFERENCES = ("rescored", "rollout")  # mipu.reference: the engine's log-probs before the update


class MipuConfig(Section):
    """MIPU, Monotonic Inference Policy Update (reconstructed from the abstract of arXiv:2606.29526; docs/math.md sec.
    24): after each update the candidate weights are synchronised to the engine, which re-scores the step's sampled
    tokens; the candidate is kept only when the engine's improvement proxy on the batch is at least `margin`, else
    the trainer's weights, AdamW state (and PPO-EWMA average) return to their values before the update and the
    engine is synchronised back. Synchronous single-turn rollouts only (rollout.engines = 0, no episodes). The
    paper's candidates are sampler-referenced: pair with correction.mode = "bypass" (e.g. preset bypass_ppo_clip)."""

    enabled: StrictBool = False
    """Gate every step's update on the engine's improvement proxy (off: every update is kept, nothing is re-scored).
    Costs per step: one engine scoring pass of the batch before the sync and one per try after it, one trainer
    forward per try (mipu/proxy_trainer), a copy of the weights and AdamW state, one more sync on a rejection."""
    level: Literal[MIPU_LEVELS] = "token"
    """The proxy (ops/mipu.py): token = token mean of (r_t - 1) A_t, r_t = mu_new / mu_old of each sampled token (the
    first-order surrogate); sequence = mean over responses of (prod_t r_t - 1) x the response's mean advantage."""
    reference: Literal[MIPU_REFERENCES] = "rescored"
    """mu_old, the engine's log-probs before the update: rescored = the engine re-scores the batch (teacher forcing)
    before the candidate is synchronised, so an update the engine's rounding erases gives a proxy of exactly 0;
    rollout = the log-probs the engine reported while sampling (no extra pass; their difference from teacher-forced
    scoring, and any logit noise, enters the proxy)."""
    margin: float = 0.0
    """Accept a candidate when its proxy is >= this (advantage units); 0 keeps a candidate that leaves the engine's
    policy unchanged on the batch, > 0 asks for a measured gain, < 0 tolerates a small loss."""
    max_tries: int = Field(1, ge=1, le=8)
    """Candidates per step: 1 = accept or reject the update; k > 1 backtracks, try j + 1 synchronising the step
    halved j times (theta_old + 2^-j (theta_new - theta_old), keeping the update's AdamW state), before a rejection."""

    @model_validator(mode="after")
    def _settings_need_enabled(self) -> "MipuConfig":
        """A mipu.* value off its default while MIPU is off would be silently ignored: refuse it by name."""
        refuse_unused(self, "mipu", [k for k in type(self).model_fields if k != "enabled"], "mipu.enabled = false",
                      self.enabled)
        return self


TOOL_SYSTEM_PROMPT = ('Use the calculator tool for arithmetic: write <tool_call>{"name": "calculator", "arguments": '
                      '{"expression": "..."}}</tool_call> and wait for its reply. Then give the final answer as: '
                      'Answer: <number>')
TOOL_EXAMPLE = (
    {"role": "user", "content": "Solve the following multiplication: 25 * 31. Give only the result as your final answer."},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "25 * 31"}}</tool_call>'},
    {"role": "tool", "content": "775"},
    {"role": "assistant", "content": "Answer: 775"},
)
EXAMPLE_ROLES = ("user", "assistant", "tool")


def check_messages(value: list[dict[str, str]], key: str, roles: tuple[str, ...]) -> list[dict[str, str]]:
    """`value` unchanged when every item is a chat message {role, content} with a role in `roles`; else ValueError
    naming `key`[i]."""
    for i, message in enumerate(value):
        if set(message) != {"role", "content"} or message["role"] not in roles:
            raise ValueError(f"{key}[{i}] must be {{role, content}} with role one of {roles}, got {message}")
    return value


def check_worked_turns(value: list[dict[str, str]], key: str) -> list[dict[str, str]]:
    """`value` unchanged when it is worked examples a chat template takes: {role, content} messages with non-empty
    content, user and assistant alternating from a user turn, ending with an assistant turn (the question follows as
    the next user turn); else ValueError naming `key`."""
    check_messages(value, key, ("user", "assistant"))
    for i, message in enumerate(value):
        if not str(message["content"]).strip():
            raise ValueError(f"{key}[{i}] has empty content")
        if message["role"] != ("user", "assistant")[i % 2]:
            raise ValueError(f"{key} must alternate user, assistant from a user turn; {key}[{i}] is {message['role']}")
    if len(value) % 2:
        raise ValueError(f"{key} must end with an assistant turn (the question follows as the next user turn)")
    return value


class EpisodeConfig(Section):
    """Multi-turn tool-use episodes (rollouts/episodes.py, docs/tools.md): the model's turns, tool calls run through
    an MCP stdio server, tool results inserted as token ids; trained on the model's tokens only. The synchronous
    engine (rollout.engines = 0: llamacpp or hf) or the asynchronous llama.cpp replicas (rollout.engines >= 1: each
    runs its episodes and their tool calls itself; rollout.partial continues an interrupted episode mid-turn at the
    new version, rollouts/episode_replicas.py); not vllm."""

    enabled: StrictBool = False
    """Run each sample as an episode of up to max_turns turns (off: one response per sample)."""
    server: list[str] = []
    """The MCP stdio server command (argv), e.g. ["python", "my_server.py"]; empty = nearpolicy's own
    (`python -m nearpolicy.tools.server`: calculator, python)."""
    max_turns: int = Field(3, ge=1, le=32)
    """Model turns per episode; a tool call in the last turn is not run (the episode ends: turn_limit)."""
    max_tokens: int = Field(256, ge=2)
    """Token budget of an episode's completion: the model's tokens plus the inserted tool / template tokens (the
    prompt + this must fit model.max_context)."""
    turn_tokens: int = Field(96, ge=1)
    """Most tokens one turn may sample (at most max_tokens)."""
    call_timeout_s: float = Field(10.0, gt=0, le=600)
    """Wall-clock limit of one tool call, seconds: a call past it is an error observation (kind timeout) and its
    server is restarted."""
    observation_chars: int = Field(400, ge=1)
    """A tool's result text is cut to this many characters before it is tokenised (marked ...[truncated])."""
    system_prompt: str = TOOL_SYSTEM_PROMPT
    """The system message of an episode's prompt (task.system_prompt is the no-tool eval's)."""
    example: list[dict[str, str]] = list(TOOL_EXAMPLE)
    """A worked example put between the system message and the question, as chat messages {role, content} (role:
    user, assistant or tool), rendered once with the chat template; [] = none."""
    eval_without_tool: StrictBool = True
    """Each eval also scores single greedy turns of the task's own prompt (task.system_prompt, no tool, at most
    sampling.max_new_tokens): eval/accuracy_no_tool beside the with-tool eval/accuracy."""

    _messages = field_validator("example")(lambda cls, value: check_messages(value, "episode.example", EXAMPLE_ROLES))

    @model_validator(mode="after")
    def _turn_fits(self) -> "EpisodeConfig":
        if self.turn_tokens > self.max_tokens:
            raise ValueError(f"episode.turn_tokens ({self.turn_tokens}) exceeds episode.max_tokens ({self.max_tokens})")
        return self


class TurnCreditFields(Section):
    """The [algorithm] keys of multi-turn episodes: turn-level credit and ECHO's observation loss (docs/turn_credit.md).
    config.AlgorithmConfig inherits them."""

    turn_credit: registered(TURN_CREDIT) = "outcome"
    """Credit over the turns of an episode (`nearpolicy list`): outcome (the episode's GRPO advantage on every model
    token), trace (+ a reference model's gold-answer TD turn rewards), rtpo (per turn counted from the last)."""
    trace_weight: float = Field(TurnCreditParams.trace_weight, ge=0)
    """TRACE's beta: weight of the group-normalised TD turn reward added to the outcome advantage (>= 0)."""
    trace_answer_format: str = DEFAULT_ANSWER_FORMAT
    """TRACE: the gold answer as the model would write it ({answer} = the task's answer), scored by the reference
    model after each tool observation; match task.system_prompt's answer line."""
    observation_loss_coef: float = Field(0.0, ge=0)
    """ECHO: the loss adds this x the token-mean cross-entropy of the tool-observation tokens under the raw (T = 1)
    distribution, same forward pass (0 = off)."""

    @field_validator("trace_answer_format")
    @classmethod
    def _has_placeholder(cls, value: str) -> str:
        try:
            filled = value.format(answer="\x00")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"algorithm.trace_answer_format = {value!r} is not a format string with only an "
                             f"{{answer}} field ({type(err).__name__}: {err})") from None
        if "\x00" not in filled:
            raise ValueError(f"algorithm.trace_answer_format = {value!r} has no {{answer}} placeholder")
        return value

    @model_validator(mode="after")
    def _credit_fits(self) -> "TurnCreditFields":
        check_turn_credit(self)
        return self
