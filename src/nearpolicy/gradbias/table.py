"""The gradient-bias table from a measurement's grams.npz and effects.json (run.py), and its outputs:
gradbias.json (every estimate with its interval), gradbias.md (the table), gradbias.png (relative bias against
relative variance per correction, one panel per source) and gradbias.html (the page).

`analyze(folder)` needs only those two small files, so a committed measurement (docs/gradbias/) is re-tabled
without the replicates: `nearpolicy gradbias --analyze FOLDER`."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from nearpolicy.gradbias.estimate import Grams, bias2_change, cell_estimates, mean_interval, relative_shift

def _blocks(gram: np.ndarray, n: int, arm: int) -> Grams:
    """The cell Grams of correction block `arm` (1-based; block 0 is the reference) of a stacked Gram matrix."""
    x, y = slice(0, n), slice(arm * n, (arm + 1) * n)
    return Grams(gram[x, x], gram[y, y], gram[y, x])


def analyze(folder: Path) -> dict:
    """Per source, per correction: the estimates of estimate.cell_estimates, the shift and the paired bias^2 change against "off", the
    mean changed fraction and ESS (batch-means intervals); per source the mismatch facts (k3, reward, length,
    truncated share, seconds); the measurement's meta. Raises FileNotFoundError when the files are missing and
    ValueError when one is unreadable (read_measurement)."""
    data, effects = read_measurement(Path(folder))
    corrections = [str(c) for c in data["corrections"]]
    n = int(data["replicates"])
    out = {"meta": effects["meta"], "reference": _facts(effects["reference"]), "sources": {}}
    for source, info in effects["sources"].items():
        gram = data[source]
        cells = {c: _blocks(gram, n, a + 1) for a, c in enumerate(corrections)}
        rows = {}
        for c, grams in cells.items():
            est = cell_estimates(grams)
            changed, ess = np.array(info["effects"][c]).T
            rows[c] = {k: v.as_dict() | {"mde": v.mde} for k, v in est.items()}
            rows[c]["bias2_change"] = bias2_change(cells["off"], grams).as_dict()
            a, off = (a_ + 1 for a_ in (corrections.index(c), corrections.index("off")))
            y, x = slice(a * n, (a + 1) * n), slice(off * n, (off + 1) * n)
            rows[c]["shift"] = relative_shift(gram[:n, :n], Grams(gram[x, x], gram[y, y], gram[y, x])).as_dict()
            rows[c]["changed"] = mean_interval(changed).as_dict()
            rows[c]["ess"] = mean_interval(ess).as_dict()
        out["sources"][source] = {"label": effects["meta"]["sources"].get(source, source),
                                  "facts": _facts(info["facts"]), "corrections": rows}
    return out


def read_measurement(folder: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(grams.npz's arrays, effects.json's object) of a measurement folder, checked for everything `analyze` reads.
    Raises FileNotFoundError naming a missing file, ValueError naming the file that is unreadable (a truncated or
    corrupted archive, invalid JSON) or inconsistent (measurement_problem)."""
    grams, effects_path = folder / "grams.npz", folder / "effects.json"
    for path in (grams, effects_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: not a finished gradbias measurement (its folder holds "
                                    "grams.npz and effects.json)")
    rerun = f"rerun the measurement into {folder} (its replicates/ are kept) or restore the file"
    try:
        with np.load(grams) as archive:
            data = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{grams} is unreadable ({type(err).__name__}: {err}); {rerun}") from None
    try:
        effects = json.loads(effects_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{effects_path} is not valid JSON ({err}); {rerun}") from None
    problem = measurement_problem(data, effects)
    if problem is not None:
        grams_at_fault, what = problem
        raise ValueError(f"{grams if grams_at_fault else effects_path}: {what}; {rerun}")
    return data, effects


def measurement_problem(data: dict[str, np.ndarray], effects) -> tuple[bool, str] | None:
    """Why grams.npz's arrays `data` and effects.json's `effects` cannot be tabled, as (the fault is grams.npz's,
    what is wrong), or None when they can: effects.json an object with meta (its `sources` a dict), a reference list
    and a sources object, each source with a non-empty list of fact objects and per-correction effects; grams.npz
    with string corrections including "off", an integer replicate count N >= 2 and, per source, a square Gram matrix
    of (corrections + 1) x N rows."""
    if not isinstance(effects, dict) or not isinstance(effects.get("meta"), dict) \
            or not isinstance(effects["meta"].get("sources"), dict) or not isinstance(effects.get("reference"), list) \
            or not isinstance(effects.get("sources"), dict) or not effects["sources"]:
        return False, "needs an object with meta (and its sources), a reference list and a non-empty sources object"
    missing = [name for name in ("corrections", "replicates", *effects["sources"]) if name not in data]
    if missing:
        return True, f"has no {', '.join(missing)} (effects.json lists them)"
    corrections, replicates = data["corrections"], data["replicates"]
    if corrections.ndim != 1 or corrections.dtype.kind != "U" or "off" not in corrections.tolist():
        return True, "corrections must be a list of names including 'off'"
    if replicates.ndim != 0 or replicates.dtype.kind not in "iu" or int(replicates) < 2:
        return True, f"replicates must be one integer >= 2, got {replicates.tolist()!r}"
    size = (len(corrections) + 1) * int(replicates)
    for source, info in effects["sources"].items():
        if data[source].shape != (size, size):
            return True, (f"{source}'s Gram matrix is {data[source].shape}, not ({size}, {size}) for "
                          f"{len(corrections)} corrections + the reference x {int(replicates)} replicates")
        facts = info.get("facts") if isinstance(info, dict) else None
        per = info.get("effects") if isinstance(info, dict) else None
        if not (isinstance(facts, list) and facts and all(isinstance(f, dict) for f in facts)
                and isinstance(per, dict) and all(c in per for c in corrections.tolist())):
            return False, f"source {source} needs a non-empty facts list and effects for every correction"
    if not effects["reference"] or not all(isinstance(f, dict) for f in effects["reference"]):
        return False, "reference must be a non-empty list of fact objects"
    return None


def _facts(rows: list[dict]) -> dict:
    return {k: mean_interval(np.array([r[k] for r in rows], float)).as_dict() for k in rows[0]}


def _fmt(e: dict, digits: int = 3) -> str:
    if not np.isfinite(e["value"]):
        return "n/a"
    if not np.isfinite(e["low"]):
        return f"{e['value']:.{digits}g}"
    return f"{e['value']:.{digits}g} [{e['low']:.{digits}g}, {e['high']:.{digits}g}]"


HEADER = ("correction", "rel. bias", "rel. bias^2 (MDE)", "cosine", "rel. variance", "rel. MSE", "shift vs off",
          "rel. bias^2 - off's", "tokens changed", "ESS")


def preamble(table: dict) -> str:
    m = table["meta"]
    return (f"Measured at trainer version {m['trainer_version']} ({m['warmup']} warm-up steps), {m['replicates']} "
            f"replicate batches of {m['batch']['prompts']} x {m['batch']['group_size']} samples per source; loss "
            f"{m['loss']} ({m['aggregation']}), advantage {m['advantage']}; gradients as count-sketches of dimension "
            f"{m['sketch_dim']} (squared-norm distortion {100 * m['sketch_distortion']:.2f} %, one sd). Intervals: "
            "95 %, delete-one jackknife over replicate batches with t quantiles (paired across corrections); MDE: the "
            "smallest relative bias^2 "
            "detected with 80 % power; shift vs off: ||E g_c - E g_off|| / ||g*||, paired on the same batches (how far the "
            "correction moves the expected gradient: an upper bound on the bias it can remove); rel. bias^2 - off's: paired, "
            "below 0 when the correction lands closer to g*; rel. bias is the root of rel. bias^2, 0 where that is "
            "below 0; tokens changed: the share of tokens whose loss coefficient differs from off's by over 1e-6 "
            "relative (any IS weight not exactly 1 counts); n/a or a bare value: the estimate or its interval is "
            "undefined (a zero gradient, or a statistic constant over the replicates).")


def source_line(s: dict) -> str:
    f = s["facts"]
    return (f"k3 KL(mu || pi) {_fmt(f['k3'])} nats/token; mean reward {f['reward']['value']:.3f}; response length "
            f"{f['length']['value']:.1f} tokens, {100 * f['truncated']['value']:.0f} % truncated; "
            f"{f['sample_s']['value']:.1f} s sampling and {f['gradient_s']['value']:.1f} s gradients per replicate")


def source_rows(s: dict) -> list[tuple[str, ...]]:
    """One row of HEADER's columns per correction of a source."""
    out = []
    for c, r in s["corrections"].items():
        b2 = r["rel_bias2"]
        out.append((c, _fmt(r["rel_bias"]), f"{_fmt(b2)} ({b2['mde']:.2g})", _fmt(r["cosine"]), _fmt(r["rel_variance"]),
                    _fmt(r["rel_mse"]), "-" if c == "off" else _fmt(r["shift"], 2),
                    "-" if c == "off" else _fmt(r["bias2_change"], 2), _fmt(r["changed"], 2),
                    _fmt(r["ess"], 3)))
    return out


def markdown(table: dict) -> str:
    """One table per source: relative bias, relative bias^2, cosine, relative variance, relative MSE, the share of
    the shift from and the bias^2 change against no correction, tokens changed and ESS, each with its 95 % interval."""
    lines = [preamble(table), ""]
    for source, s in table["sources"].items():
        lines += [f"### {source}: {s['label']}", "", source_line(s), "", "| " + " | ".join(HEADER) + " |",
                  "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(row) + " |" for row in source_rows(s)]
        lines.append("")
    return "\n".join(lines)


def html_page(table: dict, png_b64: str) -> str:
    """The self-contained page: the plot, then one table per source."""
    import html

    e = html.escape
    parts = [f"<p>{e(preamble(table))}</p>", f"<img src='data:image/png;base64,{png_b64}' style='max-width:100%'>"]
    for source, s in table["sources"].items():
        head = "".join(f"<th>{e(h)}</th>" for h in HEADER)
        body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in source_rows(s))
        parts.append(f"<h2>{e(source)}: {e(s['label'])}</h2><p>{e(source_line(s))}</p>"
                     f"<table><tr>{head}</tr>{body}</table>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>nearpolicy gradbias</title><style>"
            "body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}"
            "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}"
            "tr:nth-child(even){background:#f6f6f6}</style></head><body><h1>Gradient bias of the corrections</h1>"
            + "".join(parts) + "</body></html>")


def figure(table: dict):
    """Relative bias against relative variance, one point per correction (95 % interval bars), one panel per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(table["sources"])
    cols = min(3, len(sources))
    rows = -(-len(sources) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, source in zip(axes.flat, sources):
        s = table["sources"][source]
        for c, r in s["corrections"].items():
            x, y = r["rel_variance"], r["rel_bias"]
            if not np.isfinite(y["value"]):
                continue
            ax.errorbar(x["value"], y["value"], yerr=[[y["value"] - y["low"]], [y["high"] - y["value"]]],
                        xerr=[[x["value"] - x["low"]], [x["high"] - x["value"]]], fmt="o", ms=4, capsize=2, lw=0.8)
            ax.annotate(c, (x["value"], y["value"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{source}: k3 {s['facts']['k3']['value']:.2g}", fontsize=9)
        ax.set_xlabel("relative variance (one batch)", fontsize=8)
        ax.set_ylabel("relative bias ||E g_c - g*|| / ||g*||", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(sources):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _strict(value):
    """`value` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return None if isinstance(value, float) and not np.isfinite(value) else value


def write_outputs(table: dict, folder: Path) -> None:
    """gradbias.json, gradbias.md, gradbias.png and gradbias.html in `folder`."""
    import base64

    import matplotlib.pyplot as plt

    from nearpolicy.files import atomic_path, write_atomically

    folder = Path(folder)
    write_atomically(folder / "gradbias.json", json.dumps(_strict(table), indent=1))  # NaN as null: strict JSON
    write_atomically(folder / "gradbias.md", markdown(table) + "\n")
    fig = figure(table)
    with atomic_path(folder / "gradbias.png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    png = base64.b64encode((folder / "gradbias.png").read_bytes()).decode()
    write_atomically(folder / "gradbias.html", html_page(table, png))
