"""Checks and exercise data for notebook 05 (syncing gradients by hand on a device mesh).

The exercise: every rank of a (dp, cp) mesh holds a different slice of one global batch
(data parallel: different sequences; context parallel: different tokens of the same
sequences), runs forward and backward on its slice, and then the learner's
``sync_grads(model, mesh)`` must leave every rank with the gradient that one process
gets on the whole batch.

Source: ``torch.distributed.all_reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce , and
``torch.distributed.device_mesh``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh ;
the learner question is seed 004 (``/work/shared/seeds/004_038b5ad5d55791f3.txt``).
"""
from __future__ import annotations

import torch
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


def train_step(sync_grads, dp: int, cp: int) -> dict[str, torch.Tensor]:
    """Runs on every rank: build the (dp, cp) mesh, backward on the local slice, call
    ``sync_grads(model, mesh)``, return ``{parameter name: gradient}``.

    The local loss is the mean over the rank's tokens; all ranks hold equally many
    tokens, so the mean over ranks of the local gradients is the full-batch gradient.
    """
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    dp_index, cp_index = mesh.get_coordinate()
    model = tiny_model()
    x, y = local_batch(dp_index, cp_index, dp, cp)
    F.mse_loss(model(x), y).backward()
    sync_grads(model, mesh)
    return {name: (p.grad.detach().clone() if p.grad is not None else None)
            for name, p in model.named_parameters()}


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
    ``p.grad`` in place over all dp x cp ranks.

    Runs :func:`train_step` with ``sync_grads`` on real ranks for each ``(dp, cp)`` in
    ``shapes`` (the group is resized to ``dp * cp`` if needed, then restored) and
    compares every rank's gradients with :func:`reference_grads` (absolute tolerance
    1e-6, relative 1e-5).

    Returns:
        A :class:`~reducelab.checks.Verdict` that says, for a wrong answer, which mesh and
        rank disagree and what its gradients equal instead (unsynced, dp only, cp only,
        a SUM).
    """
    ref = reference_grads()
    with restoring_world_size(group):
        for dp, cp in shapes:
            group.resize(dp * cp)  # a no-op when it already has that many ranks
            try:
                out = group.run(train_step, sync_grads, dp, cp)
            except RankError as e:
                return raised_on_ranks(f"On the mesh (dp={dp}, cp={cp})", e)
            local = {(i, j): local_grads(i, j, dp, cp) for i in range(dp) for j in range(cp)}
            for rank, got in enumerate(out):
                if not _same(got, ref):
                    worst = max((got[k] - v).abs().max().item() for k, v in ref.items()
                                if got.get(k) is not None and got[k].shape == v.shape)
                    return failed(
                        f"On the mesh (dp={dp}, cp={cp}), rank {rank}'s gradients differ from "
                        f"the single-process full-batch gradient (largest difference "
                        f"{worst:.3g}; expected at most {ATOL:g}). Expected every rank to hold "
                        f"the mean over all {dp * cp} ranks' local gradients."
                        + _diagnose(got, rank, dp, cp, ref, local))
        listed = ", ".join(f"({dp}, {cp})" for dp, cp in shapes)
        return passed(f"On the meshes {listed}, every rank's gradients match the single-process "
                      f"full-batch gradient to {ATOL:g}: averaging over all dp x cp ranks is "
                      f"right because each rank's loss is a mean over equally many tokens.")


__all__ = ["check_mesh_sync", "tiny_model", "global_batch", "local_batch", "reference_grads",
           "local_grads", "train_step", "EXERCISE_SHAPES"]
