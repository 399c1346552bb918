"""What a rank says when something goes wrong: its traceback, and where it stands.

Introduced in notebook 01 (the learner's first remote traceback). This is the rank side
of the failure reports; the kernel words its :class:`~reducelab.RankError` from these
messages (:mod:`reducelab.reports`).

* :func:`describe_exception`: a one-line summary and the traceback of an exception that
  the learner's function raised, starting at that function (the frames of the rank's own
  machinery are cut), with the chained exceptions, and bounded in size;
* :func:`where` and :func:`stack_reply`: where a rank that did not finish in time was,
  asked by the kernel when the call's deadline passed: the ``torch.distributed``
  collective it was waiting in and the learner's line that called it, or what it was
  doing between calls.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LOOP_FILE = os.path.join(_PACKAGE_DIR, "rank_loop.py")  # its run_job() calls the learner's fn
_MACHINERY = {_LOOP_FILE, os.path.join(_PACKAGE_DIR, "rank_env.py"),
              os.path.abspath(__file__)}  # the rank's own code, never the learner's line
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DIST_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep

MAX_SUMMARY = 500
"""Characters of an exception's first line kept in the one-line summary."""
MAX_TRACEBACK = 20_000
"""Characters of one remote traceback kept (its head and its tail), whatever the message size."""


def _is_dist_frame(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_DIST_DIR)


def where(frames: list[traceback.FrameSummary]) -> tuple[str | None, str]:
    """Name the ``torch.distributed`` call and the user line in a list of frames.

    Returns ``(collective, summary)``, e.g. ``("all_reduce", "in all_reduce, called
    from my_fn line 4")``. ``collective`` is the outermost function defined in
    ``torch/distributed/distributed_c10d.py`` (the public collective) or ``None``.
    """
    collective = None
    for f in frames:
        if f.filename.endswith("distributed_c10d.py"):
            collective = f.name
            break
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
            and os.path.abspath(f.filename) not in _MACHINERY]
    at = f"{user[-1].name} line {user[-1].lineno}" if user else "fn"
    if collective:
        return collective, f"was waiting in {collective}, called from {at}"
    return None, f"was still running, at {at}"


_LAUNCHERS = ("exec_on_rank",)  # reducelab functions that only run the learner's code


def _after_launcher(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """Drop the frames of the rank's own machinery: everything up to the call of ``fn``
    in :meth:`reducelab.rank_loop._Rank.run_job` (and ``%%ranks``' own
    ``exec_on_rank``). Frames inside reducelab helpers that the learner's code called
    stay."""
    start = 0
    for i, f in enumerate(frames):
        if f.name == "run_job" and os.path.abspath(f.filename) == _LOOP_FILE:
            start = i + 1
    rest = frames[start:]
    while rest and rest[0].name in _LAUNCHERS and \
            os.path.abspath(rest[0].filename).startswith(_PACKAGE_DIR):
        rest = rest[1:]
    return rest


def cut(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and tail with a note."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return (f"{text[:half]}\n[... {len(text) - 2 * half:,} characters cut ...]\n"
            f"{text[-half:]}")


def safe_str(obj) -> str:
    """``str(obj)``, or a note saying why it could not be made (a learner's ``__str__`` may raise)."""
    try:
        return str(obj)
    except BaseException as e:  # noqa: BLE001 - any failure of user code becomes text
        return f"<str() of this {type(obj).__name__} raised {type(e).__name__}>"


def _trim(te: traceback.TracebackException, seen: set) -> None:
    """Cut the launcher frames from ``te`` and from the exceptions chained to it."""
    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list(_after_launcher(list(te.stack)))
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _trim(chained, seen)


def describe_exception(error: BaseException) -> tuple[str, str, bool]:
    """``(summary, traceback_text, in_distributed)`` for an exception raised by ``fn``.

    The traceback starts at ``fn`` and keeps the chained exceptions (``raise ... from``
    and errors during handling), as Python prints them. Safe against exceptions whose
    ``__str__`` raises, and bounded: the summary to :data:`MAX_SUMMARY`, the traceback to
    :data:`MAX_TRACEBACK` characters.
    """
    frames = _after_launcher(traceback.extract_tb(error.__traceback__))
    try:
        te = traceback.TracebackException.from_exception(error)
        _trim(te, set())
        text = "".join(te.format())
    except BaseException:  # noqa: BLE001 - fall back to the frames alone
        text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) \
            + f"{type(error).__name__}: {safe_str(error)}\n"
    first = safe_str(error).strip().splitlines()
    name = type(error).__name__
    summary = cut(f"{name}: {first[0]}" if first else name, MAX_SUMMARY)
    in_dist = any(_is_dist_frame(f.filename) for f in frames)
    return summary, cut(text, MAX_TRACEBACK), in_dist


def stack_reply(phase: str, sending: int, texts: tuple[str, str], main_ident: int) -> dict:
    """The ``stack`` message: where the rank's main thread (``main_ident``) stands.

    Args:
        phase: ``"idle"``, ``"loading"``, ``"joining"``, ``"running"`` or ``"pickling"``.
        sending: bytes of a return value sent so far (0 when not sending).
        texts: ``(stdout, stderr)`` that the call in progress has printed.
    """
    out, err = texts
    reply = {"kind": "stack", "traceback": "", "collective": None, "out": out, "err": err}
    if sending:
        return {**reply, "summary": f"was sending its return value "
                                    f"({sending / 1e6:.0f} MB)"}
    if phase not in ("running", "pickling"):
        return {**reply, "summary": {
            "idle": "was between calls (had not received fn)",
            "loading": "was still loading fn (unpickling it, importing its modules)",
            "joining": "was joining a fresh default process group (the last call "
                       "destroyed it)",
        }.get(phase, f"was {phase}")}
    frame = sys._current_frames().get(main_ident)
    frames = _after_launcher(traceback.extract_stack(frame)) if frame else []
    collective, summary = where(frames)
    if phase == "pickling":
        summary = "fn returned; its return value was still being pickled" + \
            summary.partition("was still running")[2]
    return {**reply, "traceback": "".join(traceback.format_list(frames)),
            "collective": collective, "summary": summary}
