"""The arena file's names and keys (spec.py parses the file with them), its one error type, and which arms an arena
compares (`arm_pairs`) under which label (`pair_label`): the page, the paired comparisons and the sequential rule's
arena.stop_for all name a comparison the same way. No imports from the rest of the arena package."""

from __future__ import annotations

import re

OUTCOME_NAMES = ("final", "best", "auc", "late_reward")  # the outcomes an arena compares (comparisons.OUTCOMES)

NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]|_(?!_))*(?<![._-])$")
"""Arm names: letters, digits, '.', '-', '_'; starting and ending with a letter or digit, no '__' (the cell folder
joins the names with '__', so no two cells can share a folder)."""
OWNED_KEYS = ("run.seed", "run.name", "run.output_dir")
ARENA_KEYS = ("base", "seeds", "set", "out", "baseline", "keep_checkpoints", "step_seconds", "eval_seconds",
              "start_seconds", "vary", "late_steps", "sequential", "target_mde", "min_seeds", "stop_on",
              "stop_for")
SAME_KEYS = ("run.steps", "logging.eval_every", "logging.eval_policy", "sampling.max_new_tokens",
             "algorithm.prompts_per_step", "algorithm.group_size")
"""The budget and the held-out eval: every cell must agree on these (and on every task.* key) unless arena.vary
lists the key (task.* never: the held-out set must be the same problems), except DRAW_KEYS."""
DRAW_KEYS = ("mixture", "mixture_decay", "mixture_floor")
"""task.* keys that only choose which training problems a step draws (the held-out eval is the same): arms may
differ in them."""
TOP_KEYS = ("arena", "corrections", "sources", "override")


class ArenaError(ValueError):
    """An arena file that cannot be run: bad TOML, a missing base file, a repeated or unusable name or seed, an
    unknown key (named), or a cell whose config does not validate (the ConfigError's message, with the arm named)."""


def arm_pairs(corrections: list[str], sources: list[str], baseline: str) -> list[tuple[tuple[str, str], ...]]:
    """The (arm, base) pairs compared, each arm a (correction, source): each correction but the baseline against the
    baseline under each source, then each source but the first against the first for each correction."""
    pairs = [((c, s), (baseline, s)) for s in sources for c in corrections if c != baseline]
    return pairs + [((c, s), (c, sources[0])) for c in corrections for s in sources[1:]]


def pair_label(arm: tuple[str, str], base: tuple[str, str]) -> str:
    """'tis vs off under q4_1' (two corrections under one source) or 'bypass: eta4 vs eta1' (two sources)."""
    if arm[1] == base[1]:
        return f"{arm[0]} vs {base[0]} under {arm[1]}"
    return f"{arm[0]}: {arm[1]} vs {base[1]}"
