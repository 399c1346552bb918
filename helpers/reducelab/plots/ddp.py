"""Figures of notebook 04 (DDP gradients and loss reductions), drawn to PNG bytes.

* :class:`GradientScatter`: every element of the DDP gradient against the same element
  of the single-process full-batch gradient. A constant factor ``k`` puts every point
  on the line ``y = k x``; uneven local batches with ``reduction="mean"`` scatter them.
* :func:`loss_curves`: loss per optimizer step of several training runs, overlaid.
"""
from __future__ import annotations

import numpy as np

from . import new_figure, png

_COLOURS = ("#222222", "#1f77b4", "#d62728", "#17becf", "#2ca02c", "#ff7f0e")
_STYLES = ("-", "--", "-", ":", "-.", "--")


class GradientScatter:
    """Scatter of DDP gradient elements (y) against full-batch gradient elements (x).

    The figure is built once and updated on each :meth:`draw` (a widget redraw).
    """

    def __init__(self):
        self.fig = new_figure(5.2, 4.0)
        self.ax = self.fig.add_subplot()
        self.ax.axhline(0, color="#bbb", lw=0.6)
        self.ax.axvline(0, color="#bbb", lw=0.6)
        (self._same,) = self.ax.plot([], [], ls=":", color="#888", lw=1.2,
                                     label="y = x (same gradient)")
        (self._fit,) = self.ax.plot([], [], color="#d62728", lw=1.2)
        self._points = self.ax.scatter([], [], s=9, alpha=0.6, color="#1f77b4",
                                       label="one gradient element")
        self.ax.set_xlabel("single-process full-batch gradient")
        self.ax.set_ylabel("DDP gradient (rank 0)")

    def draw(self, ddp, full, factor: float, constant: bool, title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            ddp, full: array-likes of the same length (flattened gradients).
            factor: the least-squares factor ``k`` (drawn as ``y = k x``).
            constant: whether ``ddp == k * full`` holds (changes the line's label).
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
        self._fit.set_label(f"y = {factor:.4g} x" + ("" if constant else " (best fit; points miss it)"))
        self.ax.set_xlim(-lim, lim)
        self.ax.set_ylim(-lim, lim)
        self.ax.legend(loc="upper left", fontsize=8)
        self.ax.set_title(title, fontsize=10)
        data = png(self.fig)
        # Keep the first constrained layout: later draws change the data and the limits,
        # not the size of the labels, and skipping the layout pass halves a redraw.
        self.fig.set_layout_engine("none")
        return data


def loss_curves(curves: dict, title: str = "", ylabel: str = "loss on all 1797 digits",
                reference: str | None = None) -> bytes:
    """Overlay loss curves; return PNG bytes.

    Args:
        curves: ``{label: sequence of float}``, one loss per optimizer step, drawn in
            order (the first in black, later ones dashed/coloured so overlaps stay visible).
        title: figure title.
        ylabel: y-axis label.
        reference: optional label of one curve; a second panel then shows every other
            curve's ``|loss - reference loss|`` per step on a log scale (floored at 1e-9),
            which separates "equal up to rounding" from "close".

    Raises:
        ValueError: ``curves`` is empty, or ``reference`` is not one of its labels.
    """
    if not curves:
        raise ValueError("curves is empty: give at least one {label: losses}")
    if reference is not None and reference not in curves:
        raise ValueError(f"reference must be one of the labels {list(curves)}, got {reference!r}")
    fig = new_figure(10.5 if reference else 7.0, 3.8)
    axes = fig.subplots(1, 2 if reference else 1, squeeze=False)[0]
    ref = np.asarray(curves[reference], dtype=float) if reference else None
    for i, (label, ys) in enumerate(curves.items()):
        ys = np.asarray(ys, dtype=float)
        style = dict(ls=_STYLES[i % len(_STYLES)], color=_COLOURS[i % len(_COLOURS)],
                     lw=2.4 if i == 0 else 1.6)
        steps = np.arange(1, len(ys) + 1)
        axes[0].plot(steps, ys, label=label, **style)
        if reference and label != reference:
            n = min(len(ys), len(ref))
            axes[1].plot(steps[:n], np.maximum(np.abs(ys[:n] - ref[:n]), 1e-9), **style)
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize=8, loc="center right")
    axes[0].grid(alpha=0.3)
    if reference:
        axes[1].set_yscale("log")
        axes[1].set_xlabel("optimizer step")
        axes[1].set_ylabel(f"|loss - loss of '{reference}'|", fontsize=9)
        axes[1].grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    return png(fig)
