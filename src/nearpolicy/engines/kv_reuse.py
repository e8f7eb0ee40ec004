"""KV continuation for the llama.cpp engine: which cached sequence a new prompt continues.

After each wave the engine keeps every sequence's KV cache and the ids it holds: the prompt and every sampled id but
the last (never decoded). A new prompt that starts with ALL the ids a cached sequence holds, and that sequence
holds at least one sampled id, continues it: the next turn of a multi-turn episode (prompt + turn + observation).
Its cache is kept and only the prompt's new tail is decoded. Nothing else is reused: a repeated or merely similar
prompt is prefilled from scratch, so single-turn sampling is exactly as before. The kept key/values are the ones the
engine computed while sampling; recomputing them in a prefill gives the same values up to float rounding (the
batch shape changes the kernels' summation order), so continuation changes log-probs by rounding only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cached:
    """The ids one KV sequence holds, and how many of them were its prompt."""

    ids: tuple[int, ...]
    prompt_length: int


@dataclass(frozen=True)
class SlotPlan:
    """slots[i]: the KV sequence id new sequence i decodes into; reused[i]: tokens of its prompt already in that
    sequence's cache (0: prefilled from scratch, and its slot is cleared first)."""

    slots: list[int]
    reused: list[int]


def plan_slots(cached: dict[int, Cached], prompts: list[tuple[int, ...]], leaders: list[bool], n_slots: int) -> SlotPlan:
    """Assign KV slots to new sequences (prompts [n] in order; leaders[i]: the first sequence of its request, the
    one that prefills; the others copy it). A leader takes the cached slot with the longest held ids that its prompt
    starts with (at least one sampled id held, slot not taken), reusing all but the prompt's last token at most (its
    logits must be computed); the other leaders, then the other sequences, take the lowest free slots (the prefill's
    streams consecutive: llama.cpp decodes them in one micro-batch). Raises ValueError for more sequences than
    n_slots."""
    if len(prompts) > n_slots:
        raise ValueError(f"{len(prompts)} sequences for {n_slots} KV slots")
    slots: list[int | None] = [None] * len(prompts)
    reused = [0] * len(prompts)
    candidates = sorted((c for c in cached.items() if len(c[1].ids) > c[1].prompt_length), key=lambda c: -len(c[1].ids))
    taken: set[int] = set()
    for i, (prompt, lead) in enumerate(zip(prompts, leaders)):
        if not lead:
            continue
        for slot, held in candidates:
            if slot not in taken and len(held.ids) < len(prompt) + 1 and prompt[: len(held.ids)] == held.ids:
                slots[i], reused[i] = slot, min(len(held.ids), len(prompt) - 1)
                taken.add(slot)
                break
    free = iter(s for s in range(n_slots) if s not in taken)
    for i in sorted(range(len(prompts)), key=lambda i: not leaders[i]):  # leaders first: one prefill micro-batch
        if slots[i] is None:
            slots[i] = next(free)
    return SlotPlan(slots, reused)  # type: ignore[arg-type]
