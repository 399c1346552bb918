"""The cost explorer of notebook 10: time a collective on real ranks, against the α-β model.

Pick a collective, a message size and a world size. Every change runs the notebook's
timing function on the ranks: a sweep of sizes the first time a (collective, world size)
pair is seen (cached after), and always a fresh measurement at the chosen size, whose
spread the figure shows rank by rank. The fit is the notebook's own function. A new
sweep is shown as it is measured (the chosen size first): the learner sees its first
sizes and their fit within about a second, not after the whole sweep.

Timing method (as in the notebook): a warm-up call, a barrier before each repeat, each
rank times its own call, the collective's time is the slowest rank's, and a point is
the median over repeats.

The model is ``α + β·f·S`` with ``f`` the bytes gloo's busiest rank really sends per byte
of ``S`` (:func:`~reducelab.checks.cost.gloo_factor`); busbw is nccl-tests' (with its bus
factor), so it is below ``1/β`` where gloo sends more than the best algorithm would.

Sources: Thakur, Rabenseifner & Gropp (2005), Int. J. High Performance Computing
Applications 19(1) (the α-β model); NVIDIA/nccl-tests ``doc/PERFORMANCE.md`` (algbw,
busbw and the bus factors).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ipywidgets as W
import numpy as np

from ..checks.cost import (COLLECTIVES, available_cores, busbw, crossover_bytes, gloo_factor,
                           model_seconds, seconds_label, size_label)
from ..group import LocalGroup
from ..plots.cost import explorer_figure
from . import Explorer

SIZES = tuple(4 * 16 ** k for k in range(7))
"""The notebook's message sizes, bytes: 4 B, 64 B, 1 KiB, 16 KiB, 256 KiB, 4 MiB, 64 MiB."""
MIN_WORLD_SIZE, MAX_WORLD_SIZE = 2, 8
SPOT_SECONDS = 0.6
"""About how long the measurement at the chosen size may take, seconds."""
MIN_REPEATS, MAX_REPEATS = 5, 25
INTERIM_AFTER = 0.3
"""Seconds into a new sweep by which the learner sees the sizes measured so far
(:meth:`~reducelab.widgets.Explorer.show_interim`), if the sweep runs longer. Before
each size, the explorer shows them when the sweep has run this long, or would run past it
while measuring that size (:func:`expected_seconds`); then again when it would run past
twice as long as at the last showing (three or four interim figures in a sweep of 3 s on
8 ranks and 2 cores, each a redraw of 60 to 130 ms). Without the look ahead, a sweep on
3 ranks reached its 64 MiB size (0.3 to 0.4 s of the 0.9 to 1.2 s it took) at 0.26 to
0.30 s on an idle 2-core machine, so the learner saw no interim figure in one sweep of
two."""


def expected_seconds(measured: dict, size_bytes: int) -> float:
    """About how long measuring ``size_bytes`` in a sweep will take, seconds: its
    :func:`sweep_repeats` times the median of the largest size measured so far, scaled
    by the ratio of sizes (a time per byte that still holds the per-message α, so it errs
    long), and never less than the smallest median measured. ``measured`` maps sizes,
    bytes, to their :class:`Timing`; ``0.0`` when it is empty."""
    if not measured:
        return 0.0
    largest = measured[max(measured)]
    floor = min(t.median for t in measured.values())
    return sweep_repeats(size_bytes) * max(floor, largest.median * size_bytes / largest.size_bytes)


def sweep_repeats(size_bytes: int) -> int:
    """Repeats per size in a sweep: 31 up to 16 KiB, 15 up to 4 MiB, 3 from 16 MiB up
    (they take long enough). Their medians must survive slow repeats: on a 2-vCPU VM, 59
    to 99 of 300 repeats of a 16 KiB all_reduce on 2 idle gloo ranks took 2 to 8 ms
    instead of 0.3 (29 Nov 2026), so a third of them can be slow. With a third slow, the
    median of 5 repeats is a slow one about 1 time in 5, of 15 about 1 in 12, of 31 about
    1 in 40 (the binomial tail); a sweep has 7 sizes."""
    if size_bytes <= 16 * 2 ** 10:
        return 31
    return 15 if size_bytes < 16 * 2 ** 20 else 3


@dataclass
class Timing:
    """One measurement of one collective at one size.

    Attributes:
        collective: one of :data:`~reducelab.checks.cost.COLLECTIVES` (or a label such
            as ``"Python ring"`` for an all_reduce of one's own).
        world_size: ranks that took part.
        size_bytes: ``S``, the size of the collective's whole result, bytes.
        seconds: float64 array, shape ``(world_size, repeats)``: rank ``r``'s time of
            repeat ``k``, seconds.
    """

    collective: str
    world_size: int
    size_bytes: int
    seconds: np.ndarray

    @classmethod
    def from_ranks(cls, collective: str, out: list) -> "Timing":
        """From what the timing function returned on each rank: ``out[r] = (size_bytes,
        [seconds of each repeat])``."""
        seconds = np.array([times for _, times in out], dtype=float)
        return cls(collective, len(out), int(out[0][0]), seconds)

    @property
    def slowest(self) -> np.ndarray:
        """Seconds of each repeat on its slowest rank, shape ``(repeats,)``: a collective
        is done when its last rank is."""
        return self.seconds.max(axis=0)

    @property
    def median(self) -> float:
        """The median over repeats of :attr:`slowest`, seconds."""
        return float(np.median(self.slowest))


@dataclass
class Sweep:
    """Timings of one collective on one world size at several sizes.

    Attributes:
        collective: the collective timed (for the bus factor).
        world_size: number of ranks.
        timings: one :class:`Timing` per size, in increasing size.
        label: name in figures (default: the collective).
    """

    collective: str
    world_size: int
    timings: list = field(default_factory=list)
    label: str = ""

    def __post_init__(self):
        self.label = self.label or self.collective

    @property
    def sizes(self) -> np.ndarray:
        """Bytes, shape ``(k,)``."""
        return np.array([t.size_bytes for t in self.timings], dtype=float)

    @property
    def medians(self) -> np.ndarray:
        """Seconds, shape ``(k,)``: the median over repeats of the slowest rank."""
        return np.array([t.median for t in self.timings])

    @property
    def spread(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lowest, highest)`` over repeats of the slowest rank's seconds, each ``(k,)``."""
        return (np.array([t.slowest.min() for t in self.timings]),
                np.array([t.slowest.max() for t in self.timings]))


@dataclass
class CostView:
    """What the explorer shows: a sweep, its fit, and the measurement at the chosen size.

    Attributes:
        sweep: the :class:`Sweep` of the chosen collective and world size.
        alpha, beta: the fit, seconds per message and seconds per byte sent.
        spot: the fresh :class:`Timing` at the chosen size.
        new_sweep: whether this refresh measured the sweep (the first visit of this pair).
        to_measure: sizes of the sweep still to measure (an interim view, shown while
            the sweep runs); 0 in a complete one.
    """

    sweep: Sweep
    alpha: float
    beta: float
    spot: Timing
    new_sweep: bool = False
    to_measure: int = 0


class CostExplorer(Explorer):
    """Widget: time a collective on real ranks and draw it against the fitted α-β model.

    Args:
        group: the :class:`~reducelab.LocalGroup`; the world-size slider resizes it.
        fn: the notebook's rank function ``fn(collective, size_bytes, repeats)`` that
            returns ``(S, [seconds of each repeat])`` on each rank (warm-up and a barrier
            before each repeat included).
        fit: the notebook's ``fit(sizes_bytes, seconds, factor) -> (alpha, beta)``; it is
            called with :func:`~reducelab.checks.cost.gloo_factor`, the bytes gloo's
            busiest rank sends per byte of ``S``.
        sweeps: ``{(collective, world_size): Sweep}`` already measured (the notebook's);
            other pairs are measured when first chosen, and added to this dict.
        collective: initial collective, one of
            :data:`~reducelab.checks.cost.COLLECTIVES`.
        size: initial message size, bytes, one of ``sizes``.
        world_size: initial world size, 2..8 (default: the group's).
        sizes: the sizes of a sweep and of the size slider, bytes (default :data:`SIZES`).

    Raises:
        TypeError: ``fn`` or ``fit`` is not callable.
        ValueError: an initial value outside the choices above.
    """

    def __init__(self, group: LocalGroup, fn, fit, sweeps: dict | None = None,
                 collective: str = "all_reduce", size: int | None = None,
                 world_size: int | None = None, sizes=SIZES):
        for name, f in (("fn", fn), ("fit", fit)):
            if not callable(f):
                raise TypeError(f"{name} must be the notebook's function, got {f!r}")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; "
                             f"got {collective!r}")
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise ValueError(f"sizes must hold at least 2 sizes in bytes (>= 1), got {sizes!r}")
        size = sizes[len(sizes) // 2] if size is None else size
        if size not in sizes:
            raise ValueError(f"size must be one of {', '.join(size_label(s) for s in sizes)} "
                             f"(in bytes: {', '.join(map(str, sizes))}); got {size!r}")
        world_size = world_size or max(group.world_size, MIN_WORLD_SIZE)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or \
                not MIN_WORLD_SIZE <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int from {MIN_WORLD_SIZE} to "
                             f"{MAX_WORLD_SIZE}, got {world_size!r}")
        self.group, self.fn, self.fit, self.sizes = group, fn, fit, sizes
        self.sweeps = sweeps if sweeps is not None else {}
        style = {"description_width": "initial"}
        super().__init__({
            "collective": W.Dropdown(options=COLLECTIVES, value=collective,
                                     description="collective", style=style),
            "size": W.SelectionSlider(options=[(size_label(s), s) for s in sizes], value=size,
                                      description="message size S", continuous_update=False,
                                      style=style),
            "world_size": W.IntSlider(value=world_size, min=MIN_WORLD_SIZE, max=MAX_WORLD_SIZE,
                                      description="world_size", continuous_update=False,
                                      style=style),
        })
        self.refresh()

    def measure(self, collective: str, size: int, repeats: int) -> Timing:
        """Run the timing function on every rank of the group; one :class:`Timing`."""
        return Timing.from_ranks(collective, self.group.run(self.fn, collective, size, repeats))

    def compute(self, collective, size, world_size) -> CostView:
        self.group.resize(world_size)  # a no-op when it already has that many ranks
        key = (collective, world_size)
        new = key not in self.sweeps
        if new:
            self.sweeps[key] = self._sweep(collective, size, world_size)
        sweep = self.sweeps[key]
        alpha, beta = self.fit(sweep.sizes, sweep.medians, gloo_factor(collective, world_size))
        nearest = int(np.argmin(np.abs(np.log(sweep.sizes) - np.log(size))))
        expected = max(float(sweep.medians[nearest]), 1e-6)
        repeats = int(np.clip(SPOT_SECONDS / expected, MIN_REPEATS, MAX_REPEATS))
        spot = self.measure(collective, size, repeats)
        return CostView(sweep, float(alpha), float(beta), spot, new)

    def _sweep(self, collective: str, size: int, world_size: int) -> Sweep:
        """Measure a new sweep, the chosen ``size`` first and then the others from the
        smallest up. With two sizes or more measured, the learner sees them now and
        then (:data:`INTERIM_AFTER`): the fit of those sizes, and the chosen size's sweep
        measurement as this run's."""
        measured: dict[int, Timing] = {}
        start, show_at = time.monotonic(), INTERIM_AFTER
        for s in [size] + [s for s in self.sizes if s != size]:
            elapsed = time.monotonic() - start
            if len(measured) >= 2 and elapsed + expected_seconds(measured, s) >= show_at:
                self._show_sweep_so_far(collective, size, world_size, measured)
                show_at = 2 * max(elapsed, INTERIM_AFTER)
            measured[s] = self.measure(collective, s, sweep_repeats(s))
        return Sweep(collective, world_size, [measured[s] for s in self.sizes])

    def _show_sweep_so_far(self, collective: str, size: int, world_size: int,
                           measured: dict) -> None:
        sweep = Sweep(collective, world_size, [measured[s] for s in sorted(measured)])
        alpha, beta = self.fit(sweep.sizes, sweep.medians, gloo_factor(collective, world_size))
        rest = [size_label(s) for s in self.sizes if s not in measured]
        self.show_interim(CostView(sweep, float(alpha), float(beta), measured[size], True,
                                   len(rest)),
                          f"First visit of {collective} on {world_size} ranks: measuring a "
                          f"sweep of {len(self.sizes)} sizes, {len(measured)} done. Still to "
                          f"measure: {', '.join(rest)}. The figure shows the sizes measured "
                          f"so far and their fit; both change when the rest are in.")

    def explain_error(self, values: dict, err) -> str:
        """A sentence for a measurement that failed, most often one that ran past the
        group's timeout (large sizes on many ranks sharing few cores)."""
        n, cores = values["world_size"], available_cores()
        if "did not finish" in err.headline:
            return (f"The measurement of {values['collective']} on {n} ranks did not finish "
                    f"within the group's timeout ({self.group.timeout:g} s): with {n} ranks on "
                    f"{cores} cores the largest sizes take long. Pick a smaller world_size, or "
                    f"start the group with a longer timeout, e.g. LocalGroup(world_size=2, "
                    f"timeout=120).")
        return f"The ranks refused this measurement: {err.first_summary}"

    def draw(self, view: CostView) -> bytes:
        return explorer_figure(view)

    def describe(self, view: CostView) -> str:
        sweep, spot = view.sweep, view.spot
        n, f = sweep.world_size, gloo_factor(sweep.collective, sweep.world_size)
        predicted = float(model_seconds(view.alpha, view.beta, f, spot.size_bytes))
        star = crossover_bytes(view.alpha, view.beta, f)
        regime = "latency-bound" if spot.size_bytes < star else "bandwidth-bound"
        slow = spot.slowest
        text = (f"{sweep.collective} of {size_label(spot.size_bytes)} on {n} ranks: median "
                f"{seconds_label(spot.median)} over {len(slow)} repeats (slowest rank; "
                f"{seconds_label(slow.min())} to {seconds_label(slow.max())}); model α + β·f·S = {seconds_label(predicted)}, "
                f"{regime} (S* = {size_label(star)}). Fit: α = {seconds_label(view.alpha)}, "
                f"1/β = {_bandwidth(view.beta)}; busbw here "
                f"{busbw(sweep.collective, n, spot.size_bytes, spot.median) / 1e9:.3g} GB/s.")
        if view.new_sweep:
            text += f" (First visit: a sweep of {len(self.sizes)} sizes was measured.)"
        cores = available_cores()
        if n > cores:
            text += (f" ⚠ {n} ranks on {cores} cores: ranks take turns on the cores, so a "
                     f"small collective waits for the scheduler and α grows.")
        return text


def _bandwidth(beta: float) -> str:
    """``1/β`` in GB/s, or ``∞`` when the fit found no cost per byte."""
    return f"{1 / beta / 1e9:.3g} GB/s" if beta > 0 else "∞ (no cost per byte in these sizes)"
