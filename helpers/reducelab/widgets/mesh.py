"""The device-mesh explorer of notebook 05: pick a (dp, cp) mesh shape and a mesh dimension,
and see which ranks reduce together along it.

The notebook's rank function builds the mesh with ``init_device_mesh("cpu", (dp, cp),
mesh_dim_names=("dp", "cp"))`` on the group's gloo ranks, asks the sub-mesh for its
process group, and runs a real ``all_reduce(SUM)`` of the rank ids over that group. The
figure draws the ranks as a dp x cp grid; each process group is filled, outlined and
labelled with its ranks.

Source: ``torch.distributed.device_mesh``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh ;
the learner question is "Usage pattern for torch.distributed.all_reduce for gradient
synchronization within HuggingFace Transformers distributed training" (a knowledge-base
page, last updated 2025-12-18).
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..checks.mesh import run_and_release
from ..group import LocalGroup
from ..plots.mesh import MeshGrid
from . import Explorer

MESH_SHAPES = ((1, 4), (2, 2), (4, 1), (2, 4), (4, 2))
"""The (dp, cp) shapes the explorer offers; world_size = dp * cp."""
MESH_DIMS = ("dp", "cp")
"""The mesh dimensions an all_reduce can run along."""


def expected_groups(dp: int, cp: int, dim: str) -> list[list[int]]:
    """The process group of every rank along ``dim`` for a row-major (dp, cp) mesh.

    ``init_device_mesh`` lays ranks out as ``torch.arange(dp * cp).reshape(dp, cp)``: a
    ``cp`` group is a row (consecutive ranks), a ``dp`` group is a column (ranks ``cp``
    apart). Computed in one process, for tests and for checking the real groups.

    Returns:
        ``groups[rank]``, a sorted list of global ranks, for ``rank`` in ``0 .. dp*cp-1``.

    Raises:
        ValueError: ``dim`` is not ``"dp"`` or ``"cp"``, or a size is not a positive int.
    """
    if dim not in MESH_DIMS:
        raise ValueError(f"dim must be one of {', '.join(MESH_DIMS)}; got {dim!r}")
    if not all(isinstance(v, int) and v >= 1 for v in (dp, cp)):
        raise ValueError(f"dp and cp must be positive ints, got {dp!r}, {cp!r}")
    layout = np.arange(dp * cp).reshape(dp, cp)
    groups = []
    for rank in range(dp * cp):
        i, j = divmod(rank, cp)
        groups.append(sorted(layout[:, j].tolist() if dim == "dp" else layout[i, :].tolist()))
    return groups


@dataclass
class MeshResult:
    """What every rank reported for one mesh shape and dimension.

    Attributes:
        dp, cp: the mesh shape; world_size is ``dp * cp``.
        dim: the dimension reduced along, ``"dp"`` or ``"cp"``.
        coords: ``coords[rank] = (dp_index, cp_index)`` from ``mesh.get_coordinate()``.
        groups: ``groups[rank]``, the global ranks of that rank's process group along
            ``dim`` (``dist.get_process_group_ranks``).
        sums: ``sums[rank]``, the rank's value after ``all_reduce(SUM)`` of the rank ids
            over its group (an ``int``).
    """

    dp: int
    cp: int
    dim: str
    coords: list
    groups: list
    sums: list

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def sums_match(self) -> bool:
        """True when every rank's all_reduce sum equals the sum of its group's rank ids."""
        return all(s == sum(g) for s, g in zip(self.sums, self.groups))


class MeshExplorer(Explorer):
    """Widget: build a (dp, cp) mesh on real ranks and colour the ranks by process group.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on; choosing a shape whose
            ``dp * cp`` differs from its world_size resizes it.
        fn: the notebook's rank function, called on every rank as ``fn(dp, cp, dim)``. It
            must return a dict with ``"coord"`` (``(dp_index, cp_index)``), ``"ranks"``
            (list of the global ranks in the group along ``dim``) and ``"sum"`` (the
            rank's value after ``all_reduce(SUM)`` of rank ids over that group). The
            process groups it makes are destroyed after each call
            (:func:`reducelab.checks.mesh.run_and_release`).
        shape: initial ``(dp, cp)``, one of :data:`MESH_SHAPES`.
        dim: initial dimension, one of :data:`MESH_DIMS`.

    Raises:
        ValueError: an initial value outside the choices above.
    """

    def __init__(self, group: LocalGroup, fn, shape: tuple[int, int] = (2, 2), dim: str = "dp"):
        shape = tuple(shape)
        if shape not in MESH_SHAPES:
            raise ValueError(f"shape must be one of {', '.join(map(str, MESH_SHAPES))}; got {shape!r}")
        if dim not in MESH_DIMS:
            raise ValueError(f"dim must be one of {', '.join(MESH_DIMS)}; got {dim!r}")
        self.group, self.fn = group, fn
        self.plot = MeshGrid()
        options = [(f"dp={d} x cp={c}  ({d * c} ranks)", (d, c)) for d, c in MESH_SHAPES]
        wide = {"description_width": "initial"}  # labels in full, never "mesh (dp,…"
        super().__init__({
            "shape": W.Dropdown(options=options, value=shape, description="mesh (dp, cp)",
                                style=wide, layout=W.Layout(width="auto")),
            "dim": W.ToggleButtons(options=MESH_DIMS, value=dim, description="reduce along",
                                   style={**wide, "button_width": "4em"}),
        })
        self.refresh()

    def compute(self, shape, dim) -> MeshResult:
        dp, cp = shape
        self.group.resize(dp * cp)  # no-op when it already has that many ranks
        # the rank function builds a mesh each call; its process groups are destroyed
        # after it returns, so a learner can move the controls for as long as they like
        out = self.group.run(run_and_release, self.fn, dp, cp, dim)
        return MeshResult(dp, cp, dim, [tuple(o["coord"]) for o in out],
                          [sorted(int(r) for r in o["ranks"]) for o in out],
                          [int(o["sum"]) for o in out])

    def draw(self, result: MeshResult) -> bytes:
        n = len({tuple(g) for g in result.groups})
        size = len(result.groups[0])
        return self.plot.draw(result.coords, result.groups,
                              [f"sum = {s}" for s in result.sums], result.dim,
                              title=f'mesh["{result.dim}"]: {_count(n, "group")} of '
                                    f'{_count(size, "rank")}')

    def describe(self, result: MeshResult) -> str:
        distinct = sorted({tuple(g) for g in result.groups}, key=min)
        listed = " ".join(str(list(g)) for g in distinct)
        check = ("each rank's all_reduce(SUM) of rank ids equals its group's sum"
                 if result.sums_match else "an all_reduce sum does NOT match its group")
        return (f"{_count(len(distinct), result.dim + ' group')} of "
                f"{_count(len(distinct[0]), 'rank')} on {result.world_size} ranks: {listed}; "
                f"{check}.")


def _count(n: int, noun: str) -> str:
    """``_count(1, "rank")`` is ``"1 rank"``, ``_count(2, "rank")`` is ``"2 ranks"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
