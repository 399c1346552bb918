"""Capture of each rank's output, and printing it in the kernel in rank order.

Introduced in notebook 01. A rank's ``print`` output never reaches a notebook cell by
itself: the rank is another process, and under nbval (or any kernel whose output is
a ZMQ stream) a child's file descriptors do not lead to the cell. So each rank
captures what its code writes to ``sys.stdout`` and ``sys.stderr`` (``print``,
``warnings``, ``logging``) and sends it back with its result; the kernel prints it in
rank order, every line prefixed ``[rank N]``.

On a rank, ``sys.stdout`` and ``sys.stderr`` are :class:`RankStream` objects for the
rank's whole life, and each call only points them at a fresh :class:`RankOutput`. So an
object that kept a reference to ``sys.stderr`` in an earlier call, such as the handler
that ``logging.basicConfig()`` installs, still writes into the current call's output,
as it would still write to the terminal under torchrun.

Limits: at most :data:`MAX_CHARS` characters per stream, per rank and per call (then a
note says how much was cut). Not captured: output written straight to file descriptor
1 or 2 (C++ code, ``os.write``, a ``subprocess`` that inherits them) and output of
processes the rank starts (DataLoader workers); it goes to the terminal that started
JupyterLab, as it would go to torchrun's terminal.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys


MAX_CHARS = 100_000
"""Characters kept per stream, rank and call; a rank printing in a loop cannot fill the kernel."""


class _Bounded(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def write(self, text: str) -> int:
        room = MAX_CHARS - self.tell()
        if len(text) > room:
            if room > 0:
                super().write(text[:room])
            self.dropped += len(text) - max(room, 0)
            return len(text)
        return super().write(text)

    def text(self) -> str:
        value = self.getvalue()
        if self.dropped:
            value += ("" if value.endswith("\n") else "\n") + \
                f"[output cut at {MAX_CHARS:,} characters: {self.dropped:,} more were dropped]\n"
        return value


class RankOutput:
    """The text one rank wrote to ``sys.stdout`` and ``sys.stderr`` during one call,
    at most :data:`MAX_CHARS` characters per stream (then a note that it was cut)."""

    def __init__(self) -> None:
        self.stdout = _Bounded()
        self.stderr = _Bounded()

    def texts(self) -> tuple[str, str]:
        """Return ``(stdout, stderr)`` written so far, as ``str``."""
        return self.stdout.text(), self.stderr.text()


class RankStream(io.TextIOBase):
    """A rank's lasting ``sys.stdout`` or ``sys.stderr``: writes go to the current call's
    :class:`RankOutput`, or, between calls and in processes forked from the rank, to the
    stream the rank started with (the terminal).

    ``close()`` closes it for the rest of the current call only (a later ``print``
    raises ``ValueError`` as on a closed file); the next call gets it open again.
    """

    def __init__(self, name: str, fallback) -> None:
        super().__init__()
        self.name = f"<rank {name}>"
        self._fallback = fallback
        self._owner = os.getpid()
        self.sink: io.StringIO | None = None
        self._closed_for_call = False

    # what code that inspects a stream asks for
    encoding = "utf-8"
    errors = "replace"

    @property
    def closed(self) -> bool:
        return self._closed_for_call

    def close(self) -> None:
        self._closed_for_call = True

    def reopen(self) -> None:
        self._closed_for_call = False

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fallback.fileno()

    @property
    def buffer(self):
        return _BinaryAdapter(self)

    def write(self, text) -> int:
        if self._closed_for_call:
            raise ValueError("I/O operation on closed file.")
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        sink = self.sink if os.getpid() == self._owner else None
        if sink is not None:
            return sink.write(text)
        try:
            self._fallback.write(text)
            self._fallback.flush()
        except (OSError, ValueError, AttributeError):
            pass
        return len(text)

    def flush(self) -> None:
        if self._closed_for_call:
            raise ValueError("I/O operation on closed file.")


class _BinaryAdapter:
    """``sys.stdout.buffer`` for code that writes bytes: decoded as UTF-8 into the stream."""

    def __init__(self, stream: RankStream) -> None:
        self._stream = stream

    def write(self, data) -> int:
        self._stream.write(bytes(data).decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


_STREAMS: list[RankStream] = []  # [stdout, stderr] once installed on this rank


def install() -> None:
    """Make ``sys.stdout``/``sys.stderr`` this rank's lasting :class:`RankStream` objects
    (called once, when a rank starts)."""
    _STREAMS[:] = [RankStream("stdout", sys.__stdout__ or sys.stdout),
                   RankStream("stderr", sys.__stderr__ or sys.stderr)]
    sys.stdout, sys.stderr = _STREAMS


@contextlib.contextmanager
def capture():
    """Point this rank's streams at a fresh :class:`RankOutput` for one call (runs on a rank).

    On exit the streams are open again and are ``sys.stdout``/``sys.stderr`` again, even
    if the call closed or replaced them.
    """
    if not _STREAMS:
        install()
    out = RankOutput()
    stdout, stderr = _STREAMS
    stdout.sink, stderr.sink = out.stdout, out.stderr
    stdout.reopen()
    stderr.reopen()
    sys.stdout, sys.stderr = stdout, stderr
    try:
        yield out
    finally:
        stdout.sink = stderr.sink = None
        stdout.reopen()
        stderr.reopen()
        sys.stdout, sys.stderr = stdout, stderr


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
