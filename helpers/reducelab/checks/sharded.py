"""Model, data, single-process reference and the exercise check of notebook 08
(sharded data parallelism: reduce_scatter, all_gather, ZeRO stages 1 to 3, FSDP2).

Everything here runs in the kernel and on the ranks alike (it needs only ``torch``):

* :func:`make_model` and :func:`initial_flat`: the notebook's MLP for the digits
  (64 -> 32 -> 10, tanh), its 2,410 parameters as one flat float32 vector, the same on
  every rank;
* :func:`flat_gradient`: the gradient of the mean cross-entropy with respect to that flat
  vector, on a batch;
* :func:`global_batches` and :func:`local_part`: the global batches of 840 digits and the
  slice of each that a rank holds;
* :func:`reference_run`: one process, Adam on the flat vector, the whole global batch:
  what every sharding must reproduce (:func:`flat_gradient` and :func:`reference_run`
  are also written out in the notebook's step 2, where the learner reads them; the check
  and the explorer use these copies, since they cannot import a notebook, and
  ``tests/test_nb08_sharded.py`` holds the two versions equal bit for bit);
* :func:`placed` and :func:`placed_dtensors`: what a rank holds, placed in the flat
  vector (NaN elsewhere), for the explorer's figure;
* :func:`bytes_gloo_ran` and :func:`what_gloo_runs`: what torch's profiler records of
  the collective gloo runs (notebook 08's step 1 and question 1 import them);
* :func:`ring_bytes`, :func:`counting_collectives`, :func:`storage_bytes` and
  :func:`zero_train`: the byte counting and the hand-written DDP and ZeRO stages 1 to 3
  of notebook 08's steps 1 and 2, where the learner reads them. Notebook 15 (FSDP2)
  imports these copies to compare FSDP2 with our stage 3, and
  ``tests/test_nb08_sharded.py`` holds them equal to the notebook's cells;
* :func:`exercise_run` and :func:`check_zero1_step`: the exercise, a step of DDP + torch's
  ``ZeroRedundancyOptimizer`` written by the learner: ZeRO-1 with each parameter tensor
  owned whole by one rank, and broadcast from it.

Sources: Rajbhandari, Rasley, Ruwase and He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020, arXiv:1910.02054 (stage 2 = optimizer states and
gradients partitioned); ``torch.distributed.reduce_scatter_single`` and
``all_gather_single``, https://pytorch.org/docs/stable/distributed.html ;
``torch/distributed/optim/zero_redundancy_optimizer.py`` in torch 2.13
(``_partition_parameters``, ``step``, ``_sync_params``).
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..data import batch_order, load_digits_tensors, local_slice
from ..errors import RankError
from ..group import LocalGroup
from ..determinism import within
from . import COLLECTIVES, Verdict, failed, passed, raised_on_ranks, restoring_world_size

GLOBAL_BATCH = 840
"""Digits per optimizer step, summed over ranks; divisible by every world size 1 to 8, so
every rank's local batch has the same size and the mean of the ranks' mean losses is the
mean loss of the global batch."""
LR = 0.01
"""Adam's learning rate everywhere in notebook 08."""
ATOL = 1e-6
"""Largest absolute difference accepted between a sharded run and the single-process
reference (float32; the runs measured in the notebook differ by 5e-8 or less). The one
tolerance notebook 08 states: its text, its comparison of every stage with one process and
this check all use it."""
EXERCISE_WORLD_SIZES = (2, 5)
"""World sizes the exercise check runs. ``ZeroRedundancyOptimizer`` gives each of the four
parameter tensors whole to one rank: at 2, rank 0 owns ``0.weight`` (2,048 elements) and
rank 1 the other three (362); at 5, rank 4 owns none."""
EXERCISE_STEPS = 2
"""Adam steps the exercise check takes at each world size."""


def make_model() -> nn.Module:
    """The notebook's model: ``Linear(64, 32) -> Tanh -> Linear(32, 10)``, float32, with
    weights drawn from a generator seeded with 0 (without touching the global RNG), so
    every rank and the kernel build the same model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


LAYOUT = []
"""``(name, offset, shape)`` of each parameter of :func:`make_model` in the flat vector,
in ``named_parameters()`` order: ``0.weight`` (32, 64) at 0, ``0.bias`` (32,) at 2048,
``2.weight`` (10, 32) at 2080, ``2.bias`` (10,) at 2400."""
_offset = 0
for _name, _p in make_model().named_parameters():
    LAYOUT.append((_name, _offset, tuple(_p.shape)))
    _offset += _p.numel()
NUMEL = _offset
"""Number of parameters of :func:`make_model`: 2,410."""
del _offset, _name, _p


def initial_flat() -> torch.Tensor:
    """The model's initial parameters as one flat vector: float32, shape ``(NUMEL,)``,
    parameters concatenated in :data:`LAYOUT` order. A fresh tensor on every call."""
    return torch.cat([p.detach().flatten() for p in make_model().parameters()])


def as_parameters(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of ``flat`` (shape ``(NUMEL,)`` or longer: padding is ignored) shaped as the
    model's parameters, ``{name: view}``; gradients flow back into ``flat``."""
    return {name: flat[o:o + math.prod(shape)].view(shape) for name, o, shape in LAYOUT}


def flat_gradient(flat: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of the mean cross-entropy of the model with parameters ``flat`` on the
    batch ``(X, y)``, with respect to ``flat``.

    Args:
        flat: float32, shape ``(NUMEL,)`` (not modified).
        X, y: float32 ``(b, 64)`` pixels and int64 ``(b,)`` labels.

    Returns:
        float32, shape ``(NUMEL,)``: a fresh tensor (one backward through
        ``torch.func.functional_call`` of :func:`make_model` on views of ``flat``).
    """
    flat = flat.detach()[:NUMEL].clone().requires_grad_()
    logits = torch.func.functional_call(make_model(), as_parameters(flat), (X,))
    F.cross_entropy(logits, y).backward()
    return flat.grad


def global_batches(steps: int) -> list[torch.Tensor]:
    """Indices into the 1,797 digits of the first ``steps`` global batches of
    :data:`GLOBAL_BATCH` samples (``reducelab.data.batch_order``, seed 0): int64 tensors
    of shape ``(840,)``, the same in every process."""
    epochs = math.ceil(steps / (1797 // GLOBAL_BATCH))
    return batch_order(1797, GLOBAL_BATCH, epochs)[:steps]


def local_part(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The indices of a global batch that ``rank`` of ``world_size`` holds: consecutive
    equal pieces in rank order (``reducelab.data.local_slice``)."""
    return indices[local_slice(len(indices), world_size, rank)]


@contextlib.contextmanager
def one_thread():
    """Run torch on one intra-op thread inside the block, as each rank does, then restore
    the previous setting: on a busy 2-core laptop the kernel's multi-threaded matmuls
    are slower than one thread, and one thread sums in the ranks' order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def first_gradient(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One process's gradient on the whole global batch 1, from :func:`initial_flat`: the
    gradient :func:`reference_run`'s first step uses, without its optimizer. Adam's first
    step imports ``torch._dynamo`` (``torch/optim/optimizer.py``; about 1 s of CPU on torch
    2.13), and notebook 14's setup cell, which needs only this gradient, took about 2.1
    times a bare ``import torch`` with it (issue 23).

    Args:
        X, y: the digits, float32 ``(1797, 64)`` and int64 ``(1797,)``.

    Returns:
        float32, shape ``(NUMEL,)``, equal to ``reference_run(X, y, 1)["grads"][0]``.
    """
    with one_thread():
        idx = global_batches(1)[0]
        return flat_gradient(initial_flat(), X[idx], y[idx])


def reference_run(X: torch.Tensor, y: torch.Tensor, steps: int = 1,
                  lr: float = LR) -> dict[str, list[torch.Tensor]]:
    """One process trains on the whole global batch: ``steps`` Adam steps on the flat
    vector, from :func:`initial_flat` (on one thread, see :func:`one_thread`).

    Returns:
        ``{"params": [...], "grads": [...]}``: the flat parameters after each step, and
        the full-batch gradient each step used; float32 tensors of shape ``(NUMEL,)``.
    """
    flat = initial_flat()
    opt = torch.optim.Adam([flat], lr=lr)
    out = {"params": [], "grads": []}
    with one_thread():
        for idx in global_batches(steps):
            flat.grad = flat_gradient(flat, X[idx], y[idx])
            out["grads"].append(flat.grad.clone())
            opt.step()
            out["params"].append(flat.detach().clone())
    return out


# --- what a rank holds, placed in the flat vector (for the figures) ----------------

def placed(values: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """What a rank holds, placed in the flat parameter vector (for the explorer's figure).

    Runs on a rank, or anywhere. Returns float32 of shape ``(NUMEL,)``: ``values`` (any dtype, 1-D)
    from element ``offset`` on, cut at ``NUMEL`` (padding dropped), NaN everywhere else.
    """
    out = torch.full((NUMEL,), float("nan"))
    n = max(0, min(values.numel(), NUMEL - offset))
    out[offset:offset + n] = values.detach().float().flatten()[:n]
    return out


def placed_dtensors(tensors) -> torch.Tensor:
    """What a rank holds of the model's DTensors (FSDP2's parameters or gradients, in
    ``LAYOUT`` order, each sharded with ``Shard(0)``), placed in the flat vector.

    Rank ``r`` holds rows ``r * c`` to ``r * c + c - 1`` of each, ``c = ceil(rows /
    world_size)`` (``torch.chunk``'s rule, which ``fully_shard`` follows). Runs on a
    rank; returns float32 of shape ``(NUMEL,)``, NaN where the rank holds nothing.
    """
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.full((NUMEL,), float("nan"))
    for (_, offset, shape), t in zip(LAYOUT, tensors):
        local = t.to_local().detach().float().flatten()
        start_row = min(rank * math.ceil(shape[0] / n), shape[0])
        start = offset + start_row * math.prod(shape[1:])
        out[start:start + local.numel()] = local
    return out


# --- notebook 08's byte counting and ZeRO stages (copies for notebook 15) ------------

def ring_bytes(collective: str, tensor: torch.Tensor, world_size: int) -> float:
    """Bytes one rank sends in a ring collective: ``2 (n-1)/n · S`` for ``"all_reduce"``,
    ``(n-1)/n · S`` for ``"reduce_scatter"`` and ``"all_gather"``, with ``S`` the bytes
    of ``tensor``, the whole (unsharded) tensor. (Notebook 08, step 1.)"""
    S = tensor.numel() * tensor.element_size()
    return (2 if collective == "all_reduce" else 1) * (world_size - 1) / world_size * S


@contextlib.contextmanager
def counting_collectives():
    """On a rank: record ``(collective, bytes sent)`` (:func:`ring_bytes`) for every
    ``dist.all_reduce``, ``dist.reduce_scatter_single`` and ``dist.all_gather_single``
    called inside the block, by this code or by a library such as FSDP2, which calls
    them through the ``torch.distributed`` module. Yields the list; the module's
    functions are restored on exit. (Notebook 08, step 1.)"""
    sent, originals = [], {}

    def counted(name, call, whole_tensor):
        def wrapper(*args, **kwargs):
            sent.append((name, ring_bytes(name, whole_tensor(*args, **kwargs), dist.get_world_size())))
            return call(*args, **kwargs)
        return wrapper
    for name, attr, whole_tensor in [
            ("all_reduce", "all_reduce", lambda tensor, *a, **k: tensor),
            ("reduce_scatter", "reduce_scatter_single", lambda output, input, *a, **k: input),
            ("all_gather", "all_gather_single", lambda output_tensor, input_tensor, *a, **k: output_tensor)]:
        originals[attr] = getattr(dist, attr)
        setattr(dist, attr, counted(name, originals[attr], whole_tensor))
    try:
        yield sent
    finally:
        for attr, call in originals.items():
            setattr(dist, attr, call)


@contextlib.contextmanager
def _profile_shapes():
    """torch's profiler recording each event's input shapes, without Kineto's own start
    and stop log lines (``KINETO_LOG_LEVEL=99``) in the notebook's output."""
    os.environ["KINETO_LOG_LEVEL"] = "99"
    with torch.profiler.profile(record_shapes=True) as prof:
        yield prof


def bytes_gloo_ran(call) -> float:
    """On a rank: :func:`ring_bytes` of the collective gloo itself runs inside ``call()``,
    as torch's profiler records it (its event ``gloo:<collective>`` and that event's input
    shape; an all_gather's input is one rank's piece, so the whole tensor is ``n`` times
    it). gloo's ``reduce_scatter`` records ``gloo:all_reduce`` on the whole input. Bytes.
    (Notebook 08, step 1's last column.)"""
    with _profile_shapes() as prof:
        call()
    (event,) = [e for e in prof.events() if e.name.startswith("gloo:")]
    name, n = event.name.removeprefix("gloo:"), dist.get_world_size()
    numel = math.prod(event.input_shapes[0]) * (n if name == "all_gather" else 1)   # the whole tensor
    return ring_bytes(name, torch.empty(numel), n)


def what_gloo_runs(numel: int) -> list[tuple[str, list]]:
    """On a rank: the calls inside one ``dist.reduce_scatter_single`` of ``numel`` float32
    elements, as torch's profiler records them: ``(event name, non-empty input shapes)``
    for the top-level events and the children of ``c10d::_reduce_scatter_base_``.
    (Notebook 08, question 1's evidence: on gloo, a clone, one all_reduce of the whole
    input, a chunk and a copy.)"""
    shard, grad = torch.empty(numel // dist.get_world_size()), torch.randn(numel)
    with _profile_shapes() as prof:
        dist.reduce_scatter_single(shard, grad)
    return [(e.name, [s for s in e.input_shapes if s]) for e in prof.events()
            if e.cpu_parent is None or e.cpu_parent.name == "c10d::_reduce_scatter_base_"]


def storage_bytes(*tensors) -> int:
    """Bytes of the tensors' storages, each storage counted once (``None`` skipped): a
    view costs nothing, a copy counts. (Notebook 08, step 2.)"""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def zero_train(stage: str, X: torch.Tensor, y: torch.Tensor, steps: int = 1,
               reduce_dtype: str = "float32", optimizer_name: str = "Adam") -> dict:
    """Runs on every rank: ``steps`` optimizer steps of ``stage`` (``"DDP"``, ``"ZeRO-1"``,
    ``"ZeRO-2"`` or ``"ZeRO-3"``) on the flat vector padded to ``n * k`` elements,
    ``k = ceil(NUMEL / n)``; the gradient travels in ``reduce_dtype``. The optimizer is
    Adam, or with ``optimizer_name="SGD"`` SGD with momentum 0.9 (one state tensor per
    parameter: notebook 08's question 2). Notebook 08's step 2, where the learner reads
    it line by line.

    Returns:
        ``{"params": [flat float32 (NUMEL,) after each step], "before", "grad", "after"
        (float32 (NUMEL,), NaN where the rank holds nothing: see :func:`placed`), "bytes"
        ({kind: bytes} kept between steps), "sent" ([(collective, bytes)] of the last
        step)}``.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    k = math.ceil(NUMEL / n)
    lo = rank * k
    full = F.pad(initial_flat(), (0, n * k - NUMEL))
    if stage == "DDP":
        mine = full
    elif stage == "ZeRO-3":
        mine, full = full[lo:lo + k].clone(), None
    else:
        mine = full[lo:lo + k]
    if optimizer_name == "Adam":
        optimizer = torch.optim.Adam([mine], lr=LR)
    elif optimizer_name == "SGD":
        optimizer = torch.optim.SGD([mine], lr=LR, momentum=0.9)
    else:
        raise ValueError(f"optimizer_name must be 'Adam' or 'SGD', got {optimizer_name!r}")
    dtype = getattr(torch, reduce_dtype)
    out = {"params": []}
    for idx in global_batches(steps):
        part = local_part(idx, rank, n)
        with counting_collectives() as sent:
            if stage == "ZeRO-3":
                full = torch.empty(n * k)
                dist.all_gather_single(full, mine)
            out["before"] = placed(full) if stage != "ZeRO-3" else placed(mine, lo)
            grad = F.pad(flat_gradient(full, X[part], y[part]), (0, n * k - NUMEL)).to(dtype)
            if stage == "ZeRO-3":
                full = None
            if stage in ("DDP", "ZeRO-1"):
                dist.all_reduce(grad, op=dist.ReduceOp.AVG)
                mine.grad = (grad if stage == "DDP" else grad[lo:lo + k]).float()
            else:
                shard = torch.empty(k, dtype=dtype)
                dist.reduce_scatter_single(shard, grad, op=dist.ReduceOp.AVG)
                mine.grad, grad = shard.float(), None
            optimizer.step()
            if stage in ("ZeRO-1", "ZeRO-2"):
                dist.all_gather_single(full, mine)
        out["sent"] = sent
        out["grad"] = placed(mine.grad, 0 if stage == "DDP" else lo)
        out["after"] = placed(full) if full is not None else placed(mine, lo)
        out["bytes"] = {"parameters": storage_bytes(full, mine),
                        "gradients": storage_bytes(grad, mine.grad),
                        "optimizer state": storage_bytes(*optimizer.state[mine].values())}
        whole = torch.empty(n * k)
        dist.all_gather_single(whole, mine if full is None else full[lo:lo + k])
        out["params"].append(whole[:NUMEL])
    return out


# --- the exercise ---------------------------------------------------------------------

PARAM_NAMES = tuple(name for name, _, _ in LAYOUT)
"""The model's parameters in ``model.parameters()`` order: ``0.weight``, ``0.bias``,
``2.weight``, ``2.bias`` (2,048, 32, 320 and 10 elements)."""
_NAME_OF_SIZE = {math.prod(shape): name for name, _, shape in LAYOUT}
"""Element count -> parameter name: the four counts differ, so a recorded broadcast of
``n`` elements names the parameter it carried."""
RECORDED = COLLECTIVES
"""The ``torch.distributed`` calls that :func:`check_zero1_step` records on each rank
(with their ``src`` or ``dst``), to tell a step whose parameters travel by a broadcast
from each owner from one that reached the right numbers another way (an all_reduce of the
parameters, a gather of the gradients)."""
ALLOWED = ("all_reduce", "reduce", "broadcast")
"""The collectives a step of DDP + ``ZeroRedundancyOptimizer`` needs: an ``all_reduce``
(DDP's; or a ``reduce`` to each owner) of the gradients and a ``broadcast`` per
parameter. :func:`check_zero1_step` names any other call of :data:`RECORDED`."""


def _zero_redundancy_adam(params):
    """torch's ``ZeroRedundancyOptimizer`` over ``params`` with Adam at :data:`LR` (its
    constructor calls no collective; it partitions in ``_partition_parameters``)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=LR)


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in params])


def _set_local_gradients(params, X: torch.Tensor, y: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Give each of ``params`` (:data:`LAYOUT` order) its local gradient on ``part`` as
    ``.grad``; returns the flat local gradient (float32 ``(NUMEL,)``)."""
    grad = flat_gradient(_flat(params), X[part], y[part])
    for p, g in zip(params, as_parameters(grad).values()):
        p.grad = g.clone()
    return grad


@contextlib.contextmanager
def _recording():
    """On a rank: record ``(name, peer, numel)`` for every call of :data:`RECORDED`
    inside the block (``peer``: the ``src`` or ``dst`` passed, else ``None``; ``numel``:
    the elements of the ``tensor`` argument, else ``None``). Yields the list; the module's
    functions are restored on exit."""
    import inspect
    calls, originals = [], {name: getattr(dist, name) for name in RECORDED if hasattr(dist, name)}

    def recorded(name, call):
        try:
            signature = inspect.signature(call)
        except (TypeError, ValueError):
            signature = None

        def wrapper(*args, **kwargs):
            peer = numel = None
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments if signature else {}
                for key in ("src", "dst", "group_src", "group_dst"):
                    if bound.get(key) is not None:
                        peer = bound[key]
                        break
                if isinstance(bound.get("tensor"), torch.Tensor):
                    numel = bound["tensor"].numel()
            except TypeError:
                pass
            calls.append((name, peer, numel))
            return call(*args, **kwargs)
        return wrapper
    for name, call in originals.items():
        setattr(dist, name, recorded(name, call))
    try:
        yield calls
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)


def exercise_run(zero1_step, X: torch.Tensor, y: torch.Tensor, steps: int = EXERCISE_STEPS) -> dict:
    """Runs on every rank: ``steps`` training steps of torch's own DDP +
    ``ZeroRedundancyOptimizer``, then ``steps`` in which the learner's
    ``zero1_step(params, optimizer)`` does all communication and the update.

    torch's run: the model's parameters get this rank's local gradient on its part of each
    global batch, ``dist.all_reduce(grad, op=ReduceOp.AVG)`` averages each (what DDP
    does), and ``ZeroRedundancyOptimizer.step()`` steps this rank's parameters and
    broadcasts every parameter from its owner (``_sync_params``). The learner's run: a
    fresh model, each parameter's ``.grad`` the local gradient, and ``optimizer`` the Adam
    that a ``ZeroRedundancyOptimizer`` keeps on this rank (its ``.optim``: over the
    parameters this rank owns, none on a rank that owns none).

    Returns:
        ``{"mine": [names of the parameters torch gave this rank], "torch": [flat float32
        (NUMEL,) parameters after each of torch's steps], "steps": [one dict per learner
        step: "params" (flat, after the call), "local" (the flat local gradient given),
        "grads" ({name: .grad after the call, or None}), "calls" ([(collective, src or
        dst, numel)] the call made, see _recording)]}``.
    """
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    params = list(make_model().parameters())
    zero = _zero_redundancy_adam(params)
    torch_params = []
    for idx in global_batches(steps):
        _set_local_gradients(params, X, y, local_part(idx, rank, n))
        for p in params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        zero.step()
        torch_params.append(_flat(params))
    params = list(make_model().parameters())
    optimizer = _zero_redundancy_adam(params).optim
    index = {id(p): i for i, p in enumerate(params)}
    mine = [PARAM_NAMES[index[id(p)]] for g in optimizer.param_groups for p in g["params"]]
    records = []
    for idx in global_batches(steps):
        local = _set_local_gradients(params, X, y, local_part(idx, rank, n))
        with _recording() as calls:
            zero1_step(params, optimizer)
        records.append({"params": _flat(params), "local": local, "calls": calls,
                        "grads": {name: None if p.grad is None else p.grad.detach().clone()
                                  for name, p in zip(PARAM_NAMES, params)}})
    return {"mine": mine, "torch": torch_params, "steps": records}


def _split(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: flat[o:o + math.prod(shape)] for name, o, shape in LAYOUT}


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=0))


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _size(name: str) -> int:
    return next(math.prod(shape) for nm, _, shape in LAYOUT if nm == name)


def _greedy(world_size: int, order) -> dict[str, int]:
    """Owners given by the greedy rule over the parameter names in ``order``: each to the
    rank with the fewest elements so far, the lowest among equals."""
    held, owner = [0] * world_size, {}
    for name in order:
        owner[name] = held.index(min(held))
        held[owner[name]] += _size(name)
    return owner


def _owners_text(owner: dict[str, int]) -> str:
    return ", ".join(f"{name} -> rank {owner[name]}" for name in PARAM_NAMES if name in owner)


def _partition_mistake(what: str, name: str, used: int, owner: dict[str, int],
                       theirs: dict[str, int], ws: int) -> str:
    """Why a parameter came from (or went to) a rank that does not own it under torch's
    partition, with the rule the learner's owners seem to follow."""
    what_happened = (f"rank {used}'s copy is never stepped" if what == "broadcast from" else
                     f"the mean gradient reached rank {used}, which does not step {name}")
    text = (f"{name} ({_size(name):,} elements) was {what} rank {used}, but torch's "
            f"ZeroRedundancyOptimizer made rank {owner[name]} its owner: rank {owner[name]}'s "
            f"optimizer holds {name} and steps it, {what_happened}. "
            f"Owners by your calls: {_owners_text(theirs)}; torch's: {_owners_text(owner)}.")
    if len(theirs) == len(PARAM_NAMES):
        by_size = sorted(PARAM_NAMES, key=_size)
        if set(theirs.values()) == {0}:
            text += " You used rank 0 for every parameter, and rank 0 steps only what it owns."
        elif theirs == _greedy(ws, PARAM_NAMES):
            text += (" Yours are the greedy rule applied in the order of model.parameters(), "
                     "without sorting by size first.")
        elif theirs == {nm: i % ws for i, nm in enumerate(PARAM_NAMES)}:
            text += (" Yours give params[i] to rank i % world_size, round robin by position; "
                     "torch looks at the sizes.")
        elif theirs == _greedy(ws, by_size):
            text += " Yours are the greedy rule with the smallest parameter first."
    return (text + " torch's _partition_parameters sorts the parameters by numel(), largest "
            "first, and gives each in turn to the rank with the fewest elements so far "
            "(the lowest rank among equals).")


def _check_owners(owners: dict) -> str:
    """Why the learner's predicted owners (``{world size: [owner of each parameter, in
    model.parameters() order]}``) are not torch's partition, or ``""``. Names the rule a
    wrong list follows and the tensors it places wrongly, never the right ranks."""
    for ws, guess in owners.items():
        name = f"owners_ws{ws}"
        if guess is None:
            return (f"{name} is still None. Before you write zero1_step: at world size {ws}, "
                    f"which rank owns each of the 4 tensors? A list of {len(PARAM_NAMES)} ranks, "
                    f"in model.parameters() order ({', '.join(PARAM_NAMES)}).")
        if (not isinstance(guess, (list, tuple)) or len(guess) != len(PARAM_NAMES)
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in guess)):
            return (f"{name} should be a list of {len(PARAM_NAMES)} ranks (integers), one per "
                    f"tensor in model.parameters() order ({', '.join(PARAM_NAMES)}); got {guess!r}.")
        if any(not 0 <= r < ws for r in guess):
            return f"{name} names a rank outside 0 to {ws - 1}: the world size is {ws}."
        theirs, torchs = dict(zip(PARAM_NAMES, guess)), _greedy(ws, sorted(PARAM_NAMES, key=_size,
                                                                           reverse=True))
        if theirs == torchs:
            continue
        wrong = [nm for nm in PARAM_NAMES if theirs[nm] != torchs[nm]]
        text = (f"{name} is not the partition torch makes at world size {ws}: "
                f"{', '.join(wrong[:-1]) + ' and ' if wrong[:-1] else ''}{wrong[-1]} "
                f"{'goes' if len(wrong) == 1 else 'go'} to another rank.")
        if set(guess) == {0}:
            text += " Every tensor on rank 0 would leave the other ranks nothing to step."
        elif theirs == _greedy(ws, PARAM_NAMES):
            text += " Yours are the greedy rule in model.parameters() order, without sorting by size."
        elif theirs == {nm: i % ws for i, nm in enumerate(PARAM_NAMES)}:
            text += " Yours are round robin by position; torch looks at the sizes."
        elif theirs == _greedy(ws, sorted(PARAM_NAMES, key=_size)):
            text += " Yours are the greedy rule with the smallest tensor first."
        return (text + " Go through the tensors largest first, and give each to the rank that "
                "holds the fewest elements so far (the lowest rank among equals), counting "
                "the elements each rank already holds.")
    return ""


def _peers(calls, collective: str) -> dict[str, int]:
    """``{parameter name: the src (or dst) of the first call of collective on it}``."""
    out = {}
    for name, peer, numel in calls:
        if name == collective and numel in _NAME_OF_SIZE and peer is not None:
            out.setdefault(_NAME_OF_SIZE[numel], peer)
    return out


def _diagnose_grads(rec: dict, mine: list[str], ref_grad: torch.Tensor, owner: dict[str, int],
                    rank: int, ws: int) -> str:
    want, local = _split(ref_grad), _split(rec["local"])
    for name in mine:
        got = rec["grads"][name]
        if got is None:
            return (f"{name}.grad is None on rank {rank}, which owns {name}: its owner needs the "
                    f"mean gradient of {name} when its optimizer steps (an optimizer skips a "
                    f"parameter without a .grad).")
        got = got.flatten()
        if got.numel() != want[name].numel():
            return (f"{name}.grad has {got.numel()} elements on rank {rank}; expected "
                    f"{want[name].numel()}, the size of {name}.")
        if _close(got, want[name]):
            continue
        head = (f"On rank {rank}, which owns {name}, the gradient of {name} is not the mean "
                f"over the {ws} ranks of their local gradients.")
        if _close(got, want[name] * ws, atol=ATOL * ws):
            return (f"{head} It is their SUM, {ws} times the mean. Adam nearly hides this: it "
                    f"divides by the square root of the gradient's running square, so a "
                    f"gradient {ws} times larger moves most parameters just as far; only those "
                    f"whose gradient is small next to Adam's eps (1e-8) move differently. "
                    f"DDP averages over the ranks.")
        if _close(got, local[name]):
            return (f"{head} It is this rank's own local gradient: nothing was averaged "
                    f"across ranks, so each owner would step on its {GLOBAL_BATCH // ws} "
                    f"digits instead of the global batch of {GLOBAL_BATCH}.")
        reduced = _peers(rec["calls"], "reduce")
        if name in reduced and reduced[name] != owner[name]:
            return f"{head} " + _partition_mistake("reduced to", name, reduced[name], owner,
                                                   reduced, ws)
        return f"{head} (largest difference {_worst(got, want[name]):.1g}; expected at most {ATOL:g})"
    return ""


def _diagnose_params(rec: dict, want_flat: torch.Tensor, before_flat: torch.Tensor,
                     owner: dict[str, int], rank: int, ws: int, step: int,
                     names=PARAM_NAMES) -> str:
    """Why the parameters ``names`` on ``rank`` after ``step`` are not the reference's
    (an empty string if they are)."""
    if rec["params"].numel() != NUMEL:
        return (f"the parameters hold {rec['params'].numel()} elements on rank {rank} after "
                f"step {step + 1}; expected {NUMEL}: each keeps its shape.")
    got, want, before = _split(rec["params"]), _split(want_flat), _split(before_flat)
    wrong = [name for name in names if not _close(got[name], want[name])]
    if not wrong:
        return ""
    name = wrong[0]
    o = owner[name]
    head = (f"After step {step + 1} on rank {rank}, {name} differs from one process's on the "
            f"whole global batch (largest difference {_worst(got[name], want[name]):.1g}; "
            f"expected at most {ATOL:g}).")
    sent = _peers(rec["calls"], "broadcast")
    if name in sent and sent[name] != o:
        return f"{head} " + _partition_mistake("broadcast from", name, sent[name], owner, sent, ws)
    if rank == o:
        if name not in sent and not torch.equal(got[name], before[name]):
            return (f"{head} Rank {rank} owns {name}, yet after your call it is not one "
                    f"process's value, and no broadcast of {name} was recorded. The owner's "
                    f"{name} should hold just what its own optimizer step gave; a collective "
                    f"that reduces the parameters, an all_reduce for one, mixes its new values "
                    f"with the other ranks' values from before the step.")
        if torch.equal(got[name], before[name]):
            return (f"{head} Rank {rank} owns {name}, yet {name} still holds its value from "
                    f"before the step: this rank's optimizer never stepped it.")
        return (f"{head} Rank {rank} owns {name}, and after your call its gradient is the mean "
                f"over the ranks, yet its own step did not give one process's value: an "
                f"optimizer steps with whatever .grad holds at the moment it steps.")
    if not any(call == "broadcast" for call, _, _ in rec["calls"]):
        if torch.equal(got[name], before[name]):
            return (f"{head} It still holds its value from before the step: rank {o} owns "
                    f"{name} and stepped it, but no broadcast was called, so no other rank "
                    f"received it. Every rank needs every updated parameter for its next "
                    f"forward pass.")
        return head
    if name not in sent:
        return (f"{head} No broadcast of {name} ({_size(name):,} elements) was called: rank "
                f"{o} owns it and stepped it, and only a broadcast from rank {o} brings its "
                f"new values to the other ranks.")
    if torch.equal(got[name], before[name]):
        return (f"{head} It still holds its value from before the step, although a broadcast "
                f"of {_size(name):,} elements from its owner, rank {o}, ran: the values went "
                f"into another tensor than the parameter itself (a copy of it, or its .grad). "
                f"A broadcast overwrites the tensor it is given, on every rank but src.")
    return head


def _explain_error(err: RankError) -> str:
    text = " ".join(r.summary for r in err.reports if r.summary)
    if any(r.state == "stuck" for r in err.reports):
        return (" A rank waited in a collective that another rank did not call. Every rank "
                "calls each broadcast, for the same parameter and in the same order, a rank "
                "that owns nothing included; src only names the rank whose values they all "
                "receive.")
    if "leaf Variable" in text or "requires grad" in text:
        return (" The parameters are leaf tensors that require grad: while autograd "
                "records, it refuses an in-place operation on them, which is what torch's "
                "error above says.")
    return ""


def _policy(calls, owner: dict[str, int], ws: int, rank: int) -> str:
    """Why one step's calls on one rank are not those of DDP + ZeroRedundancyOptimizer
    (an empty string if they are)."""
    used = ", ".join(sorted({f"dist.{c}" for c, _, _ in calls})) or "no collective"
    other = [c for c, _, _ in calls if c not in ALLOWED]
    if other:
        if any("gather" in c for c in other):
            why = ("A gather brings whole tensors to every rank (or to one): gathering every "
                   "rank's gradient sends n-1 copies of it where DDP's all_reduce sends "
                   "2(n-1)/n of it (step 1's formulas), and each parameter needs to come from "
                   "its owner alone.")
        else:
            why = ""
        return (f"at world_size={ws} rank {rank} called dist.{other[0]} (its calls: {used}). "
                f"{why} DDP + ZeroRedundancyOptimizer need only an all_reduce of the gradients "
                f"(or a reduce to each owner) and one broadcast per parameter, from its owner.")
    broadcasts = sorted((_NAME_OF_SIZE.get(numel, f"{numel} elements"), peer)
                        for c, peer, numel in calls if c == "broadcast")
    want = sorted(owner.items())
    if not broadcasts:
        return (f"at world_size={ws} rank {rank} never called dist.broadcast (its calls: "
                f"{used}). The parameters reached every rank another way (an all_reduce in "
                f"which non-owners add zeros, say: additions nobody needs), where "
                f"ZeroRedundancyOptimizer's _sync_params sends each parameter once, by a "
                f"broadcast from its owner.")
    if broadcasts != want:
        got = ", ".join(f"{nm} from rank {peer}" for nm, peer in broadcasts)
        return (f"at world_size={ws} rank {rank} called {len(broadcasts)} broadcast(s) in one "
                f"step ({got}); ZeroRedundancyOptimizer sends each of the {len(PARAM_NAMES)} "
                f"parameters once, from its owner ({_owners_text(owner)}).")
    return ""


def check_zero1_step(group: LocalGroup, zero1_step, world_sizes=EXERCISE_WORLD_SIZES,
                     steps: int = EXERCISE_STEPS, owners: dict | None = None) -> Verdict:
    """Exercise of notebook 08: ``zero1_step(params, optimizer)`` must do one step of DDP +
    torch's ``ZeroRedundancyOptimizer`` on this rank: average every gradient over the
    ranks, step the parameters this rank owns (``optimizer`` holds exactly those), and
    broadcast every parameter from its owner, the rank torch's greedy partition gives it
    (``torch/distributed/optim/zero_redundancy_optimizer.py``: ``_partition_parameters``,
    ``step``, ``_sync_params``).

    Runs :func:`exercise_run` on real ranks at each world size in ``world_sizes`` (the
    group is resized, then restored; each wait is bounded by the group's timeout) for
    ``steps`` Adam steps on the digits, and compares every rank, after every step, with
    :func:`reference_run` (one process, whole global batch): the gradient of each
    parameter on its owner with the mean gradient, and every parameter on every rank
    with the reference parameters, and with torch's own ``ZeroRedundancyOptimizer`` run
    on the same ranks (absolute tolerance :data:`ATOL`). Each rank's collectives are
    recorded (:data:`RECORDED`): one broadcast per parameter and step, from its owner,
    and nothing but :data:`ALLOWED`.

    ``owners``, where given, maps a world size to the learner's prediction of the owners
    (a list of ranks, one per parameter in ``model.parameters()`` order: the exercise's
    ``owners_ws2`` and ``owners_ws5``); it is checked first, against torch's partition, and
    a wrong one is explained without the right ranks (fifth review, 08-4).

    Returns:
        A :class:`~reducelab.checks.Verdict`. A wrong answer is explained: a gradient that
        is the sum (Adam nearly hides it), the rank's own unaveraged gradient, a parameter
        broadcast from (or reduced to) a rank that does not own it, with the rule the
        learner's owners follow (all rank 0, round robin, greedy unsorted or smallest
        first), a parameter never broadcast, or broadcast into a copy; an error on the
        ranks is quoted, with what it means. Right numbers reached without a broadcast
        from each owner, or with a gather, fail too. A ``zero1_step`` that is not callable
        is refused before anything runs.
    """
    if not callable(zero1_step):
        return failed(f"check_zero1_step needs your function zero1_step(params, optimizer), "
                      f"got {zero1_step!r}.")
    why_owners = _check_owners(owners or {})
    if why_owners:
        return failed(why_owners, mistake="wrong owners")
    X, y = load_digits_tensors()
    ref = reference_run(X, y, steps)
    initial = initial_flat()
    owners_at, worst, worst_torch = {}, 0.0, 0.0
    with restoring_world_size(group):
        for ws in world_sizes:
            group.resize(ws)
            try:
                out = group.run(exercise_run, zero1_step, X, y, steps)
            except RankError as err:
                verdict = raised_on_ranks(f"With world_size={ws},", err)
                message = verdict.message.rstrip()
                if not message.endswith((".", "?", "!")):
                    message += "."
                return failed(message + _explain_error(err), mistake=verdict.mistake)
            owner = {name: rank for rank, o in enumerate(out) for name in o["mine"]}
            owners_at[ws] = owner
            for step in range(steps):
                before = initial if step == 0 else ref["params"][step - 1]
                for rank, o in enumerate(out):       # every owner's gradients first
                    why = _diagnose_grads(o["steps"][step], o["mine"], ref["grads"][step],
                                          owner, rank, ws)
                    if why:
                        return failed(f"With world_size={ws}, step {step + 1}: {why}")
                for rank, o in enumerate(out):       # then each owner's own parameters
                    why = _diagnose_params(o["steps"][step], ref["params"][step], before,
                                           owner, rank, ws, step, o["mine"])
                    if why:
                        return failed(f"With world_size={ws}: {why}")
                for rank, o in enumerate(out):       # then every rank's parameters
                    why = _diagnose_params(o["steps"][step], ref["params"][step], before,
                                           owner, rank, ws, step)
                    if why:
                        return failed(f"With world_size={ws}: {why}")
                    mine, theirs = o["steps"][step]["params"], o["torch"][step]
                    if not _close(mine, theirs):
                        return failed(
                            f"With world_size={ws}, after step {step + 1} on rank {rank}, the "
                            f"parameters are within {ATOL:g} of one process's but not of torch's "
                            f"ZeroRedundancyOptimizer run on the same ranks (largest difference "
                            f"{_worst(mine, theirs):.1g}).")
                    worst = max(worst, _worst(mine, ref["params"][step]))
                    worst_torch = max(worst_torch, _worst(mine, theirs))
            for rank, o in enumerate(out):
                for rec in o["steps"]:
                    why = _policy(rec["calls"], owner, ws, rank)
                    if why:
                        sizes = " and ".join(map(str, world_sizes))
                        return failed(f"At world sizes {sizes} the gradients and the parameters "
                                      f"are right, but {why}")
    sizes = " and ".join(map(str, world_sizes))

    def owned(owner, ws):
        counts = [sum(_size(nm) for nm in PARAM_NAMES if owner[nm] == r) for r in range(ws)]
        return ", ".join(f"rank {r} {c:,}" for r, c in enumerate(counts))
    return passed(f"At world sizes {sizes}, after {steps} Adam steps, every rank's parameters "
                  f"equal one process's on the whole global batch ({within(worst, ATOL)}) and "
                  f"those of torch's own ZeroRedundancyOptimizer on the same ranks "
                  f"({within(worst_torch, ATOL)}); each owner's gradients are the mean over the "
                  f"ranks, and each parameter travelled once per step, by a broadcast from its "
                  f"owner. Elements owned (Adam state kept for them): "
                  + "; ".join(f"at world_size={ws}: {owned(owners_at[ws], ws)}" for ws in world_sizes)
                  + ". A rank that owns nothing keeps no Adam state, yet takes part in every "
                    "broadcast.")


__all__ = ["GLOBAL_BATCH", "LR", "ATOL", "LAYOUT", "NUMEL", "make_model", "initial_flat",
           "as_parameters", "flat_gradient", "global_batches", "local_part", "one_thread",
           "first_gradient", "reference_run",
           "placed", "placed_dtensors", "ring_bytes", "counting_collectives", "storage_bytes",
           "zero_train", "exercise_run", "check_zero1_step"]
