"""The explorer of notebook 04: DDP's gradient against the single-process gradient.

:class:`GradientFactorExplorer` runs the notebook's own DDP rank function on real gloo
ranks for a loss reduction, a world size and a split of the global batch, and compares
the result with the notebook's single-process full-batch gradient. It only launches,
compares (:func:`reducelab.checks.ddp.compare_gradients`) and plots: the rank function
and the reference are the notebook's.

Source: DDP divides each gradient by world_size and all_reduces it with a sum
(``Reducer::mark_variable_ready_dense`` in ``torch/csrc/distributed/c10d/reducer.cpp``;
https://pytorch.org/docs/stable/notes/ddp.html); the learner question "Why am I getting
a PyTorch reduce_op warning without explicitly using `reduce_op`?" (2025-01-30).
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
"""The world-size slider's largest value."""


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
        agree: whether every rank ended with the same gradient (DDP's promise).
    """

    reduction: str
    world_size: int
    split: str
    sizes: list
    ddp: torch.Tensor
    full: torch.Tensor
    comparison: GradientComparison
    expected: float | None
    agree: bool = True


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
    line = (f"reduction={r.reduction!r}, world_size={r.world_size}, local batches "
            f"{r.sizes}: {found}. {explain(r.reduction, r.world_size, r.split, r.sizes)}")
    if not r.agree:
        line += " The ranks did not all end with the same gradient."
    return line


class GradientFactorExplorer(Explorer):
    """Controls: loss reduction, world_size (1 to 8), split; shows DDP vs full-batch gradient.

    Each change resizes the group to ``world_size`` ranks (a fraction of a second: the
    ranks start from a forkserver that has torch and DDP's imports loaded), runs
    ``ddp_gradient`` on every rank and ``full_batch_gradient`` in the kernel.

    Args:
        group: the notebook's :class:`~reducelab.LocalGroup`; the explorer resizes it.
        ddp_gradient: the notebook's rank function ``(X, y, reduction, split) -> tensor``:
            the flattened gradient DDP leaves on this rank, for this rank's local batch
            ``local_slice(len(X), world_size, rank, split)``.
        full_batch_gradient: the notebook's function ``(X, y, reduction) -> tensor``: one
            process's flattened gradient on the whole global batch.
        X, y: the global batch, ``float32 (N, F)`` and ``int64 (N,)``.
        reduction, world_size, split: initial control values.
        max_world_size: the slider's maximum (1 to 8).

    Raises:
        TypeError: a function is not callable.
        ValueError: a bad initial value (the message names the valid choices).
    """

    def __init__(self, group, ddp_gradient, full_batch_gradient, X, y, reduction: str = "sum",
                 world_size: int = 4, split: str = "equal", max_world_size: int = MAX_WORLD_SIZE):
        for name, f in (("ddp_gradient", ddp_gradient), ("full_batch_gradient", full_batch_gradient)):
            if not callable(f):
                raise TypeError(f"{name} must be a function, got {f!r}")
        if not 1 <= max_world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"max_world_size must be from 1 to {MAX_WORLD_SIZE}, got {max_world_size}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 1 <= world_size <= max_world_size:
            raise ValueError(f"world_size must be from 1 to {max_world_size}, got {world_size}")
        self.group = group
        self.max_world_size = max_world_size
        self.fns = (ddp_gradient, full_batch_gradient)
        self.X, self.y = X, y
        self.plot = None
        self.input_error: str | None = None
        controls = {
            "reduction": W.ToggleButtons(options=list(REDUCTIONS), value=reduction,
                                         description="reduction",
                                         style={"description_width": "initial",
                                                "button_width": "60px"}),
            "world_size": W.IntSlider(value=world_size, min=1, max=max_world_size,
                                      description="world_size", continuous_update=False,
                                      style={"description_width": "initial"}),
            "split": W.ToggleButtons(options=list(SPLITS), value=split, description="split",
                                     style={"description_width": "initial",
                                            "button_width": "70px"}),
        }
        super().__init__(controls)
        self.refresh()

    def refresh(self) -> None:
        """Refuse a world size the global batch cannot be split into (one sentence, and
        a note in place of the figure); else run on the ranks."""
        v = self.values
        try:
            split_sizes(len(self.X), v["world_size"], v["split"])
        except ValueError as e:
            self.input_error = (f"The global batch of {len(self.X)} samples cannot be split "
                                f"{v['split']}ly over {v['world_size']} ranks ({e}); pick "
                                f"another world_size or split.")
            self.result, self.error = None, None
            self._refuse(self.input_error)
            return
        self.input_error = None
        super().refresh()

    def compute(self, reduction, world_size, split) -> GradientResult:
        ddp_gradient, full_batch_gradient = self.fns
        self.group.resize(world_size)  # a no-op when it already has world_size ranks
        outs = self.group.run(ddp_gradient, self.X, self.y, reduction, split)
        ddp = outs[0]
        agree = all(torch.equal(o, ddp) for o in outs)
        full = full_batch_gradient(self.X, self.y, reduction)
        return GradientResult(reduction, world_size, split,
                              split_sizes(len(self.X), world_size, split), ddp, full,
                              compare_gradients(ddp, full),
                              expected_factor(reduction, world_size, split), agree)

    def draw(self, result: GradientResult) -> bytes:
        if self.plot is None:
            from ..plots.ddp import GradientScatter
            self.plot = GradientScatter()
        c = result.comparison
        return self.plot.draw(result.ddp, result.full, c.factor, c.constant,
                              sizes=result.sizes, reduction=result.reduction,
                              title=f"reduction={result.reduction!r}, world_size="
                                    f"{result.world_size}, {result.split} local batches")

    def describe(self, result: GradientResult) -> str:
        return describe_result(result)

    def text(self) -> str:
        if self.input_error is not None:
            settings = ", ".join(f"{k}={v}" for k, v in self.values.items())
            return f"{type(self).__name__}({settings})\n{self.input_error}"
        return super().text()
