"""Figures of notebook 06: the ring all_reduce step by step, and the bytes it sends.

* :class:`RingStepsPlot` draws one step of the ring as a grid, ranks x chunks. Rank
  ``r``'s input is ``2 ** r``, so each cell's value says which ranks' inputs it holds
  (:func:`reducelab.checks.ring.contributors`); the label names them and the colour
  (:data:`~reducelab.plots.CMAP`) says how many. The chunk each rank sends at that step
  has a solid outline, the chunk it receives a dashed one (black over white, which reads on
  every colour of the map).
* :func:`bytes_figure` plots the bytes each rank sent, measured on real ranks, against
  the formulas ``2 (N - 1) / N * S`` (ring) and ``(N - 1) * S`` (naive, and the root of
  reduce-then-broadcast).

Sources: P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters
of workstations", J. Parallel Distrib. Comput. 69(2), 117-124, 2009; A. Sergeev and
M. Del Balso, "Horovod: fast and easy distributed deep learning in TensorFlow", 2018,
arXiv:1802.05799.
"""
from __future__ import annotations

import numpy as np

from ..checks.ring import contributors, naive_bytes_per_rank, ring_bytes_per_rank
from . import CMAP, MARKERS, MAX_WIDTH, MIN_FONT, NEUTRAL, PALETTE, new_figure, png

SENT_COLOUR = PALETTE["vermillion"]
"""Outline of the chunk a rank sends at a step (solid)."""
RECEIVED_COLOUR = PALETTE["black"]
"""Outline of the chunk a rank receives at a step (dashed, over a white line)."""
MAX_WORLD_SIZE = 8
MAX_PLUS_LABEL = 3
"""Up to this many ranks a label lists them (``"0+1+3"``); more are a range (``"5→1"``)."""


def cell_label(value: float, world_size: int) -> str:
    """Label of one chunk: the ranks whose inputs it holds.

    ``"all"`` for every rank (from 3 ranks up), ``"0+1+3"`` for up to
    :data:`MAX_PLUS_LABEL` ranks, ``"5→1"`` for a longer run of ranks around the ring
    (5, 6, 7, 0, 1: what a ring's partial sums always are), else ``"5 ranks"``. At most
    7 characters, so a label fits its cell at 8 ranks.
    """
    ranks = contributors(value, world_size)
    if len(ranks) == world_size and world_size > 2:
        return "all"
    if len(ranks) <= MAX_PLUS_LABEL:
        return "+".join(map(str, ranks))
    run = cyclic_run(ranks, world_size)
    return f"{run[0]}→{run[1]}" if run else f"{len(ranks)} ranks"


def cyclic_run(ranks: list[int], world_size: int) -> tuple[int, int] | None:
    """``(first, last)`` when ``ranks`` are ``first, first + 1, ..., last`` modulo
    ``world_size`` (a run around the ring), else ``None``."""
    held = set(ranks)
    if not held or len(held) == world_size:
        return None
    starts = [r for r in held if (r - 1) % world_size not in held]
    if len(starts) != 1:
        return None
    first = starts[0]
    return first, (first + len(held) - 1) % world_size


def _halo(width: float) -> list:
    from matplotlib import patheffects
    return [patheffects.withStroke(linewidth=width + 1.5, foreground="white")]


class RingStepsPlot:
    """One step of a ring all_reduce: a grid of ranks (rows) x chunks (columns).

    Drawn at the size it is shown: 5.5 in wide at 2 ranks, 9.6 in (the notebook's
    width) at 6 or more, and at most 4.4 in tall, so the explorer's controls and figure fit on
    one screen. The figure persists and is rebuilt only when the world size changes,
    so moving the step slider only redraws.
    """

    LEFT, RIGHT_PANEL, TOP, BOTTOM = 0.95, 2.45, 0.95, 0.2  # inches around the grid
    PANEL_HEIGHT = 2.3  # inches the right panel (legend and label help) needs

    def __init__(self):
        self.fig = None
        self._n = None

    def _build(self, n: int) -> None:
        from matplotlib import colormaps
        from matplotlib.colors import BoundaryNorm, ListedColormap
        from matplotlib.lines import Line2D
        from matplotlib.patches import Rectangle
        cell_w = min(1.05, (MAX_WIDTH - self.LEFT - self.RIGHT_PANEL) / n)
        cell_h = min(0.5, 3.1 / n)
        width = self.LEFT + n * cell_w + self.RIGHT_PANEL
        grid_h = n * cell_h
        body = max(grid_h, self.PANEL_HEIGHT)  # the right panel needs its height too
        height = self.TOP + body + self.BOTTOM + 0.15
        fig = new_figure(width, height)
        fig.set_layout_engine("none")
        ax = fig.add_axes((self.LEFT / width, (self.BOTTOM + 0.15 + body - grid_h) / height,
                           n * cell_w / width, grid_h / height))
        ramp = colormaps[CMAP]
        cmap = ListedColormap([ramp(0.15 + 0.85 * k / max(n - 1, 1)) for k in range(n)])
        norm = BoundaryNorm(np.arange(0.5, n + 1.5), cmap.N)
        self._image = ax.imshow(np.ones((n, n)), cmap=cmap, norm=norm, aspect="auto")
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
        ax.set_xticks(range(n), [f"chunk {c}" if n <= 4 else f"{c}" for c in range(n)])
        if n > 4:
            ax.set_xlabel("chunk", labelpad=2)
            ax.xaxis.set_label_position("top")
        ax.xaxis.tick_top()
        ax.tick_params(length=0)
        self._texts = [[ax.text(c, r, "", ha="center", va="center", fontsize=MIN_FONT)
                        for c in range(n)] for r in range(n)]
        self._sent = [ax.add_patch(Rectangle((0, 0), 0.92, 0.9, fill=False, lw=3,
                                             ec=SENT_COLOUR, visible=False,
                                             path_effects=_halo(3)))
                      for _ in range(n)]
        # received: black dashes over a white line, readable on every colour of the map
        self._received = [(ax.add_patch(Rectangle((0, 0), 0.76, 0.72, fill=False, lw=3,
                                                  ec="white", visible=False)),
                           ax.add_patch(Rectangle((0, 0), 0.76, 0.72, fill=False, lw=3,
                                                  ls=(0, (2, 1.5)), ec=RECEIVED_COLOUR,
                                                  visible=False)))
                          for _ in range(n)]
        # the right panel: what the outlines, the labels and the colours say
        x0 = (self.LEFT + n * cell_w + 0.25) / width
        handles = [Line2D([], [], color=SENT_COLOUR, lw=3, label="sent to rank r + 1"),
                   (Line2D([], [], color="white", lw=3),
                    Line2D([], [], color=RECEIVED_COLOUR, lw=3, ls=(0, (2, 1.5)))),]
        labels = ["sent to rank r + 1", "received from\nrank r - 1"]
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(x0, 1 - 0.9 / height),
                   frameon=False, handlelength=2.2, borderaxespad=0)
        label_help = "a cell names the ranks\nwhose inputs it holds:\n0+1: ranks 0 and 1\n"
        if n > MAX_PLUS_LABEL + 1:  # runs of more than MAX_PLUS_LABEL ranks can occur
            label_help += f"{n - 2}→1: ranks {n - 2}, {n - 1}, 0, 1\n"
        label_help += "all: every rank"
        fig.text(x0, (self.BOTTOM + 0.15) / height, label_help, ha="left", va="bottom",
                 fontsize=MIN_FONT, linespacing=1.35)
        self._title = fig.suptitle("", x=0.02, ha="left", y=1 - 0.08 / height, va="top")
        self._cell_w, self._cell_h = cell_w, cell_h
        self.fig, self._ax, self._n = fig, ax, n

    def draw(self, values: np.ndarray, sent=None, received=None, title: str = "") -> bytes:
        """Draw one step and return PNG bytes.

        Args:
            values: shape ``(world_size, world_size)``, ``values[r, c]`` the value of chunk
                ``c`` on rank ``r``: a sum of distinct ``2 ** rank``.
            sent, received: ``None`` (step 0) or a sequence of ``world_size`` chunk indices,
                the chunk rank ``r`` sent to rank ``r + 1`` / received from rank ``r - 1``.
            title: the figure title (one or two lines).

        Raises:
            ValueError: ``values`` is not square, or ``world_size`` is not in 2..8.
        """
        values = np.asarray(values, dtype=float)
        n = values.shape[0]
        if values.ndim != 2 or values.shape != (n, n) or not 2 <= n <= MAX_WORLD_SIZE:
            raise ValueError(f"values must have shape (world_size, world_size) with world_size "
                             f"in 2..{MAX_WORLD_SIZE}, got {values.shape}")
        if self._n != n:
            self._build(n)
        counts = np.array([[len(contributors(v, n)) for v in row] for row in values])
        self._image.set_data(counts)
        for r in range(n):
            for c in range(n):
                t = self._texts[r][c]
                t.set_text(cell_label(values[r, c], n))
                # viridis: dark for few ranks (white text), light for many (black text)
                t.set_color("black" if counts[r, c] > (n + 1) / 2 else "white")
        for patches, chunks in ((self._sent, sent), (self._received, received)):
            for r, patch in enumerate(patches):
                for p in (patch if isinstance(patch, tuple) else (patch,)):
                    if chunks is None:
                        p.set_visible(False)
                    else:
                        w, h = p.get_width(), p.get_height()
                        p.set_xy((chunks[r] - w / 2, r - h / 2))
                        p.set_visible(True)
        self._title.set_text(title)
        return png(self.fig)


def bytes_figure(rows: list[dict]) -> bytes:
    """Bytes sent per rank, divided by the tensor size ``S``, against ``world_size``.

    Args:
        rows: one dict per measurement with keys ``world_size`` (int), ``size_bytes``
            (``S``, int), and any of ``ring`` (mean bytes a rank sent in the ring),
            ``naive`` and ``root`` (bytes the busiest rank sent), all in bytes.

    Returns:
        PNG bytes, 9.6 x 4 in: measured points (a marker per algorithm, filled for the
        smaller ``S`` and hollow for the larger) over the formula lines, which are
        labelled where they end.
    """
    fig = new_figure(MAX_WIDTH, 4.0)
    ax = fig.add_subplot()
    ns = np.arange(2, max(r["world_size"] for r in rows) + 1)
    ring_line = [ring_bytes_per_rank(int(n), 1.0) for n in ns]
    naive_line = [naive_bytes_per_rank(int(n), 1.0) for n in ns]
    ax.plot(ns, ring_line, color=PALETTE["blue"], lw=1.5, zorder=1)
    ax.plot(ns, naive_line, color=PALETTE["vermillion"], lw=1.5, ls="--", zorder=1)
    ax.annotate("ring formula:\n2 (N - 1) / N", (ns[-1], ring_line[-1]), xytext=(14, 0),
                textcoords="offset points", va="center", color=PALETTE["blue"])
    ax.annotate("naive and root\nformula: N - 1", (ns[-1], naive_line[-1]), xytext=(14, 0),
                textcoords="offset points", va="center", color=PALETTE["vermillion"])
    sizes = sorted({r["size_bytes"] for r in rows})
    styles = {"ring": (PALETTE["blue"], "ring (mean over ranks)", MARKERS[0]),
              "naive": (PALETTE["vermillion"], "naive (every rank)", MARKERS[1]),
              "root": (PALETTE["orange"], "root of reduce + broadcast", MARKERS[2])}
    for key, (colour, what, marker) in styles.items():
        for k, s in enumerate(sizes):
            pts = [(r["world_size"], r[key] / s) for r in rows if r["size_bytes"] == s and key in r]
            if pts:
                x, y = zip(*pts)
                filled = k == 0
                ax.plot(x, y, ls="none", marker=marker, color=colour, mew=1.5,
                        ms=11 if filled else 7, mfc=colour if filled else "white",
                        label=f"{what}, S = {_size(s)}", zorder=2 if filled else 3)
    ax.set_xlabel("world_size N")
    ax.set_ylabel("bytes sent per rank / S")
    ax.set_xticks(ns)
    ax.set_xlim(ns[0] - 0.3, ns[-1] + 0.3 + 0.2 * len(ns))  # room for the line labels
    ax.set_ylim(0, max(naive_line) * 1.08)
    ax.grid(color=NEUTRAL, alpha=0.5, lw=0.8)
    ax.legend(loc="upper left", title="measured on the ranks", alignment="left")
    ax.set_title("Bytes each rank sends for one all_reduce of S bytes")
    return png(fig)


def _size(b: float) -> str:
    for unit, k in (("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b:g} B"
