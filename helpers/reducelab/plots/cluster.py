"""The node-layout figure of notebook 07 (how torchrun numbers ranks across nodes).

One row per node, one box per process: each box says the ``RANK`` and ``LOCAL_RANK``
torchrun gives that process, and each row ends with the node's all_reduce sum (of
``rank + 1``, the inputs of notebook 07's rank function). Each node
has a colour of the palette, and its name is written too, so the colour never says
anything alone.

Source: torchrun's environment variables, https://pytorch.org/docs/stable/elastic/run.html ;
the numbering ``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK`` is what
``SimpleElasticAgent._assign_worker_ranks`` (``torch/distributed/elastic/agent/server/api.py``) assigns for a static rendezvous with the
same ``--nproc-per-node`` on every node.
"""
from __future__ import annotations


from . import MIN_FONT, RANK_COLOURS, new_figure, png

CELL_WIDTH, ROW_HEIGHT = 1.6, 0.72
"""Inches per process box and per node row."""


def node_layout_figure(layout) -> bytes:
    """Nodes (rows) by local ranks (columns), each box labelled with the RANK and
    LOCAL_RANK torchrun would give, each node with its all_reduce sum; PNG bytes.

    ``layout`` is a :class:`reducelab.widgets.cluster.NodeLayout` (1 to 4 nodes of 1 to
    4 processes; each rank's input is ``rank + 1``). The figure is drawn at the size it
    is shown: 6.4 to 9.5 in wide, at most 4.2 in tall.
    """
    from matplotlib.patches import FancyBboxPatch
    n, p = layout.nnodes, layout.nproc_per_node
    left, right, top = 1.35, 1.75, 1.05
    grid = CELL_WIDTH * p
    width = max(6.4, left + grid + right)
    height = top + ROW_HEIGHT * n + 0.15
    fig = new_figure(width, height)
    fig.set_layout_engine("none")
    ax = fig.add_axes((left / width, 0.15 / height, (grid + right) / width,
                       ROW_HEIGHT * n / height))
    ax.set_xlim(-0.5, p - 0.5 + right / CELL_WIDTH)
    ax.set_ylim(n - 0.5, -0.5)
    ax.axis("off")
    for r in layout.ranks:
        node, local = r["node_rank"], r["local_rank"]
        colour = RANK_COLOURS[node % len(RANK_COLOURS)]
        ax.add_patch(FancyBboxPatch((local - 0.44, node - 0.4), 0.88, 0.8,
                                    boxstyle="round,pad=0,rounding_size=0.08",
                                    fc=colour, alpha=0.3, ec=colour, lw=1.5))
        ax.text(local, node - 0.13, f"RANK {r['rank']}", ha="center", va="center",
                fontsize=MIN_FONT + 2, weight="bold")
        ax.text(local, node + 0.2, f"LOCAL_RANK {r['local_rank']}", ha="center",
                va="center", fontsize=MIN_FONT)
    for k in range(n):
        members = [r for r in layout.ranks if r["node_rank"] == k]
        ax.text(-0.6, k, f"node {k}\nGROUP_RANK {k}", ha="right", va="center",
                fontsize=MIN_FONT)
        terms = " + ".join(str(r["rank"] + 1) for r in members)
        ax.text(p - 0.4, k, f"sum in node {k}:\n{terms} = {members[0]['node_sum']:g}",
                ha="left", va="center", fontsize=MIN_FONT)
    fig.text(0.02, 1 - 0.08 / height,
             f"--nnodes {n} --nproc-per-node {p}: WORLD_SIZE {n * p}\n"
             f"all_reduce of rank + 1 over all ranks: {layout.ranks[0]['world_sum']:g}",
             ha="left", va="top", fontsize=MIN_FONT + 2, linespacing=1.3)
    fig.text(0.02, 1 - 0.68 / height, "RANK = GROUP_RANK x nproc_per_node + LOCAL_RANK",
             ha="left", va="top", fontsize=MIN_FONT)
    return png(fig)
