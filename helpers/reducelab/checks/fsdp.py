"""The exercise check of notebook 15 (FSDP2): gradient accumulation with ``fully_shard``,
over micro-batches of unequal sizes.

One optimizer step over several micro-batches must use the gradient of the mean loss over
all the global batch's samples, as one process would compute it, and FSDP2 should
reduce-scatter each FSDP unit's gradients once per step, not once per micro-batch. Each
rank's 210 digits come as micro-batches of :data:`SIZES` digits (the same sizes on every
rank, so every rank's total is 210 and FSDP2's average over the ranks stays right), so a
micro-batch's mean loss cannot simply be divided by the number of micro-batches.
FSDP2's switch for the sync is ``FSDPModule.set_requires_gradient_sync`` (its counterpart
of DDP's ``no_sync()``, which notebook 04 runs): with it off, autograd accumulates a
backward's gradient into the ``.grad`` of FSDP2's unsharded parameter
(``FSDPParam._unsharded_param``), ``FSDPParamGroup.post_backward`` returns before
``foreach_reduce``, and ``p.grad`` stays ``None``; the next backward with it on
reduce-scatters the sum.

:func:`accumulate_run` builds the notebook's model with ``fully_shard`` on a 1-D CPU mesh
(gloo), gives the learner's ``accumulate_step(model, micro_batches, optimizer)`` this
rank's part of each global batch as micro-batches of :data:`SIZES` digits, and records
what the optimizer saw when it stepped, the collectives of each step, and each forward and
backward of the model (a backward is counted once per autograd graph task that reaches a
forward's output); :func:`check_accumulate_step` compares that with one process's gradient
on the whole global batch. Collectives are counted with
:func:`~reducelab.checks.sharded.counting_collectives`, which sees FSDP2's
``dist.reduce_scatter_single``: ``CommDebugMode`` (``torch.distributed.tensor.debug``)
counts FSDP2's ``c10d._reduce_scatter_base_`` for one forward and backward, but around
several micro-batches its module tracker raised ``IndexError`` on the installed torch 2.13
(``_comm_mode.py``, ``_fw_set_module_hook``).

Sources: ``torch.distributed.fsdp.fully_shard`` and ``FSDPModule.set_requires_gradient_sync``,
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html ; the source:
``torch/distributed/fsdp/_fully_shard/_fully_shard.py`` (``set_requires_gradient_sync``),
``_fsdp_param_group.py`` (``post_backward``: ``if not self.reduce_grads: ... return``),
``_fsdp_param.py`` (``_unsharded_param``, ``unsharded_accumulated_grad``),
``_fsdp_collectives.py`` (``foreach_reduce`` adds a reduce-scatter's result into an
existing ``p.grad``: ``fsdp_param.sharded_param.grad._local_tensor += new_sharded_grad``);
``torch._C._current_graph_task_id`` (used by ``torch/utils/checkpoint.py``) tells one
backward pass from another; ``torch/optim/adam.py`` skips a parameter whose ``grad`` is
``None``.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from ..data import load_digits_tensors
from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from .sharded import (ATOL, LR, NUMEL, counting_collectives, flat_gradient, global_batches,
                      initial_flat, local_part, make_model, placed_dtensors, reference_run, storage_bytes)

WORLD_SIZE = 4
"""Ranks the check runs on: the notebook's group size."""
SIZES = (100, 70, 40)
"""Digits in each micro-batch of a rank, in order: its 210 digits of a global batch of 840
(``local_part``), cut into consecutive pieces of these sizes, the same on every rank."""
MICRO_BATCHES = len(SIZES)
"""Micro-batches per optimizer step (3)."""
STEPS = 2
"""Optimizer steps the check takes, one call of the learner's function each: the second
shows what the first leaves behind."""
UNITS = 2
"""FSDP units that hold parameters: the two ``Linear`` s (the root holds none of its own),
so one step needs 2 reduce-scatters."""


_PHASES = {"pre_forward": "forward", "pre_backward": "backward", "post_backward": "backward"}
"""FSDP2's ``FSDPParamGroup`` methods that call collectives, and the phase each runs in."""


def _unit(param_group) -> str:
    """An FSDP unit's module, named as the notebook names it: ``model`` for the root,
    ``model[0]`` for its child ``"0"``."""
    fqn = param_group._module_fqn or ""
    return "model" if not fqn else f"model[{fqn}]" if fqn.isdigit() else f"model.{fqn}"


def _call_site() -> tuple[str | None, str | None]:
    """The FSDP unit and phase of the FSDP2 call that is running a collective, from the
    call stack: the ``FSDPParamGroup`` whose ``pre_forward``, ``pre_backward`` or
    ``post_backward`` called it, or the target of ``_prefetch_unshard`` (an all_gather
    started ahead of its unit's turn); ``(None, None)`` outside FSDP2."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    frame = sys._getframe(2)
    while frame is not None:
        name, local = frame.f_code.co_name, frame.f_locals
        if name == "_prefetch_unshard" and "target_fsdp_param_group" in local:
            return _unit(local["target_fsdp_param_group"]), f"{local.get('pass_type')}, prefetched"
        if name in _PHASES and isinstance(local.get("self"), FSDPParamGroup):
            return _unit(local["self"]), _PHASES[name]
        frame = frame.f_back
    return None, None


@contextlib.contextmanager
def fsdp_trace():
    """On a rank: what FSDP2 does inside the block, in order, as a list of
    ``(event, unit, phase, bytes)``. ``event``: a collective that
    :func:`~reducelab.checks.sharded.counting_collectives` counts (``"all_gather"``,
    ``"reduce_scatter"``, ``"all_reduce"``, with its ``bytes`` as there), or ``"reshard"``
    when an FSDP unit frees its gathered parameters (``bytes`` 0). ``unit``: the module
    FSDP2 runs it for (``model[0]``; ``model`` for the root; ``None`` for a collective
    outside FSDP2). ``phase``: ``"forward"`` or ``"backward"``, ``"backward, prefetched"``
    for an all_gather FSDP2 starts one unit ahead. (Notebook 15, step 2.)

    Read from FSDP2's own calls (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``):
    the ``FSDPParamGroup`` whose ``pre_forward``, ``pre_backward``, ``post_backward`` or
    ``_prefetch_unshard`` is on the call stack of a collective, and
    ``FSDPParamGroup.reshard``, wrapped for the block and restored on exit."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    events, originals = [], {}
    with counting_collectives() as sent:
        def traced(call):
            def wrapper(*args, **kwargs):
                unit, phase = _call_site()
                before = len(sent)
                result = call(*args, **kwargs)
                events.extend((name, unit, phase, nbytes) for name, nbytes in sent[before:])
                return result
            return wrapper
        for attr in ("all_reduce", "reduce_scatter_single", "all_gather_single"):
            originals[attr] = getattr(dist, attr)
            setattr(dist, attr, traced(originals[attr]))
        reshard = FSDPParamGroup.reshard

        def traced_reshard(self):
            gathered = self.is_unsharded
            phase = "forward" if self._training_state == TrainingState.FORWARD else "backward"
            reshard(self)
            if gathered and not self.is_unsharded:
                events.append(("reshard", _unit(self), phase, 0))
        FSDPParamGroup.reshard = traced_reshard
        try:
            yield events
        finally:
            FSDPParamGroup.reshard = reshard
            for attr, call in originals.items():
                setattr(dist, attr, call)


class RecordingAdam(torch.optim.Adam):
    """Adam (``lr`` = :data:`~reducelab.checks.sharded.LR`) that records, each time it
    steps, what it steps with: ``seen`` gets a 3-tuple ``(missing, grad, held)``:
    ``missing`` the number of parameters whose ``grad`` is ``None``, ``grad`` this rank's
    rows of every gradient placed in the flat vector (float32 ``(NUMEL,)``, NaN elsewhere;
    ``None`` when one is missing) and ``held`` (int), the gradient bytes this rank held
    then (``held()``, a callable of no argument)."""

    def __init__(self, params, held) -> None:
        super().__init__(params, lr=LR)
        self.seen: list[tuple[int, torch.Tensor | None, int]] = []
        self._held = held

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        missing = sum(p.grad is None for p in params)
        grad = None if missing else placed_dtensors(p.grad for p in params)
        self.seen.append((missing, grad, self._held()))
        return super().step(closure)


def _fsdp_params(model):
    """FSDP2's ``FSDPParam`` s of every FSDP module in ``model``, in module order."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        yield from (group.fsdp_params if group is not None else ())


def gradient_bytes(model) -> int:
    """On a rank: the bytes of gradient this rank holds for an FSDP2 ``model``: each
    parameter's ``grad`` (this rank's rows) plus what FSDP2 accumulates unsharded while
    gradient sync is off (``FSDPParam._unsharded_param.grad`` and
    ``unsharded_accumulated_grad``, ``_fsdp_param.py``); each storage counted once."""
    tensors = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    for fsdp_param in _fsdp_params(model):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        tensors += [getattr(unsharded, "grad", None), fsdp_param.unsharded_accumulated_grad]
    return storage_bytes(*tensors)


def pending_gradient(model) -> torch.Tensor | None:
    """On a rank: the unsharded gradient FSDP2 holds and has not reduce-scattered
    (``FSDPParam._unsharded_param.grad``), every parameter's flattened in module order:
    float32 ``(NUMEL,)``, or ``None`` when no parameter has one."""
    grads = [getattr(getattr(fp, "_unsharded_param", None), "grad", None) for fp in _fsdp_params(model)]
    if all(g is None for g in grads):
        return None
    return torch.cat([(g if g is not None else torch.zeros(fp.sharded_param.shape)).detach().flatten().float()
                      for g, fp in zip(grads, _fsdp_params(model))])


def micro_batch_indices(step: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """The indices of the digits in each of the :data:`MICRO_BATCHES` micro-batches that
    ``rank`` gets at ``step`` (0-based): its part of the global batch (``local_part``), cut
    into consecutive pieces of :data:`SIZES` digits; int64 tensors of shapes ``(100,)``,
    ``(70,)``, ``(40,)`` at 4 ranks. Raises ``RuntimeError`` (``torch.split``) at a world
    size whose part is not 210 digits."""
    return list(local_part(global_batches(step + 1)[step], rank, world_size).split(SIZES))


def _passes(events: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``events`` (``("forward", digits)`` at each forward of the model, ``("backward",
    graph task id)`` each time a backward reaches a forward's output) with one
    ``("backward", id)`` per backward pass: repeats of one pass in a row are dropped."""
    out: list[tuple[str, int]] = []
    for event in events:
        if not (event[0] == "backward" and out and out[-1] == event):
            out.append(event)
    return out


def accumulate_run(accumulate_step, X: torch.Tensor, y: torch.Tensor) -> dict:
    """Runs on each rank: the notebook's model with ``fully_shard`` on each ``Linear`` and
    the root over a 1-D CPU mesh, a :class:`RecordingAdam`, then :data:`STEPS` calls of
    ``accumulate_step(model, micro_batches, optimizer)``, ``micro_batches`` a list of
    :data:`MICRO_BATCHES` pairs ``(x, labels)``: float32 ``(b, 64)``, int64 ``(b,)``, ``b``
    each of :data:`SIZES` in turn.

    Returns:
        ``{"seen": [[(missing, grad, held), ...] per call], "sent": [[collective names]
        per call], "between": [bytes of gradient held at the start of each micro-batch's
        forward but the first, every call], "passes": [[("forward", digits) or
        ("backward", graph task id), in order] per call], "after": [{"pending": the
        unsharded gradient not yet reduce-scattered (float32 ``(NUMEL,)`` or ``None``),
        "state": parameters with Adam state, "moved": largest change of this rank's
        parameters since the call began} per call]}``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    model = make_model()
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    optimizer = RecordingAdam(model.parameters(), lambda: gradient_bytes(model))
    forwards, events = [], []

    def on_forward(module, args, output):
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return      # a forward under torch.no_grad() (an accuracy, say) is no micro-batch's
        events.append(("forward", args[0].shape[0] if args and torch.is_tensor(args[0]) else -1))
        output.register_hook(lambda grad: events.append(("backward", torch._C._current_graph_task_id())))

    model.register_forward_pre_hook(lambda module, args: forwards.append(gradient_bytes(model)))
    model.register_forward_hook(on_forward)
    out = {"seen": [], "sent": [], "between": [], "passes": [], "after": []}
    for step in range(STEPS):
        micro = [(X[idx], y[idx]) for idx in micro_batch_indices(step, rank, n)]
        before, forwards[:], events[:] = len(optimizer.seen), [], []
        start = [p.to_local().detach().clone() for p in model.parameters()]
        with counting_collectives() as sent:
            accumulate_step(model, micro, optimizer)
        out["seen"].append(optimizer.seen[before:])
        out["sent"].append([name for name, _ in sent])
        out["between"] += forwards[1:]
        out["passes"].append(_passes(events))
        out["after"].append({"pending": pending_gradient(model), "state": len(optimizer.state),
                             "moved": max((p.to_local() - s).abs().max().item()
                                          for p, s in zip(model.parameters(), start))})
    return out


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=0))


def _micro_batch_gradients(X, y, step: int, flat: torch.Tensor) -> list[torch.Tensor]:
    """One process's gradient, at parameters ``flat``, of the mean loss over micro-batch
    ``k`` of every rank, for each ``k``: float32 ``(NUMEL,)`` each."""
    parts = [micro_batch_indices(step, r, WORLD_SIZE) for r in range(WORLD_SIZE)]
    return [flat_gradient(flat, X[idx], y[idx])
            for idx in (torch.cat([p[k] for p in parts]) for k in range(MICRO_BATCHES))]


def _no_sync_hint(err: RankError) -> str:
    text = f"{err.headline} {getattr(err, 'first_summary', '')}"
    if "no_sync" in text and "AttributeError" in text:
        return (" FSDP2's sharded model has no no_sync() (that is DDP's context manager, "
                "notebook 04): its switch for the sync is the method the exercise text names.")
    return ""


def _passes_mistake(name: str, passes: list[tuple[str, int]]) -> Verdict | None:
    """A failing verdict unless ``passes`` is a forward then a backward per micro-batch."""
    kinds = [k for k, _ in passes]
    if kinds == ["forward", "backward"] * MICRO_BATCHES:
        return None
    digits = [v for k, v in passes if k == "forward"]
    f, b = len(digits), kinds.count("backward")
    did = (f"ran the model's forward {'once' if f == 1 else f'{f} times'}"
           f"{' (on ' + ', '.join(map(str, digits)) + ' digits)' if digits else ''} and "
           f"{b} backward pass{'es' if b != 1 else ''}")
    if f == 1 and digits and digits[0] == sum(SIZES):
        why = (f"that is one batch of all the rank's {sum(SIZES)} digits, not an accumulation: "
               f"its activations are those of all {MICRO_BATCHES} micro-batches at once.")
        mistake = "one batch, no accumulation"
    elif f == MICRO_BATCHES and b < f:
        why = ("fewer backward passes than forwards: the activations of several micro-batches "
               "were alive at once, until one backward freed them all.")
        mistake = "one backward for several micro-batches"
    elif f == MICRO_BATCHES and b == f:
        why = ("a forward ran before the previous micro-batch's backward: the activations of "
               "several micro-batches were alive at once.")
        mistake = "forwards ahead of backwards"
    else:
        why = f"the micro-batches come as {MICRO_BATCHES} ({', '.join(map(str, SIZES))} digits)."
        mistake = "forwards per micro-batch"
    return failed(f"{name}, your accumulate_step {did}, in the order "
                  f"{' '.join(k for k in kinds) or '(none)'}; {why} Accumulation exists to hold "
                  f"one micro-batch's activations at a time: a forward and then a backward for "
                  f"each of the {MICRO_BATCHES} micro-batches.", mistake=mistake)


def _sync_mistake(out: list[dict]) -> Verdict | None:
    """A failing verdict when ``p.grad`` was ``None`` at some step, from what the run did."""
    missing_at = [s for s in range(STEPS) if max(o["seen"][s][0][0] for o in out)]
    if not missing_at:
        return None
    s = missing_at[0]
    missing = max(o["seen"][s][0][0] for o in out)
    rs = [max(o["sent"][t].count("reduce_scatter") for o in out) for t in range(STEPS)]
    head = (f"At step {s + 1} of {STEPS}, when your function stepped the optimizer, p.grad was "
            f"None on {'every one' if missing == 4 else missing} of the model's 4 parameters, and "
            f"FSDP2 had reduce-scattered {rs[s]} times in this step.")
    pending = [[a["pending"] for a in o["after"]] for o in out]
    if missing_at == list(range(STEPS)) and not any(rs) and all(p is not None for q in pending for p in q):
        moved = max(a["moved"] for o in out for a in o["after"])
        state = max(a["state"] for o in out for a in o["after"])
        norms = [p.norm().item() for p in pending[0]]
        spread = max((q[-1] - pending[0][-1]).abs().max().item() for q in pending)
        return failed(
            f"{head} The same at each of the {STEPS} steps, 0 reduce-scatters in each: training "
            f"stopped, without an error. Adam skips a parameter whose grad is None: its state "
            f"stayed empty ({state} parameters with state after step {STEPS}) and the "
            f"parameters {'did not change' if moved == 0 else f'moved by at most {moved:.2g}'}. "
            f"Meanwhile each rank's unsharded gradient inside FSDP2 kept growing (its norm on "
            f"rank 0: {', then '.join(f'{v:.2g} after step {i + 1}' for i, v in enumerate(norms))}), "
            f"and the ranks' differ (by up to {spread:.2g}): each is that rank's own sum over "
            f"every backward so far, never averaged over the ranks. With gradient sync off, a "
            f"backward leaves its gradient there and sets no p.grad; only a backward that runs "
            f"with sync on reduce-scatters.", mistake="sync never back on")
    return failed(f"{head} With gradient sync off, a backward leaves each gradient unsharded "
                  f"inside FSDP2 and sets no p.grad; Adam skips a parameter whose grad is None, "
                  f"so that step changed nothing, and those gradients stay where they are, to be "
                  f"added into whatever the next reduce-scatter sends. FSDP2 reduce-scatters only "
                  f"in a backward that runs with sync on.", mistake="sync never back on")


def _gradient_mistake(name, got, want, previous, micro) -> Verdict:
    """The failing verdict for a wrong gradient ``got`` against ``want``; ``micro``: the
    micro-batches' gradients (:func:`_micro_batch_gradients`)."""
    total, k = sum(SIZES), MICRO_BATCHES
    sizes = ", ".join(map(str, SIZES[:-1])) + f" and {SIZES[-1]}"
    head = (f"{name}, the gradient your optimizer stepped with differs from one process's "
            f"gradient of the mean loss over the whole global batch of {WORLD_SIZE * total} "
            f"digits (largest difference {(got.double() - want.double()).abs().max().item():.3g}; "
            f"at most {ATOL:g} expected).")
    equal = sum(micro) / k
    if _close(got, equal):
        return failed(f"{head} It is the mean of the {k} micro-batches' gradients, each "
                      f"micro-batch's mean loss weighed 1/{k}: with micro-batches of {sizes} "
                      f"digits, that counts a digit of the {min(SIZES)}-digit micro-batch "
                      f"{max(SIZES) / min(SIZES):g} times as much as one of the {max(SIZES)}-digit "
                      f"micro-batch (it differs from the mean over the digits by up to "
                      f"{(equal.double() - want.double()).abs().max().item():.2g}). Dividing by the "
                      f"number of micro-batches gives the mean over the digits only when every "
                      f"micro-batch has as many digits; the mean over the {WORLD_SIZE * total} "
                      f"digits counts every digit alike.",
                      mistake="divided by the number of micro-batches")
    if _close(got, sum(micro), atol=k * ATOL):
        return failed(f"{head} It is the sum of the {k} micro-batches' gradients, each the "
                      f"gradient of a mean over that micro-batch's own digits ({sizes}): the "
                      f"micro-batches' losses were added, not combined into one mean over the "
                      f"rank's {total} digits.", mistake="sum of micro-batches")
    if _close(got, want / WORLD_SIZE):
        return failed(f"{head} It is 1/{WORLD_SIZE} of that mean: divided by the world size on "
                      f"top of FSDP2's own average (dividing by the global batch size, "
                      f"{WORLD_SIZE * sum(SIZES)}, does this too). FSDP2's reduce-scatter already "
                      f"averages over the {WORLD_SIZE} ranks (ReduceOp.AVG for float32).",
                      mistake="divided by world_size")
    for factor, words in ((SIZES[0] / total, f"weighed {SIZES[0]}/{total}"), (1 / k, f"divided by {k}"),
                          (1, "")):
        if _close(got, factor * micro[0]):
            return failed(f"{head} It is the gradient of the first micro-batch alone"
                          f"{', ' + words if words else ''}: FSDP2 reduce-scattered it into p.grad "
                          f"in micro-batch 0's backward, which ran with the sync on. The later "
                          f"micro-batches ran with the sync off: FSDP2 accumulated their gradients "
                          f"unsharded, on each rank, after that reduce-scatter, and the step did not "
                          f"see them (the next step's first reduce-scatter sends them along with its "
                          f"own). The sync was on for the wrong micro-batch: which backward has "
                          f"all {k} micro-batches' gradients to send?",
                          mistake="sync on for the first micro-batch")
    for factor, words in ((1 / k, f"divided by {k}"), (SIZES[-1] / total, f"weighed {SIZES[-1]}/{total}"),
                          (1, "")):
        if _close(got, factor * micro[-1]):
            return failed(f"{head} It is the gradient of the last micro-batch alone"
                          f"{', ' + words if words else ''}: the earlier micro-batches' gradients "
                          f"were in p.grad and were cleared before the step. Once FSDP2 has "
                          f"reduce-scattered a gradient into p.grad, clearing p.grad loses it.",
                          mistake="earlier micro-batches cleared")
    if previous is not None and _close(got, want + previous, atol=2 * ATOL):
        return failed(f"{head} It is this step's gradient plus the previous step's: p.grad still "
                      f"held the previous step's gradient when this step's micro-batches were "
                      f"added to it. FSDP2 adds a reduce-scatter's result into an existing p.grad, "
                      f"as autograd does.", mistake="previous step's gradient kept")
    return failed(f"{head} It is none of the usual slips (micro-batches weighed alike, a sum over "
                  f"the micro-batches, an extra division by the world size, the first or the last micro-batch "
                  f"alone, the previous step's gradient kept): compare what each micro-batch of "
                  f"{sizes} digits adds with the mean over the {WORLD_SIZE * total} digits.")


def check_accumulate_step(group: LocalGroup, accumulate_step) -> Verdict:
    """Exercise of notebook 15: ``accumulate_step(model, micro_batches, optimizer)`` takes
    one optimizer step over :data:`MICRO_BATCHES` micro-batches of unequal sizes
    (:data:`SIZES`) of an FSDP2 model, a forward and then a backward per micro-batch; the
    gradient the optimizer steps with must equal one process's gradient of the mean
    cross-entropy over the whole global batch of 840 digits (within
    :data:`~reducelab.checks.sharded.ATOL`, on every rank), at each of :data:`STEPS`
    steps, and FSDP2 must reduce-scatter :data:`UNITS` times per step (once per FSDP
    unit), not once per micro-batch.

    Runs :func:`accumulate_run` on :data:`WORLD_SIZE` real ranks (the group is resized if
    needed, then restored; every wait is bounded by the group's timeout).

    Returns:
        A :class:`~reducelab.checks.Verdict`. A wrong answer is explained: not a function;
        an error on the ranks (with a word on DDP's ``no_sync``, which FSDP2's module lacks);
        ``optimizer.step()`` called other than once per call; not a forward then a backward
        per micro-batch (one batch of every digit, one backward of several losses); no
        gradient at the step (gradient sync never back on: what the run then did); the
        micro-batches' mean losses weighed alike (divided by the number of micro-batches),
        added, divided by the world size as well, the first micro-batch's alone (the sync on
        for micro-batch 0 instead of the last), the last micro-batch's alone (earlier ones
        cleared), the previous step's still added; the right numbers with a reduce-scatter
        per micro-batch.
    """
    if not callable(accumulate_step):
        return failed(f"check_accumulate_step needs your function accumulate_step(model, "
                      f"micro_batches, optimizer), got {accumulate_step!r}.")
    X, y = load_digits_tensors()
    reference = reference_run(X, y, STEPS)
    with restoring_world_size(group):
        group.resize(WORLD_SIZE)
        try:
            out = group.run(accumulate_run, accumulate_step, X, y)
        except RankError as err:
            verdict = raised_on_ranks(f"On {WORLD_SIZE} ranks with FSDP2,", err)
            hint = _no_sync_hint(err)
            if not hint:
                return verdict
            message = verdict.message if verdict.message.endswith(".") else verdict.message + "."
            return Verdict(False, message + hint, mistake=verdict.mistake)
    for step in range(STEPS):
        name = f"At step {step + 1} of {STEPS}"
        calls = {len(o["seen"][step]) for o in out}
        if calls != {1}:
            k = max(calls, key=lambda c: abs(c - 1))
            did = "returned without stepping the optimizer" if k == 0 else \
                f"stepped the optimizer {k} times"
            return failed(f"{name}, one call of your accumulate_step {did} on some rank; "
                          f"one optimizer step per "
                          f"call is expected, with the gradient of all {MICRO_BATCHES} "
                          f"micro-batches.", mistake="steps per call")
        for o in out:
            verdict = _passes_mistake(name, o["passes"][step])
            if verdict is not None:
                return verdict
    verdict = _sync_mistake(out)
    if verdict is not None:
        return verdict
    previous, most = None, 0
    for step in range(STEPS):
        name = f"At step {step + 1} of {STEPS}"
        rs = [o["sent"][step].count("reduce_scatter") for o in out]
        got = torch.stack([o["seen"][step][0][1] for o in out]).nanmean(0)   # each row from its holder
        want = reference["grads"][step]
        if not _close(got, want):
            flat = initial_flat() if step == 0 else reference["params"][step - 1]
            return _gradient_mistake(name, got, want, previous, _micro_batch_gradients(X, y, step, flat))
        previous, most = got, max(most, *rs)
        if max(rs) > UNITS:
            return failed(f"{name}, the gradient is right (within {ATOL:g}), but FSDP2 "
                          f"reduce-scattered {max(rs)} times in one step, {max(rs) // UNITS} "
                          f"times for each of the {UNITS} FSDP units ({MICRO_BATCHES} "
                          f"micro-batches): once per micro-batch, with a sharded gradient in "
                          f"p.grad in between. Right numbers, but the exercise asks for one "
                          f"reduce-scatter per unit per step: the micro-batches' gradients can "
                          f"be summed on each rank first, and reduce-scattered once.",
                          mistake="a reduce-scatter per micro-batch")
        others = sorted({c for o in out for c in o["sent"][step]} - {"reduce_scatter", "all_gather"})
        if others:
            return failed(f"{name}, the gradient is right, but your function also called "
                          f"{', '.join(others)}: FSDP2's own collectives are all a step needs.",
                          mistake="extra collectives")
    between = max(max(o["between"], default=0) for o in out)
    sharded = max(o["seen"][0][0][2] for o in out)
    whole = 4 * NUMEL
    held = ("the whole model's gradient, unsharded, in float32" if between >= whole
            else f"where the whole model's, unsharded, is {whole:,} bytes")
    return passed(f"At both steps, on all {WORLD_SIZE} ranks, your function ran a forward and "
                  f"then a backward for each micro-batch ({', '.join(map(str, SIZES))} digits), "
                  f"the optimizer stepped with one process's gradient on the whole global batch, "
                  f"to float32 rounding (within {ATOL:g}), and FSDP2 reduce-scattered {most} "
                  f"times per step, once per FSDP unit, where a sync per micro-batch takes "
                  f"{UNITS * MICRO_BATCHES}. Measured on this run: between micro-batches each "
                  f"rank held up to {between:,} bytes of gradient, {held}, against at most "
                  f"{sharded:,} bytes, its shard, at the step.")


def sync_on_late_step(model, micro_batches, optimizer) -> None:
    """The step function :func:`sync_on_late` runs (``tests/test_nb15_fsdp2.py`` too): at its first call every micro-batch runs
    with gradient sync off; at its second, sync is on for the last micro-batch only. Each
    micro-batch's mean loss is weighed by its share of the rank's digits."""
    import torch.nn.functional as F
    first = not hasattr(model, "_reducelab_calls")
    model._reducelab_calls = True
    digits = sum(len(labels) for _, labels in micro_batches)
    for i, (x, labels) in enumerate(micro_batches):
        model.set_requires_gradient_sync(not first and i == len(micro_batches) - 1)
        (F.cross_entropy(model(x), labels) * (len(labels) / digits)).backward()
    optimizer.step()
    optimizer.zero_grad()


def sync_on_late(group: LocalGroup) -> str:
    """What a sync turned on one step late does, measured: runs :func:`accumulate_run` on
    :data:`WORLD_SIZE` real ranks with a step function that keeps gradient sync off for
    the whole first step and turns it on for the last micro-batch of the second, then
    compares the gradient Adam stepped with at step 2 against one process's gradients of
    the two global batches, at the initial parameters (step 1 moved none).

    Returns one paragraph (str) of what the run did: at each step, the parameters without
    a ``grad``, the reduce-scatters and whether the parameters moved; at step 2, whether the
    gradient is the sum of both steps' (within :data:`~reducelab.checks.sharded.ATOL`, on
    every rank's rows) and how far it is from step 2's own. Numbers of rounding size are
    given against ``ATOL`` only, so the text is the same on any CPU.

    Raises:
        reducelab.RankError: the run failed on the ranks (the group is resized to
            :data:`WORLD_SIZE` and restored; every wait is bounded by its timeout).

    Source: ``FSDPModule.set_requires_gradient_sync`` and ``FSDPParamGroup.post_backward``
    (``torch/distributed/fsdp/_fully_shard/``); ``torch/optim/adam.py`` skips a parameter
    whose ``grad`` is ``None``.
    """
    X, y = load_digits_tensors()
    with restoring_world_size(group):
        group.resize(WORLD_SIZE)
        out = group.run(accumulate_run, sync_on_late_step, X, y)
    first, second = global_batches(2)
    start = initial_flat()
    one = flat_gradient(start, X[first], y[first])
    two = flat_gradient(start, X[second], y[second])
    steps = []
    for s in range(STEPS):
        missing = max(o["seen"][s][0][0] for o in out)
        sent = max(o["sent"][s].count("reduce_scatter") for o in out)
        moved = max(o["after"][s]["moved"] for o in out)
        grads = ("every parameter's p.grad was None" if missing == 4 else
                 "every parameter had a p.grad" if missing == 0 else
                 f"{missing} of the 4 parameters had no p.grad")
        steps.append(f"at step {s + 1}, {grads} when Adam stepped, FSDP2 reduce-scattered "
                     f"{sent} time{'s' if sent != 1 else ''} and the parameters "
                     f"{'did not change' if moved == 0 else 'changed'}")
    if any(o["seen"][1][0][1] is None for o in out):
        return "; ".join(steps) + "."
    got = torch.stack([o["seen"][1][0][1] for o in out]).nanmean(0)   # each row from its holder
    both = _close(got, one + two)
    alone = (got.double() - two.double()).abs().max().item()
    tol = f"{ATOL:.0e}".replace("e-0", "e-")                      # 1e-6, as the notebook writes it
    return (f"On {WORLD_SIZE} ranks, sync off for all of step 1 and on for the last micro-batch "
            f"of step 2: " + "; ".join(steps) + ". At step 2 Adam stepped with "
            + ("the sum of both steps' gradients" if both else "a gradient other than the sum "
               "of both steps' gradients")
            + f" ({'within' if both else 'not within'} ATOL = {tol} of one process's sum, "
            f"on every rank's shard), not step 2's own: that differs from it by "
            f"{'more' if alone > 1e-3 else 'less'} than 1e-3.")


__all__ = ["WORLD_SIZE", "SIZES", "MICRO_BATCHES", "STEPS", "UNITS", "RecordingAdam", "fsdp_trace",
           "gradient_bytes", "pending_gradient", "micro_batch_indices", "accumulate_run",
           "check_accumulate_step", "sync_on_late", "sync_on_late_step"]
