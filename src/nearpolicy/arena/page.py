"""The arena's page: OUT/arena.md (the tables and the paired comparisons of every outcome: final and best accuracy,
eval AUC, late training reward), OUT/arena.json (every number) and
OUT/arena.html (the same tables and, per mismatch source, eval accuracy and k3 over steps for every cell: one colour
per correction, one line per seed; matplotlib figures embedded as base64 PNGs, like runs/report.py, so the file needs
nothing beside it)."""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import asdict

from matplotlib.figure import Figure

from nearpolicy.arena import sequential
from nearpolicy.arena.comparisons import METHOD, OUTCOMES, PairedComparison, paired_comparisons
from nearpolicy.arena.paired import NO_SPREAD, Paired, verdict
from nearpolicy.arena.spec import ArenaSpec
from nearpolicy.arena.state import ArenaState
from nearpolicy.arena.table import Aggregate, CellResult, arena_results, duration, spread_statements
from nearpolicy.runs.folder import write_json

COLUMNS = ("correction", "source", "seeds", "final accuracy", "best accuracy", "eval AUC", "late reward", "diverged",
           "median k3", "tokens changed", "s/step", "final: seed sd vs eval-set sd")


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None or value != value else format(value, fmt)


def _mean_sd(pair: tuple[float | None, float | None], a: Aggregate | None = None) -> str:
    """'mean ± sd', marked when the mean includes a diverged seed (a collapsed run's accuracy)."""
    mean, sd = pair
    if mean is None:
        return "n/a"
    said = f"{mean:.3f} ± {sd:.3f}" if sd is not None else f"{mean:.3f} (1 seed)"
    return said + (f" (incl. {a.diverged_in_mean} diverged)" if a is not None and a.diverged_in_mean else "")


def _other_mean_sd(pair: tuple[float | None, float | None], k: int, a: Aggregate) -> str:
    """'mean ± sd' of the eval AUC or late reward over its k seeds, the count said when it is not the n of the final
    accuracy's mean."""
    return _mean_sd(pair) + (f" ({k} of {a.finished} seeds)" if pair[0] is not None and k != a.n else "")


def eval_sd(mean: float, eval_size: int) -> float:
    """The binomial sd sqrt(p (1 - p) / eval_size) of one accuracy p on eval_size problems (table.arm_se's floor)."""
    return math.sqrt(mean * (1 - mean) / max(eval_size, 1))


def aggregate_row(a: Aggregate, eval_size: int) -> list[str]:
    """The long table's cells for one correction x source (COLUMNS): means ± sd over the seeds; the last compares the
    seeds' sd of the final accuracy with the binomial sd of one accuracy on the eval set ('eval set' marks the larger
    one)."""
    seeds = f"{a.n}/{a.seeds}" + (f" ({a.failed} failed or not run)" if a.failed else "")
    mean, sd = a.final
    noise = "-" if mean is None or sd is None else (
        f"{sd:.3f} vs {eval_sd(mean, eval_size):.3f}" + (" (eval set)" if eval_sd(mean, eval_size) > sd else ""))
    return [a.correction, a.source, seeds, _mean_sd(a.final, a), _mean_sd(a.best, a),
            _other_mean_sd(a.auc, a.auc_n, a), _other_mean_sd(a.late_reward, a.late_reward_n, a),
            f"{a.diverged}/{a.finished}" if a.finished else "-", _num(a.k3_median, ".2e"),
            "-" if a.changed_fraction is None else f"{100 * a.changed_fraction:.2f} %", _num(a.step_seconds, ".1f"),
            noise]


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _matrix(spec: ArenaSpec, aggregates: list[Aggregate]) -> tuple[list[str], list[list[str]]]:
    """Rows = corrections, columns = sources; each cell: final accuracy mean ± sd, diverged count, median k3."""
    by = {(a.correction, a.source): a for a in aggregates}
    header = ["correction \\ source"] + [s.name for s in spec.sources]
    rows = []
    for c in spec.corrections:
        row = [c.name]
        for s in spec.sources:
            a = by[(c.name, s.name)]
            row.append(f"{_mean_sd(a.final, a)}; div {a.diverged}/{a.finished}; k3 {_num(a.k3_median, '.1e')}"
                       if a.finished else "-")
        rows.append(row)
    return header, rows


def _cell_rows(results: list[CellResult]) -> list[list[str]]:
    return [[r.id, r.status + (f" ({r.failure})" if r.failure else ""), str(r.steps), _num(r.initial_accuracy),
             _num(r.final_accuracy), _num(r.best_accuracy), _num(r.auc_accuracy), _num(r.late_reward),
             _num(r.k3_median, ".2e"),
             "-" if r.changed_fraction is None else f"{100 * r.changed_fraction:.2f} %",
             "-" if r.truncated is None else f"{100 * r.truncated:.0f} %", _num(r.step_seconds, ".1f"),
             "; ".join(r.notes + ([r.error.splitlines()[-1][:160]] if r.error else []))] for r in results]


PAIRED_COLUMNS = ["comparison", "outcome", "seeds", "per-seed differences", "difference", "SE: seeds",
                  "SE: eval set (at least)", "95 % CI", "MDE (80 %)", "verdict", "bound set by",
                  "over problems x seeds (paired bootstrap)", "Welch bound (unpaired)"]


def _short(p: Paired) -> str:
    return "not established (sd 0)" if p.se <= NO_SPREAD else "difference detected" if p.detected else "no difference detected"


def _eval_share(c: PairedComparison) -> tuple[str, str]:
    """(the 'SE: eval set' cell, the 'bound set by' cell) of a comparison with a paired t: the floor of a count of
    correct answers; for the eval AUC none (in the bootstrap); for the late reward none, the seeds hold it."""
    p = c.seeds
    if OUTCOMES[c.which].counts:
        return f"{p.eval_floor:.3f}", "eval set" if p.eval_floor > p.se_seeds else "not known"
    if c.which == "auc":
        return "- (in the bootstrap)", "not known"
    return "- (in the seeds)", "seeds"


def _paired_rows(comparisons: list[PairedComparison]) -> list[list[str]]:
    rows = []
    for c in comparisons:
        welch = f"+-{c.welch.bound:.3f}" if c.welch is not None and c.welch.bound is not None else "-"
        p = c.seeds
        if p is None:
            rows.append([c.label, c.short, "-", "-", "-", "-", "-", "-", "-", str(c.reason), "-", "-", welch])
            continue
        boot = ("-" if OUTCOMES[c.which].per_problem is None else verdict(c.problems) if c.problems
                else str(c.problems_reason))
        floor, bound_by = _eval_share(c)
        rows.append([c.label, c.short, ", ".join(str(s) for s, _ in p.per_seed),
                     ", ".join(f"{d:+.3f}" for _, d in p.per_seed), f"{p.difference:+.3f}", f"{p.se_seeds:.3f}",
                     floor, f"[{p.low:+.3f}, {p.high:+.3f}]", f"{p.mde:.3f}", _short(p), bound_by, boot, welch])
    return rows


CELL_COLUMNS = ["cell", "status", "steps", "step-0 acc", "final acc", "best acc", "eval AUC", "late reward",
                "median k3", "changed", "truncated", "s/step", "notes / error"]


def outcomes_said(spec: ArenaSpec) -> str:
    """One sentence on the long table's eval AUC and late reward columns (N from arena.late_steps or its default)."""
    n = (f"N = {spec.late_steps} (arena.late_steps)" if spec.late_steps is not None
         else "N = max(1, run.steps // 4) per cell")
    return ("eval AUC: the trapezoid under the eval-accuracy curve from step 0 to the last step, divided by the steps "
            "(the mean accuracy over the run: early learning weighs as much as the end); late reward: the mean "
            f"training reward (reward/mean, sampled on training problems) of the last N steps, {n}.")


def _arms_said(spec: ArenaSpec) -> list[str]:
    out = []
    for kind, arms in (("source", spec.sources), ("correction", spec.corrections)):
        out += [f"- {kind} `{a.name}`: `{' '.join(a.sets)}`" + (f" ({a.note})" if a.note else "") for a in arms]
    return out


def render_markdown(spec: ArenaSpec, state: ArenaState, results, aggregates, comparisons) -> str:
    counts = state.counts()
    out = [f"# Arena `{spec.path.name}`", "",
           f"Base config `{spec.base.name}`, seeds {list(spec.seeds)}, {len(spec.cells)} cells: {counts['done']} done, "
           f"{counts['diverged']} diverged, {counts['failed']} failed, "
           f"{counts['pending'] + counts['running'] + counts['stopped']} not run"
           f"{', %d skipped by the sequential rule' % counts['skipped'] if counts['skipped'] else ''}. "
           f"Machine time so far: "
           f"{duration(state.seconds)} (wall time of every attempt). Accuracy: greedy, held-out, "
           f"{spec.cells[0].config.task.eval_size} problems; k3: token-mean KL(mu || pi_old) estimate, nats/token.",
           "", *_arms_said(spec), "", "## Final accuracy by correction and source (mean ± sd over seeds)", ""]
    out += _md_table(*_matrix(spec, aggregates))
    rows = [aggregate_row(a, spec.cells[0].config.task.eval_size) for a in aggregates]
    out += ["", "## Every correction x source", "", outcomes_said(spec), ""] + _md_table(list(COLUMNS), rows)
    out += ["", f"## Paired comparisons: corrections against `{spec.baseline}`, sources against "
            f"`{spec.sources[0].name}`", "", METHOD, ""]
    out += _md_table(PAIRED_COLUMNS, _paired_rows(comparisons)) if comparisons else ["no comparison yet"]
    out += sequential.page_markdown(spec)
    out += ["", "## Cells", ""] + _md_table(CELL_COLUMNS, _cell_rows(results))
    return "\n".join(out) + "\n"


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def source_figure(spec: ArenaSpec, results: list[CellResult], source: str) -> bytes:
    """PNG of one source's cells: eval accuracy and k3 (log scale) over steps, a colour per correction."""
    fig = Figure(figsize=(11, 3.6), dpi=90, layout="constrained")
    acc_ax, k3_ax = fig.subplots(1, 2)
    colours = [f"C{i % 10}" for i in range(len(spec.corrections))]
    for colour, correction in zip(colours, spec.corrections):
        mine = [r for r in results if r.source == source and r.correction == correction.name]
        named = set()  # the panels where a line already carries this correction's name
        for r in mine:
            for ax, points, style in ((acc_ax, r.accuracy, {"marker": "o", "ms": 3}),
                                      (k3_ax, [(s, v) for s, v in r.k3 if v > 0], {})):
                if points:
                    ax.plot(*zip(*points), color=colour, lw=1, label=None if ax in named else correction.name, **style)
                    named.add(ax)
    acc_ax.set(title=f"{source}: eval accuracy", xlabel="step", ylabel="greedy held-out accuracy")
    k3_ax.set(title=f"{source}: mismatch k3", xlabel="step", ylabel="k3 (nats / token)")
    if k3_ax.lines:
        k3_ax.set_yscale("log")
    for ax in (acc_ax, k3_ax):
        if ax.get_legend_handles_labels()[0]:  # lines without labels draw no legend (and no warning)
            ax.legend(fontsize=7)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def render_html(spec: ArenaSpec, state: ArenaState, results, aggregates, comparisons) -> str:
    figures = "".join(
        f"<h3>{html.escape(s.name)}</h3><img alt='{html.escape(s.name)}' src='data:image/png;base64,"
        f"{base64.b64encode(source_figure(spec, results, s.name)).decode()}'>" for s in spec.sources)
    paired = _html_table(PAIRED_COLUMNS, _paired_rows(comparisons)) if comparisons else "<p>no comparison yet</p>"
    arms = "".join(f"<li>{html.escape(line[2:])}</li>" for line in _arms_said(spec))
    rows = [aggregate_row(a, spec.cells[0].config.task.eval_size) for a in aggregates]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>arena {html.escape(spec.path.name)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
            "td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%}</style></head><body>"
            f"<h1>Arena {html.escape(spec.path.name)}</h1><p>base {html.escape(str(spec.base))}, seeds "
            f"{list(spec.seeds)}, {len(spec.cells)} cells</p><ul>{arms}</ul>"
            f"<h2>Final accuracy (mean ± sd over seeds)</h2>{_html_table(*_matrix(spec, aggregates))}"
            f"<h2>Every correction x source</h2><p>{html.escape(outcomes_said(spec))}</p>"
            f"{_html_table(list(COLUMNS), rows)}"
            f"<h2>Paired comparisons: corrections against {html.escape(spec.baseline)}, sources against "
            f"{html.escape(spec.sources[0].name)}</h2><p>{html.escape(METHOD)}</p>{paired}"
            f"{sequential.page_html(spec)}"
            f"<h2>Eval accuracy and k3 over steps</h2>{figures}"
            f"<h2>Cells</h2>{_html_table(CELL_COLUMNS, _cell_rows(results))}</body></html>\n")


def write_page(spec: ArenaSpec, state: ArenaState) -> list[str]:
    """Write OUT/arena.md, arena.json and arena.html from every cell's run so far; returns the warnings met while
    reading the runs' metrics."""
    results, aggregates, warnings = arena_results(spec, state)
    eval_size = spec.cells[0].config.task.eval_size
    statements = spread_statements(aggregates, spec.baseline, eval_size)
    comparisons = paired_comparisons(results, aggregates, [c.name for c in spec.corrections],
                                     [s.name for s in spec.sources], spec.baseline, eval_size)
    spec.out.mkdir(parents=True, exist_ok=True)
    (spec.out / "arena.md").write_text(render_markdown(spec, state, results, aggregates, comparisons))
    write_json(spec.out / "arena.json", {
        "arena": str(spec.path), "base": str(spec.base), "seeds": list(spec.seeds), "baseline": spec.baseline,
        "corrections": [asdict(a) for a in spec.corrections], "sources": [asdict(a) for a in spec.sources],
        "machine_seconds": state.seconds, "aggregates": [asdict(a) for a in aggregates],
        "cells": [asdict(r) for r in results], "statements": statements,
        "late_steps": spec.late_steps, "outcomes": {name: o.label for name, o in OUTCOMES.items()},
        "paired": [asdict(c) | {"label": c.label, "outcome": c.what, "statement": c.statement()}
                   for c in comparisons],
        "paired_method": METHOD})
    (spec.out / "arena.html").write_text(render_html(spec, state, results, aggregates, comparisons))
    return warnings
