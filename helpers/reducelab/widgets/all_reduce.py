"""The all_reduce explorer of notebook 01: pick a ReduceOp, world size, input and dtype.

Source: ``torch.distributed.all_reduce`` and ``ReduceOp``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce ; gloo's
AVG is a SUM followed by a division (pytorch/pytorch#149781, torch 2.8); the learner
question "Why do values increase significantly after `torch.dist.all_reduce`?"
(2025-01-30).
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..errors import RankError
from ..group import LocalGroup
from ..plots import RankHeatmaps, fmt_value
from . import Explorer

REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
"""The ``dist.ReduceOp`` names the explorer offers (PREMUL_SUM is NCCL/XCCL only)."""
PATTERNS = ("rank+1", "signed", "random ints", "one-hot")
"""Input patterns: ``rank+1`` everywhere; ``signed``, +1, -1, +2, -2, ... by rank (signed,
as gradients are: an even number of ranks sums to 0); ints 0..7 seeded by rank; 1 at
element ``rank``."""
DTYPES = ("float32", "int64")
BITWISE = ("BAND", "BOR", "BXOR")


def refusal(op: str, dtype: str, err: RankError | None = None) -> str:
    """One sentence on why gloo refuses ``op`` on ``dtype``, or the rank's own message."""
    if op in BITWISE and dtype != "int64":
        return (f"gloo refuses {op} on {dtype}: bitwise AND/OR/XOR combine the bits of "
                f"integers, so they are defined for integer dtypes only. Pick int64.")
    if op == "AVG" and dtype == "int64":
        return ("gloo refuses AVG on int64: its AVG is a SUM and then a true division by "
                "world_size, whose result is float whatever the values, and a float cannot be "
                "written back into an int64 tensor in place. The error comes after the SUM, "
                "which stays in the tensor. Pick float32, or use SUM and divide yourself.")
    if err is not None:
        first = err.first_summary
        return f"gloo refused {op} on {dtype}: {first}"
    return f"gloo refused {op} on {dtype}."


@dataclass
class AllReduceResult:
    """Per-rank tensors before and after one all_reduce.

    Attributes:
        op, pattern, dtype: the settings used.
        before, after: ``numpy`` arrays of shape ``(world_size, n)``, the input and the
            result on each rank (dtype float32 or int64, as the dtype control says).
    """

    op: str
    pattern: str
    dtype: str
    before: np.ndarray
    after: np.ndarray

    @property
    def world_size(self) -> int:
        return self.before.shape[0]


class AllReduceExplorer(Explorer):
    """Widget: run ``fn(op, pattern, dtype, n)`` on every rank and plot before/after.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on; the world-size slider
            resizes it.
        fn: the rank function from the notebook. Called on every rank as
            ``fn(op, pattern, dtype, n)`` with ``op`` a name from :data:`REDUCE_OPS`,
            ``pattern`` from :data:`PATTERNS`, ``dtype`` from :data:`DTYPES`; it must
            return ``(before, after)``, two 1-D tensors of length ``n``.
        n: elements per rank (int, 1..16).
        op, world_size, pattern, dtype: initial control values.

    Raises:
        ValueError: an initial value outside the choices above.
    """

    def __init__(self, group: LocalGroup, fn, n: int = 6, op: str = "SUM",
                 world_size: int | None = None, pattern: str = "rank+1",
                 dtype: str = "float32"):
        for name, value, choices in (("op", op, REDUCE_OPS), ("pattern", pattern, PATTERNS),
                                     ("dtype", dtype, DTYPES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        if not isinstance(n, int) or not 1 <= n <= 16:
            raise ValueError(f"n must be an int from 1 to 16, got {n!r}")
        self.group, self.fn, self.n = group, fn, n
        self.plot = RankHeatmaps(("before all_reduce", "after all_reduce"))
        world_size = world_size or group.world_size
        style = {"description_width": "initial"}
        super().__init__({
            "op": W.Dropdown(options=REDUCE_OPS, value=op, description="ReduceOp",
                             style=style),
            "world_size": W.IntSlider(value=world_size, min=1, max=8, description="world_size",
                                      continuous_update=False, style=style),
            "pattern": W.Dropdown(options=PATTERNS, value=pattern, description="input",
                                  style=style),
            "dtype": W.ToggleButtons(options=DTYPES, value=dtype, description="dtype",
                                     style={**style, "button_width": "80px"}),
        })
        self.refresh()

    def compute(self, op, world_size, pattern, dtype) -> AllReduceResult:
        self.group.resize(world_size)  # no-op when it already has that many ranks
        out = self.group.run(self.fn, op, pattern, dtype, self.n)
        before = np.stack([b.numpy() for b, _ in out])
        after = np.stack([a.numpy() for _, a in out])
        return AllReduceResult(op, pattern, dtype, before, after)

    def preparation(self, op, world_size, pattern, dtype):
        return self.plot.preparation(world_size, self.n)  # a new world size's figure

    def draw(self, result: AllReduceResult) -> bytes:
        return self.plot.draw([result.before, result.after],
                              title=f"all_reduce(op=ReduceOp.{result.op}) on "
                                    f"{result.world_size} ranks, {result.dtype}")

    def describe(self, result: AllReduceResult) -> str:
        """One line: what the ranks hold afterwards, and how the largest magnitude
        changed (the scale, which SUM multiplies by at most ``world_size``)."""
        same = bool((result.after == result.after[0]).all())
        row = ", ".join(fmt_value(v) for v in result.after[0])
        where = "every rank holds" if same else "rank 0 holds"
        largest_in = float(np.abs(result.before).max())
        largest_out = float(np.abs(result.after).max())
        return (f"After all_reduce({result.op}) {where} [{row}]. Largest |value|: "
                f"{fmt_value(largest_in)} before, {fmt_value(largest_out)} after "
                f"(world_size={result.world_size}).")

    def explain_error(self, values: dict, err: RankError) -> str:
        return refusal(values["op"], values["dtype"], err)
