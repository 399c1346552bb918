"""Plots of per-rank tensors, drawn to PNG bytes with matplotlib's Agg canvas.

Shared by every notebook. Notebooks whose figures need more than :class:`RankHeatmaps`
have a module here named for their topic (``plots/reduce.py`` for notebook 02, ...);
notebook 01 uses :class:`RankHeatmaps` itself.

Figures are made with ``matplotlib.figure.Figure`` directly, not ``pyplot``, so nothing
is displayed behind the learner's back and a widget can keep one figure and only update
it. A widget shows the bytes in an ``ipywidgets.Image``; a plain cell shows them with
:func:`show`.
"""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg", force=False)
import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

DPI = 80
"""Resolution of every figure, dots per inch; low enough that a redraw stays fast."""

CMAP = "viridis"


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches with an Agg canvas attached."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png(fig: Figure) -> bytes:
    """Render ``fig`` at its own dpi and return PNG bytes (RGB, no metadata).

    Draws the Agg canvas once and encodes its pixels with Pillow at low compression:
    about half the cost of ``savefig``, which matters when a widget redraws on every
    control change.
    """
    from PIL import Image
    canvas = fig.canvas
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3]
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="png", compress_level=1)
    return buf.getvalue()


def freeze_layout(fig: Figure) -> None:
    """Compute ``fig``'s constrained layout once, then keep it: later draws skip the
    layout engine (the costliest part of redrawing a persistent figure)."""
    fig.canvas.draw()
    fig.set_layout_engine("none")


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


class RankHeatmaps:
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
        width = min(2.0 + 1.0 * len(self.titles) * max(n, 3) * 0.55, 13)
        height = 0.9 + 0.42 * world_size
        self.fig = new_figure(width, height)
        axes = self.fig.subplots(1, len(self.titles), squeeze=False)[0]
        self._axes, self._images, self._texts = axes, [], []
        for ax, title in zip(axes, self.titles):
            im = ax.imshow(np.zeros((world_size, n)), cmap=CMAP, aspect="auto")
            ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
            ax.set_xticks(range(n) if n <= 16 else [])
            ax.set_xlabel("element")
            ax.set_title(title, fontsize=10)
            self._images.append(im)
            texts = []
            if world_size * n <= self.MAX_LABELS:
                texts = [[ax.text(j, i, "", ha="center", va="center", fontsize=8)
                          for j in range(n)] for i in range(world_size)]
            self._texts.append(texts)
        self._shape = (world_size, n)
        self._ylabels = None
        # reserve room for a title, two-line panel titles and "rank N (dst)" labels,
        # then freeze the layout
        self.fig.suptitle(" ", fontsize=11)
        for ax in axes:
            ax.set_title("before\nafter", fontsize=10)
            ax.set_yticks(range(world_size), [f"rank {r} (dst)" for r in range(world_size)])
        freeze_layout(self.fig)

    def draw(self, panels: list, subtitles: list[str] | None = None,
             title: str | None = None, highlight_rows: dict[int, str] | None = None) -> bytes:
        """Draw the panels and return PNG bytes.

        Args:
            panels: one array-like per title, each of shape ``(world_size, n)``; any
                numeric dtype. ``NaN`` cells are drawn grey (no value).
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
        if self._shape != (world_size, n):
            self._build(world_size, n)
        finite = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.zeros(1)
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if lo == hi:
            lo, hi = lo - 1, hi + 1
        for k, (a, im) in enumerate(zip(arrays, self._images)):
            im.set_data(np.ma.masked_invalid(a))
            im.set_clim(lo, hi)
            mid = (lo + hi) / 2
            for i, row in enumerate(self._texts[k]):
                for j, t in enumerate(row):
                    v = a[i, j]
                    t.set_text("" if not np.isfinite(v) else fmt_value(v))
                    t.set_color("black" if np.isfinite(v) and v > mid else "white")
            label = self.titles[k] + (f"\n{subtitles[k]}" if subtitles and subtitles[k] else "")
            self._axes[k].set_title(label, fontsize=10)
        labels = [f"rank {r}" + (f" ({highlight_rows[r]})" if highlight_rows and r in highlight_rows
                                 else "") for r in range(world_size)]
        if labels != self._ylabels:
            for ax in self._axes:
                ax.set_yticks(range(world_size), labels)
            self._ylabels = labels
        self.fig.suptitle(title or "", fontsize=11)
        return png(self.fig)
