"""The explorer of notebook 13: what DDP does with each rank's parameters in one step.

:class:`DDPStepExplorer` runs the notebook's own rank function on real gloo ranks for a
choice of where the model's auxiliary head is used (every rank, no rank, rank 0 only),
a DDP option (none, ``find_unused_parameters=True``, ``static_graph=True``), a seeding
pattern and a world size, and draws every rank's parameters as built, after
``DDP(model)``, their gradient after ``backward()`` and the parameters after one SGD
step, with each rank's dropout mask (:class:`reducelab.plots.ddp_model.StepFigure`).
The rank function and the model are the notebook's; this module only launches,
compares and plots.

Sources: ``DistributedDataParallel`` and its ``find_unused_parameters`` and
``static_graph`` options (``torch/nn/parallel/distributed.py``, torch 2.13,
https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html);
the learner questions open-mmlab/mmdetection#2153 and pytorch/pytorch#36613.
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np

from ..errors import RankError
from . import Explorer

AUX_USED_ON = ("every rank", "no rank", "rank 0 only")
"""Where the model's auxiliary head takes part in the loss, by the names the rank
function receives."""
OPTIONS = ("default", "find_unused_parameters", "static_graph")
"""DDP options: none, ``find_unused_parameters=True``, ``static_graph=True``."""
SEEDINGS = ("same seed", "seed + rank")
"""How each rank seeds torch before it builds the model and draws dropout masks:
``torch.manual_seed(0)`` on every rank, or ``torch.manual_seed(rank)``."""
MAX_WORLD_SIZE = 4
"""The world-size slider's largest value."""
GROUPS = [("body", 2), ("head", 2), ("aux", 2)]
"""The figure's column groups: the first element of each parameter (body weight and
bias, head weight and bias, aux weight and bias), in ``model.parameters()`` order."""
AUX_COLUMNS = slice(4, 6)
"""The columns of the auxiliary head's weight and bias."""


@dataclass
class StepResult:
    """One step on every rank.

    Attributes:
        aux_used_on, option, seeding, world_size: the settings.
        built, wrapped, grad, after: float64 arrays ``(world_size, 6)``: the first
            element of every parameter as built, after ``DDP(model)``, of its gradient after
            ``backward()`` (NaN: no gradient) and after one SGD step.
        dropped: bool array ``(world_size, units)``: each rank's dropout mask for its
            first sample.
        next_forward: per rank, ``""`` when the next iteration's forward ran, else the
            text of the error it raised.
    """

    aux_used_on: str
    option: str
    seeding: str
    world_size: int
    built: np.ndarray
    wrapped: np.ndarray
    grad: np.ndarray
    after: np.ndarray
    dropped: np.ndarray
    next_forward: list

    @staticmethod
    def rows_equal(a: np.ndarray) -> bool:
        """Whether every rank's row equals rank 0's (NaN equal to NaN)."""
        return all(np.array_equal(row, a[0], equal_nan=True) for row in a)


def _first_line(text: str) -> str:
    return text.strip().split("\n")[0].split(". This error")[0].rstrip(".") + "."


def describe_result(r: StepResult) -> str:
    """A few sentences on what DDP did in the step, and what the next forward did. The
    same words on every CPU: no numbers of rounding size."""
    n = r.world_size
    built = ("the same on every rank (one seed)" if StepResult.rows_equal(r.built)
             else "different on every rank")
    lines = [f"{r.aux_used_on}, {r.option}, {r.seeding}, {n} ranks: as built, the parameters "
             f"were {built}; after DDP(model) "
             + ("every rank holds rank 0's." if StepResult.rows_equal(r.wrapped)
                else "the ranks still differ.")]
    aux = r.grad[:, AUX_COLUMNS]
    if StepResult.rows_equal(r.grad):
        text = "DDP averaged the gradients: every rank holds the same gradient"
        if np.isnan(aux).all():
            text += ", and aux has none (it took no part in the loss on any rank)"
        elif r.aux_used_on == "rank 0 only":
            text += (f"; aux's is rank 0's own divided by {n}, the other ranks "
                     f"adding zeros for it")
        lines.append(text + ".")
    else:
        lines.append("DDP did not average: the ranks hold different gradients. No rank "
                     "computed a gradient for aux, so the gradient bucket that holds it never "
                     "became ready, and DDP never all-reduced that bucket.")
    lines.append("After one SGD step the ranks' parameters "
                 + ("still agree." if StepResult.rows_equal(r.after) else "differ."))
    errors = [t for t in r.next_forward if t]
    if errors:
        lines.append(f"The next forward raises on {len(errors)} of {n} ranks: "
                     f"RuntimeError: {_first_line(errors[0])}")
    else:
        lines.append("The next forward runs.")
    same_masks = all(np.array_equal(m, r.dropped[0]) for m in r.dropped)
    lines.append("Dropout drew the same mask on every rank." if same_masks
                 else "Dropout drew a different mask on each rank.")
    return " ".join(lines)


class DDPStepExplorer(Explorer):
    """Controls: where the aux head is used, the DDP option, the seeding, world_size (2
    to 4); shows every rank's parameters through one DDP step.

    Each change resizes the group (a new world size restarts the ranks) and runs
    ``one_step(aux_used_on, option, seeding)`` on every rank. When the ranks hang (the
    aux head used on some ranks only, with no DDP option), the group's timeout ends the
    call and the message says which rank waited where.

    Args:
        group: the notebook's :class:`~reducelab.LocalGroup`; the explorer resizes it.
        one_step: the notebook's rank function ``(aux_used_on, option, seeding) -> dict``
            with keys ``built``, ``wrapped``, ``grad``, ``after`` (float tensors of 6
            elements: :data:`GROUPS`), ``dropped`` (bool tensor, one per hidden unit) and
            ``next_forward`` (``""`` or the error's text).
        aux_used_on, option, seeding, world_size: initial control values.

    Raises:
        TypeError: ``one_step`` is not callable.
        ValueError: a bad initial value (the message names the valid choices).
    """

    def __init__(self, group, one_step, aux_used_on: str = "no rank", option: str = "default",
                 seeding: str = "seed + rank", world_size: int = 4):
        if not callable(one_step):
            raise TypeError(f"one_step must be a function, got {one_step!r}")
        for name, value, choices in (("aux_used_on", aux_used_on, AUX_USED_ON),
                                     ("option", option, OPTIONS), ("seeding", seeding, SEEDINGS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        if not 2 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be from 2 to {MAX_WORLD_SIZE}, got {world_size}")
        self.group = group
        self.one_step = one_step
        self.figure = None
        style = {"description_width": "initial"}
        controls = {
            "aux_used_on": W.ToggleButtons(options=list(AUX_USED_ON), value=aux_used_on,
                                           description="aux head used on",
                                           style={**style, "button_width": "96px"}),
            "option": W.ToggleButtons(options=list(OPTIONS), value=option,
                                      description="DDP option",
                                      style={**style, "button_width": "170px"}),
            "seeding": W.ToggleButtons(options=list(SEEDINGS), value=seeding,
                                       description="seeding",
                                       style={**style, "button_width": "96px"}),
            "world_size": W.IntSlider(value=world_size, min=2, max=MAX_WORLD_SIZE,
                                      description="world_size", continuous_update=False,
                                      style=style),
        }
        super().__init__(controls)
        self.refresh()

    def compute(self, aux_used_on, option, seeding, world_size) -> StepResult:
        self.group.resize(world_size)  # a no-op when it already has world_size ranks
        out = self.group.run(self.one_step, aux_used_on, option, seeding)

        def rows(key):
            return np.stack([np.asarray(o[key], dtype=float) for o in out])
        return StepResult(aux_used_on, option, seeding, world_size, rows("built"),
                          rows("wrapped"), rows("grad"), rows("after"),
                          np.stack([np.asarray(o["dropped"], dtype=bool) for o in out]),
                          [str(o["next_forward"]) for o in out])

    def preparation(self, aux_used_on, option, seeding, world_size):
        if self.figure is None or self.result is None:
            return None
        # a new world size's figure; the model's hidden units are those of the last step
        return self.figure.preparation(world_size, GROUPS, self.result.dropped.shape[1])

    def draw(self, result: StepResult) -> bytes:
        if self.figure is None:
            from ..plots.ddp_model import StepFigure
            self.figure = StepFigure()
        return self.figure.draw(result.built, result.wrapped, result.dropped, result.grad,
                                result.after, GROUPS,
                                title=f"aux used on {result.aux_used_on}, {result.option}, "
                                      f"{result.seeding}, {result.world_size} ranks")

    def describe(self, result: StepResult) -> str:
        return describe_result(result)

    def explain_error(self, values: dict, err: RankError) -> str:
        stuck = [r for r in err.reports if r.state == "stuck"]
        done = [r.rank for r in err.reports if r.state == "returned"]
        if stuck and values["aux_used_on"] == "rank 0 only" and values["option"] == "default":
            who = ", ".join(str(r.rank) for r in stuck)
            return (f"A hang, ended by the group's {self.group.timeout:g} s timeout: rank {who} "
                    f"used aux and waited in backward() for the all_reduce of the bucket that "
                    f"holds it ({stuck[0].summary}); rank"
                    f"{'s' if len(done) != 1 else ''} {', '.join(map(str, done)) or 'none'} "
                    f"did not use aux, so on them that bucket never became ready and they "
                    f"never joined that all_reduce. find_unused_parameters or static_graph "
                    f"fixes it.")
        return f"The ranks refused this: {err.headline}. {err.first_summary}"
