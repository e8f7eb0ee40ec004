"""The config sections that need no registry: the base Section (frozen, unknown keys rejected, field docs from the
string under each field), [rollout], [distill], [episode] and the multi-turn keys of [algorithm] (TurnCreditFields,
the base of config.AlgorithmConfig). config/schema.py assembles the whole schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from nearpolicy.config.checks import check_rollout, check_turn_credit, registered
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
    """On-policy distillation: per-token reverse KL to a teacher on the student's samples (docs/math.md sec. 15)."""

    teacher: str | None = None
    """Teacher model ("smollm2", a GGUF or an HF folder with the same tokenizer); None = no distillation."""
    coef: float = Field(1.0, gt=0)
    """Token advantage A_t = -coef (log mu(y_t) - log pi_teacher(y_t)) (+ discounted future terms)."""
    discount: float = Field(0.0, ge=0, le=1)
    """gamma in [0, 1]: A_t also sums the later model tokens' terms, discounted by gamma per model token between
    (tool observations take no step; 0 = per token only; docs/math.md sec. 15)."""
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task's GRPO-family advantage added to the distillation advantage (0 = pure distillation)."""


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

    @field_validator("example")
    @classmethod
    def _messages(cls, value: list[dict[str, str]]) -> list[dict[str, str]]:
        for i, message in enumerate(value):
            if set(message) != {"role", "content"} or message["role"] not in EXAMPLE_ROLES:
                raise ValueError(f"episode.example[{i}] must be {{role, content}} with role one of {EXAMPLE_ROLES}, "
                                 f"got {message}")
        return value

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
