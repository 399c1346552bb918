"""The bucket explorer of notebook 16: DDP's buckets, on real ranks, as ``bucket_cap_mb``,
the communication hook and the world size change.

Every change runs the notebook's rank function on the ranks: a DDP model, two passes for
DDP to rebuild its buckets, then a few timed passes, each recording when every gradient
became ready and when every bucket's all_reduce was launched and finished. The figure
shows the timeline of the median pass and ``backward()``'s time in every pass; the
message gives the buckets, the bytes all-reduced, the spread of the passes and the gradient's
error against float32 (the float32 hook's gradient at the same world size, measured once
per world size).

Sources: S. Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", PVLDB 13(12), 2020 (buckets, overlap); the DDP communication hooks,
https://pytorch.org/docs/stable/ddp_comm_hooks.html.
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..checks.cost import seconds_label, size_label
from ..determinism import within
from ..group import LocalGroup
from ..plots.buckets import explorer_figure
from . import Explorer

CAPS = ("None", "1", "0.25", "0.05")
"""The ``bucket_cap_mb`` values offered, as the dropdown shows them (``"None"``: DDP's
default, a first bucket of 1 MiB and then 25 MiB)."""
FLOAT32 = "allreduce_hook (float32)"
"""The hook whose gradient every other hook's is compared with."""
HOOKS = (FLOAT32, "fp16_compress_hook", "bf16, under another name")
"""The hooks offered by default (names of the notebook's ``HOOKS``)."""
TOLERANCES = {FLOAT32: 1e-6, "fp16_compress_hook": 1e-3, "bf16, under another name": 1e-2}
"""The bound each hook's relative error is shown against (:func:`reducelab.determinism.within`):
float32 rounding, and the 11 and 8 significant bits of fp16 and bf16."""
MIN_WORLD_SIZE, MAX_WORLD_SIZE = 2, 4
PASSES = 5
"""Timed passes per refresh, after DDP's two passes that rebuild its buckets."""


def cap_value(text: str):
    """``bucket_cap_mb`` from the dropdown's text: ``None`` or a float (MiB)."""
    return None if text == "None" else float(text)


@dataclass
class BucketView:
    """What the explorer shows.

    Attributes:
        bucket_cap_mb: the dropdown's text (``"None"`` or a number of MiB).
        hook: the communication hook's name.
        world_size: ranks that took part.
        passes: rank 0's timed passes, each a dict with ``ready``, ``buckets``, ``end_ms``
            and ``bytes_sent`` (see the notebook's rank function).
        end_ms: float64 array ``(world_size, passes)``: when ``backward()`` returned, ms.
        bucket_bytes: the buckets' sizes, bytes of float32 gradients, bucket 0 first.
        bytes_sent: bytes the hook passed to ``dist.all_reduce`` in one pass.
        error: the gradient's relative error against the float32 hook's (``‖g − g32‖ / ‖g32‖``).
    """

    bucket_cap_mb: str
    hook: str
    world_size: int
    passes: list
    end_ms: np.ndarray
    bucket_bytes: list
    bytes_sent: int
    error: float

    @property
    def slowest_ms(self) -> np.ndarray:
        """When ``backward()`` returned on the slowest rank, each pass, ms."""
        return self.end_ms.max(axis=0)

    @property
    def median_pass(self) -> dict:
        """Rank 0's pass whose slowest-rank time is the median one."""
        order = np.argsort(self.slowest_ms)
        return self.passes[int(order[len(order) // 2])]

    @property
    def launched_early(self) -> int:
        """Passes in which rank 0 launched bucket 0 before its last gradient was ready (so
        while ``backward()`` was still computing)."""
        return sum(p["buckets"][0][0] < max(t for t, _ in p["ready"])
                   for p in self.passes if p["buckets"] and p["ready"])


class BucketExplorer(Explorer):
    """Widget: DDP's buckets on real ranks, as ``bucket_cap_mb``, the hook and the world
    size change.

    Args:
        group: the :class:`~reducelab.LocalGroup`; the world-size slider resizes it.
        fn: the notebook's rank function ``fn(bucket_cap_mb, hook, passes)``; on each rank
            it returns a dict with ``passes`` (a list of ``passes`` dicts with ``ready``,
            ``buckets``, ``end_ms`` and ``bytes_sent``) and ``gradient`` (the flat
            gradient after the last pass, a float32 tensor).
        bucket_cap_mb: initial value, one of :data:`CAPS`.
        hook: initial hook, one of ``hooks``.
        world_size: initial world size, 2 to 4 (default: the group's, within that range).
        hooks: the hook names offered; the first is the float32 reference.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: an initial value outside the choices above.
    """

    def __init__(self, group: LocalGroup, fn, bucket_cap_mb: str = "None",
                 hook: str = FLOAT32, world_size: int | None = None, hooks=HOOKS):
        if not callable(fn):
            raise TypeError(f"fn must be the notebook's rank function, got {fn!r}")
        hooks = tuple(hooks)
        if bucket_cap_mb not in CAPS:
            raise ValueError(f"bucket_cap_mb must be one of {', '.join(CAPS)} (as text); "
                             f"got {bucket_cap_mb!r}")
        if hook not in hooks:
            raise ValueError(f"hook must be one of {', '.join(hooks)}; got {hook!r}")
        world_size = world_size or min(max(group.world_size, MIN_WORLD_SIZE), MAX_WORLD_SIZE)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or \
                not MIN_WORLD_SIZE <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int from {MIN_WORLD_SIZE} to "
                             f"{MAX_WORLD_SIZE}, got {world_size!r}")
        self.group, self.fn, self.hooks = group, fn, hooks
        self.references: dict[int, object] = {}
        style = {"description_width": "initial"}
        super().__init__({
            "bucket_cap_mb": W.Dropdown(options=CAPS, value=bucket_cap_mb,
                                        description="bucket_cap_mb", style=style),
            "hook": W.Dropdown(options=hooks, value=hook, description="comm hook", style=style),
            "world_size": W.IntSlider(value=world_size, min=MIN_WORLD_SIZE, max=MAX_WORLD_SIZE,
                                      description="world_size", continuous_update=False,
                                      style=style),
        })
        self.refresh()

    def compute(self, bucket_cap_mb, hook, world_size) -> BucketView:
        self.group.resize(world_size)      # a no-op when it already has that many ranks
        out = self.group.run(self.fn, cap_value(bucket_cap_mb), hook, PASSES)
        if world_size not in self.references:
            reference = out if hook == self.hooks[0] else \
                self.group.run(self.fn, None, self.hooks[0], 1)
            self.references[world_size] = reference[0]["gradient"]
        ref = self.references[world_size]
        gradient = out[0]["gradient"]
        error = float((gradient - ref).norm() / ref.norm())
        passes = out[0]["passes"]
        end_ms = np.array([[p["end_ms"] for p in rank["passes"]] for rank in out])
        last = passes[-1]
        return BucketView(bucket_cap_mb, hook, world_size, passes, end_ms,
                          [b[4] for b in last["buckets"]], int(last["bytes_sent"]), error)

    def draw(self, view: BucketView) -> bytes:
        return explorer_figure(view)

    def describe(self, view: BucketView) -> str:
        slow = view.slowest_ms / 1e3
        total = sum(view.bucket_bytes)
        tol = TOLERANCES.get(view.hook, 1e-2)
        return (f"{view.hook}, bucket_cap_mb={view.bucket_cap_mb}, {view.world_size} ranks: "
                f"{len(view.bucket_bytes)} buckets ({', '.join(size_label(b) for b in view.bucket_bytes)} "
                f"of float32 gradients, bucket 0 first); {view.bytes_sent:,} bytes all-reduced per pass "
                f"({view.bytes_sent / total:.0%} of the gradients' {total:,}). backward() returned "
                f"after a median of {seconds_label(float(np.median(slow)))} over {len(slow)} "
                f"passes (slowest rank; {seconds_label(float(slow.min()))} to "
                f"{seconds_label(float(slow.max()))}); rank 0 launched bucket 0 before its "
                f"last gradient was ready in {view.launched_early} of {len(view.passes)} passes. "
                f"Gradient's relative error against float32: {within(view.error, tol)}.")
