"""The sampler explorer of notebook 12: pick the data set's size, the world size, the batch
size and ``drop_last``; every change runs the notebook's evaluation on real ranks, each
rank reading its share through ``DistributedSampler`` and a ``DataLoader``.

The figure shows each rank's sample numbers batch by batch, the repeats the sampler's
padding adds, the samples ``drop_last`` leaves out, the wrong predictions, and the
accuracy and mean loss three ways: each sample once (exact), sums and counts over the
sampler's indices, and the mean of per-batch means.

Source: ``torch.utils.data.distributed.DistributedSampler``,
https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W

from ..errors import RankError
from ..group import LocalGroup
from ..plots.gathers import METHODS, SamplerFigure
from . import Explorer

MAX_DATASET_SIZE = 60
MAX_WORLD_SIZE = 8
MAX_BATCH_SIZE = 8


@dataclass
class SamplerResult:
    """One evaluation on real ranks.

    Attributes:
        dataset_size, world_size, batch_size, drop_last: the settings.
        batches: per rank, its batches in order, each a list of sample numbers.
        repeats: per rank, one bool per index it holds: True for a repeat added by the
            sampler's padding (global position ``i * world_size + rank`` at or past
            ``dataset_size``).
        dropped: the sample numbers no rank holds (``drop_last=True``).
        wrong: the sample numbers the model predicts wrongly, among those the ranks hold.
        metrics: ``{method: (accuracy, mean loss)}`` for each of
            :data:`reducelab.plots.gathers.METHODS`, as the ranks computed them (NaN where
            there was no sample).
    """

    dataset_size: int
    world_size: int
    batch_size: int
    drop_last: bool
    batches: list
    repeats: list
    dropped: list
    wrong: set
    metrics: dict

    @property
    def held(self) -> int:
        """How many indices the ranks hold together (repeats included)."""
        return sum(len(b) for rank in self.batches for b in rank)

    @property
    def repeated(self) -> list[int]:
        """The sample numbers that are held twice, in rank order."""
        return [i for rank, flags in zip(self.batches, self.repeats)
                for i, f in zip([i for b in rank for i in b], flags) if f]


class SamplerExplorer(Explorer):
    """Widget: data set size, world_size, batch_size and drop_last -> one evaluation on
    the ranks.

    Args:
        group: the notebook's :class:`~reducelab.LocalGroup`; the world-size slider
            resizes it.
        evaluate: the notebook's rank function, called on every rank as
            ``evaluate(X[:dataset_size], y[:dataset_size], batch_size, drop_last)``. It
            returns, on every rank, a dict with ``"batches"`` (the rank's batches, lists
            of sample numbers), ``"wrong"`` (the sample numbers it predicted wrongly) and,
            for each of :data:`~reducelab.plots.gathers.METHODS`, ``(accuracy, mean
            loss)`` as floats, the same on every rank.
        X, y: the validation set, float64 ``(N, 64)`` and int64 ``(N,)``.
        dataset_size, world_size, batch_size, drop_last: initial control values.

    Raises:
        ValueError: an initial value outside the choices (the message names them).
    """

    def __init__(self, group: LocalGroup, evaluate, X, y, dataset_size: int = 10,
                 world_size: int | None = None, batch_size: int = 2, drop_last: bool = False):
        world_size = world_size or group.world_size
        top = min(MAX_DATASET_SIZE, len(X))
        for name, value, hi in (("dataset_size", dataset_size, top),
                                ("world_size", world_size, MAX_WORLD_SIZE),
                                ("batch_size", batch_size, MAX_BATCH_SIZE)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an int from 1 to {hi}; got {value!r}")
        if drop_last not in (False, True):
            raise ValueError(f"drop_last must be False or True; got {drop_last!r}")
        self.group, self.evaluate, self.X, self.y = group, evaluate, X, y
        self.figure = SamplerFigure()
        style = {"description_width": "initial"}
        super().__init__({
            # the sizes follow the hand while dragged (the base class collapses the
            # changes); world_size waits for the release, since each value restarts ranks
            "dataset_size": W.IntSlider(value=dataset_size, min=1, max=top, description="samples",
                                        style=style),
            "world_size": W.IntSlider(value=world_size, min=1, max=MAX_WORLD_SIZE,
                                      description="world_size", continuous_update=False,
                                      style=style),
            "batch_size": W.IntSlider(value=batch_size, min=1, max=MAX_BATCH_SIZE,
                                      description="batch_size", style=style),
            "drop_last": W.ToggleButtons(options=[("False", False), ("True", True)],
                                         value=bool(drop_last), description="drop_last",
                                         style={**style, "button_width": "56px"}),
        })
        self.refresh()

    def compute(self, dataset_size, world_size, batch_size, drop_last) -> SamplerResult:
        self.group.resize(world_size)  # a no-op when it already has that many ranks
        out = self.group.run(self.evaluate, self.X[:dataset_size], self.y[:dataset_size],
                             batch_size, drop_last)
        batches = [o["batches"] for o in out]
        repeats = [[i * world_size + r >= dataset_size for i in range(sum(map(len, b)))]
                   for r, b in enumerate(batches)]
        held = {i for rank in batches for b in rank for i in b}
        return SamplerResult(dataset_size, world_size, batch_size, bool(drop_last), batches,
                             repeats, [i for i in range(dataset_size) if i not in held],
                             {i for o in out for i in o["wrong"]},
                             {m: tuple(float(v) for v in out[0][m]) for m in METHODS})

    def draw(self, r: SamplerResult) -> bytes:
        title = (f"{r.dataset_size} samples on {r.world_size} rank{'s' if r.world_size > 1 else ''}, "
                 f"batch_size={r.batch_size}, drop_last={r.drop_last}: the ranks hold {r.held} "
                 f"indices")
        return self.figure.draw(r.batches, r.repeats, r.dropped, r.wrong, r.metrics, title)

    def describe(self, r: SamplerResult) -> str:
        ranks = f"{r.world_size} rank{'s' if r.world_size > 1 else ''}"
        what = []
        if r.repeated:
            what.append(f"{len(r.repeated)} repeat{'s' if len(r.repeated) > 1 else ''}: "
                        f"sample{'s' if len(r.repeated) > 1 else ''} "
                        f"{', '.join(map(str, r.repeated))}")
        if r.dropped:
            what.append(f"{len(r.dropped)} dropped: sample{'s' if len(r.dropped) > 1 else ''} "
                        f"{', '.join(map(str, r.dropped))}")
        held = f"the ranks hold {r.held} indices" + (f" ({'; '.join(what)})" if what else
                                                     ", each sample once")

        def fmt(v, pct):
            return "no sample" if v != v else (f"{100 * v:.1f}%" if pct else f"{v:.3f}")
        acc = ", ".join(f"{fmt(r.metrics[m][0], True)} {m}" for m in METHODS)
        loss = ", ".join(fmt(r.metrics[m][1], False) for m in METHODS)
        return (f"{r.dataset_size} samples on {ranks}, batch_size={r.batch_size}, "
                f"drop_last={r.drop_last}: {held}. Accuracy: {acc}. Mean loss, in the same "
                f"order: {loss}.")

    def explain_error(self, values: dict, err: RankError) -> str:
        return (f"The ranks refused {values['dataset_size']} samples at world_size="
                f"{values['world_size']}: {err.first_summary}")


__all__ = ["SamplerExplorer", "SamplerResult"]
