"""PNG plots for `dspark eval`, `calibrate`, `bench load` and `report` (matplotlib, Agg backend: no display).

matplotlib is imported only when a plot is asked for, so evaluation without plots does not need it.
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dspark.errors import DsparkError
from dspark.eval.metrics import reliability_bins


def pyplot():
    """matplotlib.pyplot on the Agg backend; a one-line error when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as error:
        raise DsparkError("plots need matplotlib: pip install matplotlib") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Write `fig` to `path` (creating its folder), laid out tight."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


@contextmanager
def new_figure(path: str | Path, figsize: tuple[float, float] = (5.5, 3.5)) -> Iterator[tuple[Any, Any]]:
    """(fig, ax) of a new one-axes figure to draw on; written to `path` (`save_figure`) and closed after."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield fig, ax
        save_figure(fig, path)
    finally:
        plt.close(fig)


def _label_and_save(plt, fig, ax, path: str | Path, *, xlabel: str, ylabel: str, title: str) -> Path:
    """Label `ax`, add its legend, write `fig` to `path` and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def plot_position_acceptance(rates: Mapping[str, Sequence[float | None]], path: str | Path) -> Path:
    """Grouped bars: conditional acceptance per draft position (paper Fig. 2), one group per series."""
    plt = pyplot()
    length = max((len(r) for r in rates.values()), default=0)
    width = 0.8 / max(len(rates), 1)
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * length + 2), 3.5))
    for i, (name, series) in enumerate(rates.items()):
        xs = [k + 1 + (i - (len(rates) - 1) / 2) * width for k in range(len(series))]
        ax.bar(xs, [0.0 if r is None else r for r in series], width=width, label=name)
    ax.set_xticks(range(1, length + 1))
    ax.set_ylim(0, 1)
    return _label_and_save(plt, fig, ax, path, xlabel="draft position k", ylabel="P(accept k | 1..k-1 accepted)",
                           title="Per-position conditional acceptance")


def plot_lines(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: str | Path, *, xlabel: str,
               ylabel: str, title: str, log2_x: bool = False) -> Path:
    """One line with markers per named (xs, ys) series."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if log2_x:
        ax.set_xscale("log", base=2)
    return _label_and_save(plt, fig, ax, path, xlabel=xlabel, ylabel=ylabel, title=title)


def plot_accepted_histogram(histograms: Mapping[str, Sequence[int]], path: str | Path) -> Path:
    """Fraction of rounds accepting exactly n drafts, one line per series."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for name, counts in histograms.items():
        total = sum(counts) or 1
        ax.plot(range(len(counts)), [c / total for c in counts], marker="o", label=name)
    ax.set_xticks(range(max((len(c) for c in histograms.values()), default=1)))
    return _label_and_save(plt, fig, ax, path, xlabel="accepted drafts per round", ylabel="fraction of rounds",
                           title="Accepted-length histogram")


def plot_reliability(
    panels: Sequence[tuple[str, Sequence[float], Sequence[float], Sequence[float]]],
    path: str | Path,
    num_bins: int = 10,
) -> Path:
    """Reliability diagrams (paper Fig. 6), one panel per (title, before, after, outcomes): observed
    frequency vs mean prediction per bin, before and after calibration, over the sample histogram."""
    plt = pyplot()
    cols = min(4, max(len(panels), 1))
    rows = math.ceil(len(panels) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, before, after, outcomes) in zip(axes.flat, panels, strict=False):
        counts = reliability_bins(after, outcomes, num_bins).counts
        share = ax.twinx()
        share.bar([(i + 0.5) / num_bins for i in range(num_bins)], counts, width=1 / num_bins, color="0.9")
        share.set_yticks([])
        ax.set_zorder(share.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=1)
        for label, probs in (("raw", before), ("calibrated", after)):
            bins = reliability_bins(probs, outcomes, num_bins)
            filled = bins.counts > 0
            ax.plot(bins.mean_predicted[filled], bins.observed[filled], marker="o", label=label)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("predicted acceptance", fontsize=8)
        ax.set_ylabel("observed acceptance", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)
