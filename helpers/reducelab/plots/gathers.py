"""Figures of notebook 12 (uneven gathers and exact metrics).

* :class:`SamplerFigure`: what ``DistributedSampler`` hands each rank, batch by batch
  (the sample numbers, the repeats its padding adds, the samples ``drop_last`` leaves
  out, the predictions that are wrong), beside the accuracy and the mean loss computed
  three ways. Used by :class:`reducelab.widgets.gathers.SamplerExplorer`.
* :func:`cost_figure`: the time of three ways to gather tensors of different sizes,
  against their size, with the spread of the repeats.

Every figure follows the rules of :mod:`reducelab.plots`: at most ``MAX_WIDTH`` wide,
text of ``MIN_FONT`` points or more, colours from :mod:`reducelab.palette`, and nothing
said by colour alone (repeats are hatched and labelled, wrong predictions carry a ✗,
bars carry their values and their own hatching).

Source: ``torch.utils.data.distributed.DistributedSampler``,
https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from . import (MARKERS, MAX_WIDTH, MIN_FONT, NEUTRAL, PALETTE, TEXT_GREY, freeze_layout,
               new_figure, png)

METHODS = ("each sample once", "with the sampler's indices", "mean of batch means")
"""The three ways :class:`SamplerFigure` shows a metric, in its order: the exact one (every
sample of the data set once), sums and counts over what the sampler handed the ranks
(repeats counted again, dropped samples missing), and the mean of each rank's per-batch
means, averaged over ranks."""
METHOD_STYLE = {
    "each sample once": dict(color=PALETTE["green"], hatch=""),
    "with the sampler's indices": dict(color=PALETTE["orange"], hatch="//"),
    "mean of batch means": dict(color=PALETTE["sky"], hatch=".."),
}
"""Colour and hatching of each method's bars (the repeats' cells share the orange and the
hatching of the second)."""
REPEAT_STYLE = dict(facecolor=PALETTE["orange"], hatch="//", edgecolor=TEXT_GREY)
"""A cell holding a repeat added by the sampler's padding."""
ONCE_STYLE = dict(facecolor="white", edgecolor=TEXT_GREY)
"""A cell holding a sample evaluated once."""
DROPPED_STYLE = dict(facecolor=NEUTRAL, hatch="xx", edgecolor=TEXT_GREY)
"""A cell holding a sample that no rank evaluates (``drop_last=True``)."""
WRONG_COLOUR = PALETTE["vermillion"]
"""Text colour of a wrong prediction, always beside a ✗."""
MIN_CELL_PX = 20
"""Narrowest cell that gets its sample number written in it, in pixels (two digits at
``MIN_FONT`` points)."""
MIN_CROSS_PX = 36
"""Narrowest cell whose number of a wrong prediction gets a ✗ after it, in pixels."""
WRONG_FRAME = dict(facecolor="none", edgecolor=PALETTE["vermillion"], lw=2.5)
"""The frame of a cell whose sample is predicted wrongly, at any cell width: a line
thicker than any other cell's, not only a colour."""


class SamplerFigure:
    """Each rank's sample numbers, batch by batch, and a metric computed three ways.

    9.6 inches wide; 1.8 + 0.38 inches high per row of cells (a row per rank, and one
    more for the samples ``drop_last`` leaves out), 3.2 inches at least. The figure, its axes and its bars are
    made once per number of rows, with the layout computed once and then kept
    (:func:`reducelab.plots.freeze_layout`); each :meth:`draw` replaces only the cells
    and moves the bars, so a widget change costs one render.

    Attributes:
        fig: the figure (``None`` before the first draw).
        write_numbers: whether the last draw wrote the sample numbers in the cells (they
            are left out when a cell is narrower than :data:`MIN_CELL_PX`).
        write_crosses: whether a wrong prediction's number got a ✗ (cells of
            :data:`MIN_CROSS_PX` or more); its thick frame is drawn at any width.
    """

    def __init__(self):
        self.fig = None
        self.write_numbers = self.write_crosses = True
        self._rows = None
        self._cells = []

    def _build(self, rows: int) -> None:
        from matplotlib.patches import Patch
        fig = new_figure(MAX_WIDTH, max(3.2, 1.8 + 0.38 * rows))
        grid = fig.add_gridspec(2, 2, width_ratios=[2.35, 1], hspace=0.15)
        self.grid_ax = ax = fig.add_subplot(grid[:, 0])
        self.bar_axes = (fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, 1]))
        ax.set_ylim(rows, 0)
        ax.set_yticks([r + 0.5 for r in range(rows)], ["no rank"] * rows)   # room for the labels
        ax.set_xticks([])
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(left=False)
        handles = [Patch(lw=0.8, **ONCE_STYLE, label="evaluated once"),
                   Patch(lw=0.8, **REPEAT_STYLE, label="repeat (padding)"),
                   Patch(lw=0.8, **DROPPED_STYLE, label="dropped: no rank")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncols=3,
                  frameon=False, fontsize=MIN_FONT, handlelength=1.6, borderaxespad=0.2)
        ax.set_title("each rank's sample numbers, in order; black bars end a batch; "
                     "thick frame, ✗: wrong prediction", fontsize=MIN_FONT, loc="left")
        self.bars, self.bar_texts = [], []
        for bar_ax, name in zip(self.bar_axes, ("accuracy (%)", "mean loss")):
            ys = np.arange(len(METHODS))
            bars = [bar_ax.barh(y, 1.0, color=METHOD_STYLE[m]["color"], hatch=METHOD_STYLE[m]["hatch"],
                                edgecolor=TEXT_GREY, lw=0.8, height=0.7)[0] for y, m in zip(ys, METHODS)]
            texts = [bar_ax.text(0, y, "", va="center", ha="left", fontsize=MIN_FONT) for y in ys]
            bar_ax.set_yticks(ys, METHODS)
            bar_ax.set_ylim(len(METHODS) - 0.5, -0.5)
            bar_ax.set_xticks([])
            bar_ax.set_title(name, fontsize=MIN_FONT, loc="left")
            for side in ("top", "right", "bottom"):
                bar_ax.spines[side].set_visible(False)
            self.bars.append(bars)
            self.bar_texts.append(texts)
        fig.suptitle("a title of about the length of the real ones, on one line")
        freeze_layout(fig)
        self.fig, self._rows, self._cells = fig, rows, []

    def draw(self, batches: Sequence[Sequence[Sequence[int]]], repeats: Sequence[Sequence[bool]],
             dropped: Sequence[int], wrong: set, metrics: Mapping[str, tuple[float, float]],
             title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            batches: per rank, its batches in order, each a list of sample numbers (ints).
                ``len(batches)`` is the world size.
            repeats: per rank, one bool per index the rank holds (in order): True where
                that index is a repeat added by the sampler's padding.
            dropped: the sample numbers no rank holds.
            wrong: the sample numbers the model predicts wrongly.
            metrics: ``{method: (accuracy, mean loss)}`` for each of :data:`METHODS`;
                accuracy in [0, 1], NaN where a method has no sample to average.
            title: the figure's title.

        Raises:
            ValueError: ``batches`` is empty, ``repeats`` has another shape than the
                indices in ``batches``, or a method of :data:`METHODS` is missing.
        """
        world_size = len(batches)
        if world_size == 0:
            raise ValueError("batches needs one entry per rank, got none")
        held = [[i for b in rank for i in b] for rank in batches]
        if len(repeats) != world_size or any(len(r) != len(h) for r, h in zip(repeats, held)):
            raise ValueError("repeats needs one bool per index each rank holds, in the shape "
                             "of batches")
        missing = [m for m in METHODS if m not in metrics]
        if missing:
            raise ValueError(f"metrics needs a value for each of {', '.join(METHODS)}; "
                             f"missing {', '.join(missing)}")
        rows = world_size + (1 if dropped else 0)
        if rows != self._rows:
            self._build(rows)
        self._grid(batches, repeats, dropped, wrong, rows)
        for k, scale, fmt in ((0, 100, "{:.1f}"), (1, 1, "{:.3f}")):
            values = [metrics[m][k] * scale for m in METHODS]
            finite = [v for v in values if math.isfinite(v)]
            top = max(finite) if finite and max(finite) > 0 else 1.0
            for bar, text, v in zip(self.bars[k], self.bar_texts[k], values):
                ok = math.isfinite(v)
                bar.set_width(v if ok else 0.0)
                bar.set_visible(ok)
                text.set_x(v if ok else 0.0)
                text.set_text(f" {fmt.format(v)}" if ok else " no sample")
            self.bar_axes[k].set_xlim(0, top * 1.45)
        self.fig.suptitle(title)
        return png(self.fig)

    def _grid(self, batches, repeats, dropped, wrong, rows) -> None:
        from matplotlib.collections import LineCollection, PatchCollection
        from matplotlib.patches import Rectangle
        ax = self.grid_ax
        for artist in self._cells:
            artist.remove()
        self._cells = []
        columns = max([sum(map(len, b)) for b in batches] + [len(dropped), 1])
        ax.set_xlim(0, columns)
        labels = [f"rank {r}" for r in range(len(batches))] + (["no rank"] if dropped else [])
        ax.set_yticks([r + 0.5 for r in range(rows)], labels)
        cell_px = ax.get_window_extent().width / columns
        self.write_numbers, self.write_crosses = cell_px >= MIN_CELL_PX, cell_px >= MIN_CROSS_PX
        styles = {"once": [], "repeat": [], "dropped": []}
        frames = []
        separators = []
        for r, (rank_batches, rank_repeats) in enumerate(zip(batches, repeats)):
            k = 0
            for b, batch in enumerate(rank_batches):
                for i in batch:
                    styles["repeat" if rank_repeats[k] else "once"].append((k, r))
                    if i in wrong:
                        frames.append((k, r))
                    self._number(k + 0.5, r + 0.5, i, i in wrong)
                    k += 1
                if b < len(rank_batches) - 1:   # a batch ends here
                    separators.append([(k, r + 0.02), (k, r + 0.98)])
        for k, i in enumerate(dropped):
            styles["dropped"].append((k, rows - 1))
            if i in wrong:
                frames.append((k, rows - 1))
            self._number(k + 0.5, rows - 0.5, i, i in wrong)
        for name, style in (("once", ONCE_STYLE), ("repeat", REPEAT_STYLE),
                            ("dropped", DROPPED_STYLE)):
            if styles[name]:
                cells = PatchCollection([Rectangle((k + 0.04, r + 0.1), 0.92, 0.8)
                                         for k, r in styles[name]], lw=0.8, zorder=1, **style)
                self._cells.append(ax.add_collection(cells))
        if frames:
            self._cells.append(ax.add_collection(PatchCollection(
                [Rectangle((k + 0.04, r + 0.1), 0.92, 0.8) for k, r in frames], zorder=2.5,
                **WRONG_FRAME)))
        if separators:
            self._cells.append(ax.add_collection(LineCollection(
                separators, colors=PALETTE["black"], linewidths=2.5, zorder=2)))

    def _number(self, x, y, i, is_wrong) -> None:
        """The sample number on a white label, readable on every cell style, with a ✗ when
        predicted wrongly and the cell wide enough (:data:`MIN_CROSS_PX`). Whatever the
        width, a wrong prediction's cell also gets a thick frame (see :meth:`_grid`)."""
        if not self.write_numbers:
            return
        cross = is_wrong and self.write_crosses
        self._cells.append(self.grid_ax.text(
            x, y, f"{i}✗" if cross else str(i), ha="center", va="center",
            fontsize=MIN_FONT, zorder=3, color=WRONG_COLOUR if is_wrong else PALETTE["black"],
            fontweight="bold" if is_wrong else "normal",
            bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none")))


def cost_figure(times: Mapping[str, Mapping[int, Sequence[float]]], title: str = "") -> bytes:
    """The time of each way of gathering, against the size gathered, log-log: one line per
    way (its own colour and marker, labelled at its end), the median of the repeats as a
    marker and their range (fastest to slowest) as an error bar.

    Args:
        times: ``{way: {numbers on the largest rank: [seconds of each repeat, ...]}}``.
        title: the figure's title.

    Raises:
        ValueError: ``times`` is empty, or a repeat is not a positive number of seconds.
    """
    if not times:
        raise ValueError("times needs at least one way of gathering")
    fig = new_figure(8.0, 3.6)
    ax = fig.subplots()
    colours = [PALETTE["green"], PALETTE["blue"], PALETTE["vermillion"], PALETTE["purple"]]
    for k, (way, by_size) in enumerate(times.items()):
        sizes = sorted(by_size)
        runs = [np.asarray(by_size[n], dtype=float) for n in sizes]
        if any(r.size == 0 or not (r > 0).all() for r in runs):
            raise ValueError(f"every repeat must be a positive number of seconds ({way!r})")
        med = np.array([np.median(r) for r in runs]) * 1e3
        lo = med - np.array([r.min() for r in runs]) * 1e3
        hi = np.array([r.max() for r in runs]) * 1e3 - med
        ax.errorbar(sizes, med, yerr=[lo, hi], color=colours[k % 4], marker=MARKERS[k],
                    capsize=4, lw=2, ms=7, label=way)
    ax.set_xscale("log")
    ax.set_yscale("log")
    sizes = sorted({n for by_size in times.values() for n in by_size})
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("numbers on the largest rank (float32)")
    ax.set_ylabel("milliseconds per gather")
    ax.legend(loc="upper left", fontsize=MIN_FONT)
    ax.set_title(title or "median of the repeats; bars: fastest to slowest", fontsize=MIN_FONT)
    return png(fig)


__all__ = ["METHODS", "SamplerFigure", "cost_figure"]
