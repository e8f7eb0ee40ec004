"""PNG charts of a diagnosis: per-unit sensitivity bars and mismatch vs response position."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nearpolicy.diagnosis.measure import CandidateResult  # noqa: E402
from nearpolicy.diagnosis.sensitivity import UnitSensitivity  # noqa: E402


def sensitivity_chart(units: list[UnitSensitivity], precision: str, reference: str, path: Path) -> Path:
    """Horizontal bars of the k3 each unit adds when it alone is at `precision`, ranked, blocks and tensor kinds
    in two colours."""
    ranked = sorted(units, key=lambda u: u.added_k3)
    fig, ax = plt.subplots(figsize=(7, 0.22 * len(ranked) + 1.5))
    colours = ["tab:orange" if u.kind == "tensor kind" else "tab:blue" for u in ranked]
    ax.barh([u.unit for u in ranked], [u.added_k3 for u in ranked], color=colours)
    positive = [u.added_k3 for u in ranked if u.added_k3 > 0]
    if positive and max(positive) > 100 * min(positive):  # one unit dwarfs the rest: a log axis shows them all
        ax.set_xscale("symlog", linthresh=min(positive))
    ax.set_xlabel("k3 KL added (nats / token, teacher-forced)")
    ax.set_title(f"Sensitivity: one unit at {precision}, the rest at {reference}\n(blue: block, orange: tensor kind)",
                 fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def position_chart(results: list[CandidateResult], path: Path) -> Path:
    """Token-mean k3 per response-position bucket, one line per candidate, log scale."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        starts, k3 = r.by_position.get("start", []), r.by_position.get("k3", [])
        points = [(s, k) for s, k in zip(starts, k3) if k > 0]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=r.candidate)
    ax.set_yscale("log")
    ax.set_xlabel("response position (bucket start, tokens)")
    ax.set_ylabel("k3 KL(mu || pi), nats / token")
    ax.set_title("Mismatch by position in the response", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no candidate with a positive k3: no legend (and no warning)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
