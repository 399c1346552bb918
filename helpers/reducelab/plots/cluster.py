"""The node-layout figure of notebook 07 (how torchrun numbers ranks across nodes).

Source: https://pytorch.org/docs/stable/elastic/run.html (RANK, LOCAL_RANK, WORLD_SIZE).
"""
from __future__ import annotations

import numpy as np

from . import new_figure, png


def node_layout_figure(layout) -> bytes:
    """Nodes (rows) by local ranks (columns), each cell labelled with the RANK and
    LOCAL_RANK torchrun would give, each node with its all_reduce sum; PNG bytes.

    ``layout`` is a :class:`reducelab.widgets.cluster.NodeLayout`.
    """
    n, p = layout.nnodes, layout.nproc_per_node
    fig = new_figure(1.6 + 1.55 * p, 0.9 + 0.75 * n)
    ax = fig.add_subplot()
    grid = np.array([[r["node_rank"] for r in layout.ranks]]).reshape(n, p)
    ax.imshow(grid, cmap="Pastel1", vmin=0, vmax=8, aspect="auto")
    for r in layout.ranks:
        ax.text(r["local_rank"], r["node_rank"],
                f"RANK {r['rank']}\nLOCAL_RANK {r['local_rank']}",
                ha="center", va="center", fontsize=8)
    ax.set_yticks(range(n), [f"node {k}\nsum {layout.ranks[k * p]['node_sum']:g}"
                             for k in range(n)])
    ax.set_xticks(range(p), [f"local {j}" for j in range(p)])
    ax.set_title(f"--nnodes {n} --nproc-per-node {p}: WORLD_SIZE {n * p}\n"
                 f"all_reduce over all ranks: {layout.ranks[0]['world_sum']:g}", fontsize=9)
    return png(fig)
