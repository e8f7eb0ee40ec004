"""`nearpolicy report` and `nearpolicy compare`: one self-contained HTML file of a run's (or several runs') metrics.

A run folder holds metrics.jsonl (one JSON object per step, written by runs.folder.MetricsSink) and, when the trainer wrote
it, config.json and plan.json. Each panel is a matplotlib figure (Agg, no display) embedded as a base64 PNG data URI,
so the HTML file needs nothing beside it. A panel is drawn only when at least one run records its metrics; otherwise
it says "not recorded in this run". In a comparison each run has one colour, and its line is labelled with its
folder name."""

from __future__ import annotations

import base64
import html
import io
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from nearpolicy.runs.folder import RunFolderError, finite_points, is_finite_number, read_json_object, read_metrics
from nearpolicy.runs.samples import read_samples
from nearpolicy.runs.summary import describe_run, roofline_text, training_seconds

NOT_RECORDED = "not recorded in this run"
LINESTYLES = ("-", "--", ":", "-.")


ReportError = RunFolderError
"""A run folder that cannot be reported (missing, without metrics.jsonl, an unreadable file) or an unwritable page."""


@dataclass
class Run:
    """One run folder: metrics rows in step order, config.json and plan.json (empty dicts when absent), and the
    warnings raised while reading it (a cut-short last line)."""

    name: str
    rows: list[dict]
    config: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    """samples.jsonl's rows (runs/samples.py): a few eval responses per eval."""

    @cached_property
    def keys(self) -> set[str]:
        """Every metric name some row holds."""
        return {key for row in self.rows for key in row}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows where `key` holds a finite number."""
        points = finite_points(self.rows, key)
        return [s for s, _ in points], [v for _, v in points]


def load_run(run_dir: Path) -> Run:
    """Read a run folder's metrics.jsonl (required), config.json and plan.json (optional).

    metrics.jsonl is read by runs.folder.read_metrics (its one rule: a cut-short last line is skipped with a warning, any
    other bad line is an error). Raises ReportError naming the folder or file when the folder or metrics.jsonl is
    missing, a file cannot be parsed, or metrics.jsonl holds no rows."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run folder {run_dir} does not exist")
    metrics = read_metrics(run_dir)
    if not metrics.rows:
        raise ReportError(f"{run_dir / 'metrics.jsonl'} holds no metric rows")
    samples, sample_warnings = read_samples(run_dir)
    return Run(run_dir.resolve().name, metrics.rows, read_json_object(run_dir / "config.json"),
               read_json_object(run_dir / "plan.json"), metrics.warnings + sample_warnings, samples)


# -- panels ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Series:
    """One line: the first of `keys` that a run records is drawn (a newer metric name before its older name);
    `band` names a metric drawn as a +/- band around it (clipped to `limits`, e.g. a reward's [0, 1])."""

    label: str
    keys: tuple[str, ...]
    band: str | None = None
    limits: tuple[float, float] | None = None  # the metric's range: its band is clipped to it

    def key_in(self, run: Run) -> str | None:
        return next((key for key in self.keys if key in run.keys), None)


@dataclass(frozen=True)
class Panel:
    """A plot of fixed `series`, or of every metric whose name satisfies `match` (one line each)."""

    title: str
    ylabel: str
    series: tuple[Series, ...] = ()
    match: Callable[[str], bool] | None = None
    log_y: bool = False
    missing: str = NOT_RECORDED

    def lines(self, run: Run) -> list[tuple[Series, str]]:
        """(series, metric key) of each line this run records."""
        if self.match is not None:
            return [(Series(key, (key,)), key) for key in sorted(run.keys) if self.match(key)]
        return [(s, key) for s in self.series if (key := s.key_in(run)) is not None]


def _is_fraction(key: str) -> bool:
    return key.endswith(("clip_frac", "mask_frac")) or (key.startswith(("actor/", "correction/")) and "frac" in key)


DISCREPANCY_K3 = Series("numerical discrepancy", ("mismatch/discrepancy_k3", "mismatch/k3"))
PANELS = (
    Panel("Reward", "reward (mean ± std over samples)", (Series("reward", ("reward/mean",), band="reward/std", limits=(0.0, 1.0)),)),
    Panel("Eval accuracy", "accuracy (greedy, held-out)", (Series("eval accuracy", ("eval/accuracy",)),)),
    Panel("Mismatch k3 by component (log scale)", "k3 estimate of KL (nats / token)",
          (DISCREPANCY_K3, Series("policy lag", ("mismatch/lag_k3",)), Series("total", ("mismatch/total_k3",)),
           Series("current-version tokens (async)", ("mismatch/fresh_k3",)),
           Series("older-version tokens (async)", ("mismatch/stale_k3",))),
          log_y=True),
    Panel("Effective sample size", "normalised ESS",
          (Series("numerical discrepancy", ("mismatch/discrepancy_ess", "mismatch/ess")),
           Series("policy lag", ("mismatch/lag_ess",)))),
    Panel("Log-perplexity difference per sequence", "d = log PPL trainer - engine (nats/token)",
          (Series("mean", ("mismatch/seq_log_ppl_diff",)), Series("mean |d|", ("mismatch/seq_log_ppl_abs_diff",)),
           Series("min", ("mismatch/seq_log_ppl_diff_min",)), Series("max", ("mismatch/seq_log_ppl_diff_max",))),
          missing=f"{NOT_RECORDED} (a run older than these metrics, or logging.diagnostics = false)"),
    Panel("Clip and mask fractions", "fraction of tokens", match=_is_fraction),
    Panel("Staleness", "policy versions behind / fraction",
          (Series("staleness mean", ("staleness/mean",)), Series("staleness max", ("staleness/max",)),
           Series("off-policy token fraction", ("staleness/off_policy_token_frac",))),
          missing=f"{NOT_RECORDED} (a synchronous run samples every rollout from the current weights)"),
    Panel("Throughput", "tokens / s", match=lambda key: key.startswith("throughput/")),
    Panel("Phase timings", "seconds", match=lambda key: key.startswith("time/")),
    Panel("Entropy", "nats / token", (Series("entropy", ("entropy",)),)),
    Panel("Response length", "tokens",
          (Series("train mean", ("response/length_mean",)), Series("train max", ("response/length_max",)),
           Series("eval mean", ("eval/response_length",)))),
)


def _plot_line(ax, run: Run, key: str, series: Series, log_y: bool, style: dict) -> bool:
    """Draw one run's metric (and its band); returns whether any point was drawn."""
    points = [(s, v) for s, v in zip(*run.series(key)) if v > 0 or not log_y]
    if not points:
        return False
    steps, values = [s for s, _ in points], [v for _, v in points]
    sparse = len(values) == 1 or len(values) < len(run.rows) / 2
    ax.plot(steps, values, marker="o" if sparse else None, markersize=4, **style)
    if series.band is not None:
        spread = dict(zip(*run.series(series.band)))
        rows = [(s, v, spread[s]) for s, v in zip(steps, values) if s in spread]
        low, high = series.limits or (-math.inf, math.inf)
        ax.fill_between([s for s, _, _ in rows], [max(v - d, low) for _, v, d in rows],
                        [min(v + d, high) for _, v, d in rows], color=style["color"], alpha=0.15, linewidth=0)
    return True


def render_panel(panel: Panel, runs: Sequence[Run]) -> bytes | None:
    """PNG bytes of `panel` over `runs` (one colour per run in a comparison), or None when no run records it."""
    fig = panel_figure(panel, runs)
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def panel_figure(panel: Panel, runs: Sequence[Run]) -> Figure | None:
    """The matplotlib figure of `panel` over `runs` (step ticks on whole numbers, legend below the axes), or None
    when no run records it."""
    if not any(panel.lines(run) for run in runs):
        return None
    fig = Figure(figsize=(8, 3.4), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for r, run in enumerate(runs):
        lines = panel.lines(run)
        for s, (series, key) in enumerate(lines):
            if len(runs) == 1:
                # later series dashed: a series equal to an earlier one (total = discrepancy with no lag) stays visible
                style = {"color": f"C{s % 10}", "linestyle": LINESTYLES[s % len(LINESTYLES)], "label": series.label}
            else:
                label = legend_name(run) if len(lines) == 1 else f"{legend_name(run)}: {series.label}"
                style = {"color": f"C{r % 10}", "linestyle": LINESTYLES[s % len(LINESTYLES)], "label": label}
            drawn |= _plot_line(ax, run, key, series, panel.log_y, style)
    if drawn:
        ax.set_yscale("log" if panel.log_y else "linear")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        low, high = ax.dataLim.intervalx
        if high - low < 1:  # every point at one step: matplotlib's default span (+-5 %) is a fraction of a step
            ax.set_xlim(low - 1, high + 1)
        labels = ax.get_legend_handles_labels()[1]  # below the axes, so no legend covers a line
        columns = 1 if max(map(len, labels), default=0) > 40 else min(len(labels), 3)  # long run names would be cut off
        fig.legend(loc="outside lower center", ncols=columns, fontsize=8, frameon=False)
    else:
        empty = "no positive values to draw on a log scale" if panel.log_y else "no finite values to draw"
        ax.text(0.5, 0.5, empty, ha="center", transform=ax.transAxes)
    ax.set(xlabel="step", ylabel=panel.ylabel)
    ax.grid(alpha=0.3)
    return fig


def _missing_notes(panel: Panel, runs: Sequence[Run]) -> list[str]:
    """One note per fixed series that some run does not record."""
    notes = []
    for series in panel.series:
        absent = [run.name for run in runs if series.key_in(run) is None]
        if absent:
            where = NOT_RECORDED if len(runs) == 1 else f"not recorded in {', '.join(absent)}"
            notes.append(f"{series.label} ({' / '.join(series.keys)}): {where}")
    return notes


# -- header table and page -------------------------------------------------------------------------------------------
def run_summary(run: Run) -> dict[str, str]:
    """The header row of a run: name, model, what the run is (summary.describe_run: engine precision, update, KL,
    effective correction, proximal), steps, final and peak eval accuracy, median k3, total time, and the rollout's
    share of its roofline bound (summary.roofline_text)."""
    section = lambda name: run.config.get(name) if isinstance(run.config.get(name), dict) else {}  # noqa: E731
    model = section("model").get("path") or Path(str(run.plan.get("model_file", ""))).name
    steps = max(row["step"] for row in run.rows)
    planned = section("run").get("steps")
    evals = list(zip(*run.series("eval/accuracy")))
    k3_key = DISCREPANCY_K3.key_in(run)
    k3 = run.series(k3_key)[1] if k3_key else []
    seconds = training_seconds(run.rows)
    peak = max(evals, key=lambda point: point[1]) if evals else None
    return {
        "run": run.name, "model": str(model or "unknown (no config.json)"), **describe_run(run.config, run.plan),
        "steps": f"{steps} of {planned}" if planned else str(steps),
        "final eval accuracy": _final_eval(evals, steps),
        "peak eval accuracy": f"{peak[1]:.3f} (step {peak[0]})" if peak else NOT_RECORDED,
        "median k3 (discrepancy)": f"{statistics.median(k3):.3g} nats" if k3 else NOT_RECORDED,
        "training time (sum of step times, evals included)": f"{seconds / 60:.1f} min" if seconds else NOT_RECORDED,
        "rollout vs roofline bound": roofline_text(run.rows) or NOT_RECORDED,
    }


def _final_eval(evals: list[tuple[int, float]], steps: int) -> str:
    """The last finite eval, saying so when later steps have none (a stopped run, or an eval whose answers were all
    unscorable: not the run's final accuracy)."""
    if not evals:
        return NOT_RECORDED
    step, accuracy = evals[-1]
    later = f"step {steps} has" if step + 1 == steps else f"steps {step + 1}-{steps} have"
    return f"{accuracy:.3f} (step {step})" + (f"; {later} no eval accuracy" if step < steps else "")


def legend_name(run: Run) -> str:
    """A run's name in a comparison's legends: folder name, engine precision and correction preset, e.g.
    "baseline (llamacpp:q8_0, tis)" (what plan.json does not record is left out)."""
    described = describe_run(run.config, run.plan)
    parts = [described["engine"], described["correction"].split(":")[0]]
    recorded = [part for part in parts if part != "not recorded"]
    return f"{run.name} ({', '.join(recorded)})" if recorded else run.name


STYLE = """body{font-family:sans-serif;max-width:880px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}
img{max-width:100%}.note{color:#666;font-size:14px}.warning{color:#a40}"""


def _table(runs: Sequence[Run]) -> str:
    """One row per header field, one column per run (a long comparison grows down, not past the page's width)."""
    summaries = [run_summary(run) for run in runs]
    cell = lambda tag, text: f"<{tag}>{html.escape(text)}</{tag}>"  # noqa: E731
    rows = ["<tr>" + cell("th", "run") + "".join(cell("th", s["run"]) for s in summaries) + "</tr>"]
    rows += ["<tr>" + cell("th", name) + "".join(cell("td", s[name]) for s in summaries) + "</tr>"
             for name in summaries[0] if name != "run"]
    return f"<table>{''.join(rows)}</table>"


def _section(panel: Panel, runs: Sequence[Run]) -> str:
    png = render_panel(panel, runs)
    title = html.escape(panel.title)
    if png is None:
        return f"<section><h2>{title}</h2><p class='note'>{html.escape(panel.missing)}</p></section>"
    notes = "".join(f"<p class='note'>{html.escape(note)}</p>" for note in _missing_notes(panel, runs))
    image = f"<img alt='{title}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
    return f"<section><h2>{title}</h2>{image}{notes}</section>"


SAMPLE_EVALS = 3  # the newest evals whose samples the report shows
SAMPLE_CHARS = 800  # a prompt or response longer than this is cut, with "..." appended


def _cut(text, limit: int = SAMPLE_CHARS) -> str:
    text = "" if text is None else str(text)
    return html.escape(text if len(text) <= limit else text[:limit] + "...")


def samples_section(runs: Sequence[Run]) -> str:
    """"Eval samples": for each run, the samples of its newest SAMPLE_EVALS evals (newest first), one table per eval
    with prompt, reference answer, response and reward, all HTML-escaped."""
    parts = []
    for run in runs:
        title = f"<h3>{html.escape(run.name)}</h3>" if len(runs) > 1 else ""
        steps = sorted({row["step"] for row in run.samples}, reverse=True)[:SAMPLE_EVALS]
        if not steps:
            parts.append(f"{title}<p class='note'>{NOT_RECORDED} (samples.jsonl)</p>")
        for step in steps:
            rows = "".join(
                f"<tr><td>{row.get('index', '')}</td><td style='white-space:pre-wrap'>{_cut(row.get('prompt'))}</td>"
                f"<td>{_cut(row.get('answer'), 80)}</td><td style='white-space:pre-wrap'>{_cut(row.get('response'))}"
                f"</td><td>{_reward_text(row)}</td></tr>" for row in run.samples if row["step"] == step)
            parts.append(f"{title}<h4>eval at step {step}</h4><table><tr><th>#</th><th>prompt</th><th>answer</th>"
                         f"<th>response</th><th>reward</th></tr>{rows}</table>")
    return f"<section><h2>Eval samples</h2>{''.join(parts)}</section>"


def _reward_text(row: dict) -> str:
    reward = row.get("reward")
    shown = f"{reward:.3g}" if is_finite_number(reward) else "unscorable"
    status = row.get("status", "ok")
    return html.escape(shown if status == "ok" else f"{shown} ({status}: {row.get('message', '')})")


def render_html(runs: Sequence[Run]) -> str:
    """The self-contained HTML page: header table, read warnings, then one section per panel."""
    title = ("nearpolicy report: " if len(runs) == 1 else "nearpolicy compare: ") + ", ".join(r.name for r in runs)
    warnings = "".join(f"<p class='warning'>{html.escape(w)}</p>" for run in runs for w in run.warnings)
    sections = "".join(_section(panel, runs) for panel in PANELS) + samples_section(runs)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{_table(runs)}{warnings}{sections}"
            "</body></html>\n")


def write_report(run_dirs: Sequence[Path], out: Path) -> list[str]:
    """Write the report of one run folder (or the comparison of several) to `out`; returns the read warnings.

    Raises ReportError for an unreadable run folder or an unwritable `out`."""
    runs = _distinct_names([load_run(Path(d)) for d in run_dirs], run_dirs)
    page = render_html(runs)
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(page)
    except OSError as err:
        raise ReportError(f"cannot write {out}: {err}") from None
    return [w for run in runs for w in run.warnings]


def _distinct_names(runs: list[Run], run_dirs: Sequence[Path]) -> list[Run]:
    """Label runs by the path given when two folders share a name."""
    names = [run.name for run in runs]
    for run, run_dir in zip(runs, run_dirs):
        if names.count(run.name) > 1:
            run.name = str(run_dir)
    return runs
