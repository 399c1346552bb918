"""Checks for notebook 11 (when ranks disagree), and the code it runs on the ranks.

This module imports only ``torch`` (and the standard library), so its functions can run
on the ranks without importing matplotlib or ipywidgets there:

* :func:`record_on_rank` keeps a rank's flight record on disk while a function runs
  (the kernel side is :func:`reducelab.widgets.disagree.run_recorded`);
* :func:`local_batch` is each rank's data in the exercise, and :func:`simulate` the
  single-process reference of the exercise's training loop under several stopping rules;
* :func:`check_stop_together` checks the learner's fixed loop on real ranks.

Sources: ``torch.distributed.all_reduce`` and ``ReduceOp.AVG``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the
flight recorder, https://pytorch.org/tutorials/prototype/flight_recorder_tutorial.html
"""
from __future__ import annotations

import os
import pickle
import re

import torch

from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError

MAX_STEPS = 30
"""Most optimizer steps of the exercise's loop."""
TARGET = 0.1
"""The loop stops once the mean squared error, averaged over ranks, is below this."""
LR = 0.1
"""Learning rate of the exercise's SGD."""
W_TRUE = torch.tensor([[1.0], [-2.0], [0.5]])
"""The weights the exercise's data are made from, shape ``(3, 1)``."""


# --- on the ranks ----------------------------------------------------------------------

def record_on_rank(fn, folder: str, every: float, *args):
    """Run ``fn(*args)`` on this rank and keep its flight record in ``folder/rank_<r>``.

    Runs on the ranks (notebook 11's explorer, through
    :func:`reducelab.widgets.disagree.run_recorded`). The file (a pickle) is rewritten
    every ``every`` seconds by a thread, and once more when ``fn`` returns or raises;
    each write replaces the file whole, so a reader never sees half a file, even after
    the rank was killed. It holds ``{"rank", "entries", "result", "raised", "final"}``:
    ``entries`` are the flight-recorder entries of the default process group made during
    this call (each ``{"seq", "name", "sizes", "retired"}``), ``result`` is ``fn``'s
    return value and ``raised`` the text of its exception.

    Needs the flight recorder, which torch 2.13 keeps by default (2000 entries per rank;
    ``TORCH_FR_BUFFER_SIZE=0`` turns it off, and then ``entries`` stays empty). The dump is
    ``torch._C._distributed_c10d._dump_fr_trace()``, a private torch API (torch 2.13).
    """
    import threading

    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    rank = dist.get_rank()
    pg = dist.group.WORLD.group_name

    def status() -> dict:
        dump = pickle.loads(_dump_fr_trace(includeCollectives=False, includeStackTraces=False))
        return dump.get("pg_status", {}).get(pg, {})

    start = status().get("last_enqueued_collective", 0)
    lock = threading.Lock()

    def write(final: bool, result=None, raised=None) -> None:
        dump = pickle.loads(_dump_fr_trace(includeStackTraces=False))
        entries = [{"seq": e["collective_seq_id"],
                    "name": e["profiling_name"].split(":")[-1],
                    "sizes": e["input_sizes"], "retired": e["retired"]}
                   for e in dump.get("entries", [])
                   if str(e["pg_id"]) == pg and not e["is_p2p"]
                   and e["collective_seq_id"] > start]
        record = {"rank": rank, "entries": entries, "result": result, "raised": raised,
                  "final": final}
        try:
            data = pickle.dumps(record)
        except Exception:
            data = pickle.dumps({**record, "result": repr(result)})
        path = os.path.join(folder, f"rank_{rank}")
        with lock:
            with open(path + ".part", "wb") as f:
                f.write(data)
            os.replace(path + ".part", path)

    stop = threading.Event()

    def periodic() -> None:
        while not stop.wait(every):
            write(False)

    thread = threading.Thread(target=periodic, name="reducelab-flight-record", daemon=True)
    thread.start()
    try:
        result = fn(*args)
    except BaseException as e:
        stop.set()
        thread.join()
        write(True, raised=f"{type(e).__name__}: {e}")
        raise
    stop.set()
    thread.join()
    write(True, result=result)
    return result


def local_batch(rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s data in notebook 11's exercise: ``(x, y)``, float32 tensors of
    shapes ``(n, 3)`` and ``(n, 1)``.

    ``y = x @ W_TRUE`` plus noise whose size grows with the rank (0.1 * (rank + 1)), so
    every rank's loss falls at its own pace and some never get below :data:`TARGET` on
    their own. Seeded by rank: the same on every call.
    """
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 3, generator=g)
    y = x @ W_TRUE + 0.1 * (rank + 1) * torch.randn(n, 1, generator=g)
    return x, y


RULES = ("mean", "rank 0", "min", "max", "sum", "never")
"""Stopping rules :func:`simulate` knows: stop when the loss averaged over ranks is below
the target (the exercise's rule); when rank 0's own loss is; when any rank's is (MIN);
when every rank's is (MAX); when the SUM over ranks is; never (no early stop)."""


def simulate(world_size: int, rule: str = "mean", max_steps: int = MAX_STEPS,
             target: float = TARGET, lr: float = LR) -> tuple[int, torch.Tensor]:
    """The exercise's training loop in one process, for ``world_size`` ranks' data.

    Each step computes every rank's loss on its :func:`local_batch`, stops (before the
    update) when ``rule`` says so (see :data:`RULES`), and otherwise takes one SGD step
    with the gradient averaged over ranks, which is what ``all_reduce(grad, AVG)`` on
    every rank gives.

    Returns:
        ``(steps, weight)``: optimizer steps taken (an ``int``, at most ``max_steps``) and
        the final weight, float32 of shape ``(1, 3)``.

    Raises:
        ValueError: an unknown ``rule``.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = [local_batch(r) for r in range(world_size)]
    steps = 0
    for _ in range(max_steps):
        losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in data]
        values = torch.stack([loss.detach() for loss in losses])
        decide = {"mean": values.mean(), "rank 0": values[0], "min": values.min(),
                  "max": values.max(), "sum": values.sum(),
                  "never": torch.tensor(float("inf"))}[rule]
        if decide.item() < target:
            break
        opt.zero_grad()
        (sum(losses) / world_size).backward()
        opt.step()
        steps += 1
    return steps, model.weight.detach().clone()


# --- the exercise's check -----------------------------------------------------------------

_HINTS = {
    "rank 0": ("That is when rank 0's own loss was good enough: rank 0 decided for everyone. "
               "The rule is the loss averaged over all ranks."),
    "min": ("That is when the best rank's loss was good enough (ReduceOp.MIN): one lucky "
            "rank decided for everyone. The rule is the loss averaged over all ranks."),
    "max": ("That is when every rank's loss was good enough (ReduceOp.MAX). The rule is the "
            "loss averaged over all ranks."),
    "sum": ("That is when the SUM of the ranks' losses was below the target: the sum is "
            "world_size times the mean."),
}


def _place(summary: str) -> str:
    """``"in all_reduce (train line 16)"`` from a stuck rank's summary."""
    m = re.match(r"was waiting in (\w+), called from (.+)$", summary)
    if m:
        return f"in {m.group(1)} ({m.group(2)})"
    m = re.match(r"was still running, at (.+)$", summary)
    return f"in its own code ({m.group(1)})" if m else summary


def _explain_hang(ws: int, err: RankError, timeout: float) -> Verdict:
    returned = [r.rank for r in err.reports if r.state == "returned"]
    stuck = [r for r in err.reports if r.state == "stuck"]
    where = sorted({_place(r.summary) for r in stuck})
    who = ", ".join(str(r.rank) for r in stuck)
    text = (f"With world_size={ws} the loop still hangs: rank{'s' if len(stuck) > 1 else ''} "
            f"{who} waited {'; '.join(where)} until the {timeout:g} s timeout")
    if returned:
        text += (f", while rank{'s' if len(returned) > 1 else ''} "
                 f"{', '.join(map(str, returned))} had already left the loop and returned. "
                 f"A rank that decides to stop on its own loss leaves alone, and the others "
                 f"wait for it in the next all_reduce. Every rank must take the same "
                 f"decision, so base it on a value that is the same on every rank: the loss "
                 f"averaged over all ranks.")
    else:
        text += (". No rank returned: look for a collective that only some ranks call, or "
                 "that the ranks call in a different order.")
    return failed(text)


def check_stop_together(group, fn, world_sizes=(2, 4)) -> Verdict:
    """Notebook 11's exercise: ``fn(max_steps, target)`` trains until the mean squared
    error **averaged over all ranks** is below ``target``, and returns ``(steps,
    weight)`` on every rank: the number of optimizer steps taken (an ``int``) and the
    final ``model.weight`` (shape ``(1, 3)``).

    Runs ``fn(MAX_STEPS, TARGET)`` on real ranks at each world size in ``world_sizes``
    (the group is resized, then restored), each call bounded by the group's timeout, and
    compares with :func:`simulate` (``rule="mean"``; weights within 1e-4). A wrong
    answer gets an explanation: a hang (who returned, who waited where), an error, ranks
    that disagree, or a stopping rule other than the mean (rank 0's loss, MIN, MAX, SUM,
    never).

    Returns:
        A :class:`~reducelab.checks.Verdict`.
    """
    with restoring_world_size(group):
        for ws in world_sizes:
            group.resize(ws)
            try:
                out = group.run(fn, MAX_STEPS, TARGET)
            except RankError as err:
                if any(r.state == "stuck" for r in err.reports) and \
                        not any(r.state in ("raised", "died") for r in err.reports):
                    return _explain_hang(ws, err, group.timeout)
                return raised_on_ranks(f"With world_size={ws}", err)
            shaped = all(isinstance(o, (tuple, list)) and len(o) == 2
                         and isinstance(o[1], torch.Tensor) for o in out)
            if not shaped:
                return failed(f"With world_size={ws}, rank 0 returned {out[0]!r}; expected "
                              f"(steps, weight): the number of optimizer steps and "
                              f"model.weight.")
            steps = [int(o[0]) for o in out]
            weights = [o[1].detach().float().reshape(1, -1) for o in out]
            want_steps, want_weight = simulate(ws, "mean")
            if len(set(steps)) > 1:
                return failed(f"With world_size={ws} the ranks took different numbers of "
                              f"steps: {steps}. They must stop together, at the same step.")
            if any(not torch.allclose(w, weights[0], atol=1e-6) for w in weights):
                return failed(f"With world_size={ws} the ranks end with different weights: "
                              f"are the gradients still averaged over all ranks at every step?")
            if steps[0] != want_steps:
                hint = ""
                for rule in ("rank 0", "min", "max", "sum"):
                    if simulate(ws, rule)[0] == steps[0] and simulate(ws, rule)[0] != want_steps:
                        hint = " " + _HINTS[rule]
                        break
                if not hint and steps[0] >= MAX_STEPS:
                    hint = (f" Your loop never stopped early. Is the value you compare with "
                            f"the target the mean over ranks, or their SUM (which is "
                            f"{ws} times larger)?")
                elif not hint:
                    hint = (" Did you all_reduce the loss tensor itself rather than a detached "
                            "copy? Then backward() runs through the all_reduce (torch warns "
                            "that c10d::allreduce_ has no autograd kernel) and the gradients "
                            "are no longer the average over ranks.")
                return failed(f"With world_size={ws} every rank stopped after {steps[0]} "
                              f"steps, but the loss averaged over ranks first falls below "
                              f"{TARGET:g} after {want_steps} steps.{hint}")
            if not torch.allclose(weights[0], want_weight.reshape(1, -1), atol=1e-4):
                return failed(f"With world_size={ws} the ranks stopped at the right step "
                              f"({want_steps}) but hold the weight {weights[0]}, not "
                              f"{want_weight}: keep averaging the gradients over all ranks "
                              f"at every step.")
        return passed(f"At world sizes {', '.join(map(str, world_sizes))} every rank stopped "
                      f"at the same step, the first one where the loss averaged over all "
                      f"ranks is below {TARGET:g}, and the weights match a single-process "
                      f"reference. Any `if` or `break` around a collective must be decided "
                      f"the same way on every rank.")
