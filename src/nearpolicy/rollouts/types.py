"""What travels between the rollout loop and an engine worker: a segment job out, a segment result back. Both the
scheduler (the loop) and the worker (the engine side) import these; the worker never imports the scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SegmentJob:
    """A scheduler Segment with what the engine needs: the prompt, each sample's tokens so far and the number of
    tokens each may still generate."""

    group_id: int
    sample_indices: tuple[int, ...]
    version: int
    fresh: bool
    prompt_ids: tuple[int, ...]
    prefixes: tuple[tuple[int, ...], ...]  # per sample index, the completion ids generated so far
    remaining: tuple[int, ...]  # per sample index


@dataclass(frozen=True)
class SegmentResult:
    """What an engine returns for one sample of a segment: the new tokens and how the segment ended."""

    group_id: int
    sample_index: int
    version: int  # the segment's version (the engine's weights when it ran)
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str  # "stop", "length" or "interrupted"
