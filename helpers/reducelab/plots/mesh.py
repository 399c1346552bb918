"""Figures of notebook 05: a (dp, cp) device mesh with its process groups along one
dimension, and the cost of syncing the same gradients with more or fewer all_reduce calls.

* :class:`MeshGrid`: the ranks of a ``(dp, cp)`` mesh as a grid. Each process group is
  filled with one colour, outlined, and labelled with its ranks beside the grid, so the
  grouping reads without colour.
* :func:`sync_cost_figure`: wall time of syncing one fixed number of gradient elements
  against the number of tensors they are split into, for a per-tensor loop, the same
  loop with ``async_op=True``, one flat bucket, and the bucket's copies alone: medians
  with the spread of the repeats.

Source: ``torch.distributed.device_mesh.init_device_mesh``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh ;
gradient buckets: ``bucket_cap_mb`` of ``torch.nn.parallel.DistributedDataParallel``
(``torch/nn/parallel/distributed.py``) and Li et al., "PyTorch Distributed: Experiences
on Accelerating Data Parallel Training", VLDB 2020.
"""
from __future__ import annotations

import numpy as np

from ..palette import PANEL_GREY, TEXT_GREY
from . import MARKERS, MIN_FONT, PALETTE, RANK_COLOURS, new_figure, png

GROUP_COLOURS = tuple(RANK_COLOURS)
"""Fill of process group ``k`` (groups numbered by their lowest rank): ``GROUP_COLOURS[k]``,
from the project's palette; every group is also outlined and labelled with its ranks."""
OUTLINE = PALETTE["black"]
"""Colour of the outline around each process group and of the text in the cells."""
CELL_W, CELL_H = 1.15, 0.72
"""Size of one rank's cell, inches."""
MIN_WIDTH = 6.4
"""Narrowest figure, inches (640 px at ``DPI``): a 2 x 2 mesh still fills a projector's
width as the other notebooks' figures do, with its cells at their usual size."""


def group_index(coords: list[tuple[int, int]], groups: list[list[int]]) -> np.ndarray:
    """Number the distinct groups 0, 1, ... by their lowest rank and place them on the mesh.

    Args:
        coords: ``coords[rank] = (dp_index, cp_index)``, the rank's coordinate on the mesh.
        groups: ``groups[rank]`` = the global ranks in that rank's process group.

    Returns:
        ``int`` array of shape ``(dp, cp)``: the group number of the rank at each cell.

    Raises:
        ValueError: ``coords`` and ``groups`` have different lengths.
    """
    if len(coords) != len(groups):
        raise ValueError(f"need one coordinate and one group per rank; got {len(coords)} "
                         f"coordinates and {len(groups)} groups")
    dp = max(c[0] for c in coords) + 1
    cp = max(c[1] for c in coords) + 1
    order = sorted({tuple(g) for g in groups}, key=min)
    number = {g: i for i, g in enumerate(order)}
    grid = np.zeros((dp, cp), dtype=int)
    for (i, j), g in zip(coords, groups):
        grid[i, j] = number[tuple(g)]
    return grid


class MeshGrid:
    """The ranks of a ``(dp, cp)`` mesh as a grid, with the process groups along one
    dimension drawn on it (used by :class:`reducelab.widgets.mesh.MeshExplorer`).

    Rows are the ``dp`` index, columns the ``cp`` index (``init_device_mesh``'s row-major
    layout). Each cell says its global rank and a second line (the explorer writes the
    value that rank's ``all_reduce`` returned). Each group is filled with
    ``GROUP_COLOURS[k]``, outlined, and labelled beside the grid: under its column for
    ``dim="dp"``, right of its row for ``dim="cp"``. Figures are at most 4.4 in tall
    (4 rows) and at least 6.4 in wide, drawn at their shown size.
    """

    def __init__(self):
        self.fig = None

    def draw(self, coords: list[tuple[int, int]], groups: list[list[int]],
             lines: list[str], dim: str, title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            coords: ``coords[rank] = (dp_index, cp_index)``.
            groups: ``groups[rank]``, the sorted global ranks of that rank's group along
                ``dim``; every group is one full column (``dp``) or row (``cp``).
            lines: ``lines[rank]``, a short second line written in the rank's cell.
            dim: ``"dp"`` or ``"cp"``, the dimension the groups run along.
            title: optional figure title.

        Raises:
            ValueError: the lists differ in length, ``dim`` is not ``"dp"`` or ``"cp"``,
                there are more groups than :data:`GROUP_COLOURS`, or a group is not a
                full column (``dp``) or row (``cp``) of the grid.
        """
        from matplotlib.patches import FancyBboxPatch, Rectangle
        if not len(coords) == len(groups) == len(lines):
            raise ValueError(f"need one coordinate, group and line per rank; got "
                             f"{len(coords)}, {len(groups)} and {len(lines)}")
        if dim not in ("dp", "cp"):
            raise ValueError(f"dim must be 'dp' or 'cp', got {dim!r}")
        grid = group_index(coords, groups)
        dp, cp = grid.shape
        if grid.max() >= len(GROUP_COLOURS):
            raise ValueError(f"at most {len(GROUP_COLOURS)} groups can be drawn, "
                             f"got {grid.max() + 1}")
        where = {}
        for rank, (i, j) in enumerate(coords):
            where.setdefault(tuple(groups[rank]), []).append((i, j))
        for ranks, cells in where.items():
            rows, cols = {i for i, _ in cells}, {j for _, j in cells}
            full = len(cols) == 1 and len(rows) == dp if dim == "dp" else \
                len(rows) == 1 and len(cols) == cp
            if not full:
                raise ValueError(f"group {list(ranks)} is not a full {'column' if dim == 'dp' else 'row'} "
                                 f"of the ({dp}, {cp}) mesh")

        label_w = 2.1 if dim == "cp" else 0.3
        label_h = 0.75 if dim == "dp" else 0.1
        title_w = 0.11 * len(title) + 0.3   # a 12 pt title is about 0.11 in per character
        grid_w = 0.8 + CELL_W * cp + label_w
        width = max(grid_w, title_w, MIN_WIDTH)
        self.fig = fig = new_figure(width, 0.75 + CELL_H * dp + label_h,
                                    layout_key=("mesh", dp, cp, dim))
        ax = fig.subplots()
        pad = (width - grid_w) / CELL_W / 2  # cells keep their size; the grid stays centred
        ax.set_xlim(-0.5 - pad, cp - 0.5 + pad)
        ax.set_ylim(dp - 0.5, -0.5)
        ax.set_aspect("auto")
        ax.set_xticks(range(cp), [f"cp {j}" for j in range(cp)])
        ax.set_yticks(range(dp), [f"dp {i}" for i in range(dp)])
        ax.xaxis.tick_top()
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        for rank, (i, j) in enumerate(coords):
            k = int(grid[i, j])
            ax.add_patch(Rectangle((j - 0.46, i - 0.44), 0.92, 0.88, facecolor=GROUP_COLOURS[k],
                                   linewidth=0))
            ax.text(j, i, f"rank {rank}\n{lines[rank]}", ha="center", va="center",
                    fontsize=MIN_FONT, color=OUTLINE, linespacing=1.3,
                    bbox=dict(boxstyle="round,pad=0.25", facecolor=PANEL_GREY, linewidth=0))
        for ranks, cells in sorted(where.items(), key=lambda kv: min(kv[0])):
            rows = [i for i, _ in cells]
            cols = [j for _, j in cells]
            r0, r1, c0, c1 = min(rows), max(rows), min(cols), max(cols)
            ax.add_patch(FancyBboxPatch((c0 - 0.48, r0 - 0.46), c1 - c0 + 0.96, r1 - r0 + 0.92,
                                        boxstyle="round,pad=0,rounding_size=0.08",
                                        facecolor="none", edgecolor=OUTLINE, linewidth=2))
            members = ", ".join(map(str, ranks))
            if dim == "dp":
                name = f"dp group\n[{members}]"
                ax.text(c0, r1 + 0.55, name, ha="center", va="top", fontsize=MIN_FONT,
                        color=TEXT_GREY, clip_on=False)
            else:
                ax.text(c1 + 0.56, r0, f"cp group [{members}]", ha="left", va="center", fontsize=MIN_FONT,
                        color=TEXT_GREY, clip_on=False)
        fig.suptitle(title)
        return png(fig)


SYNC_STYLES = {
    "blocking": (PALETTE["vermillion"], MARKERS[0], "-", "one all_reduce per tensor"),
    "async": (PALETTE["orange"], MARKERS[1], "--", "per tensor, async_op=True"),
    "bucket": (PALETTE["blue"], MARKERS[2], "-", "one flat bucket"),
    "copies": (PALETTE["green"], MARKERS[3], ":", "the bucket's copies alone"),
}
"""Colour, marker, line style and label of each way to sync in :func:`sync_cost_figure`
(``"copies"``: the bucket's copy in and copy out, timed without the all_reduce)."""


def sync_cost_figure(seconds: dict[str, dict[int, "float | list[float]"]], numel: int,
                     world_size: int, title: str = "") -> bytes:
    """Wall time to sync ``numel`` gradient elements against the number of tensors they
    are split into, one line per way to sync, log-log; return PNG bytes.

    Args:
        seconds: ``{way: {n_tensors: seconds}}``; ``way`` is a key of
            :data:`SYNC_STYLES` (``"blocking"``, ``"async"``, ``"bucket"``,
            ``"copies"``), and ``seconds`` is one time or a list of repeats (for
            example the slowest rank of each repeat). The line joins the medians; a bar
            spans the fastest to the slowest repeat.
        numel: total gradient elements (float32) synced each time, for the axis label.
        world_size: ranks that took part, for the title.
        title: optional figure title; a default names ``world_size``.

    Each line is labelled at its right end (no legend to match colours against), and
    each way has its own marker and line style.

    Raises:
        ValueError: ``seconds`` is empty, names an unknown way, or holds a time <= 0 or
            an empty list of repeats.
    """
    if not seconds:
        raise ValueError("seconds is empty; pass at least one way to sync")
    unknown = set(seconds) - set(SYNC_STYLES)
    if unknown:
        raise ValueError(f"unknown way(s) {sorted(unknown)}; use {', '.join(SYNC_STYLES)}")
    runs = {way: {n: np.atleast_1d(np.asarray(t, dtype=float)) for n, t in times.items()}
            for way, times in seconds.items()}
    if any(r.size == 0 for times in runs.values() for r in times.values()):
        raise ValueError("every entry needs at least one time (a list of repeats may not be empty)")
    if any((r <= 0).any() for times in runs.values() for r in times.values()):
        raise ValueError("every time must be > 0 seconds (the axes are logarithmic)")
    repeats = max(r.size for times in runs.values() for r in times.values())
    fig = new_figure(8.6, 3.9)
    ax = fig.subplots()
    counts = sorted({n for times in runs.values() for n in times})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ends = []
    for way, times in runs.items():
        colour, marker, style, label = SYNC_STYLES[way]
        xs = sorted(times)
        ms = [times[n] * 1000 for n in xs]
        mid = np.array([np.median(m) for m in ms])
        low = mid - np.array([m.min() for m in ms])
        high = np.array([m.max() for m in ms]) - mid
        ax.errorbar(xs, mid, yerr=[low, high], color=colour, marker=marker, linestyle=style,
                    linewidth=2, markersize=7, capsize=4, elinewidth=1.5)
        ends.append([np.log10(mid[-1]), xs[-1], label])
    # label each line at its right end; nudge labels apart (in log10 units) so none overlap
    ends.sort()
    lo, hi = np.log10(ax.get_ylim())
    gap = 0.08 * (hi - lo)          # a 10 pt line of text on an axes about 2.9 in tall
    for a, b in zip(ends, ends[1:]):
        b[0] = max(b[0], a[0] + gap)
    for y, x, label in ends:
        ax.annotate(label, (x * 1.12, 10 ** y), va="center", ha="left", fontsize=MIN_FONT,
                    color=OUTLINE, annotation_clip=False)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.minorticks_off()
    ax.set_xlim(counts[0] / 1.4, counts[-1] * 1.4)
    ax.set_xlabel(f"number of gradient tensors holding the same {numel:,} float32 elements")
    spread = f"; bar: fastest to slowest of {repeats}" if repeats > 1 else ""
    ax.set_ylabel(f"ms per sync, slowest rank\n(marker: median{spread})")
    ax.grid(True, which="major", color=PANEL_GREY)
    fig.suptitle(title or f"{world_size} ranks: the same gradients, synced in more or fewer calls")
    return png(fig)
