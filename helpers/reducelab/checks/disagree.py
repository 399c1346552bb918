"""Checks for notebook 11 (when ranks disagree), and the code it runs on the ranks.

This module imports only ``torch`` (and the standard library), so its functions can run
on the ranks without importing matplotlib or ipywidgets there:

* :func:`record_on_rank` keeps a rank's flight record on disk while a function runs
  (the kernel side is :func:`reducelab.widgets.disagree.run_recorded`), optionally on a
  process group of its own with a short timeout;
* :func:`step_batch` is each rank's data in the exercise, and :func:`reference` the
  single-process reference of the exercise's training loop;
* :func:`check_skip_together` checks the learner's loop on real ranks.

Sources: ``torch.distributed.all_reduce`` and ``ReduceOp``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ;
``torch.amp.GradScaler``, which skips ``optimizer.step()`` when the gradients hold an
inf or a NaN, https://pytorch.org/docs/stable/amp.html#gradient-scaling ; the flight
recorder, https://pytorch.org/tutorials/prototype/flight_recorder_tutorial.html
"""
from __future__ import annotations

import os
import pickle
import re

import torch

from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError

STEPS = 6
"""Steps of the exercise's loop (one batch each)."""
LR = 0.1
"""Learning rate of the exercise's SGD."""
W_TRUE = torch.tensor([[1.0], [-2.0], [0.5]])
"""The weights the exercise's data are made from, shape ``(3, 1)``."""
CASES = ((2, ((1, 2),)), (4, ((2, 1), (0, 4))))
"""The check's runs: ``(world_size, bad)``, ``bad`` the ``(rank, step)`` pairs whose batch
is corrupt: rank 1 at step 2 on two ranks; rank 2 at step 1 and rank 0 at step 4 on four."""
ATOL = 1e-5
"""How close the learner's weights must be to :func:`reference` (float32; the ranks sum
in another order than one process does)."""


# --- on the ranks ----------------------------------------------------------------------

_LAST_GROUP: list = []
"""On a rank: the process group :func:`record_on_rank` made in its last call, destroyed at
the next call (a rank restarted after a failure starts with none)."""


def record_on_rank(fn, folder: str, every: float, *args, pg_timeout: float | None = None):
    """Run ``fn(*args)`` on this rank and keep its flight record in ``folder/rank_<r>``.

    Runs on the ranks (notebook 11's explorer, through
    :func:`reducelab.widgets.disagree.run_recorded`). The file (a pickle) is rewritten
    every ``every`` seconds by a thread, and once more when ``fn`` returns or raises;
    each write replaces the file whole, so a reader never sees half a file, even after
    the rank was killed. It holds ``{"rank", "entries", "result", "raised", "final"}``:
    ``entries`` are the flight-recorder entries of ``fn``'s process group made during
    this call (each ``{"seq", "name", "sizes", "retired"}``), ``result`` is ``fn``'s
    return value and ``raised`` the text of its exception.

    With ``pg_timeout`` (seconds), every rank first makes a process group of its own,
    ``dist.new_group(timeout=timedelta(seconds=pg_timeout))``, and ``fn`` is called as
    ``fn(*args, pg)``: its collectives on ``pg`` then end the way they would on a
    cluster, with torch's own timeout error after ``pg_timeout`` (under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, with the names of the ranks that did not reach
    DETAIL's monitored barrier). ``pg`` stays up after ``fn`` returns, so that a rank
    that returned early does not close its connections under the others (they would
    then raise "Connection closed by peer" instead of timing out); the next call
    destroys it. Without ``pg_timeout``, ``fn(*args)`` runs on the default process group.

    Needs the flight recorder, which torch 2.13 keeps by default (2000 entries per rank;
    ``TORCH_FR_BUFFER_SIZE=0`` turns it off, and then ``entries`` stays empty). The dump is
    ``torch._C._distributed_c10d._dump_fr_trace()``, a private torch API (torch 2.13).
    """
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    rank = dist.get_rank()
    while _LAST_GROUP:  # the last call's group: every rank is here, none still uses it
        dist.destroy_process_group(_LAST_GROUP.pop())
    pg = dist.new_group(timeout=timedelta(seconds=pg_timeout)) if pg_timeout else None
    if pg is not None:
        _LAST_GROUP.append(pg)
    # Which process group the record's entries belong to: its flight-recorder id is not
    # its name (under DETAIL each group has a helper group too), so ask the recorder. A
    # barrier on the group is its newest barrier entry; fn's entries come after it.
    dist.barrier(group=pg)
    probe = [e for e in pickle.loads(_dump_fr_trace(includeStackTraces=False))["entries"]
             if e["profiling_name"].endswith(":barrier") and not e["is_p2p"]]
    pg_id, start = (probe[-1]["pg_id"], probe[-1]["record_id"]) if probe else (None, -1)
    lock = threading.Lock()

    def write(final: bool, result=None, raised=None) -> None:
        dump = pickle.loads(_dump_fr_trace(includeStackTraces=False))
        entries = [{"seq": e["collective_seq_id"],
                    "name": e["profiling_name"].split(":")[-1],
                    "sizes": e["input_sizes"], "retired": e["retired"]}
                   for e in dump.get("entries", [])
                   if e["pg_id"] == pg_id and not e["is_p2p"] and e["record_id"] > start]
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
        result = fn(*args, pg) if pg is not None else fn(*args)
    except BaseException as e:
        stop.set()
        thread.join()
        write(True, raised=f"{type(e).__name__}: {e}")
        raise
    stop.set()
    thread.join()
    write(True, result=result)
    return result


def step_batch(rank: int, step: int, bad=()) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at step ``step`` in notebook 11's exercise: ``(x, y)``,
    float32 tensors of shapes ``(4, 3)`` and ``(4, 1)``, ``y = x @ W_TRUE`` plus a little
    noise, seeded by ``(rank, step)``, so the same on every call.

    When ``(rank, step)`` is in ``bad`` (pairs of ints), the first label is ``inf``: a
    corrupt sample, standing in for what an fp16 overflow does to a step under
    ``torch.amp``. The loss is then ``inf`` and the gradient holds ``inf`` or ``nan``.
    """
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 3, generator=g)
    y = x @ W_TRUE + 0.1 * torch.randn(4, 1, generator=g)
    if (rank, step) in {tuple(b) for b in bad}:
        y[0, 0] = float("inf")
    return x, y


def reference(world_size: int, bad=(), steps: int = STEPS, lr: float = LR):
    """The exercise's training loop in one process, for ``world_size`` ranks' data.

    At each step every rank's gradient is computed on its :func:`step_batch`; if any of
    them holds an inf or a NaN, the step is skipped on every rank (no update), as
    ``torch.amp.GradScaler`` skips ``optimizer.step()``; otherwise one SGD step is taken
    with the gradient averaged over ranks (what ``all_reduce(grad, AVG)`` gives).

    Returns:
        ``(taken, weight, skipped)``: the steps taken (an ``int``), the final weight
        (float32, shape ``(1, 3)``) and the skipped steps (a ``list`` of ints).
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    taken, skipped = 0, []
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            x, y = step_batch(rank, step, bad)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        if not all(g.isfinite().all() for rank_grads in grads for g in rank_grads):
            skipped.append(step)
            continue
        for k, p in enumerate(model.parameters()):
            p.grad = torch.stack([rank_grads[k] for rank_grads in grads]).mean(0)
        opt.step()
        taken += 1
    return taken, model.weight.detach().clone(), skipped


# --- the exercise's check -----------------------------------------------------------------

def _place(summary: str) -> str:
    """``"in all_reduce (train line 16)"`` from a stuck rank's summary."""
    m = re.match(r"was waiting in (\w+), called from (.+)$", summary)
    if m:
        return f"in {m.group(1)} ({m.group(2)})"
    m = re.match(r"was still running, at (.+)$", summary)
    return f"in its own code ({m.group(1)})" if m else summary


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _where_bad(bad) -> str:
    return " and ".join(f"rank {r} at step {s}" for r, s in bad)


def _explain_hang(context: str, err: RankError, timeout: float) -> Verdict:
    returned = [r.rank for r in err.reports if r.state == "returned"]
    stuck = [r for r in err.reports if r.state == "stuck"]
    where = sorted({_place(r.summary) for r in stuck})
    text = (f"{context}, the loop hangs: {_ranks(r.rank for r in stuck)} waited "
            f"{'; '.join(where)} until the {timeout:g} s timeout")
    if returned:
        text += (f", while {_ranks(returned)} had already returned. A rank that skips a "
                 f"step alone also skips that step's all_reduces. Collectives are matched "
                 f"by their order, not by the line that calls them: from then on its "
                 f"all_reduces meet the others' all_reduces of the step before (the values "
                 f"are mixed silently), and at the end the others wait for all_reduces "
                 f"that never come. Every rank must skip the same steps, so the decision "
                 f"must rest on a value that is the same on every rank.")
    else:
        text += (". No rank returned: look for a collective that only some ranks call, or "
                 "that the ranks call in a different order.")
    return failed(text)


def first_step_on_new_ranks() -> bool:
    """One step of the exercise's kind on every rank, the first of new ranks' lives: a
    :func:`step_batch`, a backward, an all_reduce and an SGD step. Ranks started by a
    resize pay one-off costs in their first call (the notebook's cells sent to them,
    torch's first backward and collective): seconds on a loaded 2-core machine, where the
    learner's whole loop takes a tenth of a second. :func:`check_skip_together` runs this
    first, so that those costs do not count against the learner's loop (review 6, 11-5)."""
    import torch.distributed as dist
    model = torch.nn.Linear(3, 1)
    x, y = step_batch(dist.get_rank(), 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    dist.all_reduce(model.weight.grad, op=dist.ReduceOp.AVG)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return True


FIRST_USE_IMPORTS = ("torch._dynamo", "reducelab.checks.disagree")
"""What a new rank imports in the exercise's first step: ``optimizer.step()`` imports
``torch._dynamo`` on its first call (824 modules, sympy among them: 4 s in one process on
a loaded 2-core machine, review 6's 11-5), and the loop calls :func:`step_batch`.
:func:`check_skip_together` asks the ranks' forkserver for them before it resizes the
group, so the new ranks inherit them (a group's start waits for the server's imports off
its clock: :func:`reducelab.processes.warm`)."""


def settle(group, tries: int = 3) -> None:
    """Run :func:`first_step_on_new_ranks` on ``group`` until a call finishes within its
    timeout, at most ``tries`` times: a call that times out stops the ranks, and the next
    one starts new ranks within its own time, not within the learner's call."""
    for _ in range(tries):
        try:
            group.run(first_step_on_new_ranks)
            return
        except RankError:
            continue


def check_skip_together(group, fn, cases=CASES) -> Verdict:
    """Notebook 11's exercise: ``fn(bad, steps)`` trains for ``steps`` steps on
    :func:`step_batch` and, whenever **any** rank's gradient holds an inf or a NaN,
    skips that step **on every rank**; it returns ``(taken, weight)`` on every rank: the
    steps taken (an ``int``) and the final ``model.weight`` (shape ``(1, 3)``).

    Runs ``fn(bad, STEPS)`` on real ranks for each ``(world_size, bad)`` in ``cases``
    (the group is resized, then restored), each call bounded by the group's timeout,
    on ranks started with :data:`FIRST_USE_IMPORTS` and after :func:`settle` has run their
    first call, and compares with :func:`reference` (weights within :data:`ATOL`). A wrong answer
    gets an explanation of what its run shows: a hang (who returned, who waited where,
    and why), an error, ranks that disagree, a step taken with a non-finite gradient
    (every step taken, the bad gradient averaged in; or skipping only when every rank,
    or rank 0, is bad), no step skipped at all (the bad gradient replaced instead), the
    right steps skipped but counted wrong, or a wrong number of steps or weights.

    Returns:
        A :class:`~reducelab.checks.Verdict`.
    """
    from .. import processes                 # the kernel's side only: ranks never run this
    processes.ask_for_later(FIRST_USE_IMPORTS)
    with restoring_world_size(group):
        for ws, bad in cases:
            context = f"With world_size={ws} and a corrupt batch on {_where_bad(bad)}"
            group.resize(ws)
            settle(group)                    # new ranks' one-off costs, not on the loop's clock
            try:
                out = group.run(fn, bad, STEPS)
            except RankError as err:
                if any(r.state == "stuck" for r in err.reports) and \
                        not any(r.state in ("raised", "died") for r in err.reports):
                    return _explain_hang(context, err, group.timeout)
                return raised_on_ranks(f"{context},", err)
            shaped = all(isinstance(o, (tuple, list)) and len(o) == 2
                         and isinstance(o[1], torch.Tensor) for o in out)
            if not shaped:
                return failed(f"{context}, rank 0 returned {out[0]!r}; expected (taken, "
                              f"weight): the number of steps taken and model.weight.")
            taken = [int(o[0]) for o in out]
            weights = [o[1].detach().float().reshape(1, -1) for o in out]
            want_taken, want_weight, skipped = reference(ws, bad)
            want_weight = want_weight.reshape(1, -1)
            finite = [bool(w.isfinite().all()) for w in weights]
            if len(set(taken)) > 1:
                return failed(f"{context}, the ranks took different numbers of steps: "
                              f"{taken}. They must skip the same steps.")
            # The weights alone cannot say whether the ranks agreed: a rank that skips a
            # step alone after the all_reduce lets the others step with the averaged inf,
            # which the next all_reduce spreads to it (a fifth review, 11-1).
            alone = ("If a rank skipped alone after the all_reduce, the others stepped with "
                     "the averaged inf, and the next all_reduce spread it to every rank.")
            if not all(finite) and taken[0] == STEPS:
                return failed(f"{context}, every rank counts all {STEPS} steps and the weights "
                              f"hold inf or nan on "
                              f"{_ranks(r for r, ok in enumerate(finite) if not ok)}: a gradient "
                              f"that is not finite was averaged in and stepped. {alone} A step "
                              f"must be skipped on every rank, or on none.")
            if not all(finite):
                return failed(f"{context}, the weights hold inf or nan on "
                              f"{_ranks(r for r, ok in enumerate(finite) if not ok)}: some rank "
                              f"took a step with a gradient that is not finite. {alone} Or the "
                              f"ranks agreed on the wrong rule: skipping only when every "
                              f"rank's gradient is not finite, or rank 0's. A step must be "
                              f"skipped on every rank when any rank's gradient is not finite.")
            if any(not torch.allclose(w, weights[0], atol=ATOL) for w in weights):
                return failed(f"{context}, the ranks end with different weights: is every "
                              f"step they take still averaged over all ranks?")
            gap = (weights[0] - want_weight).abs().max().item()
            if taken[0] != want_taken and gap <= ATOL:
                return failed(f"{context}, the weights match the reference, so every rank "
                              f"skipped the right step{'s' if len(skipped) > 1 else ''} "
                              f"({', '.join(map(str, skipped))}), but every rank says it "
                              f"took {taken[0]} steps, not {want_taken}: count a step only "
                              f"when the optimizer really steps.")
            if taken[0] == STEPS:
                return failed(f"{context}, every rank took all {STEPS} steps and ends with "
                              f"finite weights, so no step was skipped: the corrupt "
                              f"gradient was replaced or left out, not skipped. The rule is "
                              f"to skip the whole step on every rank (here step"
                              f"{'s' if len(skipped) > 1 else ''} "
                              f"{', '.join(map(str, skipped))}), as GradScaler skips "
                              f"optimizer.step().")
            if taken[0] != want_taken:
                return failed(f"{context}, every rank took {taken[0]} steps, but skipping "
                              f"exactly the step{'s' if len(skipped) > 1 else ''} with a "
                              f"corrupt batch ({', '.join(map(str, skipped))}) takes "
                              f"{want_taken}.")
            if gap > ATOL:
                return failed(f"{context}, the ranks skipped the right steps but end with "
                              f"the weight {[round(v, 4) for v in weights[0].flatten().tolist()]}, "
                              f"not {[round(v, 4) for v in want_weight.flatten().tolist()]}: "
                              f"is the gradient of every step taken averaged over all ranks?")
        return passed(f"In every run ({'; '.join(f'world_size={ws}, corrupt batch on {_where_bad(bad)}' for ws, bad in cases)}) "
                      f"every rank skipped exactly the steps with a corrupt batch, and the "
                      f"weights match a single-process reference within {ATOL:g}. A "
                      f"decision around a collective must be taken the same way on every "
                      f"rank. Two ways do it: all-reduce first and test the averaged "
                      f"gradients (an inf on one rank is then an inf on all), or all-reduce "
                      f"a flag. Under DDP, GradScaler gets the first for free: it reads the "
                      f"gradients after DDP has averaged them. FSDP's ShardedGradScaler "
                      f"does the second: it all-reduces its found-inf flag "
                      f"(torch/distributed/fsdp/sharded_grad_scaler.py).")
