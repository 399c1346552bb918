"""Checks and exercise data for notebook 05 (syncing gradients by hand on a device mesh).

The notebook's data: every rank of a (dp, cp) mesh holds a different slice of one global
batch (data parallel: different sequences; context parallel: different tokens of the same
sequences), all slices the same size (:func:`local_batch`, :func:`train_step`).

The exercise applies the notebook's sync to a case it does not show: sequences padded to
one length, so the ranks hold different numbers of **real** tokens (:data:`LENGTHS`,
:func:`local_tokens`), and each rank's loss is a mean over its own real tokens. The
learner's ``sync_grads(model, mesh, n_tokens)`` must leave every rank with the gradient
of the mean over all real tokens of the batch, without making a new process group on
every call. A plain mean over the ranks is then wrong (the mean of means of notebook 03,
here in the gradients): huggingface/transformers#24725, "Sum loss instead of mean loss
should be used if gradient accumulation step is larger than 1 when training a language
model" (2023-07-10), is the same arithmetic over micro-batches.

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
EXERCISE_SHAPES = ((2, 2), (1, 4), (4, 1), (2, 2, 1))
"""The meshes the exercise check runs on, each of world_size 4: three ``(dp, cp)`` meshes,
and one ``(dp, tp, cp)`` mesh whose two tp ranks hold different parameters
(``tiny_model(shard=tp index)``), as tensor-parallel ranks hold different shards: there
the dp x cp ranks are not the whole world, and a sum over every rank mixes the two
models' gradients."""
LENGTHS = (8, 5, 3, 6)
"""Real tokens of each sequence of the exercise's global batch; the rest of its
:data:`SEQ_LEN` token slots are padding. On every mesh of :data:`EXERCISE_SHAPES` each
rank holds at least one real token, and the ranks hold different numbers of them."""
OTHER_LENGTHS = (4, 7, 8, 2)
"""Real tokens of each sequence of the check's second batch (21 in all, against
:data:`LENGTHS`' 22), run on the mesh of :data:`OTHER_SHAPE`: a sync that divides by a
fixed number, right for the first batch, is wrong for this one. On that mesh the ranks
hold 8, 3, 6 and 4 real tokens."""
OTHER_SHAPE = (2, 2)
ATOL = 1e-6


def tiny_model(shard: int = 0) -> nn.Module:
    """The exercise's model: ``Linear(4, 8) -> Tanh -> Linear(8, 2)``, float32, the same
    weights on every rank and in the kernel (seeded with ``shard``, 0 by default, without
    touching the global RNG). On the check's ``(dp, tp, cp)`` mesh, tp rank ``t`` holds
    ``tiny_model(shard=t)``: other parameters, as a tensor-parallel shard is."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shard)
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


def token_mask(lengths=LENGTHS) -> torch.Tensor:
    """Which token slots of :func:`global_batch` are real: bool, shape ``(4, 8)``; slot
    ``t`` of sequence ``s`` is real when ``t < lengths[s]`` (padding at the end;
    :data:`LENGTHS` by default)."""
    return torch.arange(SEQ_LEN) < torch.tensor(lengths).unsqueeze(1)


def local_tokens(dp_index: int, cp_index: int, dp: int, cp: int,
                 lengths=LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens of the slice of :func:`global_batch` that the rank at mesh
    coordinate ``(dp_index, cp_index)`` of a ``(dp, cp)`` mesh holds: its
    :func:`local_batch`, without the padding slots of :func:`token_mask` of ``lengths``.

    Returns:
        ``(x, y)``, float32, shapes ``(n, 4)`` and ``(n, 2)``, ``n`` the rank's real tokens
        (between 1 and ``32 / (dp * cp)`` on the meshes of :data:`EXERCISE_SHAPES`).

    Raises:
        ValueError: as :func:`local_batch`.
    """
    x, y = local_batch(dp_index, cp_index, dp, cp)
    b, t = GLOBAL_BATCH // dp, SEQ_LEN // cp
    real = token_mask(lengths)[dp_index * b:(dp_index + 1) * b, cp_index * t:(cp_index + 1) * t]
    real = real.reshape(-1)
    return x[real], y[real]


def token_counts(dp: int, cp: int, lengths=LENGTHS) -> list[int]:
    """Real tokens per rank of a ``(dp, cp)`` mesh, in rank order (rank ``i * cp + j``
    sits at ``(i, j)``): ``[8, 5, 7, 2]`` for ``(2, 2)``.

    Raises:
        ValueError: as :func:`local_batch`.
    """
    return [len(local_tokens(i, j, dp, cp, lengths)[0]) for i in range(dp) for j in range(cp)]


def reference_token_grads(shard: int = 0, lengths=LENGTHS) -> dict[str, torch.Tensor]:
    """Single-process reference of the exercise: gradients of the mean squared error over
    every real token of :func:`global_batch` (22 of its 32 slots with :data:`LENGTHS`), for
    the model ``tiny_model(shard)``, ``{parameter name: tensor}``, float32."""
    model = tiny_model(shard)
    x, y = global_batch()
    real = token_mask(lengths)
    F.mse_loss(model(x[real]), y[real]).backward()
    return _grads(model)


def local_token_grads(dp_index: int, cp_index: int, dp: int, cp: int,
                      shard: int = 0, lengths=LENGTHS) -> dict[str, torch.Tensor]:
    """The gradients one rank of the exercise has after its own backward (the mean over
    its own real tokens), before any sync, computed in one process; ``shard`` is the
    rank's tp index (its model is ``tiny_model(shard)``)."""
    model = tiny_model(shard)
    x, y = local_tokens(dp_index, cp_index, dp, cp, lengths)
    F.mse_loss(model(x), y).backward()
    return _grads(model)


def token_train_step(sync_grads, dp: int, cp: int, steps: int = 2, tp: int = 1,
                     lengths=LENGTHS):
    """Runs on every rank: build the (dp, cp) mesh, or the (dp, tp, cp) mesh if ``tp`` > 1,
    then ``steps`` times: backward on the rank's real tokens and
    ``sync_grads(model, mesh, n_tokens)``.

    The local loss is the mean over the rank's own real tokens, ``n_tokens`` of them,
    and ``n_tokens`` differs from rank to rank. The tp ranks of a (dp, tp, cp) mesh see
    the same tokens and hold different parameters (``tiny_model(shard=tp index)``).
    ``lengths``: the real tokens of each of the batch's 4 sequences.

    Returns:
        ``(grads, made)``: ``grads`` is ``{parameter name: gradient after the last
        step}`` (``None`` for a parameter left without one); ``made[k]`` is how many new
        process groups the rank holds after step ``k``'s ``sync_grads`` call
        (:func:`live_process_groups`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    if tp == 1:
        mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
        (dp_index, cp_index), tp_index = mesh.get_coordinate(), 0
    else:
        mesh = init_device_mesh("cpu", (dp, tp, cp), mesh_dim_names=("dp", "tp", "cp"))
        dp_index, tp_index, cp_index = mesh.get_coordinate()
    model = tiny_model(shard=tp_index)       # tp ranks: other parameters
    x, y = local_tokens(dp_index, cp_index, dp, cp, lengths)
    n_tokens = len(x)                        # this rank's real tokens
    made = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        before = live_process_groups()
        sync_grads(model, mesh, n_tokens)
        made.append(live_process_groups() - before)
    grads = {name: (p.grad.detach().clone() if p.grad is not None else None)
             for name, p in model.named_parameters()}
    return grads, made


PRIVATE_CALLS = ("_flatten",)
"""Private methods of ``DeviceMesh`` that the exercise's ``sync_grads`` may not call (it
asks for public API only; notebook 05's step 5 shows the page's ``_flatten``)."""


def _token_step_recording_private(sync_grads, dp: int, cp: int, tp: int = 1,
                                  lengths=LENGTHS):
    """Runs on every rank: :func:`token_train_step`, with every call of a method of
    :data:`PRIVATE_CALLS` made from code outside the torch package (the learner's, not
    torch's own) recorded. Returns ``(grads, made, private)``, ``private`` the names of
    the calls, as ``"DeviceMesh._flatten"``."""
    import os
    import sys
    from torch.distributed.device_mesh import DeviceMesh
    inside_torch = os.path.dirname(torch.__file__)
    private, originals = [], {name: getattr(DeviceMesh, name) for name in PRIVATE_CALLS
                              if hasattr(DeviceMesh, name)}

    def recorded(name, call):
        def wrapper(*args, **kwargs):
            if not sys._getframe(1).f_code.co_filename.startswith(inside_torch):
                private.append(f"DeviceMesh.{name}")
            return call(*args, **kwargs)
        return wrapper

    for name, call in originals.items():
        setattr(DeviceMesh, name, recorded(name, call))
    try:
        grads, made = token_train_step(sync_grads, dp, cp, tp=tp, lengths=lengths)
    finally:
        for name, call in originals.items():
            setattr(DeviceMesh, name, call)
    return grads, made, private


def _same(a: dict, b: dict, atol: float = ATOL) -> bool:
    return all(a.get(k) is not None and a[k].shape == v.shape
               and torch.allclose(a[k].double(), v.double(), atol=atol, rtol=1e-5)
               for k, v in b.items())


def _combine(local: dict, coords, weights) -> dict:
    """``sum over coords of weight * local gradient``, in float64."""
    names = local[coords[0]].keys()
    return {k: sum(w * local[c][k].double() for c, w in zip(coords, weights)) for k in names}


def _likely_mistakes(rank: int, dp: int, cp: int, local: dict, counts: dict) -> list:
    """``(gradients, what to say)`` for the wrong syncs a learner is likely to write, at
    this rank, computed in one process from the local gradients and token counts."""
    i, j = divmod(rank, cp)
    world = dp * cp
    everyone = [(a, b) for a in range(dp) for b in range(cp)]
    dp_ranks = [(a, j) for a in range(dp)]
    cp_ranks = [(i, b) for b in range(cp)]
    n = [counts[c] for c in everyone]
    total, mine = sum(n), counts[(i, j)]
    shown = ", ".join(map(str, n))
    weighted = _combine(local, everyone, n)                  # sum of n_r * g_r
    mistakes = [
        (_combine(local, [(i, j)], [1]),
         "These are the rank's own local gradients: nothing was summed across ranks. Either "
         "no all_reduce reached p.grad (all_reduce works in place; a reduced copy that is "
         "never written back is lost), or the group held this rank alone."),
        (_combine(local, everyone, [1 / world] * world),
         f"That is the plain mean of the {world} ranks' local gradients, each rank weighted "
         f"1/{world}. It is right only when every rank holds as many real tokens as every "
         f"other; here they hold {shown}. Each local gradient is a mean over its own rank's "
         f"tokens, so in a plain mean over ranks a token on a rank with few real tokens "
         f"counts more than one on a rank with many."),
        (_combine(local, everyone, [1] * world),
         f"That is the SUM of the {world} ranks' local gradients, each a mean over its own "
         f"rank's tokens: neither weighted by the tokens nor divided."),
        ({k: v for k, v in weighted.items()},
         f"That is the sum over ranks of n_tokens x local gradient, the gradient of the SUM "
         f"of the loss over all {total} real tokens, not of its mean."),
        ({k: v / world for k, v in weighted.items()},
         f"That is the sum over ranks of n_tokens x local gradient, divided by the number "
         f"of ranks, {world}. Divide by the number of real tokens over all ranks, {total}, "
         f"which no rank knows until the ranks add up their counts."),
        ({k: v / mine for k, v in weighted.items()},
         f"That is the sum over ranks of n_tokens x local gradient, divided by this rank's "
         f"own n_tokens, {mine}: every rank must divide by the same number, the real "
         f"tokens over all ranks ({total})."),
        ({k: v / (GLOBAL_BATCH * SEQ_LEN) for k, v in weighted.items()},
         f"That is the sum over ranks of n_tokens x local gradient divided by "
         f"{GLOBAL_BATCH * SEQ_LEN}, every token slot of the batch, padding included. "
         f"Count the real tokens only: {total}."),
        (_combine(local, everyone, [1 / total] * world),
         f"That is the sum of the ranks' local gradients divided by the {total} real "
         f"tokens. A local gradient is already a mean over its rank's n_tokens tokens; "
         f"weighted by n_tokens it becomes the gradient of their sum, and those add up."),
        (_combine(local, [(i, j)], [mine / total]),
         f"That is this rank's own gradient, scaled by n_tokens / {total}, and never summed "
         f"across ranks: the other ranks' tokens are missing."),
    ]
    if dp > 1 and cp > 1:
        for name, ranks, other in (("dp", dp_ranks, "cp"), ("cp", cp_ranks, "dp")):
            held = "other tokens of the same sequences" if other == "cp" else "other sequences"
            index = f"{other} index {j if name == 'dp' else i}"
            m = [counts[c] for c in ranks]
            mistakes += [
                (_combine(local, ranks, [1 / len(ranks)] * len(ranks)),
                 f"That is the plain mean over the {name} group only (ranks of {index}). The "
                 f"{other} ranks hold {held}, so they must be in the sum too; and a plain "
                 f"mean weights every rank the same."),
                (_combine(local, ranks, [c / sum(m) for c in m]),
                 f"That is the token-weighted mean over the {name} group only (ranks of "
                 f"{index}). The {other} ranks hold {held}: their tokens belong in the "
                 f"sum and in the count."),
            ]
    return mistakes


def _tp_mistakes(t: int, tp: int, coords, locals_by_shard: list, counts: dict) -> list:
    """``(gradients, what to say)`` for syncs over every rank of a (dp, tp, cp) mesh, the
    tp ranks included, as tp rank ``t`` ends with them (one process, float64)."""
    n = [counts[c] for c in coords]
    total = sum(n)
    mixed = [_combine(local, coords, n) for local in locals_by_shard]
    plain = [_combine(local, coords, [1] * len(coords)) for local in locals_by_shard]
    names = mixed[0].keys()
    say = (f"That adds the gradients of the {tp} tp ranks: it is a sum over every rank of "
           f"the job, tp included. The tp ranks hold different parameters (here each "
           f"builds its model from another seed, as tensor-parallel ranks hold different "
           f"shards), so the sum mixes the gradients of different parameters. Reduce over "
           f"the ranks that hold the same parameters and see other tokens only.")
    return [
        ({k: sum(m[k] for m in mixed) / (tp * total) for k in names}, say),
        ({k: sum(m[k] for m in mixed) / total for k in names}, say),
        ({k: sum(m[k] for m in plain) / (tp * len(coords)) for k in names}, say),
    ]


def _fixed_divisor(got: dict, local: dict, coords, counts: dict, first_total: int) -> list:
    """``(gradients, what to say)`` for a sync of the second batch that weights and sums
    right but divides by a number fixed in advance (the first batch's count, say): the
    sum over ranks of n_tokens x local gradient, scaled by one constant. The constant is
    fitted to ``got`` (least squares, float64) and named."""
    weighted = _combine(local, coords, [counts[c] for c in coords])
    names = [k for k in weighted if got.get(k) is not None and got[k].shape == weighted[k].shape]
    if len(names) != len(weighted):
        return []
    a = torch.cat([weighted[k].flatten() for k in names])
    b = torch.cat([got[k].double().flatten() for k in names])
    scale = (a @ b / (a @ a)).item()
    if not scale > 0:
        return []
    divisor, total = 1 / scale, sum(counts.values())
    if abs(divisor - total) < 1e-3:
        return []
    said = f"{round(divisor)}" if abs(divisor - round(divisor)) < 1e-3 else f"{divisor:.4g}"
    first = (", the first batch's count of real tokens" if said == str(first_total) else "")
    return [({k: v * scale for k, v in weighted.items()},
             f"That is the sum over ranks of n_tokens x local gradient divided by a fixed "
             f"number, {said}{first}. This batch holds {total} real tokens: the count "
             f"changes from batch to batch, so a number written into sync_grads is right "
             f"for one batch only.")]


def check_mesh_sync(group: LocalGroup, sync_grads, shapes=EXERCISE_SHAPES) -> Verdict:
    """Exercise of notebook 05: ``sync_grads(model, mesh, n_tokens)``, called on every
    rank after ``backward()`` of the mean loss over the rank's ``n_tokens`` real tokens
    (an int that differs between ranks), must leave in every ``p.grad`` the gradient of
    the mean loss over all real tokens of all dp x cp ranks, and must not make a new
    process group on every call.

    Runs :func:`token_train_step` (two steps) with ``sync_grads`` on real ranks for each
    ``(dp, cp)`` or ``(dp, tp, cp)`` in ``shapes`` (the group is resized to the mesh's size
    if needed, then restored) and compares every rank's gradients with
    :func:`reference_token_grads` of its tp index (absolute tolerance :data:`ATOL`,
    relative 1e-5). On a mesh with tp ranks, a sum over every rank is wrong: they hold
    different parameters. A wrong answer is compared with
    the likely mistakes, computed in one process from :func:`local_token_grads` and
    :func:`token_counts` (no sync, the plain mean of means, a sum, a division by the
    number of ranks, by this rank's own count or by every slot with the padding, no
    weighting, no sum of the weighted gradients, dp or cp alone, every rank with tp).
    After ``shapes`` it runs the mesh :data:`OTHER_SHAPE` with a second batch,
    :data:`OTHER_LENGTHS` (21 real tokens, not 22): a division by a fixed number, right
    for the first batch only, is named there.
    A process group made
    on the first call and reused is fine; one made again on the second call is named, and
    so is a call of a private method of :data:`PRIVATE_CALLS` (``DeviceMesh._flatten``),
    since the exercise asks for public API only.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says, for a wrong answer, which mesh and
        rank disagree and what its gradients equal instead, or how many process groups
        each call made. No message prints a line of the solution.
    """
    first_total = sum(LENGTHS)
    cases = [(shape, LENGTHS) for shape in shapes] + [(OTHER_SHAPE, OTHER_LENGTHS)]
    with restoring_world_size(group):
        for shape, lengths in cases:
            dp, tp, cp = (shape[0], 1, shape[1]) if len(shape) == 2 else shape
            where = f"(dp={dp}, cp={cp})" if tp == 1 else f"(dp={dp}, tp={tp}, cp={cp})"
            if lengths != LENGTHS:
                where = (f"{where} with a second batch, whose 4 sequences hold "
                         f"{', '.join(map(str, lengths))} real tokens")
            group.resize(dp * tp * cp)  # a no-op when it already has that many ranks
            try:
                out = group.run(run_and_release, _token_step_recording_private, sync_grads,
                                dp, cp, tp, lengths)
            except RankError as e:
                return raised_on_ranks(f"On the mesh {where}", e)
            coords = [(i, j) for i in range(dp) for j in range(cp)]
            counts = dict(zip(coords, token_counts(dp, cp, lengths)))
            refs = [reference_token_grads(t, lengths) for t in range(tp)]
            local = [{c: local_token_grads(*c, dp, cp, shard=t, lengths=lengths) for c in coords}
                     for t in range(tp)]
            held = [counts[(r // (tp * cp), r % cp)] for r in range(dp * tp * cp)]
            for rank, (got, _, _) in enumerate(out):
                i, t, j = rank // (tp * cp), rank // cp % tp, rank % cp
                ref = refs[t]
                if _same(got, ref):
                    continue
                if any(v is None for v in got.values()):
                    return failed(f"On the mesh {where}, rank {rank} has parameters "
                                  f"without a gradient after sync_grads: did it set p.grad "
                                  f"to None?")
                diffs = [(got[k] - v).abs().max().item() for k, v in ref.items()
                         if got[k].shape == v.shape]
                worst = f"largest difference {max(diffs):.3g}" if diffs else "other shapes"
                likely = _likely_mistakes(i * cp + j, dp, cp, local[t], counts)
                if lengths != LENGTHS:
                    likely = _fixed_divisor(got, local[t], coords, counts, first_total) + likely
                if tp > 1:
                    likely = _tp_mistakes(t, tp, coords, local, counts) + likely
                hint = next((" " + say for grads, say in likely if _same(got, grads)), "")
                whose = f", for tp rank {t}'s model" if tp > 1 else ""
                return failed(
                    f"On the mesh {where}, whose ranks hold "
                    f"{', '.join(map(str, held))} real tokens, rank {rank}'s "
                    f"gradients differ from the single-process gradient of the mean over all "
                    f"{sum(counts.values())} real tokens{whose} ({worst}; expected at most "
                    f"{ATOL:g}).{hint}")
            private = next((call for o in out for call in o[2]), None)
            if private:
                return failed(
                    f"On the mesh {where} the gradients are right, but sync_grads "
                    f"called {private}, a private API: its leading underscore says it may "
                    f"change or vanish in any torch release, without a deprecation cycle. The "
                    f"exercise asks for public API only; step 5 lists public ways to reduce "
                    f"over the same ranks.")
            made = out[0][1]
            if made[-1] > 0:
                return failed(
                    f"On the mesh {where} the gradients are right, but every call "
                    f"of sync_grads made {made[-1]} new process group{'' if made[-1] == 1 else 's'} "
                    f"(dist.new_group, or new_subgroups_by_enumeration, inside it). Each new "
                    f"group is a collective that every rank of the job must join, it opens new "
                    f"connections (on GPUs, a new NCCL communicator), and it stays until "
                    f"destroy_process_group: called at every training step, sync_grads would "
                    f"pile up groups step after step. Reduce over groups that already exist "
                    f"(the mesh made one per dimension), or make the group once, outside "
                    f"sync_grads.")
        two = ", ".join(str(tuple(s)) for s in shapes if len(s) == 2)
        three = ", ".join(str(tuple(s)) for s in shapes if len(s) == 3)
        listed = f"the (dp, cp) meshes {two}" + (f" and the (dp, tp, cp) mesh {three}"
                                                  if three else "")
        return passed(
            f"On {listed}, every rank's gradients match the single-process gradient "
            f"of the mean over all {int(token_mask().sum())} real tokens to "
            f"{ATOL:g}, and on the mesh {tuple(OTHER_SHAPE)} with a second batch of other "
            f"lengths, over all {sum(OTHER_LENGTHS)} of its real tokens; a second call made "
            f"no new process group. A local mean over "
            f"n_tokens tokens, times n_tokens, is the gradient of their sum; summed over the "
            f"ranks and divided by all their real tokens, it is the global mean, whatever "
            f"each rank holds. With equal counts this is the plain mean over ranks.")


__all__ = ["check_mesh_sync", "tiny_model", "global_batch", "local_batch", "reference_grads",
           "local_grads", "train_step", "live_process_groups", "run_and_release",
           "EXERCISE_SHAPES", "LENGTHS", "OTHER_LENGTHS", "OTHER_SHAPE", "token_mask", "local_tokens", "token_counts",
           "reference_token_grads", "local_token_grads", "token_train_step"]
