"""The ring explorer of notebook 06: watch a ring all_reduce step by step.

The notebook's rank function runs a ring all_reduce built from ``dist.isend`` /
``dist.recv`` on real ranks and records, after every step, the chunk the rank sent, the
chunk it received, and a snapshot of its tensor. The explorer draws one step at a time.

Source: Patarasuk & Yuan (2009), "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2); ``torch.distributed.isend`` /
``recv``, https://pytorch.org/docs/stable/distributed.html#point-to-point-communication
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..checks.ring import contributors
from ..group import LocalGroup
from ..plots.ring import RingStepsPlot
from . import Explorer

MIN_WORLD_SIZE, MAX_WORLD_SIZE = 2, 8


@dataclass
class RingRun:
    """What every rank recorded in one ring all_reduce on ``world_size`` ranks.

    Attributes:
        values: float64 array, shape ``(2 (N - 1) + 1, N, N)``: ``values[k, r, c]`` is the
            value of chunk ``c`` on rank ``r`` after step ``k`` (step 0: the input).
        sent, received: int arrays, shape ``(2 (N - 1) + 1, N)``: the chunk rank ``r``
            sent / received at step ``k``; ``-1`` at step 0.
    """

    values: np.ndarray
    sent: np.ndarray
    received: np.ndarray

    @property
    def world_size(self) -> int:
        return self.values.shape[1]

    @property
    def steps(self) -> int:
        """Number of ring steps, ``2 (world_size - 1)``."""
        return self.values.shape[0] - 1


@dataclass
class RingView:
    """One step of a :class:`RingRun`, what the explorer shows."""

    run: RingRun
    step: int


def phase_of(step: int, world_size: int) -> str:
    """``"input"`` (step 0), ``"reduce-scatter"`` (steps 1..N-1) or ``"all-gather"`` (N..2(N-1))."""
    if step == 0:
        return "input"
    return "reduce-scatter" if step <= world_size - 1 else "all-gather"


def run_from_traces(traces: list) -> RingRun:
    """Stack the per-rank traces a rank function returned into a :class:`RingRun`.

    Args:
        traces: ``traces[r]`` is rank ``r``'s list of ``(sent, received, x)`` with
            ``2 (N - 1) + 1`` entries, the first ``(None, None, input)``; ``x`` is a
            1-D tensor of at least ``N`` elements, split into ``N`` chunks with
            ``tensor_split`` (the chunk's first element is shown).

    Raises:
        ValueError: the traces do not have that shape.
    """
    n = len(traces)
    want = 2 * (n - 1) + 1
    if any(len(t) != want for t in traces):
        raise ValueError(f"each rank must record {want} entries (the input and 2 (N - 1) = "
                         f"{want - 1} steps) for world_size={n}; got {[len(t) for t in traces]}")
    values = np.zeros((want, n, n))
    sent = np.full((want, n), -1)
    received = np.full((want, n), -1)
    for r, trace in enumerate(traces):
        for k, (s, rc, x) in enumerate(trace):
            chunks = x.reshape(-1).tensor_split(n)
            values[k, r] = [float(c[0]) if c.numel() else 0.0 for c in chunks]
            if k:
                sent[k, r], received[k, r] = int(s), int(rc)
    return RingRun(values, sent, received)


class RingExplorer(Explorer):
    """Widget: run the notebook's ring on ``world_size`` ranks and show one step.

    Args:
        group: the :class:`~reducelab.LocalGroup`; the world-size slider resizes it.
        fn: the rank function from the notebook, called with no arguments on every rank.
            It gives rank ``r`` the input ``2 ** r`` in every chunk (one element per chunk
            is enough), runs the ring and returns its trace: ``2 (N - 1) + 1`` tuples
            ``(sent_chunk, received_chunk, snapshot)``, the first ``(None, None, input)``.
        world_size: initial world size, 2..8 (default: the group's).
        step: initial step, 0..2 (world_size - 1).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``world_size`` or ``step`` out of range.

    Runs are cached per world size (the ring is deterministic), so the step slider only
    redraws.
    """

    def __init__(self, group: LocalGroup, fn, world_size: int | None = None, step: int = 0):
        if not callable(fn):
            raise TypeError(f"fn must be the rank function that returns the ring's trace, got {fn!r}")
        world_size = world_size or group.world_size
        if not isinstance(world_size, int) or not MIN_WORLD_SIZE <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int from {MIN_WORLD_SIZE} to "
                             f"{MAX_WORLD_SIZE}, got {world_size!r}")
        last = 2 * (world_size - 1)
        if not isinstance(step, int) or not 0 <= step <= last:
            raise ValueError(f"step must be an int from 0 to 2 (world_size - 1) = {last}, got {step!r}")
        self.group, self.fn = group, fn
        self.plot = RingStepsPlot()
        self.runs: dict[int, RingRun] = {}
        self._syncing = False
        style = {"description_width": "initial"}  # labels are never cut off
        super().__init__({
            "world_size": W.IntSlider(value=world_size, min=MIN_WORLD_SIZE, max=MAX_WORLD_SIZE,
                                      description="world_size", continuous_update=False,
                                      style=style),
            "step": W.IntSlider(value=step, min=0, max=last, description="step", style=style),
        })
        self.refresh()

    def _on_change(self, change) -> None:
        if not self._syncing:
            self.request_refresh(change)

    def compute(self, world_size, step) -> RingView:
        if world_size not in self.runs:
            self.group.resize(world_size)  # no-op when it already has that many ranks
            self.runs[world_size] = run_from_traces(self.group.run(self.fn))
        run = self.runs[world_size]
        slider = self.controls["step"]
        if slider.max != run.steps:
            self._syncing = True
            try:
                slider.max = run.steps   # may clamp slider.value; no second refresh
            finally:
                self._syncing = False
        return RingView(run, min(step, run.steps))

    def draw(self, view: RingView) -> bytes:
        run, k = view.run, view.step
        n = run.world_size
        phase = phase_of(k, n)
        if k == 0:
            title = (f"step 0 of {run.steps}: the input\n"
                     f"rank r holds 2**r in every chunk")
        else:
            i = k if k <= n - 1 else k - (n - 1)
            what = ("each rank adds the chunk it receives to its own copy"
                    if phase == "reduce-scatter" else
                    "each rank overwrites its copy with the complete chunk it receives")
            title = f"step {k} of {run.steps}: {phase} step {i} of {n - 1}\n{what}"
        sent = None if k == 0 else run.sent[k]
        received = None if k == 0 else run.received[k]
        return self.plot.draw(run.values[k], sent, received, title)

    def describe(self, view: RingView) -> str:
        run, k = view.run, view.step
        n = run.world_size
        complete = []
        for r in range(n):
            done = [c for c in range(n) if len(contributors(run.values[k, r, c], n)) == n]
            complete.append(f"rank {r}: {done}")
        what = "input" if k == 0 else (f"{phase_of(k, n)}; rank 0 sent chunk {run.sent[k, 0]}, "
                                        f"received chunk {run.received[k, 0]}")
        return f"Step {k} of {run.steps} ({what}). Complete chunks: {', '.join(complete)}."
