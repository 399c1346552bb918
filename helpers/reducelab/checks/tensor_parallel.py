"""Check of notebook 09's exercise: a vocabulary-parallel embedding.

The learner writes ``vocab_parallel_embedding(ids, weight_shard)``: ``ids`` are global
token ids (the same on every rank), and ``weight_shard`` is this rank's block of
consecutive rows of the embedding table (rank ``r`` of ``tp`` holds rows
``r * VOCAB // tp`` to ``(r + 1) * VOCAB // tp - 1``). It must return every token's
embedding on every rank, with a gradient of ``weight_shard`` equal to those rows of the
unsharded table's gradient.

It is a case notebook 09 does not show: an embedding lookup is ``one_hot(ids) @ table``,
a product whose weight is cut by rows, so it is a row-parallel layer. Each rank looks up
the tokens whose rows it holds and contributes zeros for the others; the ranks' partial
results are summed by Megatron-LM's ``g`` (all_reduce in forward, identity in backward).

Sources: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism" (arXiv:1909.08053), section 3 (the input embedding split
along the vocabulary); Megatron-LM's ``VocabParallelEmbedding``
(``megatron/core/tensor_parallel/layers.py``); torch's ``RowwiseParallel``, which
supports ``nn.Embedding`` (``torch/distributed/tensor/parallel/style.py``).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

VOCAB, DIM = 12, 4
"""The exercise's table: ``VOCAB`` rows (token ids 0 to 11) of ``DIM`` features."""
IDS_SHAPE = (4, 4)
"""Shape of the ids, ``(sequence, batch)``: 16 tokens, every id at least once."""
TOLERANCE = 1e-5
"""Largest absolute difference from one process that counts as equal (float32)."""
FALLBACK_WARNING = "an autograd kernel was not registered"
"""What torch 2.13 warns when autograd runs backward through ``c10d::allreduce_``."""


def layer_tensors() -> dict[str, torch.Tensor]:
    """The exercise's tensors, the same in every process (seeded): ``table`` ``(12, 4)``
    float32, ``ids`` ``(4, 4)`` int64 (every id 0 to 11 once, and 4 of them twice), and
    ``upstream`` ``(4, 4, 4)`` float32, the gradient of the loss with respect to the
    embeddings (the loss is ``(out * upstream).sum()``, the same on every rank)."""
    g = torch.Generator().manual_seed(9)
    table = torch.randn(VOCAB, DIM, generator=g)
    ids = torch.cat([torch.randperm(VOCAB, generator=g), torch.tensor([0, 5, 6, 11])])
    ids = ids[torch.randperm(ids.numel(), generator=g)].reshape(IDS_SHAPE)
    return {"table": table, "ids": ids,
            "upstream": torch.randn(*IDS_SHAPE, DIM, generator=g)}


def rows(rank: int, tp: int) -> slice:
    """The rows of the table (token ids) that rank ``rank`` of ``tp`` holds."""
    k = VOCAB // tp
    return slice(rank * k, (rank + 1) * k)


def reference() -> dict[str, torch.Tensor]:
    """One process: ``out = nn.functional.embedding(ids, table)``, shape ``(4, 4, 4)``,
    and ``table_grad``, the gradient of ``(out * upstream).sum()`` with respect to the
    table, ``(12, 4)``, computed by autograd."""
    t = layer_tensors()
    table = t["table"].clone().requires_grad_()
    out = torch.nn.functional.embedding(t["ids"], table)
    (out * t["upstream"]).sum().backward()
    return {"out": out.detach(), "table_grad": table.grad}


def _on_rank(fn, count: bool = False) -> dict:
    """Run the learner's ``fn`` on this rank with its rows of the table, then backward.

    Returns a dict: ``out`` (detached, or what ``fn`` returned if not a tensor),
    ``grad`` (of ``weight_shard``, or ``None``), ``ids_changed`` (``fn`` wrote into the
    ``ids`` it was given), ``counts`` (``{"forward": n, "backward": n}`` collectives seen
    by ``CommDebugMode`` when ``count`` is true, else ``None``) and ``warnings`` (their
    messages). ``count`` is off by default: importing DTensor's debug module costs a
    fresh rank a second or more."""
    if count:
        from torch.distributed.tensor.debug import CommDebugMode
    else:
        CommDebugMode = contextlib.nullcontext
    rank, tp = dist.get_rank(), dist.get_world_size()
    t = layer_tensors()
    ids = t["ids"].clone()
    weight_shard = t["table"][rows(rank, tp)].clone().requires_grad_()
    counts = {"forward": None, "backward": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CommDebugMode() as comm, _table_rows_moved() as moved:
            out = fn(ids, weight_shard)
        if count:
            counts["forward"] = comm.get_total_counts()
        changed = not torch.equal(ids, t["ids"])
        if not isinstance(out, torch.Tensor):
            return {"out": out, "grad": None, "ids_changed": changed, "counts": counts,
                    "warnings": [], "rows_moved": moved}
        if out.requires_grad and tuple(out.shape) == (*IDS_SHAPE, DIM):
            with CommDebugMode() as comm:
                (out * t["upstream"]).sum().backward()
            if count:
                counts["backward"] = comm.get_total_counts()
    return {"out": out.detach().clone(), "grad": weight_shard.grad, "ids_changed": changed,
            "counts": counts, "warnings": [str(w.message) for w in caught],
            "rows_moved": moved}


def _table_rows_moved() -> "contextlib.AbstractContextManager[list]":
    """A context that records, for every collective run inside it (any op of torch's
    ``c10d`` or functional-collective namespaces, as the dispatcher sees it, like
    ``CommDebugMode``), the op's name when one of its tensors has the size of the whole
    table or of one rank's shard of it: rows of the table sent between ranks. The
    ranks' shares of the output (``(4, 4, 4)``, 64 numbers) have neither size."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    rank_rows = VOCAB // dist.get_world_size()
    sizes = {VOCAB * DIM, rank_rows * DIM}

    class _Rows(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.moved: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "namespace", "") in ("c10d", "_c10d_functional",
                                                  "c10d_functional"):
                if any(isinstance(a, torch.Tensor) and a.numel() in sizes
                       for a in tree_leaves((args, kwargs))):
                    self.moved.append(func._overloadpacket.__name__)
            return func(*args, **kwargs)

    @contextlib.contextmanager
    def recording():
        mode = _Rows()
        with mode:
            yield mode.moved
    return recording()


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and bool((a.float() - b).abs().max() <= TOLERANCE))


def _id_list(ids) -> str:
    ids = sorted(set(int(i) for i in ids))
    return ", ".join(map(str, ids[:-1])) + (" and " if len(ids) > 1 else "") + str(ids[-1])


def _lookup_everywhere(local_ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(local_ids, shard)


def _diagnose_output(out: torch.Tensor, rank: int, tp: int) -> str:
    """Why rank ``rank``'s output differs from one process's, in plain words."""
    t, ref = layer_tensors(), reference()
    ids, table = t["ids"], t["table"]
    if tuple(out.shape) == (*IDS_SHAPE[:-1], IDS_SHAPE[-1], DIM * tp):
        return (" That is the ranks' results side by side along the features: an "
                "all_gather concatenates them, but every rank's result covers all "
                f"{DIM} features of every token, each a share of one sum. Add them "
                "(all_reduce, SUM) instead.")
    if tuple(out.shape) == (IDS_SHAPE[0] * tp, *IDS_SHAPE[1:], DIM):
        return (" That is the ranks' results stacked along the tokens (an all_gather): "
                "each rank's result covers every token, each a share of one sum. Add "
                "them (all_reduce, SUM) instead.")
    if tuple(out.shape) != (*IDS_SHAPE, DIM):
        return (f" Expected every token's embedding: shape {(*IDS_SHAPE, DIM)}, the shape "
                f"of ids followed by {DIM} features; got shape {tuple(out.shape)}.")
    k = VOCAB // tp
    held = (ids >= rank * k) & (ids < (rank + 1) * k)
    if _close(out, ref["out"] * held.unsqueeze(-1)):
        return (f" It holds the embeddings of the tokens whose ids ({rank * k} to "
                f"{(rank + 1) * k - 1}) are rows of this rank's shard, and zeros for the "
                f"others: this rank's share only. Every token's row lives on one rank; "
                f"the ranks' shares must be summed (all_reduce, SUM) before each rank "
                f"holds every embedding.")
    shards = [table[rows(r, tp)] for r in range(tp)]
    locals_ = [ids - r * k for r in range(tp)]
    stand_ins = {
        "clamped into the shard": [loc.clamp(0, k - 1) for loc in locals_],
        "replaced by row 0": [torch.where((loc >= 0) & (loc < k), loc, 0) for loc in locals_],
        "taken modulo the shard's size": [loc % k for loc in locals_],
    }
    for how, local in stand_ins.items():
        summed = sum(_lookup_everywhere(loc, s) for loc, s in zip(local, shards))
        if _close(out, summed):
            return (f" It matches a sum in which every rank also looked up a row for the "
                    f"tokens outside its range (their ids {how}), and added that row to "
                    f"the sum. A token whose row this rank does not hold must contribute "
                    f"zeros, so that each token's embedding comes from exactly one rank.")
    wrong = (out - ref["out"]).abs().amax(dim=-1) > TOLERANCE
    bad = ids[wrong]
    firsts, lasts = {r * k for r in range(tp)}, {r * k + k - 1 for r in range(tp)}
    if bad.numel() and set(bad.tolist()) <= firsts:
        return (f" Only the tokens with ids {_id_list(bad)} are wrong: the first id of a "
                f"rank's range. Check the ends of the test that decides which tokens a "
                f"rank holds.")
    if bad.numel() and set(bad.tolist()) <= lasts:
        return (f" Only the tokens with ids {_id_list(bad)} are wrong: the last id of a "
                f"rank's range. Check the ends of the test that decides which tokens a "
                f"rank holds.")
    if bad.numel():
        return f" The tokens with ids {_id_list(bad)} are wrong."
    return ""


def check_vocab_parallel_embedding(group: LocalGroup, fn, tps=(2, 3)) -> Verdict:
    """Exercise of notebook 09: ``fn(ids, weight_shard)`` must be the forward of an
    embedding whose table is split by rows over the ranks: every token's embedding,
    shape ``(4, 4, 4)``, on every rank, and a gradient of ``weight_shard`` equal to its
    rows of the unsharded table's gradient (within :data:`TOLERANCE`).

    Runs ``fn`` on real ranks at each tp degree in ``tps`` (the group is resized, then
    restored), with the loss ``(out * upstream).sum()`` the same on every rank, and
    compares with :func:`reference`. A wrong answer gets the likely mistake named: the
    global ids used as rows of the shard (torch's ``IndexError``), ``F.embedding`` or
    ``F.one_hot`` where the notebook's class ``F`` hides ``torch.nn.functional``, no sum over the
    ranks, the ranks' results concatenated where they must be summed, tokens of other
    ranks contributing a row instead of zeros, a range test off by one at either end,
    the ``ids`` changed in place, rows of the table sent between the ranks in forward
    (a collective on a tensor the size of the whole table or of a shard), an all_reduce in backward too (a gradient ``tp`` times
    too large), ``dist.all_reduce`` called where autograd cannot see it, or the output
    cut off from autograd.

    Returns:
        A :class:`~reducelab.checks.Verdict`; its message never shows solution code.
    """
    ref = reference()
    with restoring_world_size(group):
        for tp in tps:
            group.resize(tp)
            try:
                outs = group.run(_on_rank, fn)
            except RankError as e:
                verdict = raised_on_ranks(f"At tp={tp},", e)
                if not verdict.message.rstrip().endswith((".", "!", "?")):
                    verdict.message = verdict.message.rstrip() + "."
                if "index" in e.first_summary.lower() and "out of" in e.first_summary.lower():
                    verdict.message += (
                        f" A rank looked up a row its shard does not have: its shard holds "
                        f"{VOCAB // tp} rows, numbered from 0, while the ids are global "
                        f"(0 to {VOCAB - 1}). Either a global id was used as a row of the "
                        f"shard, or the test of which ids a rank holds let through an id "
                        f"of the next rank's range.")
                elif "type object 'F' has no attribute" in e.first_summary:
                    verdict.message += (
                        " In notebook 09, F is step 2's autograd Function (Megatron-LM's f), "
                        "defined after torch.nn.functional is usually imported as F: it "
                        "hides that module and has no other attribute than apply. Write "
                        "torch.nn.functional in full.")
                elif "leaf Variable" in e.first_summary:
                    verdict.message += (" weight_shard is a leaf that requires grad: do not "
                                        "write into it; compute a new tensor from it.")
                return verdict
            for r, o in enumerate(outs):
                out = o["out"]
                if not isinstance(out, torch.Tensor):
                    return failed(f"At tp={tp}, rank {r} returned {out!r}; expected a tensor "
                                  f"of shape {(*IDS_SHAPE, DIM)}: every token's embedding, "
                                  f"on every rank.")
                if not _close(out, ref["out"]):
                    how = (f" (largest difference {(out.float() - ref['out']).abs().max():.3g}; "
                           f"tolerance {TOLERANCE:g})" if out.shape == ref["out"].shape else "")
                    return failed(f"At tp={tp}, rank {r}'s embeddings differ from one "
                                  f"process's{how}." + _diagnose_output(out, r, tp))
            for r, o in enumerate(outs):
                if o["rows_moved"]:
                    ops = ", ".join(f"c10d.{n}" for n in dict.fromkeys(o["rows_moved"]))
                    return failed(
                        f"At tp={tp}, the embeddings are right, but rank {r}'s forward sent "
                        f"rows of the table between the ranks ({ops} of a tensor the size of "
                        f"the whole table or of one rank's shard). Splitting the table by "
                        f"rows exists so that no rank ever holds the whole table: each rank "
                        f"must look up tokens in its own {VOCAB // tp} rows only, and the "
                        f"ranks exchange only their results, never rows of the table.")
            for r, o in enumerate(outs):
                if o["ids_changed"]:
                    return failed(f"At tp={tp}, the embeddings are right, but rank {r}'s ids "
                                  f"tensor holds other values after your function ran: it "
                                  f"wrote into the ids it was given (in place). The caller's "
                                  f"ids are no longer the tokens; work on a new tensor.")
            for r, o in enumerate(outs):
                grad, want = o["grad"], ref["table_grad"][rows(r, tp)]
                if grad is None:
                    return failed(f"At tp={tp}, the embeddings are right, but no gradient "
                                  f"reached weight_shard on rank {r}: the output was cut off "
                                  f"from autograd (computed under torch.no_grad(), detached, "
                                  f"or copied into a new tensor). Backward must flow through "
                                  f"your sum to the shard.")
                if tp > 1 and torch.allclose(grad.float(), tp * want, atol=TOLERANCE) \
                        and not torch.allclose(grad.float(), want, atol=TOLERANCE):
                    o = group.run(_on_rank, fn, True)[r]
                    return failed(
                        f"At tp={tp}, the embeddings are right, but rank {r}'s gradient of "
                        f"weight_shard is {tp} times too large: your sum runs an all_reduce "
                        f"in backward too ({o['counts']['backward']} collective(s) seen in "
                        f"backward). The gradient arriving at the output is already the "
                        f"full gradient, the same on every rank; summing it again counts it "
                        f"{tp} times. torch.distributed.nn.functional.all_reduce does this. "
                        f"The sum must be the identity in backward.")
                fallback = [w for w in o["warnings"] if FALLBACK_WARNING in w]
                if fallback:
                    return failed(
                        f"At tp={tp}, the values and gradients are right, but autograd ran "
                        f"backward through dist.all_reduce itself, and torch warned: "
                        f"\"{fallback[0][:160]}...\". This treats the in-place all_reduce as "
                        f"the identity in backward, by a fallback that torch deprecates and "
                        f"calls possibly silently incorrect. Do the all_reduce inside the "
                        f"forward of a torch.autograd.Function, whose backward you write.")
                if not _close(grad, want):
                    off = (grad.float() - want).abs().amax(dim=-1) > TOLERANCE
                    ids = [r * (VOCAB // tp) + int(i) for i in off.nonzero().flatten()]
                    return failed(f"At tp={tp}, the embeddings are right, but rank {r}'s "
                                  f"gradient of weight_shard differs from one process's in "
                                  f"the rows of token ids {_id_list(ids)}.")
        counts = group.run(_on_rank, fn, True)[0]["counts"]   # at the last tp degree
    return passed(f"At tp={', '.join(map(str, tps))}, every rank's embeddings and the gradient "
                  f"of its rows of the table equal one process's nn.functional.embedding "
                  f"(within {TOLERANCE:g}). CommDebugMode saw {counts['forward']} "
                  f"collective(s) in your forward and {counts['backward']} in backward. An "
                  f"embedding lookup is one_hot(ids) @ table, a row-parallel layer: each "
                  f"token's row comes from the one rank that holds it, and g sums the shares. "
                  f"Megatron-LM's VocabParallelEmbedding works this way, and torch's "
                  f"RowwiseParallel shards an nn.Embedding by rows too.")
