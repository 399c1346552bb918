"""The node-layout explorer of notebook 07: how torchrun numbers ranks across nodes.

Pick a number of nodes and processes per node; the explorer resizes the LocalGroup to
``world_size = nnodes * nproc_per_node`` and runs the notebook's rank function, which
numbers the ranks as torchrun does (``RANK = node_rank * nproc_per_node + LOCAL_RANK``),
makes one process group per node with ``dist.new_group``, all-reduces within each
node and across all ranks, and destroys the node groups. The figure shows each node's
ranks and both sums.

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

    Both sliders keep their full range, 1 to 4. A layout of more than
    :data:`MAX_WORLD_SIZE` ranks is refused with a sentence that says so (and a note in
    place of the figure); nothing is changed behind the learner's back.
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
        self.refusal: str | None = None
        style = {"description_width": "initial"}
        super().__init__({
            "nnodes": W.IntSlider(value=nnodes, min=1, max=4, description="--nnodes",
                                  continuous_update=False, style=style),
            "nproc_per_node": W.IntSlider(value=nproc_per_node, min=1, max=4,
                                          description="--nproc-per-node",
                                          continuous_update=False, style=style),
        })
        self.refresh()

    @staticmethod
    def too_many(nnodes: int, nproc_per_node: int) -> str | None:
        """The sentence that refuses a layout of more than :data:`MAX_WORLD_SIZE` ranks,
        or ``None`` when the layout fits."""
        world_size = nnodes * nproc_per_node
        if world_size <= MAX_WORLD_SIZE:
            return None
        return (f"--nnodes {nnodes} --nproc-per-node {nproc_per_node} makes WORLD_SIZE "
                f"{world_size}; this explorer starts at most {MAX_WORLD_SIZE} ranks on one "
                f"machine (torchrun has no such limit). Lower --nnodes or --nproc-per-node.")

    def refresh(self) -> None:
        """Refuse a layout of more than :data:`MAX_WORLD_SIZE` ranks with one sentence,
        else run it on the ranks."""
        self.refusal = self.too_many(**self.values)
        if self.refusal is not None:
            self.result, self.error = None, None
            self._refuse(self.refusal)
            return
        super().refresh()

    def text(self) -> str:
        if self.refusal is not None:
            settings = ", ".join(f"{k}={v}" for k, v in self.values.items())
            return f"{type(self).__name__}({settings})\n{self.refusal}"
        return super().text()

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
