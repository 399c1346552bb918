"""Figure of notebook 09: what every tensor-parallel rank holds, stage by stage, in one
forward pass of a two-layer MLP ``y = relu(x @ A) @ B``, and where the ranks combine.

Each rank is a horizontal band; each stage of the forward pass is a heatmap of the
tensor that rank holds there, drawn at its true shape (one square per element), so a
shard is visibly narrower than the full tensor. One colour scale serves every block, shown
by a colour bar under the bands, and each cell shows its value where it fits. Partial
sums (values still to be summed over the ranks, DTensor's ``Partial()``) are hatched
with thin light lines that leave the cells' colours readable; the operators where
ranks communicate (Megatron-LM's ``f`` and ``g``, and an all_gather) are columns that
span every band, labelled with the collective they run in forward and in backward.

Sources: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism" (arXiv:1909.08053), section 3 and figure 3 (column- then
row-parallel MLP, the conjugate operators f and g); ``torch.distributed.tensor.parallel``
(``ColwiseParallel``, ``RowwiseParallel``) for the placements.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import matplotlib
import matplotlib.colors as mcolors
import numpy as np
from matplotlib.patches import Rectangle

from . import CMAP, DPI, MAX_WIDTH, MIN_FONT, NEUTRAL, TEXT_GREY, new_figure, png

MAX_HEIGHT = 4.5
"""Tallest figure, inches: the explorer's controls and figure fit on one screen."""


@dataclass
class Block:
    """One stage of the forward pass: what each rank holds there.

    Attributes:
        name: short label drawn above the column, e.g. ``"A[:, mine]"``.
        values: one 2-D ``numpy`` array per rank (float), all of one shape.
        partial: ``True`` when the values are partial sums (still to be summed over the
            ranks); they are hatched (say so in ``name`` too, e.g. ``"partial y"``).
        same: ``True`` when every rank holds the same values (the label says
            ``", same"`` after the shape; else ``" each"``).
    """

    name: str
    values: list
    partial: bool = False
    same: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(np.asarray(self.values[0]).shape)


@dataclass
class Operator:
    """Where ranks may communicate: a column across every rank's band.

    Attributes:
        name: the operator, e.g. ``"f"``, ``"g"``, ``"gather"``.
        forward: the collective it ran in forward, or ``""`` (nothing).
        backward: the collective it ran in backward, or ``""`` (nothing).
    """

    name: str
    forward: str = ""
    backward: str = ""


@dataclass
class Diagram:
    """A full forward pass: blocks and operators in order, left to right."""

    title: str
    items: list = field(default_factory=list)
    note: str = ""


MIN_SLOT = 0.8
"""Narrowest column a block gets, inches, so that its two-line label fits above it."""
OP_WIDTH = 0.42
"""Width of an operator's column, inches."""
GAP = 0.1
"""Space between two columns, inches."""
BAND_GAP = 0.14
"""Space between two ranks' bands, inches."""
MIN_BANDS = 1.5
"""Least total height of the ranks' bands, inches: an operator's rotated label fits."""
LEFT, RIGHT, TITLE, HEADER, NOTE = 0.72, 0.08, 0.34, 0.46, 0.6
"""Margins, inches: rank labels, right edge, title, block labels, and the two lines under
the bands (the note, then the colour bar)."""
COLOUR_BAR_LABEL = "colour: each element's value, on one scale for every block"
"""What the colour bar under the bands says."""
HATCH_EVERY, HATCH_WHITE = 10, 0.55
"""The hatch of a partial sum: a one-pixel diagonal line every ``HATCH_EVERY`` pixels,
the cell's colour mixed with this share of white (so the colour stays readable under it)."""
_BORDER = np.array(mcolors.to_rgba(TEXT_GREY)) * 255


def _cell_width(cols: list[int], fixed: float) -> float:
    """Width of one element, inches, so that the blocks (each at least
    :data:`MIN_SLOT` wide) and ``fixed`` inches of operators and gaps fill the figure."""
    avail = MAX_WIDTH - LEFT - RIGHT - fixed
    narrow: set[int] = set()
    for _ in range(len(cols) + 1):
        wide = [c for k, c in enumerate(cols) if k not in narrow]
        hs = (avail - MIN_SLOT * len(narrow)) / max(sum(wide), 1)
        more = {k for k, c in enumerate(cols) if c * hs < MIN_SLOT}
        if more <= narrow:
            return min(hs, 0.6)
        narrow |= more
    return min(hs, 0.6)


def _paint_block(canvas: np.ndarray, x0: float, y0: float, hs: float, vs: float,
                 values: np.ndarray, lo: float, hi: float, partial: bool) -> None:
    """Paint one rank's block into ``canvas`` (RGBA ``uint8``, ``(rows_px, cols_px, 4)``):
    one cell per element coloured by :data:`~reducelab.plots.CMAP` over ``lo`` to ``hi``,
    a dark border, and for partial sums a diagonal hatch of thin lines, each pixel of which
    is its cell's colour lightened towards white (:data:`HATCH_WHITE`), so the cells'
    colours stay readable. Positions are inches from the canvas's top-left corner."""
    rows, cols = values.shape
    ys = np.round((y0 + np.arange(rows + 1) * vs) * DPI).astype(int)
    xs = np.round((x0 + np.arange(cols + 1) * hs) * DPI).astype(int)
    colours = matplotlib.colormaps[CMAP]((values - lo) / (hi - lo), bytes=True)
    # each cell's colour, repeated over its pixels
    canvas[ys[0]:ys[-1], xs[0]:xs[-1]] = colours[np.repeat(np.arange(rows), np.diff(ys))][
        :, np.repeat(np.arange(cols), np.diff(xs))]
    top, bottom, left, right = ys[0], ys[-1], xs[0], xs[-1]
    if partial:
        yy, xx = np.mgrid[top:bottom, left:right]
        line = (xx + yy) % HATCH_EVERY == 0
        region = canvas[top:bottom, left:right]
        region[line] = np.round(region[line] * (1 - HATCH_WHITE) + 255 * HATCH_WHITE)
    canvas[top:bottom, [left, right - 1]] = _BORDER
    canvas[[top, bottom - 1], left:right] = _BORDER


def draw_diagram(diagram: Diagram) -> bytes:
    """Draw ``diagram`` and return PNG bytes.

    The figure is :data:`~reducelab.plots.MAX_WIDTH` wide and at most
    :data:`MAX_HEIGHT` tall. One element is one cell, of the same size in every block,
    so shards and full tensors compare by size; a cell is as wide as the width allows
    and never taller than wide unless the ranks' bands would be too short to read.
    Every block's colours use one scale, from the smallest to the largest value in the
    figure (viridis, :data:`~reducelab.plots.CMAP`), shown by a colour bar under the bands
    with its two ends written; each cell shows its value where it fits; the labels say
    what every block is, and hatching marks partial sums. All blocks are painted into one
    image, drawn under the labels and values, so a redraw costs one image and a few texts.

    Raises:
        ValueError: ``diagram`` has no block, or the blocks disagree on the number of
            ranks.
    """
    blocks = [it for it in diagram.items if isinstance(it, Block)]
    if not blocks:
        raise ValueError("a diagram needs at least one block")
    ranks = {len(b.values) for b in blocks}
    if len(ranks) != 1:
        raise ValueError(f"every block needs one array per rank; got {sorted(ranks)} ranks")
    tp = ranks.pop()
    band = max(b.shape[0] for b in blocks)
    n_ops = len(diagram.items) - len(blocks)
    hs = _cell_width([b.shape[1] for b in blocks],
                     n_ops * OP_WIDTH + (len(diagram.items) - 1) * GAP)
    room = MAX_HEIGHT - TITLE - HEADER - NOTE - (tp - 1) * BAND_GAP
    vs = min(hs, room / (tp * band))
    vs = max(vs, min(MIN_BANDS, room) / (tp * band))
    bands = tp * band * vs + (tp - 1) * BAND_GAP
    height = round((TITLE + HEADER + bands + NOTE) * DPI) / DPI
    fig = new_figure(MAX_WIDTH, height)
    fig.set_layout_engine("none")
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_axis_off()
    ax.patch.set_alpha(0)
    # the blocks are painted into one image of the bands' area, drawn pixel for pixel
    y0 = TITLE + HEADER
    canvas = np.zeros((round(bands * DPI) + 2, round(MAX_WIDTH * DPI), 4), dtype=np.uint8)
    ax.text(0.08, 0.06, diagram.title, ha="left", va="top", fontsize=11, color="black")

    def band_top(r: int) -> float:
        return y0 + r * (band * vs + BAND_GAP)

    for r in range(tp):
        ax.text(LEFT - 0.08, band_top(r) + band * vs / 2, f"rank {r}", ha="right",
                va="center", fontsize=MIN_FONT, color="black")
    fits_values = hs >= 0.28 and vs >= 0.2   # "-1.2" at 10 pt fits a cell
    every = np.concatenate([np.asarray(v, dtype=float).ravel() for b in blocks for v in b.values])
    lo, hi = float(every.min()), float(every.max())   # one scale for every block
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    mid = (lo + hi) / 2
    x = LEFT
    for it in diagram.items:
        if isinstance(it, Operator):
            ax.add_patch(Rectangle((x, y0 - 0.04), OP_WIDTH, bands + 0.08, facecolor=NEUTRAL,
                                   edgecolor=TEXT_GREY, linewidth=0.8))
            ax.text(x + OP_WIDTH / 2, y0 - 0.06, it.name, ha="center", va="bottom",
                    fontsize=11, fontweight="bold", color="black")
            ax.text(x + OP_WIDTH / 2, y0 + bands / 2,
                    f"fwd: {it.forward or 'identity'}\nbwd: {it.backward or 'identity'}",
                    ha="center", va="center", rotation=90, fontsize=MIN_FONT,
                    color="black", linespacing=1.15)
            x += OP_WIDTH + GAP
            continue
        rows, cols = it.shape
        w = max(cols * hs, MIN_SLOT)
        cx = x + w / 2
        stack = np.stack([np.asarray(v, dtype=float) for v in it.values])
        shape = f"{rows}×{cols}" + (", same" if it.same and tp > 1 else
                                    " each" if tp > 1 else "")
        ax.text(cx, y0 - 0.06, f"{it.name}\n{shape}", ha="center", va="bottom",
                fontsize=MIN_FONT, color="black", linespacing=1.1)
        bx = cx - cols * hs / 2
        for r in range(tp):
            by = band_top(r) + (band - rows) * vs / 2
            _paint_block(canvas, bx, by - y0, hs, vs, stack[r], lo, hi, it.partial)
            if fits_values:
                for i in range(rows):
                    for j in range(cols):
                        v = stack[r, i, j]
                        ax.text(bx + (j + 0.5) * hs, by + (i + 0.5) * vs, f"{v:.1f}",
                                ha="center", va="center", fontsize=MIN_FONT,
                                color="black" if v > mid else "white")
        x += w + GAP
    fig.figimage(canvas, xo=0, yo=round((height - y0) * DPI) - canvas.shape[0],
                 origin="upper", zorder=-1)        # under the axes: values stay on top
    ax.set_xlim(0, MAX_WIDTH)
    ax.set_ylim(height, 0)                         # inches from the top-left corner
    if diagram.note:
        ax.text(0.08, height - 0.34, diagram.note, ha="left", va="bottom",
                fontsize=MIN_FONT, color=TEXT_GREY)
    _colour_bar(fig, ax, height, lo, hi)
    return png(fig)


def _colour_bar(fig, ax, height: float, lo: float, hi: float) -> None:
    """The last line of the figure: :data:`COLOUR_BAR_LABEL`, then a horizontal colour bar
    from ``lo`` to ``hi`` (:data:`~reducelab.plots.CMAP`) with both ends written."""
    label = ax.text(0.08, height - 0.06, COLOUR_BAR_LABEL + ":", ha="left", va="bottom",
                    fontsize=MIN_FONT, color=TEXT_GREY)
    label_end = label.get_window_extent(fig.canvas.get_renderer()).x1 / DPI
    left = label_end + 0.55                        # past the label and the low end's value
    width, bar_h, bottom = 2.4, 0.16, 0.08
    ax.text(left - 0.06, height - bottom - bar_h / 2, f"{lo:.1f}", ha="right",
            va="center", fontsize=MIN_FONT, color=TEXT_GREY)
    ax.text(left + width + 0.06, height - bottom - bar_h / 2, f"{hi:.1f}", ha="left",
            va="center", fontsize=MIN_FONT, color=TEXT_GREY)
    cax = fig.add_axes([left / MAX_WIDTH, bottom / height, width / MAX_WIDTH, bar_h / height])
    cax.imshow(np.linspace(0, 1, 256)[None, :], cmap=CMAP, aspect="auto", vmin=0, vmax=1)
    cax.set_xticks([])
    cax.set_yticks([])
    cax.set_label("colour bar")


__all__ = ["Block", "Operator", "Diagram", "draw_diagram", "MAX_HEIGHT", "COLOUR_BAR_LABEL"]
