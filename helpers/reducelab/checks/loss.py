"""Checks for notebook 03 (how to aggregate the loss from all ranks).

Source: ``torch.distributed.all_reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the
learner question "How can I aggregate losses from all GPUs in DistributedDataParallel?"
(2025-01-30).
"""
from __future__ import annotations

import math

import torch

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

UNEVEN_BATCHES = ((3, 5, 8, 2), (4, 0, 3))
"""Local batch sizes, one per rank, that :func:`check_global_mean_loss` runs with. The
second has an empty local batch on rank 1: a rank can end up with no sample (the last
batch of an epoch, samples masked out of the loss), and then its local mean is nan."""

COLLECTIVE_NAMES = {"allreduce_": "all_reduce", "allgather_": "all_gather",
                    "_allgather_base_": "all_gather_single", "broadcast_": "broadcast",
                    "reduce_": "reduce", "reduce_scatter_": "reduce_scatter",
                    "_reduce_scatter_base_": "reduce_scatter_single", "gather_": "gather",
                    "scatter_": "scatter", "alltoall_": "all_to_all", "barrier": "barrier",
                    "send": "send", "recv_": "recv"}
"""torch.distributed's name for each c10d op that ``CommDebugMode`` counts (in torch 2.13,
``all_gather_single`` and ``reduce_scatter_single``; the deprecated
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` call them)."""


def exercise_losses(rank: int, local_batch_size: int) -> torch.Tensor:
    """Per-sample losses rank ``rank`` holds in the exercise: float32, shape ``(local_batch_size,)``
    (``(0,)`` for an empty local batch).

    Seeded from the rank; higher ranks hold larger losses, so a mean of per-rank means
    is visibly different from the global mean when local batch sizes differ.
    """
    g = torch.Generator().manual_seed(rank)
    return torch.rand(local_batch_size, generator=g) + rank


def _run_learner(fn, local_batch_sizes):
    """Runs on every rank: the learner's ``fn`` on this rank's per-sample losses.

    Returns ``(kind, value, collectives)``: ``kind`` is ``"value"``, ``"shape"`` or
    ``"type"``; ``collectives`` is ``{name: calls}`` of the collectives ``fn`` made,
    counted with torch's ``CommDebugMode`` (which sees every c10d op, whichever way
    ``fn`` called it).
    """
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    rank = dist.get_rank()
    with CommDebugMode() as comm:
        out = fn(exercise_losses(rank, local_batch_sizes[rank]))
    collectives = {}
    for op, calls in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        name = COLLECTIVE_NAMES.get(name, name)
        collectives[name] = collectives.get(name, 0) + calls
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            return ("shape", tuple(out.shape), collectives)
        return ("value", float(out.detach()), collectives)
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return ("value", float(out), collectives)
    return ("type", type(out).__name__, collectives)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def _calls(collectives: dict) -> str:
    """``{"all_reduce": 2}`` as ``"called all_reduce 2 times"``; ``{}`` as ``"called no collective"``."""
    if not collectives:
        return "called no collective"
    return "called " + " and ".join(f"{name} {'once' if n == 1 else f'{n} times'}"
                                    for name, n in collectives.items())


def _diagnose(got: float, rank: int, sizes: tuple[int, ...], losses: list[torch.Tensor]) -> str:
    """Name what ``got`` on ``rank`` is, and why it is not the global mean; or ``""``.
    Says what went wrong, never how to write the function."""
    ws = len(sizes)
    if math.isnan(got):
        empty = [r for r, n in enumerate(sizes) if n == 0]
        if empty:
            return (f"Rank {empty[0]} holds no sample here, and the mean of an empty tensor is nan "
                    f"(0 / 0): torch.tensor([]).mean() is tensor(nan). A nan that enters an "
                    f"all_reduce makes the result nan on every rank.")
        return "A nan entered the all_reduce on some rank, and made the result nan on every rank."
    total = float(torch.cat(losses).sum())
    count = sum(sizes)
    local = losses[rank]
    known = [(float(local.sum()) / count,
              "That is this rank's own loss sum divided by the global number of samples: the "
              "other ranks' losses are not in the sum."),
             (total, f"That is the sum of all {count} losses, not their mean."),
             (total / ws, f"That is the sum of all the losses divided by world_size={ws}: "
                          f"world_size counts ranks, not samples.")]
    if sizes[rank]:
        known += [
            (float(local.mean()), "That is this rank's own local mean: the other ranks' losses "
                                  "are not in it."),
            (total / sizes[rank], f"That is the sum of all the losses divided by this rank's own "
                                  f"local batch size, {sizes[rank]}: each rank divides by a "
                                  f"different number.")]
    if all(sizes):
        mean_of_means = float(torch.stack([l.mean() for l in losses]).mean())
        known.insert(0, (mean_of_means,
                         f"That is the mean of the per-rank means, all_reduce(loss) / world_size: "
                         f"it weights each rank equally, so a rank with {min(sizes)} samples "
                         f"counts as much as a rank with {max(sizes)}."))
    for value, why in known:
        if _close(got, value):
            return why
    return ""


def check_global_mean_loss(group: LocalGroup, fn, local_batch_sizes=UNEVEN_BATCHES) -> Verdict:
    """Exercise of notebook 03: ``fn(per_sample_losses)`` must return the global mean loss,
    with one all_reduce per rank.

    ``fn`` runs on every rank of real gloo ranks and receives that rank's per-sample
    losses (:func:`exercise_losses`, a 1-D float32 tensor whose length is the rank's local
    batch size, possibly 0). It must return, on every rank, the mean over every sample of
    the global batch (each sample counted once): a float or a one-element tensor. And it
    must make exactly one collective, an all_reduce (counted on each rank with
    ``torch.distributed.tensor.debug.CommDebugMode``).

    For each entry of ``local_batch_sizes`` (local batch sizes, one per rank) the group is
    resized to that world_size, ``fn`` is run, and each rank's answer is compared with the
    mean of the concatenated losses computed in one process (relative tolerance 1e-5),
    then its collectives are counted. The group's world_size is restored afterwards.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says what was expected and, for the
        usual mistakes (mean of means, nan from an empty local batch, a missing
        all_reduce, a wrong count), what the rank returned instead; it never says how to
        write the function.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn must be the function to run on every rank, got {fn!r}")
    with restoring_world_size(group):
        for sizes in local_batch_sizes:
            sizes = tuple(int(n) for n in sizes)
            if group.world_size != len(sizes):
                group.resize(len(sizes))
            try:
                out = group.run(_run_learner, fn, sizes)
            except RankError as err:
                return raised_on_ranks(f"With local batch sizes {list(sizes)}", err)
            losses = [exercise_losses(r, n) for r, n in enumerate(sizes)]
            expected = float(torch.cat(losses).mean())
            setting = (f"With world_size={len(sizes)} and local batch sizes {list(sizes)} "
                       f"(global batch {sum(sizes)})")
            for rank, (kind, got, _) in enumerate(out):
                if kind == "shape":
                    return failed(f"{setting}, rank {rank} returned a tensor of shape {got}; "
                                  f"return one number (a float or a one-element tensor).")
                if kind == "type":
                    return failed(f"{setting}, rank {rank} returned a {got}; return one number "
                                  f"(a float or a one-element tensor), the global mean loss.")
                if not _close(got, expected):
                    why = _diagnose(got, rank, sizes, losses)
                    return failed(f"{setting}, the global mean loss is {expected:.4f} (the sum of "
                                  f"all {sum(sizes)} losses divided by {sum(sizes)}), but rank "
                                  f"{rank} returned {got:.4f}. {why}".rstrip())
            for rank, (_, _, collectives) in enumerate(out):
                if collectives != {"all_reduce": 1}:
                    why = (" Every collective is a round trip through all the ranks, and the ranks "
                           "wait for the slowest at each one (notebook 10 measures what one costs)."
                           if sum(collectives.values()) > 1 else "")
                    return failed(f"{setting}, every rank returned the global mean loss, but rank "
                                  f"{rank} {_calls(collectives)}. The exercise asks for one "
                                  f"all_reduce per rank.{why}")
        tried = " and ".join(str(list(s)) for s in local_batch_sizes)
        return passed(f"Every rank returned the global mean loss for local batch sizes {tried}, "
                      f"with one all_reduce: each sample counts once, whichever rank holds it, "
                      f"and a rank without samples counts for nothing.")


def losses_on_rank(per_sample_losses, aggregations, local_batch_sizes):
    """Runs on every rank for notebook 03's explorer: this rank's per-sample losses (a
    1-D tensor) and each aggregation's value (a list of floats).

    It lives here, not in :mod:`reducelab.widgets.loss`, because a rank imports the
    module of a function it is sent by reference: this one is light, the widgets
    module imports ipywidgets and matplotlib (about 0.4 s of CPU per new rank)."""
    losses = per_sample_losses(local_batch_sizes).detach()
    values = [float(agg(local_batch_sizes)) for agg in aggregations]
    return losses, values
