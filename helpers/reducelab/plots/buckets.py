"""Figures of notebook 16: how DDP hides the cost of its all_reduces.

* :func:`timeline_figure`: when each gradient became ready during ``backward()`` and when
  each DDP bucket's all_reduce was launched and done, one panel per run.
* :func:`explorer_figure`: the bucket explorer's picture: the timeline of the median pass
  (left) and ``backward()``'s time in every pass, rank by rank's slowest (right).

Source: DDP's buckets and their overlap with ``backward()``, S. Li et al. (2020),
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", PVLDB 13(12),
section 3.2.
"""
from __future__ import annotations

import numpy as np

from ..checks.cost import size_label
from . import HATCHES, MARKERS, MIN_FONT, PALETTE, RANK_COLOURS, kept_figure, new_figure, png


def _right_ms(run: dict) -> float:
    """The last time on ``run``'s timeline: ``backward()``'s return or a bucket's end, in ms."""
    return max([run["end_ms"]] + [b[1] for b in run["buckets"]])


def _timeline(ax, run: dict, names_axis: bool = True, right: float | None = None) -> None:
    """Draw one run's timeline on ``ax`` (see :func:`timeline_figure` for ``run``); the x axis
    runs to 1.5 times ``right`` ms (by default, this run's own last time)."""
    from matplotlib.patches import Rectangle
    order = [name for _, name in run["ready"]]
    row = {name: i for i, name in enumerate(order)}
    bucket_of = {name: k for k, (_, _, _, names, *_) in enumerate(run["buckets"])
                 for name in names}
    for t, name in run["ready"]:
        k = bucket_of.get(name, 0)
        ax.plot([t], [row[name]], ls="none", marker=MARKERS[k % 8], ms=6,
                color=RANK_COLOURS[k % 8])
    for k, (start, done, index, names, *_) in enumerate(run["buckets"]):
        rows = [row[n] for n in names if n in row]
        if not rows:
            continue
        y0, y1 = min(rows) - 0.4, max(rows) + 0.4
        ax.add_patch(Rectangle((start, y0), max(done - start, 1e-3), y1 - y0,
                               facecolor=RANK_COLOURS[k % 8], alpha=0.25,
                               edgecolor=RANK_COLOURS[k % 8], hatch=HATCHES[(k + 1) % 8],
                               lw=1.2))
        ax.text(done, (y0 + y1) / 2, f" bucket {index}", fontsize=MIN_FONT, va="center",
                ha="left")
    ax.axvline(run["end_ms"], color=PALETTE["black"], ls="--", lw=1.2)
    ax.text(run["end_ms"], -0.5, " backward() returns", fontsize=MIN_FONT,
            ha="left", va="top")
    ax.set_xlim(0, (right if right is not None else _right_ms(run)) * 1.5)
    ax.set_xlabel("ms since backward() started")
    ax.grid(alpha=0.3, axis="x")
    if names_axis:
        ax.set_yticks(range(len(order)), order)
        ax.set_ylabel("gradient (in the order it became ready)")
    ax.set_ylim(len(order) - 0.4, -0.6)


def timeline_figure(runs: list[dict], title: str = "", label: str = "rank 0, median pass") -> bytes:
    """When each gradient was ready during ``backward()`` and when each DDP bucket's
    all_reduce ran, one panel per run (at most 2 side by side), on one shared x axis, so
    that where ``backward()`` returns compares across panels (a fifth review, 16-1: each
    panel's own axis put it at the same place by construction).

    Args:
        runs: dicts with keys ``title`` (str), ``ready`` (list of ``(ms, name)``: when
            ``name``'s gradient was accumulated, milliseconds since ``backward()``
            started), ``buckets`` (list of ``(launched_ms, done_ms, index, names, ...)``:
            the comm hook's call, its all_reduce's completion, the bucket's index and its
            parameters' names; further items are ignored) and ``end_ms`` (when
            ``backward()`` returned).
        title: the figure title.
        label: what each panel shows, after its run's title (notebook 16 passes rank 0's
            median pass, while its text judges by the slowest rank).

    Returns:
        PNG bytes: one row per parameter, in the order the gradients became ready; a
        marker where each became ready (marker and colour of its bucket); a hatched box
        per bucket spanning its parameters' rows, from the launch of its all_reduce to
        its completion, labelled.
    """
    fig = new_figure(9.6, 4.4)
    axes = fig.subplots(1, len(runs), sharey=True, sharex=True, squeeze=False)[0]
    right = max(_right_ms(run) for run in runs)
    for k, (ax, run) in enumerate(zip(axes, runs)):
        _timeline(ax, run, names_axis=k == 0, right=right)
        ax.set_title(f"{run['title']}: {label}" if label else run["title"])
    if title:
        fig.suptitle(title)
    return png(fig)


def explorer_figure(view) -> bytes:
    """The bucket explorer's figure for a :class:`~reducelab.widgets.buckets.BucketView`.

    Left: the timeline of the median pass on rank 0 (by the time ``backward()`` returned).
    Right: when ``backward()`` returned in every timed pass, on each rank (colour and
    marker of the rank) and on the slowest rank (hollow stars), with the median of the
    slowest (a bar), in milliseconds.
    """
    def make_axes(fig):
        grid = fig.add_gridspec(1, 2, width_ratios=[1.7, 1])
        return fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    fig, (ax, bx) = kept_figure("bucket explorer", 9.6, 4.6, make_axes)
    _timeline(ax, view.median_pass)
    ax.set_title(f"{view.hook}, bucket_cap_mb={view.bucket_cap_mb}:\n"
                 f"{len(view.bucket_bytes)} buckets on {view.world_size} ranks, "
                 f"the median pass of rank 0", fontsize=MIN_FONT + 1)
    ends = view.end_ms                                   # (world_size, passes)
    n = ends.shape[0]
    columns = [ends[r] for r in range(n)] + [ends.max(axis=0)]
    names = [f"rank {r}" for r in range(n)] + ["slowest"]
    for k, values in enumerate(columns):
        jitter = np.linspace(-0.22, 0.22, len(values)) if len(values) > 1 else np.zeros(1)
        if k == n:
            bx.plot(k + jitter, values, ls="none", marker="*", ms=10, mfc="white",
                    mec=PALETTE["black"], mew=1.2)
            bx.plot([k - 0.32, k + 0.32], [np.median(values)] * 2, color=PALETTE["black"], lw=2)
        else:
            bx.plot(k + jitter, values, ls="none", marker=MARKERS[k % 7], ms=5,
                    color=RANK_COLOURS[k % 8], alpha=0.85)
    bx.set_xticks(range(n + 1), names, rotation=45 if n > 3 else 0)
    bx.set_xlim(-0.6, n + 0.6)
    bx.set_ylim(0, ends.max() * 1.25)
    bx.set_ylabel("backward() returned (ms)")
    sent = size_label(view.bytes_sent)
    bx.set_title(f"{ends.shape[1]} passes · bar: median\n{sent} all-reduced per pass",
                 fontsize=MIN_FONT + 1)
    bx.grid(alpha=0.3, axis="y")
    return png(fig)
