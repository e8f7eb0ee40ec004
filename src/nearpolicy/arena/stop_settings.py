"""arena.sequential's settings (the keys below; sequential.py has the rule they configure):

    sequential = true                # run seed by seed, stop once every comparison the rule waits for is settled
    target_mde = 0.05                # a CI containing 0 with an MDE <= this settles as a null (in (0, 1); required)
    min_seeds = 3                    # the first look after this many seeds (>= 3; the seeds listed are the most run)
    stop_on = "final"                # the outcome the rule judges (one of OUTCOME_NAMES)
    stop_for = ["tis vs off under q4_1"]   # the comparisons the rule waits for, by the page's labels (default: all)

stop_for names the comparisons the question needs: the arena stops once those are settled, whatever the others
(which the page still reports, with their fixed-sample CIs). Each label is one of the arena's comparisons
(keys.arm_pairs, labelled by keys.pair_label: 'CORRECTION vs BASELINE under SOURCE' or 'CORRECTION: SOURCE vs
FIRST_SOURCE'); the rule's error rate is per comparison either way (sequential.py). With sequential = false the
keys are validated but have no effect (so the rule can be turned off and on without editing them).
A changed stop_for is not refused: the next run warns and retakes the looks, and the page marks the stored looks
stale until then."""

from __future__ import annotations

from dataclasses import dataclass

from nearpolicy.arena.keys import OUTCOME_NAMES, ArenaError, arm_pairs, pair_label


@dataclass(frozen=True)
class Sequential:
    """arena.sequential = true's settings: a comparison of the `stop_on` outcome is settled as a null when its CI
    contains 0 and its MDE is <= `target_mde`; looks start after `min_seeds` seeds; the rule waits for the
    comparisons labelled in `stop_for` (empty: every comparison)."""

    target_mde: float
    min_seeds: int = 3
    stop_on: str = "final"
    stop_for: tuple[str, ...] = ()

    def waits_for(self, label: str) -> bool:
        """Whether the rule waits for the comparison labelled `label` (keys.pair_label)."""
        return not self.stop_for or label in self.stop_for


def parse_sequential(arena: dict, seeds: int, corrections: list[str], sources: list[str], baseline: str
                     ) -> Sequential | None:
    """arena.sequential's settings when it is true (None when false or absent), for an arena of `seeds` seeds and
    these arm names; target_mde, min_seeds, stop_on and stop_for are validated either way. Raises ArenaError naming
    the key: sequential not a boolean, target_mde not in (0, 1) (or missing with sequential = true), min_seeds not
    an integer >= 3 (and, when on, at most the seeds listed), stop_on not one of OUTCOME_NAMES, stop_for not a
    non-empty list of distinct labels of the arena's comparisons (the valid ones are listed)."""
    on = arena.get("sequential", False)
    if not isinstance(on, bool):
        raise ArenaError(f"arena.sequential must be true or false, got {on!r}")
    target = arena.get("target_mde")
    if target is None and on:
        raise ArenaError("arena.target_mde is required with arena.sequential = true: the MDE (accuracy units, in "
                         "(0, 1), e.g. 0.05) at which a comparison whose CI contains 0 counts as settled")
    if target is not None and not (isinstance(target, (int, float)) and not isinstance(target, bool)
                                   and 0 < target < 1):
        raise ArenaError(f"arena.target_mde must be a number in (0, 1) (an MDE in accuracy units), got {target!r}")
    least = arena.get("min_seeds", 3)
    if not (isinstance(least, int) and not isinstance(least, bool) and 3 <= least <= (seeds if on else least)):
        raise ArenaError(f"arena.min_seeds must be an integer >= 3 and at most the {seeds} seeds listed in "
                         f"arena.seeds (the first look is after min_seeds seeds), got {least!r}")
    stop_on = arena.get("stop_on", "final")
    if stop_on not in OUTCOME_NAMES:
        raise ArenaError(f"arena.stop_on must be one of {', '.join(OUTCOME_NAMES)} (the outcome the rule judges), "
                         f"got {stop_on!r}")
    labels = [pair_label(arm, base) for arm, base in arm_pairs(corrections, sources, baseline)]
    if on and not labels:
        raise ArenaError("arena.sequential = true needs a comparison to judge: list two corrections or two sources "
                         "(this arena has one of each)")
    stop_for = _stop_for(arena.get("stop_for"), labels)
    return Sequential(float(target), least, stop_on, stop_for) if on else None


def _stop_for(value, labels: list[str]) -> tuple[str, ...]:
    """arena.stop_for as a tuple of labels (() when absent). Raises ArenaError unless it is a non-empty list of
    distinct strings, each one of `labels`."""
    if value is None:
        return ()
    valid = "; ".join(repr(label) for label in labels)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ArenaError(f"arena.stop_for must be a non-empty list of comparison labels (the rule waits for these; "
                         f"omit it to wait for all), got {value!r}; this arena's comparisons: {valid}")
    if len(set(value)) != len(value):
        raise ArenaError(f"arena.stop_for lists a comparison twice: {value!r}")
    for label in value:
        if label not in labels:
            raise ArenaError(f"arena.stop_for: {label!r} is not one of this arena's comparisons: {valid}")
    return tuple(value)
