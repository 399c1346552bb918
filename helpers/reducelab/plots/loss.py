"""Figures of notebook 03 (how to aggregate the loss from all ranks).

Two figures:

* :class:`LossAggregationPlot`: each rank's per-sample losses, each rank's local mean,
  and three horizontal lines: the single-process reference (mean over the concatenated
  global batch), ``all_reduce(loss) / world_size`` (mean of per-rank means) and
  ``all_reduce(loss_sum) / all_reduce(count)`` (weighted by local batch size). Used by
  :class:`reducelab.widgets.loss.LossExplorer`.
* :func:`gradient_variants`: grouped bars, one group per parameter element, comparing
  the gradient of each gradient-accumulation variant with the single-process full-batch
  reference gradient.

Source: the learner question is seed ``003_01e4708bffbae090.txt``; the collective is
``torch.distributed.all_reduce``, https://pytorch.org/docs/stable/distributed.html
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from . import new_figure, png

REFERENCE_COLOUR = "black"
MEAN_OF_MEANS_COLOUR = "#d62728"
WEIGHTED_COLOUR = "#2ca02c"
RANK_COLOUR = "#1f77b4"


class LossAggregationPlot:
    """One persistent figure: per-sample losses by rank, and the three global numbers.

    The figure and its artists are made once per world_size; each :meth:`draw` only
    moves them (scatter offsets, line heights, labels), so a widget change does not
    build a new figure.
    """

    def __init__(self):
        self.fig = new_figure(9.5, 3.6)
        self.ax = self.fig.subplots()
        self._world_size = None

    def _build(self, world_size: int) -> None:
        ax = self.ax
        ax.clear()
        self._dots = [ax.scatter([], [], s=14, color=RANK_COLOUR, alpha=0.55, linewidths=0)
                      for _ in range(world_size)]
        self._means = [ax.plot([r - 0.3, r + 0.3], [0, 0], color=RANK_COLOUR, lw=2.5)[0]
                       for r in range(world_size)]
        self._counts = [ax.annotate("", (r, 0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                                    textcoords="offset points", ha="center", fontsize=8)
                        for r in range(world_size)]
        self._lines = [ax.axhline(0, color=REFERENCE_COLOUR, lw=2.5),
                       ax.axhline(0, color=WEIGHTED_COLOUR, lw=1.5, ls=(0, (5, 3))),
                       ax.axhline(0, color=MEAN_OF_MEANS_COLOUR, lw=1.5, ls=(0, (2, 2)))]
        self._legend = ax.legend(self._lines, ["", "", ""], fontsize=8, loc="upper left",
                                 bbox_to_anchor=(1.01, 1.0))
        ax.set_xticks(range(world_size), [f"rank {r}" for r in range(world_size)])
        ax.set_xlim(-0.6, world_size - 0.4)
        ax.set_ylabel("per-sample loss")
        ax.set_title("dots: per-sample losses; short bars: each rank's local mean", fontsize=10)
        self._world_size = world_size

    def draw(self, per_rank_losses: Sequence, mean_of_means: float, weighted: float,
             reference: float) -> bytes:
        """Draw and return PNG bytes.

        Args:
            per_rank_losses: one 1-D array-like per rank (any float dtype); entry ``r``
                holds the per-sample losses of rank ``r``'s local batch, so its length is
                rank ``r``'s local batch size. ``len(per_rank_losses)`` is the world_size.
            mean_of_means: ``all_reduce(loss) / world_size`` as the ranks computed it.
            weighted: ``all_reduce(loss_sum) / all_reduce(count)`` as the ranks computed it.
            reference: the mean over the concatenated global batch, in one process.

        Raises:
            ValueError: ``per_rank_losses`` is empty.
        """
        if len(per_rank_losses) == 0:
            raise ValueError("per_rank_losses needs one entry per rank, got none")
        world_size = len(per_rank_losses)
        if self._world_size != world_size:
            self._build(world_size)
        rng = np.random.default_rng(0)  # fixed jitter: equal inputs give equal figures
        lo, hi = min(reference, weighted, mean_of_means), max(reference, weighted, mean_of_means)
        for r, losses in enumerate(per_rank_losses):
            a = np.asarray(losses, dtype=float).ravel()
            jitter = rng.uniform(-0.18, 0.18, size=a.size)
            self._dots[r].set_offsets(np.column_stack([r + jitter, a]))
            m = float(a.mean()) if a.size else float("nan")
            self._means[r].set_ydata([m, m])
            self._counts[r].set_text(f"n={a.size}")
            if a.size:
                lo, hi = min(lo, float(a.min())), max(hi, float(a.max()))
        pad = 0.06 * (hi - lo) if hi > lo else 1.0
        self.ax.set_ylim(lo - pad, hi + pad)
        labels = (f"reference, one process: {reference:.4f}",
                  f"all_reduce(sum) / all_reduce(count): {weighted:.4f}",
                  f"all_reduce(mean) / world_size: {mean_of_means:.4f}")
        for line, value, text, label in zip(self._lines, (reference, weighted, mean_of_means),
                                            self._legend.get_texts(), labels):
            line.set_ydata([value, value])
            text.set_text(label)
        return png(self.fig)


def gradient_variants(reference, variants: Mapping[str, object],
                      names: Sequence[str] | None = None,
                      title: str = "gradient of each variant against the full-batch reference") -> bytes:
    """Grouped bars: the reference gradient and each variant's gradient, element by element.

    Args:
        reference: 1-D array-like of floats, the single-process full-batch gradient of
            all parameters flattened (length ``p``).
        variants: ``{label: gradient}``, each gradient a 1-D array-like of length ``p``.
        names: ``p`` labels for the parameter elements (default ``"p0".."p{p-1}"``).
        title: the figure title.

    Returns:
        PNG bytes.

    Raises:
        ValueError: a variant's length differs from the reference's, or ``names`` has
            the wrong length.
    """
    ref = np.asarray(reference, dtype=float).ravel()
    p = ref.size
    names = list(names) if names is not None else [f"p{i}" for i in range(p)]
    if len(names) != p:
        raise ValueError(f"names needs {p} labels (one per gradient element), got {len(names)}")
    series = [("reference (one process, full batch)", ref)]
    for label, g in variants.items():
        a = np.asarray(g, dtype=float).ravel()
        if a.size != p:
            raise ValueError(f"variant {label!r} has {a.size} gradient elements, the reference has {p}")
        series.append((label, a))
    fig = new_figure(8.0, 3.6)
    ax = fig.subplots()
    width = 0.8 / len(series)
    colours = [REFERENCE_COLOUR, WEIGHTED_COLOUR, "#17becf", "#ff7f0e", MEAN_OF_MEANS_COLOUR,
               "#9467bd", "#8c564b"]
    x = np.arange(p)
    for k, (label, a) in enumerate(series):
        ax.bar(x - 0.4 + width * (k + 0.5), a, width, label=label, color=colours[k % len(colours)])
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(x, names)
    ax.set_ylabel("gradient")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return png(fig)
