"""Figures of notebook 02: what each rank's buffer holds after ``dist.reduce``.

Each element of each rank's tensor after the reduce is one of three things: the rank's
input, unchanged; a partial sum (some ranks' contributions, not all); or the full sum.
:class:`RankHeatmaps` colours by value, which hides that distinction, hence this module.
The three statuses differ in colour *and* in hatching (none, ``//``, ``xx``), and the
legend names them, so no one needs to tell the colours apart.

Source: ``torch.distributed.reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce ; the learner
question "Why does `torch.distributed.reduce` affect tensors other than the
destination?" (2025-01-30).
"""
from __future__ import annotations

import functools

from typing import TYPE_CHECKING

import numpy as np

from . import (CMAP, DPI, MAX_WIDTH, MIN_FONT, NEUTRAL, PALETTE, PANEL_GREY, BuiltFigures,
               freeze_layout, new_figure, png)

if TYPE_CHECKING:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch

UNCHANGED, PARTIAL, FULL = 0, 1, 2
"""Status codes of one element after reduce (see :func:`reducelab.widgets.reduce.buffer_status`)."""
STATUS_NAMES = {UNCHANGED: "unchanged", PARTIAL: "partial sum", FULL: "full sum"}
STATUS_COLOURS = {UNCHANGED: NEUTRAL, PARTIAL: PALETTE["orange"], FULL: PALETTE["green"]}
STATUS_HATCHES = {UNCHANGED: "", PARTIAL: "//", FULL: "xx"}
"""The second cue beside colour: plain, diagonal lines, cross-hatch."""
HATCH_COLOUR = PALETTE["black"]
HATCH_WIDTH = 0.6
"""Line width of the hatching, points."""
LABEL_PAD = 0.2
"""Pad of :data:`LABEL_BOX` on each side of its value, em."""
LABEL_BOX = dict(boxstyle=f"round,pad={LABEL_PAD}", facecolor="white", linewidth=0)
"""The white box behind each value in the after panel: the hatching never runs through
the digits, which stay readable on a projector (as notebook 05's mesh figure does)."""


@functools.cache
def _status_colours() -> dict:
    """``imshow``'s ``cmap`` and ``norm`` for a status array: one colour per status, grey
    for NaN (made at the first figure, when matplotlib is imported)."""
    from matplotlib.colors import BoundaryNorm, ListedColormap
    cmap = ListedColormap([STATUS_COLOURS[k] for k in (UNCHANGED, PARTIAL, FULL)]
                          ).with_extremes(bad=PANEL_GREY)
    return {"cmap": cmap, "norm": BoundaryNorm([-0.5, 0.5, 1.5, 2.5], cmap.N)}

_DIGIT_PX = 0.6 * MIN_FONT * DPI / 72
"""Width of one digit at :data:`MIN_FONT` points, in pixels (a digit is about 0.6 em)."""
_BOXED_PX = (2 * LABEL_PAD + 0.4) * MIN_FONT * DPI / 72
"""What a value on a :data:`LABEL_BOX` needs beside its digits, in pixels: the box's
pad on both sides and a gap of 0.4 em to the next box, so that two boxed values side
by side never read as one number ("1010" for 10 and 10)."""


def cell_label(v: float) -> str:
    """Label of one element: whole numbers in full (11111111, not 1.11e+07), else 3 digits."""
    v = float(v)
    return str(int(v)) if v.is_integer() else f"{v:.3g}"


def _legend_handles() -> list[Patch]:
    from matplotlib.patches import Patch
    handles = []
    for k in (UNCHANGED, PARTIAL, FULL):
        # the hatch takes the edge's colour (matplotlib 3.10; 3.11 also has hatchcolor=)
        patch = Patch(facecolor=STATUS_COLOURS[k], hatch=STATUS_HATCHES[k],
                      edgecolor=HATCH_COLOUR, linewidth=0.5, label=STATUS_NAMES[k])
        patch.set_hatch_linewidth(HATCH_WIDTH)
        handles.append(patch)
    return handles


def _hatch_layers(ax) -> dict[int, PatchCollection]:
    """One transparent, hatched collection per status on ``ax``, filled by :func:`_set_hatches`."""
    from matplotlib.collections import PatchCollection
    layers = {}
    for k in (PARTIAL, FULL):
        # no edge is drawn (linewidth 0); the edge colour sets the hatch's (matplotlib 3.10)
        layer = PatchCollection([], facecolor="none", edgecolor=HATCH_COLOUR, linewidth=0,
                                hatch=STATUS_HATCHES[k], zorder=2)
        if hasattr(layer, "set_hatchcolor"):  # matplotlib 3.11
            layer.set_hatchcolor(HATCH_COLOUR)
        layer.set_hatch_linewidth(HATCH_WIDTH)
        ax.add_collection(layer, autolim=False)
        layers[k] = layer
    return layers


def _set_hatches(layers: dict[int, PatchCollection], status: np.ndarray) -> None:
    """Hatch the cells of each status: one path of all its cells' squares per layer.
    Agg rasterises a hatch once per path, so a path per cell cost up to 13 ms of a
    redraw of 128 cells. Where cells meet on whole pixels, as in the explorer's grid,
    the pixels are those of a path per cell; where they meet between pixels (the sweep
    figure's short rows), the shared edges are no longer anti-aliased twice: a change
    of a few pixels along them, not visible."""
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path
    from matplotlib.transforms import Affine2D
    for k, layer in layers.items():
        rows, cols = np.nonzero(status == k)
        squares = [Path.unit_rectangle().transformed(Affine2D().translate(j - 0.5, i - 0.5))
                   for i, j in zip(rows, cols)]
        layer.set_paths([PathPatch(Path.make_compound_path(*squares))] if squares else [])


def _value_norm(values: np.ndarray):
    """Colour scale of the input panel: logarithmic when positive values span 100x or
    more (``10**rank``), so every rank's row gets its own colour; else linear."""
    from matplotlib.colors import LogNorm, Normalize
    lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
    if lo > 0 and hi / lo >= 100:
        return LogNorm(lo, hi)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    return Normalize(lo, hi)


LAYOUT_N = 32
"""The most elements the explorer shows (its ``n`` slider's maximum): every figure of
full width is laid out with this many columns, then shows its own number."""


def _ticks(n: int) -> list[int]:
    """The labelled elements of a panel of ``n``: all up to 16, else every 4th and the last."""
    return list(range(n)) if n <= 16 else sorted({*range(0, n, 4), n - 1})


class ReduceGrid(BuiltFigures):
    """Two panels, one row per rank and one column per element: each rank's input
    ``x`` (coloured by value, with :data:`~reducelab.plots.CMAP`) and the same ``x``
    after ``dist.reduce`` (coloured and hatched by status: unchanged, partial sum, full
    sum). Values are written in the cells wherever they fit at
    :data:`~reducelab.plots.MIN_FONT` points (in the after panel on a white box,
    :data:`LABEL_BOX`, clear of the hatching); under the input panel a colour bar gives
    the values, under the other a legend names the statuses.

    The figure persists: it is built once per world size and figure width (every
    ``n`` of 6 or more has the full width), and a change of ``n`` within one of those
    only changes the panels' columns, so the slider of ``n`` costs a redraw and one PNG
    encode, not a new figure and layout. Used by
    :class:`reducelab.widgets.reduce.ReduceExplorer`.
    """

    def __init__(self):
        self.fig = None

    @staticmethod
    def width(n: int) -> float:
        """Figure width for ``n`` elements, inches."""
        return min(MAX_WIDTH, max(7.6, 3.6 + 1.1 * n))

    def _build(self, world_size: int, n: int) -> None:
        width = self.width(n)
        self.fig = new_figure(width, 2.2 + 0.28 * world_size)
        # row 0: the two panels; row 1: the colour bar under the input, the legend under
        # the statuses (in an axes of its own, so the layout keeps room for it)
        grid = self.fig.add_gridspec(2, 2, height_ratios=[0.28 * world_size + 0.3, 0.14])
        axes = [self.fig.add_subplot(grid[0, 0])]
        axes.append(self.fig.add_subplot(grid[0, 1], sharey=axes[0]))
        self._axes = axes
        self._input = axes[0].imshow(np.ones((world_size, n)), cmap=CMAP, aspect="auto")
        self._status = axes[1].imshow(np.zeros((world_size, n)), aspect="auto",
                                      **_status_colours())
        self._hatches = _hatch_layers(axes[1])
        # lay out for the most columns this width takes, so the layout is the same
        # whichever n came first (and the panels do not move while n is dragged)
        n_layout = LAYOUT_N if width == MAX_WIDTH else n
        for im in (self._input, self._status):
            im.set_extent((-0.5, n_layout - 0.5, world_size - 0.5, -0.5))
        for ax, title in zip(axes, ("x before reduce: the input", "x after reduce")):
            ax.set_xticks(_ticks(n_layout))
            ax.set_xlabel("element")
            ax.set_title(title)
        axes[1].tick_params(labelleft=False)
        self._texts = [[[] for _ in range(world_size)] for _ in axes]
        self._cbar = self.fig.colorbar(self._input, cax=self.fig.add_subplot(grid[1, 0]),
                                       orientation="horizontal")
        self._cbar.set_label("input value")
        key = self.fig.add_subplot(grid[1, 1])
        key.axis("off")
        key.legend(handles=_legend_handles(), loc="center", frameon=False,
                   ncols=3 if width >= 9.5 else 2, handlelength=1.6, columnspacing=1.0,
                   borderaxespad=0)
        # reserve room for the widest y labels and a title, then keep that layout
        axes[0].set_yticks(range(world_size), [f"rank {r} (dst)" for r in range(world_size)])
        self.fig.suptitle("dist.reduce")
        freeze_layout(self.fig)
        self._columns = None

    def _set_columns(self, n: int) -> None:
        """Give both panels ``n`` columns: the images' extent, the x ticks, and a value
        label per cell (made the first time ``n`` columns are needed, blank beyond ``n``)."""
        world_size = len(self._texts[0])
        ticks = _ticks(n)
        for ax, im, rows in zip(self._axes, (self._input, self._status), self._texts):
            im.set_extent((-0.5, n - 0.5, world_size - 0.5, -0.5))   # sets the x limits too
            ax.set_xticks(ticks)
            for i, row in enumerate(rows):
                row.extend(ax.text(j, i, "", ha="center", va="center", fontsize=MIN_FONT,
                                   zorder=3) for j in range(len(row), n))
                for t in row[n:]:
                    t.set_text("")
                    t.set_bbox(None)
        self._cell_px = self._axes[0].get_window_extent().width / n
        self._columns = n

    def preparation(self, world_size: int, n: int):
        """The callable that makes the figure of ``world_size`` ranks and ``n`` elements
        current (built, restored, or given ``n`` columns), or ``None`` if it is: an
        explorer runs it while the ranks compute
        (:meth:`reducelab.widgets.Explorer.preparation`)."""
        shape = (world_size, self.width(n))
        use = self._preparation(shape, lambda: self._build(world_size, n))
        if use is None and self._columns == n:
            return None

        def prepare():
            if use is not None:
                use()
            if self._columns != n:
                self._set_columns(n)
        return prepare

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
        build = self.preparation(world_size, n)
        if build is not None:
            build()
        norm = _value_norm(before)
        shown = self._input.norm
        if type(shown) is not type(norm) or (shown.vmin, shown.vmax) != (norm.vmin, norm.vmax):
            # a new scale redraws the colour bar (its mesh and ticks); the n slider
            # mostly keeps the scale, and then the colour bar as it is
            self._input.set_norm(norm)
        else:
            norm = shown
        self._input.set_data(before)
        self._status.set_data(status)
        _set_hatches(self._hatches, status)
        fits = (self._cell_px * 0.9 / _DIGIT_PX,                 # digits that fit a cell
                (self._cell_px - _BOXED_PX) / _DIGIT_PX)            # ... and a boxed value
        # dark text on the light end of viridis, light on the dark end (one call of the
        # norm for every cell: a call per cell was a fifth of a redraw)
        light = np.ma.filled(norm(before) > 0.5, False)
        for k, values in enumerate((before, after)):
            labels = [[cell_label(v) for v in row] for row in values]
            show = max(len(x) for row in labels for x in row) <= fits[k]
            for i in range(world_size):
                for j in range(n):
                    t = self._texts[k][i][j]
                    t.set_text(labels[i][j] if show else "")
                    if k == 0:
                        t.set_color(PALETTE["black"] if light[i, j] else PANEL_GREY)
                        t.set_bbox(None)
                    else:       # black on a white box, clear of the colour and the hatching
                        t.set_color(PALETTE["black"])
                        t.set_bbox(LABEL_BOX if labels[i][j] and show else None)
        self._axes[0].set_yticks(range(world_size),
                                 [f"rank {r}" + (" (dst)" if r == dst else "")
                                  for r in range(world_size)])
        self.fig.suptitle(title)
        return png(self.fig)


def sweep_figure(status_by_size: dict[int, np.ndarray], dst: int, title: str = "") -> bytes:
    """Static figure: one panel per rank; row = tensor size ``n``, column = element index;
    each cell coloured and hatched by status, as in :class:`ReduceGrid`.

    Args:
        status_by_size: ``{n: status}`` with ``status`` an int array of shape
            ``(world_size, n)`` (codes :data:`UNCHANGED`, :data:`PARTIAL`, :data:`FULL`),
            one entry per tensor size swept.
        dst: the destination rank of the sweep.
        title: optional figure title.

    Returns:
        PNG bytes. Cells past the end of a tensor are light grey and blank.

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
    fig = new_figure(min(MAX_WIDTH, 1.4 + 2.1 * world_size), min(4.5, 1.5 + 0.09 * len(sizes)))
    axes = fig.subplots(1, world_size, squeeze=False, sharey=True)[0]
    shown = [i for i, n in enumerate(sizes) if i == 0 or n % 4 == 0]
    for r, ax in enumerate(axes):
        grid = np.full((len(sizes), longest), np.nan)
        for i, n in enumerate(sizes):
            grid[i, :n] = np.asarray(status_by_size[n])[r]
        ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest",
                  **_status_colours())
        _set_hatches(_hatch_layers(ax), grid)
        ax.set_title(f"rank {r}" + (" (dst)" if r == dst else ""))
        ax.set_xlabel("element")
        ax.set_yticks(shown, [str(sizes[i]) for i in shown])
    axes[0].set_ylabel("tensor size (elements)")
    fig.legend(handles=_legend_handles(), loc="outside lower center", ncols=3, frameon=False)
    fig.suptitle(title)
    return png(fig)
