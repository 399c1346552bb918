"""Failure reports: what :class:`~reducelab.LocalGroup` says when ranks fail, hang or die.

Introduced in notebook 01 (the learner's first ``RankError``). This module is the kernel
side of the failure reports: every :class:`~reducelab.RankError` that ``LocalGroup``
raises is worded here, from what the ranks sent back (gathered by
:mod:`reducelab.dispatch`), and so are the notes it prints when ranks restart. It starts,
stops and waits for nothing: the caller decides, and stops the ranks when a report says
they restart.

* :func:`describe_exit`, :func:`describe_start_death`: how a rank ended, in words
  (``"died: killed by SIGKILL"``);
* :func:`start_failure`: ranks that could not start or join the process group;
* :func:`run_failure`: a ``run()`` in which a rank raised, died or did not finish in
  time; the headline says what happened, the hint whether fresh ranks start;
* :func:`unloadable`: return values the kernel could not unpickle;
* :func:`idle_deaths`, :func:`interrupted`, :func:`destroyed_on_some`: the notes
  printed to stderr when ranks restart for a reason no exception tells.

The rank side (a remote traceback from the learner's function on, where a stuck rank
was waiting) is :mod:`reducelab.rank_reports`; the exception classes and how a
``RankError`` prints are in :mod:`reducelab.errors`.
"""
from __future__ import annotations

import re
import signal

from .errors import RankError, RankReport, notify


def describe_exit(code: int | None) -> str:
    """How a rank process ended, from its exit code (``multiprocessing``'s ``exitcode``:
    negative for a signal, ``None`` if unknown), e.g. ``"died: killed by SIGKILL"``."""
    if code is None:
        return "died"
    if code < 0:
        try:
            return f"died: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"died: killed by signal {-code}"
    return f"died: exited with code {code} without returning"


def describe_start_death(code: int | None, booted: bool) -> str:
    """How a rank ended while the group started: after its imports (``booted``), while
    joining the process group, or before, when what it printed went to the terminal."""
    if booted:
        return f"{describe_exit(code)} while joining the process group"
    return (f"{describe_exit(code)} before its imports were done; anything it printed "
            f"went to the terminal that started this kernel")


def error_kind(summary: str) -> str:
    """``"ValueError"`` from ``"ValueError: bad"``; ``"an error"`` for a sentence."""
    head = summary.split(":")[0]
    return head if re.fullmatch(r"[A-Za-z_][\w.]*", head) else "an error"


def start_failure(world_size: int, backend: str, timeout: float, boot_limit: float,
                  errors: dict[int, dict], died: dict[int, int | None], pending: set[int],
                  unbooted: set[int], booted: set[int]) -> RankError:
    """The error of a start in which some ranks did not join the process group.

    Args:
        world_size, backend, timeout: the group's (``timeout`` in seconds).
        boot_limit: seconds a rank had to finish its imports (``BOOT_LIMIT``).
        errors: the ``error`` messages of the ranks that raised, by rank.
        died: exit codes of the ranks that died, by rank.
        pending: ranks that had not answered when the time was up.
        unbooted: those of ``pending`` whose imports were not done.
        booted: ranks whose imports were done.
    """
    reports = [RankReport(r, "raised", m["summary"], m["traceback"])
               for r, m in errors.items()]
    reports += [RankReport(r, "died", describe_start_death(c, r in booted))
                for r, c in died.items()]
    reports += [RankReport(r, "stuck", f"did not finish importing torch within "
                                       f"{boot_limit:g} s" if r in unbooted else
                                       f"did not join within {timeout:g} s")
                for r in pending]
    return RankError(f"the {world_size} ranks could not start a {backend} process group",
                     reports)


def the_same_refusal(replies: dict[int, dict], world_size: int) -> bool:
    """Whether every one of the ``world_size`` ranks raised the same error (the same
    summary) having issued the same number of collectives on its default process group
    (``collectives``), which is still up: what torch's argument checks do, such as
    gloo's "Cannot use ReduceOp.BAND with non-integral dtype", raised on each rank
    before any data moves. The ranks are then still in step, and are kept: the next call
    needs no fresh ranks, which cost a move of notebook 01's explorer about 0.1 s on 2
    cores (stopping the failed ranks, then starting new ones). A rank that raised
    something else, or is a collective ahead, restarts them all. Only the default group
    is counted: a subgroup that a rank function keeps in a global across calls, with one
    rank a collective ahead in it, shows as a timeout in its next collective there (with
    where each rank waited), after which the ranks restart."""
    if len(replies) != world_size or not all(m["kind"] == "error" for m in replies.values()):
        return False
    counts = {m.get("collectives") for m in replies.values()}
    return None not in counts and len(counts) == 1 and \
        len({m["summary"] for m in replies.values()}) == 1 and \
        all(m.get("pg", True) for m in replies.values())


def run_failure(name: str, world_size: int, timeout: float, replies: dict[int, dict],
                died: dict[int, int | None], pending: set[int], stacks: dict[int, dict],
                returned: dict[int, float]) -> tuple[RankError, bool]:
    """The error of a failed ``run()``, and whether the ranks must restart.

    The headline says what happened first: a death, then the exceptions raised (named by
    type), then a timeout (and whether the stuck ranks were in different collectives).
    The ranks restart when one died or is stuck, when an error came from inside
    ``torch.distributed`` (unless it was :func:`the_same_refusal` on every rank), or when
    a failed call left a rank without its default process group; the hint then says so,
    and the caller stops them.

    Args:
        name: the function's name, as the learner wrote it.
        world_size, timeout: the group's (``timeout`` in seconds).
        replies: the ``done`` and ``error`` messages, by rank.
        died: exit codes of the ranks that died, by rank.
        pending: ranks that had not answered.
        stacks: where each of ``pending`` was, the ``stack`` messages by rank.
        returned: ranks whose ``fn`` had returned (their value was on its way).

    Returns:
        ``(error, restart)``.
    """
    reports = []
    restart = bool(died or pending)
    refusal = the_same_refusal(replies, world_size)
    for r, m in replies.items():
        if m["kind"] == "error":
            reports.append(RankReport(r, "raised", m["summary"], m["traceback"]))
            restart = restart or (m["in_distributed"] and not refusal) or not m.get("pg", True)
        else:
            reports.append(RankReport(r, "returned", f"{name} returned"))
    for r, code in died.items():
        reports.append(RankReport(r, "died", describe_exit(code)))
    for r in pending:
        if r in stacks:
            m = stacks[r]
            reports.append(RankReport(r, "stuck", m["summary"], m["traceback"],
                                      m["collective"]))
        elif r in returned:
            reports.append(RankReport(r, "stuck", f"{name} returned; its return value was "
                                                  f"still being pickled or sent"))
        else:
            reports.append(RankReport(r, "stuck", "was still running"))
    raised = sorted(r for r, m in replies.items() if m["kind"] == "error")
    if died:
        r = min(died)
        headline = f"rank {r} {describe_exit(died[r])} during {name}"
    elif raised:
        kinds = sorted({error_kind(replies[r]["summary"]) for r in raised})
        who = f"rank {raised[0]}" if len(raised) == 1 else \
            f"ranks {', '.join(map(str, raised))}"
        named = [k for k in kinds if k != "an error"]
        verb = f"raised {' / '.join(named)}" if named else "failed"
        headline = f"{who} {verb} in {name}"
    else:
        collectives = {r: stacks[r]["collective"] for r in pending if r in stacks}
        notify("timeout", seconds=timeout)  # a workshop's dashboard shows it
        headline = (f"{name} did not finish within {timeout:g} s on "
                    f"rank{'s' if len(pending) > 1 else ''} "
                    f"{', '.join(map(str, sorted(pending)))}")
        in_collective = {c for c in collectives.values() if c}
        if in_collective and (len(set(collectives.values())) > 1 or any(
                m["kind"] == "done" for m in replies.values())):
            headline += ": the ranks are not in the same collective"
    hint = ""
    if restart:
        hint = (f"The ranks were stopped; {world_size} fresh ranks start at the "
                f"next run().")
    return RankError(headline, reports, hint), restart


def unloadable(name: str, errors: dict[int, BaseException]) -> RankError:
    """The error of a ``run()`` whose return values arrived but could not be unpickled
    in the kernel (``errors``: what unpickling raised, by rank)."""
    return RankError(f"{name} returned a value the kernel cannot load", [
        RankReport(r, "raised", "its return value could not be unpickled in the kernel: "
                                f"{type(e).__name__}: {e}")
        for r, e in errors.items()])


def idle_deaths(dead: dict[int, int | None], world_size: int) -> str:
    """The note printed when ranks died between calls (exit codes by rank)."""
    return (f"Note: {'; '.join(f'rank {r} {describe_exit(c)}' for r, c in dead.items())}"
            f" while idle; starting {world_size} fresh ranks.")


def interrupted(world_size: int) -> str:
    """The note printed when the kernel was interrupted during a ``run()``."""
    return (f"Interrupted: the {world_size} ranks were stopped; they restart "
            f"at the next run().")


def destroyed_on_some(name: str, down: list[int], world_size: int) -> str:
    """The note printed when ``name`` destroyed the default process group on the ranks
    ``down`` only (the others still have theirs)."""
    return (f"Note: {name} destroyed the default process group on "
            f"rank{'s' if len(down) > 1 else ''} {', '.join(map(str, down))} only; "
            f"{world_size} fresh ranks start at the next run().")
