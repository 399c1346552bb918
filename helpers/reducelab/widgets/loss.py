"""The loss-aggregation explorer of notebook 03: set each rank's local batch size and
compare ``all_reduce(loss) / world_size`` with the batch-size-weighted global mean.

Source: ``torch.distributed.all_reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; the
learner question "How can I aggregate losses from all GPUs in DistributedDataParallel?"
(2025-01-30).
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..group import LocalGroup
from ..plots.loss import LossAggregationPlot
from . import Explorer

MAX_WORLD_SIZE = 8
"""Most ranks the explorer starts (one local batch size per rank)."""
MAX_LOCAL_BATCH = 64
"""Largest local batch size accepted for one rank."""


def parse_batch_sizes(text: str) -> list[int]:
    """Parse ``"3,5,8,2"`` into ``[3, 5, 8, 2]``: one local batch size per rank.

    Args:
        text: comma-separated whole numbers (spaces allowed), 1 to
            :data:`MAX_WORLD_SIZE` of them, each from 1 to :data:`MAX_LOCAL_BATCH`.

    Returns:
        ``list[int]``; its length is the world_size.

    Raises:
        TypeError: ``text`` is not a ``str``.
        ValueError: an entry is not a whole number, is out of range, or there are too
            few or too many entries; the message says what is accepted.
    """
    if not isinstance(text, str):
        raise TypeError(f"local batch sizes must be a str such as '3,5,8,2', got {type(text).__name__}")
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not 1 <= len(parts) <= MAX_WORLD_SIZE:
        raise ValueError(f"Type 1 to {MAX_WORLD_SIZE} local batch sizes, one per rank, "
                         f"separated by commas, such as 3,5,8,2; got {len(parts)}.")
    sizes = []
    for p in parts:
        if not p.isdigit():
            raise ValueError(f"Local batch sizes are whole numbers from 1 to {MAX_LOCAL_BATCH}, "
                             f"separated by commas, such as 3,5,8,2; got {p!r}.")
        n = int(p)
        if not 1 <= n <= MAX_LOCAL_BATCH:
            raise ValueError(f"Each local batch size is a whole number from 1 to "
                             f"{MAX_LOCAL_BATCH}, such as 3,5,8,2; got {n}.")
        sizes.append(n)
    return sizes


# The function the ranks run lives in checks.loss, a module a rank imports in
# milliseconds: one in this module would make every new rank import ipywidgets and
# matplotlib (about 0.4 s of CPU each) at its first call.
from ..checks.loss import losses_on_rank as _on_rank  # noqa: E402


@dataclass
class LossResult:
    """One run of the explorer.

    Attributes:
        local_batch_sizes: local batch size of each rank; its length is the world_size.
        losses: per rank, a float64 ``numpy`` array of that rank's per-sample losses.
        mean_of_means: ``all_reduce(loss) / world_size`` as rank 0 computed it.
        weighted: ``all_reduce(loss_sum) / all_reduce(count)`` as rank 0 computed it.
        reference: mean of the concatenated global batch, computed in the kernel.
        agree: whether every rank computed the same two numbers (tolerance 1e-6).
    """

    local_batch_sizes: list[int]
    losses: list[np.ndarray]
    mean_of_means: float
    weighted: float
    reference: float
    agree: bool

    @property
    def world_size(self) -> int:
        return len(self.local_batch_sizes)


class LossExplorer(Explorer):
    """Widget: a text field of local batch sizes, one per rank -> real all_reduce runs.

    Args:
        group: the :class:`~reducelab.LocalGroup`; it is resized to the number of batch
            sizes given (1 to :data:`MAX_WORLD_SIZE`).
        per_sample_losses: the notebook's rank function ``f(local_batch_sizes) -> Tensor``:
            this rank's per-sample losses, a 1-D float tensor of length
            ``local_batch_sizes[rank]``.
        mean_of_means: the notebook's rank function ``f(local_batch_sizes) -> Tensor`` that
            returns ``all_reduce(local mean) / world_size`` (a scalar tensor).
        weighted_mean: the notebook's rank function ``f(local_batch_sizes) -> Tensor`` that
            returns ``all_reduce(local sum) / all_reduce(local count)``.
        local_batch_sizes: initial text, e.g. ``"3,5,8,2"``.

    Raises:
        TypeError: a rank function is not callable.
        ValueError: ``local_batch_sizes`` cannot be parsed (see :func:`parse_batch_sizes`).

    The single-process reference is the mean of the concatenated per-sample losses, as
    one process holding the whole global batch computes it.
    """

    def __init__(self, group: LocalGroup, per_sample_losses, mean_of_means, weighted_mean,
                 local_batch_sizes: str = "3,5,8,2"):
        for name, f in (("per_sample_losses", per_sample_losses), ("mean_of_means", mean_of_means),
                        ("weighted_mean", weighted_mean)):
            if not callable(f):
                raise TypeError(f"{name} must be a rank function, got {f!r}")
        parse_batch_sizes(local_batch_sizes)
        self.group = group
        self.fns = (per_sample_losses, (mean_of_means, weighted_mean))
        self.plot = LossAggregationPlot()
        self.input_error: str | None = None
        controls = {"local_batch_sizes": W.Text(value=local_batch_sizes, description="local batch sizes",
                                          continuous_update=False,
                                          style={"description_width": "initial"})}
        super().__init__(controls)
        self.refresh()

    def refresh(self) -> None:
        """Parse the text; refuse bad input with one sentence that names what is valid,
        and a note in place of the old figure; else run on the ranks."""
        try:
            parse_batch_sizes(self.controls["local_batch_sizes"].value)
        except ValueError as e:
            self.input_error = str(e)
            self.result, self.error = None, None
            self._refuse(self.input_error)
            return
        self.input_error = None
        super().refresh()

    def compute(self, local_batch_sizes: str) -> LossResult:
        sizes = parse_batch_sizes(local_batch_sizes)
        self.group.resize(len(sizes))  # no-op when it already has that many ranks
        per_sample, aggs = self.fns
        out = self.group.run(_on_rank, per_sample, aggs, sizes)
        losses = [np.asarray(o[0], dtype=np.float64).ravel() for o in out]
        values = np.array([o[1] for o in out], dtype=np.float64)  # (world_size, 2)
        agree = bool(np.allclose(values, values[0], rtol=1e-6, atol=1e-6))
        reference = float(np.concatenate(losses).mean())
        return LossResult(sizes, losses, float(values[0, 0]), float(values[0, 1]), reference, agree)

    def preparation(self, local_batch_sizes: str):
        try:
            sizes = parse_batch_sizes(local_batch_sizes)
        except ValueError:
            return None                                # refused before any run
        return self.plot.preparation(len(sizes))      # a new world size's figure

    def draw(self, result: LossResult) -> bytes:
        return self.plot.draw(result.losses, result.mean_of_means, result.weighted, result.reference)

    def describe(self, result: LossResult) -> str:
        shown = round(result.mean_of_means, 4), round(result.reference, 4)   # as printed
        off = abs(result.weighted - result.reference) > 1e-5 * max(1.0, abs(result.reference))
        parts = [f"world_size={result.world_size}, global batch={sum(result.local_batch_sizes)}: "
                 f"reference {result.reference:.4f}, "
                 f"weighted {result.weighted:.4f}{' (differs!)' if off else ' (matches)'}, "
                 f"mean of means {result.mean_of_means:.4f} "
                 + ("(equal)" if shown[0] == shown[1] else f"(off by {shown[0] - shown[1]:+.4f})")]
        if not result.agree:
            parts.append("; the ranks did not all compute the same numbers")
        return "".join(parts)

    def text(self) -> str:
        if self.input_error is not None:
            return f"{type(self).__name__}(local_batch_sizes={self.controls['local_batch_sizes'].value})\n{self.input_error}"
        return super().text()
