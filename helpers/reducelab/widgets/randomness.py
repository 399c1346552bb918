"""The explorer of notebook 17: pick a seeding scheme, a ``(dp, tp)`` mesh of 4 ranks and
a dropout probability, and see which ranks draw the same dropout mask.

The notebook's rank function takes its ``(dp, tp)`` coordinate from its rank, laid out as
``init_device_mesh("cpu", (dp, tp))`` lays out the ranks (row-major; it builds no process
groups, which cost about 60 ms per move at 4 ranks), seeds torch as the scheme says, and
draws ``F.dropout`` on 16 units of an activation that every rank of a tp group holds
whole. The figure (:class:`reducelab.plots.randomness.MaskAgreement`) names each distinct
mask by a letter; the message says whether every tp group shares one mask and whether the
dp groups' masks differ, what such an activation needs.

Sources: Megatron-LM's two random streams (Shoeybi et al., 2019, arXiv:1909.08053,
appendix B.2); the learner question "Dropout sync across GPUs causes major performance
drops" (huggingface/transformers#31412, 2024-06-14).
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..checks.mesh import run_and_release
from ..group import LocalGroup
from ..plots.randomness import MaskAgreement, mask_names
from . import Explorer

SCHEMES = ("one seed", "seed = rank", "seed = dp rank", "seed = tp rank")
"""The seeding schemes the explorer offers; the notebook's rank function maps each to a
seed."""
MESH_SHAPES = ((4, 1), (2, 2), (1, 4))
"""The ``(dp, tp)`` shapes of 4 ranks the explorer offers."""
PROBABILITIES = (0.1, 0.9)
"""The dropout probabilities the slider spans, in steps of 0.1."""


@dataclass
class MaskResult:
    """What the ranks drew for one setting.

    Attributes:
        scheme, shape, p: the setting (``shape`` is ``(dp, tp)``).
        coords: ``coords[rank] = (dp_index, tp_index)``.
        dropped: bool array ``(ranks, units)``, True where the rank's mask dropped a unit.
    """

    scheme: str
    shape: tuple
    p: float
    coords: list
    dropped: np.ndarray

    @property
    def names(self) -> list[str]:
        """The letter of each rank's mask (:func:`reducelab.plots.randomness.mask_names`)."""
        return mask_names(self.dropped)

    def tp_groups_agree(self) -> bool:
        """Every rank of each tp group (same dp index) drew the same mask."""
        return all(self.names[r] == self.names[s] for r in range(len(self.coords))
                   for s in range(len(self.coords)) if self.coords[r][0] == self.coords[s][0])

    def dp_groups_differ(self) -> bool | None:
        """Every two dp indices drew different masks; ``None`` with one dp index."""
        by_dp = {}
        for (d, _), n in zip(self.coords, self.names):
            by_dp.setdefault(d, set()).add(n)
        if len(by_dp) < 2:
            return None
        sets = list(by_dp.values())
        return all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:])


def describe_masks(result: MaskResult) -> str:
    """One line: how many different masks, and whether the two rules hold."""
    dp, tp = result.shape
    n = len(set(result.names))
    differ = result.dp_groups_differ()
    tp_rule = "yes" if result.tp_groups_agree() else "NO"
    dp_rule = ("only one dp group" if differ is None else "yes" if differ else "NO")
    return (f"{result.scheme} on dp={dp} x tp={tp}, p={result.p:.1f}: {n} different "
            f"mask{'' if n == 1 else 's'} on {len(result.coords)} ranks. Every tp group shares "
            f"one mask: {tp_rule}. The dp groups' masks differ: {dp_rule}.")


class RandomnessExplorer(Explorer):
    """Widget: draw a dropout mask on every rank of a ``(dp, tp)`` mesh and show which
    ranks agree.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on; it is resized to 4 ranks.
        fn: the notebook's rank function, called on every rank as
            ``fn(scheme, (dp, tp), p)``. It returns ``{"coord": (dp_index, tp_index),
            "dropped": bool tensor of the units it dropped}``. The process groups its mesh
            makes are destroyed after each call
            (:func:`reducelab.checks.mesh.run_and_release`).
        scheme: initial seeding scheme, one of :data:`SCHEMES`.
        shape: initial ``(dp, tp)``, one of :data:`MESH_SHAPES`.
        p: initial dropout probability, 0.1 to 0.9.

    Raises:
        ValueError: an initial value outside the choices above.
    """

    def __init__(self, group: LocalGroup, fn, scheme: str = "seed = rank",
                 shape: tuple[int, int] = (2, 2), p: float = 0.5):
        shape = tuple(shape)
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        if shape not in MESH_SHAPES:
            raise ValueError(f"shape must be one of {', '.join(map(str, MESH_SHAPES))}; got {shape!r}")
        if not PROBABILITIES[0] <= p <= PROBABILITIES[1]:
            raise ValueError(f"p must be from {PROBABILITIES[0]} to {PROBABILITIES[1]}; got {p!r}")
        self.group, self.fn = group, fn
        self.figure = MaskAgreement()
        wide = {"description_width": "initial"}
        super().__init__({
            "scheme": W.Dropdown(options=SCHEMES, value=scheme, description="seeding",
                                 style=wide, layout=W.Layout(width="auto")),
            "shape": W.Dropdown(options=[(f"dp={d} x tp={t}", (d, t)) for d, t in MESH_SHAPES],
                                value=shape, description="mesh (dp, tp)", style=wide,
                                layout=W.Layout(width="auto")),
            "p": W.FloatSlider(value=p, min=PROBABILITIES[0], max=PROBABILITIES[1], step=0.1,
                               description="dropout p", style=wide, readout_format=".1f"),
        })
        self.refresh()

    def compute(self, scheme, shape, p) -> MaskResult:
        self.group.resize(4)  # every shape has 4 ranks; a no-op unless another cell resized it
        out = self.group.run(run_and_release, self.fn, scheme, tuple(shape), round(float(p), 1))
        return MaskResult(scheme, tuple(shape), round(float(p), 1),
                          [tuple(int(c) for c in o["coord"]) for o in out],
                          np.stack([np.asarray(o["dropped"], dtype=bool) for o in out]))

    def draw(self, result: MaskResult) -> bytes:
        dp, tp = result.shape
        return self.figure.draw(result.dropped, result.coords,
                                title=f"{result.scheme}: F.dropout(p={result.p:.1f}) on an "
                                      f"activation each tp group holds whole, dp={dp} x tp={tp}")

    def describe(self, result: MaskResult) -> str:
        return describe_masks(result)
