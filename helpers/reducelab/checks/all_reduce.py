"""Checks for notebook 01 (all_reduce and the reduce ops).

Source: ``torch.distributed.all_reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the learner
question "Why do values increase significantly after `torch.dist.all_reduce`?" (2025-01-30).
"""
from __future__ import annotations

import torch

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, collectives_except, failed, passed, raised_on_ranks, restoring_world_size

ATOL = 1e-5
"""Tolerance of the exercise's check, absolute and relative (float32 rounding of sums of
a few small whole numbers, and of a square root)."""


def local_values(rank: int, n: int = 4) -> torch.Tensor:
    """The tensor rank ``rank`` holds in the exercise: float32, shape ``(n,)``.

    Element ``i`` is ``(rank + 1) * (i + 1)``, so ranks differ and averages are not whole.
    """
    return (rank + 1.0) * torch.arange(1, n + 1, dtype=torch.float32)


def reference_spread(world_size: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """What every rank must return in the exercise, computed in one process in float64:
    ``(mean, std)`` over ranks of ``local_values(rank, n)``, element-wise, both shape
    ``(n,)``. ``std`` is the population standard deviation (divided by ``world_size``,
    ``torch.std(..., correction=0)``)."""
    xs = torch.stack([local_values(r, n) for r in range(world_size)]).double()
    return xs.mean(0), xs.std(0, correction=0)


def _likely_mistakes(world_size: int, n: int, rank: int) -> dict[str, tuple[str, torch.Tensor]]:
    # What the common wrong recipes return for the std on rank ``rank``, computed in one
    # process, with what to say about each: the check compares the learner's std with
    # every one. Some coincide at a small world size (see _diagnose), so the order
    # matters: the first that fits every rank is named.
    xs = torch.stack([local_values(r, n) for r in range(world_size)]).double()
    mean, total = xs.mean(0), xs.sum(0)
    var = xs.var(0, correction=0)
    mine = xs[rank]
    return {
        "variance": (
            "That is the variance over ranks, the square of the standard deviation: take "
            "its square root.", var),
        "not reduced": (
            "That is this rank's own distance from the mean, |x - mean|: the squared "
            "distances were never added up over the ranks, so each rank returns its own "
            "number. Every rank should return the same spread.", (mine - mean).abs()),
        "undivided": (
            f"That is the square root of the summed squared distances, never divided by "
            f"world_size = {world_size}: a sum over ranks, not a mean over them.",
            (var * world_size).sqrt()),
        "sample": (
            f"That is the sample standard deviation, divided by world_size - 1 = "
            f"{world_size - 1}: the exercise asks for the population one, divided by "
            f"world_size = {world_size}, as torch.std(..., correction=0) computes it.",
            xs.std(0, correction=1)),
        "rms": (
            "That is the root of the mean of the squares, sqrt(mean(x**2)): the mean itself "
            "was never taken off, so this measures how large the values are, not how far "
            "apart the ranks are.", (xs ** 2).mean(0).sqrt()),
        "in place": (
            "That comes from squaring x after all_reduce had overwritten it with the sum: "
            "all_reduce works in place, so x no longer holds this rank's own values. Keep "
            "them (reduce a clone, or square before you reduce).",
            (total ** 2 - (total / world_size) ** 2).clamp(min=0).sqrt()),
        "in place, distances": (
            "That comes from the distances of the SUM from the mean: all_reduce works in "
            "place, so after it x holds the sum over ranks, not this rank's own values. "
            "Keep them (reduce a clone).", (total - mean).abs()),
        "mean absolute deviation": (
            "That is the mean absolute deviation, the mean over ranks of |x - mean|: a "
            "spread, but not the standard deviation. Square the distances before you "
            "average them, and take the square root last.", (xs - mean).abs().mean(0)),
        "local": (
            "That is the spread of this rank's own elements (torch.std over the tensor), "
            "not the spread of element i across the ranks: each element needs the values "
            "of every rank, which only a collective brings.",
            mine.std(correction=0).expand(n)),
        "local sample": (
            "That is the spread of this rank's own elements (torch.std over the tensor), "
            "not the spread of element i across the ranks: each element needs the values "
            "of every rank, which only a collective brings.",
            mine.std(correction=1).expand(n)),
    }


def _std_of(reply):
    # The std a rank returned, or None if its reply is not a (mean, std) pair of tensors.
    got = reply[0]
    if isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], torch.Tensor):
        return got[1]
    return None


def _diagnose(out: list, world_size: int, n: int, rank: int) -> str:
    """What to say about rank ``rank``'s wrong std: the first likely mistake that gives
    every rank's std, else the first that gives this rank's. Two coincide at
    world_size 2 (no division and the sample std's division by 1), and one rank's
    |x - mean| can equal the sample std (rank 0 at world_size 3), which is why every
    rank is compared."""
    per_rank = [_likely_mistakes(world_size, n, r) for r in range(world_size)]
    std = _std_of(out[rank])
    mine = [name for name, (_, value) in per_rank[rank].items() if _close(std, value)]
    everywhere = [name for name in mine
                  if all(_std_of(reply) is not None and _close(_std_of(reply), per_rank[r][name][1])
                         for r, reply in enumerate(out))]
    if {"undivided", "sample"} <= set(everywhere):
        return (f"That is the square root of the summed squared distances divided by "
                f"world_size - 1 = {world_size - 1} (the sample standard deviation), or "
                f"never divided at all: at world_size {world_size} the two are the same. The "
                f"exercise asks for the population one, divided by world_size = "
                f"{world_size}, as torch.std(..., correction=0) computes it.")
    name = (everywhere or mine or [None])[0]
    return per_rank[rank][name][0] if name else ""


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got.double(), want.double(),
                                                      atol=ATOL, rtol=ATOL)


OTHER_COLLECTIVES = collectives_except("all_reduce")
"""Collectives and point-to-point calls of ``torch.distributed`` other than all_reduce,
which the exercise of notebook 01 does not use: each call of one is recorded by name."""


def _run_recording_all_reduce(fn, n: int):
    # Runs on every rank: the learner's fn(n), with the op of each dist.all_reduce call
    # recorded, so that a check can tell "never reduced" from "reduced a copy" and see
    # an op other than SUM, and the name of every other collective called (an all_gather
    # and torch.std compute the spread without all_reduce). Returns (result, ops, others),
    # ops as names ("SUM", "AVG", ...), others as dist's names ("all_gather", ...).
    import torch.distributed as dist
    original, ops, others = dist.all_reduce, [], []
    saved = {name: getattr(dist, name) for name in OTHER_COLLECTIVES if hasattr(dist, name)}

    def recorded(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        ops.append(next((name for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND",
                                           "BOR", "BXOR") if op == getattr(dist.ReduceOp, name)),
                        "another op"))
        return original(tensor, op, *args, **kwargs)

    def named(name, call):
        def wrapper(*args, **kwargs):
            others.append(name)
            return call(*args, **kwargs)
        return wrapper

    dist.all_reduce = recorded
    for name, call in saved.items():
        setattr(dist, name, named(name, call))
    try:
        result = fn(n)
    finally:
        dist.all_reduce = original
        for name, call in saved.items():
            setattr(dist, name, call)
    return result, ops, others


def check_spread_over_ranks(group: LocalGroup, fn, world_sizes=(2, 3, 4), n: int = 4) -> Verdict:
    """The exercise of notebook 01: ``fn(n)`` runs on every rank, starts from
    ``local_values(rank, n)``, and must return ``(mean, std)``: the element-wise mean and
    population standard deviation over ranks, both float tensors of shape ``(n,)``, on
    every rank, using ``dist.all_reduce`` with ``ReduceOp.SUM`` only.

    Runs ``fn`` on real ranks at each world size in ``world_sizes`` (the group is resized,
    then restored) and compares with :func:`reference_spread` (tolerance :data:`ATOL`).
    The op of every ``dist.all_reduce`` call made through the ``torch.distributed``
    module is recorded on each rank, and the name of every other collective called
    through it (:data:`OTHER_COLLECTIVES`), so a wrong answer can say what went wrong:
    another collective (an ``all_gather``, then ``torch.std``, leaves no division to
    write), an op other than ``SUM`` (``AVG`` does the division the exercise asks the
    learner to write), no all_reduce at all, a reduced copy, the SUM left undivided, and for the
    spread the variance, each rank's own distance from the mean (the squares never
    reduced: right at world_size 2 only), the summed squares never divided, the sample
    standard deviation, the root mean square, squares or distances of a tensor that
    all_reduce had already overwritten, and the spread of one rank's own elements; a
    mistake is named only if it gives every rank's std where one rank's could mislead
    (:func:`_diagnose`). No message prints a line of the solution.

    Returns:
        A :class:`~reducelab.checks.Verdict` that explains a wrong answer.
    """
    with restoring_world_size(group):
        for ws in world_sizes:
            group.resize(ws)
            try:
                out = group.run(_run_recording_all_reduce, fn, n)
            except RankError as e:
                return raised_on_ranks(f"With world_size={ws}", e)
            want_mean, want_std = reference_spread(ws, n)
            at = f"With world_size={ws}, rank"
            for r, (got, ops, others) in enumerate(out):
                if others:
                    message = (f"{at} {r} called dist.{others[0]}. The exercise asks for "
                               f"dist.all_reduce with ReduceOp.SUM only: each rank "
                               f"contributes its sums, and you write every division.")
                    if "gather" in others[0]:
                        message += (" With every rank's values gathered, torch.mean and "
                                    "torch.std do the arithmetic for you, and every rank "
                                    "receives world_size tensors where all_reduce delivers one.")
                    return failed(message)
                other = sorted({op for op in ops if op != "SUM"})
                if other:
                    return failed(
                        f"{at} {r} called all_reduce with "
                        f"{'an op other than SUM' if other[0] == 'another op' else 'ReduceOp.' + other[0]}. The exercise "
                        f"asks for ReduceOp.SUM only: you write the division yourself, as "
                        f"you must where AVG does not exist (integer tensors on gloo, "
                        f"older torch, some backends).")
                if not (isinstance(got, (tuple, list)) and len(got) == 2
                        and all(isinstance(t, torch.Tensor) for t in got)):
                    return failed(f"{at} {r} returned {_short(got)}; expected a pair of "
                                  f"tensors (mean, std), each of shape ({n},).")
                mean, std = got
                if not _close(mean, want_mean):
                    return failed(f"{at} {r} returned the mean {mean}, expected "
                                  f"{want_mean.float()}.{_mean_hint(mean, ws, n, r, ops)}")
                if not _close(std, want_std):
                    hint = _diagnose(out, ws, n, r)
                    if not hint and not ops:
                        hint = ("Your function never called dist.all_reduce, so no rank saw "
                                "the other ranks' values.")
                    return failed(f"The mean is right. {at} {r} returned the std {std}, "
                                  f"expected {want_std.float()}. {hint}".rstrip())
        return passed(
            f"Every rank returned the mean and the standard deviation over ranks at world "
            f"sizes {', '.join(map(str, world_sizes))}, with ReduceOp.SUM only. "
            f"A SUM divided by world_size is "
            f"a mean; a SUM of squared distances from that mean, divided by world_size, "
            f"is a variance. A one-pass E[x²] - mean² (x and x² in one all_reduce) passes "
            f"this check too and saves a collective, but the two-pass form is preferred: "
            f"where the ranks differ little next to their mean, E[x²] and mean² agree in "
            f"almost all of float32's 7 digits and their difference keeps mostly rounding "
            f"error: ranks holding 10001 to 10004 get a variance of 0 or below, not 1.25.")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _mean_hint(mean: torch.Tensor, ws: int, n: int, rank: int, ops: list[str]) -> str:
    want, _ = reference_spread(ws, n)
    if _close(mean, want * ws):
        return (f" That is the SUM, {ws} times too big: all_reduce(SUM) adds the ranks' "
                f"tensors; the mean is that sum divided by dist.get_world_size().")
    if _close(mean, local_values(rank, n)):
        if not ops:
            return (" That is the rank's own input: nothing was reduced into it, since "
                    "your function never called dist.all_reduce.")
        return (" That is the rank's own input: did you reduce a copy and return the "
                "original? all_reduce works in place, on the tensor you pass it.")
    if not ops:
        return " Your function never called dist.all_reduce, so no rank saw the others' values."
    return ""
