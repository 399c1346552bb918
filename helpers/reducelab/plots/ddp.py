"""Figures of notebook 04 (DDP gradients and loss reductions), drawn to PNG bytes at the
size they are shown (at most ``MAX_WIDTH`` wide, text of ``MIN_FONT`` points or more,
colours from :mod:`reducelab.palette`).

* :class:`GradientScatter`: left, every element of the DDP gradient against the same
  element of the single-process full-batch gradient (a constant factor ``k`` puts every
  point on the line ``y = k x``; uneven local batches with ``reduction="mean"`` scatter
  them); right, why: the weight one sample of each rank gets in DDP's gradient,
  relative to its weight in one process.
* :func:`loss_curves`: loss per optimizer step of several training runs, overlaid, with
  the legend below the panels so that it never covers a curve.

Source: DDP divides each gradient by ``world_size`` and all_reduces it with a sum
(``Reducer::mark_variable_ready_dense`` and ``Reducer::set_divide_factor`` in
``torch/csrc/distributed/c10d/reducer.cpp``); https://pytorch.org/docs/stable/notes/ddp.html
"""
from __future__ import annotations

import numpy as np

from . import MARKERS, MIN_FONT, NEUTRAL, PALETTE, new_figure, png

POINT_COLOUR = PALETTE["blue"]
"""Gradient elements in the scatter."""
FIT_COLOUR = PALETTE["vermillion"]
"""The line ``y = k x``."""
SAME_COLOUR = PALETTE["black"]
"""The line ``y = x`` (the same gradient) and "one process" references."""
WEIGHT_COLOUR = PALETTE["sky"]
"""Bars of per-sample weights."""


def sample_weights(sizes, reduction: str) -> np.ndarray:
    """Weight of one sample of rank ``r`` in DDP's gradient, relative to its weight in one
    process's gradient on the whole global batch, for each rank.

    DDP's gradient is ``(1/W) * sum_r grad(loss_r)``. With ``reduction="mean"`` a sample
    of rank ``r`` is weighted ``1 / (W * n_r)`` by DDP and ``1 / N`` by one process
    (``N = sum(sizes)``): the ratio is ``N / (W * n_r)``. With ``"sum"`` it is ``1 / W``.

    Args:
        sizes: local batch size of each rank, positive ints; ``len(sizes)`` is ``W``.
        reduction: ``"mean"`` or ``"sum"``.

    Returns:
        float64 array of shape ``(W,)``.

    Raises:
        ValueError: empty ``sizes``, a size below 1, or another reduction.
    """
    n = np.asarray(sizes, dtype=float)
    if n.size == 0 or (n < 1).any():
        raise ValueError(f"sizes needs one positive local batch size per rank, got {list(sizes)}")
    if reduction == "sum":
        return np.full(n.size, 1.0 / n.size)
    if reduction == "mean":
        return n.sum() / (n.size * n)
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


class GradientScatter:
    """Two panels, 9.6 x 3.9 in: DDP gradient elements against full-batch gradient
    elements, and each rank's per-sample weight relative to one process.

    The scatter panel is built once and updated on each :meth:`draw` (a widget redraw);
    the weight panel is redrawn, since its number of bars follows the world size.
    """

    def __init__(self):
        from matplotlib.ticker import MaxNLocator
        self.fig = new_figure(9.6, 3.9, layout_key="gradient scatter")
        self.ax, self.wax = self.fig.subplots(1, 2, width_ratios=[1.1, 1])
        ax = self.ax
        ax.axhline(0, color=NEUTRAL, lw=0.8)
        ax.axvline(0, color=NEUTRAL, lw=0.8)
        (self._same,) = ax.plot([], [], ls=(0, (2, 2)), color=SAME_COLOUR, lw=1.4,
                                label="y = x: the same gradient")
        (self._fit,) = ax.plot([], [], ls="-", color=FIT_COLOUR, lw=1.6, label="y = k x")
        self._points = ax.scatter([], [], s=14, marker="o", alpha=0.7, color=POINT_COLOUR,
                                  linewidths=0, label="one gradient element")
        ax.set_xlabel("one process, full batch")
        ax.set_ylabel("DDP (rank 0)")
        # steps of 1, 2 or 5 (no 2.5: at ±0.1, ticks of 0.025 ran together as
        # "−0.100−0.075"), at most 9 of them
        ax.xaxis.set_major_locator(MaxNLocator(nbins=9, steps=[1, 2, 5, 10]))
        self._legend = None
        self._weights = None       # the weight panel's artists, removed on the next draw

    def draw(self, ddp, full, factor: float, constant: bool, sizes=None, reduction=None,
             title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            ddp, full: array-likes of the same length (flattened gradients).
            factor: the least-squares factor ``k`` (drawn as ``y = k x``).
            constant: whether ``ddp == k * full`` holds (changes the line's label).
            sizes: the local batch size of each rank; with ``reduction`` it draws the
                weight panel (:func:`sample_weights`); without, that panel says so.
            reduction: ``"mean"`` or ``"sum"``.
            title: figure title.

        Raises:
            ValueError: ``ddp`` and ``full`` differ in length.
        """
        x = np.asarray(full, dtype=float).ravel()
        y = np.asarray(ddp, dtype=float).ravel()
        if x.shape != y.shape:
            raise ValueError(f"ddp and full must have the same length, got {y.size} and {x.size}")
        lim = 1.08 * max(np.abs(x).max(), np.abs(y).max(), 1e-12)
        self._points.set_offsets(np.column_stack([x, y]))
        self._same.set_data([-lim, lim], [-lim, lim])
        self._fit.set_data([-lim, lim], [-factor * lim, factor * lim])
        self._fit.set_label(f"y = {factor:.4g} x" + ("" if constant else "\n(best fit: the points miss it)"))
        self.ax.set_xlim(-lim, lim)
        self.ax.set_ylim(-lim, lim)
        self.ax.set_title("each gradient element", fontsize=MIN_FONT + 1)
        if self._legend is not None:
            self._legend.remove()
        # DDP's ratios are positive, so the upper-left quadrant stays empty
        self._legend = self.ax.legend(handles=[self._points, self._same, self._fit],
                                      loc="upper left", fontsize=MIN_FONT, framealpha=0.9)
        self._draw_weights(sizes, reduction)
        self.fig.suptitle(title, fontsize=MIN_FONT + 1)
        return png(self.fig)

    def _draw_weights(self, sizes, reduction) -> None:
        ax = self.wax
        if self._weights is None or sizes is None or reduction is None:
            # the first draw, and any draw into or out of "no local batch sizes": a
            # clean panel
            ax.clear()
            ax.set_title("why: one sample's weight, DDP / one process", fontsize=MIN_FONT + 1)
        else:
            # the panel keeps its axes, ticks and title (clearing them costs about a
            # quarter of a redraw); only what shows the last sizes goes
            for artist in self._weights:
                artist.remove()
        self._weights = None
        if sizes is None or reduction is None:
            ax.text(0.5, 0.5, "no local batch sizes given", ha="center", va="center",
                    transform=ax.transAxes, fontsize=MIN_FONT)
            ax.set_axis_off()
            return
        w = sample_weights(sizes, reduction)
        ranks = np.arange(len(w))
        bars = ax.bar(ranks, w, 0.7, color=WEIGHT_COLOUR, edgecolor=SAME_COLOUR, linewidth=0.6)
        top = max(1.0, float(w.max()))
        digits = 3 if len(w) <= 4 else 2  # narrower bars, shorter labels
        labels = [
            ax.annotate(f"{v:.{digits}g}", (bar.get_x() + bar.get_width() / 2, v),
                        xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                        fontsize=MIN_FONT, zorder=5,
                        bbox=dict(boxstyle="square,pad=0.1", facecolor="white",
                                  edgecolor="none"))
            for bar, v in zip(bars, w)]
        line = ax.axhline(1.0, color=SAME_COLOUR, ls=(0, (2, 2)), lw=1.4,
                          label="one process: weight ratio 1")
        legend = ax.legend(handles=[line], loc="upper right", fontsize=MIN_FONT, framealpha=0.9)
        self._weights = [bars, *labels, line, legend]
        ax.set_ylim(0, top * 1.5)  # the legend sits above the tallest bar and its value
        ax.set_xlim(-0.6, len(w) - 0.4)
        ax.set_xticks(ranks, [f"{r}\nn={n}" if len(w) <= 4 else f"{r}\n{n}"
                              for r, n in zip(ranks, sizes)])
        ax.set_xlabel("rank and its local batch size n" if len(w) <= 4
                      else "rank, and below it its local batch size")
        ax.set_ylabel("weight ratio")


LINE_STYLES = [dict(color=PALETTE["black"], ls="-", lw=3.0, marker=None),
               dict(color=PALETTE["sky"], ls="--", lw=1.8, marker=MARKERS[0]),
               dict(color=PALETTE["vermillion"], ls="-", lw=1.6, marker=MARKERS[1]),
               dict(color=PALETTE["orange"], ls=":", lw=2.2, marker=MARKERS[2]),
               dict(color=PALETTE["green"], ls="-.", lw=1.6, marker=MARKERS[3]),
               dict(color=PALETTE["purple"], ls="--", lw=1.6, marker=MARKERS[4]),
               dict(color=PALETTE["blue"], ls=":", lw=1.6, marker=MARKERS[5])]
"""Style of curve ``i`` in :func:`loss_curves`: colour, dash pattern and marker differ,
so overlapping curves stay visible and nothing is told by colour alone."""


GAP_FLOOR = 1e-9
"""Where :func:`loss_curves` draws a gap of exactly 0 (or below) on its log scale."""


def loss_curves(curves: dict, title: str = "", ylabel: str = "loss on all 1797 digits",
                reference: str | None = None) -> bytes:
    """Overlay loss curves; return PNG bytes of a figure 9.6 in wide with ``reference``
    (two panels), 7.0 in without.

    Args:
        curves: ``{label: sequence of float}``, one loss per optimizer step, drawn in
            order (the first thick, black and solid; later ones with their own colour,
            dash pattern and marker, so overlaps stay visible); at most 7 curves.
        title: figure title.
        ylabel: y-axis label.
        reference: optional label of one curve; a second panel then shows every other
            curve's ``|loss - reference loss|`` per step on a log scale, which separates
            "equal up to rounding" from "close". A log scale has no 0: gaps below
            :data:`GAP_FLOOR` (an exact 0 included) are drawn at it, and the panel's
            title says so.

    The legend sits below the panels, where it covers no curve.

    Raises:
        ValueError: ``curves`` is empty or has more than 7 curves, or ``reference`` is
            not one of its labels.
    """
    if not curves:
        raise ValueError("curves is empty: give at least one {label: losses}")
    if len(curves) > len(LINE_STYLES):
        raise ValueError(f"at most {len(LINE_STYLES)} curves, got {len(curves)}")
    if reference is not None and reference not in curves:
        raise ValueError(f"reference must be one of the labels {list(curves)}, got {reference!r}")
    rows = (len(curves) + 1) // 2
    fig = new_figure(9.6 if reference else 7.0, 3.3 + 0.22 * rows)
    axes = fig.subplots(1, 2 if reference else 1, squeeze=False)[0]
    ref = np.asarray(curves[reference], dtype=float) if reference else None
    handles = []
    for i, (label, ys) in enumerate(curves.items()):
        ys = np.asarray(ys, dtype=float)
        style = dict(LINE_STYLES[i])
        steps = np.arange(1, len(ys) + 1)
        every = max(1, len(ys) // 8)
        kw = dict(color=style["color"], ls=style["ls"], lw=style["lw"], marker=style["marker"],
                  markersize=6, markevery=(i * every // len(curves), every),
                  fillstyle="none" if i % 2 else "full")
        (h,) = axes[0].plot(steps, ys, label=label, **kw)
        handles.append(h)
        if reference and label != reference:
            n = min(len(ys), len(ref))
            axes[1].plot(steps[:n], np.maximum(np.abs(ys[:n] - ref[:n]), GAP_FLOOR), **kw)
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel(ylabel)
    axes[0].grid(alpha=0.3)
    if reference:
        axes[1].set_yscale("log")
        axes[1].set_xlabel("optimizer step")
        axes[1].set_ylabel(f"gap to '{reference}'", fontsize=MIN_FONT)
        axes[1].set_title(f"log scale: exact 0 drawn at {GAP_FLOOR:.0e}".replace("e-0", "e-"),
                          fontsize=MIN_FONT, loc="left")
        axes[1].grid(alpha=0.3)
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=MIN_FONT,
               handlelength=3.0)
    fig.suptitle(title, fontsize=MIN_FONT + 1)
    return png(fig)
