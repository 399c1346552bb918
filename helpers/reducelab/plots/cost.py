"""Figures of notebook 10: what a collective costs, and how exact a sum over ranks is.

* :func:`fits_figure`: measured time against message size, log-log, one panel per world
  size, with the fitted α-β model drawn through the points and each crossover marked.
* :func:`explorer_figure`: the explorer's picture: one collective's sweep with its fit,
  the latency-bound and bandwidth-bound regimes and the crossover (left), and the spread
  of the measurement at the chosen size, rank by rank and for the slowest rank (right).
* :func:`precision_figure`: the relative error of a low-precision sum against the number
  of ranks.

Sources: the α-β model, Thakur, Rabenseifner & Gropp (2005), Int. J. High Performance
Computing Applications 19(1); busbw, NVIDIA/nccl-tests ``doc/PERFORMANCE.md``; the error
of a floating-point sum, N. J. Higham (1993), "The accuracy of floating point summation",
SIAM J. Sci. Comput. 14(4).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks.cost import crossover_bytes, gloo_factor, model_seconds, seconds_label, size_label
from . import MARKERS, MIN_FONT, PALETTE, RANK_COLOURS, TEXT_GREY, kept_figure, new_figure, png

HEIGHT = 4.2
"""Height of the explorer's figure, inches: controls and figure fit on one screen."""


def _log_y(ax, fmt=seconds_label) -> None:
    """Label a log y axis in plain units: decades over a wide range, 1-2-5 over a narrow one."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    lo, hi = ax.get_ylim()
    subs = (1.0,) if np.log10(hi / lo) > 2.5 else (1.0, 2.0, 5.0)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _byte_ticks(ax, lo: float, hi: float) -> None:
    ticks = [4 ** k for k in range(0, 20) if lo / 1.01 <= 4 ** k <= hi * 1.01]
    ticks = ticks[::2] if len(ticks) > 7 else ticks
    ax.set_xticks(ticks, [size_label(t).replace(" ", "\u2009") for t in ticks])
    ax.minorticks_off()


@dataclass
class Curve:
    """One measured curve and its fit, what :func:`fits_figure` draws.

    Attributes:
        label: legend text, e.g. ``"all_reduce"`` or ``"Python ring"``.
        sizes: bytes, shape ``(k,)``.
        medians: seconds, shape ``(k,)``: the median over repeats of the slowest rank.
        alpha, beta: the fit, seconds and seconds per byte sent.
        factor: bytes the busiest rank sends per byte of ``S`` on gloo
            (:func:`~reducelab.checks.cost.gloo_factor`), so the model is
            ``alpha + beta * factor * S``.
        lows, highs: the spread of each point, seconds, shape ``(k,)``: the fastest and
            the slowest repeat of the slowest rank (``None``: no spread drawn).
    """

    label: str
    sizes: np.ndarray
    medians: np.ndarray
    alpha: float
    beta: float
    factor: float
    lows: np.ndarray | None = None
    highs: np.ndarray | None = None


def curve(sweep, alpha: float, beta: float, label: str | None = None) -> Curve:
    """A :class:`Curve` from a :class:`~reducelab.widgets.cost.Sweep` and its fit, with the
    sweep's spread over repeats."""
    lows, highs = sweep.spread
    return Curve(label or sweep.label, sweep.sizes, sweep.medians, alpha, beta,
                 gloo_factor(sweep.collective, sweep.world_size), lows, highs)


def fits_figure(panels: dict[str, list[Curve]], title: str = "") -> bytes:
    """Measured time against size, log-log, with the fitted α-β model through the points.

    Args:
        panels: ``{panel title: [Curve, ...]}``, one panel per entry (at most 3), e.g.
            one per world size. Curve ``k`` of a panel gets colour and marker ``k``.
        title: the figure title.

    Returns:
        PNG bytes. Each point is a median with a bar from the fastest to the slowest
        repeat (when the curve has a spread); each fitted line is drawn over the measured
        range; the crossover ``S* = α / (β · factor)`` of each curve is a small vertical
        tick on its line.
    """
    fig = new_figure(9.6, 4.5)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    all_sizes = np.concatenate([c.sizes for cs in panels.values() for c in cs])
    all_times = np.concatenate([c.medians for cs in panels.values() for c in cs] +
                               [c.highs for cs in panels.values() for c in cs if c.highs is not None] +
                               [c.lows for cs in panels.values() for c in cs if c.lows is not None])
    for ax, (name, curves) in zip(axes, panels.items()):
        for k, c in enumerate(curves):
            colour, marker = RANK_COLOURS[k % 8], MARKERS[k % 8]
            xs = np.geomspace(c.sizes.min(), c.sizes.max(), 60)
            ax.plot(xs, model_seconds(c.alpha, c.beta, c.factor, xs), color=colour, lw=1.6,
                    ls=["-", "--", "-.", ":"][k % 4])
            dodge = c.sizes * 1.15 ** (k - (len(curves) - 1) / 2)   # side by side, not on top
            if c.lows is not None and c.highs is not None:
                ax.errorbar(dodge, c.medians, yerr=[c.medians - c.lows, c.highs - c.medians],
                            ls="none", color=colour, capsize=3, lw=1.2)
            ax.plot(dodge, c.medians, ls="none", marker=marker, color=colour, ms=6,
                    mfc="white", mew=1.5, label=c.label)
            star = crossover_bytes(c.alpha, c.beta, c.factor)
            if c.sizes.min() <= star <= c.sizes.max():
                ax.plot([star], [2 * c.alpha], ls="none", marker="|", ms=14, mew=2,
                        color=colour)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _byte_ticks(ax, all_sizes.min(), all_sizes.max())
        ax.set_ylim(all_times.min() / 2, all_times.max() * 8)
        ax.set_xlabel("message size S")
        ax.set_title(name)
        ax.grid(alpha=0.3, which="major")
    _log_y(axes[0])
    axes[0].set_ylabel("median time, slowest rank")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=MIN_FONT,
               ncols=min(len(labels), 4), frameon=False,
               title="points: median, bars: fastest to slowest repeat · lines: fitted α + β·f·S · |: crossover S*",
               title_fontsize=MIN_FONT)
    if title:
        fig.suptitle(title)
    return png(fig)


LABEL_BAND = 0.13
"""Fraction of the explorer's time axis kept free of measurements at the bottom, for
the labels of the two regimes."""
LEGEND_BAND = 0.28
"""Fraction kept free at the top, for the legend (three rows)."""


def _clear_bands(low: float, high: float) -> tuple[float, float]:
    """Limits of a log axis (seconds) on which measurements from ``low`` to ``high`` fill
    the middle, leaving :data:`LABEL_BAND` under them and :data:`LEGEND_BAND` above
    them, whatever their range (at least a decade)."""
    span = max(np.log10(high / low), 1.0) / (1 - LABEL_BAND - LEGEND_BAND)
    return low / 10 ** (LABEL_BAND * span), high * 10 ** (LEGEND_BAND * span)


def explorer_figure(view) -> bytes:
    """The explorer's figure for a :class:`~reducelab.widgets.cost.CostView`.

    Left: the sweep of ``view.sweep`` (medians with the range of the slowest rank over
    repeats), the fitted model ``α + β·f·S``, its two terms (``α``, the latency term, and
    ``β·f·S``, the bandwidth term), the crossover ``S*``, and the measurement just taken
    (a hollow star). Right: that measurement's spread: every repeat's time on each rank
    (colour and marker of the rank) and on the slowest rank (hollow stars), with the
    medians (bars) and the model's prediction (dashed). The legend and the names of the
    two regimes have bands of their own above and below the measurements
    (:func:`_clear_bands`), so no point or bar of a run covers them. An interim view (a
    sweep still being measured) says in the left title how many sizes it has so far,
    instead of ``f``.
    """
    sweep, spot = view.sweep, view.spot
    f = gloo_factor(sweep.collective, sweep.world_size)
    def make_axes(fig):
        grid = fig.add_gridspec(1, 2, width_ratios=[1.45, 1])
        return fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    fig, (ax, bx) = kept_figure(("cost explorer", spot.seconds.shape[0]), 9.6, HEIGHT, make_axes)
    lo_x, hi_x = min(sweep.sizes.min(), spot.size_bytes), max(sweep.sizes.max(), spot.size_bytes)
    xs = np.geomspace(lo_x, hi_x, 80)
    lows, highs = sweep.spread
    ax.errorbar(sweep.sizes, sweep.medians, yerr=[sweep.medians - lows, highs - sweep.medians],
                ls="none", marker="o", ms=6, mfc="white", mew=1.5, color=PALETTE["blue"],
                ecolor=PALETTE["blue"], capsize=3, label="sweep: median, min..max")
    ax.plot(xs, model_seconds(view.alpha, view.beta, f, xs), color=PALETTE["black"], lw=1.8,
            label="model α + β·f·S")
    ax.plot(xs, np.full_like(xs, view.alpha), color=PALETTE["vermillion"], ls=":", lw=1.6,
            label="latency term α")
    ax.plot(xs, view.beta * f * xs, color=PALETTE["green"], ls="--", lw=1.6,
            label="bandwidth term β·f·S")
    star = crossover_bytes(view.alpha, view.beta, f)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(*_clear_bands(min(lows.min(), spot.slowest.min()),
                              max(highs.max(), spot.slowest.max())))
    if lo_x <= star <= hi_x:
        ax.axvline(star, color=TEXT_GREY, lw=1, ls="-.", label=f"crossover S* = {size_label(star)}")
    # the two regimes are named in the band under the lowest measurement (the bandwidth
    # term crosses it left of S*, where it falls below α)
    ax.text(0.02, 0.03, "latency-bound: t ≈ α", transform=ax.transAxes,
            fontsize=MIN_FONT, color=PALETTE["vermillion"], ha="left", va="bottom")
    ax.text(0.98, 0.03, "bandwidth-bound", transform=ax.transAxes,
            fontsize=MIN_FONT, color=PALETTE["green"], ha="right", va="bottom")
    ax.plot([spot.size_bytes], [spot.median], ls="none", marker="*", ms=17, mfc="white",
            mec=PALETTE["black"], mew=1.5, label="this run (median)")
    _byte_ticks(ax, lo_x, hi_x)
    _log_y(ax)
    ax.set_xlabel("message size S")
    ax.set_ylabel("time (slowest rank)")
    to_measure = view.to_measure
    ax.set_title(f"{sweep.collective}, {sweep.world_size} ranks: "
                 + (f"{len(sweep.sizes)} of {len(sweep.sizes) + to_measure} sizes so far"
                    if to_measure else f"f = {f:.3g}"))
    ax.grid(alpha=0.3, which="major")
    ax.legend(loc="upper left", fontsize=MIN_FONT, ncols=2)

    n = spot.seconds.shape[0]
    columns = [spot.seconds[r] for r in range(n)] + [spot.slowest]
    names = [f"rank {r}" for r in range(n)] + ["slowest"]
    for k, values in enumerate(columns):
        last = k == n
        jitter = np.linspace(-0.22, 0.22, len(values)) if len(values) > 1 else np.zeros(1)
        if last:
            bx.plot(k + jitter, values, ls="none", marker="*", ms=10, mfc="white",
                    mec=PALETTE["black"], mew=1.2)
        else:
            bx.plot(k + jitter, values, ls="none", marker=MARKERS[k % 7], ms=5,
                    color=RANK_COLOURS[k % 8], alpha=0.85)
        med = float(np.median(values))
        bx.plot([k - 0.32, k + 0.32], [med, med], color=PALETTE["black"], lw=2)
    predicted = float(model_seconds(view.alpha, view.beta, f, spot.size_bytes))
    bx.axhline(predicted, color=PALETTE["black"], ls="--", lw=1.2)
    bx.set_yscale("log")
    all_values = np.concatenate(columns)
    bx.set_ylim(min(all_values.min(), predicted) / 1.6, max(all_values.max(), predicted) * 1.6)
    _log_y(bx)
    bx.set_xticks(range(n + 1), names, rotation=45 if n > 4 else 0)
    bx.set_xlim(-0.6, n + 0.6)
    bx.set_title(f"S = {size_label(spot.size_bytes)}: {spot.seconds.shape[1]} repeats\n"
                 f"bar: median · dashed: model", fontsize=MIN_FONT + 1)
    bx.grid(alpha=0.3, axis="y", which="major")
    return png(fig)


def precision_figure(rows: list[dict], title: str = "") -> bytes:
    """Relative error of a sum against the number of ranks, log y.

    Args:
        rows: dicts with ``world_size`` (int) and any number of series ``{label: error}``
            under the key ``errors`` (relative errors against a float64 reference, > 0).
        title: the figure title.

    Returns:
        PNG bytes: one line per series, each with its own marker and line style, labelled
        at its right end.
    """
    fig = new_figure(8.0, 3.8)
    ax = fig.add_subplot()
    ns = [r["world_size"] for r in rows]
    labels = list(rows[0]["errors"])
    for k, label in enumerate(labels):
        ys = [max(r["errors"][label], 1e-12) for r in rows]
        colour = RANK_COLOURS[k % 8]
        ax.plot(ns, ys, marker=MARKERS[k % 8], color=colour, ls=["-", "--", "-.", ":"][k % 4],
                lw=1.6, ms=6, mfc="white", mew=1.5)
        ax.text(ns[-1] * 1.06, ys[-1], label, fontsize=MIN_FONT, va="center", ha="left",
                color=colour if k % 8 != 6 else TEXT_GREY)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.set_xlim(min(ns) / 1.15, max(ns) * 3.2)
    _log_y(ax, lambda v: f"{v:.0e}".replace("e-0", "e-"))
    ax.set_xlabel("world_size (ranks summed)")
    ax.set_ylabel("relative error ‖sum − exact‖ / ‖exact‖")
    ax.grid(alpha=0.3, which="major")
    if title:
        ax.set_title(title)
    return png(fig)
