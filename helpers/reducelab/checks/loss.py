"""Checks for notebook 03 (how to aggregate the loss from all ranks).

Source: ``torch.distributed.all_reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the
learner question "How can I aggregate losses from all GPUs in DistributedDataParallel?"
(2025-01-30).
"""
from __future__ import annotations

import math
import re

import torch

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

UNEVEN_BATCHES = ((3, 5, 8, 2), (4, 0, 3))
"""Local batch sizes, one per rank, that :func:`check_backward_and_log` runs with. The
second has an empty local batch on rank 1: a rank can end up with no sample (the last
batch of an epoch, samples masked out of the loss), and it still takes part in DDP's
all_reduce of the gradients."""

TOLERANCE = 1e-5
"""How close a rank's gradient and logged loss must be to one process's: within
``TOLERANCE * max(1, max|reference|)`` (float32; DDP and the all_reduce sum in another
order than one process does: differences up to about 4e-7 here)."""

COLLECTIVE_NAMES = {"allreduce_": "all_reduce", "allgather_": "all_gather",
                    "_allgather_base_": "all_gather_single", "broadcast_": "broadcast",
                    "reduce_": "reduce", "reduce_scatter_": "reduce_scatter",
                    "_reduce_scatter_base_": "reduce_scatter_single", "gather_": "gather",
                    "scatter_": "scatter", "alltoall_": "all_to_all",
                    "alltoall_base_": "all_to_all_single", "barrier": "barrier",
                    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
                    "allreduce_coalesced_": "all_reduce_coalesced",
                    "allgather_coalesced_": "all_gather_coalesced",
                    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
                    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced"}
"""torch.distributed's name for each ``c10d`` op (``torch.ops.c10d``) that a rank's
collectives dispatch to in torch 2.13 (``all_gather_single`` and
``reduce_scatter_single``: the deprecated ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` call them too)."""

FUNCTIONAL_NAMES = {"all_reduce_": "all_reduce", "all_reduce_coalesced_": "all_reduce_coalesced",
                    "all_gather_into_tensor_out": "all_gather_into_tensor",
                    "reduce_scatter_tensor_out": "reduce_scatter_tensor",
                    "broadcast_": "broadcast", "isend": "send", "irecv": "recv",
                    "batch_p2p_ops": "batch_isend_irecv"}
"""The name :class:`_Collectives` counts for a ``_c10d_functional`` op (the functional
collectives, ``torch.distributed._functional_collectives``, torch 2.13) or a
``_c10d_functional_autograd`` op whose own name is not the one counted: the in-place and
``_out`` forms count as the collective itself, so ``_functional_collectives.all_reduce``
counts as an all_reduce, as ``dist.all_reduce`` does."""

COUNTED_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
"""The op namespaces whose ops :class:`_Collectives` counts: ``torch.distributed``'s
collectives dispatch to ``c10d`` ops, the functional collectives to
``_c10d_functional`` ops, and their differentiable spellings
(``all_gather_tensor_autograd``, ``reduce_scatter_tensor_autograd``,
``all_to_all_single_autograd``) to ``_c10d_functional_autograd`` ops
(``torch/distributed/_functional_collectives.py``, torch 2.13)."""

NOT_COLLECTIVES = frozenset({"c10d::monitored_barrier_", "c10d::check_for_nan",
                             "_c10d_functional::wait_tensor",
                             "_c10d_functional::_wrap_tensor_autograd"})
"""Ops of :data:`COUNTED_NAMESPACES` that :class:`_Collectives` does not count: DETAIL
debug mode's barrier, NCCL's nan check, and the functional collectives' wait for a
result and their autograd wrapper, which move no data between ranks."""

_SKIPPED = "returned without calling backward() on the DDP model"
"""What a rank that returned from the learner's function without a backward() through
the model raises (``_run_learner``), so that the check can name it."""

_UNSYNCED = "called backward(), but DDP started no all_reduce of the gradients"
"""What a rank raises (``_run_learner``) whose model got gradients from a backward()
while DDP started no all_reduce of them: after a forward inside ``model.no_sync()``, or
one that did not go through the DDP model (``model.module(x)``)."""


def exercise_batch(rank: int, local_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s local batch in the exercise: ``x`` float32 of shape
    ``(local_batch_size, 3)`` and ``y`` float32 of shape ``(local_batch_size, 1)``
    (0 rows for an empty local batch).

    Seeded from the rank; rank ``r``'s targets sit ``r`` higher, as in the notebook's
    step 1, so a mean of per-rank means is visibly not the global mean.

    Raises:
        ValueError: ``local_batch_size`` is negative.
    """
    if local_batch_size < 0:
        raise ValueError(f"local_batch_size must be 0 or more, got {local_batch_size}")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(local_batch_size, 3, generator=g)
    y = torch.randn(local_batch_size, 1, generator=g) + rank
    return x, y


def exercise_model() -> torch.nn.Linear:
    """The exercise's model, ``nn.Linear(3, 1)`` as ``torch.manual_seed(0)`` makes it,
    the same in every process; the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Linear(3, 1)


def _flat_grad(model) -> torch.Tensor:
    """The weight's gradient, then the bias's: float32, shape ``(4,)``."""
    return torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()])


def reference(local_batch_sizes) -> tuple[torch.Tensor, float]:
    """One process, the whole global batch: the gradient of the mean squared error over
    every rank's samples (float32, shape ``(4,)``: weight, then bias) and that mean loss
    (a float), from :func:`exercise_model` and :func:`exercise_batch`."""
    model = exercise_model()
    xs, ys = zip(*(exercise_batch(r, n) for r, n in enumerate(local_batch_sizes)))
    loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
    loss.backward()
    return _flat_grad(model), loss.item()


def _per_rank(local_batch_sizes) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """For each rank, in one process: its per-sample losses (1-D) and the gradient of
    their sum (shape ``(4,)``, zeros for an empty local batch), in float64."""
    losses, grads = [], []
    for r, n in enumerate(local_batch_sizes):
        model = exercise_model().double()
        x, y = exercise_batch(r, n)
        per_sample = torch.nn.functional.mse_loss(model(x.double()), y.double(),
                                                  reduction="none").flatten()
        per_sample.sum().backward()
        losses.append(per_sample.detach())
        grads.append(_flat_grad(model))
    return losses, grads


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.double().flatten(), want.double().flatten()
    if got.shape != want.shape or not torch.isfinite(got).all():
        return False
    return (got - want).abs().max().item() <= TOLERANCE * max(1.0, want.abs().max().item())


class _Collectives:
    """Counts the collectives a rank makes while it is entered, by torch.distributed's
    names (:data:`COLLECTIVE_NAMES`, :data:`FUNCTIONAL_NAMES`), except while it is
    paused (:meth:`pause`: the check pauses it around each call of the DDP model, whose
    forward may broadcast, and in its DDP comm hook, around DDP's own all_reduce of the
    gradients). :attr:`counts` has them all; :attr:`in_backward` the ones made while
    autograd ran a backward (``torch._C._current_autograd_node()`` is the node running
    then, ``None`` outside a backward): the backward of a differentiable collective.

    A ``TorchDispatchMode`` sees every op of :data:`COUNTED_NAMESPACES`, however the
    learner called it (``dist.all_reduce``, ``distributed_c10d.all_reduce``, the
    ``ProcessGroup`` method, ``_functional_collectives.all_reduce``), also the ones
    launched during ``backward()``, DDP's C++ reducer's among them: the dispatch mode is
    thread-local state that the autograd engine carries over. It is ``CommDebugMode``'s
    counting without its module tracker, which breaks on a second forward of a module
    inside it (torch 2.13, ``torch/distributed/tensor/debug/_comm_mode.py``)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}
        in_backward: dict[str, int] = {}
        self.counts, self.in_backward = counts, in_backward
        self.paused = 0
        owner = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._overloadpacket.__name__
                if (func.namespace in COUNTED_NAMESPACES and not owner.paused
                        and f"{func.namespace}::{name}" not in NOT_COLLECTIVES):
                    names = COLLECTIVE_NAMES if func.namespace == "c10d" else FUNCTIONAL_NAMES
                    name = names.get(name, name)
                    counts[name] = counts.get(name, 0) + 1
                    if torch._C._current_autograd_node() is not None:
                        in_backward[name] = in_backward.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def pause(self, *_):
        """Stops counting until a matching :meth:`resume` (pauses nest)."""
        self.paused += 1

    def resume(self, *_):
        self.paused -= 1

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _run_learner(fn, local_batch_sizes):
    """Runs on every rank: builds :func:`exercise_model` wrapped in DDP, and calls the
    learner's ``fn(model, x, y)`` on this rank's :func:`exercise_batch`.

    DDP gets a comm hook that counts its all_reduces of the gradients and runs torch's
    ``allreduce_hook`` (with which DDP gives what it gives without a hook:
    ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``), and forward
    hooks that pause the count while the DDP model runs (DDP's forward broadcasts
    bucket indices when it rebuilds its buckets, after the first backward():
    ``DistributedDataParallel._pre_forward``, ``torch/nn/parallel/distributed.py``). A
    rank on which no such all_reduce started raises at once (a ``RuntimeError``: it
    returned without a ``backward()`` through the model, or, when the model has
    gradients, DDP started no all_reduce of them), so the ranks that wait for it in
    DDP's all_reduce are stopped within a second, not at the timeout.

    Returns a dict: ``grad`` (float32, ``(4,)``), ``kind`` (``"value"``, ``"shape"`` or
    ``"type"``) and ``value`` of what ``fn`` returned, ``collectives`` (``{name:
    calls}`` that ``fn`` made, DDP's own excluded), ``in_backward`` (those of them made
    inside a backward), ``through_all_reduce`` (torch's warning that a ``backward()``
    went through a ``c10d`` op, or ``""``).
    """
    import warnings

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = DDP(exercise_model())
    counter = _Collectives()
    ddp_all_reduces = []

    def counted(state, bucket):
        ddp_all_reduces.append(bucket.index())
        counter.pause()
        try:
            return default_hooks.allreduce_hook(None, bucket)
        finally:
            counter.resume()

    model.register_comm_hook(None, counted)
    model.register_forward_pre_hook(counter.pause)
    model.register_forward_hook(counter.resume, always_call=True)
    x, y = exercise_batch(rank, local_batch_sizes[rank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with counter:
            out = fn(model, x, y)
    if not ddp_all_reduces:
        produced = model.module.weight.grad is not None
        raise RuntimeError(f"rank {rank} {_UNSYNCED if produced else _SKIPPED}")
    through = next((str(w.message) for w in caught if str(w.message).startswith("c10d::")
                    and "autograd kernel was not registered" in str(w.message)), "")
    grad = _flat_grad(model.module).detach().clone()
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            kind, value = "shape", tuple(out.shape)
        else:
            kind, value = "value", float(out.detach())
    elif isinstance(out, (int, float)) and not isinstance(out, bool):
        kind, value = "value", float(out)
    else:
        kind, value = "type", type(out).__name__
    return {"grad": grad, "kind": kind, "value": value, "collectives": counter.counts,
            "in_backward": counter.in_backward, "through_all_reduce": through}


def _calls(collectives: dict) -> str:
    """``{"all_reduce": 2}`` as ``"called all_reduce 2 times"``; ``{}`` as ``"called no collective"``."""
    if not collectives:
        return "called no collective"
    return "called " + " and ".join(f"{name} {'once' if n == 1 else f'{n} times'}"
                                    for name, n in collectives.items())


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _place(summary: str) -> str:
    """``"in all_reduce, called from f line 3"`` or ``"at f line 5"`` from a stuck rank's
    summary (:class:`~reducelab.errors.RankReport`), or ``""``."""
    m = re.match(r"was waiting in (\w+), called from (.+)$", summary)
    if m:
        return f"in {m.group(1)}, called from {m.group(2)}"
    m = re.match(r"was still running, at (.+)$", summary)
    return f"at {m.group(1)}" if m else ""


def _explain_failure(setting: str, sizes, err: RankError, timeout: float) -> Verdict:
    """The verdict for a run that raised or hung: which rank returned without
    ``backward()``, or without DDP's all_reduce of the gradients, and what the others
    were doing, a hang, or the error."""
    skipped = [r.rank for r in err.reports if r.state == "raised" and _SKIPPED in r.summary]
    unsynced = [r.rank for r in err.reports if r.state == "raised" and _UNSYNCED in r.summary]
    why_unsynced = ("DDP readies its all_reduce of the gradients in the forward through the "
                    "DDP model, and only outside model.no_sync() "
                    "(DistributedDataParallel._post_forward and no_sync, "
                    "torch/nn/parallel/distributed.py): after a forward inside no_sync(), or "
                    "through model.module, backward() leaves each rank its own local "
                    "gradient.")
    if skipped and len(skipped) == len(sizes):
        return failed(f"{setting}, no rank called backward() through the model (DDP started "
                      f"no all_reduce of the gradients on any rank), so no gradient was "
                      f"computed. The exercise asks your function to call backward() "
                      f"itself.", mistake="no backward()")
    if unsynced and len(skipped) + len(unsynced) == len(sizes):
        return failed(f"{setting}, {'every rank' if not skipped else _ranks(unsynced)} called "
                      f"backward() and got gradients, but DDP started no all_reduce of the "
                      f"gradients on any rank"
                      + (f" ({_ranks(skipped)} called no backward() at all)" if skipped else "")
                      + f". {why_unsynced}", mistake="no all_reduce of the gradients")
    if skipped or unsynced:
        missing = sorted(skipped + unsynced)
        waiting = [r for r in err.reports if r.rank not in missing]
        places = sorted({_place(r.summary) for r in waiting if _place(r.summary)})
        where = f" ({'; '.join(places)})" if places else ""

        def held(ranks):
            return " and ".join(f"{n} sample{'' if n == 1 else 's'}" for n in
                                (sizes[r] for r in ranks))
        what = []
        if skipped:
            what.append(f"{_ranks(skipped)} (local batch of {held(skipped)}) returned without "
                        f"calling backward() on the DDP model")
        if unsynced:
            what.append(f"{_ranks(unsynced)} (local batch of {held(unsynced)}) called "
                        f"backward(), but DDP started no all_reduce of the gradients there")
        return failed(f"{setting}, {', and '.join(what)}, while "
                      f"{_ranks(r.rank for r in waiting)} {'was' if len(waiting) == 1 else 'were'} "
                      f"left waiting for {'it' if len(missing) == 1 else 'them'}{where}. DDP's "
                      f"backward() all_reduces the gradients, and an all_reduce, yours or "
                      f"DDP's, completes only when every rank of the group has joined it. On a "
                      f"cluster the others would wait until the process group's timeout (30 "
                      f"minutes by default on gloo, torch/distributed/constants.py) and then "
                      f"fail; the check stopped them at once."
                      + (f" {why_unsynced}" if unsynced else ""),
                      mistake="rank skipped backward()" if not unsynced
                      else "no all_reduce of the gradients")
    no_graph = [r.rank for r in err.reports if r.state == "raised"
                and "does not require grad" in r.summary]
    if no_graph:
        held = " and ".join(f"{sizes[r]} sample{'' if sizes[r] == 1 else 's'}" for r in no_graph)
        return failed(f"{setting}, {_ranks(no_graph)} (local batch of {held}) called backward() "
                      f"on a tensor that does not depend on the model's parameters, and torch "
                      f"raised: \"{next(r.summary for r in err.reports if r.rank == no_graph[0])}"
                      f"\". No gradient of the model was computed there, so DDP's all_reduce of "
                      f"the gradients never started on {'that rank' if len(no_graph) == 1 else 'those ranks'}, "
                      f"and the others waited for it.", mistake="backward() of a constant")
    stuck = [r for r in err.reports if r.state == "stuck"]
    if stuck and not any(r.state in ("raised", "died") for r in err.reports):
        where = sorted({r.collective or "its own code" for r in stuck})
        return failed(f"{setting}, the ranks hung: {_ranks(r.rank for r in stuck)} waited "
                      f"(in {', '.join(where)}) until the {timeout:g} s timeout. Look for a "
                      f"collective that only some ranks call, or that the ranks call in a "
                      f"different order.", mistake="hung past the timeout")
    return raised_on_ranks(f"{setting},", err)


def _diagnose_grad(got: torch.Tensor, sizes, grads) -> str:
    """Name what gradient ``got`` is (one of the usual mistakes), or ``""``. Says what
    came out, never how to write the loss."""
    ws, count = len(sizes), sum(sizes)
    got = got.double()
    full = sum(grads) / count
    local_means = sum(g / n for g, n in zip(grads, sizes) if n) / ws
    uneven = len({n for n in sizes if n}) > 1
    small, big = min(n for n in sizes if n), max(sizes)

    def weigh(weight: str) -> str:
        return (f"a sample of a rank with n samples weighs {weight}, not 1/{count}, so the "
                f"{small} sample{'s' if small > 1 else ''} of the smallest non-empty local "
                f"batch weigh as much as the {big} of the largest")

    known = [
        (full / ws, f"That is 1/world_size = 1/{ws} of it: DDP divides each rank's gradient "
                    f"by world_size in backward() (it averages over ranks), and nothing in "
                    f"the loss makes up for that."),
        (full / ws ** 2, f"That is 1/world_size² = 1/{ws * ws} of it: divided by "
                         f"world_size={ws} once in the loss, and once more by DDP in "
                         f"backward()."),
        (full * ws, f"That is world_size = {ws} times it: the loss's factor is world_size "
                    f"times too large (a count averaged over the ranks instead of summed "
                    f"does this too)."),
        (sum(grads) / ws, "That is the gradient of each rank's summed loss, averaged over "
                          "ranks by DDP: no sample count divides it."),
    ]
    if uneven:
        known += [
            (local_means, f"That is what DDP makes of each rank's own local mean loss (the "
                          f"default reduction=\"mean\"): the average over ranks of per-rank "
                          f"mean gradients. In it, {weigh('1/(world_size·n)')}."),
            (local_means * ws, f"That is the sum over ranks of per-rank mean gradients: each "
                               f"rank divided its loss by its own local batch size (local "
                               f"batches {list(sizes)}), so {weigh('1/n')}."),
            (local_means / ws, f"That is 1/world_size of the average over ranks of per-rank "
                               f"mean gradients: {weigh('1/(world_size²·n)')}."),
        ]
    for value, why in known:
        if _close(got, value):
            return why
    return ""


def _diagnose_loss(got: float, rank: int, sizes, losses) -> str:
    """Name what logged value ``got`` on ``rank`` is, or ``""``. Says what went wrong,
    never how to write the function."""
    ws, count = len(sizes), sum(sizes)
    if math.isnan(got):
        empty = [r for r, n in enumerate(sizes) if n == 0]
        if empty:
            return (f"Rank {empty[0]} holds no sample here, and the mean of an empty tensor is "
                    f"nan (0 / 0): torch.tensor([]).mean() is tensor(nan). A nan that enters "
                    f"an all_reduce makes the result nan on every rank.")
        return "A nan entered the all_reduce on some rank, and made the result nan on every rank."
    total = float(torch.cat(losses).sum())
    local = losses[rank]
    known = [(float(local.sum()) / count,
              "That holds only this rank's own losses (their sum over the global number of "
              "samples): the other ranks' losses are not in it."),
             (float(local.sum()) * ws / count,
              f"That holds only this rank's own losses (their sum times world_size={ws} over "
              f"the global number of samples): the other ranks' losses are not in it."),
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
        if abs(got - value) <= TOLERANCE * max(1.0, abs(value)):
            return why
    return ""


def _first_sentences(warning: str) -> str:
    """torch's warning up to "silently incorrect behavior." (its first two sentences)."""
    end = warning.find("behavior.")
    return warning[:end + len("behavior.")] if end >= 0 else warning.split(" (Triggered")[0]


def _gradient_outcome(got: torch.Tensor, want: torch.Tensor, but: str) -> str:
    """The closing sentence of a verdict whose gradient may be right by chance: "The gradient
    came out right here, but {but}" when ``got`` is within the check's tolerance of ``want``
    (``_close``), else both gradients, printed by ``_fmt``."""
    if _close(got, want):
        return f"The gradient came out right here, but {but}"
    return f"The gradient came out {_fmt(got)} against {_fmt(want)}."


def _fmt(t: torch.Tensor) -> str:
    """A gradient to 3 decimals: enough to tell the mistakes apart, and far from a
    rounding boundary for the exercise's numbers on any CPU (float32 differs by ~1e-7)."""
    return "[" + ", ".join(f"{v:.3f}" for v in t.tolist()) + "]"


def check_backward_and_log(group: LocalGroup, fn, local_batch_sizes=UNEVEN_BATCHES) -> Verdict:
    """Exercise of notebook 03: one DDP step with uneven local batch sizes.
    ``fn(model, x, y)`` must call ``backward()`` so that DDP's gradient on every rank is
    one process's gradient of the mean squared error over the whole global batch, and
    return the global mean loss to log, with one all_reduce of its own per rank.

    ``fn`` runs on every rank of real gloo ranks. ``model`` is :func:`exercise_model`
    (``nn.Linear(3, 1)``, the same on every rank) wrapped in
    ``DistributedDataParallel``; ``x`` (float32, ``(n, 3)``) and ``y`` (float32,
    ``(n, 1)``) are the rank's local batch (:func:`exercise_batch`), ``n`` its local
    batch size, possibly 0. ``fn`` returns a float or a one-element tensor.

    For each entry of ``local_batch_sizes`` (one local batch size per rank) the group is
    resized to that world size and ``fn`` runs once, on a fresh DDP model. Then, in this
    order: a rank that returned without a ``backward()`` through the model, or whose
    ``backward()`` started no all_reduce of DDP's (after a forward inside
    ``model.no_sync()``), is named (the ranks that wait for it in DDP's all_reduce are
    stopped at once; any other hang is bounded by the group's timeout); a
    ``backward()`` through ``dist.all_reduce`` (torch's warning that
    ``c10d::allreduce_`` has no autograd kernel) fails, and so does one through a
    differentiable collective (a collective made inside ``backward()``, DDP's own left
    out); each rank's gradient (weight, then bias) and returned value are compared with
    :func:`reference`, one process, within :data:`TOLERANCE`; and the collectives ``fn``
    made are counted (a ``TorchDispatchMode`` on each rank, ``c10d`` and
    functional-collective ops; what DDP calls itself, in its forward and in its
    all_reduce of the gradients, which hooks mark, is not counted): exactly one
    all_reduce. The group's world size is restored afterwards.

    Returns:
        A :class:`~reducelab.checks.Verdict`. A wrong answer is told what came out
        against what was expected, and, for the usual mistakes (the default mean loss,
        DDP's division by world_size left in or made twice, a summed loss, a backward()
        through dist.all_reduce or through a differentiable all_reduce, a rank that
        returns before backward() or runs its forward inside no_sync(), nan from an
        empty local batch, a local or mean-of-means log, two all_reduces), what it is;
        it is never told how to write the function.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: a local batch size is negative, or an entry has no sample at all.

    Sources: DDP averages gradients over ranks in ``backward()``
    (https://pytorch.org/docs/stable/notes/ddp.html; ``torch/csrc/distributed/c10d/
    reducer.cpp``, torch 2.13), and every rank must join each collective
    (https://pytorch.org/docs/stable/distributed.html#collective-functions).
    """
    if not callable(fn):
        raise TypeError(f"fn must be the function to run on every rank, "
                        f"backward_and_log(model, x, y); got {fn!r}")
    for sizes in local_batch_sizes:
        if min(sizes) < 0 or sum(sizes) == 0:
            raise ValueError(f"each entry of local_batch_sizes needs local batch sizes of 0 or "
                             f"more, at least one above 0; got {list(sizes)}")
    with restoring_world_size(group):
        for sizes in local_batch_sizes:
            sizes = tuple(int(n) for n in sizes)
            if group.world_size != len(sizes):
                group.resize(len(sizes))
            setting = (f"With world_size={len(sizes)} and local batch sizes {list(sizes)} "
                       f"(global batch {sum(sizes)})")
            try:
                out = group.run(_run_learner, fn, sizes)
            except RankError as err:
                return _explain_failure(setting, sizes, err, group.timeout)
            want_grad, want_loss = reference(sizes)
            losses, grads = _per_rank(sizes)
            for rank, r in enumerate(out):
                if r["through_all_reduce"]:
                    return failed(
                        f"{setting}, rank {rank}'s backward() went through an all_reduce, and "
                        f"torch warned: \"{_first_sentences(r['through_all_reduce'])}\" "
                        f"Autograd has no formula for dist.all_reduce and passes the gradient "
                        f"through it as if it were the identity (question 3). "
                        + _gradient_outcome(r["grad"], want_grad,
                                            "only through that fallback, which torch "
                                            "deprecates and says may be silently incorrect."),
                        mistake="backward() through all_reduce")
            for rank, r in enumerate(out):
                if r["in_backward"]:
                    return failed(
                        f"{setting}, rank {rank}'s backward() {_calls(r['in_backward'])} "
                        f"besides DDP's all_reduce of the gradients: it went back through a "
                        f"differentiable collective, whose backward communicates too. The "
                        f"backward of a differentiable all_reduce "
                        f"(torch.distributed.nn.functional.all_reduce, "
                        f"torch.distributed._functional_collectives.all_reduce) all-reduces "
                        f"the gradient that reaches it, summing it over the ranks, before "
                        f"DDP's all_reduce averages the parameters' gradients over the ranks "
                        f"(torch/distributed/nn/functional.py, _AllReduce.backward; "
                        f"torch/distributed/_functional_collectives.py, all_reduce_backward). "
                        + _gradient_outcome(r["grad"], want_grad,
                                            f"rank {rank} {_calls(r['collectives'])} in all, "
                                            f"besides DDP's all_reduce of the gradients; the "
                                            f"exercise asks for one all_reduce per rank."),
                        mistake="backward() through a differentiable all_reduce")
            for rank, r in enumerate(out):
                if not _close(r["grad"], want_grad):
                    why = _diagnose_grad(r["grad"], sizes, grads)
                    return failed(f"{setting}, one process's gradient of the mean loss over "
                                  f"all {sum(sizes)} samples (weight, then bias) is "
                                  f"{_fmt(want_grad)}, but after your backward() rank {rank} "
                                  f"holds {_fmt(r['grad'])}. {why}".rstrip(),
                                  mistake="wrong gradient")
            for rank, r in enumerate(out):
                if r["kind"] == "shape":
                    return failed(f"{setting}, rank {rank} returned a tensor of shape "
                                  f"{r['value']}; return one number (a float or a "
                                  f"one-element tensor), the global mean loss.")
                if r["kind"] == "type":
                    return failed(f"{setting}, rank {rank} returned a {r['value']}; return "
                                  f"one number (a float or a one-element tensor), the global "
                                  f"mean loss.")
                got = r["value"]
                if not abs(got - want_loss) <= TOLERANCE * max(1.0, abs(want_loss)):
                    why = _diagnose_loss(got, rank, sizes, losses)
                    return failed(f"{setting}, every rank's gradient is right, and the global "
                                  f"mean loss is {want_loss:.4f} (the sum of all "
                                  f"{sum(sizes)} losses divided by {sum(sizes)}), but rank "
                                  f"{rank} returned {got:.4f}. {why}".rstrip(),
                                  mistake="wrong logged loss")
            for rank, r in enumerate(out):
                if r["collectives"] != {"all_reduce": 1}:
                    why = (" Every collective is a round trip through all the ranks, and the "
                           "ranks wait for the slowest at each one (notebook 10 measures what "
                           "one costs)." if sum(r["collectives"].values()) > 1 else "")
                    return failed(f"{setting}, every rank's gradient and logged loss are right, "
                                  f"but rank {rank} {_calls(r['collectives'])}, not counting "
                                  f"what DDP calls itself (in model(x), and its all_reduce of "
                                  f"the gradients in backward()). The exercise asks for one "
                                  f"all_reduce per rank.{why}", mistake="collectives")
        tried = " and ".join(str(list(s)) for s in local_batch_sizes)
        return passed(f"For local batch sizes {tried}, every rank ends with one process's "
                      f"gradient of the mean loss over the global batch and logs the global "
                      f"mean loss, with one all_reduce besides DDP's: each sample counts once, "
                      f"whichever rank holds it, and the rank without samples still joins "
                      f"DDP's all_reduce of the gradients.")


def losses_on_rank(per_sample_losses, aggregations, local_batch_sizes):
    """Runs on every rank for notebook 03's explorer: this rank's per-sample losses (a
    1-D tensor) and each aggregation's value (a list of floats).

    It lives here, not in :mod:`reducelab.widgets.loss`, because a rank imports the
    module of a function it is sent by reference: this one is light, the widgets
    module imports ipywidgets and matplotlib (about 0.4 s of CPU per new rank)."""
    losses = per_sample_losses(local_batch_sizes).detach()
    values = [float(agg(local_batch_sizes)) for agg in aggregations]
    return losses, values
