"""The figure of notebook 18's explorer: one block of a transformer layer (attention or
the MLP, each ``x + dropout(block(LayerNorm(x)))``) on ``tp`` ranks, stage by stage.

:func:`layer_figure` draws one column per stage (the block's input, its LayerNorm, the
way in, the block's partial sums, the way out, the residual add) and one row per rank.
In each cell a strip of token boxes says which tokens of the sequence the rank holds
there: filled in the rank's colour where it holds them (each row labelled with its rank),
white where it does not, cross-hatched where it holds only a partial sum; the cell's text
says the same in words ("tokens 0-1", "all tokens", "partial") and gives the bytes the
rank holds. Between columns, the
collective that ran there, in forward and in backward, with the bytes a rank sends. On
the right, the bytes each rank holds over the stages drawn. The figure is kept between
draws (one per number of ranks, :func:`reducelab.plots.kept_figure`). Everything the figure says
by colour it also says in text or hatching.

Sources: Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, section 4.2.2 and figure 5 (sequence parallelism:
``g``/``ḡ`` become all_gather and reduce_scatter); Shoeybi et al. (2019),
arXiv:1909.08053, section 3 (f and g).
"""
from __future__ import annotations

from dataclasses import dataclass


from . import MIN_FONT, NEUTRAL, RANK_COLOURS, TEXT_GREY, kept_figure, png

PARTIAL_HATCH = "xx"
INSIDE = ("into the block", "partial sum")
"""The stages inside the tensor-parallel block, where every rank holds all the tokens; the
figure's right column sums the bytes of the others, outside the block."""


def outside_bytes(stage_names, held: list) -> list[int]:
    """Bytes each rank holds in the stages outside the block (not in :data:`INSIDE`),
    summed: ``held[rank][stage] = (first, stop, nbytes)``. The figure's right column, and
    the explorer's status line."""
    return [sum(c[2] for name, c in zip(stage_names, row) if name not in INSIDE)
            for row in held]
"""Hatch of a token box that holds only a partial sum (a second cue beside the word)."""
COLUMN = 1.0
"""Width of a stage's column, in data units; a cell's strip takes :data:`STRIP` of it."""
STRIP = 0.78


@dataclass(frozen=True)
class Hop:
    """The collective between two stages, as the ranks recorded it.

    Attributes:
        forward: what ran in forward ("all_gather", "all_reduce", or "nothing").
        backward: what ran in backward, the same way.
        sent: bytes a rank sends in forward and backward together (ring formulas).
    """

    forward: str
    backward: str
    sent: int


def _fmt_tokens(first: int, stop: int) -> str:
    return f"token {first}" if stop - first == 1 else f"tokens {first}-{stop - 1}"


def layer_figure(stage_names: list, held: list, partial: list, hops: list, seq: int,
                 title: str = "") -> bytes:
    """Draw the block stage by stage and return PNG bytes, 9.6 in wide.

    Args:
        stage_names: the stages' names, left to right (at most 6).
        held: ``held[rank][stage] = (first, stop, nbytes)``: the rank holds tokens
            ``first`` to ``stop - 1`` there, ``nbytes`` bytes of activation.
        partial: ``partial[stage]``: True where each rank holds only a partial sum.
        hops: ``len(stage_names) - 1`` :class:`Hop` objects, or ``None`` between two
            stages that no collective joins.
        seq: tokens in the whole sequence.
        title: figure title.

    Raises:
        ValueError: shapes that do not match, more than 6 stages or 8 ranks.
    """
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle
    ranks, stages = len(held), len(stage_names)
    if stages > 6 or ranks > len(RANK_COLOURS):
        raise ValueError(f"at most 6 stages and {len(RANK_COLOURS)} ranks, got {stages} and {ranks}")
    if any(len(row) != stages for row in held) or len(partial) != stages or len(hops) != stages - 1:
        raise ValueError("held, partial and hops must match stage_names")
    height = 1.9 + 0.72 * ranks

    def make_axes(fig):
        # fixed margins (no layout engine): the labels on both sides fit in 1.1 in
        return [fig.add_axes((0.8 / 9.6, 0.55 / height, 7.7 / 9.6, 1 - 1.15 / height))]

    fig, (ax,) = kept_figure(("transformer layer", ranks, stages), 9.6, height, make_axes,
                             layout=False)
    held_boxes = [[] for _ in range(ranks)]
    empty, hatched = [], []
    box_w = STRIP / seq
    for r, row in enumerate(held):
        for s, (first, stop, nbytes) in enumerate(row):
            x0 = s * COLUMN
            for t in range(seq):
                rect = Rectangle((x0 + t * box_w, r), box_w, 0.42)
                mine = first <= t < stop
                (hatched if mine and partial[s] else held_boxes[r] if mine else empty).append(rect)
            what = "partial" if partial[s] else ("all tokens" if stop - first == seq
                                                  else _fmt_tokens(first, stop))
            ax.text(x0 + STRIP / 2, r + 0.66, f"{what}, {nbytes} B", ha="center", va="center",
                    fontsize=MIN_FONT)
    # one collection per rank's held boxes (its colour; its row is labelled), one for the
    # boxes a rank does not hold, one (hatched) for partial sums
    for r, rects in enumerate(held_boxes):
        if rects:
            ax.add_collection(PatchCollection(rects, facecolor=RANK_COLOURS[r], edgecolor="black",
                                              lw=0.6))
    if empty:
        ax.add_collection(PatchCollection(empty, facecolor="white", edgecolor=NEUTRAL, lw=0.6))
    if hatched:
        ax.add_collection(PatchCollection(hatched, facecolor="white", hatch=PARTIAL_HATCH,
                                          edgecolor=TEXT_GREY, lw=0.6))
    for s, hop in enumerate(hops):
        x = s * COLUMN + STRIP + (COLUMN - STRIP) / 2
        ax.annotate("", xy=(x + 0.09, 0.21), xytext=(x - 0.09, 0.21),
                    arrowprops=dict(arrowstyle="->", color="black", lw=1.2))
        if hop is not None:
            ax.text(x, -0.12, f"fwd: {hop.forward}\nbwd: {hop.backward}\n"
                              f"{hop.sent} B sent (fwd + bwd)",
                    ha="center", va="bottom", fontsize=MIN_FONT, linespacing=1.1,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor=NEUTRAL))
    right = stages * COLUMN - (COLUMN - STRIP) + 0.05
    for r, outside in enumerate(outside_bytes(stage_names, held)):
        ax.text(-0.08, r + 0.21, f"rank {r}", ha="right", va="center", fontsize=MIN_FONT)
        ax.text(right + 0.03, r + 0.21, f"{outside:,} B", ha="left", va="center",
                fontsize=MIN_FONT)
        ax.text(right + 0.03, r + 0.52, "outside", ha="left", va="center", fontsize=MIN_FONT,
                color=TEXT_GREY)
    for s, name in enumerate(stage_names):
        ax.text(s * COLUMN + STRIP / 2, -0.9, name, ha="center", va="bottom", fontsize=MIN_FONT + 1)
    ax.text(right / 2, ranks + 0.05, "each box one token of the sequence: filled, this rank holds "
            "it; white, it does not; cross-hatched, a partial sum\nright: the bytes a rank holds "
            "outside the block (the four stages not inside it)", ha="center", va="top",
            fontsize=MIN_FONT)
    ax.set_xlim(-0.05, right)
    ax.set_ylim(ranks - 0.05, -0.95)
    ax.set_axis_off()
    fig.suptitle(title, fontsize=MIN_FONT + 2)
    return png(fig)
