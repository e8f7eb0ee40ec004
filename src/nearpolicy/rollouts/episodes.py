"""Multi-turn tool-use episodes, token-in/token-out (synchronous, on the in-process engine).

Each turn, every live episode goes to the engine in ONE `generate` call: a GenerationRequest with n = 1 whose prompt
ids are the episode's whole prefix (prompt + every id so far, verbatim), its token limit the episode's budget left
capped by the per-turn limit. A turn ends at a stop token (or its limit). A tool call in the turn's text
(tools/protocol.py) runs through the MCP client (tools/client.py) while turns are left, and its observation ids
(the template's tool framing + the result's tokens, framing tokenised once) are appended with no log-prob and
model_mask False; a turn without a call ends the episode, scored on that last turn (Rollout.response_ids) as the
task scores a single turn. Ends: an answer, the turn limit, the token budget (episode_state.ENDS).

The sampled ids, their engine log-probs and versions are kept exactly as the engine returned them, so the prompt of
turn k + 1 starts with every id of turn k and the trainer trains the sampled ids (invariant 19). Seeds:
SeedSequence([seed, step, turn]), so a resumed run samples what the uninterrupted one did. The asynchronous engine
replicas run the same runner in their own processes (rollouts/episode_replicas.py): a weight update interrupts it
mid-turn or between turns and the episode continues later from its state (`run(..., interrupt=)`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from nearpolicy.engines.base import RolloutEngine
from nearpolicy.ops.diagnostics import mismatch_by_turn
from nearpolicy.rollouts.base import StepSamples
from nearpolicy.rollouts.inline import InlineRollouts
from nearpolicy.rollouts.episode_state import Episode, error_counts
from nearpolicy.tasks import Problem, Task
from nearpolicy.tools.protocol import MalformedCall, ObservationFraming, parse_tool_call
from nearpolicy.types import GenerationRequest, Rollout, SamplingParams


@dataclass(frozen=True)
class EpisodeLimits:
    """max_turns: model turns per episode; max_tokens: completion tokens (model + inserted) per episode;
    turn_tokens: tokens one turn may sample."""

    max_turns: int
    max_tokens: int
    turn_tokens: int

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.turn_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"episode limits must be >= 1, got {self}")


class EpisodeRunner:
    """Runs episodes turn by turn on an engine: `tokenizer` decodes a turn for the call parser and tokenises tool
    text; `tools` answers calls (a ToolClient: call(name, arguments) -> Observation); `framing` frames the
    observations; `stop_ids` is the engine's complete end-of-generation set (invariant 18)."""

    def __init__(self, tokenizer, tools, framing: ObservationFraming, stop_ids: frozenset[int], limits: EpisodeLimits):
        self.tokenizer, self.tools, self.framing, self.limits = tokenizer, tools, framing, limits
        self.stop_ids = frozenset(stop_ids)
        self.reused_prefill = 0  # prompt tokens the engine did not recompute (KV continuation), since the last read

    def new(self, group_id: int, sample_index: int, prompt_ids: list[int]) -> Episode:
        return Episode(group_id, sample_index, list(prompt_ids), self.limits.max_tokens)

    def run(self, engine: RolloutEngine, episodes: list[Episode], sampling: SamplingParams,
            seed_of_turn: Callable[[int], int], rounds: int | None = None,
            interrupt: Callable[[], bool] | None = None) -> None:
        """Sample every unfinished episode to its end (in place), or for at most `rounds` more turns (a partial
        episode, continued by a later call, e.g. after a weight update); round r's generate call is seeded
        seed_of_turn(r). `interrupt` (a replica's weight update) goes to the engine, which polls it before every
        decode step, and is polled here after every round: a turn it cuts stays open (Episode.open_turn, continued
        by the next call with the rest of its token limit) and the call returns with the episodes where they are."""
        sampling = replace(sampling, max_new_tokens=self.limits.turn_tokens)
        polled = {} if interrupt is None else {"interrupt": interrupt}
        for round_ in range(self.limits.max_turns if rounds is None else min(rounds, self.limits.max_turns)):
            live = [e for e in episodes if not e.done]
            if not live:
                return
            requests = [GenerationRequest(i, e.prefix(), 1, min(self.limits.turn_tokens - e.open_turn, e.budget))
                        for i, e in enumerate(live)]
            turns = engine.generate(requests, sampling, seed_of_turn(round_), **polled)
            for episode, turn in zip(live, turns, strict=True):
                self.reused_prefill += int(turn.extras.get("prefill_reused", 0))
                if turn.finish_reason == "interrupted":
                    episode.add_turn(turn, complete=False)
                else:
                    self._after(episode, turn, engine.version)
            if interrupt is not None and interrupt():
                return

    def run_greedy(self, engine: RolloutEngine, episodes: list[Episode]) -> None:
        """run() with argmax turns (evaluation): no log-probs (None), each turn cut to its episode's budget."""
        for _ in range(self.limits.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                return
            outputs = _greedy_by_limit(engine, live, self.limits.turn_tokens)
            for episode, ids in zip(live, outputs, strict=True):
                finish = "stop" if ids and ids[-1] in self.stop_ids else "length"
                turn = Rollout(episode.group_id, episode.sample_index, list(episode.prefix()), ids, [None] * len(ids),
                               [engine.version] * len(ids), finish)
                self._after(episode, turn, engine.version)

    def _after(self, episode: Episode, turn: Rollout, version: int) -> None:
        """Append the turn, then end the episode or run its tool call and append the observation."""
        episode.add_turn(turn)
        said = episode.last_turn_ids()  # the whole turn: an interrupted turn's earlier ids too
        stopped = bool(said) and said[-1] in self.stop_ids
        call = parse_tool_call(self.tokenizer.decode(said, skip_special_tokens=True))
        if call is None:
            episode.end = "answer" if stopped else "token_budget" if episode.budget == 0 else "length"
            return
        if episode.turns >= self.limits.max_turns:
            episode.end = "turn_limit"
            return
        episode.tool_calls += 1
        if isinstance(call, MalformedCall):
            text = call.reason
            episode.count_error("malformed")
        else:
            observation = self.tools.call(call.name, call.arguments)
            text = observation.text
            if observation.error:
                episode.count_error(observation.error)
        ids = self.framing.observation_ids(self.tokenizer, text, said[-1] if said else None)
        if len(ids) + 1 > episode.budget:  # the observation and at least one token of the next turn
            episode.end = "token_budget"
            return
        episode.add_observation(ids, version)


@dataclass(frozen=True)
class EpisodeSetup:
    """What an EpisodeRunner is built from, picklable, so an engine replica's process builds its own (a ToolClient's
    server process and event-loop thread cannot travel): the tokenizer, the framing, the engine's stop ids, the
    limits, the MCP server command (argv; empty: nearpolicy's own, resolved where the runner is built) and the
    time limit of one call (seconds)."""

    tokenizer: object
    framing: ObservationFraming
    stop_ids: frozenset[int]
    limits: EpisodeLimits
    server: tuple[str, ...] = ()
    call_timeout_s: float = 10.0

    def runner(self) -> EpisodeRunner:
        """A runner with its own ToolClient (its server starts at the first call)."""
        from nearpolicy.tools.client import DEFAULT_SERVER, ToolClient

        tools = ToolClient(self.server or DEFAULT_SERVER, call_timeout_s=self.call_timeout_s)
        return EpisodeRunner(self.tokenizer, tools, self.framing, self.stop_ids, self.limits)


def episode_metrics(episodes: list[Episode], prefix: str = "episode") -> dict[str, float]:
    """Per-step figures of finished episodes: {prefix}/turns_mean, tool_calls_mean, tool_errors (and by kind),
    truncated (fraction not ended by an answer), tokens_mean, observation_tokens_mean; turn{k}/episodes (episodes
    with a turn k), turn{k}/tokens_mean (the model's tokens of turn k), turn{k}/tool_calls."""
    n = max(len(episodes), 1)
    errors = error_counts(episodes)
    out = {f"{prefix}/turns_mean": sum(e.turns for e in episodes) / n,
           f"{prefix}/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
           f"{prefix}/tool_errors": float(sum(errors.values())),
           f"{prefix}/truncated": sum(e.end != "answer" for e in episodes) / n,
           f"{prefix}/tokens_mean": sum(len(e.ids) for e in episodes) / n,
           f"{prefix}/observation_tokens_mean": sum(e.model_mask.count(False) for e in episodes) / n}
    out |= {f"{prefix}/tool_errors_{kind}": float(count) for kind, count in sorted(errors.items())}
    if prefix != "episode":
        return out
    tokens, calls, reached = Counter(), Counter(), Counter()
    for e in episodes:
        reached.update(range(e.turns))
        for k, own in zip(e.turn_index, e.model_mask):
            tokens[k] += own
        calls.update({k for k, own in zip(e.turn_index, e.model_mask) if not own})
    for k in sorted(reached):
        out |= {f"turn{k}/episodes": float(reached[k]), f"turn{k}/tokens_mean": tokens[k] / reached[k],
                f"turn{k}/tool_calls": float(calls[k])}
    return out


class EpisodeSourceParts:
    """What both episode sources share (EpisodeRollouts here, EpisodeReplicaRollouts in rollouts/episode_replicas.py,
    each listing this class first): the per-turn k3 of the last collect's rows, the greedy eval with and without
    the tool, and closing the runner's ToolClient with the source. Needs `runner` (an EpisodeRunner in the trainer's
    process) and `prompt_ids`; `_init_episode_parts` sets the rest."""

    def _init_episode_parts(self, runner: EpisodeRunner, plain_prompt_ids: Callable[[Problem], list[int]],
                            eval_without_tool: bool, plain_tokens: int) -> None:
        self.runner, self.plain_prompt_ids = runner, plain_prompt_ids
        self.eval_without_tool, self.plain_tokens = eval_without_tool, plain_tokens
        self._turns: list[list[int]] = []  # turn_index of each row of the last collect, in collect order

    def _trained_rollouts(self, episodes: list[Episode]) -> list[Rollout]:
        """The finished episodes as the step's Rollouts, in order; remembers their turn index for step_metrics."""
        rollouts = [e.to_rollout(self.runner.stop_ids) for e in episodes]
        self._turns = [r.turn_index for r in rollouts]
        return rollouts

    def step_metrics(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, defined: torch.Tensor,
                     versions: torch.Tensor, version: int) -> dict[str, float]:
        """The source's own step metrics (super()) and mismatch/k3_turn{k} (nats / token) over the model's tokens
        of turn k of the trained batch ([B, T]; its rows are the last collect's rollouts, in order). Raises
        ValueError when B is not the number of episodes of the last collect."""
        if len(self._turns) != old_logprobs.shape[0]:
            raise ValueError(f"step_metrics got {old_logprobs.shape[0]} rows for the {len(self._turns)} episodes "
                             "of the last collect")
        turn = torch.full(old_logprobs.shape, -1, dtype=torch.long)
        for i, row in enumerate(self._turns):
            turn[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        per_turn = mismatch_by_turn(old_logprobs, rollout_logprobs, defined, turn)
        return super().step_metrics(old_logprobs, rollout_logprobs, defined, versions, version) | {
            f"mismatch/k3_turn{k}": float(m["k3"]) for k, m in per_turn.items()}

    def evaluate(self, engine: RolloutEngine, problems: list[Problem],
                 score: Callable[[list[list[int]], str], list]) -> tuple[list[list[int]], list, dict]:
        """Greedy episodes with the tool on `problems`: (each episode's completion ids, the score results of its
        last turn, eval/* metrics: tool calls, errors, turns, well-formed call fraction, and eval/accuracy_no_tool
        from single greedy turns of the plain prompt when eval_without_tool). `score(completions, label)` scores
        response ids (the trainer's bounded scorer)."""
        episodes = [self.runner.new(i, 0, self.prompt_ids(p)) for i, p in enumerate(problems)]
        self.runner.run_greedy(engine, episodes)
        rollouts = [e.to_rollout(self.runner.stop_ids) for e in episodes]
        results = score([r.response_ids() for r in rollouts], "")
        calls = sum(e.tool_calls for e in episodes)
        malformed = sum(e.tool_errors.get("malformed", 0) for e in episodes)
        metrics = episode_metrics(episodes, "eval") | {
            "eval/well_formed_calls": (calls - malformed) / calls if calls else 0.0}
        if self.eval_without_tool:
            plain = engine.greedy([self.plain_prompt_ids(p) for p in problems], self.plain_tokens)
            rewards = np.array([r.reward for r in score(plain, " without the tool")], dtype=float)
            metrics["eval/accuracy_no_tool"] = float(np.nanmean(rewards)) if np.isfinite(rewards).any() else float("nan")
        return [r.completion_ids for r in rollouts], results, metrics

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.runner.tools.close()


class EpisodeRollouts(EpisodeSourceParts, InlineRollouts):
    """A RolloutSource (rollouts/base.py) of tool-use episodes: each step prompts_per_step problems x group_size
    episodes on `engine` (start, publish, eval_engine and state_dict as InlineRollouts). `prompt_ids` templates a
    problem with the episode's system prompt and worked example; `plain_prompt_ids` without them (the no-tool eval,
    when `eval_without_tool`, greedy, `plain_tokens` new tokens). `tools` is closed with the source."""

    def __init__(self, engine: RolloutEngine, weights: Callable[[], object], task: Task,
                 prompt_ids: Callable[[Problem], list[int]], plain_prompt_ids: Callable[[Problem], list[int]],
                 runner: EpisodeRunner, sampling: SamplingParams, group_size: int, prompts_per_step: int, seed: int,
                 eval_without_tool: bool = True, plain_tokens: int = 64):
        super().__init__(engine, weights, task, prompt_ids, sampling, group_size, prompts_per_step, seed)
        self._init_episode_parts(runner, plain_prompt_ids, eval_without_tool, plain_tokens)

    def collect(self, step: int, version: int, data_position: int) -> StepSamples:
        problems = self.step_problems(data_position)
        episodes = [self.runner.new(gid, k, self.prompt_ids(p)) for gid, p in problems.items()
                    for k in range(self.group_size)]
        seed = lambda turn: int(np.random.SeedSequence([self.seed, step, turn]).generate_state(1)[0])  # noqa: E731
        self.runner.reused_prefill = 0
        self.runner.run(self.engine, episodes, self.sampling, seed)
        rollouts = self._trained_rollouts(episodes)
        metrics = episode_metrics(episodes) | {"episode/prefill_reused_tokens": float(self.runner.reused_prefill)}
        metrics |= self.decode_metrics()  # every turn's generate call
        return StepSamples(rollouts, problems, data_position + len(problems), metrics)


def _greedy_by_limit(engine: RolloutEngine, live: list[Episode], turn_tokens: int) -> list[list[int]]:
    """Greedy turns of `live` in order, each at most min(turn_tokens, its budget) tokens: one greedy call per
    distinct limit, so no prompt + limit exceeds what the start-up check allowed (prompt + episode budget)."""
    limits = [min(turn_tokens, e.budget) for e in live]
    outputs: list[list[int]] = [[] for _ in live]
    for limit in sorted(set(limits)):
        rows = [i for i, n in enumerate(limits) if n == limit]
        for i, ids in zip(rows, engine.greedy([list(live[i].prefix()) for i in rows], limit), strict=True):
            outputs[i] = ids[:limit]
    return outputs
