"""Reduce Lab: real ``torch.distributed`` collectives on local gloo ranks, from notebook cells.

Start with :class:`LocalGroup` (notebook 01).
"""
from .errors import RankError, RankReport
from .determinism import setup
from .group import LocalGroup

__all__ = ["LocalGroup", "RankError", "RankReport", "setup"]
__version__ = "0.1.0"
