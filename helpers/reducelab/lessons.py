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


def socket_scope(ip: str) -> str:
    """Who can reach a TCP socket bound to ``ip``, in words that are the same on any host.

    ``"all interfaces (:: or 0.0.0.0)"`` for the IPv6 and IPv4 wildcard addresses, which
    both mean every interface. ``"loopback (127.0.0.1)"`` or ``"loopback (::1)"`` for the
    loopback addresses, ``"one interface address"`` for any other.
    """
    if ip in ("::", "0.0.0.0"):
        return "all interfaces (:: or 0.0.0.0)"
    if ip.startswith("127.") or ip == "::1":
        return f"loopback ({ip})"
    return "one interface address"


def listening_sockets() -> dict:
    """Where this rank, and the process that started it, listen for TCP connections.

    Measured twice with psutil: once every rank has joined (after a barrier, so all of
    gloo's listeners are up), and again at the end, after an ``all_reduce``. Under
    torchrun the process that started the rank is the torchrun agent, which hosts the
    rendezvous ``TCPStore``; the rank's own listening sockets are gloo's.

    Returns ``{"after every rank joined": {"rank": [...], "launcher": [...]},
    "at the end, after an all_reduce": {...}}``: for each measurement, the sorted,
    de-duplicated ``socket_scope`` of each listening socket (addresses and ports are left
    out, so the result is the same on any host).
    """
    def listening(proc: psutil.Process | None) -> list[str]:
        """The scopes of the TCP sockets ``proc`` listens on."""
        if proc is None:
            return []
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            return ["<not readable>"]
        return sorted({socket_scope(c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN})

    me = psutil.Process()
    launcher = me.parent()                # under torchrun: the agent, host of the TCPStore
    dist.barrier()                        # every rank has joined: gloo's listeners are up
    joined = {"rank": listening(me), "launcher": listening(launcher)}
    total = torch.ones(1)
    dist.all_reduce(total)                # the job's work: here, one all_reduce
    end = {"rank": listening(me), "launcher": listening(launcher)}
    return {"after every rank joined": joined, "at the end, after an all_reduce": end}
