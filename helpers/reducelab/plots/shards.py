"""Figures of notebook 14 (clipping and checkpoints across shards), drawn to PNG bytes at
the size they are shown (at most ``MAX_WIDTH`` wide, text of ``MIN_FONT`` points or more,
colours from :mod:`reducelab.palette`, and every colour also said by a marker, a hatch or
a label).

* :func:`norm_figure`: each rank's local gradient norm at several world sizes, against
  the global norm and ``global / √n``.
* :class:`CheckpointFigure`: the explorer's figure: which rows of one parameter each
  saving rank wrote to its file, and which rows each loading rank reads from which file.
"""
from __future__ import annotations

import math


from ..palette import PANEL_GREY, TEXT_GREY
from . import HATCHES, MARKERS, MAX_WIDTH, MIN_FONT, PALETTE, RANK_COLOURS, kept_figure, new_figure, png

GLOBAL_COLOUR = PALETTE["black"]
"""Lines and markers that stand for the global norm."""


def norm_figure(local_norms: dict, global_norm: float, title: str = "") -> bytes:
    """Each rank's local gradient norm (the norm of the elements it holds) at each world
    size, one marker shape and colour per rank (named in the legend; a rank's marker sits a
    little right of the one before), the global norm as
    a solid line and ``global / √n`` dashed, each labelled at its right end.

    Args:
        local_norms: ``{world_size: [norm of rank 0, rank 1, ...]}``, norms >= 0 (any
            unit; the axis says "norm").
        global_norm: the norm of the whole gradient, > 0.
        title: optional figure title.

    Returns:
        PNG bytes (8.0 x 3.4 in).

    Raises:
        ValueError: empty ``local_norms``, a list whose length is not its world size, a
            negative norm, or a ``global_norm`` that is not positive.
    """
    if not local_norms or any(len(v) != w for w, v in local_norms.items()):
        raise ValueError("local_norms needs {world_size: one norm per rank}, at least one world size")
    if not global_norm > 0 or any(x < 0 for v in local_norms.values() for x in v):
        raise ValueError("norms must be >= 0 and global_norm > 0")
    sizes = sorted(local_norms)
    fig = new_figure(8.0, 3.4)
    ax = fig.subplots()
    ranks = max(sizes)
    for r in range(ranks):
        xs = [w for w in sizes if r < w]
        shifted = [w + 0.07 * (r - (w - 1) / 2) for w in xs]      # side by side, none hidden
        ax.plot(shifted, [local_norms[w][r] for w in xs], linestyle="none", marker=MARKERS[r % 8],
                markersize=8, color=RANK_COLOURS[r % 8], markeredgecolor=PALETTE["black"],
                markeredgewidth=0.6, label=f"rank {r}")
    lo, hi = min(sizes), max(sizes)
    ax.plot([lo - 0.2, hi + 0.2], [global_norm] * 2, color=GLOBAL_COLOUR, linewidth=2)
    grid = [lo + (hi - lo) * i / 60 for i in range(61)]
    ax.plot(grid, [global_norm / math.sqrt(w) for w in grid], color=GLOBAL_COLOUR, linewidth=1.5,
            linestyle="--")
    ax.text(hi + 0.3, global_norm, f"global norm {global_norm:.3g}\n(the whole gradient)",
            va="center", ha="left", fontsize=MIN_FONT)
    ax.text(hi + 0.3, global_norm / math.sqrt(hi), "global / √n", va="center", ha="left",
            fontsize=MIN_FONT)
    ax.set_xticks(sizes, [str(w) for w in sizes])
    ax.set_xlim(lo - 0.4, hi + 1.9)
    ax.set_ylim(0, global_norm * 1.2)
    ax.set_xlabel("world size n")
    ax.set_ylabel("norm of the gradient")
    ax.legend(loc="lower left", ncols=min(ranks, 4), frameon=True, handletextpad=0.3,
              columnspacing=1.0, title="each rank's local norm", title_fontsize=MIN_FONT)
    ax.grid(True, axis="y", color=PANEL_GREY)
    ax.set_axisbelow(True)
    fig.suptitle(title or "FSDP2: each rank's local gradient norm against the global norm")
    return png(fig)


def _span(start: int, count: int) -> str:
    return "no rows" if count == 0 else (f"row {start}" if count == 1 else f"rows {start}–{start + count - 1}")


class CheckpointFigure:
    """The explorer's figure: one parameter's rows (x axis), in two panels.

    * Top, **saved**: one bar per file, ``__r_0.distcp`` written by rank ``r``, over the
      rows that rank held and wrote, in rank ``r``'s colour and hatch, labelled with its
      rows (``rows 3–5``, or ``3–5`` or ``3`` where the bar is narrow); the file's size at
      the right.
    * Bottom, **loaded**: one row per loading rank; its rows split into the pieces it
      reads, each in the colour and hatch of the file it comes from and labelled with the
      file's rank (``from 1``, or ``1`` where the piece is narrow).

    A label goes inside its bar or not at all; colour and hatch name the file without it.
    """

    def draw(self, name: str, rows: int, saved: list, loaded: list, file_bytes: list,
             title: str = "") -> bytes:
        """Draw and return PNG bytes (9.6 in wide, 1.8 in plus 0.27 in per bar tall).

        Args:
            name: the parameter's name, e.g. ``"2.weight"``.
            rows: its number of rows (dim 0), > 0.
            saved: per saving rank ``r``, ``(first row, number of rows)`` it wrote to
                ``__r_0.distcp`` (``(r·c, 0)`` when it held none).
            loaded: per loading rank, ``[(first row, number of rows, saving rank of the
                file), ...]``, the pieces it reads, in order; ``[]`` when it holds none.
            file_bytes: per saving rank, the size of its file in bytes.
            title: optional figure title.

        Raises:
            ValueError: ``rows`` < 1, ``saved`` and ``file_bytes`` of different lengths, or a
                piece outside ``0 .. rows``.
        """
        import matplotlib
        if rows < 1 or len(saved) != len(file_bytes) or not saved or not loaded:
            raise ValueError("need rows >= 1, one (start, count) and one size per saving rank, "
                             "and at least one loading rank")
        pieces = [(s, c) for s, c in saved] + [(s, c) for per in loaded for s, c, _ in per]
        if any(s < 0 or c < 0 or s + c > rows for s, c in pieces):
            raise ValueError(f"every piece must lie within rows 0 .. {rows - 1}")
        n_save, n_load = len(saved), len(loaded)
        height = 1.8 + 0.27 * (n_save + n_load)
        margins = dict(left=1.3, right=0.7, top=0.64, bottom=0.55, gap=0.46)

        def make_axes(fig):       # fixed margins, in inches: a third less time than a constrained layout
            panels = height - margins["top"] - margins["bottom"] - margins["gap"]
            fig.subplots_adjust(left=margins["left"] / MAX_WIDTH, right=1 - margins["right"] / MAX_WIDTH,
                                top=1 - margins["top"] / height, bottom=margins["bottom"] / height,
                                hspace=margins["gap"] / (panels / 2))
            return fig.subplots(2, 1, sharex=True, height_ratios=[n_save + 0.6, n_load + 0.6])

        # kept per shape: making the two axes and their ticks anew was about half a redraw
        fig, (top, bottom) = kept_figure(("checkpoint explorer", n_save, n_load), MAX_WIDTH, height,
                                         make_axes, layout=False)
        step = 1 if rows <= 16 else (2 if rows <= 32 else max(1, rows // 16))

        width = MAX_WIDTH - margins["left"] - margins["right"]      # inches of the row axis

        def bar(ax, y, start, count, source, texts):
            colour, hatch = RANK_COLOURS[source % 8], HATCHES[source % 8]
            lines = PALETTE["black"] if colour != PALETTE["black"] else "white"   # hatch lines show
            ax.barh(y, count, left=start, height=0.72, color=colour, hatch=hatch, edgecolor=lines,
                    linewidth=0.6)
            room = count / rows * width                               # inches of this bar
            text = next((t for t in texts if 0.085 * len(t) + 0.12 <= room), None)
            if text:                                                  # the longest label that fits
                ax.text(start + count / 2, y, text, ha="center", va="center", fontsize=MIN_FONT,
                        color=PALETTE["black"], bbox=dict(boxstyle="round,pad=0.12", facecolor="white",
                                                          edgecolor="none", alpha=0.85))

        for r, ((start, count), size) in enumerate(zip(saved, file_bytes)):
            if count:
                bar(top, r, start, count, r, (_span(start, count), _span(start, count).split(" ")[-1], str(r)))
            else:
                top.text(0.1, r, "held no rows: its file has none", va="center", fontsize=MIN_FONT,
                         color=TEXT_GREY)
            top.text(1.005, r, f"{size / 1000:.1f} kB", transform=top.get_yaxis_transform(),
                     va="center", ha="left", fontsize=MIN_FONT)
        top.set_yticks(range(n_save), [f"__{r}_0.distcp" for r in range(n_save)])
        top.set_title(f"saved on {n_save} rank{'s' if n_save > 1 else ''}: the rows of {name} "
                      f"rank r wrote to its file __r_0.distcp", loc="left")
        for r, per in enumerate(loaded):
            for start, count, source in per:
                bar(bottom, r, start, count, source, (f"from {source}", str(source)))
            if not per:
                bottom.text(0.1, r, "holds no rows: reads nothing", va="center", fontsize=MIN_FONT,
                            color=TEXT_GREY)
        bottom.set_yticks(range(n_load), [f"rank {r}" for r in range(n_load)])
        bottom.set_title(f"loaded on {n_load} rank{'s' if n_load > 1 else ''}: the rows each rank "
                         f"holds, by the file it reads them from", loc="left")
        for ax, n in ((top, n_save), (bottom, n_load)):
            ax.set_ylim(n - 0.4, -0.6)
            ax.set_xlim(0, rows)
            # a line at each row's edge (row k spans k .. k + 1), under the bars: one
            # collection, drawn far faster than a minor tick and grid line per row
            ax.vlines(range(rows + 1), 0, 1, transform=ax.get_xaxis_transform(),
                      colors=PANEL_GREY, linewidth=matplotlib.rcParams["grid.linewidth"],
                      zorder=0.5)
        bottom.set_xticks([k + 0.5 for k in range(0, rows, step)], [str(k) for k in range(0, rows, step)])
        bottom.set_xlabel(f"row of {name} ({rows} rows; FSDP2 shards dim 0)")
        fig.suptitle(title or f"A DCP checkpoint of {name}, saved on {n_save} and loaded on {n_load} ranks")
        return png(fig)


__all__ = ["norm_figure", "CheckpointFigure", "GLOBAL_COLOUR"]
