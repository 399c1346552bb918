"""Checks and byte formulas for notebook 06 (ring all_reduce built from send and recv).

The formulas are the ones notebook 06 measures on real ranks: in a ring all_reduce
(a reduce-scatter phase, then an all-gather phase, ``world_size - 1`` steps each) every
rank sends ``2 (N - 1) / N * S`` bytes for a tensor of ``S`` bytes on ``N`` ranks.

Sources: Patarasuk & Yuan (2009), "Bandwidth optimal all-reduce algorithms for clusters
of workstations", J. Parallel Distrib. Comput. 69(2), 117-124; Sergeev & Del Balso
(2018), "Horovod: fast and easy distributed deep learning in TensorFlow",
arXiv:1802.05799; ``torch.distributed.isend`` / ``recv`` / ``all_gather_into_tensor``,
https://pytorch.org/docs/stable/distributed.html
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, restoring_world_size


# --- byte formulas ----------------------------------------------------------------------
def _check_sizes(world_size, size_bytes) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float)) or size_bytes < 0:
        raise ValueError(f"size_bytes must be a number of bytes >= 0, got {size_bytes!r}")


def ring_bytes_per_rank(world_size: int, size_bytes: float) -> float:
    """Bytes each rank sends in a ring all_reduce: ``2 (N - 1) / N * S``.

    ``N - 1`` reduce-scatter steps and ``N - 1`` all-gather steps, each sending one chunk
    of ``S / N`` bytes. With chunks of unequal size (``S`` not divisible by ``N``) this is
    the mean over ranks; each rank is within one chunk's rounding of it.

    Args:
        world_size: ``N``, the number of ranks (int >= 1).
        size_bytes: ``S``, the tensor's size in bytes (``numel * element_size``).

    Raises:
        ValueError: a negative or non-numeric size, or ``world_size < 1``.
    """
    _check_sizes(world_size, size_bytes)
    return 2 * (world_size - 1) / world_size * size_bytes


def naive_bytes_per_rank(world_size: int, size_bytes: float) -> float:
    """Bytes each rank sends when it sends its whole tensor to every other rank: ``S (N - 1)``.

    Raises:
        ValueError: as :func:`ring_bytes_per_rank`.
    """
    _check_sizes(world_size, size_bytes)
    return (world_size - 1) * size_bytes


def root_bytes(world_size: int, size_bytes: float) -> float:
    """Bytes the root sends in reduce-then-broadcast through one root: ``S (N - 1)``.

    Every other rank sends ``S`` (its tensor, to the root); the root sends the sum to each
    of the ``N - 1`` others. Same total as the ring, ``2 (N - 1) S``, but piled on one rank.

    Raises:
        ValueError: as :func:`ring_bytes_per_rank`.
    """
    _check_sizes(world_size, size_bytes)
    return (world_size - 1) * size_bytes


def contributors(value: float, world_size: int) -> list[int]:
    """Ranks whose input is in ``value``, when rank ``r``'s input is ``2 ** r``.

    Notebook 06 gives rank ``r`` the value ``2.0 ** r``; a sum of distinct powers of two
    is exact in float32 for ``world_size <= 24`` and its binary digits say which ranks it
    contains: ``contributors(11.0, 4) == [0, 1, 3]``.

    Raises:
        ValueError: ``value`` is not a whole number in ``0 .. 2 ** world_size - 1``.
    """
    v = float(value)
    if not v.is_integer() or not 0 <= v < 2 ** world_size:
        raise ValueError(f"{value!r} is not a sum of distinct 2**rank for world_size={world_size}")
    bits = int(v)
    return [r for r in range(world_size) if bits >> r & 1]


# --- the exercise: all_gather from the ring's all-gather phase ------------------------
EXERCISE_WORLD_SIZES = (2, 3, 4)
EXERCISE_NUMEL = 3
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                "all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object")


def exercise_input(rank: int, numel: int = EXERCISE_NUMEL) -> torch.Tensor:
    """The tensor rank ``rank`` holds in notebook 06's exercise: float32, shape ``(numel,)``.

    Element ``i`` is ``10 * rank + i + 1`` (rank 2 holds 21, 22, 23), so a gathered slice
    says at a glance whose tensor it is.
    """
    return 10.0 * rank + torch.arange(1, numel + 1, dtype=torch.float32)


def _run_exercise(fn, numel):
    """Runs on each rank: call ``fn(x)`` with collectives forbidden and sends counted."""
    rank = dist.get_rank()
    x = exercise_input(rank, numel)
    counted = {"bytes": 0, "calls": 0}
    saved = {name: getattr(dist, name) for name in _COLLECTIVES + ("isend", "send")
             if hasattr(dist, name)}

    def forbid(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"the exercise builds all_gather from send_recv; "
                               f"your function called dist.{name}")
        return refuse

    def counting(original):
        def wrapper(tensor, *args, **kwargs):
            counted["bytes"] += tensor.numel() * tensor.element_size()
            counted["calls"] += 1
            return original(tensor, *args, **kwargs)
        return wrapper

    try:
        for name in _COLLECTIVES:
            if name in saved:
                setattr(dist, name, forbid(name))
        dist.isend, dist.send = counting(saved["isend"]), counting(saved["send"])
        out = fn(x.clone())
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    # the reference, with the real collective (after restoring it)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return out, torch.cat(parts), counted["bytes"]


def _whose(slice_: torch.Tensor, world_size: int, numel: int):
    for r in range(world_size):
        if slice_.shape == (numel,) and torch.equal(slice_, exercise_input(r, numel)):
            return r
    return None


def check_ring_all_gather(group: LocalGroup, fn, world_sizes=EXERCISE_WORLD_SIZES,
                          numel: int = EXERCISE_NUMEL) -> Verdict:
    """Exercise of notebook 06: ``fn(x)`` is ``all_gather`` built from the ring.

    On rank ``r``, ``fn`` gets ``x = exercise_input(r, numel)`` (float32, shape
    ``(numel,)``) and must return a float32 tensor of shape ``(world_size * numel,)``
    whose slice ``i`` is rank ``i``'s ``x``, the result of
    ``dist.all_gather`` concatenated, sending only with ``dist.isend``/``dist.send`` (each
    rank may send ``(world_size - 1) * numel * 4`` bytes, as in the ring's all-gather
    phase). Collectives are disabled on the ranks while ``fn`` runs, and every byte
    passed to ``isend``/``send`` is counted.

    Runs on real ranks at each world size in ``world_sizes`` (the group is resized, then
    restored) and compares with the real ``all_gather`` on the same ranks.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says, for a wrong answer, which rank's
        slice holds what and why.
    """
    with restoring_world_size(group):
        for n in world_sizes:
            group.resize(n)
            try:
                out = group.run(_run_exercise, fn, numel)
            except RankError as e:
                stuck = [r for r in e.reports if r.state == "stuck"]
                if stuck and all("send" in r.summary and "isend" not in r.summary for r in stuck):
                    return failed(f"With world_size={n} every rank waited in a blocking "
                                  f"dist.send: each waits for its right neighbour to receive, "
                                  f"and none receives. Send with dist.isend (or use send_recv), "
                                  f"then recv, then wait on the send.")
                first = e.reports[0].summary if e.reports else ""
                return failed(f"With world_size={n} your function failed on the ranks: "
                              f"{e.headline}. {first}")
            per_rank = (n - 1) * numel * 4
            for r, (got, want, sent) in enumerate(out):
                if not isinstance(got, torch.Tensor):
                    return failed(f"With world_size={n}, rank {r} returned {got!r}; expected a "
                                  f"tensor of {n * numel} elements: {want}.")
                if got.shape != want.shape:
                    return failed(f"With world_size={n}, rank {r} returned shape "
                                  f"{tuple(got.shape)}; expected {tuple(want.shape)}: "
                                  f"world_size slices of {numel} elements, slice i from rank i.")
                if not torch.equal(got.float(), want):
                    problems = []
                    for i, piece in enumerate(got.float().tensor_split(n)):
                        if torch.equal(piece, exercise_input(i, numel)):
                            continue
                        holder = _whose(piece, n, numel)
                        if holder is not None:
                            problems.append(f"slice {i} holds rank {holder}'s tensor")
                        elif not piece.any():
                            problems.append(f"slice {i} is still zero (never received)")
                        else:
                            problems.append(f"slice {i} holds {piece.tolist()}")
                    hint = ""
                    if any("holds rank" in p for p in problems):
                        hint += (" Some data arrived but landed in the wrong slice: receive "
                                 "the left neighbour's slice into the slice of the rank it "
                                 "came from, (r - s - 1) % n at step s.")
                    if any("never received" in p for p in problems):
                        hint += (f" After {n - 1} ring step{'s' if n > 2 else ''} every slice "
                                 f"must have arrived: at step s rank r sends the slice it "
                                 f"received at step s - 1 (its own at step 0), that is slice "
                                 f"(r - s) % n, and receives slice (r - s - 1) % n from "
                                 f"rank r - 1.")
                    return failed(f"With world_size={n}, rank {r} returned {got}, expected "
                                  f"{want}: {'; '.join(problems)}.{hint}")
                if sent != per_rank:
                    return failed(f"With world_size={n}, the result is right, but rank {r} "
                                  f"passed {sent} bytes to isend/send; the ring's all-gather "
                                  f"phase sends {n - 1} slices of {numel * 4} bytes = "
                                  f"{per_rank} bytes. Send one slice per step, not the whole "
                                  f"output.")
        return passed(f"At world sizes {', '.join(map(str, world_sizes))} every rank gathered "
                      f"every rank's tensor in world_size - 1 ring steps, sending "
                      f"(world_size - 1) x {numel * 4} bytes: the same as the real all_gather. "
                      f"This is the ring's all-gather phase, started from each rank's own "
                      f"slice instead of a reduced chunk.")
