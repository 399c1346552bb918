"""Rank functions and the exercise check of notebook 14
(clipping and checkpoints across shards).

Everything here runs in the kernel and on the ranks alike (it needs only ``torch``):

* :func:`tp_model_after_backward`: notebook 14's step 3, the digits MLP of notebook 08 on a
  ``(dp, tp)`` mesh: the first ``Linear`` split over ``tp`` (``RowwiseParallel``), the
  second either replicated over ``tp`` or left alone, FSDP2 over ``dp`` on top, after
  one backward. The notebook writes it out in a cell; the check uses this copy, since it
  cannot import a notebook, and ``tests/test_nb14_shards.py`` holds the two equal.
* :func:`exercise_run` and :func:`check_global_grad_norm`: the exercise, the global
  gradient norm by hand on that mesh, where ``torch.nn.utils.clip_grad_norm_`` raises.
* :class:`~reducelab.checks.load_planner.RecordingLoadPlanner` (a module of its own:
  it needs ``torch.distributed.checkpoint``, which this module leaves to the ranks that
  save and load, since its import costs about 0.6 s of CPU after torch).
* :func:`checkpoint_round_trip`: the explorer's rank function: an FSDP2 model saved with
  DCP by the first ``saved_on`` ranks and loaded by the first ``loaded_on`` ranks.

Sources: ``torch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` (defined as
``_get_total_norm`` in ``torch/nn/utils/clip_grad.py``); DTensor's ``_NormPartial``
(``torch/distributed/tensor/_ops/_math_ops.py``); "Getting Started with Distributed
Checkpoint (DCP)", https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html ;
``DefaultLoadPlanner`` (``torch/distributed/checkpoint/default_planner.py``); NVIDIA-NeMo/RL
pull request #3788, "fix(dtensor): count TP-replicated gradients once in get_grad_norm"
(2026-08-24).
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import load_digits_tensors
from ..errors import RankError
from ..group import LocalGroup
from . import COLLECTIVES, Verdict, failed, passed, raised_on_ranks, restoring_world_size
from .sharded import global_batches, local_part, make_model, reference_run

MESH_SHAPE = (2, 2)
"""``(dp, tp)`` of the exercise: rank ``r`` has ``dp = r // 2`` and ``tp = r % 2``
(``init_device_mesh`` numbers the ranks row-major)."""
WORLD_SIZE = MESH_SHAPE[0] * MESH_SHAPE[1]
UNCOVERED = ("replicated over tp", "left alone")
"""What :func:`tp_model_after_backward` does with the second ``Linear``, which the tensor
parallel plan does not cover: a DTensor replicated over ``tp`` (``distribute_module``), or
nothing, so that FSDP2 makes its parameters DTensors on the ``dp`` mesh only."""
NORM_RTOL = 1e-5
"""Relative tolerance of the exercise's norm against one process's (float32 sums of
squares in another order: about 1e-7 here)."""


def tp_model_after_backward(X: torch.Tensor, y: torch.Tensor, tp: int, uncovered: str):
    """Runs on every rank: the notebook's MLP on a ``(world_size // tp, tp)`` mesh
    named ``("dp", "tp")``, after one backward of the mean cross-entropy on this dp
    rank's part of the first global batch (the ``tp`` ranks of one dp index see the same
    samples). Notebook 14's step 3.

    * ``model[0]``, ``Linear(64, 32)``: ``RowwiseParallel``, its weight's 64 input columns
      split over ``tp``, its bias replicated; its output all-reduced over ``tp``.
    * ``model[2]``, ``Linear(32, 10)``, not in the tensor parallel plan: with
      ``uncovered="replicated over tp"`` its parameters become DTensors replicated over
      ``tp``; with ``"left alone"`` they stay plain, every tp rank computing the same.
    * ``fully_shard(model, mesh=mesh["dp"])`` on top: every parameter is then a DTensor
      sharded on dim 0 over ``dp``, on the 2-D mesh (or, left alone, on the dp mesh).

    Returns:
        ``(model, mesh)``: the model, whose ``p.grad`` are DTensors, and the 2-D
        ``DeviceMesh``.

    Raises:
        ValueError: ``uncovered`` not one of :data:`UNCOVERED`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_module
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    if uncovered not in UNCOVERED:
        raise ValueError(f"uncovered must be one of {', '.join(map(repr, UNCOVERED))}; got {uncovered!r}")
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n // tp, tp), mesh_dim_names=("dp", "tp"))
    model = make_model()
    parallelize_module(model[0], mesh["tp"], RowwiseParallel(
        input_layouts=Replicate(), use_local_output=uncovered == "left alone"))
    if uncovered == "replicated over tp":
        distribute_module(model[2], mesh["tp"],
                          output_fn=lambda module, output, mesh: output.to_local().clone())
    fully_shard(model, mesh=mesh["dp"])
    part = local_part(global_batches(1)[0], mesh["dp"].get_local_rank(), n // tp)
    F.cross_entropy(model(X[part]), y[part]).backward()
    return model, mesh


@contextlib.contextmanager
def torch_log(name: str):
    """Keep, as text, what torch logs to the logger ``name`` (for example
    ``"torch.distributed.tensor._redistribute"``) inside the block, and keep it from torch's
    own handler, which writes each record to the process's stderr with a timestamp and a
    process id. Yields the list of messages (``str``, formatted, in order); runs on a rank
    or anywhere. Notebook 14 prints the messages itself, so that the stored notebook holds
    torch's words and no time."""
    logger = logging.getLogger(name)
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    handler, propagate = Keep(level=logging.DEBUG), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# --- the exercise -----------------------------------------------------------------------------

def _largest_tensor(value) -> int:
    """Elements of the largest tensor in ``value`` (a tensor, or a list or tuple of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return max((_largest_tensor(v) for v in value), default=0)
    return 0


@contextlib.contextmanager
def _counting_gathers(counts: dict, few: int):
    """Count calls of ``DTensor.full_tensor`` and ``DTensor.redistribute`` inside the block
    (each gathers or moves a gradient's elements between ranks), and calls of the
    :data:`~reducelab.checks.COLLECTIVES` of ``torch.distributed`` made from outside torch
    with a tensor of more than ``few`` elements, as ``counts["dist.<name>"]``, the largest
    such tensor's number of elements: one that carries more numbers than the model has
    parameter tensors moves gradient elements (the exercise: "Gather no gradient ... only
    a few numbers may cross the ranks")."""
    import os
    import sys
    from torch.distributed.tensor import DTensor
    originals = {name: getattr(DTensor, name) for name in ("full_tensor", "redistribute")}
    collectives = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    inside_torch = os.path.dirname(torch.__file__)

    def counted(name):
        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](self, *args, **kwargs)
        return wrapper

    def sized(name):
        def wrapper(*args, **kwargs):
            size = _largest_tensor(list(args) + list(kwargs.values()))
            if size > few and not sys._getframe(1).f_code.co_filename.startswith(inside_torch):
                counts[f"dist.{name}"] = max(size, counts.get(f"dist.{name}", 0))
            return collectives[name](*args, **kwargs)
        return wrapper
    for name in originals:
        setattr(DTensor, name, counted(name))
    for name in collectives:
        setattr(dist, name, sized(name))
    try:
        yield counts
    finally:
        for name, call in originals.items():
            setattr(DTensor, name, call)
        for name, call in collectives.items():
            setattr(dist, name, call)


def _sum_over(value: torch.Tensor, group=None) -> float:
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value.item()


def exercise_run(global_grad_norm, X: torch.Tensor, y: torch.Tensor) -> dict:
    """Runs on each of :data:`WORLD_SIZE` ranks: :func:`tp_model_after_backward` with the
    second ``Linear`` left alone (so ``clip_grad_norm_`` raises: its parameters live on
    the dp mesh, the first ``Linear``'s on the 2-D mesh), then the learner's
    ``global_grad_norm(model, mesh)``, with ``DTensor.full_tensor`` and
    ``DTensor.redistribute`` counted, and every collective that carries gradient elements
    recorded (:func:`_counting_gathers`).

    Returns:
        ``{"value": what the learner returned, "gathers": {method: calls, or for a
        collective "dist.<name>": its largest tensor's elements}, "dp", "tp":
        this rank's coordinates, "squares": {way: float}}``, where ``squares`` are the sums of
        squared gradient elements that the usual mistakes compute: ``"local"`` (this
        rank's shard), ``"every rank"`` (summed over all ranks), ``"dp only"`` and ``"tp
        only"`` (summed over one mesh dimension), ``"dp mesh added over every rank"``
        (``model[2]``'s copies counted once per tp rank), ``"Replicate() added over every
        rank"`` (``0.bias``'s likewise), ``"copies added over tp"`` (the pieces over every
        rank, the copies over ``tp``, where they are the same rows), and ``"right"`` (each
        element once).
    """
    model, mesh = tp_model_after_backward(X, y, MESH_SHAPE[1], "left alone")
    kinds = {"split over tp": torch.zeros((), dtype=torch.float64),        # 0.weight
             "replicated over tp": torch.zeros((), dtype=torch.float64),   # 0.bias
             "on the dp mesh": torch.zeros((), dtype=torch.float64)}       # 2.weight, 2.bias
    for p in model.parameters():
        kind = ("on the dp mesh" if p.grad.device_mesh.ndim == 1 else
                "split over tp" if p.grad.placements[1].is_shard() else "replicated over tp")
        kinds[kind] += p.grad.to_local().double().pow(2).sum()
    local = sum(kinds.values())
    over_all = {kind: _sum_over(value) for kind, value in kinds.items()}
    over_dp = {kind: _sum_over(value, mesh.get_group("dp")) for kind, value in kinds.items()}
    over_tp = {kind: _sum_over(value, mesh.get_group("tp")) for kind, value in kinds.items()}
    ways = {"local": local.item(), "every rank": _sum_over(local),
            "dp only": _sum_over(local, mesh.get_group("dp")),
            "tp only": _sum_over(local, mesh.get_group("tp")),
            "right": over_all["split over tp"] + over_dp["replicated over tp"] + over_dp["on the dp mesh"],
            "dp mesh added over every rank": over_all["split over tp"] + over_dp["replicated over tp"]
            + over_all["on the dp mesh"],
            "Replicate() added over every rank": over_all["split over tp"] + over_all["replicated over tp"]
            + over_dp["on the dp mesh"],
            "copies added over tp": over_all["split over tp"] + over_tp["replicated over tp"]
            + over_tp["on the dp mesh"]}
    counts: dict = {}
    with _counting_gathers(counts, few=len(list(model.parameters()))):
        value = global_grad_norm(model, mesh)
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        value = value.item() if value.numel() == 1 else value
    return {"value": value, "gathers": counts, "dp": mesh["dp"].get_local_rank(),
            "tp": mesh["tp"].get_local_rank(), "squares": ways}


def _near(a: float, b: float, rtol: float = NORM_RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


def _explain_error(text: str, stack: str = "") -> str:
    # ``text``: the ranks' one-line summaries; ``stack``: their tracebacks, which say
    # whether torch's own norm raised or the learner's arithmetic did
    if "same mesh" in text or "different meshes" in text:
        if "clip_grad_norm_" in stack or "get_total_norm" in stack:
            return (" That is torch's own clip_grad_norm_ (or get_total_norm) failing on this "
                    "model, as step 3 showed: the second Linear's gradients live on the dp mesh, "
                    "the first's on the 2-D mesh. Compute the norm yourself from each gradient's "
                    "local piece.")
        return (" Your function combined DTensors that live on two meshes (the second Linear's "
                "gradients on the dp mesh, the first's on the 2-D mesh), which DTensor refuses, "
                "as in step 3. Work on each gradient's local piece, p.grad.to_local().")
    if "mixed torch.Tensor and DTensor" in text or "sharding strategy" in text:
        return (" p.grad is a DTensor, and a torch.distributed collective, or arithmetic with a "
                "plain tensor, wants plain tensors: work on p.grad.to_local(), this rank's piece.")
    return ""


def check_global_grad_norm(group: LocalGroup, global_grad_norm) -> Verdict:
    """Exercise of notebook 14: ``global_grad_norm(model, mesh)`` must return the 2-norm of
    the whole gradient, a float, the same on every rank, for the model of
    :func:`tp_model_after_backward` with its second ``Linear`` left alone, on the
    :data:`MESH_SHAPE` ``(dp, tp)`` mesh, without gathering any gradient.

    Runs :func:`exercise_run` on :data:`WORLD_SIZE` real ranks (the group is resized, then
    restored), and compares each rank's value with one process's gradient norm on the
    whole global batch (relative tolerance :data:`NORM_RTOL`).

    Returns:
        A :class:`~reducelab.checks.Verdict`. A wrong answer is explained: nothing
        returned, values that differ between ranks, this rank's shard only, the copies
        over ``tp`` counted once per tp rank (NeMo-RL's bug), a sum over one mesh
        dimension only, a missing square root, an average instead of a sum, a right value
        reached by gathering the gradients (``full_tensor``, or a call of
        :data:`COLLECTIVES` with more elements than the model has parameter tensors, such
        as a ``dist.all_gather`` of the local pieces), or an error on the ranks, quoted
        with what it means.
    """
    X, y = load_digits_tensors()
    want = reference_run(X, y, 1)["grads"][0].double().norm().item()
    with restoring_world_size(group):
        group.resize(WORLD_SIZE)
        try:
            out = group.run(exercise_run, global_grad_norm, X, y)
        except RankError as err:
            text = " ".join(r.summary for r in err.reports if r.summary)
            stack = "\n".join(r.traceback for r in err.reports)
            message = raised_on_ranks("On the 2 x 2 (dp, tp) mesh,", err).message.rstrip()
            return failed(message + ("" if message.endswith(".") else ".")
                          + _explain_error(text, stack))
    values = [o["value"] for o in out]
    if any(v is None for v in values):
        return failed("Your function returned None on the ranks: return the norm, a float "
                      "(or a one-element tensor), the same on every rank.")
    if not all(isinstance(v, (int, float)) for v in values):
        return failed(f"Your function returned {type(values[0]).__name__} on rank 0: return the "
                      f"norm as one number, a float (or a one-element tensor).")
    same = all(_near(v, values[0]) for v in values)
    listed = ", ".join(f"rank {r}: {v:.4f}" for r, v in enumerate(values))
    head = (f"Your function returns {values[0]:.4f} on every rank" if same else
            f"Your function returns different norms on the ranks ({listed})")
    head += f"; one process's gradient on the whole global batch has norm {want:.4f}."
    if same and _near(values[0], want):
        gathers = next((o["gathers"] for o in out if o["gathers"]), None)
        if gathers and any(name in gathers for name in ("full_tensor", "redistribute")):
            return failed(f"{head} The value is right, but your function called full_tensor() or "
                          f"redistribute(): that gathers the gradients onto every rank, the memory "
                          f"FSDP2 saves. Only a few numbers need to cross the ranks: sums of squares "
                          f"of each rank's local piece.")
        if gathers:
            name, size = next(iter(gathers.items()))
            return failed(f"{head} The value is right, but your function called {name} with a "
                          f"tensor of {size:,} elements: gradient elements crossed the ranks, where "
                          f"the exercise lets only a few numbers cross, sums of squares of each "
                          f"rank's local piece.")
        return passed(f"{head} Checked on the 2 x 2 (dp, tp) mesh: every rank returns one "
                      f"process's norm, and no gradient crossed the ranks (no full_tensor(), no "
                      f"redistribute(), no collective of more numbers than the model has "
                      f"parameters), where gathering the gradients would move all 2,410 "
                      f"elements. The norm counts every element once, pieces and copies alike: "
                      f"the correction of NeMo-RL's pull request #3788, and what DTensor's "
                      f"_NormPartial does for clip_grad_norm_ when every parameter lives on one "
                      f"mesh.")

    def each_rank_gave(way, how=math.sqrt) -> bool:
        return all(_near(v, how(o["squares"][way])) for v, o in zip(values, out))
    diagnoses = [
        ("local", "Each rank's number is the norm of its own piece only: a norm of a sharded "
                  "gradient needs the other ranks' pieces, added as squares."),
        ("every rank", "Every rank's sum of squares was added over all 4 ranks, so the elements "
                       "that two ranks both hold, copies rather than pieces, were counted twice: "
                       "NeMo-RL's bug (pull request #3788). Which gradients are copies across the "
                       "tp ranks, and over which ranks are they pieces?"),
        ("dp only", "It is the sum over dp only: 0.weight's 64 input columns are split over tp as "
                    "well, so the other tp rank's columns are missing."),
        ("tp only", "It is the sum over tp only: the dp ranks hold different rows of every "
                    "parameter (FSDP2's shards), so those must be added too."),
        ("dp mesh added over every rank", "The gradients of model[2] (2.weight, 2.bias) live on the "
                                          "dp mesh only, yet both tp ranks of a dp index hold them: "
                                          "copies over tp as well, counted twice here."),
        ("Replicate() added over every rank", "0.bias is Replicate() over tp: both tp ranks of a dp "
                                              "index hold the same rows, counted twice here. Only a "
                                              "Shard placement on the tp dimension makes pieces."),
        ("copies added over tp", "The copies (0.bias, 2.weight, 2.bias) were added over tp, where both "
                                 "tp ranks of a dp index hold the same rows: each row counted twice, "
                                 "and the other dp index's rows never added. Over which ranks do the "
                                 "copies hold different rows?"),
    ]
    for way, why in diagnoses:
        if each_rank_gave(way):
            return failed(f"{head} {why}")
    if each_rank_gave("right", lambda x: x):
        return failed(f"{head} It is the sum of squares: a 2-norm is its square root.")
    for way in ("every rank", "dp only", "tp only", "right"):
        for n in (2, 4):
            if each_rank_gave(way, lambda x: math.sqrt(x / n)) or each_rank_gave(way, lambda x: x / n):
                by_tp = (" Dividing the sum over every rank by tp = 2 halves the pieces as well "
                         "as the copies: only the copies were counted twice."
                         if way == "every rank" and n == 2 else "")
                return failed(f"{head} It looks like an average over {n} ranks (ReduceOp.AVG, or a "
                              f"division by the group's size): a norm adds the squares of the "
                              f"pieces, it does not average them.{by_tp}")
    if not same:
        return failed(f"{head} Every rank must clip with the same factor, max_norm / norm, or the "
                      f"copies of a parameter drift apart: the norm needs sums over ranks, which "
                      f"give every rank the same number.")
    return failed(f"{head} Add, on each rank, the squares of the elements it holds, then add "
                  f"those sums over the ranks that hold different elements, once per element.")


# --- checkpoints ------------------------------------------------------------------------------

_GROUPS: dict = {}
"""On a rank: the process groups of :func:`checkpoint_round_trip`, by ``(world_size,
ranks)``, made once per rank process (every rank creates them in the same order, as
``dist.new_group`` requires) and kept: a group that DCP or a ``DeviceMesh`` has used is
not destroyed while the rank lives."""


def _first_ranks(n: int):
    """The process group of ranks ``0 .. n - 1`` (the default group when ``n`` is the
    world size); every rank must call this, members or not."""
    world = dist.get_world_size()
    if n == world:
        return dist.group.WORLD
    key = (world, n)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(range(n)))
    return _GROUPS[key]


def checkpoint_round_trip(path: str, saved_on: int, loaded_on: int) -> dict:
    """Runs on every rank of a group of at least ``max(saved_on, loaded_on)`` ranks (the
    explorer of notebook 14): ranks ``0 .. saved_on - 1`` shard the notebook's model
    with ``fully_shard`` over a process group of their own and save its state dict with
    ``dcp.save`` into the directory ``path``; then ranks ``0 .. loaded_on - 1`` shard a
    zeroed model over theirs and ``dcp.load`` it with a :class:`RecordingLoadPlanner`. A
    checkpoint saved by one job and loaded by another of a different size does the same.

    Returns:
        On a loading rank: ``{"reads": RecordingLoadPlanner.reads, "loaded": the whole
        flat parameters after the load (float32, ``(NUMEL,)``, ``full_tensor()`` of
        each)}``; ``{}`` on the others. The saving ranks' rows are in the checkpoint's
        metadata.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from .load_planner import RecordingLoadPlanner
    rank = dist.get_rank()
    savers, loaders = _first_ranks(saved_on), _first_ranks(loaded_on)
    out = {}
    if rank < saved_on:
        model = make_model()
        fully_shard(model, mesh=DeviceMesh.from_group(savers, "cpu"))
        dcp.save({"model": model.state_dict()}, checkpoint_id=path, process_group=savers)
    dist.barrier()
    if rank < loaded_on:
        model = make_model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        fully_shard(model, mesh=DeviceMesh.from_group(loaders, "cpu"))
        planner = RecordingLoadPlanner()
        dcp.load({"model": model.state_dict()}, checkpoint_id=path, process_group=loaders,
                 planner=planner)
        out["reads"] = planner.reads
        out["loaded"] = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    dist.barrier()
    return out


__all__ = ["MESH_SHAPE", "WORLD_SIZE", "UNCOVERED", "NORM_RTOL", "tp_model_after_backward", "torch_log",
           "exercise_run", "check_global_grad_norm", "checkpoint_round_trip"]
