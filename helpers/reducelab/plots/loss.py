"""Figures of notebook 03 (how to aggregate the loss from all ranks).

Three figures, drawn at the size they are shown (at most ``MAX_WIDTH`` wide, text of
``MIN_FONT`` points or more, colours from :mod:`reducelab.palette`):

* :class:`LossAggregationPlot`: each rank's per-sample losses, each rank's local mean,
  and three horizontal lines: the single-process reference (mean over the concatenated
  global batch), ``all_reduce(loss_sum) / all_reduce(count)`` (weighted by local batch
  size) and ``all_reduce(loss) / world_size`` (mean of per-rank means). The three lines
  differ in colour, width and dash pattern, and the legend gives each one's value.
  Used by :class:`reducelab.widgets.loss.LossExplorer`.
* :func:`parameter_drift`: the popular answer's training loop on every rank, without and
  with DDP: one parameter per rank over the steps, and how far the ranks' parameters
  are apart.
* :func:`gradient_variants`: grouped bars, one group per parameter element, comparing
  the gradient of each gradient-accumulation variant with the single-process full-batch
  reference gradient. Each variant has its own colour *and* hatching.

Source: ``torch.distributed.all_reduce``, https://pytorch.org/docs/stable/distributed.html ;
the learner question "How can I aggregate losses from all GPUs in DistributedDataParallel?"
(2025-01-30).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from . import (HATCHES, MARKERS, MIN_FONT, NEUTRAL, PALETTE, RANK_COLOURS, BuiltFigures,
               new_figure, png)

REFERENCE_STYLE = dict(color=PALETTE["black"], lw=3.0, ls="-")
"""The single-process reference: a thick black solid line."""
WEIGHTED_STYLE = dict(color=PALETTE["green"], lw=2.0, ls=(0, (6, 3)))
"""``all_reduce(sum) / all_reduce(count)``: a green dashed line (drawn over the reference)."""
MEAN_OF_MEANS_STYLE = dict(color=PALETTE["vermillion"], lw=2.0, ls=(0, (1.5, 1.5)))
"""``all_reduce(mean) / world_size``: a vermillion dotted line."""
SAMPLE_COLOUR = PALETTE["sky"]
"""Dots of per-sample losses."""
LOCAL_MEAN_COLOUR = PALETTE["blue"]
"""Short bars of each rank's local mean."""


class LossAggregationPlot(BuiltFigures):
    """One persistent figure per world_size: per-sample losses by rank, and the three
    global numbers.

    9.6 x 3.4 inches. The figure and its artists are made once per world_size
    (:class:`~reducelab.plots.BuiltFigures`: going back to a world size shown before
    gets its figure back); each :meth:`draw` only moves them (scatter offsets, line
    heights, labels), so a widget change does not build a new figure.
    """

    def __init__(self):
        self.fig = None

    def preparation(self, world_size: int):
        """The callable that builds (or restores) the figure of ``world_size`` ranks, or
        ``None`` if it is current: the explorer runs it while the ranks compute
        (:meth:`reducelab.widgets.Explorer.preparation`)."""
        return self._preparation(world_size, lambda: self._build(world_size))

    def _build(self, world_size: int) -> None:
        self.fig = new_figure(9.6, 3.4)
        self.ax = ax = self.fig.subplots()
        self._dots = [ax.scatter([], [], s=22, color=SAMPLE_COLOUR, marker="o", alpha=0.8,
                                 linewidths=0.5, edgecolors=LOCAL_MEAN_COLOUR, zorder=2)
                      for _ in range(world_size)]
        self._means = [ax.plot([r - 0.32, r + 0.32], [0, 0], color=LOCAL_MEAN_COLOUR, lw=3,
                               solid_capstyle="butt", zorder=3)[0]
                       for r in range(world_size)]
        self._counts = [ax.annotate("", (r, 1), xycoords=("data", "axes fraction"),
                                    xytext=(0, -3), textcoords="offset points", ha="center",
                                    va="top", fontsize=MIN_FONT)
                        for r in range(world_size)]
        self._lines = [ax.axhline(0, zorder=4, **REFERENCE_STYLE),
                       ax.axhline(0, zorder=5, **WEIGHTED_STYLE),
                       ax.axhline(0, zorder=5, **MEAN_OF_MEANS_STYLE)]
        self._legend = ax.legend(self._lines, ["", "", ""], loc="upper left",
                                 bbox_to_anchor=(1.01, 1.0), handlelength=3.2,
                                 title="one number for the global batch", title_fontsize=MIN_FONT,
                                 alignment="left")
        ax.set_xticks(range(world_size), [f"rank {r}" for r in range(world_size)])
        ax.set_xlim(-0.6, world_size - 0.4)
        ax.set_ylabel("per-sample loss")
        ax.set_title("dots: per-sample losses; short bars: each rank's local mean; "
                     "n: local batch size", fontsize=MIN_FONT, loc="left")

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
        build = self.preparation(world_size)
        if build is not None:
            build()
        rng = np.random.default_rng(0)  # fixed jitter: equal inputs give equal figures
        lo, hi = min(reference, weighted, mean_of_means), max(reference, weighted, mean_of_means)
        for r, losses in enumerate(per_rank_losses):
            a = np.asarray(losses, dtype=float).ravel()
            jitter = rng.uniform(-0.2, 0.2, size=a.size)
            self._dots[r].set_offsets(np.column_stack([r + jitter, a]))
            m = float(a.mean()) if a.size else float("nan")
            self._means[r].set_ydata([m, m])
            self._counts[r].set_text(f"n={a.size}")
            if a.size:
                lo, hi = min(lo, float(a.min())), max(hi, float(a.max()))
        span = hi - lo if hi > lo else 1.0
        self.ax.set_ylim(lo - 0.06 * span, hi + 0.2 * span)  # room for the n= labels
        labels = (f"reference, one process: {reference:.4f}",
                  f"all_reduce(sum) / all_reduce(count): {weighted:.4f}",
                  f"all_reduce(mean) / world_size: {mean_of_means:.4f}")
        for line, value, text, label in zip(self._lines, (reference, weighted, mean_of_means),
                                            self._legend.get_texts(), labels):
            line.set_ydata([value, value])
            text.set_text(label)
        return png(self.fig)


def _spread_labels(ys: Sequence[float], gap: float) -> list[float]:
    """Label heights near ``ys`` that are at least ``gap`` apart, in the same order."""
    order = np.argsort(ys)
    placed = np.asarray(ys, dtype=float)[order].copy()
    for i in range(1, len(placed)):
        placed[i] = max(placed[i], placed[i - 1] + gap)
    shift = (np.asarray(ys, dtype=float)[order] - placed).mean()  # re-centre the stack
    out = np.empty_like(placed)
    out[order] = placed + shift
    return out.tolist()


def parameter_drift(without_ddp, with_ddp, element: int | None = None,
                    names: Sequence[str] | None = None) -> bytes:
    """The popular answer's training loop on every rank, without and with DDP.

    Left: one parameter element per rank over the optimizer steps, without DDP (a line
    and a marker per rank, labelled at its end), and the same element with DDP (every
    rank the same; one black dashed line). Right: how far the ranks are apart, the
    largest ``max - min`` over ranks of any parameter element, per step, for both runs.

    Args:
        without_ddp, with_ddp: array-likes of shape ``(world_size, steps + 1, P)``: every
            rank's flattened parameters before the first step and after each step.
        element: which of the ``P`` elements the left panel shows; default: the one
            whose ranks are furthest apart after the last step without DDP.
        names: optional ``P`` names of the elements, for the left panel's axis label.

    Returns:
        PNG bytes of a 9.6 x 3.6 in figure.

    Raises:
        ValueError: the two runs differ in shape, or are not 3-D.
    """
    a = np.asarray(without_ddp, dtype=float)
    b = np.asarray(with_ddp, dtype=float)
    if a.ndim != 3 or a.shape != b.shape:
        raise ValueError(f"both runs must have the shape (world_size, steps + 1, P), "
                         f"got {a.shape} and {b.shape}")
    world_size, n_points, p = a.shape
    spread_a = (a.max(0) - a.min(0)).max(1)
    spread_b = (b.max(0) - b.min(0)).max(1)
    if element is None:
        element = int(np.argmax(a[:, -1].max(0) - a[:, -1].min(0)))
    name = names[element] if names is not None else f"parameter element {element}"
    steps = np.arange(n_points)

    fig = new_figure(9.6, 3.6)
    left, right = fig.subplots(1, 2, width_ratios=[1.25, 1])
    ends = []
    for r in range(world_size):
        left.plot(steps, a[r, :, element], color=RANK_COLOURS[r % 8], marker=MARKERS[r % 8],
                  markersize=5, lw=1.6)
        ends.append(a[r, -1, element])
    left.plot(steps, b[0, :, element], color=PALETTE["black"], ls="--", lw=2.2)
    ends.append(b[0, -1, element])
    lo, hi = min(a[..., element].min(), b[..., element].min()), \
        max(a[..., element].max(), b[..., element].max())
    span = hi - lo if hi > lo else 1.0
    left.set_ylim(lo - 0.08 * span, hi + 0.08 * span)
    texts = [f"rank {r}" for r in range(world_size)] + ["DDP, every rank"]
    colours = [RANK_COLOURS[r % 8] for r in range(world_size)] + [PALETTE["black"]]
    for y, text, colour in zip(_spread_labels(ends, 0.075 * span), texts, colours):
        left.annotate(text, (steps[-1], y), xytext=(6, 0), textcoords="offset points",
                      va="center", fontsize=MIN_FONT, color=colour)
    left.set_xlim(0, steps[-1] * 1.32)
    left.set_xticks(steps[::max(1, len(steps) // 6)])
    left.set_xlabel("optimizer step")
    left.set_ylabel(name)
    left.set_title("one parameter, each rank", fontsize=MIN_FONT + 1)

    right.plot(steps, spread_a, color=PALETTE["vermillion"], marker="o", markersize=5, lw=2)
    right.plot(steps, spread_b, color=PALETTE["black"], ls="--", marker="s", markersize=5, lw=2)
    right.annotate("without DDP", (steps[-1], spread_a[-1]), xytext=(-6, 6),
                   textcoords="offset points", ha="right", va="bottom", fontsize=MIN_FONT,
                   color=PALETTE["vermillion"])
    right.annotate(f"with DDP: {spread_b.max():g} at every step", (steps[-1], spread_b[-1]),
                   xytext=(-6, 6), textcoords="offset points", ha="right", va="bottom",
                   fontsize=MIN_FONT, color=PALETTE["black"])
    right.set_ylim(-0.05 * max(spread_a.max(), 1e-12), 1.15 * max(spread_a.max(), 1e-12))
    right.set_xticks(steps[::max(1, len(steps) // 6)])
    right.set_xlabel("optimizer step")
    right.set_ylabel("max - min over ranks,\nlargest over parameters")
    right.set_title("how far apart the ranks are", fontsize=MIN_FONT + 1)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return png(fig)


VARIANT_COLOURS = [PALETTE["black"], PALETTE["blue"], PALETTE["sky"], PALETTE["orange"],
                   PALETTE["vermillion"], PALETTE["purple"], PALETTE["green"], NEUTRAL]
"""Colour of series ``k`` in :func:`gradient_variants` (the reference first)."""


def gradient_variants(reference, variants: Mapping[str, object],
                      names: Sequence[str] | None = None,
                      title: str = "each variant's gradient against the full-batch reference",
                      ylabel: str = "gradient") -> bytes:
    """Grouped bars: the reference gradient and each variant's gradient, element by element.

    Series ``k`` (the reference is series 0) has colour ``VARIANT_COLOURS[k]`` and hatch
    ``HATCHES[k]``, so the legend reads without telling colours apart.

    Args:
        reference: 1-D array-like of floats, the single-process full-batch gradient of
            all parameters flattened (length ``p``).
        variants: ``{label: gradient}``, each gradient a 1-D array-like of length ``p``;
            at most 7 variants.
        names: ``p`` labels for the parameter elements (default ``"p0".."p{p-1}"``).
        title: the figure title.
        ylabel: the y axis's label (notebook 03 plots each gradient divided by the
            reference, ``"gradient / reference"``, so that a factor of 4 does not dwarf the
            rest).

    Returns:
        PNG bytes of a 9.6 x 3.4 in figure.

    Raises:
        ValueError: a variant's length differs from the reference's, ``names`` has the
            wrong length, or there are more than 7 variants.
    """
    ref = np.asarray(reference, dtype=float).ravel()
    p = ref.size
    names = list(names) if names is not None else [f"p{i}" for i in range(p)]
    if len(names) != p:
        raise ValueError(f"names needs {p} labels (one per gradient element), got {len(names)}")
    if len(variants) > len(VARIANT_COLOURS) - 1:
        raise ValueError(f"at most {len(VARIANT_COLOURS) - 1} variants, got {len(variants)}")
    series = [("reference: one process, full batch", ref)]
    for label, g in variants.items():
        a = np.asarray(g, dtype=float).ravel()
        if a.size != p:
            raise ValueError(f"variant {label!r} has {a.size} gradient elements, the reference has {p}")
        series.append((label, a))
    fig = new_figure(9.6, 3.4)
    ax = fig.subplots()
    width = 0.84 / len(series)
    x = np.arange(p)
    for k, (label, a) in enumerate(series):
        ax.bar(x - 0.42 + width * (k + 0.5), a, width, label=label, color=VARIANT_COLOURS[k],
               hatch=HATCHES[k % len(HATCHES)],   # in the edge's colour (k = 0: no hatch)
               edgecolor=PALETTE["black"], linewidth=0.6)
    ax.axhline(0, color=PALETTE["black"], lw=0.8)
    ax.set_xticks(x, names)
    ax.set_xlabel("gradient element")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=MIN_FONT + 1, loc="left")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), handlelength=2.4, handleheight=1.4)
    return png(fig)
