"""Capture of each rank's output, and printing it in the kernel in rank order.

Introduced in notebook 01. A rank's ``print`` output never reaches a notebook cell by
itself: the rank is another process, and under nbval (or any kernel whose output is
a ZMQ stream) a child's file descriptors do not lead to the cell. So each rank
captures what ``fn`` writes to ``sys.stdout`` and ``sys.stderr`` (``print``,
``warnings``, logging to stderr) and sends it back with its result; the kernel prints
it in rank order, every line prefixed ``[rank N]``.

Output written straight to file descriptor 1 or 2 by C++ code is not captured; it goes
to the terminal that started JupyterLab.
"""
from __future__ import annotations

import contextlib
import io
import sys


MAX_CHARS = 1_000_000
"""Characters kept per stream and call; a rank printing in a loop cannot fill the kernel."""


class _Bounded(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def write(self, text: str) -> int:
        room = MAX_CHARS - self.tell()
        if len(text) > room:
            if room > 0:
                super().write(text[:room])
            if not self.dropped:
                super().write(f"\n[output cut at {MAX_CHARS:,} characters]\n")
            self.dropped += len(text) - max(room, 0)
            return len(text)
        return super().write(text)


class RankOutput:
    """The text one rank wrote to ``sys.stdout`` and ``sys.stderr`` during one call,
    at most :data:`MAX_CHARS` characters per stream (then a note that it was cut)."""

    def __init__(self) -> None:
        self.stdout = _Bounded()
        self.stderr = _Bounded()

    def texts(self) -> tuple[str, str]:
        """Return ``(stdout, stderr)`` written so far, as ``str``."""
        return self.stdout.getvalue(), self.stderr.getvalue()


@contextlib.contextmanager
def capture():
    """Redirect ``sys.stdout``/``sys.stderr`` into a :class:`RankOutput` (runs on a rank)."""
    out = RankOutput()
    with contextlib.redirect_stdout(out.stdout), contextlib.redirect_stderr(out.stderr):
        yield out


def prefix_lines(rank: int, text: str) -> str:
    """Prefix every line of ``text`` with ``[rank N] ``; ``""`` stays ``""``."""
    if not text:
        return ""
    lines = text.splitlines()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def print_rank_outputs(outputs: dict[int, tuple[str, str]], stdout=None, stderr=None) -> None:
    """Print captured ``{rank: (stdout, stderr)}`` in rank order with ``[rank N]`` prefixes.

    All of stdout goes first, rank by rank, then all of stderr, so each stream reads
    in rank order. Streams default to the kernel's current ``sys.stdout``/``sys.stderr``.
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    out = "".join(prefix_lines(r, outputs[r][0]) for r in sorted(outputs))
    err = "".join(prefix_lines(r, outputs[r][1]) for r in sorted(outputs))
    if out:
        stdout.write(out)
        stdout.flush()
    if err:
        stderr.write(err)
        stderr.flush()
