"""One multi-turn episode's token-level state, kept verbatim across turns (invariant 19): the ids so far (the model's
turns and the inserted observations, in order), the engine log-prob of each sampled id (None for inserted ids), the
policy version of each token, which tokens are the model's, the turn of each token, and the budget left. It
serialises to a plain dict and back (`to_dict` / `from_dict`), so a partial episode resumes with its masks and
versions intact: tokens sampled after the resume carry the engine's version then (slime #1440: a loss mask whose
length disagreed with the resumed ids). A turn cut by a weight update (an asynchronous replica's interrupt) stays
open: its ids are kept and the next segment continues the same turn (`open_turn`)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from nearpolicy.types import FinishReason, Rollout

ENDS = ("answer", "turn_limit", "token_budget", "length")
"""Why an episode ended: answer (a turn without a tool call that stopped), turn_limit (a call with no turn left),
token_budget (the observation would not fit the episode's budget, or none is left), length (a turn cut by its
token limit without a call)."""


@dataclass
class Episode:
    """The state of one episode of group `group_id` (its data position), sample `sample_index` of the group.

    prompt_ids   [P] the templated prompt (system, any worked example, the question), generation prompt included
    ids          [T] every completion id so far; the prompt of the next turn is prompt_ids + ids
    logprobs     [T] engine log-prob (nats) of each sampled id; None for inserted (tool / template) ids
    versions     [T] policy version of each token (an inserted id carries the version of the turn before it)
    model_mask   [T] True where the model sampled the id
    turn_index   [T] 0-based turn of each id; the observation after turn k carries k
    budget       completion tokens (model + inserted) the episode may still add
    open_turn    model ids of turn `turns` sampled before an interruption (0: no turn open); the turn goes on
    """

    group_id: int
    sample_index: int
    prompt_ids: list[int]
    budget: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    turns: int = 0  # model turns completed
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)  # error kind -> count
    end: str | None = None  # one of ENDS once the episode is over
    open_turn: int = 0

    def __post_init__(self) -> None:
        n = len(self.ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.model_mask) == len(self.turn_index) == n):
            raise ValueError(f"episode of group {self.group_id}: {n} ids but {len(self.logprobs)} log-probs, "
                             f"{len(self.versions)} versions, {len(self.model_mask)} mask and "
                             f"{len(self.turn_index)} turn entries")
        if self.budget < 0:
            raise ValueError(f"episode of group {self.group_id}: negative token budget {self.budget}")
        if not 0 <= self.open_turn <= n:
            raise ValueError(f"episode of group {self.group_id}: an open turn of {self.open_turn} ids in {n} ids")
        if self.end is not None and self.end not in ENDS:
            raise ValueError(f"episode of group {self.group_id}: unknown end {self.end!r}; one of {ENDS}")

    @property
    def done(self) -> bool:
        return self.end is not None

    def prefix(self) -> tuple[int, ...]:
        """The next turn's prompt: every prompt and completion id so far, verbatim."""
        return tuple(self.prompt_ids) + tuple(self.ids)

    def add_turn(self, turn: Rollout, complete: bool = True) -> None:
        """Append one turn as the engine sampled it (its ids, log-probs and versions unchanged); `complete` False:
        the turn was interrupted and stays open (the next add_turn continues it, with the same turn index). Raises
        ValueError when the turn does not continue this episode's prefix or exceeds the budget."""
        if tuple(turn.prompt_ids) != self.prefix():
            raise ValueError(f"episode of group {self.group_id}: the turn was sampled after another prompt")
        if len(turn.completion_ids) > self.budget:
            raise ValueError(f"episode of group {self.group_id}: a turn of {len(turn.completion_ids)} tokens exceeds "
                             f"the {self.budget} left")
        n = len(turn.completion_ids)
        self.ids += turn.completion_ids
        self.logprobs += turn.rollout_logprobs
        self.versions += turn.versions
        self.model_mask += [True] * n
        self.turn_index += [self.turns] * n
        self.budget -= n
        if complete:
            self.turns, self.open_turn = self.turns + 1, 0
        else:
            self.open_turn += n

    def add_observation(self, ids: list[int], version: int) -> None:
        """Append inserted ids (a tool result with its framing) after the last turn: no log-prob, not the
        model's, the last turn's index. Raises ValueError when they exceed the budget."""
        if self.open_turn:
            raise ValueError(f"episode of group {self.group_id}: an observation inside an open turn")
        if len(ids) > self.budget:
            raise ValueError(f"episode of group {self.group_id}: {len(ids)} observation ids exceed the {self.budget} left")
        self.ids += ids
        self.logprobs += [None] * len(ids)
        self.versions += [version] * len(ids)
        self.model_mask += [False] * len(ids)
        self.turn_index += [max(self.turns - 1, 0)] * len(ids)
        self.budget -= len(ids)

    def count_error(self, kind: str) -> None:
        self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    def last_turn_ids(self) -> list[int]:
        """The model's ids of the last turn."""
        last = self.turns - 1
        return [t for t, k, own in zip(self.ids, self.turn_index, self.model_mask) if own and k == last]

    def finish(self, stop: frozenset[int]) -> FinishReason:
        """How the finished episode's sequence ends: "stop" when its last id is in `stop`, else "length"."""
        return "stop" if self.ids and self.ids[-1] in stop else "length"

    def to_rollout(self, stop: frozenset[int]) -> Rollout:
        """The finished episode as one Rollout (model_mask and turn_index set; finish as `finish(stop)`);
        extras["episode"] holds its turns, calls, errors and end."""
        return Rollout(self.group_id, self.sample_index, list(self.prompt_ids), list(self.ids), list(self.logprobs),
                       list(self.versions), self.finish(stop), model_mask=list(self.model_mask), turn_index=list(self.turn_index),
                       extras={"episode": {"turns": self.turns, "tool_calls": self.tool_calls,
                                           "tool_errors": dict(self.tool_errors), "end": self.end}})

    def to_dict(self) -> dict:
        """Plain JSON-able state (a non-finite log-prob would not survive JSON: there is none, engines report
        finite values and inserted ids None)."""
        return {"group_id": self.group_id, "sample_index": self.sample_index, "prompt_ids": list(self.prompt_ids),
                "budget": self.budget, "ids": list(self.ids), "logprobs": list(self.logprobs),
                "versions": list(self.versions), "model_mask": list(self.model_mask),
                "turn_index": list(self.turn_index), "turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": dict(self.tool_errors), "end": self.end, "open_turn": self.open_turn}

    @classmethod
    def from_dict(cls, data: dict) -> "Episode":
        """The episode `to_dict` wrote. Raises ValueError for missing keys or inconsistent lengths."""
        missing = sorted({"group_id", "sample_index", "prompt_ids", "budget", "ids", "logprobs", "versions",
                          "model_mask", "turn_index", "turns"} - set(data))
        if missing:
            raise ValueError(f"episode state lacks {missing}")
        logprobs = [None if lp is None else float(lp) for lp in data["logprobs"]]
        if any(lp is not None and not math.isfinite(lp) for lp in logprobs):
            raise ValueError("episode state holds a non-finite log-prob")
        return cls(int(data["group_id"]), int(data["sample_index"]), [int(t) for t in data["prompt_ids"]],
                   int(data["budget"]), [int(t) for t in data["ids"]], logprobs, [int(v) for v in data["versions"]],
                   [bool(m) for m in data["model_mask"]], [int(k) for k in data["turn_index"]], int(data["turns"]),
                   int(data.get("tool_calls", 0)), dict(data.get("tool_errors", {})), data.get("end"),
                   int(data.get("open_turn", 0)))


def error_counts(episodes: list[Episode]) -> Counter:
    """Tool errors by kind over `episodes`."""
    total: Counter = Counter()
    for e in episodes:
        total.update(e.tool_errors)
    return total
