"""Checks and exercise data for notebook 05 (syncing gradients by hand on a device mesh).

The exercise: every rank of a (dp, cp) mesh holds a different slice of one global batch
(data parallel: different sequences; context parallel: different tokens of the same
sequences), runs forward and backward on its slice, and then the learner's
``sync_grads(model, mesh)`` must leave every rank with the gradient that one process
gets on the whole batch, without making a new process group on every call.

Source: ``torch.distributed.all_reduce`` and ``new_group``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce , and
``torch.distributed.device_mesh``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh ;
the learner question is "Usage pattern for torch.distributed.all_reduce for gradient
synchronization within HuggingFace Transformers distributed training" (a knowledge-base
page, last updated 2025-12-18).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

GLOBAL_BATCH = 4
"""Sequences in the global batch (split over the dp ranks)."""
SEQ_LEN = 8
"""Tokens per sequence (split over the cp ranks)."""
IN_FEATURES, OUT_FEATURES = 4, 2
EXERCISE_SHAPES = ((2, 2), (1, 4), (4, 1))
"""The (dp, cp) meshes the exercise check runs on; each has world_size 4."""
ATOL = 1e-6


def tiny_model() -> nn.Module:
    """The exercise's model: ``Linear(4, 8) -> Tanh -> Linear(8, 2)``, float32, the same
    weights on every rank and in the kernel (seeded with 0 without touching the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN_FEATURES, 8), nn.Tanh(), nn.Linear(8, OUT_FEATURES))


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch: inputs of shape ``(4, 8, 4)`` and targets ``(4, 8, 2)``, float32
    (sequences, tokens, features), from a generator seeded with 1234."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(GLOBAL_BATCH, SEQ_LEN, IN_FEATURES, generator=g)
    y = torch.randn(GLOBAL_BATCH, SEQ_LEN, OUT_FEATURES, generator=g)
    return x, y


def local_batch(dp_index: int, cp_index: int, dp: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice of :func:`global_batch` that the rank at mesh coordinate
    ``(dp_index, cp_index)`` of a ``(dp, cp)`` mesh holds.

    dp splits the sequences (``4 / dp`` each), cp splits the tokens of those sequences
    (``8 / cp`` each), so every rank holds ``32 / (dp * cp)`` tokens.

    Returns:
        ``(x, y)``, float32, the rank's tokens flattened: shapes ``(tokens, 4)`` and
        ``(tokens, 2)`` with ``tokens = 32 / (dp * cp)``.

    Raises:
        ValueError: ``dp`` does not divide 4, ``cp`` does not divide 8, or an index is
            outside the mesh.
    """
    if dp < 1 or GLOBAL_BATCH % dp or cp < 1 or SEQ_LEN % cp:
        raise ValueError(f"dp must divide {GLOBAL_BATCH} and cp must divide {SEQ_LEN}; "
                         f"got dp={dp}, cp={cp}")
    if not (0 <= dp_index < dp and 0 <= cp_index < cp):
        raise ValueError(f"coordinate ({dp_index}, {cp_index}) is outside a ({dp}, {cp}) mesh")
    x, y = global_batch()
    b, t = GLOBAL_BATCH // dp, SEQ_LEN // cp
    rows, cols = slice(dp_index * b, (dp_index + 1) * b), slice(cp_index * t, (cp_index + 1) * t)
    return (x[rows, cols].reshape(-1, IN_FEATURES), y[rows, cols].reshape(-1, OUT_FEATURES))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.grad is not None}


def reference_grads() -> dict[str, torch.Tensor]:
    """Single-process reference: gradients of the mean squared error over the whole
    :func:`global_batch`, ``{parameter name: tensor}``, float32."""
    model = tiny_model()
    x, y = global_batch()
    F.mse_loss(model(x.reshape(-1, IN_FEATURES)), y.reshape(-1, OUT_FEATURES)).backward()
    return _grads(model)


def local_grads(dp_index: int, cp_index: int, dp: int, cp: int) -> dict[str, torch.Tensor]:
    """The gradients one rank has after its own backward, before any sync (one process)."""
    model = tiny_model()
    x, y = local_batch(dp_index, cp_index, dp, cp)
    F.mse_loss(model(x), y).backward()
    return _grads(model)


def live_process_groups() -> int:
    """How many process groups this rank holds: the default one, those
    ``init_device_mesh`` made, and every one ``dist.new_group`` made since (they stay
    until ``destroy_process_group``). Reads torch's registry of groups,
    ``torch.distributed.distributed_c10d._world.pg_map``, a private attribute of
    torch 2.13, only to count its entries; call it on a rank."""
    from torch.distributed import distributed_c10d
    return len(distributed_c10d._world.pg_map)


def run_and_release(fn, *args):
    """Runs on a rank: return ``fn(*args)``, then destroy every process group that the
    call made (``init_device_mesh`` makes one per mesh dimension on every call, and each
    holds sockets until it is destroyed); the default group is never destroyed.

    A training script builds its mesh once, but a rank here lives across many calls
    (every control change of the notebook 05 explorer, every check), so groups would pile
    up until the rank runs out of file descriptors. Every rank must call it (it ends with
    a barrier on the default group, so no rank closes a group another still uses). If
    ``fn`` raises, nothing is destroyed (the group restarts its ranks after a failure
    anyway). Reads torch's registry of groups, the private
    ``torch.distributed.distributed_c10d._world.pg_map`` of torch 2.13.
    """
    from torch.distributed import distributed_c10d
    before = set(distributed_c10d._world.pg_map)
    result = fn(*args)
    default = distributed_c10d._world.default_pg
    made = [pg for pg in distributed_c10d._world.pg_map if pg not in before and pg is not default]
    if default is not None:   # every rank calls this, whatever groups it holds
        dist.barrier()        # every rank is done with the groups before any rank closes them
    for pg in made:
        dist.destroy_process_group(pg)
    return result


def train_step(sync_grads, dp: int, cp: int, steps: int = 2):
    """Runs on every rank: build the (dp, cp) mesh, then ``steps`` times: backward on the
    local slice and ``sync_grads(model, mesh)``.

    The local loss is the mean over the rank's tokens; all ranks hold equally many
    tokens, so the mean over ranks of the local gradients is the full-batch gradient.

    Returns:
        ``(grads, made)``: ``grads`` is ``{parameter name: gradient after the last
        step}`` (``None`` for a parameter left without one); ``made[k]`` is how many new
        process groups the rank holds after step ``k``'s ``sync_grads`` call
        (:func:`live_process_groups`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    dp_index, cp_index = mesh.get_coordinate()
    model = tiny_model()
    x, y = local_batch(dp_index, cp_index, dp, cp)
    made = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        before = live_process_groups()
        sync_grads(model, mesh)
        made.append(live_process_groups() - before)
    grads = {name: (p.grad.detach().clone() if p.grad is not None else None)
             for name, p in model.named_parameters()}
    return grads, made


def _same(a: dict, b: dict, atol: float = ATOL) -> bool:
    return all(a.get(k) is not None and a[k].shape == v.shape
               and torch.allclose(a[k].float(), v, atol=atol, rtol=1e-5) for k, v in b.items())


def _mean(dicts: list[dict]) -> dict:
    return {k: torch.stack([d[k] for d in dicts]).mean(0) for k in dicts[0]}


def _diagnose(got: dict, rank: int, dp: int, cp: int, ref: dict, local: dict) -> str:
    """Name what the rank's gradients equal, when they are not the reference."""
    i, j = divmod(rank, cp)
    world = dp * cp
    dp_ranks = [(a, j) for a in range(dp)]
    cp_ranks = [(i, b) for b in range(cp)]
    dp_mean = _mean([local[c] for c in dp_ranks])
    cp_mean = _mean([local[c] for c in cp_ranks])
    scaled = lambda d, s: {k: v * s for k, v in d.items()}  # noqa: E731
    if any(v is None for v in got.values()):
        return " Some parameters have no gradient: did sync_grads set p.grad to None?"
    if world > 1 and _same(got, scaled(ref, world), 1e-5):
        return (f" That is the SUM over all {world} ranks, {world} times the mean: divide by "
                f"the number of ranks you reduced over (or use ReduceOp.AVG).")
    if _same(got, local[(i, j)]) and world > 1:
        return (" These are the rank's own local gradients: nothing was averaged across "
                "ranks. Either no all_reduce reached p.grad (all_reduce works in place; a "
                "reduced copy that is never written back is lost), or the group held this "
                "rank alone (a mesh dimension of size 1).")
    if cp > 1 and dp > 1 and _same(got, dp_mean):
        return (f" That is the mean over the dp group only (ranks of cp index {j}). The cp "
                f"ranks hold other tokens of the same sequences, so they must be averaged too.")
    if dp > 1 and cp > 1 and _same(got, cp_mean):
        return (f" That is the mean over the cp group only (ranks of dp index {i}). The dp "
                f"ranks hold other sequences, so they must be averaged too.")
    if cp > 1 and _same(got, scaled(dp_mean, dp)) and dp > 1:
        return " That is the SUM over the dp group only."
    if dp > 1 and cp > 1 and _same(got, scaled(cp_mean, cp)):
        return " That is the SUM over the cp group only."
    return ""


def check_mesh_sync(group: LocalGroup, sync_grads, shapes=EXERCISE_SHAPES) -> Verdict:
    """Exercise of notebook 05: ``sync_grads(model, mesh)`` must average every
    ``p.grad`` in place over all dp x cp ranks, and must not make a new process group
    on every call.

    Runs :func:`train_step` (two steps) with ``sync_grads`` on real ranks for each
    ``(dp, cp)`` in ``shapes`` (the group is resized to ``dp * cp`` if needed, then
    restored) and compares every rank's gradients with :func:`reference_grads`
    (absolute tolerance 1e-6, relative 1e-5). A process group made on the first call
    and reused is fine; one made again on the second call is named.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says, for a wrong answer, which mesh and
        rank disagree and what its gradients equal instead (unsynced, dp only, cp only,
        a SUM), or how many process groups each call made.
    """
    ref = reference_grads()
    with restoring_world_size(group):
        for dp, cp in shapes:
            group.resize(dp * cp)  # a no-op when it already has that many ranks
            try:
                out = group.run(run_and_release, train_step, sync_grads, dp, cp)
            except RankError as e:
                return raised_on_ranks(f"On the mesh (dp={dp}, cp={cp})", e)
            local = {(i, j): local_grads(i, j, dp, cp) for i in range(dp) for j in range(cp)}
            for rank, (got, _) in enumerate(out):
                if not _same(got, ref):
                    diffs = [(got[k] - v).abs().max().item() for k, v in ref.items()
                             if got.get(k) is not None and got[k].shape == v.shape]
                    worst = f"largest difference {max(diffs):.3g}" if diffs else "no gradients"
                    return failed(
                        f"On the mesh (dp={dp}, cp={cp}), rank {rank}'s gradients differ from "
                        f"the single-process full-batch gradient ({worst}; expected at most "
                        f"{ATOL:g}). Expected every rank to hold the mean over all {dp * cp} "
                        f"ranks' local gradients." + _diagnose(got, rank, dp, cp, ref, local))
            made = out[0][1]
            if made[-1] > 0:
                return failed(
                    f"On the mesh (dp={dp}, cp={cp}) the gradients are right, but every call "
                    f"of sync_grads made {made[-1]} new process group{'' if made[-1] == 1 else 's'} "
                    f"(dist.new_group, or new_subgroups_by_enumeration, inside it). Each new "
                    f"group is a collective that every rank of the job must join, it opens new "
                    f"connections (on GPUs, a new NCCL communicator), and it stays until "
                    f"destroy_process_group: called at every training step, sync_grads would "
                    f"pile up groups step after step. Reduce over groups that already exist "
                    f"(the mesh made one per dimension, and a SUM along one dimension and then "
                    f"the other covers the whole grid), or make the group "
                    f"once, outside sync_grads.")
        listed = ", ".join(f"({dp}, {cp})" for dp, cp in shapes)
        return passed(f"On the meshes {listed}, every rank's gradients match the single-process "
                      f"full-batch gradient to {ATOL:g}, and a second call made no new process "
                      f"group: averaging over all dp x cp ranks is right because each rank's "
                      f"loss is a mean over equally many tokens.")


__all__ = ["check_mesh_sync", "tiny_model", "global_batch", "local_batch", "reference_grads",
           "local_grads", "train_step", "live_process_groups", "run_and_release", "EXERCISE_SHAPES"]
