"""Explorer and gradient table of notebook 04 (DDP gradients and loss reductions).

:class:`GradientFactorExplorer` runs the notebook's own DDP rank function on real gloo
ranks for a loss reduction, a world size and a split of the global batch, and compares
the result with the single-process full-batch gradient. :func:`gradient_table` does the
same for a grid of settings.

Source: https://pytorch.org/docs/stable/notes/ddp.html (DDP all_reduces gradients and
divides by world_size).
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import torch

from . import Explorer
from ..checks.ddp import (REDUCTIONS, GradientComparison, compare_gradients, expected_factor,
                          explain)
from ..data import SPLITS, split_sizes

MAX_WORLD_SIZE = 8


@dataclass
class GradientResult:
    """One comparison: the settings, both gradients and how they relate.

    Attributes:
        reduction, world_size, split: the settings.
        sizes: local batch size of each rank (``list[int]``).
        ddp: rank 0's DDP gradient, ``float32`` of shape ``(P,)`` (all ranks hold the same).
        full: the single-process full-batch gradient, ``float32`` of shape ``(P,)``.
        comparison: :class:`~reducelab.checks.ddp.GradientComparison`.
        expected: the factor theory predicts (``None`` for mean with uneven splits).
    """

    reduction: str
    world_size: int
    split: str
    sizes: list
    ddp: torch.Tensor
    full: torch.Tensor
    comparison: GradientComparison
    expected: float | None


def run_comparison(group, ddp_gradient, full_batch_gradient, X, y, reduction: str,
                   world_size: int, split: str) -> GradientResult:
    """Run ``ddp_gradient`` on ranks ``0..world_size-1`` of ``group``; compare with one process.

    Args:
        group: a running :class:`~reducelab.LocalGroup` with at least ``world_size`` ranks.
        ddp_gradient: rank function ``(X, y, reduction, world_size, split) -> tensor`` that
            returns the flattened gradient on ranks below ``world_size``, ``None`` on others.
        full_batch_gradient: kernel function ``(X, y, reduction) -> tensor``.
        X, y: the global batch, ``float32 (N, 64)`` and ``int64 (N,)``.

    Raises:
        ValueError: bad ``reduction``/``split``/``world_size`` (names the valid choices).
        RankError: a rank failed.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or not 1 <= world_size <= group.world_size:
        raise ValueError(f"world_size must be an int from 1 to {group.world_size} "
                         f"(the ranks in the group), got {world_size!r}")
    sizes = split_sizes(len(X), world_size, split)
    outs = group.run(ddp_gradient, X, y, reduction, world_size, split)
    ddp = outs[0]
    full = full_batch_gradient(X, y, reduction)
    return GradientResult(reduction, world_size, split, sizes, ddp, full,
                          compare_gradients(ddp, full),
                          expected_factor(reduction, world_size, split))


def describe_result(r: GradientResult) -> str:
    """One line: the factor found, the factor theory predicts, and why."""
    c = r.comparison
    if c.constant:
        found = f"DDP gradient = {c.text()} the full-batch gradient"
        if r.expected is not None and r.world_size > 1 and r.expected != 1:
            found += f" (= 1/world_size = 1/{r.world_size})"
    else:
        found = (f"DDP gradient / full-batch gradient {c.text()} across elements: "
                 f"no single factor")
    return (f"reduction={r.reduction!r}, world_size={r.world_size}, local batches "
            f"{r.sizes}: {found}. {explain(r.reduction, r.world_size, r.split, r.sizes)}")


def gradient_table(group, ddp_gradient, full_batch_gradient, X, y,
                   world_sizes=(1, 2, 3, 4)) -> str:
    """Text table of DDP gradient / full-batch gradient for every reduction, split, world size.

    Rows: ``(reduction, split)``; columns: ``world_sizes`` (each at most
    ``group.world_size``; smaller ones use the group's first ranks). A cell holds the
    constant factor (``"0.25 x"``) or the range of element ratios (``"varies a..b"``).

    Returns:
        The table as a ``str`` (print it).
    """
    header = f"{'reduction':<10}{'split':<8}" + "".join(f"{'W=' + str(w):>19}" for w in world_sizes)
    lines = [header, "-" * len(header)]
    for reduction in REDUCTIONS:
        for split in SPLITS:
            cells = []
            for w in world_sizes:
                r = run_comparison(group, ddp_gradient, full_batch_gradient, X, y,
                                   reduction, w, split)
                cells.append(f"{r.comparison.text():>19}")
            lines.append(f"{reduction:<10}{split:<8}" + "".join(cells))
    return "\n".join(lines)


class GradientFactorExplorer(Explorer):
    """Controls: loss reduction, world_size (1..8), split; shows DDP vs full-batch gradient.

    Args:
        group: the notebook's :class:`~reducelab.LocalGroup`. World sizes up to its size
            run on its first ranks (no restart). Larger ones run on a private group of
            ``max_world_size`` ranks that the explorer starts the first time it is needed
            (timeout at least 120 s: each new rank's first DDP imports ``torch._dynamo``)
            and stops in :meth:`close`.
        ddp_gradient, full_batch_gradient, X, y: as in :func:`run_comparison`.
        reduction, world_size, split: initial control values.
        max_world_size: the slider's maximum (at most 8).
    """

    def __init__(self, group, ddp_gradient, full_batch_gradient, X, y, reduction: str = "sum",
                 world_size: int = 4, split: str = "equal", max_world_size: int = MAX_WORLD_SIZE):
        if not 1 <= max_world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"max_world_size must be from 1 to {MAX_WORLD_SIZE}, got {max_world_size}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 1 <= world_size <= max_world_size:
            raise ValueError(f"world_size must be from 1 to {max_world_size}, got {world_size}")
        self.group, self._big = group, None
        self.max_world_size = max_world_size
        self.fns = (ddp_gradient, full_batch_gradient)
        self.X, self.y = X, y
        self.plot = None
        controls = {
            "reduction": W.ToggleButtons(options=list(REDUCTIONS), value=reduction,
                                         description="reduction"),
            "world_size": W.IntSlider(value=world_size, min=1, max=max_world_size,
                                      description="world_size", continuous_update=False),
            "split": W.ToggleButtons(options=list(SPLITS), value=split, description="split"),
        }
        super().__init__(controls)
        self.refresh()

    def _group_for(self, world_size: int):
        if world_size <= self.group.world_size:
            return self.group
        if self._big is None:
            from ..group import LocalGroup
            self._big = LocalGroup(self.max_world_size, timeout=max(self.group.timeout, 120.0))
        return self._big

    def compute(self, reduction, world_size, split):
        return run_comparison(self._group_for(world_size), *self.fns, self.X, self.y,
                              reduction, world_size, split)

    def draw(self, result: GradientResult) -> bytes:
        if self.plot is None:
            from ..plots.ddp import GradientScatter
            self.plot = GradientScatter()
        c = result.comparison
        return self.plot.draw(result.ddp, result.full, c.factor, c.constant,
                              title=f"reduction={result.reduction!r}, world_size="
                                    f"{result.world_size}, {result.split} local batches")

    def describe(self, result: GradientResult) -> str:
        return describe_result(result)

    def close(self) -> None:
        """Stop the private group started for world sizes above the notebook's group."""
        if self._big is not None:
            self._big.close()
            self._big = None
