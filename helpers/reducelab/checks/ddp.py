"""Checks for notebook 04 (DDP gradients, loss reductions and the real reduce_op warning).

Also the comparison every part of notebook 04 uses: is the DDP gradient a constant
multiple of the single-process full-batch gradient, and of which factor
(:func:`compare_gradients`). This module imports only ``torch``, so its rank functions
can run on the ranks.

Source: with no communication hook registered, DistributedDataParallel divides each
gradient by the size of its process group while it copies it into a gradient bucket, then
all_reduces the bucket with a sum (``Reducer::set_divide_factor``,
``Reducer::mark_variable_ready_dense`` and ``Reducer::run_allreduce_hook``, which runs the
C++ ``_AllReduceBySumCommHook``, in ``torch/csrc/distributed/c10d/reducer.cpp``, torch
v2.13.0). A registered hook gets the gradients undivided; torch's Python
``allreduce_hook`` (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``)
divides first too, and gives what DDP gives without a hook;
https://pytorch.org/docs/stable/notes/ddp.html
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError
from ..data import SPLITS, local_slice, split_sizes

REDUCTIONS = ("mean", "sum")
"""Loss reductions notebook 04 compares (``CrossEntropyLoss(reduction=...)``)."""

TOLERANCE = 1e-4
"""Largest relative deviation from ``factor * full`` still called a constant factor."""


@dataclass
class GradientComparison:
    """How a DDP gradient relates to the single-process full-batch gradient.

    Attributes:
        factor: least-squares ``k`` in ``ddp ≈ k * full`` (a ``float``).
        constant: ``True`` when ``ddp`` equals ``factor * full`` for every element,
            within :data:`TOLERANCE` relative to ``max|full|``.
        deviation: ``max|ddp - factor * full| / max|full|`` (a ``float``).
        ratio_min, ratio_max: smallest and largest element-wise ``ddp / full`` over the
            elements where ``|full|`` is at least a tenth of ``max|full|``.
    """

    factor: float
    constant: bool
    deviation: float
    ratio_min: float
    ratio_max: float

    def text(self) -> str:
        """``"0.25 x"`` for a constant factor, else ``"varies 0.81..1.3"``."""
        if self.constant:
            return f"{_fmt(self.factor)} x"
        return f"varies {self.ratio_min:.2f}..{self.ratio_max:.2f}"


def _fmt(v: float) -> str:
    r = round(v, 4)
    return f"{r:g}" if abs(r) >= 1e-3 else f"{v:.3g}"


def compare_gradients(ddp: torch.Tensor, full: torch.Tensor) -> GradientComparison:
    """Compare a DDP gradient with the single-process full-batch gradient.

    Args:
        ddp, full: floating tensors of the same shape (any shape; flattened), e.g. the
            concatenated ``.grad`` of every parameter.

    Raises:
        TypeError: not tensors. ValueError: shapes differ, or ``full`` is all zeros.
    """
    if not isinstance(ddp, torch.Tensor) or not isinstance(full, torch.Tensor):
        raise TypeError(f"ddp and full must be tensors, got {type(ddp).__name__} "
                        f"and {type(full).__name__}")
    if ddp.shape != full.shape:
        raise ValueError(f"ddp and full must have the same shape, got {tuple(ddp.shape)} "
                         f"and {tuple(full.shape)}")
    a, b = ddp.double().flatten(), full.double().flatten()
    scale = b.abs().max().item()
    if scale == 0:
        raise ValueError("the full-batch gradient is all zeros; there is no factor to find")
    k = (a @ b / (b @ b)).item()
    dev = ((a - k * b).abs().max() / scale).item()
    big = b.abs() >= 0.1 * scale
    ratio = a[big] / b[big]
    return GradientComparison(k, dev < TOLERANCE, dev, ratio.min().item(), ratio.max().item())


def expected_factor(reduction: str, world_size: int, split: str) -> float | None:
    """The factor DDP gradient / full-batch gradient that theory predicts, or ``None``.

    DDP divides each gradient by ``world_size`` and all_reduces it with a sum:
    ``ddp = sum_r grad(loss_r) / W``. With ``reduction="sum"`` the local sums add up
    to the full-batch sum, so the factor is ``1/W`` for any split. With ``"mean"`` and
    equal local batches, the mean of the local means is the global mean: factor 1. With
    ``"mean"`` and uneven local batches no single factor exists (``None``).
    """
    _validate(reduction, world_size, split)
    if reduction == "sum":
        return 1.0 / world_size
    if split == "equal" or world_size == 1:
        return 1.0
    return None


def explain(reduction: str, world_size: int, split: str, sizes: list[int]) -> str:
    """One or two sentences: why DDP's gradient is what it is for these settings."""
    _validate(reduction, world_size, split)
    W = world_size
    if W == 1:
        return ("With one rank DDP's all_reduce has nothing to add and divides by 1: "
                "the DDP gradient is the full-batch gradient.")
    if reduction == "sum":
        return (f"Each rank's summed loss covers only its own samples; DDP divides each "
                f"rank's gradient by world_size={W} and sums the {W} of them (undivided, "
                f"they would add up to the full-batch sum), so the factor is 1/{W} "
                f"whatever the split.")
    if split == "equal":
        return (f"Each rank averages over {sizes[0]} samples; DDP averages the {W} local "
                f"gradients, and the mean of equal-sized means is the global mean: factor 1.")
    return (f"DDP gives each local mean the same weight 1/{W}, but the local batches "
            f"{sizes} differ, so a sample on a small rank counts more than one on a big "
            f"rank: a different gradient, not a rescaled one.")


def _validate(reduction, world_size, split) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


# --- the exercise: scale each local loss so that DDP gives the full-batch gradient ----

def _scaled_ddp_gradient(X, y, reduction, split, scales):
    """Rank function: DDP backward of ``scales[rank] * local loss``; returns the gradient."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world_size = dist.get_rank(), dist.get_world_size()
    part = local_slice(len(X), world_size, rank, split)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(X.shape[1], 10))
    loss = F.cross_entropy(model(X[part]), y[part], reduction=reduction)
    (scales[rank] * loss).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _full_batch_gradient(X, y, reduction):
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = torch.nn.Linear(X.shape[1], 10)
    F.cross_entropy(model(X), y, reduction=reduction).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


CHECK_WORLD_SIZES = (4, 3)
"""World sizes :func:`check_loss_scale` runs at (a scale that hard-codes 4 fails at 3)."""


def check_loss_scale(group, loss_scale, X: torch.Tensor, y: torch.Tensor,
                     world_sizes=CHECK_WORLD_SIZES) -> Verdict:
    """Check the exercise of notebook 04: a loss scale that makes DDP match one process.

    ``loss_scale(reduction, world_size, local_batch, global_batch) -> float`` is the
    number each rank multiplies its local loss by before ``backward()``. For each world
    size in ``world_sizes`` the check resizes ``group``, runs real DDP on every rank for
    each loss reduction (``"mean"``, ``"sum"``) and split (``"equal"``, ``"uneven"``),
    and compares the gradient with the single-process full-batch gradient of the same
    reduction. The group's world size is restored afterwards.

    Args:
        group: a running :class:`~reducelab.LocalGroup`.
        loss_scale: the learner's function.
        X, y: the global batch, ``float32 (N, F)`` and ``int64 (N,)``; ``N`` must be
            divisible by every world size in ``world_sizes``.
        world_sizes: ints of 2 or more.

    Returns:
        A :class:`Verdict` that names the first failing case, the factor it found and
        why; it never shows a solution.

    Raises:
        ValueError: a world size below 2, or ``N`` not divisible by one.
    """
    if not callable(loss_scale):
        return failed(f"check_loss_scale needs your function loss_scale, got {loss_scale!r}.")
    N = len(X)
    for W in world_sizes:
        if W < 2:
            raise ValueError(f"world sizes must be 2 or more (with one rank any scale of 1 "
                             f"passes), got {W}")
        split_sizes(N, W, "equal")  # raises ValueError when N is not divisible by W
    with restoring_world_size(group):
        for W in world_sizes:
            group.resize(W)
            verdict = _check_at(group, loss_scale, X, y, W, N)
            if verdict is not None:
                return verdict
    sizes = " and ".join(str(w) for w in world_sizes)
    return passed(f"With your scales DDP's gradient equals the single-process full-batch "
                  f"gradient for 'mean' and 'sum', equal and uneven local batches, on "
                  f"world_size {sizes}. DDP still divides by world_size; your scale undoes it.")


def _check_at(group, loss_scale, X, y, W: int, N: int) -> Verdict | None:
    """The failing :class:`Verdict` of the first wrong case at world size ``W``, or ``None``."""
    for reduction in REDUCTIONS:
        full = _full_batch_gradient(X, y, reduction)
        for split in SPLITS:
            sizes = split_sizes(N, W, split)
            try:
                scales = [loss_scale(reduction, W, n, N) for n in sizes]
            except Exception as e:  # the learner's code: report, do not raise
                return failed(f"loss_scale({reduction!r}, {W}, {sizes[0]}, {N}) raised "
                              f"{type(e).__name__}: {e}")
            bad = next((s for s in scales if isinstance(s, bool)
                        or not isinstance(s, (int, float)) or not math.isfinite(s)), "ok")
            if bad != "ok":
                return failed(f"loss_scale must return a finite number; for "
                              f"reduction={reduction!r} it returned {bad!r}"
                              + (" (the TODO stub)." if bad is None else "."))
            try:
                ddp = group.run(_scaled_ddp_gradient, X, y, reduction, split, scales)[0]
            except RankError as err:
                return raised_on_ranks(f"With world_size={W} and reduction={reduction!r}", err)
            cmp = compare_gradients(ddp, full)
            if cmp.constant and abs(cmp.factor - 1) < TOLERANCE:
                continue
            case = (f"reduction={reduction!r}, world_size={W}, {split} local batches "
                    f"{sizes} (global batch {N})")
            got = (f"the DDP gradient was {_fmt(cmp.factor)} x the full-batch gradient"
                   if cmp.constant else
                   f"the DDP gradient was not a multiple of the full-batch gradient "
                   f"(element-wise ratios from {cmp.ratio_min:.2f} to {cmp.ratio_max:.2f})")
            if reduction == "sum":
                why = (f"DDP divides every rank's gradient by world_size={W} before it sums "
                       f"them; the local sums already add up to the full-batch sum, so the "
                       f"scale has to undo only that division.")
            else:
                why = (f"with 'mean' rank r's loss is divided by its own local_batch, the "
                       f"full-batch loss by global_batch={N}, and DDP divides by "
                       f"world_size={W} on top: each sample must end up weighted "
                       f"1/global_batch, so the scale depends on local_batch.")
            return failed(f"For {case} your scales {[_fmt(float(s)) for s in scales]} gave: "
                          f"{got}; expected exactly 1 x. Why: {why}")
    return None
