"""Reduce Lab: real ``torch.distributed`` collectives on local gloo ranks, from notebook cells.

Start with :class:`LocalGroup` (notebook 01).
"""
from .errors import GroupBusyError, GroupClosedError, RankError, RankReport
from .determinism import setup
from .group import LocalGroup

__all__ = ["GroupBusyError", "GroupClosedError", "LocalGroup", "RankError", "RankReport", "setup", "load_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    """``%load_ext reducelab``: registers the ``%%ranks`` cell magic (see reducelab.magic)."""
    from .magic import load_ipython_extension as load
    load(ipython)
__version__ = "0.1.0"
