"""The explorer of notebook 18: one block of a transformer layer (attention or the MLP)
on ``tp`` real ranks, with tensor parallelism alone or with sequence parallelism, stage
by stage: which tokens each rank holds, the collective between stages with the bytes a
rank sends, and the bytes of activation each rank holds.

Every move runs the notebook's rank function on the ranks. It returns, per stage, the
tokens the rank holds and the bytes of the tensor it holds there (read off the tensor),
and the collectives that f, g or the sequence-parallel operators recorded in ``CALLS``
in forward and backward. The bytes a rank sends are the ring formulas of notebook 08
applied to the recorded shapes: ``2(n-1)/n · S`` for an all_reduce, ``(n-1)/n · S`` for
an all_gather or a reduce_scatter, ``S`` the bytes of the whole tensor. A move that keeps
``tp`` builds no process group and no mesh.

Sources: Korthikanti et al. (2022), arXiv:2205.05198, section 4.2.2; Shoeybi et al.
(2019), arXiv:1909.08053, section 3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ipywidgets as W

from ..group import LocalGroup
from ..plots.transformer_layer import Hop, layer_figure, outside_bytes
from . import Explorer

PLANS = ("tp only", "tp + sp")
"""The plans the explorer offers: tensor parallelism alone, or with sequence parallelism."""
BLOCKS = ("attention", "MLP")
"""The blocks of the layer; the rank function takes 1 for attention, 2 for the MLP."""
TP_DEGREES = (1, 2, 4)
"""The tp sizes offered: the sequence of 4 tokens and the 4 heads split evenly."""
STAGES = ("x", "LayerNorm", "into the block", "partial sum", "out of the block", "+ residual")
"""The stages the rank function reports, in order; the hops join the 2nd and 3rd (way
in) and the 4th and 5th (way out)."""


def ring_bytes(collective: str, shape, n: int, itemsize: int = 4) -> int:
    """Bytes one rank sends in a ring ``collective`` over ``n`` ranks of the whole tensor
    ``shape`` (notebook 08): ``2(n-1)/n · S`` for an all_reduce, ``(n-1)/n · S`` for an
    all_gather or reduce_scatter."""
    size = itemsize * math.prod(shape)
    return round((2 if collective == "all_reduce" else 1) * (n - 1) / n * size)


@dataclass
class LayerResult:
    """What the ranks reported for one setting.

    Attributes:
        plan, block, tp: the setting.
        held: ``held[rank][stage] = (first, stop, nbytes)``, stages as in :data:`STAGES`.
        calls: rank 0's ``CALLS``: ``(when, where, collective, shape)`` in order.
        same_calls: every rank recorded the same collectives.
        seq: tokens in the whole sequence.
    """

    plan: str
    block: str
    tp: int
    held: list
    calls: list
    same_calls: bool
    seq: int

    def hop(self, where: str) -> Hop:
        """The way in (``"in"``: f or the all_gather) or out (``"out"``: g or the
        reduce_scatter), as recorded; ``"nothing"`` where no collective ran."""
        names = {"in": ("in", "f"), "out": ("out", "g")}[where]
        ran = [(when, c, s) for when, op, c, s in self.calls if op in names]
        fwd = next((c for when, c, _ in ran if when == "forward"), "nothing")
        bwd = next((c for when, c, _ in ran if when == "backward"), "nothing")
        return Hop(fwd, bwd, sum(ring_bytes(c, s, self.tp) for _, c, s in ran))

    def outside_bytes(self) -> list[int]:
        """Bytes each rank holds in the stages outside the block (x, LayerNorm, out of the
        block, + residual), summed: the activations sequence parallelism cuts to a ``1/tp``
        share of the tokens, the LayerNorm and dropout ones of Korthikanti et al. 2022,
        section 4.2.2. Inside the block every rank holds all the tokens either way."""
        return outside_bytes(STAGES, self.held)


def describe_layer(r: LayerResult) -> str:
    """One line: the collectives each way, the bytes sent, the bytes held."""
    into, out = r.hop("in"), r.hop("out")
    outside = r.outside_bytes()
    first, stop, _ = r.held[0][1]
    tokens = "all the tokens" if stop - first == r.seq else f"{stop - first} of {r.seq} tokens"
    same = "every rank ran the same collectives" if r.same_calls else "ranks ran DIFFERENT collectives"
    return (f"{r.block}, {r.plan}, tp={r.tp}: way in {into.forward} (backward {into.backward}), "
            f"way out {out.forward} (backward {out.backward}); a rank sends "
            f"{into.sent + out.sent:,} B; at the LayerNorm rank 0 holds {tokens}; outside the block "
            f"(x, LayerNorm, out, + residual) rank 0 holds {outside[0]:,} B; {same}.")


class TransformerLayerExplorer(Explorer):
    """Widget: one block of a transformer layer on ``tp`` real ranks, stage by stage.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on; it is resized to ``tp``.
        fn: the notebook's rank function, called on every rank as ``fn(sp, i)`` (``sp``
            True for sequence parallelism, ``i`` 1 for attention, 2 for the MLP). It
            returns ``(stages, calls)``: ``stages`` a dict, in the order of
            :data:`STAGES`, of ``name: ((first, stop), nbytes)``; ``calls`` the rank's
            ``CALLS``.
        plan: initial plan, one of :data:`PLANS`.
        block: initial block, one of :data:`BLOCKS`.
        tp: initial tp size, one of :data:`TP_DEGREES`.
        seq: tokens in the whole sequence (the notebook's ``SEQ``).

    Raises:
        ValueError: an initial value outside the choices above.
    """

    def __init__(self, group: LocalGroup, fn, plan: str = "tp + sp", block: str = "MLP",
                 tp: int = 4, seq: int = 4):
        for name, value, choices in (("plan", plan, PLANS), ("block", block, BLOCKS),
                                     ("tp", tp, TP_DEGREES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        self.group, self.fn, self.seq = group, fn, seq
        wide = {"description_width": "initial"}
        super().__init__({
            "plan": W.ToggleButtons(options=PLANS, value=plan, description="plan", style=wide),
            "block": W.ToggleButtons(options=BLOCKS, value=block, description="block", style=wide),
            "tp": W.ToggleButtons(options=TP_DEGREES, value=tp, description="tp (world_size)",
                                  style={**wide, "button_width": "3em"}),
        })
        self.refresh()

    def compute(self, plan, block, tp) -> LayerResult:
        self.group.resize(tp)
        out = self.group.run(self.fn, plan == "tp + sp", BLOCKS.index(block) + 1)
        held = []
        for stages, _ in out:
            if tuple(stages) != STAGES:
                raise ValueError(f"the rank function must report the stages {STAGES}; "
                                 f"got {tuple(stages)}")
            held.append([(int(t[0]), int(t[1]), int(b)) for t, b in stages.values()])
        calls = [tuple(c[:3]) + (tuple(c[3]),) for c in out[0][1]]
        same = all([tuple(c[:3]) + (tuple(c[3]),) for c in o[1]] == calls for o in out)
        return LayerResult(plan, block, tp, held, calls, same, self.seq)

    def draw(self, r: LayerResult) -> bytes:
        partial = [name == "partial sum" and r.tp > 1 for name in STAGES]   # one rank: the whole sum
        hops = [None, r.hop("in"), None, r.hop("out"), None]
        return layer_figure(list(STAGES), r.held, partial, hops, r.seq,
                            title=f"{r.block} block, {r.plan}, on tp={r.tp} ranks: what each "
                                  f"rank holds, stage by stage (forward)")

    def describe(self, r: LayerResult) -> str:
        return describe_layer(r)
