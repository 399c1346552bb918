"""Figures and texts of notebook 11 (when ranks disagree): the collectives each rank
entered and where it stopped, and a deterministic reading of a :class:`~reducelab.RankError`.

* :func:`timeline_figure` draws one row per rank and one box per collective the rank
  entered, in order (from the rank's flight record, see
  :mod:`reducelab.widgets.disagree`). A box says what the collective was (``all_reduce``,
  the tensor shape) and how it ended, in words and by its style: *done* (grey fill),
  *waiting* (hatched ``//``, vermillion edge: the rank was still inside it when the
  timeout hit), *refused* (hatched ``xx``, orange edge: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
  stopped it before it ran) or *failed* (hatched ``..``, black edge: it raised, for
  instance because a peer died). A column on the right says how each rank ended.
* :func:`report_lines` and :func:`clean_summary` turn a ``RankError``'s per-rank reports
  into lines that read the same on every run: gloo's source paths and the loopback port
  numbers in its messages are dropped, and the long ``CollectiveFingerPrint`` text of a
  DETAIL mismatch is cut down to what differs (:func:`fingerprint`).

Sources: the collective fingerprint check of ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
(``ProcessGroupWrapper`` and ``CollectiveFingerPrint`` in
``torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp``);
https://pytorch.org/docs/stable/distributed.html#torch-distributed-debug
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


from . import (MAX_WIDTH, MIN_FONT, NEUTRAL, PALETTE, TEXT_GREY, freeze_layout,
               new_figure, png)
from ..palette import WAIT, WRONG

STYLES = {
    #          face     edge              hatch  word
    "done": (NEUTRAL, PALETTE["black"], "", "done"),
    "waiting": ("white", WRONG, "//", "waiting"),
    "refused": ("white", WAIT, "xx", "refused"),
    "failed": ("white", PALETTE["black"], "..", "failed"),
}
"""How a box looks for each way a collective ended: ``(face, edge, hatch, word)``. The
word is also written in the box, so no style says anything by colour alone."""

MIN_SLOTS = 4
"""A timeline has at least this many columns, so that the layout stays put from one
failure to the next."""


@dataclass
class TimelineEntry:
    """One collective a rank entered.

    Attributes:
        name: the collective, e.g. ``"all_reduce"``.
        shape: the tensor shape as text, e.g. ``"[4]"`` (``""`` if none).
        status: ``"done"``, ``"waiting"``, ``"refused"`` or ``"failed"`` (see :data:`STYLES`).
    """

    name: str
    shape: str
    status: str = "done"


@dataclass
class TimelineRow:
    """What one rank did in one call.

    Attributes:
        rank: the rank.
        entries: the collectives it entered, in order.
        outcome: how it ended, one short line (``"✓ returned 480"``, ``"≠ wrong value 4
            (should be 480)"``, ``"✗ stuck in all_reduce #3"``, ``"✕ died: SIGKILL"``, ...).
        detail: an optional second line (the line of code, the mismatch).
        note: text written across the row instead of boxes when there is no record.
    """

    rank: int
    entries: list[TimelineEntry] = field(default_factory=list)
    outcome: str = ""
    detail: str = ""
    note: str = ""


def _measure(fig):
    """``measure(line) -> (width, height)`` of one line at :data:`MIN_FONT` points, in
    pixels of ``fig``'s renderer (the height is the line's spacing, 1.2 em)."""
    from matplotlib.font_manager import FontProperties
    renderer, font = fig.canvas.get_renderer(), FontProperties(size=MIN_FONT)
    height = 1.2 * renderer.points_to_pixels(MIN_FONT)

    def measure(line: str) -> tuple[float, float]:
        return renderer.get_text_width_height_descent(line, font, ismath=False)[0], height
    return measure


def _box_label(entry: TimelineEntry, word: str, box: tuple[float, float], measure) -> str:
    """The text of an entry's box, in the first form that fits ``box`` (width, height in
    pixels): ``"all_reduce [4]"``; the shape on a line of its own; the name broken after
    its underscores too; the name alone (the box's style and the legend still say how
    it ended); at last, in a box narrower than a part of the name (seven or more
    collectives), each part cut short with "…". ``word`` (the status, or ``""``) is a
    last line where it fits."""
    parts = re.findall(r"[^_]+_?", entry.name) or [entry.name]
    shape = [entry.shape] if entry.shape else []
    tail = [word] if word else []
    forms = [[" ".join([entry.name, *shape]), *tail], [entry.name, *shape, *tail],
             [*parts, *shape, *tail], [entry.name, *shape], [*parts, *shape], [entry.name],
             parts]
    width, height = box[0] - 6, box[1] - 2      # 3 pixels clear of each side of the box

    def fits(lines):
        sizes = [measure(line) for line in lines]
        return max(w for w, _ in sizes) <= width and sum(h for _, h in sizes) <= height

    def cut(line):
        while measure(line)[0] > width and len(line) > 2:
            line = line[:-2] + "…"
        return line
    return "\n".join(next((f for f in forms if fits(f)), [cut(part) for part in parts]))


def timeline_figure(rows: list[TimelineRow], title: str = "", hit: int | None = None) -> bytes:
    """Draw the collectives each rank entered and where it stopped; return PNG bytes.

    Args:
        rows: one :class:`TimelineRow` per rank, rank 0 first.
        title: the figure's title (the settings).
        hit: the rank a failure was injected into; its label says ``(hit)``.

    The figure is :data:`~reducelab.plots.MAX_WIDTH` wide and at most 4.5 in tall (up to
    8 ranks); every text is at least :data:`~reducelab.plots.MIN_FONT` points.
    """
    from matplotlib.patches import Patch, Rectangle
    n = max(len(rows), 1)
    slots = max(MIN_SLOTS, max((len(r.entries) for r in rows), default=0))
    height = min(4.5, 1.55 + 0.62 * n)
    fig = new_figure(MAX_WIDTH, height)
    grid = fig.add_gridspec(1, 2, width_ratios=[3.1, 2.0], wspace=0.02)
    ax = fig.add_subplot(grid[0, 0])
    side = fig.add_subplot(grid[0, 1], sharey=ax)
    ax.set_xlim(0.45, slots + 0.55)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xticks(range(1, slots + 1), [f"#{k}" for k in range(1, slots + 1)])
    ax.set_xlabel("collectives each rank entered in this call, in order")
    ax.set_yticks(range(n), [f"rank {r.rank} (hit)" for r in rows])  # room for the widest label
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    three_lines = n <= 5  # room for the status word (and the outcome's detail) on a line of its own
    for y, row in enumerate(rows):
        if row.note and not row.entries:
            ax.text(0.55, y, row.note, ha="left", va="center", fontsize=MIN_FONT,
                    color=TEXT_GREY, style="italic")
        for x, entry in enumerate(row.entries, start=1):
            face, edge, hatch, word = STYLES[entry.status]
            ax.add_patch(Rectangle((x - 0.45, y - 0.36), 0.9, 0.72, facecolor=face,
                                   edgecolor=edge, hatch=hatch, linewidth=1.8))
    side.set_xlim(0, 1)
    side.axis("off")
    for y, row in enumerate(rows):
        text = row.outcome + (f"\n{row.detail}" if row.detail and three_lines else "")
        side.text(0.03, y, text, ha="left", va="center", fontsize=MIN_FONT, wrap=False)
    handles = [Patch(facecolor=face, edgecolor=edge, hatch=hatch, label=word)
               for face, edge, hatch, word in STYLES.values()]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, frameon=False,
               fontsize=MIN_FONT, title=None)
    fig.suptitle(title or " ")
    freeze_layout(fig)  # the same layout whichever rank is hit
    # the boxes' words, fitted to the boxes as laid out (a box narrows as entries grow)
    box = (0.9 * ax.bbox.width / (slots + 0.1), 0.72 * ax.bbox.height / n)
    measure = _measure(fig)
    for y, row in enumerate(rows):
        for x, entry in enumerate(row.entries, start=1):
            word = STYLES[entry.status][3] if entry.status != "done" and three_lines else ""
            ax.text(x, y, _box_label(entry, word, box, measure), ha="center", va="center",
                    fontsize=MIN_FONT, bbox=None if entry.status == "done" else
                    dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))
    ax.set_yticks(range(n), [f"rank {r.rank}" + (" (hit)" if r.rank == hit else "")
                             for r in rows])
    return png(fig)


# --- texts -----------------------------------------------------------------------------

_SOURCE = re.compile(r"\[/[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_PORT = re.compile(r"\[(127\.0\.0\.1|::1|localhost)\]:\d+")
_FINGERPRINT = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),?\s*"
    r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\], TensorDtypes=(\w+))?")
_DIFFER = re.compile(r"Collectives differ in the following aspects:\s*(.*)$", re.S)


@dataclass
class Fingerprint:
    """What ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` says two ranks disagree on.

    Attributes:
        ranks: the two ranks the message compares: this rank first, then the other.
        ops: the collective each was entering (``"ALLREDUCE"``, ``"BROADCAST"``, ...).
        shapes: the first tensor's shape on each (``"[4]"``; ``""`` when not given).
        dtypes: the first tensor's dtype on each (``"Float"``; ``""`` when not given).
        sequence: the sequence number of the collective on this rank.
        differ: what differs, in torch's words, tidied (``"tensor shapes: 4 vs 5"``).
    """

    ranks: tuple[int, int]
    ops: tuple[str, str]
    shapes: tuple[str, str]
    dtypes: tuple[str, str]
    sequence: int
    differ: str

    def text(self) -> str:
        """One line, e.g. ``"rank 2 ALLREDUCE [5] Float vs rank 0 ALLREDUCE [4] Float
        (tensor shapes: 5 vs 4; sequence number 1)"``."""
        def one(k):
            shape = f" [{self.shapes[k]}]" if self.shapes[k] else ""
            dtype = f" {self.dtypes[k]}" if self.dtypes[k] else ""
            return f"rank {self.ranks[k]} {self.ops[k]}{shape}{dtype}"
        if "sequence number" in self.differ:  # the sequence numbers are what differs
            return f"{one(0)} vs {one(1)} ({self.differ})"
        differ = f"{self.differ}; " if self.differ else ""
        return f"{one(0)} vs {one(1)} ({differ}sequence number {self.sequence})"


def fingerprint(text: str) -> Fingerprint | None:
    """Parse a DETAIL mismatch message (``"Detected mismatch between collectives on
    ranks. Rank 0 is running collective: CollectiveFingerPrint(...), but Rank 2 is
    running collective: ..."``); ``None`` if ``text`` holds no such message."""
    found = _FINGERPRINT.findall(text or "")
    if "Detected mismatch between collectives" not in (text or "") or len(found) < 2:
        return None
    (r0, seq, op0, shape0, dtype0), (r1, _, op1, shape1, dtype1) = found[:2]
    differ = ""
    m = _DIFFER.search(text)
    if m:
        parts = [p.strip() for p in re.split(r"\s{2,}", m.group(1)) if p.strip()]
        tidy = []
        for p in parts:
            p = re.sub(r"^Tensor Tensor ", "tensor ", p)
            p = re.sub(r"^Op type", "collective", p)
            p = re.sub(r"^Sequence number", "sequence number", p)
            p = re.sub(r"(\S)vs ", r"\1 vs ", p)
            if "TensorOptions" in p:  # device options: identical on CPU, long
                continue
            tidy.append(p.rstrip(" vs").strip())
        differ = "; ".join(tidy)
    return Fingerprint((int(r0), int(r1)), (op0, op1), (shape0, shape1), (dtype0, dtype1),
                       int(seq), differ)


def clean_summary(text: str) -> str:
    """A rank's one-line summary without what changes from run to run: gloo's source
    paths (``[/__w/.../pair.cc:537]``) and loopback port numbers. A DETAIL mismatch
    becomes :meth:`Fingerprint.text`."""
    fp = fingerprint(text)
    if fp is not None:
        kind = text.split(":", 1)[0] if ":" in text[:40] else "RuntimeError"
        return f"{kind}: mismatch, {fp.text()}"
    text = _PORT.sub(r"[\1]", _SOURCE.sub("", text or ""))
    text = text.replace(" GLHF! 🏖️", "").replace("GLHF!", "").strip()
    return text


def full_message(report) -> str:
    """The whole error message of a :class:`~reducelab.RankReport` that raised, on one
    line: the exception at the end of its traceback, its lines joined by spaces (a
    summary is cut at 500 characters); else its summary. :func:`torch_words` keeps the
    lines as torch wrote them."""
    words = torch_words(report) if report.state == "raised" else ""
    if words:
        return " ".join(line.strip() for line in words.splitlines() if line.strip())
    return report.summary


def report_lines(err, width: int = 160) -> list[str]:
    """``["rank 0: was waiting in all_reduce, called from f line 4", ...]``: one line per
    rank of a :class:`~reducelab.RankError`, the same on every run (see
    :func:`clean_summary`), each cut at ``width`` characters.

    When a rank died, which of the others raised (gloo's "Connection closed" or
    "Connection reset") and which were still waiting depends on timing, so they share
    one line that says so."""
    died = [r.rank for r in err.reports if r.state == "died"]
    out = []
    for r in err.reports:
        if died and r.state in ("raised", "stuck"):
            continue
        text = clean_summary(full_message(r))
        if len(text) > width:
            text = text[:width - 1].rstrip() + "…"
        out.append(f"rank {r.rank}: {text}")
    others = [r.rank for r in err.reports if died and r.state in ("raised", "stuck")]
    if others:
        gone = ", ".join(map(str, died))
        out.append(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}: "
                   f"raised or were still waiting once rank {gone} was gone (which one "
                   f"depends on timing)")
    return out


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Warning)\b[^\n]*$")


def torch_words(report) -> str:
    """What torch itself raised on one rank, word for word: the exception at the end of a
    :class:`~reducelab.RankReport`'s traceback, every line of it (gloo's messages can span
    several), as a learner finds it in a cluster log. Only the loopback port numbers are
    masked (``[127.0.0.1]:PORT``), since they change from run to run. ``""`` when the rank
    raised nothing (it returned, was stuck, or died).

    Source: the exception texts are torch's own, from ``ProcessGroupGloo.cpp``,
    ``ProcessGroupWrapper.cpp`` and gloo's ``transport/tcp`` (torch 2.13)."""
    if report is None or report.state != "raised":
        return ""
    lines = (report.traceback or "").rstrip().splitlines()
    start = next((i for i in range(len(lines) - 1, -1, -1)
                  if _EXCEPTION_LINE.match(lines[i])), None)
    text = "\n".join(lines[start:]) if start is not None else report.summary
    return _PORT.sub(r"[\1]:PORT", text)
