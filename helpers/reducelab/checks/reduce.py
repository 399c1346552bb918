"""Checks for notebook 02 (reduce, in-place buffers and aliasing).

Source: ``torch.distributed.reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce ("Input and
output of the collective. The function operates in-place."); the learner question "Why
does `torch.distributed.reduce` affect tensors other than the destination?" (2025-01-30).
"""
from __future__ import annotations

import torch

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

SIZES = (4, 16)
"""Tensor sizes (elements) the exercise check tries; at both, gloo's reduce changes every
non-dst rank's tensor at world_size 2..4, with dst 0 or the last rank."""
WORLD_SIZES = (2, 3, 4)
"""World sizes the exercise check tries."""


def exercise_input(rank: int, n: int) -> torch.Tensor:
    """The tensor rank ``rank`` passes to the learner's function: float32, shape ``(n,)``.

    Every element is ``10.0 ** rank`` (1, 10, 100, ...), so the digits of a sum say which
    ranks are in it: 1101 holds ranks 0, 2 and 3.
    """
    return torch.full((n,), 10.0 ** rank)


def _on_rank(fn, n: int, dst: int):
    # Runs on every rank: hand the learner's function a fresh input and report what happened.
    import torch.distributed as dist
    x = exercise_input(dist.get_rank(), n)
    before = x.clone()
    result = fn(x, dst)
    return before, x.clone(), result.clone() if isinstance(result, torch.Tensor) else result


def check_reduce_keep_input(group: LocalGroup, fn, world_sizes=WORLD_SIZES) -> Verdict:
    """Exercise of notebook 02: ``fn(x, dst)`` must return the sum over ranks of ``x`` on
    rank ``dst`` and leave every rank's ``x`` as it was.

    Runs ``fn`` on the group's real ranks at each world size in ``world_sizes`` (the
    group is resized, then put back), with ``x = exercise_input(rank, n)`` for ``n`` in
    :data:`SIZES` and ``dst`` in ``{0, world_size - 1}``, and compares with a
    single-process reference: on ``dst`` the returned tensor must equal
    ``sum(exercise_input(r, n) for r in ranks)``; on every rank ``x`` must be unchanged.
    What ``fn`` returns on other ranks is not checked (the docs promise nothing there).
    A failing verdict explains what went wrong; it never shows the solution.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on.
        fn: the learner's function, run on every rank as ``fn(x, dst)`` with ``x`` a
            float32 tensor of shape ``(n,)`` and ``dst`` an int.
        world_sizes: ints of 2 or more.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says what was expected and why.

    Raises:
        ValueError: a world size below 2 (with one rank reduce changes nothing to check).
    """
    if not world_sizes or min(world_sizes) < 2:
        raise ValueError(f"world_sizes must be 2 or more ranks each, got {world_sizes!r}: "
                         f"with one rank there is no other rank whose x could change")
    with restoring_world_size(group):
        for ws in world_sizes:
            group.resize(ws)
            verdict = _check_at(group, fn, ws)
            if verdict is not None:
                return verdict
    return passed(f"dst got the sum and every rank's x was unchanged, at world sizes "
                  f"{', '.join(map(str, world_sizes))}, dst the first or the last rank, "
                  f"and {' and '.join(map(str, SIZES))} elements. Keeping the input costs "
                  f"one extra tensor of the same size on every rank.")


def _check_at(group: LocalGroup, fn, ws: int) -> Verdict | None:
    """The failing verdict at world size ``ws``, or ``None`` when ``fn`` is right there."""
    for n in SIZES:
        want = sum(exercise_input(r, n) for r in range(ws))
        for dst in sorted({0, ws - 1}):
            try:
                out = group.run(_on_rank, fn, n, dst)
            except RankError as e:
                return raised_on_ranks(f"With world_size={ws}, dst={dst} and {n} elements", e)
            changed = [r for r, (before, after, _) in enumerate(out)
                       if not torch.equal(before, after)]
            if changed:
                # show a non-dst rank first: that is the surprise this exercise is about
                r = next((r for r in changed if r != dst), changed[0])
                before, after, _ = out[r]
                where = "dst" if r == dst else "not dst"
                return failed(
                    f"With world_size={ws}, dst={dst} and {n} elements, x changed on "
                    f"{'rank' if len(changed) == 1 else 'ranks'} "
                    f"{', '.join(map(str, changed))}; expected it unchanged everywhere. "
                    f"On rank {r} ({where}) x was {before.tolist()} before your function "
                    f"and {after.tolist()} after it. dist.reduce writes into the very "
                    f"tensor you pass it, on every rank: the sum on dst, and gloo's "
                    f"partial sums on the others. So x itself must not be the tensor that "
                    f"goes into dist.reduce.")
            got = out[dst][2]
            if not isinstance(got, torch.Tensor):
                return failed(f"With world_size={ws}, dst={dst}, rank {dst} (dst) returned "
                              f"{got!r}; expected a tensor holding the sum over ranks, "
                              f"{want.tolist()}. Return the tensor you reduced.")
            if got.shape != want.shape or not torch.allclose(got.float(), want):
                hint = ""
                if got.shape == want.shape and torch.equal(got.float(), out[dst][0]):
                    hint = (" That is dst's own input: the sum is in the tensor you passed "
                            "to dist.reduce, so return that one.")
                return failed(f"With world_size={ws}, dst={dst} and {n} elements, rank {dst} "
                              f"(dst) returned {got.tolist()}; expected the sum over ranks, "
                              f"{want.tolist()}.{hint}")
    return None
