"""Rank functions that run unchanged on a LocalGroup and under torchrun.

Introduced in notebook 07 ("From notebook to cluster"). Each function is ordinary
``torch.distributed`` code for the inside of an initialised default process group: it
takes no arguments, asks ``dist`` for its rank and world size, and returns plain Python
values (lists, dicts, numbers, strings), so a result can travel back from torchrun as
JSON and be compared with ``group.run(fn)`` on a :class:`~reducelab.LocalGroup`.

They live in a module, not in a notebook cell, because torchrun starts fresh Python
processes that find a function by importing it (see
:func:`reducelab.torchrun.function_spec`).

Sources: https://pytorch.org/docs/stable/distributed.html and
https://pytorch.org/docs/stable/elastic/run.html
"""
from __future__ import annotations

import os

import psutil
import torch
import torch.distributed as dist

from .torchrun import TORCHRUN_ENV_KEYS


def all_reduce_lesson() -> dict:
    """Each rank draws 4 integers seeded from its rank, then all_reduce (SUM) them.

    Returns ``{"rank", "world_size", "mine", "sum"}``: ``mine`` is this rank's input
    (4 ints from ``torch.randint(0, 10, ...)`` with ``manual_seed(rank)``), ``sum``
    the element-wise sum over all ranks (the same list on every rank). Deterministic
    for a given world_size, whoever launches the ranks.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    mine = torch.randint(0, 10, (4,))
    total = mine.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return {"rank": rank, "world_size": world_size,
            "mine": mine.tolist(), "sum": total.tolist()}


def launcher_env() -> dict:
    """The launcher's environment variables as this rank sees them.

    Returns ``{name: value or None}`` for each name in
    :data:`reducelab.torchrun.TORCHRUN_ENV_KEYS` (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), plus ``"get_rank"`` and
    ``"get_world_size"`` from ``dist``. Under torchrun they agree. A LocalGroup sets
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun does on
    one node, but no ``MASTER_ADDR``/``MASTER_PORT`` (its ranks meet through a
    FileStore, not a TCP store), so those are ``None`` there.
    ``MASTER_PORT`` and the run id are volatile: pass the dict through
    :func:`reducelab.torchrun.sanitize_env` before printing it.
    """
    env = {k: os.environ.get(k) for k in TORCHRUN_ENV_KEYS}
    env["get_rank"] = dist.get_rank()
    env["get_world_size"] = dist.get_world_size()
    return env


def _scope(ip: str) -> str:
    if ip in ("::", "0.0.0.0"):
        return f"all interfaces ({ip})"
    if ip.startswith("127.") or ip == "::1":
        return f"loopback ({ip})"
    return "one interface address"


def listening_sockets() -> dict:
    """Where this rank, and the process that started it, listen for TCP connections.

    Returns ``{"rank": [...], "launcher": [...]}``: sorted, de-duplicated scopes of the
    listening sockets, each ``"all interfaces (::)"``, ``"all interfaces (0.0.0.0)"``,
    ``"loopback (127.0.0.1)"`` or ``"one interface address"`` (addresses and ports are
    left out, so the result is deterministic). Under torchrun the launcher is the
    torchrun agent, which hosts the rendezvous ``TCPStore``; the rank's own sockets are
    gloo's. Measured after every rank has joined (a barrier), so what the agent lists
    is still open after the rendezvous: it stays open until the agent exits, at the end
    of the job.
    """
    def scopes(proc: psutil.Process) -> list[str]:
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            return ["<not readable>"]
        return sorted({_scope(c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN})

    dist.barrier()  # every rank has joined gloo: all of its listeners are up
    me = psutil.Process()
    parent = me.parent()
    return {"rank": scopes(me), "launcher": scopes(parent) if parent else []}
