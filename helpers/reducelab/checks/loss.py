"""Checks for notebook 03 (how to aggregate the loss from all ranks).

Source: ``torch.distributed.all_reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the
learner question "How can I aggregate losses from all GPUs in DistributedDataParallel?"
(2025-01-30).
"""
from __future__ import annotations

import torch

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

UNEVEN_BATCHES = ((3, 5, 8, 2), (1, 6, 2))
"""Local batch sizes, one per rank, that :func:`check_global_mean_loss` runs with."""


def exercise_losses(rank: int, local_batch_size: int) -> torch.Tensor:
    """Per-sample losses rank ``rank`` holds in the exercise: float32, shape ``(local_batch_size,)``.

    Seeded from the rank; higher ranks hold larger losses, so a mean of per-rank means
    is visibly different from the global mean when local batch sizes differ.
    """
    g = torch.Generator().manual_seed(rank)
    return torch.rand(local_batch_size, generator=g) + rank


def _run_learner(fn, local_batch_sizes):
    """Runs on every rank: the learner's ``fn`` on this rank's per-sample losses."""
    import torch.distributed as dist
    rank = dist.get_rank()
    out = fn(exercise_losses(rank, local_batch_sizes[rank]))
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            return ("shape", tuple(out.shape))
        return ("value", float(out.detach()))
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return ("value", float(out))
    return ("type", type(out).__name__)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def _diagnose(got: float, rank: int, sizes: tuple[int, ...], losses: list[torch.Tensor]) -> str:
    """Name the usual mistake that produces ``got`` on ``rank``, or ``""``."""
    ws = len(sizes)
    total = float(torch.cat(losses).sum())
    count = sum(sizes)
    local = losses[rank]
    mean_of_means = float(torch.stack([l.mean() for l in losses]).mean())
    known = [
        (mean_of_means, "That is the mean of the per-rank means, all_reduce(loss) / world_size: "
                        "it weights each rank equally, so a rank with 2 samples counts as much as "
                        "a rank with 8. All-reduce the loss sum and the sample count separately, "
                        "then divide."),
        (float(local.mean()), "That is this rank's own local mean: nothing was all-reduced."),
        (total, "That is the global sum of the losses: divide it by the global count of samples."),
        (total / ws, "That is the global sum divided by world_size: divide by the global "
                     "number of samples instead (all-reduce the local counts)."),
        (total / sizes[rank], "That is the global sum divided by this rank's local batch size: "
                              "the count must be all-reduced too."),
        (float(local.sum()) / count, "That is this rank's local sum divided by the global count: "
                                     "the sum must be all-reduced too."),
    ]
    for value, why in known:
        if _close(got, value):
            return why
    return ""


def check_global_mean_loss(group: LocalGroup, fn, local_batch_sizes=UNEVEN_BATCHES) -> Verdict:
    """Exercise of notebook 03: ``fn(per_sample_losses)`` must return the global mean loss.

    ``fn`` runs on every rank of real gloo ranks and receives that rank's per-sample
    losses (:func:`exercise_losses`, a 1-D float32 tensor whose length is the rank's local
    batch size). It must return, on every rank, the mean over every sample of the global
    batch (each sample counted once): a float or a one-element tensor.

    For each entry of ``local_batch_sizes`` (local batch sizes, one per rank) the group is
    resized to that world_size, ``fn`` is run, and each rank's answer is compared with the
    mean of the concatenated losses computed in one process (relative tolerance 1e-5).
    The group's world_size is restored afterwards.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says what was expected and, for the
        usual mistakes (mean of means, a missing all_reduce, a missing division), which
        mistake it was.

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
            for rank, (kind, got) in enumerate(out):
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
        tried = " and ".join(str(list(s)) for s in local_batch_sizes)
        return passed(f"Every rank returned the global mean loss for local batch sizes {tried}: "
                      f"each sample counts once, whichever rank holds it.")
