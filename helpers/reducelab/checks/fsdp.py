"""The exercise check of notebook 15 (FSDP2): a gradient sync over the ``cp`` dimension
of a 2-D ``(dp, cp)`` mesh, on top of FSDP2 sharding over ``dp``.

The knowledge-base page of notebooks 05, 08 and 15 ("Usage pattern for
torch.distributed.all_reduce for gradient synchronization within HuggingFace
Transformers distributed training", last updated 2025-12-18) says that with FSDP "manual
all_reduce is only needed for the CP dimension". The exercise asks the learner to write
that sync: :func:`cp_run` builds the mesh, shards the notebook's model with
``fully_shard(module, mesh=mesh["dp"])``, gives each of the 4 ranks its quarter of a
global batch, runs backward, calls the learner's ``sync(model, mesh)``, and returns each
rank's gradients; :func:`check_cp_sync` compares them with one process's gradient on the
whole global batch.

Sources: ``torch.distributed.fsdp.fully_shard``,
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html ;
``torch.distributed.device_mesh.init_device_mesh``,
https://pytorch.org/docs/stable/distributed.html#devicemesh
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import load_digits_tensors
from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from .sharded import ATOL, global_batches, local_part, make_model, reference_run

MESH_SHAPE = (2, 2)
"""``(dp, cp)``: 2 data-parallel groups of 2 context-parallel ranks; rank ``r`` has
``dp = r // 2`` and ``cp = r % 2`` (``init_device_mesh`` numbers the ranks row-major)."""
WORLD_SIZE = MESH_SHAPE[0] * MESH_SHAPE[1]


def cp_run(sync, X: torch.Tensor, y: torch.Tensor) -> dict:
    """Runs on each of :data:`WORLD_SIZE` ranks: a ``(dp, cp)`` CPU mesh (gloo), the
    notebook's model with ``fully_shard`` applied to each ``Linear`` and the root over
    ``mesh["dp"]``, one backward of the mean cross-entropy on this rank's quarter of the
    first global batch (rank ``r`` takes piece ``r``, so the two cp ranks of one dp index
    hold the two halves of that dp rank's samples, as cp ranks hold halves of its
    tokens), then ``sync(model, mesh)``.

    Returns:
        ``{"before": ..., "after": ...}``: the whole flat gradient (float32, shape
        ``(NUMEL,)``, ``full_tensor()`` of each parameter's gradient, an all_gather over
        dp) before and after ``sync``; and ``"dp"``, ``"cp"``: this rank's coordinates.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp", "cp"))
    model = make_model()
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh["dp"])
    rank = dist.get_rank()
    part = local_part(global_batches(1)[0], rank, WORLD_SIZE)
    F.cross_entropy(model(X[part]), y[part]).backward()
    flat = lambda: torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])  # noqa: E731
    before = flat()
    sync(model, mesh)
    return {"before": before, "after": flat(), "dp": mesh["dp"].get_local_rank(),
            "cp": mesh["cp"].get_local_rank()}


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=0))


def check_cp_sync(group: LocalGroup, sync) -> Verdict:
    """Exercise of notebook 15: after FSDP2 has averaged the gradients over ``dp``,
    ``sync(model, mesh)`` must average them over ``cp`` as well, so that every rank's
    gradient equals one process's on the whole global batch (within :data:`ATOL`).

    Runs :func:`cp_run` on :data:`WORLD_SIZE` real ranks (the group is resized, then
    restored).

    Returns:
        A :class:`~reducelab.checks.Verdict`. A wrong answer is explained: nothing
        synced (each cp rank keeps the gradient of its half of the samples), a SUM over
        cp (twice the mean), a mean divided again (half), a reduction over ranks that hold
        other rows (the world group, or dp), or an error on the ranks, quoted with what it
        means (a DTensor passed to a collective, for one).
    """
    X, y = load_digits_tensors()
    want = reference_run(X, y, 1)["grads"][0]
    with restoring_world_size(group):
        group.resize(WORLD_SIZE)
        try:
            out = group.run(cp_run, sync, X, y)
        except RankError as err:
            text = " ".join(r.summary for r in err.reports if r.summary)
            hint = ""
            if "sharding strategy" in text:
                hint = (" p.grad is a DTensor, and a torch.distributed collective takes a plain "
                        "tensor: reduce the plain tensor that holds this rank's piece of the "
                        "gradient, in place, so that p.grad sees the result.")
            message = raised_on_ranks("On the 2 x 2 (dp, cp) mesh,", err).message.rstrip()
            return failed(message + ("" if message.endswith(".") else ".") + hint)
        for rank, o in enumerate(out):
            got = o["after"]
            if _close(got, want):
                continue
            head = (f"On rank {rank} (dp {o['dp']}, cp {o['cp']}), the gradient after your sync "
                    f"differs from one process's on the whole global batch (largest difference "
                    f"{(got.double() - want.double()).abs().max().item():.3g}; at most {ATOL:g} "
                    f"expected).")
            if torch.equal(got, o["before"]):
                return failed(f"{head} Your sync left it unchanged: it is still the mean over "
                              f"dp only, FSDP2's, of the samples that this rank's dp group (the "
                              f"ranks with its cp index) saw. The other half of the samples went "
                              f"to ranks this average did not include: which of them hold the "
                              f"same rows of every parameter as this rank?")
            if _close(got, 2 * want, atol=2 * ATOL):
                return failed(f"{head} It is twice the mean: the SUM over the 2 cp ranks. "
                              f"Average instead (ReduceOp.AVG, or divide by the cp group's size).")
            if _close(got, want / 2, atol=ATOL):
                return failed(f"{head} It is half the mean: divided twice. ReduceOp.AVG already "
                              f"divides by the group's size.")
            return failed(f"{head} It changed, but not into the mean over cp: a reduction over "
                          f"ranks that hold other rows of a parameter, such as the whole world or "
                          f"dp, adds rows that do not belong together. Reduce only over the ranks "
                          f"that hold the same rows as this rank.")
        return passed("Every rank's gradient, on all 4 ranks of the (dp, cp) mesh, equals one "
                      "process's on the whole global batch, to float32 rounding (within "
                      f"{ATOL:g}). FSDP2 averaged over dp with a reduce-scatter; your sync "
                      "averaged the same rows over cp. One step further: torchtitan flattens dp "
                      "and cp into one mesh dimension and shards over it, so that FSDP2's own "
                      "reduce-scatter averages over both and no manual sync is needed.")


__all__ = ["MESH_SHAPE", "WORLD_SIZE", "cp_run", "check_cp_sync"]
