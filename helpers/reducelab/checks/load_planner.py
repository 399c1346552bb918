"""Notebook 14's recording load planner: ``torch.distributed.checkpoint``'s default load
planner, which also records what a rank reads, from which file (step 4 and the
explorer's :func:`reducelab.checks.shards.checkpoint_round_trip`).

A module of its own because it subclasses ``DefaultLoadPlanner``, so importing it imports
``torch.distributed.checkpoint`` (about 0.6 s of CPU after torch, on torch 2.13): notebook
14's setup cell imports the rest of its helpers without it (issue 23).

Source: ``DefaultLoadPlanner`` (``torch/distributed/checkpoint/default_planner.py``);
"Getting Started with Distributed Checkpoint (DCP)",
https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html
"""
from __future__ import annotations

from torch.distributed.checkpoint import DefaultLoadPlanner


class RecordingLoadPlanner(DefaultLoadPlanner):
    """``torch.distributed.checkpoint``'s default load planner, which also records what
    this rank reads: after ``dcp.load(..., planner=planner)``, :attr:`reads` holds one
    ``(fqn, file, chunk_offsets, offsets_in_chunk, offsets_here, lengths)`` per read, in
    the plan's order: the state dict key, the ``.distcp`` file (``_StorageInfo.relative_path``
    in the checkpoint's metadata), where the saved chunk starts in the whole tensor,
    where the read starts within that chunk and within this rank's tensor, and its shape
    (tuples of ints, one per dimension; ``()`` for a value that is not a tensor, such as
    an optimizer's ``param_groups``, read whole).

    It changes nothing of what :class:`~torch.distributed.checkpoint.DefaultLoadPlanner`
    plans: :meth:`create_local_plan` returns the parent's plan unchanged.
    """

    def create_local_plan(self):
        plan = super().create_local_plan()
        place = lambda value: () if value is None else tuple(value)  # noqa: E731 (None: not a tensor)
        self.reads = [(item.dest_index.fqn, self.metadata.storage_data[item.storage_index].relative_path,
                       place(item.storage_index.offset), place(item.storage_offsets),
                       place(item.dest_offsets), place(item.lengths)) for item in plan.items]
        return plan


__all__ = ["RecordingLoadPlanner"]
