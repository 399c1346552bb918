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
* :func:`ring_bytes`, :func:`counting_collectives`, :func:`storage_bytes` and
  :func:`zero_train`: the byte counting and the hand-written DDP and ZeRO stages 1 to 3
  of notebook 08's steps 1 and 2, where the learner reads them. Notebook 15 (FSDP2)
  imports these copies to compare FSDP2 with our stage 3, and
  ``tests/test_nb08_sharded.py`` holds them equal to the notebook's cells;
* :func:`check_zero2_step`: the exercise, a ZeRO-2 step written by the learner.

Sources: Rajbhandari, Rasley, Ruwase and He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020, arXiv:1910.02054 (stage 2 = optimizer states and
gradients partitioned); ``torch.distributed.reduce_scatter_single`` and
``all_gather_single``, https://pytorch.org/docs/stable/distributed.html
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..data import batch_order, load_digits_tensors, local_slice
from ..errors import RankError
from ..group import LocalGroup
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
tolerance notebook 08 states: its text, its question 5 and this check all use it."""
EXERCISE_WORLD_SIZES = (2, 4)
"""World sizes the exercise check runs: 2,410 elements divide by 2, not by 4."""
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


def storage_bytes(*tensors) -> int:
    """Bytes of the tensors' storages, each storage counted once (``None`` skipped): a
    view costs nothing, a copy counts. (Notebook 08, step 2.)"""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def zero_train(stage: str, X: torch.Tensor, y: torch.Tensor, steps: int = 1,
               reduce_dtype: str = "float32") -> dict:
    """Runs on every rank: ``steps`` Adam steps of ``stage`` (``"DDP"``, ``"ZeRO-1"``,
    ``"ZeRO-2"`` or ``"ZeRO-3"``) on the flat vector padded to ``n * k`` elements,
    ``k = ceil(NUMEL / n)``; the gradient travels in ``reduce_dtype``. Notebook 08's
    step 2, where the learner reads it line by line.

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
    optimizer = torch.optim.Adam([mine], lr=LR)
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

def exercise_run(zero2_step, X: torch.Tensor, y: torch.Tensor,
                 steps: int = EXERCISE_STEPS) -> list[dict]:
    """Runs on every rank: ``steps`` training steps in which the learner's
    ``zero2_step(flat_params, flat_grad, my_shard, optimizer)`` does all communication
    and the update.

    The rank holds every parameter (``flat_params``, float32 ``(NUMEL,)``), computes its
    local gradient on its part of each global batch (``flat_grad``), and owns
    ``my_shard``: ``k = ceil(NUMEL / world_size)`` elements of the flat vector padded with
    zeros to ``world_size * k``, starting at ``rank * k``; ``optimizer`` is Adam over
    ``[my_shard]`` alone.

    Returns:
        One dict per step: ``params`` (``flat_params`` after the call), ``grad``
        (``my_shard.grad`` after the call, or ``None``), ``local`` (the local gradient
        before the call).
    """
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    k = math.ceil(NUMEL / n)
    flat_params = initial_flat()
    my_shard = nn.Parameter(F.pad(flat_params, (0, n * k - NUMEL))[rank * k:(rank + 1) * k].clone())
    optimizer = torch.optim.Adam([my_shard], lr=LR)
    records = []
    for idx in global_batches(steps):
        part = local_part(idx, rank, n)
        flat_grad = flat_gradient(flat_params, X[part], y[part])
        local = flat_grad.clone()
        zero2_step(flat_params, flat_grad, my_shard, optimizer)
        grad = my_shard.grad
        records.append({"params": flat_params.detach().clone(), "local": local,
                        "grad": None if grad is None else grad.detach().clone()})
    return records


REDUCE_SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
"""The ``torch.distributed`` calls that reduce-scatter: a ZeRO-2 step calls one of them."""

RECORDED = COLLECTIVES
"""The ``torch.distributed`` calls whose names :func:`check_zero2_step` records on each
rank, to tell a step that reduce-scatters from one that reached the right numbers with
every rank's whole gradient (an all_reduce, or an all_gather of the gradients)."""


def _exercise_run_counted(zero2_step, X: torch.Tensor, y: torch.Tensor, steps: int) -> tuple:
    """Runs on every rank: :func:`exercise_run` with the name of every call of
    :data:`RECORDED` recorded, in order. Returns ``(records, calls)``: ``exercise_run``'s
    records and those names (``"reduce_scatter_single"``, ``"all_gather_into_tensor"``, ...)."""
    calls, originals = [], {name: getattr(dist, name) for name in RECORDED if hasattr(dist, name)}

    def recorded(name, call):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return call(*args, **kwargs)
        return wrapper
    for name, call in originals.items():
        setattr(dist, name, recorded(name, call))
    try:
        records = exercise_run(zero2_step, X, y, steps)
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)
    return records, calls


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=0))


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _explain_error(ws: int, err: RankError) -> str:
    text = " ".join(r.summary for r in err.reports if r.summary)
    k = math.ceil(NUMEL / ws)
    if "worldSize == inputShape" in text or "outputShape" in text:
        return (f" reduce_scatter needs an input of exactly world_size x k elements: with "
                f"{NUMEL} parameters on {ws} ranks, k = ceil({NUMEL} / {ws}) = {k}, so pad "
                f"the flat gradient with {ws * k - NUMEL} zero(s) at the end, to {ws * k} "
                f"elements, before you reduce-scatter it.")
    if "gradient of size" in text or "must match the size" in text:
        return (f" The gradient you gave my_shard has another size than my_shard ({k} "
                f"elements at world_size={ws}). {NUMEL} does not divide by {ws}: each shard "
                f"has k = ceil({NUMEL} / {ws}) = {k} elements (my_shard.numel()), not "
                f"{NUMEL} // {ws} = {NUMEL // ws}; the last rank's shard ends with padding.")
    if "allgather" in text or "all_gather" in text:
        return (f" all_gather needs an output of exactly world_size x k = {ws * k} "
                f"elements: gather into a padded buffer, then copy its first {NUMEL} "
                f"elements into flat_params.")
    return ""


def _diagnose_grad(got, want, local, ref_padded, rank: int, ws: int, k: int) -> str:
    if got is None:
        return (f"my_shard.grad is None on rank {rank}: set it to this rank's shard of the "
                f"mean gradient (k = {k} elements) before the optimizer steps; an optimizer "
                f"skips a tensor without a .grad.")
    if got.shape != want.shape:
        return (f"my_shard.grad has shape {tuple(got.shape)} on rank {rank}; expected "
                f"({k},), the size of my_shard.")
    if _close(got, want):
        return ""
    start = rank * k
    head = (f"On rank {rank}, my_shard.grad differs from this rank's shard of the mean "
            f"gradient, elements {start} to {start + k - 1} of the flat vector padded to "
            f"{ws * k} (largest difference {_worst(got, want):.3g}).")
    if _close(got, want * ws, atol=ATOL * ws):
        return (f"{head} It is the SUM over the {ws} ranks, {ws} times the mean: "
                f"reduce_scatter adds the ranks' gradients, so divide the shard by "
                f"world_size (or reduce with ReduceOp.AVG).")
    local_padded = F.pad(local, (0, ws * k - NUMEL))
    if _close(got, local_padded[start:start + k]):
        return (f"{head} It is this rank's own local gradient: nothing was reduced across "
                f"ranks. Reduce-scatter the flat gradient and step with the result.")
    for scale, what in ((1.0, "mean"), (float(ws), "sum")):
        for o in range(0, ws * k - k + 1):
            if o != start and _close(got, ref_padded[o:o + k] * scale, atol=ATOL * scale):
                why = (f" {NUMEL} does not divide by {ws}: every shard has k = ceil({NUMEL} / "
                       f"{ws}) = {k} elements, rank r's starts at r * k, and the flat "
                       f"gradient is padded with {ws * k - NUMEL} zero(s) at the end."
                       if NUMEL % ws else "")
                return (f"{head} It is the {what} of the elements starting at {o}, not at "
                        f"rank * k = {start}: a wrong shard offset.{why}")
    return head


def _diagnose_params(got, want, ref_grad, initial, rank: int, ws: int, k: int, step: int) -> str:
    if got.shape != want.shape:
        return (f"flat_params has shape {tuple(got.shape)} on rank {rank} after step "
                f"{step + 1}; expected ({NUMEL},): the padding must not end up in it.")
    if _close(got, want):
        return ""
    head = (f"After step {step + 1} on rank {rank}, flat_params differ from the "
            f"single-process reference (largest difference {_worst(got, want):.3g}; "
            f"expected at most {ATOL:g}).")
    if _close(got, ref_grad, atol=1e-5):
        return (f"{head} They equal the mean gradient: you all-gathered the gradient "
                f"shards. all_gather the updated parameter shards (my_shard, once the "
                f"optimizer has stepped it) instead.")
    if torch.equal(got, initial):
        return (f"{head} flat_params did not change at all: write the gathered parameters "
                f"into flat_params in place (its first {NUMEL} elements). Binding the name "
                f"flat_params to a new tensor inside your function does not change the "
                f"caller's tensor.")
    padded_got, padded_want = F.pad(got, (0, ws * k - NUMEL)), F.pad(want, (0, ws * k - NUMEL))
    lo = rank * k
    if ws > 1 and _close(padded_got[lo:lo + k], padded_want[lo:lo + k]):
        return (f"{head} This rank's own shard (elements {lo} to {min(lo + k, NUMEL) - 1}) is "
                f"right, the others are not: all_gather every rank's updated shard so that "
                f"each rank gets all of them.")
    return head


def check_zero2_step(group: LocalGroup, zero2_step, world_sizes=EXERCISE_WORLD_SIZES,
                     steps: int = EXERCISE_STEPS) -> Verdict:
    """Exercise of notebook 08: ``zero2_step(flat_params, flat_grad, my_shard, optimizer)``
    must reduce-scatter the flat gradient (averaged over ranks), step this rank's shard,
    and all-gather the parameters into ``flat_params``.

    Runs :func:`exercise_run` on real ranks at each world size in ``world_sizes`` (the
    group is resized, then restored) for ``steps`` Adam steps on the digits, and compares
    every rank, after every step, with :func:`reference_run` (one process, whole global
    batch): ``my_shard.grad`` with the rank's shard of the mean gradient, and
    ``flat_params`` with the reference parameters (absolute tolerance :data:`ATOL`).

    Returns:
        A :class:`~reducelab.checks.Verdict`. A wrong answer is explained: a gradient that
        is the sum (not divided by world_size), the rank's own unreduced gradient, a shard
        taken at the wrong offset (the size, 2,410, does not divide by 4), gathered
        gradients instead of parameters, parameters not written back, or only the rank's
        own shard updated; an error on the ranks is quoted, with what it means. Right
        numbers reached with a ``dist.all_reduce`` (DDP's collective: every rank holds the
        whole mean gradient), or with no reduce_scatter at all (an all_gather of the
        gradients), fail too: each rank's calls of :data:`RECORDED` are recorded.
    """
    X, y = load_digits_tensors()
    ref = reference_run(X, y, steps)
    initial = initial_flat()
    all_reduced = not_scattered = None
    with restoring_world_size(group):
        for ws in world_sizes:
            group.resize(ws)
            try:
                out, called = zip(*group.run(_exercise_run_counted, zero2_step, X, y, steps))
            except RankError as err:
                message = raised_on_ranks(f"With world_size={ws},", err).message.rstrip()
                if not message.endswith((".", "?", "!")):
                    message += "."
                return failed(message + _explain_error(ws, err))
            k = math.ceil(NUMEL / ws)
            for step in range(steps):
                ref_padded = F.pad(ref["grads"][step], (0, ws * k - NUMEL))
                before = initial if step == 0 else ref["params"][step - 1]
                for rank, records in enumerate(out):    # every rank's gradient shard first
                    rec = records[step]
                    want = ref_padded[rank * k:(rank + 1) * k]
                    why = _diagnose_grad(rec["grad"], want, rec["local"], ref_padded, rank, ws, k)
                    if why:
                        return failed(f"With world_size={ws}, step {step + 1}: {why}")
                for rank, records in enumerate(out):    # then every rank's parameters
                    why = _diagnose_params(records[step]["params"], ref["params"][step],
                                           ref["grads"][step], before, rank, ws, k, step)
                    if why:
                        return failed(f"With world_size={ws}: {why}")
            reduced = [r for r, names in enumerate(called) if "all_reduce" in names]
            if reduced and all_reduced is None:       # named once the numbers are right everywhere
                all_reduced = (ws, reduced[0], called[reduced[0]].count("all_reduce"))
            unscattered = [r for r, names in enumerate(called)
                           if not any(name in REDUCE_SCATTERS for name in names)]
            if unscattered and not reduced and not_scattered is None:
                r = unscattered[0]
                not_scattered = (ws, r, sorted(set(called[r])))
        if all_reduced is None and not_scattered is not None:
            ws, rank, names = not_scattered
            used = ", ".join(f"dist.{name}" for name in names) or "no collective we know"
            if any("gather" in name for name in names if name != "all_gather_single"):
                how = (f"A gradient that reaches the right shard through a gather travelled "
                       f"whole: every rank received every rank's gradient, all {NUMEL} elements "
                       f"of each, and summed them itself. ")
            elif "reduce" in names:
                how = ("A reduce to each shard's owner takes world_size reduces, each paying a "
                       "collective's fixed cost, where one reduce_scatter does the same work. ")
            else:
                how = ""
            return failed(
                f"At world sizes {' and '.join(map(str, world_sizes))} the gradient shards and "
                f"the parameters are right, but at world_size={ws} rank {rank} never called a "
                f"reduce_scatter (it called {used}). {how}ZeRO-2 uses the collectives of the "
                f"bare step: a reduce_scatter, so that each rank receives only the k elements of "
                f"its own shard, and an all_gather of the updated parameters.")
        if all_reduced is not None:
            ws, rank, calls = all_reduced
            return failed(
                f"At world sizes {' and '.join(map(str, world_sizes))} the gradient shards and "
                f"the parameters are right, but at world_size={ws} rank {rank} called "
                f"dist.all_reduce ({calls} time{'' if calls == 1 else 's'} in {steps} steps). "
                f"An all_reduce gives every rank the whole mean gradient, all {NUMEL} "
                f"elements, and sends 2(n-1)/n of the flat vector, what DDP sends and holds. "
                f"ZeRO-2 uses the collectives of the bare step: a reduce_scatter, so that each "
                f"rank receives only the k elements of its own shard, and an all_gather of the "
                f"updated parameters.")
        worst = max(_worst(rec["params"], ref["params"][s]) for rec_list in out
                    for s, rec in enumerate(rec_list))
        sizes = " and ".join(map(str, world_sizes))
        return passed(f"At world sizes {sizes}, after {steps} Adam steps, every rank's "
                      f"gradient shard is its shard of the mean gradient and every rank's "
                      f"parameters equal one process's on the whole global batch (largest "
                      f"difference at world_size={world_sizes[-1]}: {worst:.2g}). Each rank "
                      f"kept a k-element gradient and Adam state for k elements, and sent "
                      f"(n-1)/n of the flat vector twice per step: what DDP's all_reduce "
                      f"sends, for a fraction of the memory.")


__all__ = ["GLOBAL_BATCH", "LR", "ATOL", "LAYOUT", "NUMEL", "make_model", "initial_flat",
           "as_parameters", "flat_gradient", "global_batches", "local_part", "one_thread",
           "reference_run",
           "placed", "placed_dtensors", "ring_bytes", "counting_collectives", "storage_bytes",
           "zero_train", "exercise_run", "check_zero2_step"]
