"""Figures of notebook 05: a (dp, cp) device mesh coloured by process group, and a
timeline of compute and all_reduce on each rank.

Source: ``torch.distributed.device_mesh.init_device_mesh``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh ,
and ``all_reduce(..., async_op=True)``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the learner
question is seed 004 (``/work/shared/seeds/004_038b5ad5d55791f3.txt``).
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap

from . import new_figure, png

GROUP_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2",
                 "#edc948", "#9c755f")
"""One colour per process group, in the order of the group's lowest rank."""
_CMAP = ListedColormap(GROUP_COLOURS)


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
    """One panel: the ranks of a (dp, cp) mesh as a grid, coloured by process group.

    Rows are the ``dp`` index, columns the ``cp`` index; each cell says its global rank
    and a second line (for example the value the rank holds after an all_reduce over its
    group). The figure persists and is rebuilt only when the mesh shape changes. Used by
    :class:`reducelab.widgets.mesh.MeshExplorer`.
    """

    def __init__(self):
        self.fig = None
        self._shape = None

    def _build(self, dp: int, cp: int) -> None:
        self.fig = new_figure(1.6 + 1.05 * cp, 1.3 + 0.8 * dp)
        self.ax = self.fig.subplots()
        self.im = self.ax.imshow(np.zeros((dp, cp)), cmap=_CMAP, vmin=-0.5,
                                 vmax=len(GROUP_COLOURS) - 0.5, aspect="equal")
        self.ax.set_xticks(range(cp), [f"cp {j}" for j in range(cp)])
        self.ax.set_yticks(range(dp), [f"dp {i}" for i in range(dp)])
        self.ax.tick_params(length=0)
        for k in range(1, cp):
            self.ax.axvline(k - 0.5, color="white", linewidth=2)
        for k in range(1, dp):
            self.ax.axhline(k - 0.5, color="white", linewidth=2)
        self.texts = [[self.ax.text(j, i, "", ha="center", va="center", fontsize=9,
                                    color="white") for j in range(cp)] for i in range(dp)]
        self._shape = (dp, cp)

    def draw(self, grid, labels, title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            grid: ``int`` array-like of shape ``(dp, cp)``, the group number of each cell
                (from :func:`group_index`); at most :data:`GROUP_COLOURS` groups.
            labels: ``(dp, cp)`` nested list of strings written in the cells.
            title: optional figure title.

        Raises:
            ValueError: ``grid`` is not 2-D, ``labels`` has another shape, or there are
                more groups than colours.
        """
        grid = np.asarray(grid)
        if grid.ndim != 2:
            raise ValueError(f"grid must have shape (dp, cp), got {grid.shape}")
        if np.asarray(labels, dtype=object).shape != grid.shape:
            raise ValueError(f"labels must have the grid's shape {grid.shape}")
        if grid.max() >= len(GROUP_COLOURS):
            raise ValueError(f"at most {len(GROUP_COLOURS)} groups can be coloured, "
                             f"got {grid.max() + 1}")
        if self._shape != grid.shape:
            self._build(*grid.shape)
        self.im.set_data(grid)
        for i, row in enumerate(self.texts):
            for j, t in enumerate(row):
                t.set_text(labels[i][j])
        self.ax.set_title(title, fontsize=10)
        return png(self.fig)


LANE_COLOURS = {"compute": "#4e79a7", "all_reduce": "#f28e2b", "wait": "#bab0ac"}


def timeline_figure(runs: dict[str, list[list[tuple[str, float, float]]]], title: str = "") -> bytes:
    """Per-rank timelines of compute and all_reduce, one panel per variant.

    Args:
        runs: ``{variant: events}``, e.g. ``{"blocking": ..., "async_op=True": ...}``, where
            ``events[rank]`` is a list of ``(name, start, end)``; ``name`` is ``"compute"``,
            ``"wait"`` or starts with ``"all_reduce"``; ``start`` and ``end`` are seconds
            since the rank passed a barrier.
        title: optional figure title.

    Returns:
        PNG bytes. Each rank has one lane for compute (and waits) and one lane per
        all_reduce, so overlapping intervals stay visible. The x axis is in milliseconds.

    Raises:
        ValueError: ``runs`` is empty, or an event name is not one of the three kinds.
    """
    if not runs:
        raise ValueError("runs is empty; pass at least one variant")
    world_size = max(len(ev) for ev in runs.values())
    n_ar = max(sum(1 for e in rank if e[0].startswith("all_reduce"))
               for ev in runs.values() for rank in ev)
    lanes = 1 + n_ar
    fig = new_figure(10, 1.2 + 0.13 * world_size * (lanes + 0.6) * len(runs))
    axes = fig.subplots(len(runs), 1, squeeze=False, sharex=True)[:, 0]
    end = max(e[2] for ev in runs.values() for rank in ev for e in rank) * 1000
    for ax, (variant, events) in zip(axes, runs.items()):
        yticks, ylabels = [], []
        for r, rank_events in enumerate(events):
            base = r * (lanes + 0.6)
            yticks.append(base + (lanes - 1) / 2)
            ylabels.append(f"rank {r}")
            k = 0
            for name, s, e in rank_events:
                kind = "all_reduce" if name.startswith("all_reduce") else name
                if kind not in LANE_COLOURS:
                    raise ValueError(f"event name must be compute, wait or all_reduce..., got {name!r}")
                if kind == "all_reduce":
                    lane, k = 1 + k, k + 1
                else:
                    lane = 0
                ax.barh(base + lane, (e - s) * 1000, left=s * 1000, height=0.85,
                        color=LANE_COLOURS[kind], edgecolor="white", linewidth=0.5)
        ax.set_yticks(yticks, ylabels)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
        ax.set_title(variant, fontsize=10, loc="left")
    axes[-1].set_xlabel("milliseconds since the barrier")
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=c, label=k) for k, c in LANE_COLOURS.items()],
               loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    return png(fig)
