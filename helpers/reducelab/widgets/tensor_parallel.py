"""The tensor-parallel explorer of notebook 09: pick the tp degree, the split (column then
row, as Megatron-LM does, or row then column) and the layer width; see what every rank
holds at every stage of one forward pass of one token, top to bottom, with every value
written in its cell at every width offered; where the partial sums are; and which
collectives ran in forward and in backward (drawn by
:func:`reducelab.plots.tensor_parallel.draw_diagram`).

Every control change runs the notebook's rank function on real gloo ranks (the group is
resized to ``tp`` ranks), then checks in the kernel that every rank's output and input
gradient equal one process's.

Sources: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism" (arXiv:1909.08053), section 3; the learner question is
"Usage pattern for torch.distributed.all_reduce for gradient synchronization within
HuggingFace Transformers distributed training" (a knowledge-base page, last updated
2025-12-18), whose 3-D example builds a ``tp`` mesh beside ``dp`` and ``cp``.
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import torch

from ..errors import RankError
from ..group import LocalGroup
from ..plots.tensor_parallel import Diagram, Operator, Stage, draw_diagram
from . import Explorer

TP_DEGREES = (1, 2, 3, 4)
"""The tp degrees (world sizes) the explorer offers."""
SPLITS = (("column → row", "column-row"), ("row → column", "row-column"))
"""``(label, value)`` of the two splits: Megatron-LM's column-parallel then row-parallel
MLP, and the other way round."""
WIDTHS = (4, 6, 8, 12)
"""Layer widths offered: ``A`` and ``B`` are ``width x width``; up to
:data:`~reducelab.plots.tensor_parallel.MAX_COLUMNS`, so every value fits its cell."""
TOLERANCE = 1e-5
"""Largest difference from one process that still counts as equal (float32)."""


def _or(values) -> str:
    """``[1, 2, 3]`` -> ``"1, 2 or 3"``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def valid_tp(width: int) -> list[int]:
    """The tp degrees of :data:`TP_DEGREES` that split ``width`` into equal shards."""
    return [t for t in TP_DEGREES if width % t == 0]


@dataclass
class TPResult:
    """What the ranks held and ran in one forward and backward.

    Attributes:
        tp, split, width: the settings (``split`` is ``"column-row"`` or ``"row-column"``).
        held: ``held[rank][name]``, the float32 tensor that rank held at each stage,
            ``(tokens, columns)`` for the activations:
            ``"x"`` (its input to layer 1), ``"A"``, ``"B"`` (its shards), ``"partial"``
            (its partial sum), ``"h"`` (the hidden activation as it held it), ``"y_r"``
            (its output columns, row-column only) and ``"y"`` (the full output).
        calls: ``calls[rank]``, the collectives that rank ran, in order, as
            ``(pass, operator, collective, shape)`` with pass ``"forward"`` or
            ``"backward"``.
        y_error, grad_error: largest difference over ranks between a rank's output
            (and input gradient) and one process's, computed in the kernel.
    """

    tp: int
    split: str
    width: int
    held: list
    calls: list
    y_error: float
    grad_error: float

    def collectives(self, which: str) -> list[tuple[str, str, tuple]]:
        """Rank 0's ``(operator, collective, shape)`` calls in ``"forward"`` or
        ``"backward"``."""
        return [(op, coll, tuple(shape)) for p, op, coll, shape in self.calls[0] if p == which]

    @property
    def same_calls(self) -> bool:
        """True when every rank ran the same collectives (they must, or they would hang)."""
        return all(c == self.calls[0] for c in self.calls)


def reference(result_held: list, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's output and input gradient, rebuilt from the ranks' shards.

    Concatenates the shards of ``A`` and ``B`` (and of ``x`` for row-column) the way
    the split cut them, then runs ``y = relu(x @ A) @ B`` and ``backward()`` of
    ``(y ** 2).sum()`` in float32, as the notebook's rank function does.

    Returns:
        ``(y, x_grad)``, two tensors of shape ``(batch, width)``.
    """
    if split == "column-row":
        A = torch.cat([h["A"] for h in result_held], dim=1)
        B = torch.cat([h["B"] for h in result_held], dim=0)
        x = result_held[0]["x"]
    else:
        A = torch.cat([h["A"] for h in result_held], dim=0)
        B = torch.cat([h["B"] for h in result_held], dim=1)
        x = torch.cat([h["x"] for h in result_held], dim=1)
    x = x.clone().requires_grad_()
    y = torch.relu(x @ A) @ B
    (y ** 2).sum().backward()
    return y.detach(), x.grad


class TensorParallelExplorer(Explorer):
    """Widget: run the notebook's tensor-parallel MLP on ``tp`` real ranks and draw what
    every rank holds.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on; the ``tp`` control resizes it.
        fn: the notebook's rank function, called on every rank as ``fn(split, width)``
            with ``split`` a value of :data:`SPLITS`. It must return ``(held, x_grad,
            calls)``: ``held`` a dict of the stage tensors listed in
            :class:`TPResult`, ``x_grad`` the gradient of the full input ``x``, and
            ``calls`` the list of collectives it ran (see :attr:`TPResult.calls`). It
            raises (any exception) when ``width`` does not split into ``tp`` equal
            shards.
        tp: initial tp degree, one of :data:`TP_DEGREES` (default: the group's
            world_size if offered, else 4).
        split: initial split, ``"column-row"`` or ``"row-column"``.
        width: initial layer width, one of :data:`WIDTHS`.

    Raises:
        ValueError: an initial value outside the choices above.
    """

    def __init__(self, group: LocalGroup, fn, tp: int | None = None,
                 split: str = "column-row", width: int = 8):
        if tp is None:
            tp = group.world_size if group.world_size in TP_DEGREES else 4
        if tp not in TP_DEGREES:
            raise ValueError(f"tp must be one of {', '.join(map(str, TP_DEGREES))}; got {tp!r}")
        if split not in dict(SPLITS).values():
            raise ValueError(f"split must be one of {', '.join(v for _, v in SPLITS)}; got {split!r}")
        if width not in WIDTHS:
            raise ValueError(f"width must be one of {', '.join(map(str, WIDTHS))}; got {width!r}")
        self.group, self.fn = group, fn
        style = {"description_width": "initial"}
        super().__init__({
            "tp": W.ToggleButtons(options=TP_DEGREES, value=tp, description="tp (world_size)",
                                  style={**style, "button_width": "3em"}),
            "split": W.ToggleButtons(options=SPLITS, value=split, description="split",
                                     style=style),
            "width": W.Dropdown(options=WIDTHS, value=width, description="layer width",
                                style=style, layout=W.Layout(width="10em")),
        })
        self.refresh()

    def compute(self, tp, split, width) -> TPResult:
        self.group.resize(tp)  # a no-op when it already has tp ranks
        out = self.group.run(self.fn, split, width)
        held = [{k: v.float() for k, v in o[0].items()} for o in out]
        y_ref, grad_ref = reference(held, split)
        y_error = max(float((h["y"] - y_ref).abs().max()) for h in held)
        grad_error = max(float((o[1] - grad_ref).abs().max()) for o in out)
        return TPResult(tp, split, width, held, [list(o[2]) for o in out], y_error, grad_error)

    # --- figure and text ---------------------------------------------------------------
    def _operators(self, result: TPResult) -> dict[str, Operator]:
        """One :class:`Operator` per operator name, labelled with what it really ran."""
        ran: dict[str, dict[str, str]] = {}
        for p, op, coll, shape in result.calls[0]:
            ran.setdefault(op, {})[p] = f"{coll} of {'×'.join(map(str, shape))}"
        quiet = {"f": ("identity", "(not run)"), "g": ("(not run)", "identity"),
                 "gather": ("(not run)", "keeps this rank's columns")}
        return {name: Operator(name, ran.get(name, {}).get("forward", fwd),
                               ran.get(name, {}).get("backward", bwd))
                for name, (fwd, bwd) in quiet.items()}

    def diagram(self, result: TPResult) -> Diagram:
        """The :class:`~reducelab.plots.tensor_parallel.Diagram` of ``result``."""
        held, tp, w = result.held, result.tp, result.width
        ops = self._operators(result)

        def stage(name, key, kind="same"):
            values = [h[key].numpy() for h in held]
            if kind == "same" and not all(torch.equal(h[key], held[0][key]) for h in held):
                kind = "each"                  # drawn as it is: one line per rank
            return Stage(name, values, kind)
        if result.split == "column-row":
            items = [stage("x, the input", "x"), ops["f"],
                     stage("h = relu(x @ A[:, mine])", "h", "sharded"),
                     stage("partial y = h @ B[mine, :]", "partial", "partial"), ops["g"],
                     stage("y, the output", "y")]
            how = (f"A ({w}×{w}) split by columns: {w}×{w // tp} per rank; "
                   f"B split by rows: {w // tp}×{w} per rank")
        else:
            items = [ops["f"], stage("x[:, mine]", "x", "sharded"),
                     stage("partial h = x_r @ A[mine, :]", "partial", "partial"), ops["g"],
                     stage("h = relu(the sum)", "h"), ops["f"],
                     stage("y[:, mine] = h @ B[:, mine]", "y_r", "sharded"), ops["gather"],
                     stage("y, the output", "y")]
            how = (f"A ({w}×{w}) split by rows: {w // tp}×{w} per rank; "
                   f"B split by columns: {w}×{w // tp} per rank")
        label = dict((v, k) for k, v in SPLITS)[result.split]
        tokens = held[0]["x"].shape[0]
        title = (f"{label}, tp={tp} ({tp} rank{'s' if tp > 1 else ''}), width {w}: "
                 f"y = relu(x @ A) @ B, for {tokens} token{'s' if tokens > 1 else ''}")
        note = ("hatched: partial sums, which the next all_reduce adds up; "
                "grey bands: where the ranks communicate")
        return Diagram(title, items, subtitle=how, note=note)

    def draw(self, result: TPResult) -> bytes:
        return draw_diagram(self.diagram(result))

    def describe(self, result: TPResult) -> str:
        def listing(which):
            calls = result.collectives(which)
            if not calls:
                return "no collective"
            return ", ".join(f"{op}: {coll} of {'×'.join(map(str, shape))}"
                             for op, coll, shape in calls)
        fwd, bwd = result.collectives("forward"), result.collectives("backward")
        h = result.held[0]["h"]
        kept = ("stays sharded" if result.split == "column-row" and result.tp > 1
                else "is whole on every rank")
        ok = max(result.y_error, result.grad_error) <= TOLERANCE
        check = ("every rank's y and x.grad equal one process's" if ok else
                 f"y or x.grad DIFFER from one process's (by {max(result.y_error, result.grad_error):.2g})")
        return (f"forward: {len(fwd)} collective(s) per rank ({listing('forward')}); "
                f"backward: {len(bwd)} ({listing('backward')}); the hidden activation "
                f"{kept} ({'×'.join(map(str, h.shape))} per rank); {check}.")

    def explain_error(self, values: dict, err: RankError) -> str:
        width, tp = values["width"], values["tp"]
        if width % tp:
            widths = [w for w in WIDTHS if w % tp == 0]
            return (f"Width {width} does not split into {tp} equal shards. Pick tp "
                    f"{_or(valid_tp(width))} for width {width}, or width {_or(widths)} "
                    f"for tp {tp}.")
        return f"The ranks refused this: {err.first_summary}"
