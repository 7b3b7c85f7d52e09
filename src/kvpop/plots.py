"""Small PNG plots for the evaluate stage (matplotlib, Agg backend): curves with one line per policy
(identical curves share one line, named together), the per-head keep map, and the occupancy of
one pool per layer and KV head."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_FIGSIZE = (5.0, 3.4)
_DPI = 110
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_STYLES = ("-", "--", "-.", ":")


def shared_lines(series: Mapping[str, Sequence[tuple[float, float]]]) -> list[tuple[tuple[tuple[float, float], ...], list[str]]]:
    """(sorted points, names) per distinct curve: identical curves (every bounded cache at one budget
    holds the same memory) become one line named after all of them; empty ones are left out."""
    groups: dict[tuple, list[str]] = {}
    for name, points in sorted(series.items()):
        pts = tuple(sorted((float(x), float(y)) for x, y in points))
        if pts:
            groups.setdefault(pts, []).append(name)
    return list(groups.items())


def _figure(path: str | Path, figsize: tuple[float, float]):
    """(the output path, its folder made; a Figure on the Agg canvas): no pyplot, so no global backend
    switch, safe in threads and loops."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=figsize, dpi=_DPI)
    FigureCanvasAgg(fig)
    return path, fig


def _line_plot(
    series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *, xlabel: str, ylabel: str, title: str,
    zero_based: bool = False,
) -> Path:
    path, fig = _figure(path, _FIGSIZE)
    ax = fig.add_subplot()
    for i, (pts, names) in enumerate(shared_lines(series)):
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], linestyle=_STYLES[i % len(_STYLES)], markersize=4, linewidth=1.5,
                label=", ".join(names) if len(names) < 4 else f"{', '.join(names[:3])} +{len(names) - 3} (same)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if zero_based:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_memory_curve(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path) -> Path:
    """Cache memory (MiB) vs generated length, one line per policy (from :func:`kvpop.rollouts.memory_curve`);
    the y axis starts at zero."""
    return _line_plot(curves, path, xlabel="generated tokens", ylabel="KV cache (MiB)", title="Cache memory vs generated length",
                      zero_based=True)


def plot_keep_map(maps: Mapping[str, Any], path: str | Path, *, marks: Mapping[str, Sequence[int]] | None = None, title: str = "") -> Path:
    """One panel per policy: rows are (layer, KV head), columns positions of one trace, the colour the
    share of its remaining trace a token stayed in that head's cache (:func:`kvpop.evaluate.keep_map`;
    1 = kept to the end). ``marks``: positions to tick above the panels, e.g. ``definitions`` (the
    sources the quotes copy) and ``quotes``."""
    names = list(maps)
    path, fig = _figure(path, (9.0, 1.1 + 1.6 * max(1, len(names))))
    axes = fig.subplots(max(1, len(names)), 1, sharex=True, squeeze=False)[:, 0]
    colours = ("tab:red", "tab:orange", "tab:green")
    image = None
    for ax, name in zip(axes, names, strict=False):
        m = maps[name]
        m = m.reshape(-1, m.shape[-1]).float().numpy() if hasattr(m, "reshape") else m  # (L * Hk, S)
        image = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_ylabel(f"{name}\nlayer x head", fontsize=7)
        ax.set_yticks([])
        for i, (label, xs) in enumerate((marks or {}).items()):
            rows = m.shape[0]
            ax.vlines(list(xs), -0.5 - 0.06 * rows * (i + 1), -0.5 - 0.06 * rows * i, colors=colours[i % 3], linewidth=1.0,
                      label=label if ax is axes[0] else None, clip_on=False)
    axes[-1].set_xlabel("position in the trace")
    if marks:
        axes[0].legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(marks), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.8, label="share of the rest of the trace kept")
    fig.savefig(path, format="png")
    return path


def plot_occupancy(maps: Mapping[str, Any], path: str | Path, *, title: str = "") -> Path:
    """One panel per policy: the entries each (layer, KV head) held at the traces' last token over the
    per-head budget (``occupancy_map`` of :func:`kvpop.evaluate.evaluate_fidelity`, ``[layer][head]``):
    how a ``one_pool`` policy split its pool (1 everywhere: the per-head split of every other
    policy)."""
    from matplotlib.colors import TwoSlopeNorm

    names = list(maps)
    path, fig = _figure(path, (1.6 + 2.0 * max(1, len(names)), 4.2))
    axes = fig.subplots(1, max(1, len(names)), squeeze=False)[0]
    top = max([2.0] + [float(max(max(row) for row in maps[n])) for n in names])
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    image = None
    for ax, name in zip(axes, names, strict=False):
        image = ax.imshow(maps[name], aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("KV head", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("layer", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.8, label="entries held / per-head budget")
    fig.savefig(path, format="png")
    return path
