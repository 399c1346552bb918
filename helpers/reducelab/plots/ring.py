"""Figures of notebook 06: the ring all_reduce step by step, and the bytes it sends.

* :class:`RingStepsPlot` draws one step of the ring as a grid, ranks x chunks. Rank
  ``r``'s input is ``2 ** r``, so each cell's value says which ranks' inputs it holds
  (:func:`reducelab.checks.ring.contributors`); the colour is how many. The chunk each
  rank sends at that step is outlined in orange, the chunk it receives in blue.
* :func:`bytes_figure` plots the bytes each rank sent, measured on real ranks, against
  the formulas ``2 (N - 1) / N * S`` (ring) and ``(N - 1) * S`` (naive, and the root of
  reduce-then-broadcast).

Source: Patarasuk & Yuan (2009), J. Parallel Distrib. Comput. 69(2); Sergeev & Del Balso
(2018), arXiv:1802.05799.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Rectangle

from ..checks.ring import contributors, naive_bytes_per_rank, ring_bytes_per_rank
from . import new_figure, png

SENT_COLOUR = "#e07b00"
RECEIVED_COLOUR = "#1f5fbf"
MAX_WORLD_SIZE = 8


def cell_label(value: float, world_size: int) -> str:
    """Label of one chunk: the ranks whose inputs it holds, e.g. ``"0+1+3"``, or ``"all"``."""
    ranks = contributors(value, world_size)
    if len(ranks) == world_size and world_size > 2:
        return "all"
    return "+".join(map(str, ranks))


class RingStepsPlot:
    """One step of a ring all_reduce: a grid of ranks (rows) x chunks (columns).

    The figure persists and is rebuilt only when the world size changes, so moving the
    step slider redraws in well under 100 ms.
    """

    def __init__(self):
        self.fig = None
        self._n = None

    def _build(self, n: int) -> None:
        size = 0.62 * n
        self.fig = new_figure(max(2.6 + size, 5.2), 1.5 + size)
        ax = self.fig.add_subplot()
        cmap = ListedColormap(_ramp(n))
        norm = BoundaryNorm(np.arange(0.5, n + 1.5), cmap.N)
        self._image = ax.imshow(np.ones((n, n)), cmap=cmap, norm=norm, aspect="equal")
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
        ax.set_xticks(range(n), [f"{c}" for c in range(n)])
        ax.set_xlabel("chunk")
        ax.xaxis.set_label_position("top")
        ax.xaxis.tick_top()
        font = 9 if n <= 4 else 7 if n <= 6 else 6
        self._texts = [[ax.text(c, r, "", ha="center", va="center", fontsize=font)
                        for c in range(n)] for r in range(n)]
        self._sent = [ax.add_patch(Rectangle((0, 0), 0.9, 0.9, fill=False, lw=2.5,
                                             ec=SENT_COLOUR, visible=False)) for _ in range(n)]
        self._received = [ax.add_patch(Rectangle((0, 0), 0.78, 0.78, fill=False, lw=2,
                                                 ec=RECEIVED_COLOUR, ls="--", visible=False))
                          for _ in range(n)]
        cbar = self.fig.colorbar(self._image, ax=ax, ticks=range(1, n + 1), shrink=0.8)
        cbar.set_label("ranks summed in the chunk", fontsize=8)
        cbar.ax.tick_params(labelsize=7)
        self._ax, self._n = ax, n

    def draw(self, values: np.ndarray, sent=None, received=None, title: str = "") -> bytes:
        """Draw one step and return PNG bytes.

        Args:
            values: shape ``(world_size, world_size)``, ``values[r, c]`` the value of chunk
                ``c`` on rank ``r``: a sum of distinct ``2 ** rank``.
            sent, received: ``None`` (step 0) or a sequence of ``world_size`` chunk indices,
                the chunk rank ``r`` sent to rank ``r + 1`` / received from rank ``r - 1``.
            title: the figure title.

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
                t.set_color("white" if counts[r, c] == n else "black")
        for r in range(n):
            for patches, chunks, pad in ((self._sent, sent, 0.45), (self._received, received, 0.39)):
                if chunks is None:
                    patches[r].set_visible(False)
                else:
                    patches[r].set_xy((chunks[r] - pad, r - pad))
                    patches[r].set_visible(True)
        self.fig.suptitle(title, fontsize=10)
        return png(self.fig)


def _ramp(n: int) -> list:
    from matplotlib import colormaps
    cmap = colormaps["YlGnBu"]
    return [cmap(0.2 + 0.75 * k / max(n - 1, 1)) for k in range(n)]


def bytes_figure(rows: list[dict]) -> bytes:
    """Bytes sent per rank, divided by the tensor size ``S``, against ``world_size``.

    Args:
        rows: one dict per measurement with keys ``world_size`` (int), ``size_bytes``
            (``S``, int), and any of ``ring`` (mean bytes a rank sent in the ring),
            ``naive`` and ``root`` (bytes the busiest rank sent), all in bytes.

    Returns:
        PNG bytes: measured points (one marker per ``S``) over the formula lines.
    """
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    ns = np.arange(2, max(r["world_size"] for r in rows) + 1)
    ax.plot(ns, [ring_bytes_per_rank(int(n), 1.0) for n in ns], color="#1f5fbf",
            label="ring formula 2(N-1)/N")
    ax.plot(ns, [naive_bytes_per_rank(int(n), 1.0) for n in ns], color="#b3261e",
            label="naive / root formula N-1")
    sizes = sorted({r["size_bytes"] for r in rows})
    styles = {"ring": ("#1f5fbf", "ring", "os"), "naive": ("#b3261e", "naive", "x+"),
              "root": ("#e07b00", "root of reduce+broadcast", "^v")}
    for key, (colour, what, markers) in styles.items():
        for k, s in enumerate(sizes):
            pts = [(r["world_size"], r[key] / s) for r in rows if r["size_bytes"] == s and key in r]
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, ls="none", marker=markers[k % len(markers)], mfc="none",
                        mew=1.5, color=colour, ms=9 if key == "root" else 7,
                        label=f"measured {what}, S={_size(s)}")
    ax.set_xlabel("world_size N")
    ax.set_ylabel("bytes sent per rank / S")
    ax.set_xticks(ns)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("Bytes each rank sends for one all_reduce of S bytes", fontsize=10)
    return png(fig)


def _size(b: float) -> str:
    for unit, k in (("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b:g} B"
