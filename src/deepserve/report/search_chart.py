"""The planner's layout search as the Pareto chart users know: output tokens/s per GPU against tokens/s per user.

Every predicted point of every candidate is a faint dot coloured by its kind of layout (TP, TP + PP, DP attention
with EP or split experts, prefill/decode pools, each with or without MTP); the thick black line is the frontier
(the points no other beats on both axes); the chosen candidate's points are ringed; a dashed vertical line marks the
ITL objective (points left of it miss it). Drawn in the style of report/charts.py.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from deepserve.plan.search import SearchResult
from deepserve.report.charts import _colors, _figure, _labels, _thousands  # one style for every chart


def draw_search_frontier(result: SearchResult, path: Path) -> Path:
    """PATH (a .png): RESULT's points by kind, its frontier and its chosen candidate."""
    config = result.config
    title = f"{config.model.split('/')[-1]} on {config.gpus} x {config.gpu}: throughput per GPU vs speed per user"
    fig, ax = _figure(title)
    handles = _kinds(ax, result) + _frontier(ax, result) + _chosen(ax, result)
    if config.slo_itl_ms:
        per_user = 1e3 / config.slo_itl_ms
        ax.axvline(per_user, color="grey", linestyle="--", linewidth=1)
        handles.append(Line2D([], [], color="grey", linestyle="--", label=f"ITL {config.slo_itl_ms:g} ms"))
    _labels(ax, "output tokens/s per user (1000 / TPOT)", "output tokens/s per GPU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
    ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.text(
        0.01,
        0.01,
        f"{config.input_len}/{config.output_len} tokens per request; {result.candidates} candidates in "
        f"{result.seconds:.1f} s (deepserve plan search, steady closed-loop predictions)",
        fontsize=7,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _kinds(ax: Axes, result: SearchResult) -> list[Line2D]:
    kinds = sorted({p.candidate.kind for p in result.points})
    handles = []
    for color, kind in zip(_colors(), kinds, strict=False):
        points = [p for p in result.points if p.candidate.kind == kind]
        ax.scatter([p.tok_s_per_user for p in points], [p.tok_s_per_gpu for p in points], color=color, alpha=0.3, s=14)
        handles.append(Line2D([], [], color=color, marker="o", linestyle="", alpha=0.6, label=kind))
    return handles


def _frontier(ax: Axes, result: SearchResult) -> list[Line2D]:
    front = result.frontier
    ax.plot([p.tok_s_per_user for p in front], [p.tok_s_per_gpu for p in front], color="black", linewidth=2.2)
    return [Line2D([], [], color="black", linewidth=2.2, label="frontier")]


def _chosen(ax: Axes, result: SearchResult) -> list[Line2D]:
    chosen = result.chosen
    if chosen is None:
        return []
    points = [p for p in result.points if p.candidate == chosen.candidate]
    ax.scatter(
        [p.tok_s_per_user for p in points],
        [p.tok_s_per_gpu for p in points],
        facecolors="none",
        edgecolors="red",
        s=60,
        linewidths=1.5,
    )
    label = f"chosen: {chosen.candidate.describe()}"
    return [Line2D([], [], color="red", marker="o", markerfacecolor="none", linestyle="", label=label)]
