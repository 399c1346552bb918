"""Checks for notebook 04 (DDP gradients, loss reductions and the real reduce_op warning).

Also the comparison every part of notebook 04 uses: is the DDP gradient a constant
multiple of the single-process full-batch gradient, and of which factor
(:func:`compare_gradients`). This module imports only ``torch``, so its rank functions
can run on the ranks.

Source: with no communication hook registered, DistributedDataParallel divides each
gradient by the size of its process group while it copies it into a gradient bucket, then
all_reduces the bucket with a sum (``Reducer::set_divide_factor``,
``Reducer::mark_variable_ready_dense`` and ``Reducer::run_allreduce_hook``, in
``torch/csrc/distributed/c10d/reducer.cpp``; the last runs the C++
``_AllReduceBySumCommHook`` of ``torch/csrc/distributed/c10d/default_comm_hooks.cpp``,
torch v2.13.0). A registered hook gets the gradients undivided; torch's Python
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


# --- the exercise: a penalty every rank computes whole, or only its part of ---------
PENALTY = {"mean": 0.5, "sum": 0.5 * 840}
"""λ of the exercise's L2 penalty ``λ · Σ w²`` on the ``Linear``'s weight, per reduction:
a ``"sum"`` loss over 840 samples is 840 times a ``"mean"`` one, and so is its λ, so
that the penalty matters as much beside either."""


def penalty_rows(rank: int, world_size: int, rows: int = 10) -> list[int]:
    """The rows of the weight (one per class, ``rows`` of them) whose penalty ``rank``
    computes when the penalty is computed in parts: ``rank, rank + world_size, ...``.
    Every row belongs to exactly one rank, so the parts add up to the whole penalty; a
    rank may get no row (``world_size > rows``).

    Raises:
        ValueError: ``rank`` outside ``0 .. world_size - 1``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be from 0 to world_size - 1 = {world_size - 1}, got {rank}")
    return list(range(rank, rows, world_size))


def _penalty(model, reduction: str, rows=None) -> torch.Tensor:
    """``PENALTY[reduction] · Σ w²`` over the weight's ``rows`` (all of them if ``None``)."""
    w = model.weight if rows is None else model.weight[rows]
    return PENALTY[reduction] * w.pow(2).sum()


def _ddp_loss_gradient(X, y, reduction, split, in_parts, ddp_loss, keep="both"):
    """Rank function: DDP backward of ``ddp_loss(data_loss, penalty, reduction,
    world_size, penalty_in_parts)``; returns the gradient (weight, then bias, flattened).
    With ``in_parts`` the penalty is this rank's part (:func:`penalty_rows`), else the
    whole penalty. ``keep="data"`` or ``"penalty"`` zeroes the other part before the
    call, so the gradient of each part can be told apart."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world_size = dist.get_rank(), dist.get_world_size()
    part = local_slice(len(X), world_size, rank, split)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(X.shape[1], 10))
    data_loss = F.cross_entropy(model(X[part]), y[part], reduction=reduction)
    penalty = _penalty(model.module, reduction,
                       penalty_rows(rank, world_size) if in_parts else None)
    if keep == "data":
        penalty = penalty * 0.0
    elif keep == "penalty":
        data_loss = data_loss * 0.0
    loss = ddp_loss(data_loss, penalty, reduction, world_size, in_parts)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(f"ddp_loss must return the loss to call backward() on: a tensor of "
                        f"one element that requires grad; it returned {_short(loss)}")
    loss.backward()
    return _flat_grad(model.module)



def _flat_grad(model) -> torch.Tensor:
    """Every parameter's gradient, flattened in order; zeros where a parameter has none."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}" + (
            "" if value.requires_grad else " that does not require grad")
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def full_gradients(X: torch.Tensor, y: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One process on the whole global batch: the gradient of the cross entropy with
    ``reduction`` and the gradient of the exercise's penalty, each flattened as weight
    then bias (float32, ``(F * 10 + 10,)``; the penalty's bias part is zero).

    Raises:
        ValueError: an unknown reduction.
    """
    import torch.nn.functional as F
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    grads = []
    for part in ("data", "penalty"):
        torch.manual_seed(0)
        model = torch.nn.Linear(X.shape[1], 10)
        loss = (F.cross_entropy(model(X), y, reduction=reduction) if part == "data"
                else _penalty(model, reduction))
        loss.backward()
        grads.append(_flat_grad(model))
    return grads[0], grads[1]


CASES = (("mean", "equal", False), ("sum", "equal", False), ("sum", "uneven", False),
         ("mean", "equal", True), ("sum", "uneven", True))
"""The (reduction, split, penalty in parts) cases :func:`check_ddp_loss` runs, in order.
``"mean"`` over uneven local batches is left out: its weighting is notebook 03's
exercise."""

CHECK_WORLD_SIZES = (4, 3)
"""World sizes :func:`check_ddp_loss` runs at (a loss that hard-codes 4 fails at 3)."""


def check_ddp_loss(group, ddp_loss, X: torch.Tensor, y: torch.Tensor,
                   world_sizes=CHECK_WORLD_SIZES) -> Verdict:
    """Check the exercise of notebook 04: a penalty every rank computes whole, or only its
    part of.

    ``ddp_loss(data_loss, penalty, reduction, world_size, penalty_in_parts)`` returns the
    loss each rank calls ``backward()`` on. ``data_loss`` is the rank's cross entropy over
    its local batch with ``reduction``. ``penalty`` is ``PENALTY[reduction] · Σ w²`` over
    the ``Linear``'s weight, the same number on every rank, when ``penalty_in_parts`` is
    ``False``; when it is ``True``, the same sum over this rank's rows of the weight only
    (:func:`penalty_rows`), so that the parts add up to the whole penalty. DDP's gradient
    must equal one process's gradient of the cross entropy over the whole global batch
    plus the whole penalty.

    For each world size in ``world_sizes`` the check resizes ``group``, runs real DDP on
    every rank for each case of :data:`CASES` (``"mean"`` with equal local batches only:
    ``"mean"`` over uneven ones needs the weighting of notebook 03's exercise, not this
    one's question), and compares with :func:`full_gradients`: it passes when no element
    is further than ``TOLERANCE`` times one process's largest element from it. Where it
    differs, it runs the learner's function again with the penalty zeroed and with the
    data loss zeroed, and names what each part's gradient came out as, times what one
    process gets, and why. The group's world size is restored afterwards.

    Args:
        group: a running :class:`~reducelab.LocalGroup`.
        ddp_loss: the learner's function; it runs on the ranks.
        X, y: the global batch, ``float32 (N, F)`` and ``int64 (N,)``; ``N`` must be
            divisible by every world size in ``world_sizes``.
        world_sizes: ints of 2 to 10 (the weight has 10 rows to share out).

    Returns:
        A :class:`Verdict` that names the first failing case and, for each part of the
        loss, the factor it found and why; it never shows a solution.

    Raises:
        ValueError: a world size below 2 or above 10, or ``N`` not divisible by one.
    """
    if not callable(ddp_loss):
        return failed(f"check_ddp_loss needs your function ddp_loss, got {ddp_loss!r}.")
    N = len(X)
    for W in world_sizes:
        if not 2 <= W <= 10:
            raise ValueError(f"world sizes must be from 2 (with one rank the plain sum "
                             f"passes) to 10 (the weight's rows, shared out when the "
                             f"penalty is computed in parts), got {W}")
        split_sizes(N, W, "equal")  # raises ValueError when N is not divisible by W
    full = {reduction: full_gradients(X, y, reduction) for reduction in REDUCTIONS}
    with restoring_world_size(group):
        for W in world_sizes:
            group.resize(W)
            verdict = _check_at(group, ddp_loss, X, y, W, N, full)
            if verdict is not None:
                return verdict
    sizes = " and ".join(str(w) for w in world_sizes)
    return passed(f"DDP's gradient equals one process's, penalty included, for 'sum' with "
                  f"equal and uneven local batches and 'mean' with equal ones, the penalty "
                  f"whole on every rank or in parts, on world_size {sizes}. DDP divides "
                  f"every gradient by world_size before it sums them: a term every rank "
                  f"computes alike comes out of that average as it went in; terms that "
                  f"differ from rank to rank (the data term, the parts of the penalty) add "
                  f"up, each divided by world_size.")


def _check_at(group, ddp_loss, X, y, W: int, N: int, full: dict) -> Verdict | None:
    """The failing :class:`Verdict` of the first wrong case at world size ``W``, or ``None``.
    ``full`` maps each reduction to its :func:`full_gradients` (one process's)."""
    for reduction, split, in_parts in CASES:
        data_full, penalty_full = full[reduction]
        sizes = split_sizes(N, W, split)
        case = (f"For reduction={reduction!r}, world_size={W}, {split} local batches "
                f"{sizes} (global batch {N}), "
                + (f"the penalty in parts (rank r: rows r, r + {W}, ... of the weight)"
                   if in_parts else "the whole penalty on every rank"))
        args = (X, y, reduction, split, in_parts, ddp_loss)
        try:
            ddp = group.run(_ddp_loss_gradient, *args)[0]
        except RankError as err:
            return raised_on_ranks(f"{case},", err)
        want = data_full + penalty_full
        if (ddp - want).abs().max().item() <= TOLERANCE * want.abs().max().item():
            continue
        try:
            data = group.run(_ddp_loss_gradient, *args, "data")[0]
            penalty = group.run(_ddp_loss_gradient, *args, "penalty")[0]
        except RankError as err:
            return raised_on_ranks(f"{case}, with one part of the loss zeroed,", err)
        data_said = _data_part(data, data_full, reduction, W, N)
        data_scaled = reduction == "sum" and not data_said   # the data term took world_size
        parts = [data_said,
                 _penalty_part(penalty, penalty_full, reduction, W, in_parts, data_scaled)]
        said = [s for s in parts if s]
        if not said:
            said = ["Each part alone comes out right, but not the two together: return "
                    "a loss whose gradient is the sum of theirs."]
        return failed(f"{case}: DDP's gradient differs from one process's. "
                      + " ".join(said))
    return None


def _data_part(got: torch.Tensor, want: torch.Tensor, reduction: str, W: int, N: int) -> str:
    cmp = compare_gradients(got, want)
    if cmp.constant and abs(cmp.factor - 1) < TOLERANCE:
        return ""
    found = (f"came out {_fmt(cmp.factor)} x one process's" if cmp.constant else
             f"is not a multiple of one process's (element-wise ratios "
             f"{cmp.ratio_min:.2f} to {cmp.ratio_max:.2f})")
    fixed = _fixed_number(cmp.factor * W, W) if cmp.constant and reduction == "sum" else ""
    if reduction == "sum":
        why = (f"DDP divides every rank's gradient by world_size={W} before it sums them, and "
               f"the local sums already add up to the full-batch sum.")
    else:
        why = (f"with 'mean' and equal local batches every rank's loss weighs each of its "
               f"{N // W} samples 1/{N // W}, DDP divides by world_size={W} before it sums, "
               f"and one process weighs each of the {N} samples 1/{N}.")
    return f"The data term's gradient {found}; expected 1 x.{fixed} Why: {why}"


def _fixed_number(m: float, W: int) -> str:
    """A hint when a term came out scaled by a whole number ``m`` other than 0, 1 and
    ``W``: a number written into the loss (a review found a hard-coded 4 at world size 3
    named only as "1.3333 x"). ``m`` is the factor the learner's loss applied."""
    n = round(m)
    if abs(m - n) > 1e-3 or n in (0, 1, W):
        return ""
    return (f" That is a factor {n} where world_size is {W}: a number written into the loss "
            f"does not follow the world size.")


def _penalty_part(got: torch.Tensor, want: torch.Tensor, reduction: str, W: int,
                  in_parts: bool, data_scaled: bool) -> str:
    """What the penalty's gradient did, or ``""`` when it is right. ``data_scaled``: the
    data term was multiplied by ``W`` (and rightly so), so a penalty multiplied by ``W``
    too is named as scaled like it."""
    b = want.double()
    k = (got.double() @ b / (b @ b)).item()
    constant = (got.double() - k * b).abs().max().item() <= TOLERANCE * b.abs().max().item()
    if constant and abs(k - 1) < TOLERANCE:
        return ""
    if constant and abs(k) < TOLERANCE:
        return ("The penalty's gradient is missing: the loss you return must still contain "
                "the penalty.")
    found = f"came out {_fmt(k)} x one process's" if constant else "is not a multiple of one process's"
    hint = " "
    if in_parts:
        if constant and abs(k - 1 / W) < 1e-3:
            hint = " That is each rank's part left as it is. "
        elif constant and _fixed_number(k * W, W):
            hint = _fixed_number(k * W, W) + " "
        why = (f"Each rank's part covers other rows of the weight, so the ranks' penalty "
               f"gradients differ (each is zero outside its own rows), and DDP sums the "
               f"{W} of them after dividing each by {W}.")
    else:
        if constant and abs(k - W) < 1e-3 * W:
            hint = (f" That is the penalty scaled like the data term, by world_size={W}. "
                    if data_scaled else
                    f" That is the penalty multiplied by world_size={W}. ")
        elif constant and abs(k - 1 / W) < 1e-3:
            hint = (f" That is 1/{W} of it, as if each rank divided the penalty by "
                    f"world_size={W}, or one rank alone added it. ")
        elif constant and _fixed_number(k, W):
            hint = _fixed_number(k, W) + " "
        why = (f"When every rank adds the same penalty, computed from the same weights, every "
               f"rank's penalty gradient is the same, and DDP's divide-by-{W}-then-sum of {W} "
               f"equal gradients gives that gradient back.")
    return f"The penalty's gradient {found}; expected 1 x.{hint}{why}"

