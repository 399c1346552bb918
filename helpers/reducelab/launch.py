"""Launching a group's ranks: one process and one pipe per rank (kernel side).

Introduced with notebook 01's ``LocalGroup``, whose lifecycle (:mod:`reducelab.group`)
checks its settings here (:func:`validate`, :func:`validate_env`: nothing starts on bad
ones), then calls :func:`start_ranks` each time the ranks start or restart, and waits
for them to join under its deadline. Each rank is a process from
:func:`reducelab.processes.context` (the forkserver) that runs
:func:`reducelab.rank_loop.main` with:

* its end of a socket pair (``multiprocessing.Pipe``), the only channel into the rank;
  the kernel keeps the other end in the rank's :class:`_Proc` handle;
* the group's private (0700) temporary directory, where the ranks meet through a
  ``FileStore``;
* the loopback interface (:func:`loopback_interface`) that gloo is pinned to, so that
  nothing listens beyond 127.0.0.1;
* the kernel's ``sys.path``, and its environment with the group's ``env`` on top.

Each rank's process group is told to the kernel's :mod:`~reducelab.reaper` at once, so a
killed kernel leaves nothing behind. Stopping ranks is :func:`reducelab.processes.stop`.
"""
from __future__ import annotations

import pickle
import sys

import psutil

from . import processes
from .reaper import Reaper


BACKENDS = ("gloo",)
"""Backends LocalGroup can start. gloo is the one torch backend that runs on any CPU."""

MAX_WORLD_SIZE = 64
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME")
"""Environment variables every rank gets from LocalGroup itself, which ``env`` cannot set."""


def validate_env(env) -> dict[str, str]:
    """A copy of a group's ``env`` (``{}`` for ``None``).

    Raises:
        TypeError: ``env`` is not a dict of str to str.
        ValueError: it sets one of :data:`RESERVED_ENV`.
    """
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise TypeError(f"env must be a dict of str to str, such as "
                        f"{{'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}}, got {env!r}")
    taken = [k for k in env if k in RESERVED_ENV]
    if taken:
        raise ValueError(f"env cannot set {', '.join(taken)}: LocalGroup sets "
                         f"{', '.join(RESERVED_ENV)} on every rank itself")
    return dict(env)


def validate(world_size, backend, timeout) -> None:
    """Check a group's settings before anything starts.

    Raises:
        TypeError: ``world_size`` is not an int (a bool is not), or ``timeout`` is not a
            number of seconds.
        ValueError: ``world_size`` is not from 1 to :data:`MAX_WORLD_SIZE`, ``backend``
            is not one of :data:`BACKENDS`, or ``timeout`` is not positive and finite.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int from 1 to {MAX_WORLD_SIZE}, "
                        f"got {world_size!r} ({type(world_size).__name__})")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be from 1 to {MAX_WORLD_SIZE}, got {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} "
                         f"(CPU only), got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")


def loopback_interface() -> str:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS).

    Raises:
        RuntimeError: if no interface holds 127.0.0.1.
    """
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    raise RuntimeError("no network interface holds 127.0.0.1; gloo cannot be kept on loopback")


class _Proc:
    """Kernel-side handle of one rank: its process, its pid, when it started (psutil's
    ``create_time``, which tells a rank from a later process that reuses its pid) and its
    end of the pipe."""

    def __init__(self, rank: int, process, conn):
        self.rank = rank
        self.process = process
        self.pid = process.pid
        self.created = processes.create_time(process.pid)
        self.conn = conn

    def send(self, msg: dict) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> dict:
        return pickle.loads(self.conn.recv_bytes())

    def exitcode(self) -> int | None:
        try:
            return self.process.exitcode
        except ValueError:  # already closed
            return None


def start_ranks(ctx, procs: list[_Proc], world_size: int, backend: str, tmpdir: str,
                timeout: float, ifname: str, env: dict[str, str],
                spares: list[_Proc] | None = None) -> None:
    """Start ``world_size`` rank processes from the multiprocessing context ``ctx`` and
    append their handles to ``procs``, by rank, as each starts (so that the caller can
    stop those that started if a later one fails); then tell the reaper of their
    process groups, and of the forkserver.

    Call it with interrupts deferred (:func:`reducelab.processes.interrupts_deferred`).

    Args:
        tmpdir: the group's private directory (the ranks' ``FileStore`` is in it).
        timeout: the ranks' process group timeout in seconds.
        ifname: the loopback interface (:func:`loopback_interface`).
        env: each rank's whole environment.
        spares: processes from :func:`start_spares`, taken from the front (and removed
            from the list) for the first ranks, before any new process is forked. A
            spare that cannot be told its rank (it died) is stopped and replaced.

    Raises:
        OSError: a process or a pipe could not be made.
    """
    forked = []
    for rank in range(world_size):
        args = (rank, world_size, backend, tmpdir, timeout, ifname, list(sys.path), env)
        while spares:
            spare = spares.pop(0)
            try:
                spare.send({"kind": "assign", "args": args})
            except (OSError, ValueError):
                processes.stop([spare], None)
                continue
            spare.rank = rank
            procs.append(spare)
            break
        else:
            procs.append(_fork(ctx, _rank_main, rank, f"rank-{rank}", args[:5], args[5:]))
            forked.append(procs[-1])
    _tell_reaper(forked)


def start_spares(ctx, spares: list[_Proc], n: int) -> None:
    """Fork ``n`` spares from ``ctx`` and append them to ``spares``: processes that import
    what a rank imports and then wait to be told their rank (``assign``;
    :func:`reducelab.rank_loop.spare_main`), so that :func:`start_ranks` need not fork.
    Told to the reaper like ranks. Call it with interrupts deferred.

    Raises:
        OSError: a process or a pipe could not be made.
    """
    new = []
    try:
        for _ in range(n):
            new.append(_fork(ctx, _spare_main, -1, "spare", (), ()))
    finally:
        spares.extend(new)
        _tell_reaper(new)


def _fork(ctx, target, rank: int, name: str, before: tuple, after: tuple) -> _Proc:
    """One process running ``target(*before, conn, *after)``, and its handle as ``rank``
    (-1: a spare, until it is given one)."""
    parent, child = ctx.Pipe(duplex=True)
    try:
        proc = ctx.Process(target=target, name=f"{processes.PROCESS_PREFIX}{name}",
                           daemon=True, args=(*before, child, *after))
        proc.start()
    except BaseException:
        parent.close()
        child.close()
        raise
    child.close()
    return _Proc(rank, proc, parent)


def _tell_reaper(procs: list[_Proc]) -> None:
    if procs:
        Reaper.tell(*[f"pg {p.pid} {p.created}" for p in procs])
        processes.register_forkserver(procs[0].pid)


def _rank_main(*args) -> None:
    """A rank's target: imports the rank loop (and torch) only in the rank."""
    from .rank_loop import main
    main(*args)


def _spare_main(conn) -> None:
    """A spare's target (see :func:`start_spares`)."""
    from .rank_loop import spare_main
    spare_main(conn)
