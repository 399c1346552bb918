"""Plots of per-rank tensors, drawn to PNG bytes with matplotlib's Agg canvas.

Shared by every notebook. Notebooks whose figures need more than :class:`RankHeatmaps`
have a module here named for their topic (``plots/reduce.py`` for notebook 02, ...);
notebook 01 uses :class:`RankHeatmaps` itself.

Figures are made with ``matplotlib.figure.Figure`` directly, not ``pyplot``, so nothing
is displayed behind the learner's back and a widget can keep one figure and only update
it. A widget shows the bytes in an ``ipywidgets.Image``; a plain cell shows them with
:func:`show`.

Every figure follows three rules, checked by ``tests/test_figures.py``:

* **One palette.** Colours come from :data:`PALETTE` (Okabe and Ito's "Color Universal
  Design" set, defined in :mod:`reducelab.palette`) or :data:`NEUTRAL`; every pair stays distinct (CAM02-UCS ΔE of 10 or
  more) under simulated deuteranopia, protanopia and tritanopia. Sequential data use
  :data:`CMAP` (viridis, which keeps its order under those simulations).
* **Never colour alone.** What a colour says is also written: direct labels, values in
  the cells, hatching or markers.
* **Legible on a projector and on GitHub.** Drawn at :data:`DPI` and at most
  :data:`MAX_WIDTH` inches wide, so a PNG is shown pixel for pixel within a notebook's
  width; text is at least :data:`MIN_FONT` points.
"""
from __future__ import annotations

import collections
import functools
import importlib
import io
from typing import TYPE_CHECKING

import numpy as np
from cycler import cycler

from ..palette import NEUTRAL, PALETTE, PANEL_GREY, TEXT_GREY  # noqa: F401

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
"""Resolution of every figure, dots per inch: one figure pixel per screen pixel at 100 %."""
MAX_WIDTH = 9.6
"""Widest figure, inches (960 px): the width of a JupyterLab notebook on a 1280 px screen."""
MIN_FONT = 10
"""Smallest text in any figure, points."""

RANK_COLOURS = [PALETTE[k] for k in ("blue", "orange", "green", "vermillion", "sky",
                                     "purple", "yellow", "black")]
"""Colour of rank ``r`` is ``RANK_COLOURS[r % 8]``; ranks are always labelled too."""
CMAP = "viridis"
"""Colour map of heatmaps whose cells also show their values."""
HATCHES = ["", "//", "..", "xx", "\\\\", "oo", "--", "++"]
"""Hatch of category ``k`` is ``HATCHES[k % 8]``: a second cue beside colour."""
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
"""Marker of series ``k`` is ``MARKERS[k % 8]``: a second cue beside colour."""

STYLE = {
    "font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "xtick.labelsize": 10,
    "ytick.labelsize": 10, "legend.fontsize": 10, "figure.titlesize": 12,
    "axes.prop_cycle": cycler(color=RANK_COLOURS), "image.cmap": CMAP,
    "figure.dpi": DPI, "savefig.dpi": DPI,
}
"""matplotlib settings of every Reduce Lab figure, applied to ``matplotlib.rcParams`` when
the first figure is made (:mod:`reducelab.plots.agg`); a learner's own plots after it then
follow the same palette and sizes."""


def new_figure(width: float, height: float, layout_key=None, layout: bool = True) -> Figure:
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches with an Agg canvas attached.

    ``width`` is capped at :data:`MAX_WIDTH`, so the PNG fits a notebook's width.

    ``layout``: False for a figure without a layout engine, whose axes keep the positions
    the caller gives them (``subplots_adjust``, fixed margins); ``layout_key`` is then
    ignored.

    ``layout_key`` (any hashable): for a figure an explorer draws anew on every change.
    The first figure with a key is laid out by matplotlib's constrained layout when
    :func:`png` draws it; a later figure with the same key, size and axes, whose tick
    labels are as long and whose titles have as many lines (what sets the margins),
    gets the positions it found and skips the layout engine (about 40 % of such a
    redraw). Anything else that changes the layout (a legend's rows) belongs in the key."""
    from matplotlib.figure import Figure

    from .agg import Canvas
    fig = Figure(figsize=(min(width, MAX_WIDTH), height), dpi=DPI,
                 layout="constrained" if layout else None)
    Canvas(fig)
    fig._reducelab_layout_key = layout_key if layout else None
    return fig


_KEPT: collections.OrderedDict = collections.OrderedDict()
"""The figures :func:`kept_figure` keeps, by key: ``(figure, axes)``."""
KEEP_FIGURES = 8
"""At most this many kept figures (about 2 MB each), the least recently used dropped."""


def kept_figure(key, width: float, height: float, make_axes, layout: bool = True) -> tuple:
    """A figure for a plot an explorer draws anew on every change, kept between draws:
    ``(figure, axes)``, where ``make_axes(figure)`` made the tuple ``axes`` the first time.

    ``layout``: with True, the figure is laid out by constrained layout, ``key`` passed on
    as its ``layout_key`` (see :func:`new_figure`); with False it has no layout engine and
    keeps the positions ``make_axes`` gave its axes (fixed margins).

    A later call with the same ``key`` (any hashable) gets the same figure back with every axes
    emptied of its data: lines, patches, texts, collections, images, containers and
    legend removed; data and view limits, linear scales, margins, the colour cycle and
    autoscaling as a new axes has them. What stays is the axes, their ticks and their
    other settings (titles, labels, tick labels, grid), so the draw sets each of those it
    uses. A new figure's axes make all their tick
    objects again on the first draw: 40 to 50 ms of a redraw of 16's explorer with one
    tick per parameter."""
    kept = _KEPT.pop(key, None)
    if kept is None:
        fig = new_figure(width, height, layout_key=key, layout=layout)
        kept = (fig, tuple(make_axes(fig)))
    else:
        for ax in kept[1]:
            _empty(ax)
    _KEPT[key] = kept
    while len(_KEPT) > KEEP_FIGURES:
        _KEPT.popitem(last=False)
    return kept


def _empty(ax) -> None:
    """Remove what a draw added to ``ax`` (see :func:`kept_figure`)."""
    import matplotlib
    for container in list(ax.containers):
        container.remove()
    for artist in [*ax.lines, *ax.patches, *ax.texts, *ax.collections, *ax.images,
                   *ax.tables, *ax.artists]:
        artist.remove()
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    ax.relim()
    ax.set_prop_cycle(None)                  # colours start again from rcParams' cycle
    ax.set_xscale("linear")                  # a log scale at plot time changes data limits
    ax.set_yscale("linear")
    ax.set_xmargin(matplotlib.rcParams["axes.xmargin"])
    ax.set_ymargin(matplotlib.rcParams["axes.ymargin"])
    ax.set_xlim(0, 1, auto=True)             # last, as Axes.clear does: an axes left
    ax.set_ylim(0, 1, auto=True)             # empty shows 0 to 1, not an autoscale


_LAYOUTS: dict = {}
"""Positions found by constrained layout, by ``(layout_key, size, margins)``: each
subfigure's box, each suptitle's place and each axes' position."""


def _subfigures(fig) -> list:
    """``fig`` and its subfigures, depth first."""
    out = [fig]
    for sub in getattr(fig, "subfigs", []):
        out.extend(_subfigures(sub))
    return out


def _layout_of(fig: Figure, subs: list) -> tuple:
    """Each subfigure's box in ``subs`` (:func:`_subfigures`), each suptitle's place and
    each axes' position, as :func:`_reuse_layout` applies them."""
    return ([sub.bbox_relative.frozen() for sub in subs[1:]],
            [sub._suptitle.get_position() if sub._suptitle is not None else None for sub in subs],
            [ax.get_position(original=False).frozen() for ax in fig.axes])


def _ticks(ticker) -> tuple:
    """The places (as the locator returns them, an array or a list) and labels (a tuple
    of str) of ``ticker``'s ticks (``axis.major`` or ``axis.minor``) as its locator and
    formatter give them now, at the axes' present size and view limits."""
    locs = ticker.locator()
    if not len(locs):
        return (), ()
    return locs, tuple(ticker.formatter.format_ticks(locs))


def _margins(fig: Figure, subs: list) -> tuple:
    """What sets constrained layout's margins, per axes: the longest tick label on each
    axis, the lines of each title, and whether the axis labels are set; per (sub)figure
    in ``subs`` (:func:`_subfigures`), the lines of its suptitle."""
    sig = []
    for ax in fig.axes:
        row = []
        for axis in (ax.xaxis, ax.yaxis):
            labels = [*_ticks(axis.major)[1], *_ticks(axis.minor)[1]]
            row.append(max((len(x) for x in labels), default=0))
            row.append(bool(axis.label.get_text()))
        row.extend(ax.get_title(loc).count("\n") + bool(ax.get_title(loc))
                   for loc in ("left", "center", "right"))
        sig.append(tuple(row))
    for sub in subs:
        title = sub._suptitle
        text = title.get_text() if title is not None else None
        sig.append(None if text is None else text.count("\n") + bool(text))
    return tuple(sig)


def _layout_key(fig: Figure, subs: list, key=None):
    """The :data:`_LAYOUTS` key of ``fig`` (its subfigures ``subs``, :func:`_subfigures`):
    ``key``, or the figure's own, with its size and :func:`_margins`; None without a key."""
    key = getattr(fig, "_reducelab_layout_key", None) if key is None else key
    if key is None:
        return None
    return (key, tuple(fig.get_size_inches()), _margins(fig, subs))


def _reuse_layout(fig: Figure, subs: list, key) -> bool:
    """Apply the cached layout of ``key`` to ``fig`` (its subfigures ``subs``) if there is
    one; True if it did."""
    if key is None:
        return False
    cached = _LAYOUTS.get(key)
    if cached is None:
        return False
    boxes, titles, positions = cached
    if len(boxes) != len(subs) - 1 or len(positions) != len(fig.axes) or \
            [t is None for t in titles] != [sub._suptitle is None for sub in subs]:
        return False
    fig.set_layout_engine("none")
    for sub, box in zip(subs[1:], boxes):
        sub._redo_transform_rel_fig(bbox=box)
    for sub, place in zip(subs, titles):
        if place is not None:
            sub._suptitle.set_position(place)
    for ax, pos in zip(fig.axes, positions):
        ax.set_position(pos)
        # set_position takes the axes out of constrained layout; a later draw of this
        # figure with other margins (a new key) must lay it out again, not keep this place
        ax.set_in_layout(True)
    return True


def _titles_stay(ax) -> bool:
    """True when matplotlib's automatic title placement would leave ``ax``'s titles where
    they are (at the top of the axes, plus ``axes.titlepad``). It looks at ``ax``, its
    twins and its child axes (a ``secondary_yaxis``), as matplotlib does: none may have
    x tick labels or an x label on top, a y-axis offset text (``1e7``) that could meet a
    title, or a top above ``ax``'s; titles aligned across axes and colour bars are left
    to matplotlib. Checked on every draw, for what the draw will show."""
    twins = getattr(ax, "_twinned_axes", None)
    aligned = getattr(ax.get_figure(root=False), "_align_label_groups", {}).get("title")
    if twins is None or aligned is None or len(aligned.get_siblings(ax)) > 1:
        return False
    others = [*ax.child_axes, *(twin for twin in twins.get_siblings(ax) if twin is not ax)]
    if ax.child_axes:          # where the child axes will be, as matplotlib places them
        renderer = ax.get_figure(root=True).canvas.get_renderer()
        for child in ax.child_axes:
            locator = child.get_axes_locator()
            child.apply_aspect(locator(ax, renderer) if locator else None)
    top = ax.bbox.ymax
    return _pushes_no_title(ax) and all(
        _pushes_no_title(other) and other.bbox.ymax <= top + 1 for other in others)


def _pushes_no_title(ax) -> bool:
    """Whether ``ax``'s own x axis and y offset text leave a title above it in place (see
    :func:`_titles_stay`)."""
    if "outline" in ax.spines:
        return False
    xaxis = ax.xaxis
    position = xaxis.get_ticks_position()
    if position == "unknown" and xaxis.get_label_position() != "top" and not any(
            kw.get("label2On") for kw in (xaxis._major_tick_kw, xaxis._minor_tick_kw)) and not any(
            tick.label2.get_visible() for tick in (*xaxis.majorTicks, *xaxis.minorTicks)):
        # ticks at the bottom, labels hidden (the upper axes of ``sharex``): matplotlib
        # measures this x axis, but what it finds lies below the axes' top
        position = "bottom"
    if position in ("top", "unknown") or xaxis.get_label_position() == "top":
        # matplotlib measures this x axis; it has a box only with ticks or a label
        if xaxis.get_visible() and (len(xaxis.get_majorticklocs()) or
                                    len(xaxis.get_minorticklocs()) or xaxis.label.get_text()):
            return False
    formatter = ax.yaxis.get_major_formatter()
    if hasattr(formatter, "get_offset"):
        formatter.set_locs(ax.yaxis.get_majorticklocs())
        if formatter.get_offset():
            return False
    return True


def _place_titles(fig: Figure) -> None:
    """Skip matplotlib's automatic title placement where it would not move a title.

    On every draw, an axes with a title measures its whole y axis (every tick label's
    box) to see whether the title must move up: 5 to 15 ms of a redraw per titled axes
    on 2 cores. Where :func:`_titles_stay` holds, the titles are put at the top of the
    axes and the measurement is skipped (matplotlib's ``_autotitlepos``, as
    ``set_title(y=1.0)`` does); where it stops holding on a later draw of the same
    figure, the automatic placement is restored. The pixels are the same either way
    (``test_explorer_base``)."""
    for ax in fig.axes:
        auto = getattr(ax, "_autotitlepos", False)      # None or True: matplotlib places
        fixed = auto is False and getattr(ax, "_reducelab_titles_fixed", False)
        if auto is False and not fixed:
            continue                        # placed by hand, or not a matplotlib we know
        titles = [getattr(ax, name, None) for name in ("title", "_left_title", "_right_title")]
        if None in titles or not any(t.get_text() for t in titles):
            continue
        stay = _titles_stay(ax)
        if stay and not fixed:              # (ax.clear() puts matplotlib back in charge)
            for title in titles:
                title.set_y(1.0)
            ax._autotitlepos = False
            ax._reducelab_titles_fixed = True
        elif fixed and not stay:
            ax._autotitlepos = True
            ax._reducelab_titles_fixed = False


# --- Drawing only what changes ---------------------------------------------------------
#
# An explorer redraws the same axes for every control move: the same ticks, tick labels
# and axis labels, around new data. Those are 40 to 50 % of an Agg draw (notebook 08's
# figure: 85 ms, 49 ms with its axes' ticks, labels and spines hidden). So a figure is
# drawn in two layers. The static layer (the figure's background, each axes' background,
# and each axis's ticks, tick labels, label and offset text, without grid lines) is drawn
# first and kept as pixels; every other artist (the data, texts, legends, titles, spines,
# grid lines) is then drawn over it by matplotlib's own ``Figure.draw``, in its usual
# order. A later draw whose static layer would come out the same (:func:`_static_key`)
# restores those pixels instead of drawing it.
#
# Drawing the static layer first is matplotlib's order only where nothing drawn below an
# axis (by zorder) can reach the axis's pixels; :func:`_static_axes` keeps an axes in the
# static layer only then, and draws every other axes the usual way. ``tests/conftest.py``
# compares every figure the tests draw with matplotlib's own draw, pixel for pixel.

CHECK_LAYERS: list = []
"""Callables ``check(fig, pixels)`` run after every layered draw with the RGBA buffer it
made (a copy, a numpy array of shape (height, width, 4)); the tests register one that
draws the figure matplotlib's own way and compares. Empty in normal use."""


def _static_axes(fig: Figure, subs: list) -> list:
    """The axes of ``fig`` whose background and axes can be drawn in the static layer, or
    ``[]`` for a figure drawn the usual way. An axes qualifies when it is a plain
    rectilinear ``Axes`` with its axes and frame on, not animated and not rasterized,
    whose titles, if any, are not placed by matplotlib at draw time (:func:`_place_titles`);
    its x and y axes draw their ticks outward (so tick marks and labels lie outside the
    axes' box); and every artist it draws below its axes (by zorder) is clipped to the
    box, or is a secondary axis (``secondary_yaxis``: a sliver at the axes' edge, with
    its ticks and labels outside the other side). The figure qualifies when its layout
    is fixed (no layout engine runs at draw time), no two axes and no two sibling
    subfigures overlap, its axes are all in subfigures or none is, and no figure-level
    artist is drawn below an axes. ``subs`` is ``fig`` and its subfigures
    (:func:`_subfigures`), walked once per draw by :func:`_draw_layers`."""
    from matplotlib.axes import Axes
    from matplotlib.axes._secondary_axes import SecondaryAxis
    from matplotlib.axis import XAxis, YAxis
    from matplotlib.figure import SubFigure
    from matplotlib.layout_engine import PlaceHolderLayoutEngine
    engine = fig.get_layout_engine()
    if not fig.axes or (engine is not None and not isinstance(engine, PlaceHolderLayoutEngine)):
        return []
    if len(subs) > 1 and fig._localaxes:
        return []                               # axes beside subfigures: drawn the usual way
    top = max(ax.zorder for ax in fig.axes)
    for sub in subs:
        for artist in (*sub.lines, *sub.patches, *sub.texts, *sub.images, *sub.legends,
                       *sub.artists, *sub.subfigs):
            if artist.zorder < top and not isinstance(artist, SubFigure):
                return []
        if _overlapping([child.bbox for child in sub.subfigs]):
            return []
    if _overlapping([ax.bbox for ax in fig.axes]):
        return []
    static = []
    for ax in fig.axes:
        if type(ax) is not Axes or not (ax.axison and ax._frameon and ax.get_visible()) \
                or ax.get_animated() or ax._rasterization_zorder is not None:
            continue
        if getattr(ax, "_autotitlepos", True) is not False and any(
                getattr(ax, name).get_text() for name in ("title", "_left_title", "_right_title")):
            continue    # matplotlib places its titles by measuring the axes as they are drawn
        axes = (ax.xaxis, ax.yaxis)
        if type(axes[0]) is not XAxis or type(axes[1]) is not YAxis or any(
                _tick_direction(axis) != "out" or axis.get_animated() for axis in axes):
            continue
        below = min(axis.zorder for axis in axes)
        clipped = all(
            child.zorder >= below or not child.get_visible() or isinstance(child, SecondaryAxis)
            or (child.get_clip_on() and child.get_clip_box() is not None)
            for child in ax.get_children()
            if child is not ax.patch and child not in axes and child not in ax.spines.values())
        if clipped:
            static.append(ax)
    return static


def _overlaps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each box in ``a`` (shape ``(m, 4)``: x0, y0, x1, y1 in display pixels), whether
    it overlaps one of ``b`` (shape ``(n, 4)``): a bool array of shape ``(m,)``."""
    a, b = np.asarray(a, dtype=float).reshape(-1, 4), np.asarray(b, dtype=float).reshape(-1, 4)
    return ((a[:, None, 0] < b[None, :, 2]) & (b[None, :, 0] < a[:, None, 2])
            & (a[:, None, 1] < b[None, :, 3]) & (b[None, :, 1] < a[:, None, 3])).any(axis=1)


def _overlapping(boxes: list) -> bool:
    """Whether any two of ``boxes`` (``Bbox``) overlap."""
    extents = np.array([b.extents for b in boxes], dtype=float).reshape(-1, 4)
    return any(_overlaps(extents[i], extents[i + 1:])[0] for i in range(len(extents) - 1))


def _tick_direction(axis) -> str:
    """Where ``axis``'s major and minor ticks point: "out", "in", "inout", or "mixed"."""
    import matplotlib
    rc = matplotlib.rcParams[f"{axis.axis_name}tick.direction"]
    directions = {axis._major_tick_kw.get("tickdir", rc), axis._minor_tick_kw.get("tickdir", rc)}
    return directions.pop() if len(directions) == 1 else "mixed"


def _text_style(text) -> tuple:
    """How ``text`` is drawn, apart from what it says and where: visibility, colour, size,
    rotation and font (only visibility for a hidden text, such as most ticks' second
    label: hashing the font is the costliest part of the static layer's key)."""
    if not text.get_visible():
        return (False,)
    return (True, text.get_color(), text.get_fontsize(), text.get_rotation(),
            hash(text.get_fontproperties()))


def _axis_key(axis) -> tuple:
    """What ``axis``'s ticks, tick labels, label and offset text look like, for
    :func:`_static_key`: its view interval (where it has a tick) and scale, each tick's
    place, label and visibility, its tick settings (``tick_params``), label and offset
    text."""
    if not axis.get_visible():
        return (False,)
    # the label's place is the draw's own work unless set by hand (``set_label_coords``)
    label = (_text_style(axis.label), axis.label.get_text(),
             () if axis._autolabelpos else axis.label.get_position())
    row = [None, axis.get_scale(), repr(axis._major_tick_kw),
           repr(axis._minor_tick_kw), label, axis.label_position,
           axis.offsetText.get_visible(), axis.offsetText.get_color(),
           axis.offsetText.get_fontsize()]
    for ticker, ticks in ((axis.major, axis.majorTicks), (axis.minor, axis.minorTicks)):
        # after the layout: the locator's tick count follows the axes' size
        locs, labels = _ticks(ticker)
        row.extend((tuple(np.asarray(locs, dtype=float).tolist()), labels))
        row.append(ticker.formatter.get_offset() if hasattr(ticker.formatter, "get_offset") else "")
        for tick in ticks[:len(locs)]:
            row.append((tick.get_visible(), tick.tick1line.get_visible(), tick.tick2line.get_visible(),
                        tick.tick1line.get_color(), tick.tick1line.get_markersize(),
                        tick.tick1line.get_markeredgewidth(),
                        _text_style(tick.label1), _text_style(tick.label2)))
        if len(locs):
            # the view limits place the ticks (and drop those outside them); an axis with
            # no tick draws the same at any limits (a bar chart's value axis, rescaled on
            # every draw, keeps its static layer)
            row[0] = axis.get_view_interval().tolist()
    return tuple(row)


def _static_key(fig: Figure, subs: list, static: list) -> tuple:
    """Everything the static layer's pixels depend on: the figure's size, dpi and
    background, and each subfigure's in ``subs``; per static axes, its place, zorder and
    background, and its x and y axes (:func:`_axis_key`); the spines' positions (which
    move the ticks)."""
    key = [tuple(fig.bbox.bounds), fig.dpi]
    for sub in subs:
        key.append((tuple(sub.bbox.bounds), sub.patch.get_visible(), sub.patch.get_facecolor(),
                    sub.patch.get_edgecolor(), sub.patch.get_linewidth()))
    for ax in static:
        key.append((tuple(ax.bbox.bounds), ax.zorder, ax.patch.get_visible(),
                    ax.patch.get_facecolor(), ax.patch.get_edgecolor(),
                    tuple((name, repr(spine._position)) for name, spine in ax.spines.items()),
                    _axis_key(ax.xaxis), _axis_key(ax.yaxis)))
    return tuple(key)


def _draw_axis_static(axis, renderer) -> tuple:
    """Draw ``axis`` as ``Axis.draw`` does, but without its grid lines; return the grid
    lines it would have drawn (:func:`_draw_layers` draws them with the data) and the
    boxes (``Bbox``, display pixels) of what it drew: tick marks, tick labels, its label
    and offset text."""
    if not axis.get_visible():
        return [], []
    ticks = axis._update_ticks()
    tlb1, tlb2 = axis._get_ticklabel_bboxes(ticks, renderer)
    grid, drawn = [], [*tlb1, *tlb2]
    for tick in ticks:
        if tick.get_visible():
            grid.append(tick.gridline)
            for artist in (tick.tick1line, tick.tick2line, tick.label1, tick.label2):
                artist.draw(renderer)
            drawn += [line.get_window_extent(renderer) for line in (tick.tick1line, tick.tick2line)
                      if line.get_visible()]
    axis._update_label_position(renderer)
    axis.label.draw(renderer)
    axis._update_offset_text_position(tlb1, tlb2)
    axis.offsetText.set_text(axis.major.formatter.get_offset())
    axis.offsetText.draw(renderer)
    drawn += [text.get_window_extent(renderer) for text in (axis.label, axis.offsetText)
              if text.get_visible() and text.get_text()]
    return grid, drawn


def _meets(boxes: np.ndarray, x0: float, y0: float, x1: float, y1: float) -> bool:
    """Whether the box ``(x0, y0, x1, y1)`` overlaps one of ``boxes`` (:func:`_overlaps`)."""
    return bool(_overlaps((x0, y0, x1, y1), boxes)[0])


def _texts_meet(texts: list, boxes: np.ndarray, renderer) -> bool:
    """Whether one of the unclipped ``texts`` (with its ``bbox`` patch, if any) may draw
    over one of ``boxes``: first against a square around its anchor that holds any text
    of its lines at its size (1.5 em per character, rotated any way), all texts at once;
    then, for a text near a box, against its own extent."""
    em = np.array([t.get_fontsize() for t in texts]) * renderer.points_to_pixels(1.0)
    pads = em * (1.0 + np.array([t.get_bbox_patch().get_boxstyle().pad
                                 if t.get_bbox_patch() is not None else 0.0 for t in texts]))
    reach = em * 1.5 * np.array([max(max(map(len, t.get_text().split("\n"))),
                                     (t.get_text().count("\n") + 1) * t._linespacing)
                                 for t in texts]) + pads
    anchors = np.empty((len(texts), 2))
    by_transform: dict = {}
    for k, t in enumerate(texts):
        by_transform.setdefault(id(t.get_transform()), (t.get_transform(), []))[1].append(k)
    for transform, ks in by_transform.values():
        anchors[ks] = transform.transform(np.array([texts[k].get_unitless_position() for k in ks],
                                                   dtype=float))
    near = _overlaps(np.hstack([anchors - reach[:, None], anchors + reach[:, None]]), boxes)
    for k in np.flatnonzero(near):
        box, pad = texts[k].get_window_extent(renderer), pads[k]
        if _meets(boxes, box.x0 - pad, box.y0 - pad, box.x1 + pad, box.y1 + pad):
            return True
    return False


_PLAIN_SPINE = (None, ("outward", 0), ("outward", 0.0))
"""Spine positions on the axes' box edge (matplotlib's default)."""


def _draws_over(ax, static: bool, boxes: np.ndarray, renderer) -> bool:
    """Whether ``ax`` draws anything over ``boxes`` (shape ``(n, 4)``, display pixels),
    apart from its static layer when ``static``: its box (with what is clipped to it and
    the spines on its edges, widened by their half width and a pixel of antialiasing),
    spines placed elsewhere, and each artist it draws unclipped (a text, a title, a
    legend; its x and y axes unless ``static``)."""
    from matplotlib.axes import Axes
    from matplotlib.spines import Spine
    from matplotlib.text import Text
    b = ax.bbox
    spines = [sp for sp in ax.spines.values() if sp.get_visible()]
    w = max((renderer.points_to_pixels(sp.get_linewidth()) for sp in spines), default=0) / 2 + 1
    if _meets(boxes, b.x0 - w, b.y0 - w, b.x1 + w, b.y1 + w):
        return True
    texts = []
    for child in ax.get_children():
        if child is ax.patch or not child.get_visible():
            continue
        if child in (ax.xaxis, ax.yaxis) or isinstance(child, Axes):   # or a secondary axis
            e = None if child in (ax.xaxis, ax.yaxis) and static else child.get_tightbbox(renderer)
            if e is not None and _meets(boxes, e.x0 - 1, e.y0 - 1, e.x1 + 1, e.y1 + 1):
                return True
            continue
        if isinstance(child, Spine):
            if child._position in _PLAIN_SPINE and child.spine_type in ("left", "right", "top", "bottom"):
                continue                    # on the box's edge: in the widened box
            e = child.get_path().get_extents(child.get_transform())
            if _meets(boxes, e.x0 - w, e.y0 - w, e.x1 + w, e.y1 + w):
                return True
            continue
        if child.get_clip_on() and (child.get_clip_box() is ax.bbox or child.get_clip_path() is not None):
            continue                        # inside the box
        if isinstance(child, Text):
            if child.get_text():
                texts.append(child)
            continue
        e = child.get_window_extent(renderer)
        if e is not None and _meets(boxes, e.x0 - 1, e.y0 - 1, e.x1 + 1, e.y1 + 1):
            return True
    return bool(texts) and _texts_meet(texts, boxes, renderer)


def _layers_keep_order(fig: Figure, static: list, drawn: dict, renderer) -> bool:
    """Whether drawing ``static``'s layer first leaves the pixels of matplotlib's order:
    nothing that an axes drawn before a static axes draws may meet what that static axes
    puts in the layer (``drawn``: its boxes per axes, from :func:`_draw_axis_static`, and
    its own box). Notebook 16's bucket explorer, with long tick labels on its right
    axes, put that axes' y label over the left axes' spine: drawn first, it came out a
    shade lighter there than under matplotlib's order."""
    order = sorted(fig.axes, key=lambda a: a.zorder)   # Figure.draw's order (a stable sort)
    later: list = []                        # the static boxes of the axes after each one
    after = []
    for ax in reversed(order):
        after.append(np.array(later, dtype=float).reshape(-1, 4))
        later += [b.extents for b in drawn.get(ax, [])]
    for ax, boxes in zip(order, reversed(after)):
        if len(boxes) and _draws_over(ax, ax in drawn, boxes, renderer):
            return False
    return True


def _draw_layers(fig: Figure, subs: list) -> None:
    """Draw ``fig`` (its subfigures ``subs``, :func:`_subfigures`) on its canvas's
    renderer, as ``canvas.draw()`` would: the static layer (drawn, or restored when
    :func:`_static_key` is unchanged), then everything else."""
    canvas = fig.canvas
    renderer = canvas.get_renderer()
    for ax in fig.axes:                     # what Figure.draw does first: aspect, autoscale
        locator = ax.get_axes_locator()
        ax.apply_aspect(locator(ax, renderer) if locator else None)
        ax._unstale_viewLim()
    static = _static_axes(fig, subs)
    if not static:
        fig.__dict__.pop("_reducelab_background", None)
        canvas.draw()
        return
    key = _static_key(fig, subs, static)
    kept = fig.__dict__.get("_reducelab_background")
    try:
        same = kept is not None and kept[1] is renderer and bool(kept[0] == key)
    except ValueError:                      # a colour given as an array: compare no further
        same = False
    if same:
        grids, drawn = kept[3], kept[4]
        if not _layers_keep_order(fig, static, drawn, renderer):
            canvas.draw()
            return
        renderer.restore_region(kept[2])
    else:
        renderer.clear()
        for sub in subs:                    # the figure's background, then its subfigures'
            sub.patch.draw(renderer)
        grids, drawn = {}, {}
        for ax in sorted(static, key=lambda a: a.zorder):
            ax.patch.draw(renderer)
            drawn[ax] = [ax.bbox]
            for axis in (ax.xaxis, ax.yaxis):
                grids[axis], boxes = _draw_axis_static(axis, renderer)
                drawn[ax] += boxes
        fig._reducelab_background = (key, renderer, renderer.copy_from_bbox(fig.bbox), grids, drawn)
        if not _layers_keep_order(fig, static, drawn, renderer):
            canvas.draw()
            return
    overridden = [*(sub.patch for sub in subs), *(ax.patch for ax in static)]
    for artist in overridden:
        artist.draw = _draw_nothing
    for axis, lines in grids.items():
        axis.draw = _gridlines_drawer(lines)
        overridden.append(axis)
    try:
        fig.draw(renderer)
    finally:
        for artist in overridden:
            del artist.draw
    for check in CHECK_LAYERS:
        check(fig, np.array(renderer.buffer_rgba()))


def _draw_nothing(renderer) -> None:
    """What a static artist draws after the static layer: nothing more."""


def _gridlines_drawer(lines: list):
    """An ``Axis.draw`` that draws only the grid lines the static layer left out, at the
    axis's place among the data."""
    def draw(renderer):
        for line in lines:
            line.draw(renderer)
    return draw


AUDITS: list = []
"""Callables ``audit(fig)`` run on every figure before it is encoded (the tests register
one that checks the palette, font sizes and width); empty in normal use."""


def png(fig: Figure) -> bytes:
    """Render ``fig`` at its own dpi and return PNG bytes (RGB, no metadata).

    Draws the Agg canvas once, in layers (:func:`_draw_layers`: the axes' ticks and
    labels restored from the last draw where they would come out the same, the same
    pixels as matplotlib's own draw), and encodes its pixels with Pillow at low
    compression: about half the cost of ``savefig``, which matters when a widget redraws
    on every control change.
    """
    from PIL import Image
    subs = _subfigures(fig)
    key = _layout_key(fig, subs)
    reused = _reuse_layout(fig, subs, key)
    if not reused and getattr(fig, "_reducelab_layout_reused", False):
        fig.set_layout_engine("constrained")   # a persistent figure whose margins changed
    fig._reducelab_layout_reused = reused
    _place_titles(fig)
    for audit in AUDITS:
        audit(fig)
    canvas = fig.canvas
    _draw_layers(fig, subs)
    if key is not None and not reused:
        _LAYOUTS[key] = _layout_of(fig, subs)
    rgba = canvas.buffer_rgba()             # memory of shape (height, width, 4)
    # Pillow drops the alpha channel in C: about 1.7 of 11 ms per figure less than
    # numpy's strided copy, the same PNG bytes
    rgb = Image.frombuffer("RGBA", (rgba.shape[1], rgba.shape[0]), rgba, "raw", "RGBA", 0,
                           1).convert("RGB")
    buf = io.BytesIO()
    rgb.save(buf, format="png", compress_level=1)
    return buf.getvalue()


def freeze_layout(fig: Figure, key=None) -> None:
    """Compute ``fig``'s constrained layout once, then keep it: later draws skip the
    layout engine (the costliest part of redrawing a persistent figure). The layout
    engine runs on its own, without rendering the figure (a quarter less than a draw).

    ``key`` (any hashable): figures frozen with the same key, size and margins (tick
    labels as long, titles of as many lines, see :func:`new_figure`) share one layout:
    the second and later get the positions the first found, without the engine (about
    90 ms of a 9.6 x 4.5 in figure of five axes). Anything else that changes the layout
    belongs in the key."""
    subs = _subfigures(fig)
    full = _layout_key(fig, subs, key) if key is not None else None
    if not _reuse_layout(fig, subs, full):
        fig.get_layout_engine().execute(fig)
        if full is not None:
            _LAYOUTS[full] = _layout_of(fig, subs)
    fig.set_layout_engine("none")


_NOTHING = object()


class BuiltFigures:
    """Mixin for a plot that keeps one persistent figure per shape (world size, number of
    elements): :meth:`_use` makes the figure of a shape current, restoring the figure
    and artists it built for that shape before, or building them. Going back to a world
    size the learner saw then costs a redraw, not a new figure and layout (a few
    hundred milliseconds). The last :data:`KEEP` shapes are kept (about 2 MB each)."""

    KEEP = 4

    def _preparation(self, shape, build):
        """``None`` if ``shape``'s figure is current; else the callable that makes it
        current (:meth:`_use`), for :meth:`reducelab.widgets.Explorer.preparation`."""
        if self.__dict__.get("_built_shape", _NOTHING) == shape:
            return None
        return lambda: self._use(shape, build)

    def _use(self, shape, build) -> None:
        """Make ``shape``'s figure current; ``build()`` makes it the first time (it sets
        the instance's figure and artist attributes)."""
        built = self.__dict__.setdefault("_built", collections.OrderedDict())
        current = self.__dict__.get("_built_shape")
        if current is not None:  # remember the current figure as it is now
            built[current] = {k: v for k, v in self.__dict__.items()
                              if k not in ("_built", "_built_shape")}
            built.move_to_end(current)
        if shape in built:
            self.__dict__.update(built.pop(shape))
        else:
            build()
        self._built_shape = shape
        while len(built) > self.KEEP - 1:
            built.popitem(last=False)


@functools.lru_cache(maxsize=16)
def message_png(text: str, width_px: int = 600, height_px: int = 160) -> bytes:
    """A plain figure of ``width_px`` x ``height_px`` pixels that says ``text``: what an
    explorer shows instead of its figure when the ranks refused the controls' values,
    so no stale picture contradicts the message. Drawn once per text and size (a new
    figure costs 20 to 40 ms of a refusal), then served from a cache."""
    from matplotlib.figure import Figure

    from .agg import Canvas
    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
    Canvas(fig)
    fig.patch.set_facecolor(PANEL_GREY)
    fig.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=12,
             color=TEXT_GREY)
    return png(fig)


def show(png_bytes: bytes):
    """Display PNG bytes in a notebook cell (returns an ``IPython.display.Image``)."""
    from IPython.display import Image
    return Image(data=png_bytes, format="png")


def fmt_value(v: float) -> str:
    """Short label for one tensor element: integers without a decimal point, else 3 significant digits."""
    if isinstance(v, (bool, np.bool_)):
        return str(int(v))
    if float(v).is_integer() and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


class RankHeatmaps(BuiltFigures):
    """Side-by-side heatmaps of a per-rank tensor: one row per rank, one column per element.

    Used by notebook 01 (before/after ``all_reduce``) and notebook 02 (what each rank's
    buffer holds after ``reduce``). The figure persists between draws and is rebuilt
    only when the number of panels, ranks or elements changes, because updating a
    persistent figure is several times faster than making a new one.

    Args:
        titles: one title per panel, e.g. ``("before", "after")``.
    """

    MAX_LABELS = 160  # annotate each cell with its value up to this many cells per panel

    def __init__(self, titles: tuple[str, ...] = ("before", "after")):
        self.titles = tuple(titles)
        self.fig: Figure | None = None
        self._shape = None
        self._images = []
        self._texts = []

    def _build(self, world_size: int, n: int) -> None:
        width = MAX_WIDTH if n > 4 else 2.4 + 1.5 * len(self.titles) * max(n, 2)
        height = 1.3 + 0.38 * world_size  # 4.3 in at 8 ranks: controls and figure fit a screen
        self.fig = new_figure(width, height)
        axes = self.fig.subplots(1, len(self.titles), squeeze=False)[0]
        self._axes, self._images, self._texts = axes, [], []
        for ax, title in zip(axes, self.titles):
            im = ax.imshow(np.zeros((world_size, n)), cmap=CMAP, aspect="auto")
            ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
            ax.set_xticks(range(n) if n <= 16 else [])
            ax.set_xlabel("element")
            ax.set_title(title)
            self._images.append(im)
            texts = []
            if world_size * n <= self.MAX_LABELS:
                texts = [[ax.text(j, i, "", ha="center", va="center", fontsize=MIN_FONT)
                          for j in range(n)] for i in range(world_size)]
            self._texts.append(texts)
        self._shape = (world_size, n)
        self._ylabels = None
        # reserve room for a title, two-line panel titles and "rank N (dst)" labels,
        # then freeze the layout
        self.fig.suptitle(" ")
        for ax in axes:
            ax.set_title("before\nafter")
            ax.set_yticks(range(world_size), [f"rank {r} (dst)" for r in range(world_size)])
        freeze_layout(self.fig)
        # the widest label that fits a cell at MIN_FONT (a digit is about 0.6 em wide)
        cell_px = axes[0].get_window_extent().width / n
        self._max_chars = int(0.9 * cell_px / (0.6 * MIN_FONT * DPI / 72))

    def preparation(self, world_size: int, n: int):
        """The callable that builds (or restores) the figure of ``world_size`` ranks and
        ``n`` elements, or ``None`` if it is current: an explorer runs it while the
        ranks compute (:meth:`reducelab.widgets.Explorer.preparation`)."""
        return self._preparation((world_size, n), lambda: self._build(world_size, n))

    def draw(self, panels: list, subtitles: list[str] | None = None,
             title: str | None = None, highlight_rows: dict[int, str] | None = None) -> bytes:
        """Draw the panels and return PNG bytes.

        Args:
            panels: one array-like per title, each of shape ``(world_size, n)``; any
                numeric dtype. ``NaN`` cells are left blank (no value). Each cell shows
                its value where the value fits the cell at :data:`MIN_FONT` points.
            subtitles: optional text under each panel's title.
            title: optional figure title.
            highlight_rows: optional ``{rank: label}`` marked on the y axis, e.g. ``{0: "dst"}``.

        Raises:
            ValueError: the number of panels differs from the number of titles.
        """
        arrays = [np.asarray(p, dtype=float) for p in panels]
        if len(arrays) != len(self.titles):
            raise ValueError(f"expected {len(self.titles)} panels ({self.titles}), got {len(arrays)}")
        world_size, n = arrays[0].shape
        build = self.preparation(world_size, n)
        if build is not None:
            build()
        finite = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.zeros(1)
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if lo == hi:
            lo, hi = lo - 1, hi + 1
        for k, (a, im) in enumerate(zip(arrays, self._images)):
            im.set_data(np.ma.masked_invalid(a))
            im.set_clim(lo, hi)
            mid = (lo + hi) / 2
            labels = [[fmt_value(v) if np.isfinite(v) else "" for v in row] for row in a]
            fits = max((len(x) for row in labels for x in row), default=0) <= self._max_chars
            for i, row in enumerate(self._texts[k]):
                for j, t in enumerate(row):
                    v = a[i, j]
                    t.set_text(labels[i][j] if fits else "")
                    t.set_color("black" if np.isfinite(v) and v > mid else "white")
            label = self.titles[k] + (f"\n{subtitles[k]}" if subtitles and subtitles[k] else "")
            self._axes[k].set_title(label)
        labels = [f"rank {r}" + (f" ({highlight_rows[r]})" if highlight_rows and r in highlight_rows
                                 else "") for r in range(world_size)]
        if labels != self._ylabels:
            for ax in self._axes:
                ax.set_yticks(range(world_size), labels)
            self._ylabels = labels
        self.fig.suptitle(title or "")
        return png(self.fig)


IDLE_IMPORT_DELAY = 0.5
"""Seconds a Jupyter kernel stays idle after the cell that imported this module before
:func:`import_agg_when_idle` imports :mod:`reducelab.plots.agg` (matplotlib)."""


def import_agg_when_idle() -> bool:
    """In a Jupyter kernel, import :mod:`reducelab.plots.agg` (matplotlib, about 0.3 s of
    CPU after torch) once the current cell has ended and the kernel has been idle for
    :data:`IDLE_IMPORT_DELAY` seconds; return ``True`` if scheduled.

    The setup cell then does not wait for matplotlib (issue 23's goal for it: 1.3 times a
    bare ``import torch``), and a learner who reads before running the first cell that
    draws does not wait for it there either. The import runs on the kernel's own thread,
    from its event loop (IPython's ``post_run_cell`` event, then ``call_later``), so it
    never runs beside a cell's own imports: a cell sent while it runs waits for it, as
    that cell would have waited for its own first figure. Outside a kernel (scripts,
    tests, a terminal IPython without a running loop) nothing is scheduled."""
    import sys
    try:
        shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    except Exception:  # noqa: BLE001 - a broken IPython: draw as scripts do
        return False
    if shell is None or not hasattr(shell, "events") or "ipykernel" not in sys.modules:
        return False

    def at_cell_end(result=None) -> None:
        import asyncio
        shell.events.unregister("post_run_cell", at_cell_end)
        try:
            asyncio.get_running_loop().call_later(IDLE_IMPORT_DELAY, _import_agg)
        except RuntimeError:  # no running loop: the first figure imports it
            pass
    shell.events.register("post_run_cell", at_cell_end)
    return True


def _import_agg() -> None:
    try:
        importlib.import_module(".agg", __name__)
    except Exception:  # noqa: BLE001 - the first figure imports it again and says why
        pass


import_agg_when_idle()
