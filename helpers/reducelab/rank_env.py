"""A rank's surroundings: what makes it behave like a process that ``torchrun`` started.

Introduced in notebook 01. The loop a rank runs (:mod:`reducelab.rank_loop`) sets these
up when the rank starts (:func:`lead_process_group`, :func:`setup`, :class:`DefaultGroup`)
and at each call (:func:`persistent`), so that the code a learner brings runs as it would
under ``torchrun`` on one machine:

* it is not a daemon, so it may start processes of its own (``DataLoader`` workers);
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set;
* its lasting namespace is its ``__main__`` module (:data:`MAIN`), so a class defined in
  a notebook cell can be pickled by reference, as torch's object collectives and
  ``torch.save`` do (:func:`persistent`);
* a function may end with ``dist.destroy_process_group()``: the rank joins a fresh
  default process group before the next call. ``dist.init_process_group(...)`` called
  while LocalGroup's own default group is up replaces it, and with no ``init_method``
  and no ``MASTER_ADDR`` it meets the other ranks through the group's private
  ``FileStore`` (where torchrun would give it a TCP store); see :class:`DefaultGroup`;
* it leads a process group of its own (:func:`lead_process_group`), so everything it
  starts can be stopped with it, by the kernel or by the kernel's
  :mod:`~reducelab.reaper`, and :func:`leave` takes it all along.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing as mp
import os
import signal
import sys
import types
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from .capture import install as install_streams
from .determinism import print_options

MAIN = types.ModuleType("__main__")
"""This rank's ``__main__`` module, installed in ``sys.modules`` when the rank starts."""
NAMESPACE: dict = MAIN.__dict__
"""This rank's lasting namespace (``__main__``'s globals): the globals of cell-defined
functions and of %%ranks cells."""
NAMESPACE["__builtins__"] = __builtins__


def lead_process_group() -> None:
    """Make this rank lead a process group of its own (``setpgid``), so that it is
    stopped as one with whatever it starts (POSIX; nothing on Windows)."""
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)


def setup(rank: int, world_size: int, loopback_ifname: str, sys_path: list[str],
          env: dict[str, str] | None) -> None:
    """Make this process look like a torchrun worker, once, before it joins the group.

    Args:
        rank, world_size: this rank and the group's size (ints).
        loopback_ifname: the loopback interface gloo is pinned to (``lo``, ``lo0``).
        sys_path: the kernel's ``sys.path``, so functions sent by reference import.
        env: the rank's whole environment, or ``None`` to keep the one it has.
    """
    # A kernel interrupt reaches the kernel's process group, not this one: a signal
    # here is the learner's own, and the processes this rank starts get the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "pthread_sigmask"):  # the forkserver blocks it (start_forkserver)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    mp.current_process().daemon = False  # like a torchrun worker: may start processes,
    mp.set_start_method(None, force=True)  # with the platform's default start method
    _pickle_main_by_value()
    sys.modules["__main__"] = MAIN
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    dist.set_debug_level_from_env()  # torch read it when the forkserver imported it
    os.environ.update(GLOO_SOCKET_IFNAME=loopback_ifname, RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    sys.path[:] = list(dict.fromkeys(sys_path + sys.path))
    torch.set_num_threads(1)  # world_size ranks share a laptop's few cores
    print_options()
    install_streams()


def _main_classes(values, found: dict, depth: int = 3, budget: list | None = None) -> dict:
    """Classes defined in ``__main__`` (a notebook cell) among ``values``, the types of
    their items, and so on ``depth`` containers deep (at most 1000 objects looked at)."""
    budget = budget if budget is not None else [1000]
    for value in values:
        if budget[0] <= 0:
            break
        budget[0] -= 1
        cls = value if isinstance(value, type) else type(value)
        if getattr(cls, "__module__", None) == "__main__" and "." not in cls.__qualname__:
            found[cls.__qualname__] = cls
        if depth > 0:
            if isinstance(value, dict):
                _main_classes(list(value.keys()) + list(value.values()), found, depth - 1, budget)
            elif isinstance(value, (list, tuple, set, frozenset)):
                _main_classes(list(value), found, depth - 1, budget)
    return found


def persistent(fn, args=(), kwargs=None, namespace: dict = NAMESPACE):
    """Give a function sent by value (defined in a cell) this rank's lasting globals.

    cloudpickle rebuilds such a function with a fresh dict of the globals it uses, so
    ``global x`` on a rank would be forgotten by the next call. Here the shipped
    globals are copied into this rank's ``__main__`` namespace, which lives as long
    as the rank, and the function runs with that namespace: the kernel's current
    values win for the names it sends, and names a rank function assigns with
    ``global`` persist. Classes defined in cells (in the globals, or the types of
    the arguments) become attributes of ``__main__``, so the standard pickler finds
    them by reference, as torch's object collectives need.
    """
    ns = namespace
    ns.update(_main_classes(list(args) + list((kwargs or {}).values()), {}))
    if not isinstance(fn, types.FunctionType):
        return fn
    module = sys.modules.get(fn.__module__ or "")
    if module is not None and fn.__globals__ is vars(module):
        return fn  # imported from a module (or already ours): its globals persist
    # the kernel's module dunders (__file__ of a script kernel, ...) stay behind: with
    # them, a process the rank starts with spawn would re-run the kernel's script
    ns.update((k, v) for k, v in fn.__globals__.items()
              if not (k.startswith("__") and k.endswith("__")))
    new = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    return new


def _pickle_main_by_value() -> None:
    """Let processes that a rank starts with spawn or forkserver (DataLoader workers on
    macOS and Windows) receive classes and functions defined in a notebook cell: the
    rank's pickler for processes sends them by value, with cloudpickle. Under torchrun,
    such a child would import them by re-running the script; a notebook has no script."""
    from multiprocessing.reduction import ForkingPickler

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)) and \
                getattr(obj, "__module__", None) == "__main__":
            return cloudpickle.loads, (cloudpickle.dumps(obj),)
        return NotImplemented
    ForkingPickler.reducer_override = reducer_override


def kill_descendants() -> None:
    """Kill every process this rank started (also those in a session of their own)."""
    import psutil
    try:
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    except psutil.Error:
        pass


def leave() -> None:
    """Exit now, and take every process this rank started along: its descendants (also
    those in a session of their own, found before they are orphaned), then its own
    process group, itself included."""
    kill_descendants()
    if hasattr(os, "killpg") and os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(0)


class DefaultGroup:
    """This rank's default process group: the one LocalGroup's ranks join at the start,
    joined again after a function destroyed it, and replaced when the learner's code
    calls ``dist.init_process_group`` itself.

    Args:
        rank, world_size, backend: as every rank of the group has them.
        tmpdir: the group's private directory, where the ``FileStore`` files are.
        timeout: the process group's timeout in seconds.
    """

    def __init__(self, rank: int, world_size: int, backend: str, tmpdir: str,
                 timeout: float):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.tmpdir, self.timeout = tmpdir, timeout
        self.own_pg = None  # the default process group this rank made itself
        self.stores = 0  # FileStores made so far: each new default group gets a fresh file

    def next_store(self) -> "dist.FileStore":
        """A fresh ``FileStore`` in the group's private directory. Every rank makes the
        same sequence of stores, so the n-th one of each rank is the same file."""
        name = "store" if self.stores == 0 else f"store.{self.stores}"
        self.stores += 1
        return dist.FileStore(os.path.join(self.tmpdir, name), self.world_size)

    def join(self, wait_for_all: bool = True) -> None:
        """Join a default process group of all ranks (the first, or after fn destroyed it).

        With ``wait_for_all``, returns once every rank has joined. Gloo's
        ``connectFullMesh`` can return on one rank while a peer is still connecting; had
        the first rank then destroyed the group at once (learner code that begins with
        its own ``init_process_group``, or with ``destroy_process_group``), the peer's
        join would fail with "Connection closed by peer". The wait is on the store, not
        a collective: the group's collective sequence numbers (which
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reports) start at 1, and
        ``TORCH_GLOO_LAZY_INIT`` still connects nothing, as under torchrun.

        A rank that is starting joins without it: the kernel sends no job until every
        rank has reported ``ready``, which is the same barrier. The store's wait polls
        every 10 ms (``FileStore::wait``, ``torch/csrc/distributed/c10d/FileStore.cpp``),
        and it cost a start of 3 or 4 ranks on 2 cores about 9 ms of its 40 to 50.
        """
        store = self.next_store()
        timeout = timedelta(seconds=self.timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank,
                                world_size=self.world_size, timeout=timeout)
        if wait_for_all:
            if store.add("reducelab/joined", 1) == self.world_size:
                store.set("reducelab/all joined", b"1")
            store.wait(["reducelab/all joined"], timeout)
        self.own_pg = dist.group.WORLD

    def collectives_issued(self) -> int | None:
        """How many collectives this rank has issued on the default process group: its
        sequence number (``ProcessGroup._get_sequence_number_for_group``, counted by
        gloo on every rank by default), or ``None`` where there is no default group or
        torch does not say. Ranks whose counts differ are out of step: the one ahead
        waits in its next collective for a message the others send under another tag
        (tried on torch 2.13: a rank that had caught one refused ``all_reduce`` more
        than the others hung in the next ``all_reduce``)."""
        if not dist.is_initialized():
            return None
        try:
            return int(dist.group.WORLD._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - not counted by this backend or torch version
            return None

    def own_pg_is_up(self) -> bool:
        return dist.is_initialized() and self.own_pg is not None and \
            dist.group.WORLD is self.own_pg

    def wrap_init_process_group(self) -> None:
        """Let ``dist.init_process_group`` in learner code run as it does under torchrun."""
        real = dist.init_process_group
        signature = inspect.signature(real)
        me = self

        @functools.wraps(real)
        def init_process_group(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            a = bound.arguments
            if me.own_pg_is_up():
                dist.destroy_process_group()  # the learner's own init replaces LocalGroup's
                me.own_pg = None
            if a.get("store") is None and a.get("init_method") in (None, "env://") \
                    and not os.environ.get("MASTER_ADDR"):
                a["init_method"] = None
                a["store"] = me.next_store()
                if a.get("rank", -1) == -1:
                    a["rank"] = me.rank
                if a.get("world_size", -1) == -1:
                    a["world_size"] = me.world_size
            return real(*bound.args, **bound.kwargs)

        dist.init_process_group = init_process_group
        dist.distributed_c10d.init_process_group = init_process_group
