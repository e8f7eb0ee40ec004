"""Sequential stopping for an arena (arena.sequential = true): run the seeds one after another and stop when every
comparison is settled. The rule is pure (`judge`, `decide`: numbers in, a decision out); the runner (runner.py) feeds
it the stored results after each seed and records its looks in OUT/arena-sequential.json (`record`, `write_record`),
which the page shows (`page_markdown`, `page_html`).

The rule. An arena lists S seeds (the most it will run) and min_seeds = m (>= 3). Its cells run seed-major (every
cell of the first seed, then of the next), so after each seed every arm has the same seeds. After the i-th seed,
i = m .. S, the rule takes look j = i - m + 1 of K = S - m + 1 planned looks, over the first i seeds of the list,
at the two-sided level alpha / K (alpha = ALPHA = 0.05); later seeds' results, if any cell of them ran (an
earlier sitting without the rule), are left out of the look. For each comparison the rule waits for
(arena.stop_for, stop_settings.py; default every one of keys.arm_pairs) of the chosen outcome
(arena.stop_on), paired over the matched seeds (paired.paired_seeds: difference d, SE with the eval set's floor,
df = n - 1):

- CI_j = d +- t_{1 - alpha / (2K), df} x SE, MDE_j = M(alpha / K, df) x SE (M below);
- the comparison is settled at look j as an **effect** when CI_j excludes 0, or as a **null** when CI_j contains 0
  and MDE_j <= arena.target_mde (a null with enough power: a true difference of target_mde would have been detected
  with probability >= 0.80 at this look's level). Without a paired result (fewer than 3 matched seeds, an arm
  without an accuracy) or with SE ~ 0 (no spread to bound it: paired.verdict's "not established") it is not settled.
- A comparison stays settled at the first look that settles it (its verdict is that look's); the arena stops before
  the next seed once every comparison it waits for is settled, and the remaining seeds' cells are recorded as
  "skipped". The comparisons it does not wait for are not judged by the rule; the page reports them with their
  fixed-sample 95 % CIs like every comparison.

Error rate. For one comparison with no true difference, each look falsely excludes 0 with probability alpha / K
(the paired t interval at that level: exact for normal per-seed differences, at most that with the eval set's floor,
which only widens it; the looks are dependent, they share seeds), so by the union bound (Bonferroni
over the K looks) the probability that any look declares a false effect is <= K x alpha / K = alpha = 0.05. Stopping
for the null (futility) only removes later looks, so it cannot raise that rate. The bound is per comparison, not
adjusted for the number of comparisons (as comparisons.py's fixed-sample CIs are not). A "null" is a statement of
power, not of equality: the MDE treats the observed SE as the true one (Bloom 1995, Evaluation Review 19(5),
547-556), so its false-null rate is not bounded by this rule.

Quantiles and the MDE multiplier at any level: ops/t_quantiles.py (t_quantile, mde_multiplier), without scipy."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from nearpolicy.arena.paired import NO_SPREAD, Paired
from nearpolicy.arena.spec import ArenaSpec
from nearpolicy.ops.t_quantiles import mde_multiplier, t_quantile

ALPHA = 0.05
RECORD = "arena-sequential.json"
FORMAT = 1


@dataclass(frozen=True)
class Rule:
    """The rule's numbers: `max_seeds` seeds listed, looks from `min_seeds` on, a null settled when its MDE is at
    most `target_mde` (accuracy units), family level `alpha` per comparison over the looks."""

    max_seeds: int
    min_seeds: int
    target_mde: float
    alpha: float = ALPHA

    @property
    def looks(self) -> int:
        """K = max_seeds - min_seeds + 1, the planned looks."""
        return self.max_seeds - self.min_seeds + 1

    @property
    def level(self) -> float:
        """alpha / K: each look's two-sided level (Bonferroni over the looks)."""
        return self.alpha / self.looks


@dataclass(frozen=True)
class Judgment:
    """One comparison at one look at `level`: its outcome ("effect", "null", or None: not settled), the paired
    difference, its CI (low, high) and MDE at that level, the matched seeds, and why it is not settled (None when
    it is)."""

    label: str
    outcome: str | None
    difference: float | None = None
    low: float | None = None
    high: float | None = None
    mde: float | None = None
    seeds: int = 0
    reason: str | None = None


def judge(label: str, paired: Paired | None, level: float, target_mde: float, why_none: str | None = None
          ) -> Judgment:
    """Judge one comparison at a two-sided `level` (module docstring): CI d +- t_{1 - level / 2, df} SE and MDE
    M(level, df) SE from `paired` (paired.paired_seeds's result: difference, se, df); settled as "effect" when the
    CI excludes 0, as "null" when it contains 0 and the MDE is <= target_mde, else not settled (None). `paired`
    None: not settled, `why_none` the reason; an SE <= NO_SPREAD (every seed's difference the same): not settled."""
    if paired is None or paired.df is None:
        return Judgment(label, None, reason=why_none or "no paired result over seeds")
    if paired.se <= NO_SPREAD:
        return Judgment(label, None, paired.difference, paired.difference, paired.difference, 0.0, paired.seeds,
                        "not established: every seed's difference is the same (sd 0)")
    half = t_quantile(1.0 - level / 2.0, paired.df) * paired.se
    mde = mde_multiplier(level, paired.df) * paired.se
    low, high = paired.difference - half, paired.difference + half
    if low > 0 or high < 0:
        outcome, reason = "effect", None
    elif mde <= target_mde:
        outcome, reason = "null", None
    else:
        outcome, reason = None, f"CI contains 0 and MDE {mde:.3f} > target {target_mde:.3f}"
    return Judgment(label, outcome, paired.difference, low, high, mde, paired.seeds, reason)


@dataclass(frozen=True)
class Verdict:
    """A comparison after the looks so far: `settled_at` the first look that settled it (None: none yet) with that
    look's judgment `settled`, and `now` the latest look's judgment."""

    label: str
    settled_at: int | None
    settled: Judgment | None
    now: Judgment


@dataclass(frozen=True)
class Decision:
    """The rule after look `look` of `looks` (over `seeds`, at `level`): each comparison's verdict and whether
    every comparison is settled (`stop`: run no further seed)."""

    look: int
    looks: int
    level: float
    seeds: tuple[int, ...]
    verdicts: tuple[Verdict, ...]

    @property
    def stop(self) -> bool:
        return bool(self.verdicts) and all(v.settled_at is not None for v in self.verdicts)


def decide(rule: Rule, history: list[list[Judgment]], seeds: tuple[int, ...]) -> Decision:
    """The decision after the looks `history` (history[j - 1]: every comparison's judgment at look j, in the same
    order at every look; the last is the current look, over `seeds`): a comparison is settled at the first look
    whose judgment has an outcome; stop when every one is. Raises ValueError for an empty history, more looks than
    the rule plans, or looks that judge different comparisons."""
    if not history or len(history) > rule.looks:
        raise ValueError(f"decide needs 1 to {rule.looks} looks, got {len(history)}")
    labels = [j.label for j in history[-1]]
    if any([j.label for j in look] != labels for look in history):
        raise ValueError("every look must judge the same comparisons in the same order")
    verdicts = []
    for i, label in enumerate(labels):
        first = next((n for n, look in enumerate(history, 1) if look[i].outcome is not None), None)
        verdicts.append(Verdict(label, first, history[first - 1][i] if first else None, history[-1][i]))
    return Decision(len(history), rule.looks, rule.level, tuple(seeds), tuple(verdicts))


def said(j: Judgment, level: float, target_mde: float) -> str:
    """'difference detected: +0.050 (98.3 % CI [+0.020, +0.080], MDE 0.040)', 'no difference detected, MDE 0.031
    <= target 0.050 (98.3 % CI [...])' or 'not settled: <reason>'."""
    if j.outcome is None:
        return f"not settled: {j.reason}"
    ci = f"{100 * (1 - level):.1f} % CI [{j.low:+.3f}, {j.high:+.3f}]"
    if j.outcome == "effect":
        return f"difference detected: {j.difference:+.3f} ({ci}, MDE {j.mde:.3f})"
    return f"no difference detected, MDE {j.mde:.3f} <= target {target_mde:.3f} ({ci}, difference {j.difference:+.3f})"


def verdict_lines(decision: Decision, target_mde: float) -> list[str]:
    """One line per comparison: its settled verdict and the look that settled it (and the latest look's, when that
    differs), or why it is not settled."""
    lines = []
    for v in decision.verdicts:
        if v.settled is None:
            lines.append(f"{v.label}: {said(v.now, decision.level, target_mde)}")
            continue
        line = f"{v.label} settled at look {v.settled_at}: {said(v.settled, decision.level, target_mde)}"
        if v.settled_at != decision.look and v.now.outcome != v.settled.outcome:
            line += f"; at look {decision.look}: {said(v.now, decision.level, target_mde)}"
        lines.append(line)
    return lines


def _waiting(stop_for) -> str:
    """' it waits for (arena.stop_for): a; b' or '' (every comparison)."""
    return f"; the comparisons it waits for (arena.stop_for): {'; '.join(stop_for)}" if stop_for else ""


def rule_lines(rule: Rule, stop_on: str, stop_for: tuple[str, ...] = ()) -> list[str]:
    """The rule in words for --dry-run: K, the per-look level, the target MDE, the comparisons it waits for (every
    one unless arena.stop_for names some), each look's t and MDE multipliers."""
    looks = "; ".join(f"look {j} after {rule.min_seeds + j - 1} seeds: t {t_quantile(1 - rule.level / 2, df):.3f}, "
                      f"MDE {mde_multiplier(rule.level, df):.3f} x SE"
                      for j, df in ((j, rule.min_seeds + j - 2) for j in range(1, rule.looks + 1)))
    return [f"sequential stopping on the {stop_on} outcome: K = {rule.looks} look(s) ({rule.max_seeds} seeds listed, "
            f"min_seeds {rule.min_seeds}), each at two-sided level {rule.alpha} / {rule.looks} = {rule.level:.4f} "
            f"(Bonferroni: false effect <= {rule.alpha} per comparison); settled when the CI excludes 0, or contains "
            f"0 with MDE (80 % power) <= target {rule.target_mde}; cells run seed by seed{_waiting(stop_for)}",
            looks]


def record(rule: Rule, stop_on: str, decisions: list[Decision], skipped: list[str] | None,
           stop_for: tuple[str, ...] = ()) -> dict:
    """The JSON record of the looks taken (OUT/arena-sequential.json): the rule (with the comparisons it waits for,
    `stop_for`, [] for all), every look's decision over those comparisons, and, when the last look stopped the
    arena before its last seed, `stopped` with the cells it skipped (`skipped` None: no stop; [] a stop whose
    later cells had all run already)."""
    last = decisions[-1] if decisions else None
    return {"format": FORMAT, "rule": asdict(rule) | {"looks": rule.looks, "level": rule.level, "stop_on": stop_on,
                                                      "stop_for": list(stop_for)},
            "looks": [asdict(d) | {"stop": d.stop} for d in decisions],
            "stopped": None if last is None or skipped is None else
            {"look": last.look, "after_seeds": list(last.seeds), "skipped": skipped}}


def write_record(out: Path, data: dict) -> None:
    """Write `data` (record()) to OUT/arena-sequential.json atomically (runs.folder.write_json)."""
    from nearpolicy.runs.folder import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / RECORD, data)


def read_record(out: Path) -> dict | None:
    """OUT/arena-sequential.json, or None when absent or unreadable (the page then shows no sequential section)."""
    try:
        return json.loads((Path(out) / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def page_lines(data: dict) -> list[str]:
    """Plain lines for the page from a record (read_record): the rule, the last look's state, then one line per
    comparison (verdict_lines)."""
    rule, looks = data["rule"], data["looks"]
    head = (f"Rule: K = {rule['looks']} looks from {rule['min_seeds']} of {rule['max_seeds']} seeds, each at two-sided "
            f"level {rule['level']:.4f} (alpha {rule['alpha']} / K: Bonferroni over the looks, so a false 'difference "
            f"detected' has probability <= {rule['alpha']} per comparison), outcome {rule['stop_on']}, a null settled "
            f"at MDE <= {rule['target_mde']}{_waiting(rule.get('stop_for'))}. The CIs below are at that level, "
            f"not 95 %.")
    if not looks:
        return [head, "No look taken yet."]
    last, stopped = looks[-1], data.get("stopped")
    seeds = ", ".join(map(str, last["seeds"]))
    if stopped:
        state = (f"Stopped after look {last['look']} (seeds {seeds}): every comparison it waits for settled; "
                 f"skipped: {', '.join(stopped['skipped']) or 'none (the later cells had run already)'}.")
    else:
        state = (f"Last look {last['look']} of {last['looks']} over seeds {seeds}: "
                 f"{'every' if last['stop'] else 'not every'} comparison it waits for settled.")
    decision = Decision(last["look"], last["looks"], last["level"], tuple(last["seeds"]), tuple(
        Verdict(v["label"], v["settled_at"], Judgment(**v["settled"]) if v["settled"] else None, Judgment(**v["now"]))
        for v in last["verdicts"]))
    return [head, state] + verdict_lines(decision, rule["target_mde"])


def changed_stop_for(spec: ArenaSpec) -> str | None:
    """'arena.stop_for changed since the recorded looks (was ..., now ...)' when OUT/arena-sequential.json's looks
    waited for other comparisons than the arena file's arena.stop_for now names; None otherwise (or without a
    record or a rule)."""
    data = read_record(spec.out) if spec.sequential is not None else None
    return _stop_for_change(spec, data) if data is not None else None


def _stop_for_change(spec: ArenaSpec, data: dict) -> str | None:
    """changed_stop_for's sentence from a record already read."""
    if not isinstance(data.get("rule"), dict):
        return None
    before, now = list(data["rule"].get("stop_for") or []), list(spec.sequential.stop_for)
    if before == now:
        return None
    said = lambda labels: "; ".join(labels) if labels else "every comparison"  # noqa: E731
    return f"arena.stop_for changed since the recorded looks (was: {said(before)}; now: {said(now)})"


def _section_lines(spec: ArenaSpec) -> list[str] | None:
    """page_lines of the record (read once), the state line marked stale when arena.stop_for changed since; None
    without a record or when the arena's rule is off (a record left from a sequential sitting is then stale)."""
    data = read_record(spec.out) if spec.sequential is not None else None
    if data is None:
        return None
    lines = page_lines(data)
    if (changed := _stop_for_change(spec, data)) is not None:
        lines[1] += f" Stale: {changed}; running the arena again retakes the looks."
    return lines


def page_markdown(spec: ArenaSpec) -> list[str]:
    """The page's "Sequential stopping" section (markdown lines) from OUT/arena-sequential.json; [] where
    _section_lines gives None."""
    lines = _section_lines(spec)
    if lines is None:
        return []
    return ["", "## Sequential stopping", "", lines[0], "", lines[1], ""] + [f"- {line}" for line in lines[2:]]


def page_html(spec: ArenaSpec) -> str:
    """The same section as HTML ('' where page_markdown gives [])."""
    import html

    lines = _section_lines(spec)
    if lines is None:
        return ""
    lines = [html.escape(line) for line in lines]
    items = "".join(f"<li>{line}</li>" for line in lines[2:])
    return f"<h2>Sequential stopping</h2><p>{lines[0]}</p><p>{lines[1]}</p><ul>{items}</ul>"
