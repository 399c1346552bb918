"""The "when ranks disagree" explorer of notebook 11, and the flight recording it is built on.

:func:`run_recorded` runs a rank function on every rank of a
:class:`~reducelab.LocalGroup` while each rank writes its **flight record** (torch's
record of the collectives it entered, ``torch._C._distributed_c10d._dump_fr_trace()``)
to a file every ``every`` seconds and once more when the function returns or raises. The
kernel reads the files after the call, also after a hang or a death, when the ranks'
memory is gone: the same thing NCCL's watchdog does when a collective times out, which
gloo does not do in torch 2.13 (notebook 11, step 3). The recorder is on by default in
torch 2.13 (2000 entries per rank); ``env={"TORCH_FR_BUFFER_SIZE": "2000"}`` says so
explicitly, and ``"0"`` turns it off.

:class:`DisagreeExplorer` injects one failure into a short training step (none, a
skipped collective, a shape mismatch, an op mismatch, a dead rank, uneven batches) on
one rank, with ``TORCH_DISTRIBUTED_DEBUG`` ``OFF`` or ``DETAIL``, and draws each rank's
collectives and where it stopped (:func:`reducelab.plots.disagree.timeline_figure`). The
step runs on a process group with a short timeout (1 s in notebook 11), so that each
failure ends as it would on a cluster, with torch's own error, which the message quotes.

Sources: the flight recorder, https://pytorch.org/tutorials/prototype/flight_recorder_tutorial.html
(``TORCH_FR_BUFFER_SIZE``; dump format version ``"2.10"`` in torch 2.13);
``TORCH_DISTRIBUTED_DEBUG``,
https://pytorch.org/docs/stable/distributed.html#torch-distributed-debug
"""
from __future__ import annotations

import functools
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import ipywidgets as W

from ..checks.disagree import record_on_rank
from ..errors import RankError
from ..group import LocalGroup, current_group
from ..plots import fmt_value
from ..plots.disagree import (TimelineEntry, TimelineRow, clean_summary, fingerprint,
                              full_message, timeline_figure, torch_words)
from . import Explorer

FAILURES = ("none", "skipped collective", "shape mismatch", "op mismatch", "dead rank",
            "uneven batches")
"""The failures the explorer injects, by the names its rank function receives."""
DEBUG_LEVELS = ("OFF", "DETAIL")
"""``TORCH_DISTRIBUTED_DEBUG`` levels the explorer offers (one group each)."""
WRONG_VALUE = "≠ wrong value"
"""How a figure row starts for a rank that returned a value other than the right one
(``✓ returned`` is kept for a right value)."""

_NAMES = {"ALLREDUCE": "all_reduce", "BROADCAST": "broadcast", "ALLGATHER": "all_gather",
          "REDUCE": "reduce", "GATHER": "gather", "SCATTER": "scatter", "BARRIER": "barrier",
          "REDUCE_SCATTER": "reduce_scatter", "ALLTOALL": "all_to_all"}


# --- in the kernel ---------------------------------------------------------------------

@dataclass
class RankRecord:
    """What one rank's flight-record file said.

    Attributes:
        rank: the rank.
        entries: ``[{"seq", "name", "sizes", "retired"}, ...]``, the collectives it
            entered during the call, in order.
        result: ``fn``'s return value, if it returned (else ``None``).
        raised: its exception as text, if it raised (else ``None``).
        final: ``True`` when written as ``fn`` ended, ``False`` for a periodic write.
    """

    rank: int
    entries: list = field(default_factory=list)
    result: object = None
    raised: str | None = None
    final: bool = False


@dataclass
class RecordedRun:
    """One call of :func:`run_recorded`.

    Attributes:
        world_size: number of ranks.
        values: the return values by rank, or ``None`` if the call failed.
        error: the :class:`~reducelab.RankError`, or ``None``.
        records: one :class:`RankRecord` (or ``None``: no file) per rank.
        timeout: the group's timeout, seconds.
    """

    world_size: int
    values: list | None
    error: RankError | None
    records: list
    timeout: float

    def state(self, rank: int) -> str:
        """``"returned"``, ``"stuck"``, ``"raised"`` or ``"died"``."""
        if self.error is None:
            return "returned"
        for r in self.error.reports:
            if r.rank == rank:
                return r.state
        return "returned"

    def report(self, rank: int):
        """The :class:`~reducelab.RankReport` of ``rank``, or ``None``."""
        if self.error is None:
            return None
        return next((r for r in self.error.reports if r.rank == rank), None)

    def value(self, rank: int):
        """What ``rank`` returned (also when other ranks failed), else ``None``."""
        if self.values is not None:
            return self.values[rank]
        rec = self.records[rank]
        return rec.result if rec is not None and self.state(rank) == "returned" else None

    def ranks_in(self, state: str) -> list[int]:
        return [r for r in range(self.world_size) if self.state(r) == state]


def run_recorded(group: LocalGroup, fn, *args, every: float = 0.1,
                 pg_timeout: float | None = None) -> RecordedRun:
    """Run ``fn(*args)`` on every rank of ``group`` while each rank keeps its flight
    record on disk (:func:`record_on_rank`); never raises :class:`~reducelab.RankError`:
    a failure is in the result.

    With ``pg_timeout`` (seconds), each rank first makes a process group with that
    timeout and calls ``fn(*args, pg)`` (see :func:`record_on_rank`).

    Returns a :class:`RecordedRun` within the group's timeout plus
    :data:`reducelab.group.MARGIN` seconds. The files live in a private temporary
    directory, removed before returning.
    """
    folder = tempfile.mkdtemp(prefix="reducelab-record-")
    call = functools.partial(record_on_rank, fn, folder, every, pg_timeout=pg_timeout)
    call.__name__ = getattr(fn, "__name__", "fn")  # headlines name fn, not the wrapper
    try:
        try:
            values, error = group.run(call, *args), None
        except RankError as err:
            values, error = None, err
        records = []
        for rank in range(group.world_size):
            try:
                with open(os.path.join(folder, f"rank_{rank}"), "rb") as f:
                    records.append(RankRecord(**pickle.load(f)))
            except (OSError, EOFError, pickle.UnpicklingError, TypeError):
                records.append(None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return RecordedRun(group.world_size, values, error, records, group.timeout)


def _shape(sizes) -> str:
    return f"[{', '.join(map(str, sizes[0]))}]" if sizes else ""


def _where(summary: str) -> str:
    """``"train_step line 14"`` from ``"was waiting in all_reduce, called from train_step line 14"``."""
    m = re.search(r"(?:called from|at) (.+ line \d+)$", summary)
    return m.group(1) if m else ""


def _collective_in(traceback: str) -> str | None:
    """The public ``torch.distributed`` call a raised rank's traceback went through."""
    m = re.search(r'distributed_c10d\.py", line \d+, in (\w+)', traceback or "")
    return m.group(1) if m else None


def short_words(message: str) -> str:
    """A few words for a figure row, from torch's message (the full text is in the
    explorer's message line): who DETAIL's monitored barrier names, a timeout, a lost
    connection; else the message's first clause, cut to 44 characters."""
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    if m:
        ranks = m.group(1).strip()
        return f"rank{'s' if ',' in ranks else ''} {ranks} missed the barrier"
    if "successfully reached monitoredBarrier" in message:
        return "says: check rank 0 logs"
    m = re.search(r"Timed out waiting (\d+)ms for (\w+)", message)
    if m:
        return f"timed out ({m.group(1)} ms, {m.group(2)})"
    if re.search(r"Connection (closed|reset)", message):
        return "lost the connection to a peer"
    return _short(clean_summary(message).partition(": ")[2])


def timeline_rows(run: RecordedRun, expected=None) -> list[TimelineRow]:
    """One :class:`~reducelab.plots.disagree.TimelineRow` per rank of ``run``: the
    collectives it entered (from its flight record) and how it ended (from the
    :class:`~reducelab.RankError`'s report, which is authoritative: a rank that
    returned finished every collective it entered, even if its record had not yet
    marked the last one retired). A returned value other than ``expected`` (what every
    rank returns with no failure) gets :data:`WRONG_VALUE` instead of ``✓ returned``.
    A rank that raised in DETAIL's checks (the monitored barrier or the fingerprint
    comparison, which run before the collective is recorded) gets a box for the
    collective it was entering."""
    rows = []
    for rank in range(run.world_size):
        rec, state, report = run.records[rank], run.state(rank), run.report(rank)
        row = TimelineRow(rank)
        message = full_message(report) if state == "raised" else ""
        in_collective = state == "raised" and "distributed_c10d" in (report.traceback or "")
        in_barrier = "monitoredBarrier" in message
        for k, e in enumerate(rec.entries if rec else []):
            last = k == len(rec.entries) - 1
            status = "done"
            if state != "returned" and not e["retired"]:
                status = "waiting" if state == "stuck" else "failed"
            elif in_collective and last and not fingerprint(message) and not in_barrier:
                status = "failed"  # it raised inside this one (gloo retires failed work too)
            row.entries.append(TimelineEntry(e["name"], _shape(e["sizes"]), status))
        if state == "returned":
            value = run.value(rank)
            if expected is not None and value is not None and value != expected:
                # a mark and a word of its own: ✓ would call a wrong value right
                row.outcome = f"{WRONG_VALUE} {_fmt(value)} (should be {_fmt(expected)})"
            else:
                row.outcome = f"✓ returned {_fmt(value)}"
        elif state == "stuck":
            waiting = [k + 1 for k, e in enumerate(row.entries) if e.status == "waiting"]
            if report.collective and not waiting:
                # with DETAIL the rank waits in the fingerprint check, before the
                # collective itself is recorded: draw where LocalGroup saw it wait
                row.entries.append(TimelineEntry(report.collective, "", "waiting"))
                waiting = [len(row.entries)]
            row.outcome = (f"✗ stuck in {report.collective} #{waiting[-1]}" if report.collective
                           else "✗ stuck outside a collective")
            row.detail = f"at {_where(report.summary)}" if _where(report.summary) else ""
        elif state == "died":
            row.outcome = f"✕ {report.summary}"
            if rec is None:
                row.note = "no flight record: the rank died before it wrote one"
        else:  # raised
            fp = fingerprint(message)
            if fp is not None:
                row.entries.append(TimelineEntry(_NAMES.get(fp.ops[0], fp.ops[0].lower()),
                                                 f"[{fp.shapes[0]}]" if fp.shapes[0] else "",
                                                 "refused"))
                row.outcome = "⚠ refused by DETAIL"
                row.detail = fp.differ
            else:
                if in_barrier and _collective_in(report.traceback):
                    row.entries.append(TimelineEntry(_collective_in(report.traceback), "",
                                                     "failed"))
                row.outcome = f"⚠ raised {message.split(':')[0]}"
                row.detail = short_words(message)
        if rec is None and not row.note and state != "returned":
            row.note = "no flight record"
        rows.append(row)
    return rows


def _short(text: str, limit: int = 44) -> str:
    text = text.split(". ")[0]
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _fmt(value) -> str:
    if isinstance(value, (int, float)):
        return fmt_value(value)
    return "" if value is None else str(value)


# --- the explorer ----------------------------------------------------------------------

def _debug_of(group: LocalGroup) -> str:
    return "DETAIL" if group.env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" else "OFF"


def _open_group(debug: str) -> LocalGroup | None:
    """An open LocalGroup of this kernel with ``TORCH_DISTRIBUTED_DEBUG`` at ``debug``
    (after the learner ran the setup cell again): the kernel's newest group if it fits,
    else the one whose ranks started last (:attr:`~reducelab.LocalGroup.started`; not the
    highest process ids, since a start may take spares forked earlier)."""
    from ..group import _LIVE
    newest = current_group()
    if newest is not None and _debug_of(newest) == debug:
        return newest
    fits = [g for g in list(_LIVE) if g.state != "closed" and _debug_of(g) == debug]
    return max(fits, key=lambda g: g.started, default=None)


@dataclass
class DisagreeResult:
    """One refresh of :class:`DisagreeExplorer`.

    Attributes:
        failure, rank, debug: the settings (``rank`` is the rank the failure hits).
        run: the :class:`RecordedRun`.
        expected: what every rank returns with no failure (``None`` if unknown).
    """

    failure: str
    rank: int
    debug: str
    run: RecordedRun
    expected: float | None = None

    @property
    def rows(self) -> list[TimelineRow]:
        return timeline_rows(self.run, self.expected)


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def lesson(failure: str, run: RecordedRun) -> str:
    """One or two sentences on what ``run`` shows for ``failure``; only what the run
    itself showed is said."""
    raised = run.ranks_in("raised")
    messages = {r: full_message(run.report(r)) for r in raised}
    refused = [r for r in raised if fingerprint(messages[r])]
    named = [r for r in raised if "failed to pass monitoredBarrier" in messages[r]]
    blame_0 = [r for r in raised if "successfully reached monitoredBarrier" in messages[r]]
    timed_out = [r for r in raised if "Timed out waiting" in messages[r]]
    if failure == "none":
        return "Every rank entered the same collectives in the same order."
    if failure == "op mismatch":
        return ("No error and no hang: the ReduceOp is not in the flight record, nor in "
                "DETAIL's fingerprint, so nothing flags the mismatch; only the values are wrong.")
    if failure == "dead rank" and run.ranks_in("died"):
        written = [r for r in run.ranks_in("died") if run.records[r] is not None]
        left = (", only the flight record it wrote before it died" if written
                else " and no flight record of its own")
        return (f"The dead rank left no error{left}; the others raised when gloo saw the "
                f"connection close or their wait time out.")
    if refused:
        return ("DETAIL compared every rank's fingerprint (collective, shapes, dtypes) "
                "before running the collective and refused it on every rank.")
    if named:
        return ("DETAIL's monitored barrier runs before each collective: rank 0 waited the "
                "process group's timeout for every rank, then named the ones that never came.")
    if blame_0:
        return ("Rank 0 runs DETAIL's monitored barrier, and rank 0 is the one that skipped: "
                "the others can only point at rank 0's logs.")
    if timed_out:
        return ("Plain gloo only says that a wait timed out, not which rank is missing; "
                "some ranks may even return, with wrong values. Try DETAIL.")
    return ""


_PRIORITY = (("failed to pass monitoredBarrier", "Detected mismatch"),
             ("successfully reached monitoredBarrier",), ("Timed out waiting",))
"""Which error text to quote first: one that names ranks or a mismatch, then one that
points at rank 0, then a timeout; a lost connection (what a rank says once another rank
has given up, which rank sees it depends on timing) comes last."""


def _priority(words: str) -> int:
    return next((k for k, keys in enumerate(_PRIORITY) if any(w in words for w in keys)),
                len(_PRIORITY))


def quoted_words(run: RecordedRun) -> str:
    """The error text to quote for ``run``, word for word on one line (see
    :func:`~reducelab.plots.disagree.torch_words`): of the ranks that raised, the most
    telling message (:data:`_PRIORITY`), then the one most of them share, then the
    lowest rank's. ``""`` when no rank raised."""
    texts = {}
    for r in run.ranks_in("raised"):
        words = " ".join(line.strip() for line in torch_words(run.report(r)).splitlines()
                         if line.strip())
        texts.setdefault(re.sub(r"\bRank \d+\b", "Rank N", words), []).append((r, words))
    if not texts:
        return ""
    best = min(texts.values(), key=lambda ranks: (_priority(ranks[0][1]), -len(ranks),
                                                  ranks[0][0]))
    return best[0][1]


class DisagreeExplorer(Explorer):
    """Widget: inject a failure into ``fn`` on one rank and show each rank's collectives.

    Args:
        group: a :class:`~reducelab.LocalGroup` with the flight recorder on (torch's
            default; notebook 11 passes ``env={"TORCH_FR_BUFFER_SIZE": "2000"}``) and
            ``TORCH_DISTRIBUTED_DEBUG`` unset: the ``OFF`` level. Its ``timeout`` (seconds) is how long a hang takes
            to report; notebook 11 uses 2.
        fn: the notebook's rank function, called on every rank as
            ``fn(failure, hit, pg)`` with ``failure`` from :data:`FAILURES`, ``hit`` the
            rank it hits and ``pg`` a process group made for the call with a timeout of
            ``pg_timeout``; it runs its collectives on ``pg`` and returns a number (the
            same on every rank when nothing fails).
        detail_group: the same with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in its ``env``:
            the ``DETAIL`` level.
        failure, rank, debug: initial control values.
        pg_timeout: seconds (``float``) after which a collective on ``pg`` raises torch's
            own timeout error (and, under DETAIL, the monitored barrier names the ranks
            that did not arrive); below both groups' ``timeout``, so torch speaks before
            LocalGroup stops the ranks. Notebook 11 uses 1.

    Raises:
        ValueError: an initial value outside the choices, ``detail_group`` not started
            with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or ``pg_timeout`` not below the
            groups' timeout.

    Every control change runs ``fn`` on real ranks. A failure that waits takes
    ``pg_timeout`` to report, then the ranks restart at the next refresh. The message
    line quotes torch's own error text of one rank beside the explorer's summary.
    """

    def __init__(self, group: LocalGroup, fn, detail_group: LocalGroup,
                 failure: str = "uneven batches", rank: int = 2, debug: str = "OFF",
                 pg_timeout: float = 1.0):
        if failure not in FAILURES:
            raise ValueError(f"failure must be one of {', '.join(FAILURES)}; got {failure!r}")
        if debug not in DEBUG_LEVELS:
            raise ValueError(f"debug must be one of {', '.join(DEBUG_LEVELS)}; got {debug!r}")
        if _debug_of(detail_group) != "DETAIL":
            raise ValueError("detail_group must be a LocalGroup started with "
                             "env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL', ...}")
        slowest = min(group.timeout, detail_group.timeout)
        if isinstance(pg_timeout, bool) or not isinstance(pg_timeout, (int, float)) \
                or not 0 < pg_timeout < slowest:
            raise ValueError(f"pg_timeout must be a number of seconds above 0 and below the "
                             f"groups' timeout ({slowest:g} s), so that torch's own timeout "
                             f"fires before LocalGroup stops the ranks; got {pg_timeout!r}")
        self.pg_timeout = float(pg_timeout)
        self.world_size = group.world_size
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int from 0 to {self.world_size - 1}; got {rank!r}")
        self.group, self.fn = group, fn
        self._groups = {"OFF": group, "DETAIL": detail_group}
        self.expected = None
        super().__init__({
            "failure": W.Dropdown(options=FAILURES, value=failure, description="failure"),
            "rank": W.Dropdown(options=list(range(self.world_size)), value=rank,
                               description="rank it hits",
                               style={"description_width": "initial"},
                               layout=W.Layout(width="150px")),
            "debug": W.ToggleButtons(options=DEBUG_LEVELS, value=debug,
                                     description="TORCH_DISTRIBUTED_DEBUG",
                                     style={"description_width": "initial",
                                            "button_width": "70px"}),
        })
        self.note = W.HTML(
            f"<small>Each change runs the step on {self.world_size} real ranks, on a process "
            f"group whose timeout is {self.pg_timeout:g} s (<code>pg</code>): a rank that "
            f"waits in vain raises torch's own timeout error after {self.pg_timeout:g} s, as "
            f"on a cluster after the default timeout (30 minutes with gloo, 10 with "
            f"NCCL).</small>")
        self.box = W.VBox([self.box.children[0], self.note, *self.box.children[1:]])
        self.refresh()

    def group_for(self, debug: str) -> LocalGroup:
        """The group of ``debug`` (``"OFF"`` or ``"DETAIL"``); once it is closed, an open
        one of this kernel at the same level (the learner ran the setup cell again)."""
        g = self._groups[debug]
        if g.state == "closed":
            newer = _open_group(debug)
            if newer is not None:
                self._groups[debug] = g = newer
                if debug == "OFF":
                    self.group = newer
        return g

    def compute(self, failure, rank, debug) -> DisagreeResult:
        g = self.group_for(debug)
        g.resize(self.world_size)  # a no-op unless someone resized it
        if g.state != "idle":
            # ranks stopped by the last failure restart here, not inside the call below,
            # whose whole time is left for torch's pg_timeout to fire
            g.run(int)
        if self.expected is None and failure != "none":
            clean = run_recorded(g, self.fn, "none", rank, pg_timeout=self.pg_timeout)
            if clean.values is not None:
                self.expected = clean.values[0]
        run = run_recorded(g, self.fn, failure, rank, pg_timeout=self.pg_timeout)
        if failure == "none" and run.values is not None:
            self.expected = run.values[0]
        return DisagreeResult(failure, rank, debug, run, self.expected)

    def draw(self, result: DisagreeResult) -> bytes:
        title = (f"{result.failure} on rank {result.rank} · TORCH_DISTRIBUTED_DEBUG="
                 f"{result.debug} · timeout {self.pg_timeout:g} s"
                 if result.failure != "none" else
                 f"no failure (rank {result.rank} would be hit) · "
                 f"TORCH_DISTRIBUTED_DEBUG={result.debug}")
        return timeline_figure(result.rows, title,
                               hit=result.rank if result.failure != "none" else None)

    def describe(self, result: DisagreeResult) -> str:
        run = result.run
        parts = []
        returned = run.ranks_in("returned")
        if run.error is None:
            values = sorted({_fmt(v) for v in run.values})
            parts.append(f"every rank returned {' / '.join(values)}")
        elif returned:
            values = ", ".join(_fmt(run.value(r)) for r in returned)
            parts.append(f"{_ranks(returned)} returned {values}")
        wrong = [r for r in returned if result.expected is not None
                 and run.value(r) is not None and run.value(r) != result.expected]
        if wrong:
            parts[-1] += f", but the right value is {_fmt(result.expected)}"
        died = run.ranks_in("died")
        stuck = run.ranks_in("stuck")
        if stuck:
            where = sorted({run.report(r).collective or "their own code" for r in stuck})
            when = (f"when LocalGroup stopped {'it' if len(stuck) == 1 else 'them'}" if died else
                    f"when the {run.timeout:g} s timeout hit")
            parts.append(f"{_ranks(stuck)} still waited in {', '.join(where)} {when}")
        if died:
            parts.append(f"{_ranks(died)} died")
        raised = run.ranks_in("raised")
        if raised:
            refused = [r for r in raised if fingerprint(full_message(run.report(r)) or "")]
            if refused:
                fp = fingerprint(full_message(run.report(refused[0])))
                parts.append(f"{_ranks(refused)} raised: DETAIL names the mismatch "
                             f"({fp.differ})")
            others = [r for r in raised if r not in refused]
            if others:
                parts.append(f"{_ranks(others)} raised RuntimeError")
        text = "; ".join(parts) + "."
        text = text[0].upper() + text[1:]
        extra = lesson(result.failure, run)
        text = f"{text} {extra}".strip()
        if raised:  # torch's own words, as a cluster log would show them, beside ours
            text += f' In torch\'s words: "{quoted_words(run)}"'
        return text

    def explain_error(self, values: dict, err: RankError) -> str:  # pragma: no cover
        return f"The ranks failed outside the injected failure: {err.headline}"
