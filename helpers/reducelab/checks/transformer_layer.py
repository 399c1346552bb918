"""The check of notebook 18's exercise, and the code it runs on the ranks.

The exercise: after backward on a ``(dp=2, tp=2)`` mesh, with sequence parallelism,
``sync_gradients(grads, mesh)`` combines each rank's gradients so that every rank holds
what one process training on both batches would hold, for its own shards:

* the gradients of the parameters a rank used on its own tokens only (the LayerNorms'
  weights and biases, and the biases added after the reduce_scatter: :data:`SP_NAMES`)
  are partial sums over the tokens: summed over ``tp``, then averaged over ``dp``;
* the sharded weights' gradients (:data:`SHARDED_NAMES`) are whole on each tp rank for
  its own shard: averaged over ``dp`` only.

This module imports only ``torch`` (and the standard library), so its functions can run
on the ranks.

Each rank's gradients have the shapes of notebook 18's layer at ``tp=2`` (a shard for
the sharded weights, the whole vector for the others), with values drawn from a seed of
the parameter and the rank's ``(dp, tp)`` coordinate; the rule the exercise asks for does
not depend on the values. The one-process reference adds and averages the same tensors.

Sources: Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, section 4.2.2; Megatron-LM's
``megatron/core/distributed/finalize_model_grads.py`` (the sequence-parallel gradients
all-reduced over tp) and its data-parallel gradient all_reduce over dp.
"""
from __future__ import annotations

import torch

from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError

DP, TP = 2, 2
"""The mesh the check runs: ``(dp, tp)``, 4 ranks."""
EMBED, HIDDEN = 8, 16
"""Notebook 18's model width and MLP width."""
SP_NAMES = ("ln1.weight", "ln1.bias", "o.bias", "ln2.weight", "ln2.bias", "2.bias")
"""Parameters used on a rank's own tokens only under sequence parallelism."""
SHARDED_NAMES = ("q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "o.weight",
                 "0.weight", "0.bias", "2.weight")
"""Parameters cut over tp (each rank's gradient is whole for its own shard)."""
TOL = 1e-5


def _shape(name: str) -> tuple:
    if name in SP_NAMES:
        return (EMBED,)
    rows = {"q": EMBED // TP, "k": EMBED // TP, "v": EMBED // TP, "0": HIDDEN // TP}
    head, kind = name.split(".")
    if name == "o.weight":
        return (EMBED, EMBED // TP)
    if name == "2.weight":
        return (EMBED, HIDDEN // TP)
    return (rows[head], EMBED) if kind == "weight" else (rows[head],)


def layer_grads(dp_index: int, tp_index: int) -> dict:
    """The gradients a rank at ``(dp_index, tp_index)`` holds after backward, before any
    sync: ``{name: float32 tensor}`` in the layer's shapes at ``tp=2``; the same on every
    call for the same coordinate."""
    out = {}
    for k, name in enumerate(SP_NAMES + SHARDED_NAMES):
        g = torch.Generator().manual_seed(1000 * k + 10 * dp_index + tp_index)
        out[name] = torch.randn(_shape(name), generator=g)
    return out


def synced_on_mesh(fn) -> tuple:
    """Runs on a rank of 4: build the ``(dp, tp)`` mesh, hand ``fn`` this rank's
    gradients and the mesh, and return ``((dp_index, tp_index), grads)``, ``grads`` as
    the dict holds them after the call (copies; a value that is not a tensor as its
    ``repr``), and the number of collectives ``fn`` made on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from .loss import _Collectives
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    d, t = (int(c) for c in mesh.get_coordinate())
    grads = layer_grads(d, t)
    off = _OffGrads({g.untyped_storage().data_ptr() for g in grads.values()})
    with _Collectives() as made, off:            # every collective fn makes, however called
        fn(grads, mesh)
    return (d, t), {name: (g.detach().clone() if isinstance(g, torch.Tensor) else repr(g))
                    for name, g in grads.items()}, sum(made.counts.values()), off.count


class _OffGrads:
    """Counts, while entered, the collectives whose tensors all live outside ``grads``
    (none shares storage with a gradient it was given): a flat buffer, which torch.cat
    fills with copies, so its result reaches ``grads`` only if copied back. Seen as
    :class:`~reducelab.checks.loss._Collectives` sees them, by a ``TorchDispatchMode``."""

    def __init__(self, storages: set):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        from .loss import COUNTED_NAMESPACES, NOT_COLLECTIVES
        owner, self.count = self, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if (func.namespace in COUNTED_NAMESPACES
                        and f"{func.namespace}::{func._overloadpacket.__name__}" not in NOT_COLLECTIVES):
                    tensors = [a for a in tree_leaves((args, kwargs or {}))
                               if isinstance(a, torch.Tensor)]
                    if tensors and not any(a.untyped_storage().data_ptr() in storages
                                           for a in tensors):
                        owner.count += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def reference() -> dict:
    """One process: ``{(d, t): {name: the right gradient}}``."""
    every = {(d, t): layer_grads(d, t) for d in range(DP) for t in range(TP)}
    right = {}
    for (d, t) in every:
        right[d, t] = {}
        for name in SP_NAMES:
            right[d, t][name] = sum(sum(every[e, u][name] for u in range(TP)) for e in range(DP)) / DP
        for name in SHARDED_NAMES:
            right[d, t][name] = sum(every[e, t][name] for e in range(DP)) / DP
    return right


def _candidates(name: str, d: int, t: int, every: dict) -> dict:
    """What each usual mistake gives for ``name`` on rank ``(d, t)``."""
    def over_dp(f, mean=True):
        s = sum(f(e) for e in range(DP))
        return s / DP if mean else s
    own = lambda e: every[e, t][name]                                     # noqa: E731
    tp_sum = lambda e: sum(every[e, u][name] for u in range(TP))          # noqa: E731
    tp_mean = lambda e: tp_sum(e) / TP                                    # noqa: E731
    return {"unchanged": every[d, t][name],
            "dp only": over_dp(own),
            "tp averaged": over_dp(tp_mean),
            "tp summed": over_dp(tp_sum),
            "dp summed": over_dp(tp_sum if name in SP_NAMES else own, mean=False),
            "tp summed, dp summed": over_dp(tp_sum, mean=False),
            "tp only": tp_sum(d)}


def _near(a, b) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= TOL


MAX_COLLECTIVES = 2
"""Collectives a rank may make: one over each dimension of the mesh, each on all the
gradients it combines in one flat buffer, as Megatron-LM coalesces them
(``_flatten_dense_tensors`` in ``megatron/core/distributed/finalize_model_grads.py``)."""


def _judge(rows: list, right: dict) -> Verdict | None:
    every = {(d, t): layer_grads(d, t) for d in range(DP) for t in range(TP)}
    for (d, t), grads, made, off in rows:
        where = f"rank (dp {d}, tp {t})"
        copy_back = (" This rank ran a collective on a tensor that is none of grads' tensors: "
                     "torch.cat makes a copy: copy the reduced buffer back into the grads."
                     if off else "")
        # the dp mean with the tp sum missing: a buffer was lost only if the dp mean came from
        # collectives on grads' own tensors; with every collective on a copy, the copy came
        # back, and only the tp sum is missing (a sixth review, 18-1)
        lost_buffer = copy_back if made > off else ""
        missing = [n for n in SP_NAMES + SHARDED_NAMES if n not in grads]
        if missing:
            return failed(f"{where}: grads lost {', '.join(missing)}. Change the tensors in grads "
                          f"(or put the combined ones back under the same names).", "names lost")
        for name in SP_NAMES + SHARDED_NAMES:
            if not isinstance(grads[name], torch.Tensor):
                return failed(f"{where}: grads[{name!r}] is {grads[name]}, not a tensor.",
                              "not a tensor")
        seen_as = {name: next((k for k, v in _candidates(name, d, t, every).items()
                               if _near(grads[name], v)), None)
                   for name in SP_NAMES + SHARDED_NAMES if not _near(grads[name], right[d, t][name])}
        if seen_as and set(seen_as) == set(SP_NAMES + SHARDED_NAMES) and \
                set(seen_as.values()) == {"tp averaged"}:
            return failed(f"{where}: every gradient was averaged over all {DP * TP} ranks. That "
                          f"halves the sequence-parallel ones (partial sums over tokens, to be "
                          f"added up over tp) and mixes each sharded weight's gradient with the "
                          f"other tp rank's, a different shard. Combine over the mesh's "
                          f"dimensions one at a time.", "averaged over all 4 ranks")
        if seen_as and set(seen_as) == set(SP_NAMES + SHARDED_NAMES) and \
                set(seen_as.values()) <= {"dp summed", "tp summed, dp summed"}:
            return failed(f"{where}: every gradient is {DP} times the right one: summed over dp "
                          f"but never divided. The dp ranks saw different batches, and one "
                          f"process training on both would take their mean. Note that g = g / 2 "
                          f"on a loop variable makes a new tensor and does not change grads.",
                          "summed over dp, never divided")
        for name in SP_NAMES + SHARDED_NAMES:
            got = grads[name]
            if name not in seen_as:
                continue
            kind = "sequence-parallel" if name in SP_NAMES else "sharded"
            seen = seen_as[name]
            if seen == "unchanged":
                changed = [n for n in SP_NAMES + SHARDED_NAMES if n not in seen_as or
                           seen_as[n] != "unchanged"]
                if changed:   # a buffer came back: this one was left out (a seventh review, 18-1)
                    need = ("the dp average" if kind == "sharded" else
                            "the sum over tp and the average over dp")
                    return failed(f"{where}: the gradient of {name} is unchanged, as backward left "
                                  f"it, while that of {changed[0]} changed: the collectives left "
                                  f"{name} out. A {kind} weight's gradient needs {need} too.",
                                  "left out of the collectives")
                return failed(f"{where}: the gradient of {name} is unchanged, as backward left it: "
                              f"nothing combined it with the other ranks' gradients.{copy_back}", "unchanged")
            if kind == "sequence-parallel" and seen == "dp only":
                return failed(f"{where}: the gradient of {name} is the dp average of this rank's "
                              f"own gradient. Under sequence parallelism a rank used {name} on its "
                              f"own tokens only, so its gradient is a partial sum over those "
                              f"tokens: the tp ranks' partial sums must be added up as well "
                              f"(question 1).{lost_buffer}", "SP gradients not summed over tp")
            if kind == "sequence-parallel" and seen == "tp averaged":
                return failed(f"{where}: the gradient of {name} is half the right one: the tp "
                              f"ranks' partial sums were averaged. Each holds the sum over its "
                              f"own tokens; the whole gradient is their sum over tp, not their "
                              f"mean. Average over dp only.", "averaged over tp too")
            if seen in ("dp summed", "tp summed, dp summed"):
                everyone = (f" (A collective called without a group runs over the default "
                            f"process group, all {DP * TP} ranks: it sums over dp and tp at once.)"
                            if kind == "sequence-parallel" else "")
                return failed(f"{where}: the gradient of {name} is {DP} times the right one: it was "
                              f"summed over dp. The dp ranks saw different batches, and one process "
                              f"training on both would take their mean: average over dp.{everyone}",
                              "summed over dp instead of averaged")
            if kind == "sharded" and seen in ("tp averaged", "tp summed", "tp only"):
                how = "averaged" if seen == "tp averaged" else "added"
                return failed(f"{where}: the gradient of {name}, a shard cut over tp, was {how} "
                              f"with the other tp rank's. That rank holds another shard, other "
                              f"rows or columns of the weight: the two are different parameters, "
                              f"and mixing them raises nothing but corrupts both. A sharded "
                              f"weight's gradient is already whole on its own rank; average it "
                              f"over dp only.", "sharded gradients mixed over tp")
            if kind == "sequence-parallel" and seen == "tp only":
                return failed(f"{where}: the gradient of {name} is the sum over tp of this dp "
                              f"rank's batch only: the dp ranks' gradients were never averaged.",
                              "not averaged over dp")
            want = right[d, t][name]
            if got.shape != want.shape:
                return failed(f"{where}: the gradient of {name} has the shape {tuple(got.shape)}, "
                              f"not {tuple(want.shape)}: keep each rank's own shard.", "wrong shape")
            worst = (got - want).abs().max().item()
            return failed(f"{where}: the gradient of {name} ({kind}) differs from one process's "
                          f"by up to {worst:.3g}. Which of these gradients are partial sums over "
                          f"a rank's tokens, and which mesh dimension holds other data?", "wrong")
    return None


def check_sync_gradients(group, fn) -> Verdict:
    """Notebook 18's exercise: ``fn(grads, mesh)`` combines, on each rank of a
    ``(dp=2, tp=2)`` mesh with sequence parallelism, this rank's gradients ``grads``
    (``{name: tensor}``, changed in place or replaced under the same names) over the
    mesh's dimensions ``"dp"`` and ``"tp"``.

    Runs ``fn`` on real ranks at world size 4 (the group is resized, then restored),
    compares every rank's gradients with one process's (:func:`reference`), and names
    the usual mistake it finds: gradients unchanged, sequence-parallel gradients not
    summed over tp or averaged over tp, summed over dp instead of averaged, sharded
    gradients mixed over tp (averaged over all 4 ranks, or added), a DeviceMesh passed
    as a group, an error or a hang on the ranks; with every gradient right, more than
    :data:`MAX_COLLECTIVES` collectives on a rank (counted as notebook 03's check counts
    them, ``reducelab.checks.loss._Collectives``).

    Returns:
        A :class:`~reducelab.checks.Verdict`.
    """
    from .mesh import run_and_release
    if not callable(fn):
        return failed(f"Pass your function itself, sync_gradients, not {fn!r}.")
    with restoring_world_size(group):
        group.resize(DP * TP)
        try:
            rows = group.run(run_and_release, synced_on_mesh, fn)
        except RankError as err:
            if any("DeviceMesh(" in r.summary and "not initialized" in r.summary
                   for r in err.reports):
                return failed(f"On a (dp={DP}, tp={TP}) mesh, a collective got a DeviceMesh as its "
                              f"group, and torch says the process group "
                              f"{err.reports[0].summary.split('Process group ')[-1].split(' is ')[0]}"
                              f" is not initialized: a collective takes a process group, which "
                              f"a mesh dimension gives with .get_group().", "a mesh as group")
            return raised_on_ranks(f"On a (dp={DP}, tp={TP}) mesh,", err)
    problem = _judge(rows, reference())
    if problem is not None:
        return problem
    made = {coord: n for coord, _, n, _ in rows}
    most = max(made.values())
    if most > MAX_COLLECTIVES:
        (d, t), n = next((c, n) for c, n in sorted(made.items()) if n == most)
        return failed(f"Every rank's gradients are right, but rank (dp {d}, tp {t}) made {n} "
                      f"collectives for them; at most {MAX_COLLECTIVES} are asked, one over each "
                      f"dimension of the mesh, each carrying all the gradients it combines. "
                      f"Every collective pays its latency; Megatron-LM coalesces the "
                      f"sequence-parallel gradients into one buffer for one all_reduce.",
                      "too many collectives")
    return passed(f"On a (dp={DP}, tp={TP}) mesh, every rank's {len(SP_NAMES)} sequence-parallel "
                  f"gradients and {len(SHARDED_NAMES)} sharded ones equal one process's for its "
                  f"own shards: the partial sums over tokens added up over tp, every gradient "
                  f"averaged over dp, and no shard mixed with another, in at most "
                  f"{MAX_COLLECTIVES} collectives per rank.")
