"""Checks for notebook 13 (what DDP expects of a model), and the code it runs on the ranks.

This module imports only ``torch`` (and the standard library), so its functions can run
on the ranks:

* :func:`first_elements` takes a few elements of every parameter (or gradient), the
  numbers the notebook's figures show;
* :func:`stderr_during` keeps what torch's C++ code writes to a rank's standard error
  while a function runs (its warnings, such as the reducer's);
* :func:`evaluate_on_every_rank` trains a small DDP model with BatchNorm and dropout for
  two steps, then runs a learner's ``evaluate`` on every rank, each on its own share of a
  validation set, and one more training step;
* :func:`check_evaluate_together` checks the exercise: the mean validation loss over
  every rank's share, on every rank, between two training steps.

Sources: DDP's construction broadcast, its buffer sync and its reducer
(``torch/nn/parallel/distributed.py``, torch 2.13; https://pytorch.org/docs/stable/notes/ddp.html).
Notebook 17's check (dropout seeds for a dp x tp mesh) lives in :mod:`.randomness`.
"""
from __future__ import annotations

import math
import numbers
import os
import sys
import tempfile

import torch

from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError

# --- on the ranks ---------------------------------------------------------------------

def first_elements(parameters, grad: bool = False, k: int = 2) -> torch.Tensor:
    """The first ``k`` elements of each parameter (of its gradient with ``grad=True``),
    flattened and concatenated: float32 of shape ``(sum(min(k, p.numel())),)``, for
    ``Net`` of notebook 13 ten numbers. A parameter without a gradient gives NaNs in its
    place, so that the figures can show "none". Used by notebook 13's rank functions
    (they run on the ranks).

    Args:
        parameters: an iterable of tensors, such as ``model.parameters()``.
        grad: take ``p.grad`` instead of ``p``.
        k: elements per parameter, an int of 1 or more.

    Raises:
        ValueError: ``k`` below 1.
    """
    if k < 1:
        raise ValueError(f"k must be 1 or more, got {k}")
    parts = []
    for p in parameters:
        t = p.grad if grad else p
        if t is None:
            t = torch.full_like(p, float("nan"))
        parts.append(t.detach().flatten()[:k].float())
    return torch.cat(parts) if parts else torch.empty(0)


def stderr_during(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` on this rank and return ``(result, text)``: its return
    value and what was written to file descriptor 2 meanwhile, as ``str``.

    torch's C++ code writes its warnings and log lines (``[W... reducer.cpp:...]``)
    straight to file descriptor 2, past ``sys.stderr``, so a rank's captured output never
    holds them; this points descriptor 2 at a temporary file for the call. Runs on the
    ranks (notebook 13, step 4). The descriptor is restored when ``fn`` returns or raises
    (and the exception propagates).
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            result = fn(*args, **kwargs)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    return result, text




SHARD_SIZES = (7, 5, 3, 2)
"""How many validation samples each of the 4 ranks holds in the check: uneven, as the
last batch of a split often is (notebook 12)."""


def evaluate_on_every_rank(fn, sizes=SHARD_SIZES, steps: int = 2) -> dict:
    """Runs on the ranks (the check of notebook 13's exercise). Every rank builds the same
    model with a BatchNorm and a dropout layer, wraps it in DDP and trains it ``steps``
    SGD steps on its own batch of 8, whose inputs have mean ``rank + 1`` as in notebook
    13's step 2, and a BatchNorm with ``momentum=None`` (the plain average of the batches
    it saw), so that each rank's running statistics differ by far more than noise and a
    mistake that evaluates with them misses by several percent; then it calls ``fn(model, x, y)`` with the DDP wrapper and
    its share of a validation set of ``sum(sizes)`` samples (rank r holds ``sizes[r]``, as
    float32 ``(n, 4)`` and ``(n, 1)``); then it trains one more step.

    Returns:
        ``{"value": what fn returned (a float, or its repr), "reference": the mean squared
        error over the whole validation set of the model rank 0 holds (its parameters and
        buffers), in eval mode, "share_rank0" and "share_own": the summed squared error of
        this rank's share with rank 0's and with this rank's own buffers, "sizes",
        "buffers_ok": the buffers after fn are this rank's own or rank 0's, untouched by
        training, "parameters_changed", "training_after": every module in training mode
        after fn, "next_step": "" or the error text the next training step raised,
        "through_wrapper": fn called the DDP wrapper, "built_graph": an output of the model
        required grad during fn (evaluated without torch.no_grad()), "trained_forward": a
        forward of the model during fn ran with a module in training mode}``.
        Computed on copies before fn runs; one broadcast of rank 0's buffers.
    """
    import copy

    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    if dist.get_world_size() != len(sizes):
        raise ValueError(f"{len(sizes)} shard sizes need world size {len(sizes)}, "
                         f"not {dist.get_world_size()}")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.Tanh(),
                              nn.Dropout(0.5), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 4, generator=g) + (rank + 1), torch.randn(8, 1, generator=g)
    torch.manual_seed(1000 + rank)                      # dropout: a stream per rank
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    v = torch.Generator().manual_seed(200)              # the validation set, the same everywhere
    xv, yv = torch.randn(sum(sizes), 4, generator=v), torch.randn(sum(sizes), 1, generator=v)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    own = copy.deepcopy(model.module).eval()
    rank0 = copy.deepcopy(model.module).eval()
    for buffer in rank0.buffers():
        dist.broadcast(buffer, src=0)
    with torch.no_grad():
        reference = F.mse_loss(rank0(xv), yv).item()
        share_rank0 = F.mse_loss(rank0(xv[mine]), yv[mine], reduction="sum").item()
        share_own = F.mse_loss(own(xv[mine]), yv[mine], reduction="sum").item()
    params = [p.detach().clone() for p in model.module.parameters()]
    wrapper_calls = []                                  # forwards through the DDP wrapper
    hook = model.register_forward_pre_hook(lambda module, args: wrapper_calls.append(1))
    graphs = []                                         # each forward of the model: did it record a graph?
    modes = []                                          # each forward of the model: a module in training mode?

    def record(module, args, output):                   # returns None: the output is left as it is
        graphs.append(bool(getattr(output, "requires_grad", False)))
        modes.append(any(m.training for m in module.modules()))
    graph_hook = model.module.register_forward_hook(record)
    try:
        value = fn(model, xv[mine], yv[mine])
    finally:
        hook.remove()
        graph_hook.remove()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    training_after = all(m.training for m in model.modules())
    after = list(model.module.buffers())
    buffers_ok = any(all(torch.equal(a, b) for a, b in zip(after, kept.buffers()))
                     for kept in (own, rank0))
    parameters_changed = not all(torch.equal(a, b.detach())
                                 for a, b in zip(params, model.module.parameters()))
    try:
        model.train()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        next_step = ""
    except RuntimeError as err:
        next_step = str(err)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return {"value": float(value) if ok else repr(value)[:80], "reference": reference,
            "share_rank0": share_rank0, "share_own": share_own, "sizes": tuple(sizes),
            "buffers_ok": buffers_ok, "parameters_changed": parameters_changed,
            "training_after": training_after, "next_step": next_step,
            "through_wrapper": bool(wrapper_calls), "built_graph": any(graphs),
            "trained_forward": any(modes)}


def _close_to(a: float, b: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= 1e-5 * max(1.0, abs(b))


def _judge_evaluation(rows: list[dict]) -> tuple[str, str] | None:
    """The first thing wrong with one run of ``evaluate``, as ``(sentence, mistake)``,
    or ``None``."""
    sizes = rows[0]["sizes"]
    n = sum(sizes)
    shares = ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]}"
    for r, row in enumerate(rows):
        if not isinstance(row["value"], float):
            return (f"Rank {r}'s evaluate returned {row['value']}. Return the mean loss as a "
                    f"Python float, the same number on every rank.", "not a number")
    if not all(row["buffers_ok"] for row in rows):
        which = [r for r, row in enumerate(rows) if not row["buffers_ok"]]
        if not any(row["trained_forward"] for row in rows if not row["buffers_ok"]):
            return (f"BatchNorm's running statistics on rank(s) {', '.join(map(str, which))} "
                    f"changed during evaluate, though no forward ran in training mode: your "
                    f"function changed them itself (an all_reduce of them, for instance). The "
                    f"model to score is the one rank 0 holds and a rank-0 checkpoint keeps; an "
                    f"average of the ranks' statistics is a model no rank holds. Leave each "
                    f"rank's statistics as they were, or make them rank 0's.",
                    "changed the statistics")
        return (f"BatchNorm's running statistics on rank(s) {', '.join(map(str, which))} were "
                f"updated during evaluate: the model ran in training mode, so BatchNorm "
                f"normalised each validation batch with that batch's own statistics and added "
                f"them to its running ones, and dropout was on. Evaluate in eval mode.",
                "evaluated in training mode")
    if any(row["parameters_changed"] for row in rows):
        return ("The parameters changed during evaluate: evaluating must not train. Leave "
                "the optimizer and backward() out of it.", "trained while evaluating")
    if any(row["built_graph"] for row in rows):
        which = [r for r, row in enumerate(rows) if row["built_graph"]]
        return (f"On rank(s) {', '.join(map(str, which))} the model's output required grad: "
                f"evaluate ran with gradients enabled, so autograd recorded a graph of the forward "
                f"(its activations kept in memory) for a backward that evaluation never runs. "
                f"Evaluate under torch.no_grad().", "built a graph")
    if not all(row["training_after"] for row in rows):
        return ("After evaluate, the model is still in eval mode: the next training steps "
                "would run without dropout and with BatchNorm's statistics frozen. Put the "
                "model back in the mode it came in.", "left in eval mode")
    broken = next((row["next_step"] for row in rows if row["next_step"]), "")
    if broken:
        return (f"The training step after evaluate raised: {broken.splitlines()[0][:200]}",
                "broke the next step")
    values = [row["value"] for row in rows]
    reference = rows[0]["reference"]
    if not all(_close_to(v, values[0]) for v in values):
        mine = [(row["share_rank0"] / s, row["share_own"] / s) for row, s in zip(rows, sizes)]
        if all(any(_close_to(row["value"], m) for m in pair) for row, pair in zip(rows, mine)):
            return (f"Each rank returned the mean loss of its own share ({shares} samples): "
                    f"{', '.join(f'{v:.4f}' for v in values)}. Every rank should return the "
                    f"mean over all {n} samples, {reference:.4f}: combine the ranks' shares "
                    f"with a collective that every rank calls.", "own share only")
        return (f"The ranks returned different numbers: "
                f"{', '.join(f'rank {r} {v:.4f}' for r, v in enumerate(values))}. Every rank "
                f"should return the mean over all {n} samples, {reference:.4f}.",
                "ranks disagree")
    value = values[0]
    if _close_to(value, reference):
        return None
    own_stats = sum(row["share_own"] for row in rows) / n
    if _close_to(value, own_stats):
        return (f"Every rank returned {value:.4f}: each rank evaluated its share with its own "
                f"BatchNorm running statistics, which differ from rank to rank (step 2), so the "
                f"{n} samples were scored by {len(rows)} different models. The model to evaluate "
                f"is the one rank 0 holds, and saves: its parameters and its buffers. Its mean "
                f"over all {n} samples is {reference:.4f}.", "own BatchNorm statistics")
    for stats, shares_of in (("rank 0's", "share_rank0"), ("its own", "share_own")):
        means = [row[shares_of] / s for row, s in zip(rows, sizes)]
        if _close_to(value, sum(means) / len(means)):
            return (f"Every rank returned {value:.4f}, the mean of the {len(rows)} ranks' own "
                    f"means. It weights every rank alike, but the ranks hold {shares} samples, "
                    f"so a sample of the rank with {sizes[-1]} counts more than one of the "
                    f"rank with {sizes[0]}. The mean over all {n} samples is {reference:.4f}: "
                    f"combine sums and counts, not means.", "mean of means")
    return (f"Every rank returned {value:.4f}; the mean squared error over all {n} validation "
            f"samples of the model rank 0 holds, in eval mode, is {reference:.4f}.",
            "wrong value")


def check_evaluate_together(group, fn) -> Verdict:
    """Notebook 13's exercise: ``fn(model, x, y) -> float`` is called on every rank in the
    middle of training, with the DDP wrapper ``model`` (a model with BatchNorm and dropout)
    and this rank's share ``x``, ``y`` of a validation set. It must return the mean squared
    error over the whole validation set, the same float on every rank, without training the
    model: BatchNorm's running statistics and the parameters as they were, the model back
    in training mode, and the next training step working. "The model" is the one rank 0
    holds, and a rank-0 checkpoint keeps: its parameters (the same on every rank) and its
    buffers (BatchNorm's running statistics, which differ between ranks, notebook 13's
    step 2).

    Runs ``fn`` on real ranks at world size 4 (the group is resized, then restored), with
    the uneven shares :data:`SHARD_SIZES` (:func:`evaluate_on_every_rank`), and says what is
    wrong with the first rule it breaks. A hang ends at the group's timeout.

    Returns:
        A :class:`~reducelab.checks.Verdict`.
    """
    if not callable(fn):
        return failed(f"Pass your function itself, evaluate, not {fn!r}.")
    with restoring_world_size(group):
        group.resize(len(SHARD_SIZES))
        try:
            rows = group.run(evaluate_on_every_rank, fn)
        except RankError as err:
            return raised_on_ranks("Evaluating on 4 ranks,", err)
    problem = _judge_evaluation(rows)
    if problem:
        return failed(*problem)
    how = (" Rank 0's BatchNorm statistics reached every rank through the wrapper: DDP's forward "
           "starts with a broadcast of rank 0's buffers (forward_sync_buffers=True, the default, "
           "notebook 13's step 2) when the wrapper's previous forward ran with gradients enabled, "
           "as the last training step's did (require_forward_param_sync in "
           "torch/nn/parallel/distributed.py). A forward under torch.no_grad() clears that flag, "
           "so a second call through the wrapper, for a second validation batch, broadcasts "
           "nothing: there, and through model.module, the broadcast is yours to make."
           if any(row["through_wrapper"] for row in rows) else "")
    return passed(f"Every rank returned {rows[0]['value']:.4f}, the mean squared error over all "
                  f"{sum(SHARD_SIZES)} validation samples (shares of "
                  f"{', '.join(map(str, SHARD_SIZES))}) of the model rank 0 holds, its parameters "
                  f"and its BatchNorm statistics, in eval mode: what one process evaluating the "
                  f"whole set with rank 0's checkpoint gives. No parameter moved, no running "
                  f"statistic took in a validation batch, and the next training step ran on every "
                  f"rank in training mode.{how}")
