"""Errors that LocalGroup raises in the kernel.

Introduced in notebook 01. A ``RankError`` is what a learner sees when code on one or
more ranks fails, hangs or dies; it is written to be read in a notebook cell.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankReport:
    """What one rank reported, or what the kernel saw of it, when a run failed.

    Attributes:
        rank: the rank, in ``0 .. world_size - 1``.
        state: one of ``"raised"``, ``"died"``, ``"stuck"``, ``"returned"``.
        summary: one line, for example ``"ZeroDivisionError: division by zero"``,
            ``"was waiting in all_reduce"`` or ``"died: killed by SIGKILL"``.
        traceback: the remote traceback (``"raised"``) or the stack it was stopped in
            (``"stuck"``), as text; ``""`` if there is none.
        collective: the ``torch.distributed`` call the rank was inside, such as
            ``"all_reduce"``, or ``None``.
    """

    rank: int
    state: str
    summary: str
    traceback: str = ""
    collective: str | None = None


@dataclass
class _Details:
    headline: str
    reports: list[RankReport] = field(default_factory=list)
    hint: str = ""


class RankError(RuntimeError):
    """Code on one or more ranks failed, hung past the timeout, or a rank died.

    Raised in the kernel by :meth:`reducelab.LocalGroup.run` (and by starting a group).
    It is a ``RuntimeError``. The message names the rank(s); ``str(err)`` carries every
    remote traceback.

    Attributes:
        ranks: the ranks that raised, died or were stuck, in rank order.
        reports: one :class:`RankReport` per rank that has something to say.
        headline: the one-line summary, e.g. ``"rank 1 raised ZeroDivisionError in f"``.

    In IPython the error renders as the headline, the per-rank reports and the remote
    tracebacks, without the kernel-side frames of ``run()``, which help no learner.
    """

    def __init__(self, headline: str, reports: list[RankReport] | None = None, hint: str = ""):
        self.headline = headline
        self.reports = sorted(reports or [], key=lambda r: r.rank)
        self.hint = hint
        self.ranks = [r.rank for r in self.reports if r.state in ("raised", "died", "stuck")]
        super().__init__(self._text())

    @property
    def first_summary(self) -> str:
        """The first raising rank's one-line error (e.g. gloo's own words), else the headline."""
        return next((r.summary for r in self.reports if r.state == "raised"), self.headline)

    @property
    def tracebacks(self) -> dict[int, str]:
        """Remote traceback text by rank, for the ranks that have one."""
        return {r.rank: r.traceback for r in self.reports if r.traceback}

    def _text(self) -> str:
        lines = [self.headline]
        for r in self.reports:
            lines.append(f"  rank {r.rank}: {r.summary}")
        if self.hint:
            lines.append(self.hint)
        shown = set()
        for r in self.reports:
            if not r.traceback or r.traceback in shown:
                continue
            shown.add(r.traceback)
            what = "traceback" if r.state == "raised" else "where it was stopped"
            lines.append(f"\n--- rank {r.rank}, {what} ---\n{r.traceback.rstrip()}")
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:  # IPython hook: show this, not run()'s frames
        return [f"RankError: {self._text()}"]


class GroupClosedError(RuntimeError):
    """:meth:`reducelab.LocalGroup.run` or :meth:`~reducelab.LocalGroup.resize` was called
    after :meth:`~reducelab.LocalGroup.close`, or the group was closed (from another
    thread) while the call was in progress."""


class GroupBusyError(RuntimeError):
    """Another thread's call on the same :class:`~reducelab.LocalGroup` did not finish
    within the group's ``timeout``; nothing was run. One call runs at a time per group."""


listeners: list = []
"""Callables ``listener(event, **fields)`` told of events in the kernel; today one event,
``"timeout"`` (``seconds=``): a :meth:`reducelab.LocalGroup.run` call did not finish within
its timeout. :mod:`reducelab.workshop` listens while the kernel is in a workshop."""


def notify(event: str, **fields) -> None:
    """Tell every listener of ``event``; a listener that raises is ignored, so that
    telling never changes what the caller raises."""
    for listener in list(listeners):
        try:
            listener(event, **fields)
        except Exception:  # noqa: BLE001 - a listener never breaks a group call
            pass
