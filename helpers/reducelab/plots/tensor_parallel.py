"""Figure of notebook 09: what every tensor-parallel rank holds, stage by stage, in one
forward pass of a two-layer MLP ``y = relu(x @ A) @ B`` for one token, and where the
ranks combine.

The forward pass reads from top to bottom. Each stage is one activation, drawn as one
line of cells per token, one cell per element, with its value written in the cell: at
every width the explorer offers, every value is written (a cell is at least
:data:`MIN_CELL` inches wide). How the ranks hold a stage decides how it is drawn:

* ``"same"``: every rank holds the same tensor; one line, labelled "every rank";
* ``"sharded"``: rank ``r`` holds its own columns; one line, the ranks' pieces side by
  side at their place in the whole tensor, each labelled "rank r" above it;
* ``"partial"``: every rank holds a full-shape partial sum, to be summed over the ranks
  (DTensor's ``Partial()``); one hatched line per rank, labelled "rank r";
* ``"each"``: every rank holds a different full-shape tensor (not a partial sum); one
  line per rank.

Between stages, an operator where the ranks may communicate (Megatron-LM's ``f`` and
``g``, an all_gather) is a grey band across the figure that says what it ran in forward
and in backward. One colour scale serves every cell (a colour bar at the bottom); the
values written in the cells say the same thing without colour.

Sources: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism" (arXiv:1909.08053), section 3 and figure 3 (column- then
row-parallel MLP, the conjugate operators f and g); ``torch.distributed.tensor.parallel``
(``ColwiseParallel``, ``RowwiseParallel``) for the placements.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from . import CMAP, DPI, MAX_WIDTH, MIN_FONT, NEUTRAL, TEXT_GREY, fmt_value, new_figure, png

KINDS = ("same", "sharded", "partial", "each")
"""How the ranks hold a :class:`Stage` (see the module docstring)."""
MAX_HEIGHT = 5.0
"""Tallest figure, inches: the explorer's controls and figure fit on one laptop screen."""
MAX_COLUMNS = 12
"""Widest activation, in elements, whose every value is written in its cell."""
LEFT = 3.2
"""Width of the label column, inches: a stage's name, then the rank a line belongs to."""
RIGHT = 0.1
"""Margin right of the cells, inches."""
MIN_CELL = (MAX_WIDTH - LEFT - RIGHT) / MAX_COLUMNS
"""Narrowest cell, inches (about 0.52): a value such as ``-48`` or ``-1.25`` at
:data:`MIN_FONT` points fits it."""
MAX_CELL = 0.6
"""Widest cell, inches, so that a narrow tensor is not stretched across the figure."""
ROW, STRIP, BAND, GAP = 0.25, 0.19, 0.25, 0.04
"""Heights, inches: one token's line of cells, the "rank r" labels above a sharded line,
an operator's band, and the space between two items."""
TITLE, SUBTITLE, FOOTER = 0.34, 0.24, 0.6
"""Heights, inches: the title, the line under it, and the note and colour bar at the
bottom."""
VALUE_GID = "cell value"
"""``gid`` of every text that writes a cell's value (so a test can find them all)."""
COLOUR_BAR_LABEL = "colour: each element's value, on one scale for every line"
"""What the colour bar at the bottom says."""
HATCH_EVERY, HATCH_WHITE = 10, 0.55
"""The hatch of a partial sum: a one-pixel diagonal line every ``HATCH_EVERY`` pixels,
the cell's colour mixed with this share of white (so the colour stays readable under it)."""


@dataclass
class Stage:
    """One activation of the forward pass, as the ranks hold it.

    Attributes:
        name: label drawn left of its first line, e.g. ``"h = relu(x @ A[:, mine])"``.
        values: one 2-D ``numpy`` array per rank, ``(tokens, columns)`` (float): the
            whole tensor for ``"same"``, ``"partial"`` and ``"each"``, this rank's
            columns for ``"sharded"`` (ranks in order, side by side, make the whole).
        kind: one of :data:`KINDS`.
    """

    name: str
    values: list
    kind: str = "same"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")

    @property
    def whole_columns(self) -> int:
        """Columns of the whole tensor (the ranks' columns added up when sharded)."""
        cols = [np.asarray(v).shape[1] for v in self.values]
        return sum(cols) if self.kind == "sharded" else cols[0]

    @property
    def tokens(self) -> int:
        return np.asarray(self.values[0]).shape[0]

    def lines(self) -> int:
        """Lines of cells it takes: one per rank for partial sums and different tensors."""
        return len(self.values) if self.kind in ("partial", "each") and len(self.values) > 1 else 1


@dataclass
class Operator:
    """Where ranks may communicate: a band across the figure.

    Attributes:
        name: the operator, e.g. ``"f"``, ``"g"``, ``"gather"``.
        forward: what it ran in forward, e.g. ``"all_reduce of 1×12"`` or ``"identity"``.
        backward: what it ran in backward.
    """

    name: str
    forward: str = "identity"
    backward: str = "identity"


@dataclass
class Diagram:
    """A forward pass: stages and operators in order, top to bottom."""

    title: str
    items: list = field(default_factory=list)
    subtitle: str = ""
    note: str = ""


def _height(diagram: Diagram) -> float:
    """Height of ``diagram``'s figure, inches."""
    h = TITLE + (SUBTITLE if diagram.subtitle else 0) + FOOTER
    for it in diagram.items:
        if isinstance(it, Operator):
            h += BAND
        else:
            h += it.lines() * it.tokens * ROW + (STRIP if it.kind == "sharded" else 0)
        h += GAP
    return h


def _paint(canvas: np.ndarray, x0: float, y0: float, cw: float, values: np.ndarray,
           lo: float, hi: float, partial: bool) -> None:
    """Paint one block of cells into ``canvas`` (RGBA ``uint8``, ``(rows_px, cols_px, 4)``):
    one cell per element, :data:`ROW` tall and ``cw`` wide, coloured by
    :data:`~reducelab.plots.CMAP` over ``lo`` to ``hi``, with a dark border; for partial
    sums a diagonal hatch of thin lines, each pixel of which is its cell's colour
    lightened towards white (:data:`HATCH_WHITE`), so the colours stay readable.
    Positions are inches from the canvas's top-left corner."""
    import matplotlib
    import matplotlib.colors as mcolors
    rows, cols = values.shape
    ys = np.round((y0 + np.arange(rows + 1) * ROW) * DPI).astype(int)
    xs = np.round((x0 + np.arange(cols + 1) * cw) * DPI).astype(int)
    colours = matplotlib.colormaps[CMAP]((values - lo) / (hi - lo), bytes=True)
    canvas[ys[0]:ys[-1], xs[0]:xs[-1]] = colours[np.repeat(np.arange(rows), np.diff(ys))][
        :, np.repeat(np.arange(cols), np.diff(xs))]
    top, bottom, left, right = ys[0], ys[-1], xs[0], xs[-1]
    if partial:
        yy, xx = np.mgrid[top:bottom, left:right]
        line = (xx + yy) % HATCH_EVERY == 0
        region = canvas[top:bottom, left:right]
        region[line] = np.round(region[line] * (1 - HATCH_WHITE) + 255 * HATCH_WHITE)
    border = np.array(mcolors.to_rgba(TEXT_GREY)) * 255
    for x in xs[1:-1]:                               # thin lines between cells
        canvas[top:bottom, x] = border
    canvas[top:bottom, [left, right - 1]] = border
    canvas[[top, bottom - 1], left:right] = border


def draw_diagram(diagram: Diagram) -> bytes:
    """Draw ``diagram`` and return PNG bytes.

    The figure is :data:`~reducelab.plots.MAX_WIDTH` wide; every cell of every stage has
    one width, at least :data:`MIN_CELL` inches, and shows its element's value
    (``fmt_value``: integers without a decimal point) in black or white, whichever
    reads on its colour. One colour scale, from the smallest to the largest value in the
    figure (viridis, :data:`~reducelab.plots.CMAP`), is shown by a colour bar with its
    two ends written. All cells are painted into one image under the texts, so a redraw
    costs one image and the texts.

    Raises:
        ValueError: ``diagram`` has no stage; the stages disagree on the number of
            ranks or tokens; a tensor is wider than :data:`MAX_COLUMNS` (its values
            would not fit); or the figure would be taller than :data:`MAX_HEIGHT`.
    """
    from matplotlib.patches import Rectangle
    stages = [it for it in diagram.items if isinstance(it, Stage)]
    if not stages:
        raise ValueError("a diagram needs at least one stage")
    ranks = {len(s.values) for s in stages}
    tokens = {s.tokens for s in stages}
    if len(ranks) != 1 or len(tokens) != 1:
        raise ValueError(f"every stage needs one array per rank, of one number of tokens; "
                         f"got {sorted(ranks)} ranks and {sorted(tokens)} tokens")
    widest = max(s.whole_columns for s in stages)
    if widest > MAX_COLUMNS:
        raise ValueError(f"a tensor of {widest} columns is wider than the {MAX_COLUMNS} "
                         f"whose values fit the figure")
    height = round(_height(diagram) * DPI) / DPI
    if height > MAX_HEIGHT + 1e-9:
        raise ValueError(f"the figure would be {height:.2f} in tall, more than {MAX_HEIGHT}")
    tp = ranks.pop()
    cw = min(MAX_CELL, MIN_CELL if widest == MAX_COLUMNS else (MAX_WIDTH - LEFT - RIGHT) / widest)
    every = np.concatenate([np.asarray(v, dtype=float).ravel() for s in stages for v in s.values])
    lo, hi = float(every.min()), float(every.max())   # one scale for every line
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    mid = (lo + hi) / 2

    fig, ax, cax = _figure(height)
    canvas = np.zeros((round(height * DPI), round(MAX_WIDTH * DPI), 4), dtype=np.uint8)
    ax.text(0.08, 0.08, diagram.title, ha="left", va="top", fontsize=11, color="black")
    y = TITLE
    if diagram.subtitle:
        ax.text(0.08, y, diagram.subtitle, ha="left", va="top", fontsize=MIN_FONT,
                color=TEXT_GREY)
        y += SUBTITLE

    def write_values(x0: float, y0: float, values: np.ndarray) -> None:
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                ax.text(x0 + (j + 0.5) * cw, y0 + (i + 0.5) * ROW, fmt_value(round(float(v), 2)),
                        ha="center", va="center", fontsize=MIN_FONT, gid=VALUE_GID,
                        color="black" if v > mid else "white")

    for it in diagram.items:
        if isinstance(it, Operator):
            ax.add_patch(Rectangle((0.04, y), MAX_WIDTH - 0.08, BAND, facecolor=NEUTRAL,
                                   edgecolor=TEXT_GREY, linewidth=0.6))
            ax.text(0.12, y + BAND / 2, it.name, ha="left", va="center", fontsize=11,
                    fontweight="bold", color="black")
            ax.text(LEFT, y + BAND / 2,
                    f"forward: {it.forward}   ·   backward: {it.backward}",
                    ha="left", va="center", fontsize=MIN_FONT, color="black")
            y += BAND + GAP
            continue
        stack = [np.asarray(v, dtype=float) for v in it.values]
        n_tok = it.tokens
        ax.text(0.08, y + (STRIP if it.kind == "sharded" else 0) + n_tok * ROW / 2, it.name,
                ha="left", va="center", fontsize=MIN_FONT, color="black")
        if it.kind == "sharded":
            x = LEFT
            for r, v in enumerate(stack):
                ax.text(x + v.shape[1] * cw / 2, y + STRIP / 2, f"rank {r}", ha="center",
                        va="center", fontsize=MIN_FONT, color=TEXT_GREY)
                _paint(canvas, x, y + STRIP, cw, v, lo, hi, partial=False)
                write_values(x, y + STRIP, v)
                x += v.shape[1] * cw
            y += STRIP + n_tok * ROW + GAP
            continue
        lines = stack if it.lines() > 1 else stack[:1]
        for r, v in enumerate(lines):
            who = "every rank" if len(lines) == 1 and tp > 1 else f"rank {r}"
            ax.text(LEFT - 0.08, y + n_tok * ROW / 2, who, ha="right", va="center",
                    fontsize=MIN_FONT, color=TEXT_GREY)
            _paint(canvas, LEFT, y, cw, v, lo, hi, partial=it.kind == "partial")
            write_values(LEFT, y, v)
            y += n_tok * ROW
        y += GAP
    fig.figimage(canvas, xo=0, yo=0, origin="upper", zorder=-1)   # under the texts
    if diagram.note:
        ax.text(0.08, height - 0.34, diagram.note, ha="left", va="bottom",
                fontsize=MIN_FONT, color=TEXT_GREY)
    _colour_bar(fig, ax, cax, height, lo, hi)
    return png(fig)


_FIGURES: collections.OrderedDict = collections.OrderedDict()
"""The last :data:`KEEP` figures, by height: ``(figure, axes, colour bar axes)``."""
KEEP = 4
"""Figures kept: the explorer's settings give a few heights (one per tp and split)."""


def _figure(height: float):
    """An empty figure of ``height`` inches, its full-size axes in inches from the top-left
    corner, and the colour bar's axes (placed by :func:`_colour_bar`). A diagram of a
    height drawn before gets that figure back, emptied of its texts, bands and cells:
    making the two axes was a fifth of a redraw of the explorer. Not
    :func:`reducelab.plots.kept_figure`: that one resets every axes' limits and removes
    its images, and this figure sets both once (the inch coordinates, the colour bar's
    gradient), then removes only what a draw adds (texts, bands, the cells' figimage)."""
    kept = _FIGURES.pop(height, None)
    if kept is not None:
        fig, ax, cax = kept
        for artist in [*ax.texts, *ax.patches, *fig.images]:
            artist.remove()
    else:
        fig = new_figure(MAX_WIDTH, height)
        fig.set_layout_engine("none")
        ax = fig.add_axes([0, 0, 1, 1])
        ax.set_axis_off()
        ax.patch.set_alpha(0)
        ax.set_xlim(0, MAX_WIDTH)
        ax.set_ylim(height, 0)                     # inches from the top-left corner
        cax = fig.add_axes([0, 0, 1, 1])
        cax.imshow(np.linspace(0, 1, 256)[None, :], cmap=CMAP, aspect="auto", vmin=0, vmax=1)
        cax.set_xticks([])
        cax.set_yticks([])
        cax.set_label("colour bar")
    _FIGURES[height] = (fig, ax, cax)
    while len(_FIGURES) > KEEP:
        _FIGURES.popitem(last=False)
    return fig, ax, cax


def _colour_bar(fig, ax, cax, height: float, lo: float, hi: float) -> None:
    """The last line of the figure: :data:`COLOUR_BAR_LABEL`, then a horizontal colour bar
    from ``lo`` to ``hi`` (:data:`~reducelab.plots.CMAP`) with both ends written."""
    label = ax.text(0.08, height - 0.06, COLOUR_BAR_LABEL + ":", ha="left", va="bottom",
                    fontsize=MIN_FONT, color=TEXT_GREY)
    label_end = label.get_window_extent(fig.canvas.get_renderer()).x1 / DPI
    left = label_end + 0.55                        # past the label and the low end's value
    width, bar_h, bottom = 2.4, 0.16, 0.08
    ax.text(left - 0.06, height - bottom - bar_h / 2, fmt_value(round(lo, 2)), ha="right",
            va="center", fontsize=MIN_FONT, color=TEXT_GREY)
    ax.text(left + width + 0.06, height - bottom - bar_h / 2, fmt_value(round(hi, 2)),
            ha="left", va="center", fontsize=MIN_FONT, color=TEXT_GREY)
    cax.set_position([left / MAX_WIDTH, bottom / height, width / MAX_WIDTH, bar_h / height])


__all__ = ["Stage", "Operator", "Diagram", "draw_diagram", "KINDS", "MAX_HEIGHT",
           "MAX_COLUMNS", "MIN_CELL", "COLOUR_BAR_LABEL", "VALUE_GID"]
