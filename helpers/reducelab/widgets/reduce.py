"""The reduce explorer of notebook 02: what every rank's buffer holds after ``dist.reduce``.

Pick world_size, dst, the tensor size and an input pattern; the ranks run the
notebook's own rank function (a real ``dist.reduce`` on gloo) and the figure shows,
element by element, whether each rank's tensor still holds its input, a partial sum,
or the full sum. The docs promise the result on ``dst`` only; on gloo the other ranks'
tensors are used as the ring's work buffers.

Source: ``torch.distributed.reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce ; gloo's ring
reduce, ``gloo/reduce.cc`` (https://github.com/pytorch/gloo), which torch's
``ProcessGroupGloo`` (``AsyncReduceWork``) runs with your tensor as its only buffer;
pytorch/pytorch#21480 and #76527 report the partial sums on non-dst ranks; the learner
question "Why does `torch.distributed.reduce` affect tensors other than the
destination?" (2025-01-30).
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..errors import RankError
from ..group import LocalGroup
from ..plots.reduce import FULL, PARTIAL, UNCHANGED, ReduceGrid
from . import Explorer

PATTERNS = ("10**rank", "rank + 1", "random ints")
"""Input patterns: ``10.0 ** rank`` everywhere (the digits of a sum say which ranks are in
it: 1101 = ranks 0, 2 and 3); ``rank + 1`` everywhere; ints 1..9 seeded by rank. Every
pattern is positive, so a partial sum differs from both the input and the full sum."""
MAX_WORLD_SIZE = 8
MAX_ELEMENTS = 32


def buffer_status(before, after) -> np.ndarray:
    """Classify each element of each rank's tensor after a SUM reduce.

    Args:
        before, after: array-likes of shape ``(world_size, n)``: each rank's input and its
            tensor after ``dist.reduce(..., op=ReduceOp.SUM)``.

    Returns:
        ``int`` array of shape ``(world_size, n)``: ``FULL`` (2) where the element equals
        the sum over ranks, else ``UNCHANGED`` (0) where it equals the rank's input, else
        ``PARTIAL`` (1). With positive inputs a partial sum can equal neither.

    Raises:
        ValueError: the shapes differ or are not 2-D.
    """
    before, after = np.asarray(before, float), np.asarray(after, float)
    if before.ndim != 2 or before.shape != after.shape:
        raise ValueError(f"before and after must both have shape (world_size, n); "
                         f"got {before.shape} and {after.shape}")
    full = before.sum(axis=0, keepdims=True)
    status = np.full(before.shape, PARTIAL)
    status[np.isclose(after, before)] = UNCHANGED
    status[np.isclose(after, full)] = FULL
    return status


def contributors(value: float, world_size: int) -> list[int]:
    """Ranks whose ``10**rank`` is in ``value`` (a sum of distinct powers of ten).

    ``contributors(1101.0, 4) == [0, 2, 3]``. Raises ValueError if ``value`` is not such
    a sum over ranks ``0 .. world_size - 1``.
    """
    v = int(round(float(value)))
    digits = str(v)[::-1]
    if v <= 0 or abs(v - float(value)) > 1e-6 or set(digits) - {"0", "1"} \
            or len(digits) > world_size:
        raise ValueError(f"{value!r} is not a sum of distinct 10**rank for ranks "
                         f"0..{world_size - 1}")
    return [r for r, d in enumerate(digits) if d == "1"]


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


@dataclass
class ReduceResult:
    """Per-rank tensors before and after one ``dist.reduce``.

    Attributes:
        dst, pattern: the settings used.
        before, after: ``float64`` arrays of shape ``(world_size, n)``.
        status: ``int`` array of shape ``(world_size, n)``, see :func:`buffer_status`.
    """

    dst: int
    pattern: str
    before: np.ndarray
    after: np.ndarray
    status: np.ndarray

    @property
    def world_size(self) -> int:
        return self.before.shape[0]

    @property
    def n(self) -> int:
        return self.before.shape[1]

    def changed_ranks(self) -> list[int]:
        """Ranks other than ``dst`` whose tensor no longer equals their input."""
        return [r for r in range(self.world_size)
                if r != self.dst and (self.status[r] != UNCHANGED).any()]

    def counts(self, rank: int) -> dict[int, int]:
        """``{FULL: k, PARTIAL: k, UNCHANGED: k}``: how many of ``rank``'s elements hold
        the full sum, a partial sum, or the input."""
        return {k: int((self.status[rank] == k).sum()) for k in (FULL, PARTIAL, UNCHANGED)}


class ReduceExplorer(Explorer):
    """Widget: run ``fn(n, dst, pattern)`` on every rank and show every rank's buffer.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on; the world_size slider
            resizes it.
        fn: the notebook's rank function, called on every rank as ``fn(n, dst, pattern)``
            with ``n`` elements (int), ``dst`` a rank, ``pattern`` from :data:`PATTERNS`.
            It must return ``(before, after)``: two 1-D tensors of ``n`` elements, the
            input and the same tensor after ``dist.reduce(x, dst=dst)``.
        world_size: initial world size, 1..8 (default: the group's).
        dst: initial destination rank, ``0 .. world_size - 1``.
        n: initial tensor size in elements, 1..32.
        pattern: initial input pattern, one of :data:`PATTERNS`.

    Raises:
        ValueError: an initial value outside the ranges above.

    The dst slider's maximum follows world_size (dst is clamped when world_size shrinks).
    """

    def __init__(self, group: LocalGroup, fn, world_size: int | None = None, dst: int = 0,
                 n: int = 8, pattern: str = "10**rank"):
        world_size = world_size or group.world_size
        if not (isinstance(world_size, int) and 1 <= world_size <= MAX_WORLD_SIZE):
            raise ValueError(f"world_size must be an int from 1 to {MAX_WORLD_SIZE}, "
                             f"got {world_size!r}")
        if not (isinstance(dst, int) and 0 <= dst < world_size):
            raise ValueError(f"dst must be a rank from 0 to {world_size - 1}, got {dst!r}")
        if not (isinstance(n, int) and 1 <= n <= MAX_ELEMENTS):
            raise ValueError(f"n must be an int from 1 to {MAX_ELEMENTS}, got {n!r}")
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}; got {pattern!r}")
        self.group, self.fn = group, fn
        self.plot = ReduceGrid()
        self._syncing = False
        style = {"description_width": "initial"}
        super().__init__({
            "world_size": W.IntSlider(value=world_size, min=1, max=MAX_WORLD_SIZE,
                                      description="world_size", continuous_update=False,
                                      style=style),
            # dst and n follow the hand while dragged (the base class collapses the
            # changes); world_size waits for the release, since each value restarts ranks
            "dst": W.IntSlider(value=dst, min=0, max=world_size - 1, description="dst",
                               style=style),
            "n": W.IntSlider(value=n, min=1, max=MAX_ELEMENTS, description="elements",
                             style=style),
            "pattern": W.Dropdown(options=PATTERNS, value=pattern, description="input",
                                  style=style),
        })
        self.refresh()

    def _on_change(self, change) -> None:
        if self._syncing:
            return
        if change["owner"] is self.controls["world_size"]:
            self._syncing = True  # moving dst's max may clamp dst: refresh once, below
            try:
                dst = self.controls["dst"]
                dst.max = max(change["new"] - 1, 0)
                dst.value = min(dst.value, dst.max)
            finally:
                self._syncing = False
        self.request_refresh(change)

    def compute(self, world_size, dst, n, pattern) -> ReduceResult:
        self.group.resize(world_size)  # no-op when it already has that many ranks
        out = self.group.run(self.fn, n, dst, pattern)
        before = np.stack([np.asarray(b, dtype=float).reshape(-1) for b, _ in out])
        after = np.stack([np.asarray(a, dtype=float).reshape(-1) for _, a in out])
        return ReduceResult(dst, pattern, before, after, buffer_status(before, after))

    def preparation(self, world_size, dst, n, pattern):
        return self.plot.preparation(world_size, n)  # a new world size's or n's figure

    def draw(self, result: ReduceResult) -> bytes:
        return self.plot.draw(result.before, result.after, result.status, result.dst,
                              title=f"dist.reduce(x, dst={result.dst}) on "
                                    f"{_plural(result.world_size, 'rank')}, "
                                    f"{_plural(result.n, 'element')}, input {result.pattern}")

    def describe(self, result: ReduceResult) -> str:
        """One line: the settings, what dst holds, then each other rank's elements by
        status (full sum / partial sum / unchanged)."""
        ws, n, dst = result.world_size, result.n, result.dst
        head = (f"input {result.pattern}, world_size={ws}, dst={dst}, "
                f"{_plural(n, 'element')}: dst holds the full sum in "
                f"{result.counts(dst)[FULL]} of {n}.")
        others = [r for r in range(ws) if r != dst]
        if not others:
            return head + " With one rank there is nothing to reduce; x is unchanged."
        groups: dict[tuple, list[int]] = {}   # ranks with the same counts, in rank order
        for r in others:
            c = result.counts(r)
            groups.setdefault((c[FULL], c[PARTIAL], c[UNCHANGED]), []).append(r)
        parts = []
        for (full, partial, unchanged), ranks in groups.items():
            who = (f"rank {ranks[0]}" if len(ranks) == 1 else
                   "ranks " + ", ".join(map(str, ranks)) + " each")
            parts.append(f"{who}: {full} full, {partial} partial, {unchanged} unchanged")
        return head + " Not dst: " + "; ".join(parts) + "."

    def explain_error(self, values: dict, err: RankError) -> str:
        first = err.first_summary
        return (f"The ranks could not run reduce with world_size={values['world_size']}, "
                f"dst={values['dst']}: {first}")
