"""Checks for notebook 01 (all_reduce and the reduce ops).

Source: ``torch.distributed.all_reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the learner
question "Why do values increase significantly after `torch.dist.all_reduce`?" (2025-01-30).
"""
from __future__ import annotations

import torch

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size


def _reference_mean(world_size: int, n: int) -> torch.Tensor:
    # what each rank's local_values(rank, n) holds, averaged over ranks, in one process
    return torch.stack([local_values(r, n) for r in range(world_size)]).mean(dim=0)


def local_values(rank: int, n: int = 4) -> torch.Tensor:
    """The tensor rank ``rank`` holds in the exercise: float32, shape ``(n,)``.

    Element ``i`` is ``(rank + 1) * (i + 1)``, so ranks differ and averages are not whole.
    """
    return (rank + 1.0) * torch.arange(1, n + 1, dtype=torch.float32)


def _run_counting_all_reduce(fn, n: int):
    # Runs on every rank: the learner's fn(n), with dist.all_reduce counted, so that a
    # check can tell "never reduced" from "reduced a copy". Returns (result, calls).
    import torch.distributed as dist
    original, calls = dist.all_reduce, []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        result = fn(n)
    finally:
        dist.all_reduce = original
    return result, len(calls)


def check_mean_over_ranks(group: LocalGroup, fn, world_sizes=(2, 3, 4)) -> Verdict:
    """Exercise 1 of notebook 01: ``fn(n)`` must return the element-wise mean over ranks
    of ``local_values(rank, n)``, on every rank, using only ``ReduceOp.SUM``.

    Runs ``fn`` on real ranks at each world size in ``world_sizes`` (the group is resized,
    then restored), and compares with a single-process reference (tolerance 1e-6). Calls
    of ``dist.all_reduce`` made through the ``torch.distributed`` module are counted on
    each rank, so that a wrong answer says whether anything was reduced at all.

    Returns:
        A :class:`~reducelab.checks.Verdict` that explains a wrong answer.
    """
    with restoring_world_size(group):
        for ws in world_sizes:
            group.resize(ws)
            try:
                out = group.run(_run_counting_all_reduce, fn, 4)
            except RankError as e:
                return raised_on_ranks(f"With world_size={ws}", e)
            want = _reference_mean(ws, 4)
            for r, (got, calls) in enumerate(out):
                if not isinstance(got, torch.Tensor):
                    return failed(f"With world_size={ws}, rank {r} returned {got!r}; "
                                  f"expected a tensor like {want}.")
                if got.shape != want.shape or not torch.allclose(got.float(), want, atol=1e-6):
                    hint = ""
                    if got.shape == want.shape and torch.allclose(got.float(), want * ws, atol=1e-5):
                        hint = (f" That is the SUM, {ws} times too big: all_reduce(SUM) adds "
                                f"the ranks' tensors, so divide by dist.get_world_size().")
                    elif got.shape == want.shape and torch.allclose(
                            got.float(), local_values(r, 4), atol=1e-6):
                        hint = (" You returned the rank's own input: nothing was reduced "
                                "into x, since your function never called dist.all_reduce."
                                if calls == 0 else
                                " That is the rank's own input: did you call all_reduce on "
                                "a copy and return the original? all_reduce works in place.")
                    elif calls == 0:
                        hint = (" Your function never called dist.all_reduce, so no rank "
                                "saw the other ranks' values.")
                    return failed(f"With world_size={ws}, rank {r} returned {got}, expected "
                                  f"{want}.{hint}")
        return passed(f"Every rank returned the mean over ranks at world sizes "
                      f"{', '.join(map(str, world_sizes))}: all_reduce(SUM) then / world_size "
                      f"is what ReduceOp.AVG computes, and what DDP does to gradients.")
