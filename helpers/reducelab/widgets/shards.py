"""The checkpoint explorer of notebook 14: pick how many ranks save an FSDP2 model with
``torch.distributed.checkpoint`` (DCP), how many load it, and which parameter to look at;
every change saves and loads a real checkpoint on the ranks, in a temporary directory
that is removed afterwards.

The figure shows which rows of the parameter each saving rank wrote to its file, and
which rows each loading rank reads from which file: DCP's resharding.

Sources: "Getting Started with Distributed Checkpoint (DCP)",
https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html ;
``torch.distributed.checkpoint.DefaultLoadPlanner`` and ``create_default_local_load_plan``
(``torch/distributed/checkpoint/default_planner.py``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import ipywidgets as W
import torch

from ..checks.sharded import LAYOUT, initial_flat
from ..checks.shards import checkpoint_round_trip
from ..errors import RankError
from ..group import LocalGroup
from ..plots.shards import CheckpointFigure
from . import Explorer

PARAMETERS = tuple(name for name, _, _ in LAYOUT)
"""The model's parameters, as the explorer names them: ``0.weight``, ``0.bias``,
``2.weight``, ``2.bias``."""
MAX_WORLD_SIZE = 8


def _file_rank(relative_path: str) -> int:
    """``3`` for ``"__3_0.distcp"``: the rank that wrote the file (``FileSystemWriter``'s
    naming, ``__{rank}_{n}.distcp``)."""
    return int(relative_path.split("_")[2])


@dataclass
class CheckpointResult:
    """One DCP save on ``saved_on`` ranks and load on ``loaded_on`` ranks.

    Attributes:
        saved_on, loaded_on: the numbers of ranks.
        rows: ``{parameter: number of rows}``.
        saved: ``{parameter: [(first row, number of rows) per saving rank]}``, from the
            checkpoint's metadata.
        loaded: ``{parameter: [[(first row, number of rows, saving rank of the file), ...]
            per loading rank]}``, from each loading rank's load plan.
        file_bytes: per saving rank, the size of ``__r_0.distcp``, in bytes.
        metadata_bytes: the size of ``.metadata``, in bytes.
        files: the checkpoint's file names, sorted.
        exact: whether every loading rank's parameters equal the saved ones bit for bit.
    """

    saved_on: int
    loaded_on: int
    rows: dict
    saved: dict
    loaded: dict
    file_bytes: list
    metadata_bytes: int
    files: list
    exact: bool


class CheckpointExplorer(Explorer):
    """Widget: ranks that save, ranks that load, parameter -> a real DCP round trip.

    Args:
        group: the notebook's :class:`~reducelab.LocalGroup`; it is resized to
            ``max(saved_on, loaded_on)`` ranks, and the first ``saved_on`` (then the
            first ``loaded_on``) ranks form the process group that saves (loads), as two
            jobs of those sizes would.
        saved_on, loaded_on: initial numbers of ranks, ints from 1 to 8.
        parameter: the parameter first shown, one of :data:`PARAMETERS`.

    Raises:
        ValueError: an initial value outside the choices (the message names them).
    """

    def __init__(self, group: LocalGroup, saved_on: int = 4, loaded_on: int = 3,
                 parameter: str = "2.weight"):
        for label, value in (("saved_on", saved_on), ("loaded_on", loaded_on)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD_SIZE:
                raise ValueError(f"{label} must be an int from 1 to {MAX_WORLD_SIZE}; got {value!r}")
        if parameter not in PARAMETERS:
            raise ValueError(f"parameter must be one of {', '.join(PARAMETERS)}; got {parameter!r}")
        self.group = group
        self.figure = CheckpointFigure()
        self.expected = initial_flat()
        style = {"description_width": "initial"}
        super().__init__({
            "saved_on": W.IntSlider(value=saved_on, min=1, max=MAX_WORLD_SIZE, description="saved on (ranks)",
                                    continuous_update=False, style=style),
            "loaded_on": W.IntSlider(value=loaded_on, min=1, max=MAX_WORLD_SIZE,
                                     description="loaded on (ranks)", continuous_update=False, style=style),
            "parameter": W.ToggleButtons(options=PARAMETERS, value=parameter, description="parameter",
                                         style={**style, "button_width": "72px"}),
        })
        self._last, self._from_change = None, False
        self.refresh()

    def _on_change(self, change) -> None:
        # A change of the parameter alone shows another part of the same checkpoint: the
        # refresh it asks for (at once from Python; from the browser, later, collapsed with
        # the changes after it) redraws the last one. A change of saved_on or loaded_on, or
        # a call of refresh(), saves and loads a new one.
        self._from_change = True
        super()._on_change(change)

    def compute(self, saved_on, loaded_on, parameter) -> CheckpointResult:
        key = (saved_on, loaded_on)
        last = self._last
        same = self._from_change and last is not None and self._last_group is self.group \
            and (last.saved_on, last.loaded_on) == key
        self._from_change = False
        if same:
            return last
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import MetadataIndex
        self.group.resize(max(key))      # a no-op when it already has that many ranks
        path = tempfile.mkdtemp(prefix="reducelab-dcp-")
        try:
            out = self.group.run(checkpoint_round_trip, path, saved_on, loaded_on)
            metadata = dcp.FileSystemReader(path).read_metadata()
            files = sorted(os.listdir(path))
            sizes = {f: os.path.getsize(os.path.join(path, f)) for f in files}
        finally:
            shutil.rmtree(path, ignore_errors=True)
        rows, saved, loaded = {}, {}, {}
        for name, _, shape in LAYOUT:
            fqn, n = f"model.{name}", shape[0]
            rows[name] = n
            chunk = -(-n // saved_on)
            per = [(min(r * chunk, n), 0) for r in range(saved_on)]
            for c in metadata.state_dict_metadata[fqn].chunks:
                info = metadata.storage_data[MetadataIndex(fqn, c.offsets)]
                per[_file_rank(info.relative_path)] = (c.offsets[0], c.sizes[0])
            saved[name] = per
            loaded[name] = [[(chunk_at[0] + in_chunk[0], lengths[0], _file_rank(file))
                             for fqn_read, file, chunk_at, in_chunk, _, lengths in o["reads"]
                             if fqn_read == fqn] for o in out[:loaded_on]]
        exact = all(torch.equal(o["loaded"], self.expected) for o in out[:loaded_on])
        self._last_group = self.group
        self._last = CheckpointResult(saved_on, loaded_on, rows, saved, loaded,
                                      [sizes[f"__{r}_0.distcp"] for r in range(saved_on)],
                                      sizes[".metadata"], files, exact)
        return self._last

    def draw(self, r: CheckpointResult) -> bytes:
        name = self.controls["parameter"].value
        return self.figure.draw(name, r.rows[name], r.saved[name], r.loaded[name], r.file_bytes)

    def describe(self, r: CheckpointResult) -> str:
        name = self.controls["parameter"].value
        reads = []
        for rank, pieces in enumerate(r.loaded[name]):
            sources = sorted({source for _, _, source in pieces})
            reads.append(f"rank {rank} from " + (" and ".join(f"__{s}_0" for s in sources) or "no file"))
        ranks = lambda n: f"{n} rank{'s' if n > 1 else ''}"  # noqa: E731
        return (f"Saved on {ranks(r.saved_on)}: {len(r.files) - 1} file{'s' if r.saved_on > 1 else ''} "
                f"and .metadata. Loaded on {ranks(r.loaded_on)}, {name} is read: {'; '.join(reads)}. "
                + ("After the load, every parameter on every loading rank equals the saved one "
                   "bit for bit." if r.exact else "After the load, not every parameter on every "
                   "loading rank equals the saved one bit for bit."))

    def explain_error(self, values: dict, err: RankError) -> str:
        return (f"The ranks refused to save on {values['saved_on']} and load on "
                f"{values['loaded_on']}: {err.first_summary}")


__all__ = ["PARAMETERS", "CheckpointExplorer", "CheckpointResult"]
