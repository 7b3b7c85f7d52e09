"""Small PNG plots for the evaluate stage (matplotlib, Agg backend, one line per policy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

_FIGSIZE = (5.0, 3.4)
_DPI = 110


def _line_plot(
    series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *, xlabel: str, ylabel: str, title: str
) -> Path:
    # the Agg canvas directly, no pyplot: no global backend switch, safe in threads and loops
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=_FIGSIZE, dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in sorted(series.items()):
        pts = sorted((float(x), float(y)) for x, y in points)
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_memory_curve(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path) -> Path:
    """Cache memory (MiB) vs generated length, one line per policy (from :func:`kvpop.rollouts.memory_curve`)."""
    return _line_plot(curves, path, xlabel="generated tokens", ylabel="KV cache (MiB)", title="Cache memory vs generated length")


def plot_accuracy_vs_budget(
    points: Mapping[str, Sequence[tuple[int, float]]], path: str | Path, metric_name: str
) -> Path:
    """``metric_name`` vs KV budget, one line per policy; ``points`` may merge the current run with
    earlier experiments' metrics (several budgets per policy)."""
    return _line_plot(points, path, xlabel="KV budget (tokens)", ylabel=metric_name, title=f"{metric_name} vs budget")
