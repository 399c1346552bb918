"""The sharding explorer of notebooks 08 and 15: pick the world size, the sharding (DDP,
ZeRO-1, ZeRO-2, ZeRO-3; and FSDP2 in notebook 15) and the dtype gradients are reduced in;
every change runs one real Adam step of the notebook's rank functions on the ranks.

The figure shows what each rank holds of the parameters before the step, of the reduced
gradient and of the parameters after it; the bytes each rank keeps beside the ZeRO
paper's formula; and the bytes each rank sends, by collective, beside the ring formula.

Sources: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020, arXiv:1910.02054; ``torch.distributed.fsdp.fully_shard``,
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np
import torch

from ..checks.sharded import ATOL, LR, NUMEL, make_model, placed, placed_dtensors, reference_run  # noqa: F401 (re-exported)
from ..determinism import within
from ..errors import RankError
from ..group import LocalGroup
from ..plots.sharded import COLLECTIVES, ShardingFigure, memory_formula, sent_formula
from . import Explorer

SHARDINGS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2")
"""Every sharding the explorer can offer: what each rank keeps between steps. FSDP2 is
offered only with an ``fsdp_train`` (notebook 15); notebook 08 offers the first four."""
REDUCE_DTYPES = ("float32", "bfloat16")
"""The dtypes a gradient can be reduced in."""
MAX_WORLD_SIZE = 8


@dataclass
class ShardingResult:
    """One Adam step of one sharding on real ranks.

    Attributes:
        world_size, sharding, reduce_dtype: the settings.
        before, grad, after: float64 arrays of shape ``(world_size, NUMEL)``: the
            parameters each rank holds before the step, the gradient it keeps after the
            reduction, the parameters it holds after the step; NaN where it holds nothing.
        memory: per rank, ``{kind: bytes}`` kept between steps (measured from its tensors).
        sent: per rank, ``{collective: bytes}`` sent in the step (ring formula applied to
            the tensors passed to each collective).
        error: largest ``|parameter - one process's parameter|`` after the step, over
            every rank and element.
    """

    world_size: int
    sharding: str
    reduce_dtype: str
    before: np.ndarray
    grad: np.ndarray
    after: np.ndarray
    memory: list
    sent: list
    error: float

    @property
    def grad_bytes(self) -> int:
        return 2 if self.reduce_dtype == "bfloat16" else 4


class ShardingExplorer(Explorer):
    """Widget: world_size, sharding and reduce dtype -> one real Adam step on the ranks.

    Args:
        group: the notebook's :class:`~reducelab.LocalGroup`; the world-size slider
            resizes it.
        zero_train: the rank function for DDP and ZeRO (notebook 08's, or its copy in
            :mod:`reducelab.checks.sharded` in notebook 15), called on every rank as
            ``zero_train(sharding, X, y, 1, reduce_dtype)``.
        fsdp_train: notebook 15's FSDP2 rank function, called as
            ``fsdp_train(X, y, 1, reduce_dtype)``; ``None`` (notebook 08): the explorer
            offers DDP and the ZeRO stages only.
        X, y: the digits, float32 ``(N, 64)`` and int64 ``(N,)``.
        world_size, sharding, reduce_dtype: initial control values.

    Both rank functions return, on every rank, a dict with ``"params"`` (the full flat
    parameters after each step), ``"before"``, ``"grad"``, ``"after"`` (float32
    ``(NUMEL,)``, NaN where the rank holds nothing: see :func:`placed`), ``"bytes"``
    (``{kind: bytes}``) and ``"sent"`` (``[(collective, bytes), ...]`` of the last step).

    Raises:
        ValueError: an initial value outside the choices (the message names them).
    """

    def __init__(self, group: LocalGroup, zero_train, fsdp_train, X, y, world_size: int | None = None,
                 sharding: str = "ZeRO-2", reduce_dtype: str = "float32"):
        world_size = world_size or group.world_size
        self.shardings = SHARDINGS if fsdp_train is not None else SHARDINGS[:-1]
        if sharding not in self.shardings:
            raise ValueError(f"sharding must be one of {', '.join(self.shardings)}; got {sharding!r}")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}; "
                             f"got {reduce_dtype!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) \
                or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int from 1 to {MAX_WORLD_SIZE}; got {world_size!r}")
        self.group, self.fns, self.X, self.y = group, (zero_train, fsdp_train), X, y
        # notebook 15 (FSDP2 offered): rows of each parameter, its boundaries marked, so
        # that FSDP2's rows of every parameter show against ZeRO's blocks of the flat vector
        self.figure = ShardingFigure(NUMEL) if fsdp_train is None else ShardingFigure(
            NUMEL, parameters=[(name, tuple(p.shape)) for name, p in make_model().named_parameters()])
        self._reference = None
        style = {"description_width": "initial"}
        super().__init__({
            "world_size": W.IntSlider(value=world_size, min=1, max=MAX_WORLD_SIZE,
                                      description="world_size", continuous_update=False, style=style),
            "sharding": W.ToggleButtons(options=self.shardings, value=sharding, description="sharding",
                                        style={**style, "button_width": "64px"}),
            "reduce_dtype": W.ToggleButtons(options=REDUCE_DTYPES, value=reduce_dtype,
                                            description="reduce dtype",
                                            style={**style, "button_width": "76px"}),
        })
        self.refresh()

    @property
    def reference(self) -> torch.Tensor:
        """One process's flat parameters after one Adam step on the whole global batch."""
        if self._reference is None:
            self._reference = reference_run(self.X, self.y, 1)["params"][0]
        return self._reference

    def compute(self, world_size, sharding, reduce_dtype) -> ShardingResult:
        self.group.resize(world_size)  # a no-op when it already has that many ranks
        zero_train, fsdp_train = self.fns
        if sharding == "FSDP2":
            out = self.group.run(fsdp_train, self.X, self.y, 1, reduce_dtype)
        else:
            out = self.group.run(zero_train, sharding, self.X, self.y, 1, reduce_dtype)
        stack = lambda key: np.stack([o[key].double().numpy() for o in out])  # noqa: E731
        sent = []
        for o in out:
            per = {c: 0.0 for c in COLLECTIVES}
            for name, nbytes in o["sent"]:
                per[name] = per.get(name, 0.0) + nbytes
            sent.append(per)
        error = max((o["params"][-1].double() - self.reference.double()).abs().max().item()
                    for o in out)
        return ShardingResult(world_size, sharding, reduce_dtype, stack("before"), stack("grad"),
                              stack("after"), [dict(o["bytes"]) for o in out], sent, error)

    def preparation(self, world_size, sharding, reduce_dtype):
        return self.figure.preparation(world_size)  # a new world size's figure

    def draw(self, r: ShardingResult) -> bytes:
        mem = sum(memory_formula(r.sharding, NUMEL, r.world_size).values())
        sent, text = sent_formula(r.sharding, NUMEL, r.world_size, grad_bytes=r.grad_bytes)
        title = (f"{r.sharding} on {r.world_size} rank{'s' if r.world_size > 1 else ''}, "
                 f"gradients reduced in {r.reduce_dtype}: one Adam step")
        return self.figure.draw(r.before, r.grad, r.after, r.memory, r.sent, mem, sent,
                                f"formula {text}", title)

    def describe(self, r: ShardingResult) -> str:
        m = r.memory[0]
        total = sum(m.values())
        ddp = sum(memory_formula("DDP", NUMEL, 1).values())
        sent = sum(r.sent[0].values())
        ranks = f"{r.world_size} rank{'s' if r.world_size > 1 else ''}"
        return (f"{r.sharding} on {ranks}, gradients reduced in {r.reduce_dtype}: "
                f"rank 0 keeps {m['parameters'] / 1000:.1f} kB of parameters, "
                f"{m['gradients'] / 1000:.1f} kB of gradients and "
                f"{m['optimizer state'] / 1000:.1f} kB of Adam state ({total / 1000:.1f} kB; "
                f"DDP keeps {ddp / 1000:.1f} kB) and sends {sent / 1000:.1f} kB per step. "
                f"After the step, max |parameters - one process's on the whole batch| over "
                f"every rank {within(r.error, ATOL if r.reduce_dtype == 'float32' else 3 * LR)}.")

    def explain_error(self, values: dict, err: RankError) -> str:
        return (f"The ranks refused {values['sharding']} at world_size="
                f"{values['world_size']}: {err.first_summary}")


__all__ = ["SHARDINGS", "REDUCE_DTYPES", "ShardingExplorer", "ShardingResult", "placed",
           "placed_dtensors"]
