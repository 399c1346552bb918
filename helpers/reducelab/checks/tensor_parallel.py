"""Check of notebook 09's exercise: the forward of a row-parallel linear layer.

The learner writes ``row_parallel_linear(h_shard, weight_shard, bias)``: this rank's
columns of the hidden activation, this rank's columns of the weight (an ``nn.Linear``
weight, ``(out_features, in_features)``, split along ``in_features``), and the full
bias. It must return the layer's full output on every rank, with gradients that match
the unsharded ``nn.Linear``: Megatron-LM's ``g`` (all_reduce in forward, identity in
backward), with the bias added once, after the sum.

Source: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism" (arXiv:1909.08053), section 3 and figure 3; Megatron-LM's
``RowParallelLinear`` and ``reduce_from_tensor_model_parallel_region``
(``megatron/core/tensor_parallel/layers.py`` and ``mappings.py``).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

BATCH, IN_FEATURES, OUT_FEATURES = 3, 8, 4
"""Shapes of the exercise's layer: ``h`` is ``(BATCH, IN_FEATURES)``, the weight
``(OUT_FEATURES, IN_FEATURES)``, the bias ``(OUT_FEATURES,)``."""
TOLERANCE = 1e-5
"""Largest absolute difference from the unsharded layer that counts as equal (float32;
the values are of order 1, and the ranks add in another order than one process)."""
FALLBACK_WARNING = "an autograd kernel was not registered"
"""What torch 2.13 warns when autograd runs backward through ``c10d::allreduce_``."""


def layer_tensors() -> dict[str, torch.Tensor]:
    """The exercise's full tensors, the same in every process (float32, seeded):
    ``h`` ``(3, 8)``, ``weight`` ``(4, 8)``, ``bias`` ``(4,)`` and ``upstream`` ``(3, 4)``,
    the gradient of the loss with respect to the output (the loss is
    ``(output * upstream).sum()``, the same on every rank)."""
    g = torch.Generator().manual_seed(9)
    return {"h": torch.randn(BATCH, IN_FEATURES, generator=g),
            "weight": torch.randn(OUT_FEATURES, IN_FEATURES, generator=g) / 2,
            "bias": torch.randn(OUT_FEATURES, generator=g) + 1.0,
            "upstream": torch.randn(BATCH, OUT_FEATURES, generator=g)}


def columns(rank: int, tp: int) -> slice:
    """The ``in_features`` that rank ``rank`` of ``tp`` holds (even split)."""
    k = IN_FEATURES // tp
    return slice(rank * k, (rank + 1) * k)


def _on_rank(fn, count: bool = False) -> dict:
    """Run the learner's ``fn`` on this rank with its shards, then ``backward()``.

    Returns a dict: ``out`` (detached, or what ``fn`` returned if not a tensor),
    ``grads`` (``h_shard``, ``weight_shard``, ``bias``: tensors or ``None``),
    ``counts`` (``{"forward": n, "backward": n}``, the collectives seen by
    ``CommDebugMode`` when ``count`` is true, else ``None``) and ``warnings`` (their
    messages). ``count`` is off by default: importing DTensor's debug module costs a
    fresh rank a second or more."""
    if count:
        from torch.distributed.tensor.debug import CommDebugMode
    else:
        CommDebugMode = contextlib.nullcontext

    rank, tp = dist.get_rank(), dist.get_world_size()
    t = layer_tensors()
    mine = columns(rank, tp)
    h_shard = t["h"][:, mine].clone().requires_grad_()
    weight_shard = t["weight"][:, mine].clone().requires_grad_()
    bias = t["bias"].clone().requires_grad_()
    counts = {"forward": 0, "backward": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CommDebugMode() as comm:
            out = fn(h_shard, weight_shard, bias)
        counts["forward"] = comm.get_total_counts() if count else None
        if not isinstance(out, torch.Tensor):
            return {"out": out, "grads": {}, "counts": counts, "warnings": []}
        if out.requires_grad and tuple(out.shape) == (BATCH, OUT_FEATURES):
            with CommDebugMode() as comm:
                (out * t["upstream"]).sum().backward()
            counts["backward"] = comm.get_total_counts() if count else None
    return {"out": out.detach().clone(), "counts": counts,
            "grads": {"h_shard": h_shard.grad, "weight_shard": weight_shard.grad,
                      "bias": bias.grad},
            "warnings": [str(w.message) for w in caught]}


def reference() -> dict[str, torch.Tensor]:
    """The unsharded layer in one process: ``out = h @ weight.T + bias`` and the
    gradients of ``(out * upstream).sum()`` with respect to ``h``, ``weight`` and
    ``bias``, computed by autograd."""
    t = layer_tensors()
    h = t["h"].clone().requires_grad_()
    weight = t["weight"].clone().requires_grad_()
    bias = t["bias"].clone().requires_grad_()
    out = torch.nn.functional.linear(h, weight, bias)
    (out * t["upstream"]).sum().backward()
    return {"out": out.detach(), "h": h.grad, "weight": weight.grad, "bias": bias.grad}


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and bool((a.float() - b).abs().max() <= TOLERANCE))


def _diagnose_output(out, rank: int, tp: int, outs: list) -> str:
    """Why rank ``rank``'s output differs from the unsharded layer's, in plain words."""
    t, ref = layer_tensors(), reference()
    mine = columns(rank, tp)
    partial = t["h"][:, mine] @ t["weight"][:, mine].T
    if tuple(out.shape) == (BATCH, OUT_FEATURES * tp):
        return (" That is the ranks' partial outputs side by side: an all_gather "
                "concatenates them, but every rank's partial output covers all "
                f"{OUT_FEATURES} output features, each a share of the same sum. Add them "
                "(all_reduce, SUM) instead.")
    if tuple(out.shape) != (BATCH, OUT_FEATURES):
        return (f" Expected the full output, of shape ({BATCH}, {OUT_FEATURES}) on every "
                f"rank; got shape {tuple(out.shape)}.")
    if _close(out, partial + t["bias"]) or _close(out, partial):
        return (" That is this rank's partial sum, h_shard @ weight_shard.T: it covers "
                f"only its {IN_FEATURES // tp} of the {IN_FEATURES} input features. The "
                "ranks' partial sums must be added in forward (an all_reduce, SUM) before "
                "the output is complete.")
    if _close(out, ref["out"] + (tp - 1) * t["bias"]):
        extra = "1 extra copy" if tp == 2 else f"{tp - 1} extra copies"
        return (f" It is the right output plus {extra} of the bias: every "
                "rank added the bias before the sum, so the all_reduce added it "
                f"{tp} times. The bias is replicated: add it once, after the all_reduce "
                "(or on one rank only, before it).")
    missing = [r for r, o in enumerate(outs) if _close(o, ref["out"] - t["bias"])]
    if missing:
        return (f" It lacks the bias, on rank(s) {', '.join(map(str, missing))}. Every "
                "rank needs the full output, so every rank adds the (replicated) bias, "
                "after the all_reduce.")
    summed = sum(t["h"][:, columns(r, tp)] for r in range(tp))
    if (_close(out, summed @ t["weight"][:, mine].T + t["bias"]) or
            _close(out, sum(summed @ t["weight"][:, columns(r, tp)].T for r in range(tp))
                   + t["bias"])):
        return (" It matches what you get by summing the ranks' h_shard tensors first. "
                "Those shards hold different input features, so a sum adds unrelated "
                "features; seeing all of h would take an all_gather (a concatenation). "
                "The row-parallel layer needs neither: multiply your own shard by your "
                "own columns of the weight, then sum the partial outputs.")
    return ""


def check_row_parallel(group: LocalGroup, fn, tps=(2, 4)) -> Verdict:
    """Exercise of notebook 09: ``fn(h_shard, weight_shard, bias)`` must be the forward of
    a row-parallel ``nn.Linear``: the full output ``(3, 4)`` on every rank, and
    gradients of ``h_shard``, ``weight_shard`` and ``bias`` equal to the matching parts
    of the unsharded layer's (within :data:`TOLERANCE`).

    Runs ``fn`` on real ranks at each tp degree in ``tps`` (the group is resized, then
    restored), with the loss ``(output * upstream).sum()`` the same on every rank, and
    compares with :func:`reference`. A wrong answer gets the usual mistake named: no sum
    over ranks, the bias added on every rank before the sum or missing on some ranks,
    the hidden shards summed where only an all_gather could join them, partial outputs
    concatenated where they must be summed, an all_reduce in backward too (gradients
    ``tp`` times too large), or ``dist.all_reduce`` called where autograd cannot see it.

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
                if "leaf Variable" in e.first_summary:
                    verdict.message += (" dist.all_reduce writes into its tensor in place, "
                                        "and the arguments are leaves that require grad: "
                                        "reduce a new tensor computed from them instead.")
                return verdict
            values = [o["out"] for o in outs]
            for r, o in enumerate(outs):
                out = o["out"]
                if not isinstance(out, torch.Tensor):
                    return failed(f"At tp={tp}, rank {r} returned {out!r}; expected a tensor "
                                  f"of shape ({BATCH}, {OUT_FEATURES}): the layer's full "
                                  f"output, on every rank.")
                if not _close(out, ref["out"]):
                    how = (f" (largest difference {(out.float() - ref['out']).abs().max():.3g}; "
                           f"tolerance {TOLERANCE:g})" if out.shape == ref["out"].shape else "")
                    return failed(f"At tp={tp}, rank {r}'s output differs from the "
                                  f"unsharded layer's{how}." + _diagnose_output(out, r, tp, values))
            for r, o in enumerate(outs):
                grads, mine = o["grads"], columns(r, tp)
                want = {"h_shard": ref["h"][:, mine], "weight_shard": ref["weight"][:, mine],
                        "bias": ref["bias"]}
                if grads["h_shard"] is None or grads["weight_shard"] is None:
                    return failed(f"At tp={tp}, the output is right, but no gradient "
                                  f"reached h_shard or weight_shard on rank {r}: the output "
                                  f"was cut off from autograd (computed under "
                                  f"torch.no_grad(), detached, or copied into a new tensor). "
                                  f"Backward must flow through your sum to the shards.")
                if any(torch.allclose(grads[k].float(), tp * want[k], atol=TOLERANCE)
                       for k in ("h_shard", "weight_shard")) and tp > 1:
                    o = group.run(_on_rank, fn, True)[r]
                    return failed(
                        f"At tp={tp}, the output is right, but rank {r}'s gradients of "
                        f"h_shard and weight_shard are {tp} times too large: your sum runs an "
                        f"all_reduce in backward too ({o['counts']['backward']} collective(s) "
                        f"seen in backward). The gradient arriving at the output is already "
                        f"the full gradient, the same on every rank; summing it again counts "
                        f"it {tp} times. torch.distributed.nn.functional.all_reduce does "
                        f"this. g must be the identity in backward.")
                fallback = [w for w in o["warnings"] if FALLBACK_WARNING in w]
                if fallback:
                    return failed(
                        f"At tp={tp}, the values and gradients are right, but autograd ran "
                        f"backward through dist.all_reduce itself, and torch warned: "
                        f"\"{fallback[0][:160]}...\". This treats the in-place all_reduce "
                        f"as the identity in backward, by a fallback that torch deprecates "
                        f"and calls possibly silently incorrect. Do the all_reduce inside "
                        f"the forward of a torch.autograd.Function (g), whose backward you "
                        f"write yourself.")
                for k in ("h_shard", "weight_shard"):
                    if not _close(grads[k], want[k]):
                        return failed(f"At tp={tp}, the output is right, but rank {r}'s "
                                      f"gradient of {k} differs from the unsharded layer's "
                                      f"(expected {want[k]}, got {grads[k]}).")
                if grads["bias"] is None or not _close(grads["bias"], want["bias"]):
                    who = [q for q, p in enumerate(outs)
                           if p["grads"]["bias"] is not None
                           and _close(p["grads"]["bias"], ref["bias"])]
                    if who:
                        return failed(
                            f"At tp={tp}, the output is right, but only rank(s) "
                            f"{', '.join(map(str, who))} got the bias's gradient; rank {r} "
                            f"got {grads['bias']}. The bias reached the output through one "
                            f"rank only (added before the sum, on that rank). Each rank keeps "
                            f"its own copy of the bias, so after the next optimizer step the "
                            f"copies would differ. Add the bias on every rank, after the sum.")
                    return failed(f"At tp={tp}, the output is right, but rank {r}'s gradient "
                                  f"of bias is {grads['bias']}; expected {want['bias']}.")
        counts = group.run(_on_rank, fn, True)[0]["counts"]   # at the last tp degree
    return passed(f"At tp={', '.join(map(str, tps))}, every rank's output and the gradients "
                  f"of h_shard, weight_shard and bias equal the unsharded nn.Linear's "
                  f"(within {TOLERANCE:g}). CommDebugMode saw {counts['forward']} "
                  f"collective(s) in your forward and {counts['backward']} in backward: "
                  f"the partial sums meet in one all_reduce, and the gradient needs none, "
                  f"because every rank already holds the full gradient of the output.")
