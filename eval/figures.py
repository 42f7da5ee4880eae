"""Figures of the evaluations: matplotlib on a non-interactive backend, PNGs written atomically, step axes, error
bars and the layer × head heat maps. Imports no model code. Importing this module has no side effects (matplotlib is
imported when a figure is drawn)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fileio import atomic_writer


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (selected here, not at import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure atomically as a PNG and close it."""
    with atomic_writer(path) as f:
        fig.savefig(f, format="png", dpi=120)
    pyplot().close(fig)


def step_axis(ax, steps: list[int]) -> None:
    """An x axis of optimizer steps: integer ticks (the one step alone when there is one)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    distinct = sorted(set(steps))
    if len(distinct) == 1:
        ax.set_xticks(distinct)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def error_bars(values: list[float], intervals: list[tuple[float, float]]) -> list[list[float]]:
    """matplotlib's `yerr` ([below], [above]) for `values` with (low, high) intervals: never negative (a bound on
    the wrong side of its value, or nan, gives a zero-length bar)."""
    def length(a: float, b: float) -> float:
        return b - a if b - a > 0 else 0.0
    return [[length(lo, v) for v, (lo, _) in zip(values, intervals)],
            [length(v, hi) for v, (_, hi) in zip(values, intervals)]]


def head_maps_figure(result: dict, labels: dict[str, str], suptitle: str):
    """One layer × head heat map per key of `labels` (result["per_head"][key]), titled with its label in words and
    result["summary"]'s mean: the per-head figure of eval.dynamics and eval.gauge."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(labels), figsize=(4 * len(labels), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], labels.items()):
        values = np.array(result["per_head"][key])
        image = ax.imshow(values, cmap="magma", aspect="auto")
        ax.set_xticks(range(values.shape[1]))
        ax.set_yticks(range(values.shape[0]))
        ax.set_title(f"{label}\n(mean {result['summary'][key]:.3g})", fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax)
    fig.suptitle(suptitle)
    fig.tight_layout()
    return fig
