"""Figures of notebook 02: what each rank's buffer holds after ``dist.reduce``.

Each element of each rank's tensor is drawn in one of three colours: the rank's input,
unchanged; a partial sum (some ranks' contributions, not all); or the full result.
:class:`RankHeatmaps` colours by value, which hides that distinction, hence this module.

Source: ``torch.distributed.reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce ; the learner
question is seed 002 (``/work/shared/seeds/002_849a4f4688f08166.txt``).
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch

from . import DPI, new_figure, png

UNCHANGED, PARTIAL, FULL = 0, 1, 2
"""Status codes of one element after reduce (see :func:`reducelab.widgets.reduce.buffer_status`)."""
STATUS_NAMES = {UNCHANGED: "input, unchanged", PARTIAL: "partial sum", FULL: "full sum"}
STATUS_COLOURS = {UNCHANGED: "#d9d9d9", PARTIAL: "#f4a259", FULL: "#3c9d5d"}
_INPUT = 3  # code of the "before" panel's cells
_CMAP = ListedColormap([STATUS_COLOURS[UNCHANGED], STATUS_COLOURS[PARTIAL],
                        STATUS_COLOURS[FULL], "#bcd4e6"]).with_extremes(bad="white")
_NORM = BoundaryNorm([-0.5, 0.5, 1.5, 2.5, 3.5], _CMAP.N)

MAX_LABELS = 16
"""Values are written in the cells up to this many elements per rank."""


def cell_label(v: float) -> str:
    """Label of one element: whole numbers in full (11111111, not 1.11e+07), else 3 digits."""
    v = float(v)
    return str(int(v)) if v.is_integer() else f"{v:.3g}"


def _font_size(longest: int, cell_px: float) -> float | None:
    # the largest font whose `longest` characters fit in a cell (a digit is ~0.6 em wide)
    for size in (8, 7, 6, 5):
        if longest * 0.6 * size * DPI / 72 <= 0.9 * cell_px:
            return size
    return None


def _legend(fig) -> None:
    handles = [Patch(facecolor=STATUS_COLOURS[k], edgecolor="#888", label=v)
               for k, v in STATUS_NAMES.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=9, frameon=False)


class ReduceGrid:
    """Two panels, input and buffer after reduce, one row per rank and one column per element.

    The "after" panel is coloured by status (unchanged / partial sum / full sum) and,
    up to :data:`MAX_LABELS` elements, each cell shows its value. The figure persists
    and is rebuilt only when ``world_size`` or the number of elements changes, so a
    widget redraw costs one PNG encode. Used by :class:`reducelab.widgets.reduce.ReduceExplorer`.
    """

    def __init__(self):
        self.fig = None
        self._shape = None

    def _build(self, world_size: int, n: int) -> None:
        width = min(3.0 + 2 * max(n, 3) * 0.62, 14.0)
        height = 1.5 + 0.42 * world_size
        self.fig = new_figure(width, height)
        axes = self.fig.subplots(1, 2, squeeze=False, width_ratios=[1, 1])[0]
        self._axes, self._images, self._texts = axes, [], []
        for ax in axes:
            im = ax.imshow(np.zeros((world_size, n)), cmap=_CMAP, norm=_NORM, aspect="auto")
            ax.set_xticks(range(n) if n <= MAX_LABELS else range(0, n, 4))
            ax.set_xlabel("element")
            self._images.append(im)
            texts = []
            if n <= MAX_LABELS:
                texts = [[ax.text(j, i, "", ha="center", va="center", fontsize=8)
                          for j in range(n)] for i in range(world_size)]
            self._texts.append(texts)
        _legend(self.fig)
        self._shape = (world_size, n)
        self._frozen = False

    def draw(self, before, after, status, dst: int, title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            before, after: array-likes of shape ``(world_size, n)``: each rank's input and
                its tensor after ``reduce``.
            status: int array of shape ``(world_size, n)`` with codes
                :data:`UNCHANGED`, :data:`PARTIAL`, :data:`FULL`.
            dst: the destination rank, marked on the y axis.
            title: optional figure title.

        Raises:
            ValueError: the three arrays do not have the same 2-D shape, or ``dst`` is not
                a rank.
        """
        before, after = np.asarray(before, float), np.asarray(after, float)
        status = np.asarray(status)
        if before.ndim != 2 or before.shape != after.shape or status.shape != before.shape:
            raise ValueError(f"before, after and status must have one shape (world_size, n); "
                             f"got {before.shape}, {after.shape}, {status.shape}")
        world_size, n = before.shape
        if not 0 <= dst < world_size:
            raise ValueError(f"dst must be a rank from 0 to {world_size - 1}, got {dst}")
        if self._shape != (world_size, n):
            self._build(world_size, n)
        longest = max(len(cell_label(v)) for v in np.concatenate([before.ravel(), after.ravel()]))
        panel_px = (self.fig.get_figwidth() - 2.4) / 2 * DPI
        size = _font_size(longest, panel_px / n)
        labels = [f"rank {r}" + (" (dst)" if r == dst else "") for r in range(world_size)]
        panels = [(before, np.full(before.shape, _INPUT), "input (before reduce)"),
                  (after, status, "buffer after reduce")]
        for k, (values, codes, name) in enumerate(panels):
            self._images[k].set_data(codes)
            for i, row in enumerate(self._texts[k]):
                for j, t in enumerate(row):
                    t.set_text(cell_label(values[i, j]) if size else "")
                    t.set_fontsize(size or 5)
                    t.set_color("white" if codes[i, j] == FULL else "black")
            self._axes[k].set_title(name, fontsize=10)
            self._axes[k].set_yticks(range(world_size), labels)
        self.fig.suptitle(title, fontsize=11)
        data = png(self.fig)
        if not self._frozen:
            # Keep the first constrained layout: later draws change values and which row is
            # dst, not the labels' widths, and skipping the layout pass saves ~20% per draw.
            self.fig.set_layout_engine("none")
            self._frozen = True
        return data


def sweep_figure(status_by_size: dict[int, np.ndarray], dst: int, title: str = "") -> bytes:
    """Static figure: one panel per rank; row = tensor size ``n``, column = element index.

    Args:
        status_by_size: ``{n: status}`` with ``status`` an int array of shape
            ``(world_size, n)`` (codes :data:`UNCHANGED`, :data:`PARTIAL`, :data:`FULL`),
            one entry per tensor size swept.
        dst: the destination rank of the sweep.
        title: optional figure title.

    Returns:
        PNG bytes. Cells past the end of a tensor are white.

    Raises:
        ValueError: ``status_by_size`` is empty or its arrays have different numbers of ranks.
    """
    if not status_by_size:
        raise ValueError("status_by_size is empty; sweep at least one tensor size")
    sizes = sorted(status_by_size)
    ranks = {np.asarray(s).shape[0] for s in status_by_size.values()}
    if len(ranks) != 1:
        raise ValueError(f"every status array needs the same world_size; got {sorted(ranks)}")
    world_size, longest = ranks.pop(), max(sizes)
    fig = new_figure(min(1.2 + 2.6 * world_size, 14.0), 1.6 + 0.13 * len(sizes))
    axes = fig.subplots(1, world_size, squeeze=False, sharey=True)[0]
    for r, ax in enumerate(axes):
        grid = np.full((len(sizes), longest), np.nan)
        for i, n in enumerate(sizes):
            grid[i, :n] = np.asarray(status_by_size[n])[r]
        ax.imshow(np.ma.masked_invalid(grid), cmap=_CMAP, norm=_NORM, aspect="auto",
                  interpolation="nearest")
        ax.set_title(f"rank {r}" + (" (dst)" if r == dst else ""), fontsize=10)
        ax.set_xlabel("element")
        step = max(1, len(sizes) // 8)
        ax.set_yticks(range(0, len(sizes), step), [str(sizes[i]) for i in range(0, len(sizes), step)])
    axes[0].set_ylabel("tensor size (elements)")
    _legend(fig)
    fig.suptitle(title, fontsize=11)
    return png(fig)
