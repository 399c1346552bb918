"""Figures of notebook 13 (what DDP expects of a model), drawn to PNG bytes at the size
they are shown (at most ``MAX_WIDTH`` wide, text of ``MIN_FONT`` points or more, colours
from :mod:`reducelab.palette`).

* :func:`construction_figure`: a few elements of every rank's parameters as each rank
  built them and after ``DDP(model)``, with each rank's row marked "same" or "differs"
  from rank 0's.
* :func:`buffers_figure`: BatchNorm's ``running_mean`` on every rank, with DDP's
  ``forward_sync_buffers`` on and off, against the mean of the global batch.
* :func:`mask_figure`: dropout masks, one row per rank, for several seeding patterns.
* :class:`StepFigure`: the explorer's figure: the parameters as built, after
  ``DDP(model)``, the gradient after ``backward()`` and the parameters after one SGD
  step, each rank a row, plus each rank's dropout mask.

Sources: the DDP constructor broadcasts rank 0's parameters and buffers
(``_sync_module_states``, called from ``DistributedDataParallel.__init__`` in
``torch/nn/parallel/distributed.py``, torch 2.13; https://pytorch.org/docs/stable/notes/ddp.html);
the learner questions pytorch/pytorch#36613 and open-mmlab/mmdetection#2153.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import (CMAP, HATCHES, MIN_FONT, NEUTRAL, PALETTE, BuiltFigures, freeze_layout, new_figure,
               png)
from .sharded import scale_text, scaled_labels

if TYPE_CHECKING:
    from matplotlib.patches import Rectangle

NO_VALUE = NEUTRAL
"""Background of a cell with no value (a parameter that received no gradient)."""
NO_VALUE_HATCH = "//"
"""Hatch of such a cell: a second cue beside the grey."""
DROPPED = PALETTE["black"]
"""A dropped unit in a dropout mask (also written "0" and hatched)."""
MEAN_COLOUR = PALETTE["vermillion"]
"""The line of the global batch's mean in :func:`buffers_figure`."""
SETTING_STYLE = {True: (PALETTE["blue"], HATCHES[0]), False: (PALETTE["orange"], HATCHES[1])}
"""Colour and hatch of ``forward_sync_buffers=True`` and ``False`` bars."""


def _check_rows(name: str, values, world_size: int | None = None) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D array, one row per rank, got shape {a.shape}")
    if world_size is not None and a.shape[0] != world_size:
        raise ValueError(f"{name} has {a.shape[0]} rows; expected one per rank ({world_size})")
    return a


def same_as_rank0(values: np.ndarray) -> list[bool]:
    """For each row of ``values`` (one row per rank), whether it equals row 0 exactly,
    NaN cells included (NaN counts as equal to NaN: no value on both)."""
    a = np.asarray(values, dtype=float)
    return [bool(np.array_equal(row, a[0], equal_nan=True)) for row in a]


def _group_ticks(ax, groups, names=None) -> list[float]:
    """Label column groups (``[(name, n_columns), ...]``) under the panel (``names``
    instead of the groups' names, if given) and separate them with vertical lines;
    return the tick positions."""
    start, centres = 0, []
    for _, n in groups:
        centres.append(start + (n - 1) / 2)
        start += n
        if start < sum(n for _, n in groups):
            ax.axvline(start - 0.5, color="white", lw=2.5)
    ax.set_xticks(centres, names if names is not None else [name for name, _ in groups])
    ax.tick_params(axis="x", length=0)
    return centres


NEAR_ZERO = "~0"
"""A cell's label where a value that is not zero rounds to 0 in its unit: "0" is kept
for an exact zero (a gradient that is exactly zero, such as a unit dropped for every
sample), so a small value never reads as none."""


def cell_labels(values: np.ndarray, group_of=None) -> tuple[list, np.ndarray]:
    """The labels of a heatmap's cells and their units: whole numbers in units of
    ``10**e`` (:func:`~reducelab.plots.sharded.scaled_labels`), :data:`NEAR_ZERO` where a
    value that is not zero rounds to 0.

    Args:
        values: ``(rows, columns)`` float; NaN where there is no value.
        group_of: per column, the index of its column group: each group then gets its
            own exponent (a group's values may be a hundred times smaller than
            another's, as a body's gradient against a head's); ``None``: one exponent.

    Returns:
        ``(exponents, labels)``: one exponent per group (one in all without
        ``group_of``), and an array of ``str`` of the shape of ``values``.
    """
    a = np.asarray(values, dtype=float)
    groups = np.zeros(a.shape[1], int) if group_of is None else np.asarray(group_of)
    exponents, labels = [], np.full(a.shape, "", dtype=object)
    for g in range(int(groups.max()) + 1):
        columns = groups == g
        e, part = scaled_labels(a[:, columns])
        exponents.append(e)
        labels[:, columns] = part
    labels[(labels == "0") & np.isfinite(a) & (a != 0)] = NEAR_ZERO
    return exponents, labels


def _hatched_cell(x: float, y: float) -> Rectangle:
    from matplotlib.patches import Rectangle
    return Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=NO_VALUE, edgecolor="black",
                     hatch=NO_VALUE_HATCH, lw=0)


class _HeatPanel:
    """One heatmap panel, built once and updated: rows are ranks, each cell shows its
    value in the panel's unit (``unit_per_group``: in its column group's unit, written
    under the group's name; :data:`NEAR_ZERO` for a value that is not zero but rounds
    to 0); a NaN cell is grey and hatched, and each run of NaN cells
    within a column group says "none" once, centred on the run (one label per cell
    would touch its neighbour's and read as one word across the cells); the right side
    says whether each row equals rank 0's."""

    def __init__(self, ax, world_size: int, groups, title: str, unit_per_group: bool = False):
        n = sum(int(k) for _, k in groups)
        self.ax, self.title, self.world_size = ax, title, world_size
        self.names, self.unit_per_group = [str(name) for name, _ in groups], unit_per_group
        self.group_of = np.repeat(np.arange(len(groups)), [int(k) for _, k in groups])
        ax.set_facecolor(NO_VALUE)
        self.image = ax.imshow(np.zeros((world_size, n)), cmap=CMAP, aspect="auto")
        self.cells = []
        for i in range(world_size):
            row = []
            for j in range(n):
                patch = ax.add_patch(_hatched_cell(j, i))
                patch.set_visible(False)
                row.append((patch, ax.text(j, i, "", ha="center", va="center",
                                           fontsize=MIN_FONT)))
            self.cells.append(row)
        ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
        self.centres = _group_ticks(ax, groups, [f"{name}\n×10⁻²" for name in self.names]
                                    if unit_per_group else None)             # room for a unit
        self.right = ax.secondary_yaxis("right")
        self.right.set_yticks(range(world_size), ["differs"] * world_size)   # the widest label
        self.right.tick_params(length=0)
        ax.set_title(f"{title}  (×10⁻²)" if not unit_per_group else title,
                     fontsize=MIN_FONT + 1)

    def update(self, values: np.ndarray) -> None:
        finite = values[np.isfinite(values)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if lo == hi:
            lo, hi = lo - 1, hi + 1
        self.image.set_data(np.ma.masked_invalid(values))
        self.image.set_clim(lo, hi)
        exponents, labels = cell_labels(values, self.group_of if self.unit_per_group else None)
        mid = (lo + hi) / 2
        for (i, j), v in np.ndenumerate(values):
            patch, text = self.cells[i][j]
            if np.isfinite(v):
                patch.set_visible(False)
                text.set_text(labels[i, j])
                text.set_position((j, i))
                text.set_color("black" if v > mid else "white")
                text.set_bbox(None)
                continue
            patch.set_visible(True)
            first = j == 0 or np.isfinite(values[i, j - 1]) or self.group_of[j - 1] != self.group_of[j]
            if not first:
                text.set_text("")
                continue
            last = j
            while (last + 1 < values.shape[1] and not np.isfinite(values[i, last + 1])
                   and self.group_of[last + 1] == self.group_of[j]):
                last += 1
            text.set_text("none")
            text.set_position(((j + last) / 2, i))
            text.set_color("black")
            text.set_bbox({"facecolor": "white", "edgecolor": "none", "pad": 0.5})
        self.right.set_yticks(range(self.world_size),
                              ["rank 0" if r == 0 else ("same" if s else "differs")
                               for r, s in enumerate(same_as_rank0(values))])
        if self.unit_per_group:                  # the unit under each group's name
            present = [np.isfinite(values[:, self.group_of == g]).any() for g in range(len(self.names))]
            self.ax.set_xticks(self.centres, [f"{name}\n{scale_text(e) or '×1'}" if has else name
                                              for name, e, has in zip(self.names, exponents, present)])
            return
        unit = scale_text(exponents[0])
        self.ax.set_title(self.title + (f"  ({unit})" if unit else ""), fontsize=MIN_FONT + 1)


def construction_figure(built, wrapped, groups, title: str = "") -> bytes:
    """Two panels, 9.6 x (1.5 + 0.45 per rank) in: a few parameter elements of every
    rank as it built the model, and after ``DDP(model)``.

    Args:
        built, wrapped: array-likes of shape ``(world_size, n)``, float.
        groups: ``[(name, n_columns), ...]`` naming consecutive columns (e.g.
            ``[("body", 4), ("head", 3), ("aux", 3)]``); the counts add up to ``n``.
        title: figure title.

    Raises:
        ValueError: shapes differ, or ``groups`` does not cover the columns.
    """
    b = _check_rows("built", built)
    w = _check_rows("wrapped", wrapped, b.shape[0])
    if b.shape != w.shape:
        raise ValueError(f"built and wrapped must have the same shape, got {b.shape} and {w.shape}")
    _check_groups(groups, b.shape[1])
    fig = new_figure(9.6, 1.5 + 0.45 * b.shape[0])
    axes = fig.subplots(1, 2)
    for ax, values, name in ((axes[0], b, "as each rank built it"), (axes[1], w, "after DDP(model)")):
        _HeatPanel(ax, b.shape[0], groups, name).update(values)
    fig.suptitle(title, fontsize=MIN_FONT + 1)
    return png(fig)


def _check_groups(groups, n: int) -> None:
    total = sum(int(k) for _, k in groups)
    if total != n or any(int(k) < 1 for _, k in groups):
        raise ValueError(f"groups {list(groups)} must name {n} columns, one or more each")


def buffers_figure(synced, unsynced, global_mean: float, title: str = "") -> bytes:
    """Grouped bars, 7.5 x 3.4 in: each rank's BatchNorm ``running_mean`` with
    ``forward_sync_buffers=True`` (DDP's default) and ``False``, each bar labelled with
    its value, and a dashed line at ``global_mean``, the mean of the global batch.

    Args:
        synced, unsynced: one ``running_mean`` per rank (floats), equal lengths.
        global_mean: the mean over every rank's samples.
        title: figure title.

    Raises:
        ValueError: lengths differ or are 0.
    """
    s, u = np.asarray(synced, dtype=float), np.asarray(unsynced, dtype=float)
    if s.ndim != 1 or s.shape != u.shape or s.size == 0:
        raise ValueError(f"synced and unsynced need one value per rank, got {s.shape} and {u.shape}")
    fig = new_figure(7.5, 3.4)
    ax = fig.subplots()
    x = np.arange(s.size)
    width = 0.38
    for offset, values, sync in ((-width / 2, s, True), (width / 2, u, False)):
        colour, hatch = SETTING_STYLE[sync]
        bars = ax.bar(x + offset, values, width, color=colour, hatch=hatch, edgecolor="black",
                      lw=0.6, label=f"forward_sync_buffers={sync}")
        ax.bar_label(bars, [f"{v:.1f}" for v in values], fontsize=MIN_FONT, padding=2)
    ax.axhline(global_mean, color=MEAN_COLOUR, ls=(0, (4, 3)), lw=1.6,
               label=f"mean of the global batch: {global_mean:.1f}")
    ax.set_xticks(x, [f"rank {r}" for r in x])
    ax.set_ylabel("running_mean")
    ax.set_ylim(0, max(s.max(), u.max(), global_mean) * 1.3)
    ax.legend(loc="upper left", fontsize=MIN_FONT, framealpha=0.95)
    ax.set_title(title, fontsize=MIN_FONT + 1)
    return png(fig)


class _MaskPanel:
    """One panel of dropout masks, built once and updated: a row per rank, black and
    cross-hatched for a dropped unit, white for a kept one; the right side says whether
    the row is rank 0's mask."""

    def __init__(self, ax, ranks: int, units: int, title: str, row_labels=None, reference=None):
        from matplotlib.patches import Rectangle
        self.ax, self.ranks = ax, ranks
        self.cells = [[ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white",
                                              edgecolor=NEUTRAL, lw=0.6))
                       for j in range(units)] for i in range(ranks)]
        ax.set_xlim(-0.5, units - 0.5)
        ax.set_ylim(ranks - 0.5, -0.5)
        ax.set_yticks(range(ranks), row_labels if row_labels is not None else [""] * ranks)
        ax.set_xticks(range(0, units, 4 if units > 8 else 1))
        ax.set_xlabel("hidden unit")
        ax.set_title(title, fontsize=MIN_FONT + 1)
        self.right = ax.secondary_yaxis("right")
        self.reference = list(reference) if reference is not None else None
        widest = "differs from rank 0" if reference is not None else "rank 0's"
        self.right.set_yticks(range(ranks), [widest] * ranks)
        self.right.tick_params(length=0)
        for r in range(1, ranks if reference is not None else 0):   # a thick line between groups
            if self.reference[r] != self.reference[r - 1]:
                ax.axhline(r - 0.5, color="black", lw=3)

    def update(self, dropped: np.ndarray) -> None:
        for (i, j), d in np.ndenumerate(dropped):
            rect = self.cells[i][j]
            rect.set_facecolor(DROPPED if d else "white")
            rect.set_hatch("xx" if d else None)
        self.right.set_yticks(range(self.ranks), mask_labels(dropped, self.reference))


def mask_labels(dropped: np.ndarray, reference=None) -> list[str]:
    """The right-hand label of each row of a mask panel: ``"rank k's"`` on a reference
    row; on another row, against rank 0 (``reference`` None) ``"same"`` or ``"differs"``,
    and against its own reference row k ``"same as rank k"`` or ``"differs from rank k"``.

    Args:
        dropped: ``(ranks, units)``, truthy for a dropped unit.
        reference: per row, the row it is compared with (a reference row names itself).
    """
    d = np.asarray(dropped).astype(bool)
    ref = list(reference) if reference is not None else [0] * d.shape[0]
    out = []
    for r, k in enumerate(ref):
        same = np.array_equal(d[r], d[k])
        if r == k:
            out.append(f"rank {k}'s")
        elif reference is None:
            out.append("same" if same else "differs")
        else:
            out.append(f"same as rank {k}" if same else f"differs from rank {k}")
    return out


def mask_figure(panels: dict, row_labels=None, title: str = "", reference=None) -> bytes:
    """One panel per seeding pattern, 9.6 in wide: each row is a rank's dropout mask
    (black, cross-hatched: dropped; white: kept, as a key under the panels says), and
    the right side says whether the row is the same mask as its reference row's: rank
    0's, or with ``reference`` each row's own (a thick line then separates the groups
    of rows that share a reference, such as the tp groups of a dp x tp mesh).

    Args:
        panels: ``{title: array-like of shape (ranks, units)}``, truthy where a unit
            was dropped; every panel has the same shape.
        row_labels: a label per row (default ``"rank r"``).
        title: figure title.
        reference: per row, the index of the row it is compared with (a reference row
            gives its own index); default: every row against row 0.

    Raises:
        ValueError: no panel, panels of different shapes, or a ``row_labels`` or
            ``reference`` of another length than the rows.
    """
    from matplotlib.patches import Rectangle
    arrays = {k: np.asarray(v).astype(bool) for k, v in panels.items()}
    if not arrays:
        raise ValueError("mask_figure needs at least one panel")
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"every panel must be a (ranks, units) array of one shape, got {shapes}")
    ranks, _ = next(iter(shapes))
    labels = row_labels or [f"rank {r}" for r in range(ranks)]
    if len(labels) != ranks:
        raise ValueError(f"row_labels has {len(labels)} labels for {ranks} rows")
    if reference is not None and (len(reference) != ranks
                                  or any(not 0 <= int(k) < ranks for k in reference)):
        raise ValueError(f"reference needs one row index in [0, {ranks}) per row, got {reference}")
    fig = new_figure(9.6, 2.0 + 0.4 * ranks)
    axes = fig.subplots(1, len(arrays), squeeze=False)[0]
    for k, (ax, (name, a)) in enumerate(zip(axes, arrays.items())):
        _MaskPanel(ax, ranks, a.shape[1], name, labels if k == 0 else None, reference).update(a)
    key = [Rectangle((0, 0), 1, 1, facecolor=DROPPED, edgecolor=NEUTRAL, hatch="xx", lw=0.6),
           Rectangle((0, 0), 1, 1, facecolor="white", edgecolor=NEUTRAL, lw=0.6)]
    fig.legend(key, ["a dropped unit (black, cross-hatched)", "a kept unit (white)"],
               loc="outside lower center", ncols=2, fontsize=MIN_FONT, frameon=False)
    fig.suptitle(title, fontsize=MIN_FONT + 1)
    return png(fig)


class StepFigure(BuiltFigures):
    """The explorer's figure, 9.6 x (2.6 + 0.7 per rank) in: five panels and a key.

    Top: an element of every parameter as each rank built it, after ``DDP(model)``,
    and each rank's dropout mask in the step. Bottom: the gradient after ``backward()``
    ("none" where a parameter received none; each column group in a unit of its own,
    written under its name, since a body's gradient can be a hundred times smaller than
    a head's) and the parameters after one SGD step. Every panel marks each rank's row
    "same" as rank 0's or "differs"; a value that is not zero but rounds to 0 in its
    unit reads :data:`NEAR_ZERO`.

    The figure is built once per world size, number of columns and of hidden units, its
    layout computed once and kept; a :meth:`draw` only updates it (a widget redraws on
    every control change), and going back to a world size drawn before reuses its figure
    (:class:`~reducelab.plots.BuiltFigures`).
    """

    def __init__(self):
        self.fig = None

    def _build(self, world_size: int, groups, units: int) -> None:
        from matplotlib.patches import Rectangle
        fig = new_figure(9.6, 2.6 + 0.7 * world_size)
        grid = fig.add_gridspec(2, 3, width_ratios=[1.5, 1.5, 0.8])
        names = [(grid[0, 0], "built, own generator"), (grid[0, 1], "after DDP(model)"),
                 (grid[1, 0], "gradient after backward"), (grid[1, 1], "after one SGD step")]
        self.panels = [_HeatPanel(fig.add_subplot(spec), world_size, groups, name,
                                  unit_per_group=name.startswith("gradient"))
                       for spec, name in names]
        self.mask = _MaskPanel(fig.add_subplot(grid[0, 2]), world_size, units,
                               "dropout mask in the step", [f"rank {r}" for r in range(world_size)])
        key = fig.add_subplot(grid[1, 2])
        key.axis("off")
        key.add_patch(Rectangle((0.02, 0.68), 0.16, 0.2, facecolor=NO_VALUE, edgecolor="black",
                                hatch=NO_VALUE_HATCH, lw=0, transform=key.transAxes))
        key.text(0.24, 0.78, "none: no gradient", va="center", fontsize=MIN_FONT,
                 transform=key.transAxes)
        key.add_patch(Rectangle((0.02, 0.40), 0.16, 0.2, facecolor=DROPPED, edgecolor=NEUTRAL,
                                hatch="xx", lw=0.6, transform=key.transAxes))
        key.text(0.24, 0.50, "a dropped unit", va="center", fontsize=MIN_FONT,
                 transform=key.transAxes)
        key.text(0.02, 0.18, "same / differs: this rank's row\nagainst rank 0's",
                 va="center", fontsize=MIN_FONT, transform=key.transAxes)
        key.text(0.02, -0.12, f"{NEAR_ZERO}: not zero, under half\nthe unit (0: exactly zero)",
                 va="center", fontsize=MIN_FONT, transform=key.transAxes)
        self.title = fig.suptitle("aux used on rank 0 only, find_unused_parameters, seed + rank, "
                                  "4 ranks", fontsize=MIN_FONT + 1)     # room for the longest title
        freeze_layout(fig)
        self.fig = fig

    def preparation(self, world_size: int, groups, units: int):
        """The callable that builds (or restores) the figure of ``world_size`` ranks,
        ``groups`` (``[(name, n_columns), ...]``) and ``units`` hidden units, or ``None``
        if it is current: an explorer runs it while the ranks compute
        (:meth:`reducelab.widgets.Explorer.preparation`)."""
        groups = [(str(name), int(k)) for name, k in groups]
        return self._preparation((world_size, tuple(groups), units),
                                 lambda: self._build(world_size, groups, units))

    def draw(self, built, wrapped, dropped, grad, after, groups, title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            built, wrapped, grad, after: array-likes ``(world_size, n)``; NaN in ``grad``
                where a parameter has no gradient.
            dropped: ``(world_size, units)``, truthy for a dropped unit.
            groups: ``[(name, n_columns), ...]`` covering the ``n`` columns.
            title: figure title.

        Raises:
            ValueError: shapes that do not agree.
        """
        b = _check_rows("built", built)
        ws = b.shape[0]
        w, g, a = (_check_rows(k, v, ws) for k, v in (("wrapped", wrapped), ("grad", grad),
                                                     ("after", after)))
        if not b.shape == w.shape == g.shape == a.shape:
            raise ValueError("built, wrapped, grad and after must have one shape")
        d = np.asarray(dropped).astype(bool)
        if d.ndim != 2 or d.shape[0] != ws:
            raise ValueError(f"dropped must have one row per rank ({ws}), got shape {d.shape}")
        groups = [(str(name), int(k)) for name, k in groups]
        _check_groups(groups, b.shape[1])
        build = self.preparation(ws, groups, d.shape[1])
        if build is not None:
            build()
        for panel, values in zip(self.panels, (b, w, g, a)):
            panel.update(values)
        self.mask.update(d)
        self.title.set_text(title)        # its text only: the frozen layout placed it
        return png(self.fig)


__all__ = ["NO_VALUE", "StepFigure", "buffers_figure", "construction_figure",
           "mask_figure", "mask_labels", "same_as_rank0"]
