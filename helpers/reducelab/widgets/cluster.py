"""The node-layout explorer of notebook 07: how torchrun numbers ranks across nodes.

Pick a number of nodes and processes per node; the explorer resizes the LocalGroup to
``world_size = nnodes * nproc_per_node`` and runs the notebook's rank function, which
numbers the ranks as torchrun does (``RANK = node_rank * nproc_per_node + LOCAL_RANK``),
makes one process group per node with ``dist.new_group`` and all-reduces within each
node and across all ranks. The figure shows each node's ranks and both sums.

Source: torchrun's environment variables, https://pytorch.org/docs/stable/elastic/run.html ;
``dist.new_group``, https://pytorch.org/docs/stable/distributed.html#groups
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
from ..group import LocalGroup
from ..plots.cluster import node_layout_figure
from . import Explorer

MAX_WORLD_SIZE = 8
"""The most ranks the explorer starts (a laptop's limit, not torchrun's)."""


@dataclass
class NodeLayout:
    """What every rank reported for one layout.

    Attributes:
        nnodes, nproc_per_node: the layout (ints).
        ranks: one dict per rank, in rank order, with int ``rank``, ``node_rank``,
            ``local_rank`` and float ``node_sum`` (all_reduce SUM of ``rank + 1``
            within the node) and ``world_sum`` (over every rank).
    """

    nnodes: int
    nproc_per_node: int
    ranks: list[dict]

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class NodeLayoutExplorer(Explorer):
    """Widget: simulated nodes on one LocalGroup, numbered and reduced as under torchrun.

    Args:
        group: the LocalGroup; it is resized to ``nnodes * nproc_per_node`` ranks.
        fn: the notebook's rank function, called on every rank as ``fn(nproc_per_node)``
            and returning the dict described in :class:`NodeLayout`.
        nnodes: initial number of nodes, 1 to 4.
        nproc_per_node: initial processes per node, 1 to 4; ``nnodes * nproc_per_node``
            must be at most :data:`MAX_WORLD_SIZE`.

    Raises:
        TypeError: ``fn`` is not callable. ValueError: a layout outside the ranges above.
    """

    def __init__(self, group: LocalGroup, fn, nnodes: int = 2, nproc_per_node: int = 2):
        if not callable(fn):
            raise TypeError(f"fn must be the rank function, got {fn!r}")
        for name, v in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
            if not isinstance(v, int) or not 1 <= v <= 4:
                raise ValueError(f"{name} must be an int from 1 to 4, got {v!r}")
        if nnodes * nproc_per_node > MAX_WORLD_SIZE:
            raise ValueError(f"nnodes * nproc_per_node must be at most {MAX_WORLD_SIZE}, "
                             f"got {nnodes} * {nproc_per_node}")
        self.group, self.fn = group, fn
        super().__init__({
            "nnodes": W.IntSlider(value=nnodes, min=1, max=4, description="--nnodes",
                                  continuous_update=False),
            "nproc_per_node": W.IntSlider(value=nproc_per_node, min=1,
                                          max=MAX_WORLD_SIZE // nnodes,
                                          description="--nproc-per-node",
                                          continuous_update=False,
                                          style={"description_width": "initial"}),
        })
        self.refresh()

    def _on_change(self, change) -> None:
        if getattr(self, "_clamping", False):
            return  # the nnodes change below refreshes once, for both values
        if change["owner"] is self.controls["nnodes"]:
            per = self.controls["nproc_per_node"]
            self._clamping = True
            try:
                per.max = min(4, MAX_WORLD_SIZE // change["new"])  # also clamps its value
            finally:
                self._clamping = False
        self.refresh()

    def compute(self, nnodes, nproc_per_node) -> NodeLayout:
        world_size = nnodes * nproc_per_node
        self.group.resize(world_size)  # no-op when it already has that many ranks
        return NodeLayout(nnodes, nproc_per_node, self.group.run(self.fn, nproc_per_node))

    def draw(self, layout: NodeLayout) -> bytes:
        return node_layout_figure(layout)

    def describe(self, layout: NodeLayout) -> str:
        node_sums = [layout.ranks[k * layout.nproc_per_node]["node_sum"] for k in range(layout.nnodes)]
        return (f"RANK = node_rank * {layout.nproc_per_node} + LOCAL_RANK for "
                f"{layout.world_size} ranks; all_reduce within each node gives "
                f"{', '.join(f'{s:g}' for s in node_sums)}; over all ranks "
                f"{layout.ranks[0]['world_sum']:g}.")
