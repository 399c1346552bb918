"""Figures of notebook 17 (which random numbers should match across ranks).

* :func:`patchwork_figure`: the weight ``full_tensor()`` gives after FSDP2's
  ``fully_shard`` on ranks that each drew their own initial weights, row block by row
  block, beside rank 0's own initial weight: each block says whose initialisation it is.
* :class:`MaskAgreement`: every rank's dropout mask on a ``(dp, tp)`` mesh (the
  explorer's figure), with each distinct mask named by a letter, a colour and a hatch, so
  that ranks that drew the same mask read as such without colour.

Sources: ``_init_sharded_param`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``
(torch 2.13: each rank keeps chunk ``rank`` of its own parameter, no broadcast);
Megatron-LM's two random streams (Shoeybi et al., 2019, arXiv:1909.08053, appendix B.2).
"""
from __future__ import annotations

import string

import numpy as np

from . import HATCHES, MIN_FONT, NEUTRAL, PALETTE, RANK_COLOURS, new_figure, png

DROPPED = PALETTE["black"]
"""Fill of a dropped unit (with the hatch ``"xx"``); a kept unit is white."""
UNITS_SHOWN = 16
"""Units per mask in the explorer's figure."""


def mask_names(dropped: np.ndarray) -> list[str]:
    """Name each distinct row of ``dropped`` (bool, shape ``(ranks, units)``) by a letter,
    in order of first appearance: ``["A", "A", "B", "B"]`` for two tp groups of two ranks
    that each share a mask. Ranks with the same letter drew exactly the same mask.

    Raises:
        ValueError: ``dropped`` is not two-dimensional, or has more than 26 rows.
    """
    a = np.asarray(dropped, dtype=bool)
    if a.ndim != 2:
        raise ValueError(f"dropped must be (ranks, units), got shape {a.shape}")
    if len(a) > 26:
        raise ValueError(f"at most 26 ranks can be named, got {len(a)}")
    seen: dict[bytes, str] = {}
    names = []
    for row in a:
        key = row.tobytes()
        if key not in seen:
            seen[key] = string.ascii_uppercase[len(seen)]
        names.append(seen[key])
    return names


def source_rows(full: np.ndarray, inits: np.ndarray) -> list[int | None]:
    """For each row of ``full`` (shape ``(rows, cols)``), the first rank whose own initial
    weight (``inits[rank]``, the same shape) has exactly that row, or ``None``.

    Raises:
        ValueError: shapes that do not match.
    """
    full, inits = np.asarray(full), np.asarray(inits)
    if inits.ndim != 3 or inits.shape[1:] != full.shape:
        raise ValueError(f"inits must be (ranks, {full.shape[0]}, {full.shape[1]}), "
                         f"got {inits.shape}")
    out = []
    for i, row in enumerate(full):
        out.append(next((r for r in range(len(inits)) if np.array_equal(inits[r][i], row)), None))
    return out


def patchwork_figure(full, inits, title: str = "") -> bytes:
    """Two panels, 9.6 in wide; return PNG bytes.

    Left: ``full`` (the weight ``full_tensor()`` returns), each row filled with the colour
    and hatch of the rank whose own initial weight holds it, and labelled "rank k's init"
    on the right. Right: rank 0's own initial weight, each row marked "= left" where
    it equals the left panel's row, "differs" where it does not. Every cell writes its
    value to 2 decimals.

    Args:
        full: array of shape ``(rows, cols)``.
        inits: array of shape ``(ranks, rows, cols)``: what each rank drew before sharding.
        title: figure title.

    Raises:
        ValueError: shapes that do not match, or more than 8 ranks.
    """
    from matplotlib.patches import Rectangle
    full, inits = np.asarray(full, dtype=float), np.asarray(inits, dtype=float)
    sources = source_rows(full, inits)
    if len(inits) > len(RANK_COLOURS):
        raise ValueError(f"at most {len(RANK_COLOURS)} ranks can be drawn, got {len(inits)}")
    rows, cols = full.shape
    fig = new_figure(9.6, 1.4 + 0.42 * rows)
    fig.get_layout_engine().set(wspace=0.12)
    left, right = fig.subplots(1, 2)
    for ax, values, name in ((left, full, "full_tensor() after fully_shard"),
                             (right, inits[0], "rank 0's own initial weight")):
        for i in range(rows):
            for j in range(cols):
                src = sources[i] if ax is left else None
                face = "white" if src is None else RANK_COLOURS[src]
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=face,
                                       hatch=HATCHES[src % len(HATCHES)] if src is not None else None,
                                       edgecolor=NEUTRAL, lw=0.6))
                ax.text(j, i, f"{values[i, j]:+.2f}", ha="center", va="center", fontsize=MIN_FONT,
                        bbox=dict(boxstyle="round,pad=0.1", facecolor="white", linewidth=0, alpha=0.8))
        ax.set_xlim(-0.5, cols - 0.5)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xticks(range(cols), [f"col {j}" for j in range(cols)])
        ax.set_yticks(range(rows), [f"row {i}" for i in range(rows)])
        ax.tick_params(length=0)
        ax.set_title(name, fontsize=MIN_FONT + 1)
        side = ax.secondary_yaxis("right")
        side.tick_params(length=0)
        if ax is left:
            side.set_yticks(range(rows), ["no rank's" if s is None else f"rank {s}'s init"
                                          for s in sources])
        else:
            side.set_yticks(range(rows), ["= left" if np.array_equal(inits[0][i], full[i]) else "differs"
                                          for i in range(rows)])
    fig.suptitle(title, fontsize=MIN_FONT + 2)
    return png(fig)


class MaskAgreement:
    """Every rank's dropout mask on a ``(dp, tp)`` mesh, one row per rank (the explorer of
    notebook 17, :class:`reducelab.widgets.randomness.RandomnessExplorer`).

    A dropped unit is black and cross-hatched, a kept one white. Left of each row, a chip
    in the colour and hatch of its mask's letter; right of it, the letter ("mask A"):
    ranks with the same letter drew the same mask. Rows are labelled with the rank and
    its mesh coordinate, and a line between tp groups separates the dp indices. The figure
    is 9.6 x 3.6 in for 4 ranks, drawn anew on each call.
    """

    def __init__(self):
        self.fig = None

    def draw(self, dropped, coords, title: str = "") -> bytes:
        """Draw and return PNG bytes.

        Args:
            dropped: bool array ``(ranks, units)``, True where a unit was dropped.
            coords: ``coords[rank] = (dp_index, tp_index)``.
            title: figure title.

        Raises:
            ValueError: one coordinate per rank is needed; at most 8 distinct masks.
        """
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import Rectangle
        dropped = np.asarray(dropped, dtype=bool)
        ranks, units = dropped.shape
        if len(coords) != ranks:
            raise ValueError(f"need one coordinate per rank, got {len(coords)} for {ranks} ranks")
        names = mask_names(dropped)
        letters = sorted(set(names))
        if len(letters) > len(RANK_COLOURS):
            raise ValueError(f"at most {len(RANK_COLOURS)} distinct masks can be drawn")
        self.fig = fig = new_figure(9.6, 1.6 + 0.5 * ranks, layout_key=("masks", ranks, units))
        ax = fig.subplots()
        for i in range(ranks):
            k = letters.index(names[i])
            ax.add_patch(Rectangle((-2.1, i - 0.4), 1.2, 0.8, facecolor=RANK_COLOURS[k],
                                   hatch=HATCHES[(k + 1) % len(HATCHES)], edgecolor="black", lw=0.8))
        for kind, face, hatch in ((True, DROPPED, "xx"), (False, "white", None)):
            # one collection per kind of cell: 64 patches drawn one by one took most of a draw
            cells = [Rectangle((j - 0.5, i - 0.5), 1, 1) for i, j in zip(*np.nonzero(dropped == kind))]
            ax.add_collection(PatchCollection(cells, facecolor=face, hatch=hatch, edgecolor=NEUTRAL, lw=0.6))
        for i in range(1, ranks):
            if coords[i][0] != coords[i - 1][0]:
                ax.axhline(i - 0.5, color="black", lw=2.5)
        ax.set_xlim(-2.3, units - 0.5)
        ax.set_ylim(ranks - 0.5, -0.5)
        ax.set_xticks(range(0, units, 4 if units > 8 else 1))
        ax.set_xlabel("hidden unit (black, cross-hatched: dropped)")
        ax.set_yticks(range(ranks), [f"rank {r} (dp {d}, tp {t})" for r, (d, t) in enumerate(coords)])
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        side = ax.secondary_yaxis("right")
        side.set_yticks(range(ranks), [f"mask {n}" for n in names])
        side.tick_params(length=0)
        fig.suptitle(title, fontsize=MIN_FONT + 2)
        return png(fig)
