"""Code of notebook 12 (uneven gathers and exact metrics) that runs on the ranks, and the
check of its exercise.

This module imports only ``torch`` and the standard library, so its functions run on the
ranks without matplotlib or ipywidgets:

* :func:`stderr_to` keeps what C++ code (gloo) writes to a rank's standard error in a
  file, so the kernel can read gloo's own words after the process was killed;
* :func:`sampler_layout` says, without any process group, which sample numbers
  ``DistributedSampler`` hands each rank, which of them are repeats, and which samples
  no rank sees;
* :func:`exercise_losses`, :func:`exercise_run` and :func:`check_exact_mean_loss`: the
  exercise, an exact mean loss computed from the shares of a padded, shuffled
  ``DistributedSampler``.

Sources: ``torch.utils.data.distributed.DistributedSampler`` (its ``__iter__`` pads the
index list with its own first indices, then gives rank ``r`` every ``world_size``-th index
from position ``r``), https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler ;
``torch.distributed.all_reduce``, https://pytorch.org/docs/stable/distributed.html
"""
from __future__ import annotations

import contextlib
import math
import os

import torch

from . import COLLECTIVES, Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError

TRAIN_SIZE = 1500
"""Notebook 12 fits its model (one mean image per class) on the first 1,500 digits and
evaluates it on the other 297, its validation set."""
EXERCISE_CASES = ((2, 7, 3), (3, 10, 0), (3, 2, 1), (4, 11, 1), (4, 12, 2))
"""``(world_size, dataset_size, epoch)`` of each run of the exercise's check: padding of
1, 2, 1, 1 and 0 samples, and one data set smaller than the world size."""
TOLERANCE = 1e-9
"""Largest accepted difference from the exact mean loss (float64 sums in another order)."""


# --- on the ranks ------------------------------------------------------------------------

@contextlib.contextmanager
def stderr_to(path: str):
    """Inside the block, this process's file descriptor 2 (standard error) writes to the
    file ``path`` (created with mode 0600, truncated).

    Python's ``sys.stderr`` of a rank is captured and sent to the kernel with the rank's
    result, but text that C++ code writes to the descriptor itself (gloo's
    ``terminate called after throwing an instance of 'gloo::EnforceNotMet'`` before it
    aborts the process) is not, and a killed process sends nothing back. The file
    survives the process, so the kernel can read it afterwards. The descriptor is
    restored when the block ends normally or by an exception. Notebook 12, question 1.
    """
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    try:
        yield path
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def sampler_layout(dataset_size: int, world_size: int, shuffle: bool = False, epoch: int = 0,
                   drop_last: bool = False, seed: int = 0) -> dict:
    """What ``DistributedSampler`` hands each rank, worked out in one process.

    Builds one ``DistributedSampler`` per rank (``num_replicas=world_size``, ``rank=r``),
    so it needs no process group and runs in the kernel.

    Returns:
        ``{"indices": [[int, ...] per rank], "repeats": [[bool, ...] per rank],
        "dropped": [int, ...], "padding": int}``: each rank's sample numbers in order;
        ``repeats[r][i]`` is True where rank ``r``'s ``i``-th index is padding (global
        position ``i * world_size + r`` at or past ``dataset_size``, a repeat of a
        sample another position already holds); the samples no rank gets
        (``drop_last=True``); and how many padding indices were added.

    Raises:
        ValueError: ``dataset_size`` or ``world_size`` below 1.
    """
    from torch.utils.data import DistributedSampler
    if dataset_size < 1 or world_size < 1:
        raise ValueError(f"dataset_size and world_size must be at least 1, got "
                         f"{dataset_size} and {world_size}")
    indices = []
    for r in range(world_size):
        sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=r,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        indices.append(list(sampler))
    repeats = [[i * world_size + r >= dataset_size for i in range(len(ix))]
               for r, ix in enumerate(indices)]
    seen = {i for ix in indices for i in ix}
    return {"indices": indices, "repeats": repeats,
            "dropped": [i for i in range(dataset_size) if i not in seen],
            "padding": sum(map(sum, repeats))}


# --- the exercise ----------------------------------------------------------------------------

def exercise_losses(dataset_size: int) -> torch.Tensor:
    """The per-sample losses of the exercise: float64, shape ``(dataset_size,)``, values
    in [0.1, 2.1), drawn from a generator seeded with ``dataset_size`` (the same in every
    process; the global RNG is not touched)."""
    g = torch.Generator().manual_seed(dataset_size)
    return 0.1 + 2 * torch.rand(dataset_size, generator=g, dtype=torch.float64)


def exercise_inputs(dataset_size: int, epoch: int) -> tuple[torch.Tensor, list[int]]:
    """Runs on a rank: this rank's share of the exercise's data set. The indices come
    from ``DistributedSampler(range(dataset_size))`` with its defaults (``shuffle=True``,
    ``seed=0``, ``drop_last=False``) after ``set_epoch(epoch)``; the losses are
    :func:`exercise_losses` at those indices, in the same order. Returns
    ``(losses, indices)``: float64 of shape ``(len(indices),)`` and a list of ints."""
    from torch.utils.data import DistributedSampler
    sampler = DistributedSampler(range(dataset_size))
    sampler.set_epoch(epoch)
    indices = list(sampler)
    return exercise_losses(dataset_size)[indices], indices


def exercise_run(fn, dataset_size: int, epoch: int):
    """Runs on every rank: ``fn(losses, indices, dataset_size)`` on this rank's share
    (:func:`exercise_inputs`). Returns ``(value, calls)``: what ``fn`` returned, as a
    float when it is a number or a one-element tensor (else as it came), and how many
    ``torch.distributed`` calls of :data:`~reducelab.checks.COLLECTIVES` it made."""
    import torch.distributed as dist
    losses, indices = exercise_inputs(dataset_size, epoch)
    calls, originals = [0], {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def counted(call):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            return call(*args, **kwargs)
        return wrapper
    for n, call in originals.items():
        setattr(dist, n, counted(call))
    try:
        value = fn(losses.clone(), list(indices), dataset_size)
    finally:
        for n, call in originals.items():
            setattr(dist, n, call)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    return value, calls[0]


def _candidates(world_size: int, dataset_size: int, epoch: int) -> dict[str, object]:
    """The usual wrong answers for one case, computed in one process, by name."""
    layout = sampler_layout(dataset_size, world_size, shuffle=True, epoch=epoch)
    losses = exercise_losses(dataset_size)
    shares = [losses[ix] for ix in layout["indices"]]
    held = torch.cat(shares)
    out = {"padded mean": held.mean().item(),
           "padded sum / dataset_size": (held.sum() / dataset_size).item(),
           "local means": [s.mean().item() for s in shares]}
    if len(shares[0]) > 1:
        kept = torch.cat([s[:-1] for s in shares])
        out["last dropped everywhere"] = kept.mean().item()
    return out


def check_exact_mean_loss(group, fn, cases=EXERCISE_CASES) -> Verdict:
    """The exercise of notebook 12: ``fn(losses, indices, dataset_size)`` runs on every
    rank with that rank's share of a ``DistributedSampler`` (``shuffle=True``,
    ``drop_last=False``, after ``set_epoch``), and must return the mean loss over the
    ``dataset_size`` samples, each counted once, the same on every rank.

    Runs ``fn`` on real ranks for every ``(world_size, dataset_size, epoch)`` in ``cases``
    (the group is resized, then restored) and compares with the exact mean of
    :func:`exercise_losses` within :data:`TOLERANCE`. A wrong answer says which usual
    mistake it matches (the sampler's repeats counted in the sum or in the count, one
    index dropped on every rank, a rank's own mean), never the code of a solution.

    Returns:
        A :class:`~reducelab.checks.Verdict`.
    """
    with restoring_world_size(group):
        for world_size, dataset_size, epoch in cases:
            group.resize(world_size)
            padding = sampler_layout(dataset_size, world_size, True, epoch)['padding']
            context = (f"With {dataset_size} samples on {world_size} ranks (epoch {epoch}, "
                       f"{padding} padding {'index' if padding == 1 else 'indices'})")
            try:
                out = group.run(exercise_run, fn, dataset_size, epoch)
            except RankError as err:
                return raised_on_ranks(f"{context},", err)
            want = exercise_losses(dataset_size).mean().item()
            values = [v for v, _ in out]
            for r, v in enumerate(values):
                if not isinstance(v, float):
                    return failed(f"{context}, rank {r} returned {v!r}; expected one number "
                                  f"(a float or a one-element tensor), the mean loss.")
                if math.isnan(v):
                    return failed(f"{context}, rank {r} returned nan: a division by a count "
                                  f"of 0, or a mean of an empty tensor?")
            if all(abs(v - want) <= TOLERANCE for v in values):
                continue
            return failed(f"{context}: {_diagnose(world_size, dataset_size, epoch, values, want, [c for _, c in out])}")
    return passed(f"Every rank returned the exact mean loss in all {len(cases)} cases "
                  f"(world sizes {', '.join(sorted({str(c[0]) for c in cases}))}, with and "
                  f"without padding, and 2 samples on 3 ranks): each sample counted once, "
                  f"whichever rank's share holds its repeat.")


def _diagnose(world_size, dataset_size, epoch, values, want, calls) -> str:
    got = ", ".join(f"rank {r}: {v:.6f}" for r, v in enumerate(values))
    head = f"the ranks returned {got}; the mean over the {dataset_size} samples is {want:.6f}."
    wrong = _candidates(world_size, dataset_size, epoch)
    p = sampler_layout(dataset_size, world_size, True, epoch)["padding"]
    close = lambda a, b: abs(a - b) <= TOLERANCE  # noqa: E731
    if len({round(v, 9) for v in values}) > 1:
        if all(close(v, m) for v, m in zip(values, wrong["local means"])):
            why = "Each rank returned the mean of its own share only."
        else:
            why = "The ranks disagree."
        return (f"{head} {why} A metric everyone reports must be the same on every rank: "
                f"combine the ranks' numbers with a collective"
                + (" (your function called none)." if not any(calls) else "."))
    v = values[0]
    if close(v, wrong["padded mean"]):
        return (f"{head} That is the mean over all {dataset_size + p} indices the ranks hold: "
                f"the sampler's {p} repeat(s) are counted twice. Removing repeats within "
                f"one rank's indices finds none: the sampler puts each repeat on another "
                f"rank than its first copy. Find which of a rank's indices are padding, and "
                f"leave them out of both the sum and the count. If your function already "
                f"leaves out what it takes for padding, here it left out nothing: check its "
                f"rule where the data set's samples end and the padding begins.")
    if close(v, wrong["padded sum / dataset_size"]):
        return (f"{head} The count is right, but the sum still holds the {p} repeated "
                f"sample(s): leave the padding out of the sum too.")
    if "last dropped everywhere" in wrong and close(v, wrong["last dropped everywhere"]):
        return (f"{head} That leaves out the last index of every rank, {world_size} samples, "
                f"but only {p} of them {'is' if p == 1 else 'are'} padding here: which ranks' "
                f"last indices are padding depends on where their positions fall in the padded "
                f"list.")
    if p == 0 and abs(v - want) > TOLERANCE:
        return (f"{head} Here nothing is padded ({dataset_size} divides by {world_size}), so "
                f"every index the ranks hold is a sample counted once: your function removes "
                f"something it should keep.")
    return (f"{head} {p} of the indices the ranks hold "
            f"{'is a repeat' if p == 1 else 'are repeats'}. Step 3 showed where "
            f"the sampler puts repeats in each rank's share; with shuffle=True they are other "
            f"samples each epoch, in the same places.")


__all__ = ["EXERCISE_CASES", "TOLERANCE", "TRAIN_SIZE", "check_exact_mean_loss",
           "exercise_inputs", "exercise_losses", "exercise_run", "sampler_layout", "stderr_to"]
