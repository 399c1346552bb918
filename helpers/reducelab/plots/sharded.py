"""Figures of notebook 08 (sharded data parallelism), drawn to PNG bytes at the size they
are shown (at most ``MAX_WIDTH`` wide, text of ``MIN_FONT`` points or more, colours from
:mod:`reducelab.palette`, and every colour also said by hatching, a marker or a label).

* :func:`collective_figure`: each rank's tensor, then what it holds after
  ``reduce_scatter`` (its own piece; grey elsewhere), then after ``all_gather``.
* :func:`memory_figure`: bytes per rank of parameters, gradients and optimizer state for
  each sharding at several world sizes, stacked, beside the ZeRO paper's formula.
* :func:`precision_figure`: relative gradient error against the world size, one line per
  mixed-precision setting.
* :class:`ShardingFigure`: the explorer's figure: what each rank holds of the parameters
  before the step, of the reduced gradient, and of the parameters after the step; the
  memory each rank keeps; the bytes each rank sends in one step.

Source of the formulas: Rajbhandari, Rasley, Ruwase and He, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, arXiv:1910.02054 (Figure 1 and
section 7 on communication).
"""
from __future__ import annotations

import numpy as np

from ..palette import NEUTRAL, PANEL_GREY, TEXT_GREY
from . import (CMAP, HATCHES, MARKERS, MAX_WIDTH, MIN_FONT, PALETTE, BuiltFigures, RankHeatmaps,
               freeze_layout, new_figure, png)

NOT_HELD = NEUTRAL
"""Colour of a heatmap cell for an element a rank does not hold (NaN), in every figure of
notebook 08; the figures also say it in words ("grey: not held")."""

KINDS = ("parameters", "gradients", "optimizer state")
"""What a rank keeps between steps, in the order the bars stack."""
KIND_STYLE = {"parameters": (PALETTE["blue"], HATCHES[0]),
              "gradients": (PALETTE["orange"], HATCHES[1]),
              "optimizer state": (PALETTE["green"], HATCHES[2])}
"""Colour and hatch of each kind of memory."""
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives a step may call, in the order the bars stack."""
COLLECTIVE_STYLE = {"all_reduce": (PALETTE["vermillion"], HATCHES[3]),
                    "reduce_scatter": (PALETTE["sky"], HATCHES[4]),
                    "all_gather": (PALETTE["purple"], HATCHES[2])}
"""Colour and hatch of each collective's bytes."""
FORMULA_COLOUR = PALETTE["black"]
"""Markers and lines that stand for a formula."""


def collective_figure(inputs: np.ndarray, shards: np.ndarray, gathered: np.ndarray,
                      title: str = "") -> bytes:
    """Three heatmaps, one row per rank: the tensor each rank passes, what it holds after
    ``reduce_scatter`` (its own reduced piece; grey, :data:`NOT_HELD`, elsewhere) and after
    ``all_gather``.

    Args:
        inputs: shape ``(world_size, n)``, each rank's input.
        shards: shape ``(world_size, n // world_size)``, each rank's output of
            ``reduce_scatter``; rank ``r``'s piece is drawn at elements
            ``r * n // world_size`` onwards.
        gathered: shape ``(world_size, n)``, each rank's output of ``all_gather``.
        title: optional figure title.

    Returns:
        PNG bytes.

    Raises:
        ValueError: the shapes do not fit together.
    """
    inputs, shards, gathered = (np.asarray(a, dtype=float) for a in (inputs, shards, gathered))
    ws, n = inputs.shape
    if gathered.shape != (ws, n) or shards.shape[0] != ws or shards.shape[1] * ws != n:
        raise ValueError(f"expected inputs and gathered of shape (world_size, n) and shards of "
                         f"shape (world_size, n // world_size); got {inputs.shape}, "
                         f"{shards.shape}, {gathered.shape}")
    k = n // ws
    placed = np.full((ws, n), np.nan)
    for r in range(ws):
        placed[r, r * k:(r + 1) * k] = shards[r]
    heat = _HeldHeatmaps(("each rank's input", "after reduce_scatter", "after all_gather"))
    return heat.draw([inputs, placed, gathered],
                     subtitles=["", "rank r keeps piece r (grey: not held)", "every piece, in rank order"],
                     title=title)


class _HeldHeatmaps(RankHeatmaps):
    """:class:`~reducelab.plots.RankHeatmaps` whose empty (NaN) cells are grey,
    :data:`NOT_HELD`, as in the explorer's figure, rather than white."""

    def _build(self, world_size: int, n: int) -> None:
        super()._build(world_size, n)
        for ax in self._axes:
            ax.set_facecolor(NOT_HELD)


def memory_formula(sharding: str, numel: int, world_size: int, param_bytes: int = 4,
                   grad_bytes: int = 4, state_bytes: int = 8) -> dict[str, float]:
    """Bytes per rank of each kind of memory by the ZeRO paper's formulas (Figure 1 of
    arXiv:1910.02054), for ``numel`` parameters (the paper's Ψ) on ``world_size`` ranks
    (its N_d).

    The paper counts 2 bytes per parameter and per gradient (fp16) and K = 12 bytes of
    optimizer state (Adam's fp32 master copy, momentum and variance). Notebook 08 trains
    in float32: 4 bytes per parameter and per gradient, and K = 8 (``exp_avg`` and
    ``exp_avg_sq``; the parameters themselves are the fp32 copy). Pass other sizes for
    other cases.

    Args:
        sharding: ``"DDP"`` (nothing sharded), ``"ZeRO-1"`` (optimizer state),
            ``"ZeRO-2"`` (and gradients), ``"ZeRO-3"`` or ``"FSDP2"`` (and parameters).

    Returns:
        ``{kind: bytes}`` for the kinds of :data:`KINDS`, floats (a shard of a fraction
        of an element is allowed; the measured tensors round up and add padding).

    Raises:
        ValueError: an unknown sharding or a world size below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    split = {"DDP": (1, 1, 1), "ZeRO-1": (1, 1, world_size), "ZeRO-2": (1, world_size, world_size),
             "ZeRO-3": (world_size,) * 3, "FSDP2": (world_size,) * 3}
    if sharding not in split:
        raise ValueError(f"sharding must be one of {', '.join(split)}; got {sharding!r}")
    p, g, o = split[sharding]
    return {"parameters": param_bytes * numel / p, "gradients": grad_bytes * numel / g,
            "optimizer state": state_bytes * numel / o}


def sent_formula(sharding: str, numel: int, world_size: int,
                 grad_bytes: int = 4, param_bytes: int = 4) -> tuple[float, str]:
    """Bytes one rank sends per step by the ring formulas, and the formula as text.

    With ``n = world_size``, ``S = param_bytes * numel`` (the parameters) and
    ``G = grad_bytes * numel`` (the gradient, in the dtype it is reduced in): a ring
    all_reduce sends ``2 (n-1)/n`` of its tensor, reduce_scatter and all_gather
    ``(n-1)/n``. Per step: DDP all_reduces G; ZeRO-1 all_reduces G and all-gathers S;
    ZeRO-2 and notebook 08's ZeRO-3 (parameters gathered once, kept through backward)
    reduce-scatter G and all-gather S; FSDP2 by default gathers S twice (before forward,
    again before backward, ``reshard_after_forward=True``) and reduce-scatters G, the
    paper's 3Ψ for stage 3 (section 7.2.2 of arXiv:1910.02054).

    Returns:
        ``(bytes, text)``, e.g. ``(7230.0, "(n−1)/n·(S+G)")``.

    Raises:
        ValueError: an unknown sharding or a world size below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    f = (world_size - 1) / world_size
    S, G = param_bytes * numel, grad_bytes * numel
    table = {"DDP": (2 * f * G, "2(n−1)/n·G"), "ZeRO-1": (f * (2 * G + S), "(n−1)/n·(2G+S)"),
             "ZeRO-2": (f * (G + S), "(n−1)/n·(G+S)"), "ZeRO-3": (f * (G + S), "(n−1)/n·(G+S)"),
             "FSDP2": (f * (G + 2 * S), "(n−1)/n·(G+2S)")}
    if sharding not in table:
        raise ValueError(f"sharding must be one of {', '.join(table)}; got {sharding!r}")
    return table[sharding]


def _stacked(ax, x, parts: dict, styles: dict, width: float) -> np.ndarray:
    """Stack ``parts`` (``{name: heights}``) as bars at ``x``; return the tops."""
    bottom = np.zeros(len(x))
    for name, heights in parts.items():
        colour, hatch = styles[name]
        ax.bar(x, heights, width, bottom=bottom, color=colour, hatch=hatch,
               edgecolor=PALETTE["black"], linewidth=0.6, label=name)
        bottom = bottom + np.asarray(heights, dtype=float)
    return bottom


def memory_figure(measured: dict, numel: int, title: str = "") -> bytes:
    """Bytes per rank of parameters, gradients and optimizer state (stacked, hatched), for
    each sharding and world size, with the ZeRO paper's total (◆) on each bar.

    Args:
        measured: ``{sharding: {world_size: {kind: bytes}}}`` (rank 0's, measured from its
            tensors), shardings as in :func:`memory_formula`.
        numel: the model's number of parameters, for the formula.
        title: optional figure title.

    Returns:
        PNG bytes (9.6 x 3.6 in).
    """
    fig = new_figure(MAX_WIDTH, 3.6)
    ax = fig.subplots()
    shardings = list(measured)
    sizes = sorted({w for per in measured.values() for w in per})
    width, gap = 0.8, 1.0
    xs, labels, centres = [], [], []
    for i, s in enumerate(shardings):
        base = i * (len(sizes) + gap)
        xs.extend(base + j for j in range(len(sizes)))
        labels.extend(str(w) for w in sizes)
        centres.append(base + (len(sizes) - 1) / 2)
    x = np.array(xs, dtype=float)
    parts = {kind: [measured[s][w][kind] / 1000 for s in shardings for w in sizes] for kind in KINDS}
    tops = _stacked(ax, x, parts, KIND_STYLE, width)
    formula = [sum(memory_formula(s, numel, w).values()) / 1000 for s in shardings for w in sizes]
    ax.plot(x, formula, linestyle="none", marker="D", markersize=7, color=FORMULA_COLOUR,
            label="ZeRO paper's formula (total)")
    for xi, top in zip(x, tops):
        ax.text(xi, top + 0.6, f"{top:.1f}", ha="center", va="bottom", fontsize=MIN_FONT)
    ax.set_xticks(x, labels)
    for c, s in zip(centres, shardings):
        ax.text(c, -0.16, s, transform=ax.get_xaxis_transform(), ha="center", va="top",
                fontsize=11, fontweight="bold")
    ax.set_xlabel("world size, per sharding", labelpad=22)
    ax.set_ylabel("kB per rank")
    ax.set_ylim(0, max(tops) * 1.15)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=4, frameon=False,
              handlelength=1.4, columnspacing=1.2)
    ax.grid(True, axis="y", color=PANEL_GREY)
    ax.set_axisbelow(True)
    fig.suptitle(title or f"Memory each rank keeps between steps, Adam, {numel:,} float32 parameters")
    return png(fig)


def precision_figure(errors: dict, title: str = "") -> bytes:
    """Relative error of the gradient against the world size, one line per setting, each
    with its own colour, marker and line style and a label at its right end.

    Args:
        errors: ``{label: {world_size: relative error}}``, errors >= 0, shown on a linear
            axis in units of 10⁻³.
        title: optional figure title.

    Returns:
        PNG bytes (8.0 x 3.2 in).

    Raises:
        ValueError: empty ``errors`` or a negative error.
    """
    if not errors or any(e < 0 for per in errors.values() for e in per.values()):
        raise ValueError("errors needs at least one line, every error >= 0")
    fig = new_figure(8.0, 3.2)
    ax = fig.subplots()
    colours = [PALETTE["black"], PALETTE["blue"], PALETTE["vermillion"], PALETTE["green"]]
    styles = [":", "-", "--", "-."]
    sizes = sorted({w for per in errors.values() for w in per})
    ends = []
    for i, (label, per) in enumerate(errors.items()):
        ws = sorted(per)
        ys = [per[w] * 1000 for w in ws]
        ax.plot(ws, ys, color=colours[i % 4], linestyle=styles[i % 4], marker=MARKERS[i % 8],
                linewidth=2, markersize=7)
        ends.append([ys[-1], ws[-1], label])
    top = max(e[0] for e in ends)
    ax.set_ylim(-0.04 * top if top > 0 else 0, top * 1.25 if top > 0 else 1)
    gap = 0.09 * ax.get_ylim()[1]          # one 10 pt line on an axes about 2.4 in tall
    ends.sort()
    for a, b in zip(ends, ends[1:]):
        b[0] = max(b[0], a[0] + gap)
    for yv, x, label in ends:
        ax.annotate(label, (x, yv), xytext=(10, 0), textcoords="offset points", va="center",
                    fontsize=MIN_FONT, color=TEXT_GREY, annotation_clip=False)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(w) for w in sizes])
    ax.minorticks_off()
    ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("relative gradient error (10⁻³)")
    ax.grid(True, color=PANEL_GREY)
    fig.suptitle(title)
    return png(fig)


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def scaled_labels(values: np.ndarray) -> tuple[int, np.ndarray]:
    """Short labels for heatmap cells that share one scale: the values in units of
    ``10**e``, rounded to whole numbers, with ``e`` chosen so that the largest magnitude
    has two digits (``0.13`` and ``-0.09`` in units of 10⁻² are ``13`` and ``-9``).

    Every label has at most 3 characters (a minus sign and two digits), so it fits a
    heatmap cell at :data:`MIN_FONT` points where 3 characters fit; the panel says the
    unit once (``scale_text(e)``).

    Args:
        values: any shape, float; NaN for a cell with no value.

    Returns:
        ``(e, labels)``: the exponent, and an array of ``str`` of the shape of
        ``values`` (``""`` for NaN, ``"0"`` for values that round to zero).
    """
    values = np.asarray(values, dtype=float)
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    e = int(np.floor(np.log10(top))) - 1 if top > 0 else 0
    if top > 0 and round(top / 10.0 ** e) >= 100:          # 99.6 would round to 3 digits
        e += 1
    return e, scaled_labels_in(values, e)


def scaled_labels_in(values: np.ndarray, e: int) -> np.ndarray:
    """Labels of ``values`` in units of ``10**e`` (as :func:`scaled_labels`, with a
    given ``e``, so that two panels share a unit)."""
    values = np.asarray(values, dtype=float)
    labels = np.full(values.shape, "", dtype=object)
    for index, v in np.ndenumerate(values):
        if np.isfinite(v):
            labels[index] = str(int(round(v / 10.0 ** e)))   # an int has no "-0"
    return labels


def scale_text(e: int) -> str:
    """The unit of :func:`scaled_labels`' numbers, e.g. ``"×10⁻²"`` (``""`` for 10⁰)."""
    return "" if e == 0 else f"×10{str(e).translate(SUPERSCRIPT)}"


class ShardingFigure(BuiltFigures):
    """The explorer's figure, 9.6 x 4.5 in.

    Top row, one row per rank, ``columns`` evenly spaced elements of the flat parameter
    vector: the parameter values a rank holds before the step, the gradient it keeps
    after the reduction, and the parameters it holds after the step; a grey
    (:data:`NOT_HELD`) cell means the rank does not hold that element. Where 3 characters
    fit a cell (up to 7 ranks), each cell shows its value as a whole number in the unit
    its panel's title gives (``×10⁻²``; see :func:`scaled_labels`). Bottom row: the bytes
    each rank keeps (parameters, gradients, optimizer state, stacked and hatched; ◆ the
    ZeRO paper's total) and the bytes each rank sends in the step, by collective (dashed:
    the formula).

    The figure is built once per world size and its layout frozen; a redraw only updates
    the images, texts and bars (a widget redraw, several times faster than a new figure).

    With ``parameters`` (notebook 15), the columns are instead the first element of
    ``rows_per_parameter`` evenly spaced rows of each parameter, grouped under the
    parameter's name, with a black line at each boundary between parameters: so that a
    sharding per parameter (FSDP2's rows of every parameter on every rank) and one of the
    flat vector (ZeRO's blocks) can be told apart.

    Args:
        numel: length of the flat parameter vector.
        columns: how many of its elements the heatmaps show (evenly spaced).
        parameters: ``[(name, shape), ...]`` of the flat vector's parameters, in order, or
            ``None``: columns evenly spaced over the flat vector.
        rows_per_parameter: with ``parameters``, the rows sampled in each.
    """

    TITLES = ("parameters before the step", "gradient kept after reduction",
              "parameters after the step")

    def __init__(self, numel: int, columns: int = 8, parameters=None, rows_per_parameter: int = 4):
        self.numel = numel
        self.groups = []                         # (name, first column, last column + 1)
        if parameters is None:
            self.columns = np.unique(np.linspace(0, numel - 1, columns).round().astype(int))
        else:
            cols, offset = [], 0
            for name, shape in parameters:
                rows = int(shape[0])
                row_len = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                picked = np.unique(np.linspace(0, rows - 1, min(rows_per_parameter, rows)).round().astype(int))
                self.groups.append((name, len(cols), len(cols) + len(picked)))
                cols.extend(offset + int(r) * row_len for r in picked)
                offset += rows * row_len
            if offset != numel:
                raise ValueError(f"the parameters hold {offset} elements, not numel={numel}")
            self.columns = np.asarray(cols)
        self.fig = None
        self.world_size = None

    def _build(self, ws: int) -> None:
        cols = self.columns
        fig = new_figure(MAX_WIDTH, 4.5)
        top, bottom = fig.subfigures(2, 1, height_ratios=[1.0, 1.05] if ws <= 4 else [1.3, 1.0])
        self.heat_axes = top.subplots(1, 3, sharey=True)
        self.images, self.cell_texts, self.titles = [], [], []
        for ax, name in zip(self.heat_axes, self.TITLES):
            ax.set_facecolor(NOT_HELD)
            self.images.append(ax.imshow(np.zeros((ws, len(cols))), cmap=CMAP, aspect="auto"))
            self.titles.append(ax.set_title(f"{name}, ×10⁻⁸\n(1 of 8 rank holds all 8)",
                                            fontsize=MIN_FONT))
            if self.groups:                      # the parameter's name under its columns
                ax.set_xticks([(a + b - 1) / 2 for _, a, b in self.groups],
                              [name for name, _, _ in self.groups])
            else:
                ax.set_xticks(range(len(cols)), [str(c) for c in cols], rotation=90)
            ax.set_yticks(range(ws), [f"rank {r}" if ws <= 4 else str(r) for r in range(ws)])
            # white lines between the cells: two line collections, not a grid on minor
            # ticks (each tick is several artists; they were a third of building this)
            ax.vlines(np.arange(len(cols) + 1) - 0.5, -0.5, ws - 0.5, colors="white",
                      linewidth=2)
            ax.hlines(np.arange(ws + 1) - 0.5, -0.5, len(cols) - 0.5, colors="white",
                      linewidth=2)
            if self.groups:                      # black lines between the parameters
                ax.vlines([a - 0.5 for _, a, _ in self.groups[1:]], -0.5, ws - 0.5,
                          colors=PALETTE["black"], linewidth=2.5)
            ax.tick_params(length=0)
            self.cell_texts.append([[ax.text(j, i, "", ha="center", va="center", fontsize=MIN_FONT)
                                     for j in range(len(cols))] for i in range(ws)])
        if ws > 4:
            self.heat_axes[0].set_ylabel("rank")
        self.heat_axes[1].set_xlabel(
            f"the first element of {len(cols) // len(self.groups)} rows spread over each "
            f"parameter (grey: not held)" if self.groups else
            f"element of the flat parameter vector ({len(cols)} of {self.numel:,}; grey: not held)")
        self.suptitle = top.suptitle("DDP on 8 ranks, gradients reduced in bfloat16: one Adam step",
                                     fontsize=12)

        self.mem_ax, self.sent_ax = bottom.subplots(1, 2)
        x = np.arange(ws)
        width = 0.7 if ws > 1 else 0.45
        zeros = np.zeros(ws)
        self.mem_bars = {k: self.mem_ax.bar(x, zeros, width, color=KIND_STYLE[k][0],
                                            hatch=KIND_STYLE[k][1], edgecolor=PALETTE["black"],
                                            linewidth=0.6, label=k) for k in KINDS}
        (self.mem_formula,) = self.mem_ax.plot(x, zeros, linestyle="none", marker="D", markersize=7,
                                               color=FORMULA_COLOUR, label="ZeRO formula")
        self.sent_bars = {c: self.sent_ax.bar(x, zeros, width, color=COLLECTIVE_STYLE[c][0],
                                              hatch=COLLECTIVE_STYLE[c][1], edgecolor=PALETTE["black"],
                                              linewidth=0.6, label=c) for c in COLLECTIVES}
        self.sent_formula = self.sent_ax.axhline(0, color=FORMULA_COLOUR, linestyle="--", linewidth=1.4,
                                                 label="formula (n−1)/n·(2G+S)")
        self.bar_labels = {}
        for name, ax in (("mem", self.mem_ax), ("sent", self.sent_ax)):
            self.bar_labels[name] = [ax.annotate("", (xi, 0), xytext=(0, 5), textcoords="offset points",
                                                 ha="center", va="bottom", fontsize=MIN_FONT)
                                     for xi in x]
            ax.set_xticks(x, [f"rank {r}" if ws <= 4 else str(r) for r in range(ws)])
            ax.grid(True, axis="y", color=PANEL_GREY)
            ax.set_axisbelow(True)
            ax.set_xlim(-0.6, ws - 0.4)
            ax.set_ylim(0, 100)
        self.mem_ax.set_ylabel("kB kept per rank")
        self.sent_ax.set_ylabel("kB sent per rank")
        legend = dict(loc="lower left", bbox_to_anchor=(0, 1.0), ncols=2, frameon=False,
                      borderaxespad=0.2, handlelength=1.2, columnspacing=0.8)
        self.mem_ax.legend(**legend)
        self.sent_legend = self.sent_ax.legend(**legend)
        labels = [t.get_text() for t in self.sent_legend.get_texts()]
        self._sent_formula_handle = self.sent_legend.legend_handles[labels.index(self.sent_formula.get_label())]
        # world sizes 3-4 share a layout, and 5-8 do (tests/test_nb08 checks each against
        # its own); 1 and 2 have their own (their bar labels reach out differently)
        freeze_layout(fig, key=("sharding", self.numel, tuple(self.columns), bool(self.groups),
                                str(ws) if ws <= 2 else ("3-4" if ws <= 4 else "5-8")))
        # values only where the widest label, "-88", fits a cell with a margin
        probe = self.cell_texts[0][0][0]
        probe.set_text("-88")
        label = probe.get_window_extent(fig.canvas.get_renderer())
        probe.set_text("")
        cell = self.heat_axes[0].get_window_extent()
        self.write_values = (label.width <= 0.85 * cell.width / len(cols)
                             and label.height <= 0.9 * cell.height / ws)
        if not self.write_values:
            for texts in self.cell_texts:
                for t in (t for row in texts for t in row):
                    t.remove()
            self.cell_texts = [[] for _ in self.cell_texts]
        self.fig, self.world_size = fig, ws

    def preparation(self, world_size: int):
        """The callable that builds (or restores) the figure of ``world_size`` ranks, or
        ``None`` if it is current: an explorer runs it while the ranks compute
        (:meth:`reducelab.widgets.Explorer.preparation`)."""
        return self._preparation(world_size, lambda: self._build(world_size))

    def draw(self, before: np.ndarray, grad: np.ndarray, after: np.ndarray,
             memory: list[dict], sent: list[dict], memory_formula_total: float,
             sent_formula: float, sent_formula_text: str, title: str = "") -> bytes:
        """Draw one state and return PNG bytes.

        Args:
            before, grad, after: shape ``(world_size, numel)``, NaN where a rank holds
                nothing.
            memory: per rank, ``{kind: bytes}`` for :data:`KINDS`.
            sent: per rank, ``{collective: bytes}`` for :data:`COLLECTIVES`.
            memory_formula_total: bytes per rank by the ZeRO formula.
            sent_formula: bytes per rank per step by the formula; ``sent_formula_text``
                says which formula (the legend shows it).
            title: figure title.

        Raises:
            ValueError: the arrays and lists disagree on the world size.
        """
        ws = before.shape[0]
        if not (grad.shape[0] == after.shape[0] == len(memory) == len(sent) == ws):
            raise ValueError("before, grad, after, memory and sent need one entry per rank")
        build = self.preparation(ws)
        if build is not None:
            build()
        cols = self.columns
        params = np.concatenate([before[:, cols], after[:, cols]])
        finite = params[np.isfinite(params)]
        plo, phi = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 1.0)
        g = grad[:, cols]
        gfin = g[np.isfinite(g)]
        gmax = float(np.abs(gfin).max()) if gfin.size and np.abs(gfin).max() > 0 else 1.0
        panels = [(before[:, cols], plo, phi), (g, -gmax, gmax), (after[:, cols], plo, phi)]
        e_params, _ = scaled_labels(params)                  # one unit for before and after
        for k, (data, lo, hi) in enumerate(panels):
            hi = hi if hi > lo else lo + 1
            self.images[k].set_data(np.ma.masked_invalid(data))
            self.images[k].set_clim(lo, hi)
            e, labels = scaled_labels(data) if k == 1 else (e_params, scaled_labels_in(data, e_params))
            unit = f", {scale_text(e)}" if self.write_values and scale_text(e) else ""
            full_rows = int(np.isfinite(data).all(axis=1).sum())
            held = (f"every rank holds all {len(cols)}" if full_rows == ws else
                    f"{full_rows} of {ws} {'rank holds' if full_rows == 1 else 'ranks hold'} all {len(cols)}")
            self.titles[k].set_text(f"{self.TITLES[k]}{unit}\n({held})")
            mid = (lo + hi) / 2
            for i, row in enumerate(self.cell_texts[k]):
                for j, t in enumerate(row):
                    v = data[i, j]
                    t.set_text(labels[i, j])
                    t.set_color("black" if np.isfinite(v) and v > mid else "white")
        self.suptitle.set_text(title)

        for name, ax, bars, parts, extra in (
                ("mem", self.mem_ax, self.mem_bars, {k: [m[k] / 1000 for m in memory] for k in KINDS},
                 memory_formula_total / 1000),
                ("sent", self.sent_ax, self.sent_bars,
                 {c: [s.get(c, 0) / 1000 for s in sent] for c in COLLECTIVES}, sent_formula / 1000)):
            bottom = np.zeros(ws)
            for key, heights in parts.items():
                for rect, b, h in zip(bars[key], bottom, heights):
                    rect.set_y(b)
                    rect.set_height(h)
                bottom = bottom + np.asarray(heights)
            for t, xi, top in zip(self.bar_labels[name], range(ws), bottom):
                t.xy = (xi, max(top, extra) if name == "mem" else top)   # above the ◆
                t.set_text(f"{top:.1f}")
            ax.set_ylim(0, max(float(bottom.max()), extra, 1.0) * 1.25)
        self.mem_formula.set_ydata([memory_formula_total / 1000] * ws)
        self.sent_formula.set_ydata([sent_formula / 1000] * 2)
        handles = self.sent_legend.legend_handles
        self.sent_legend.get_texts()[handles.index(self._sent_formula_handle)].set_text(sent_formula_text)
        return png(self.fig)
