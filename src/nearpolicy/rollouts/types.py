"""What travels between the rollout loop and an engine worker: a segment job out, a segment result back. Both the
scheduler (the loop) and the worker (the engine side) import these; the worker never imports the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from nearpolicy.rollouts.episode_state import Episode


@dataclass(frozen=True)
class SegmentJob:
    """A scheduler Segment with what the engine needs: the prompt, each sample's tokens so far and the number of
    tokens each may still generate; in a tool-use run, each sample's episode so far (None: not begun)."""

    group_id: int
    sample_indices: tuple[int, ...]
    version: int
    fresh: bool
    prompt_ids: tuple[int, ...]
    prefixes: tuple[tuple[int, ...], ...]  # per sample index, the completion ids generated so far
    remaining: tuple[int, ...]  # per sample index
    episodes: tuple[Episode | None, ...] = ()  # per sample index; () when the run has no episodes


@dataclass(frozen=True)
class SegmentResult:
    """What an engine returns for one sample of a segment: the new tokens and how the segment ended; in a tool-use
    run, the sample's whole episode after the segment (its new ids are the model's and the observations', an
    observation's log-prob None; None when the segment never ran)."""

    group_id: int
    sample_index: int
    version: int  # the segment's version (the engine's weights when it ran)
    completion_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    finish: str  # "stop", "length" or "interrupted"
    episode: Episode | None = None
