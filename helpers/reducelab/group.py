"""LocalGroup: a gloo process group of local ranks, driven from notebook cells.

Introduced in notebook 01; every notebook builds on it. This module is the kernel side
of the group's lifecycle: start the ranks, send them work, collect results, report
failures, stop them. The loop each rank runs is in :mod:`reducelab.rank_loop`; starting
and stopping processes is in :mod:`reducelab.processes`.

Design, and the failures of the usual tools it avoids:

* Ranks start from a **forkserver** that imports torch once per kernel (about 2 s),
  after which a group of ranks starts in well under a second. The live kernel is never
  forked: once the kernel has run an OpenMP op, a forked child's matmul can deadlock,
  which is how accelerate's ``notebook_launcher`` hangs. Where there is no forkserver
  (Windows) ranks are started with ``spawn``.
* Functions travel by value with **cloudpickle**, so functions, lambdas and closures
  defined in cells work (``torch.multiprocessing.spawn`` cannot pickle them).
* Ranks behave like torchrun's processes (see :mod:`reducelab.rank_loop`): they may
  start processes, classes defined in cells pickle by reference, and a function may
  destroy and re-create the default process group.
* Rendezvous is a **FileStore** in a private (0700) temporary directory, and gloo is
  pinned to the loopback interface: nothing listens beyond 127.0.0.1, and the only
  channel into a rank is a socket pair whose other end the kernel holds.
* **One bound per call**: every public call returns or raises within its ``timeout``
  plus :data:`MARGIN` seconds (a rank that skips a collective costs ``timeout``
  seconds, not gloo's default 30 minutes; a dead rank is reported at once). Two
  allowances, both documented on :meth:`LocalGroup.run`: the forkserver's one-off
  start, and large return values that are still arriving (in chunks) when it ends.
* **Everything a group starts dies with it**: ranks, what they start, and, when the
  kernel is killed, the forkserver, through the kernel's :mod:`~reducelab.reaper`.
* **One call at a time**: ``run()``, ``resize()`` and ``close()`` may come from any
  thread; a second caller waits (within its timeout), and ``close()`` stops a run in
  progress at once.
"""
from __future__ import annotations

import atexit
import contextlib
import linecache
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait as mp_wait

import cloudpickle
import psutil

from . import display, processes, reports
from .capture import print_rank_outputs
from .errors import GroupBusyError, GroupClosedError, RankError
from .progress import StartProgress
from .reaper import Reaper

BACKENDS = ("gloo",)
"""Backends LocalGroup can start. gloo is the one torch backend that runs on any CPU."""

MAX_WORLD_SIZE = 64
MARGIN = 3.0
"""Seconds a call may take beyond its ``timeout``: the other ranks' time to report a
failure (``_GRACE``), the stuck ranks' time to say where they are (``_STACK_WAIT``),
and stopping the ranks."""
_GRACE = 1.0  # seconds the other ranks get to report once one rank has failed
_DEATH_GRACE = 0.3  # seconds the other ranks get to report once a rank has died
_STACK_WAIT = 1.0  # seconds to wait for stuck ranks to say where they are
_POLITE_WAIT = 0.5  # seconds idle ranks get to leave the process group before being killed
_CLOSE_WAIT = 5.0  # seconds close() waits for a run() in another thread to stop
BOOT_LIMIT = 120.0
"""Seconds a starting rank may take to import torch before it is called stuck: a fraction
of a second from the forkserver, a few seconds with the spawn start method (Windows);
not counted against ``timeout``."""
_CAN_WAKE = sys.platform != "win32"  # multiprocessing's wait() takes pipe fds on POSIX only

def loopback_interface() -> str:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS).

    Raises:
        RuntimeError: if no interface holds 127.0.0.1.
    """
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    raise RuntimeError("no network interface holds 127.0.0.1; gloo cannot be kept on loopback")


_RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME")


def _validate_env(env) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise TypeError(f"env must be a dict of str to str, such as "
                        f"{{'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}}, got {env!r}")
    taken = [k for k in env if k in _RESERVED_ENV]
    if taken:
        raise ValueError(f"env cannot set {', '.join(taken)}: LocalGroup sets "
                         f"{', '.join(_RESERVED_ENV)} on every rank itself")
    return dict(env)


def _validate(world_size, backend, timeout) -> None:
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


def _close_fds(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


_LIVE: "weakref.WeakSet[LocalGroup]" = weakref.WeakSet()
_STARTED: list = []  # weakrefs to the LocalGroups that started, oldest first


def current_group() -> "LocalGroup | None":
    """The open LocalGroup started most recently in this kernel, or ``None``.

    A group that a check starts and closes for itself does not hide the learner's own:
    closed groups are skipped."""
    for ref in reversed(_STARTED):
        g = ref()
        if g is not None and g.state != "closed":
            return g
    return None


@atexit.register
def _close_all() -> None:
    for g in list(_LIVE):
        g.close()


class LocalGroup:
    """A process group of ``world_size`` local ranks that run functions sent from the kernel.

    Example (notebook 01)::

        from reducelab import LocalGroup
        import torch, torch.distributed as dist

        def double_sum():
            t = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(t)          # ReduceOp.SUM by default
            return t

        with LocalGroup(world_size=4) as group:
            out = group.run(double_sum)   # out[r] is rank r's return value: tensor([10.])

    Args:
        world_size: number of ranks, an ``int`` from 1 to 64.
        backend: the ``torch.distributed`` backend; only ``"gloo"`` (CPU).
        timeout: seconds (``float``) that bound each call: starting the ranks, each
            :meth:`run` (including a restart of the ranks it needs), each
            :meth:`resize`; each call returns or raises within ``timeout`` plus
            :data:`MARGIN` seconds. Collectives on the ranks time out 5 s later, so the
            kernel's bound, which can say where each rank was, fires first.
        progress: how to show ranks joining while the group starts: ``None`` shows a
            status line when called from a notebook cell, ``False`` shows nothing, a
            callable gets ``(up, world_size)``, here and at each :meth:`resize`.
        env: environment variables (``{str: str}``) set on every rank before it joins
            the process group, such as ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``, which
            torch reads only then (notebook 11). The kernel's own environment is
            unchanged.

    Raises:
        TypeError, ValueError: bad ``world_size``, ``backend``, ``timeout`` or ``env``;
            nothing is started.
        RankError: a rank could not start or join the process group.

    Ranks persist across :meth:`run` calls, so state (a model, a tensor in a global)
    survives between cells and a widget change costs one round trip. After a rank dies,
    hangs or fails inside a collective, the group stops its ranks and starts fresh ones
    at the next :meth:`run`. :meth:`close` is idempotent; ranks, and every process they
    started, also stop when the kernel exits or is killed.

    Source: ``torch.distributed.init_process_group`` and ``FileStore``,
    https://pytorch.org/docs/stable/distributed.html
    """

    def __init__(self, world_size: int = 2, backend: str = "gloo", timeout: float = 30.0,
                 progress=None, env: dict[str, str] | None = None):
        _validate(world_size, backend, timeout)
        self._env = _validate_env(env)
        self._progress = progress
        self._world_size = world_size
        self._backend = backend
        self._timeout = float(timeout)
        self._procs: list[_Proc] = []
        self._tmpdir: str | None = None
        self._state = "stopped"
        self._closed = False
        self._sent_sources: set[str] = set()
        self._returned: dict[int, float] = {}  # rank -> when its fn returned (this call)
        self._chunks: dict[int, list[bytes]] = {}  # rank -> chunks of its value (this call)
        self._last_progress = 0.0  # when a chunk of a rank's value last arrived (this call)
        self._restart_next = False  # the ranks disagree on the default process group
        self._booted: set[int] = set()  # ranks whose imports are done (this start)
        self.restarts = 0
        """How many times the ranks were (re)started, the first start included."""
        self._finalizer = None
        self._lock = threading.Lock()  # held by the one call in progress
        self._owner: int | None = None  # the thread that holds it
        self._flags = threading.Lock()  # guards _closed and the wake pipe
        self._wake_r = self._wake_w = None
        if _CAN_WAKE:  # close() wakes a run() waiting in another thread through it
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
        self._fds = weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        _LIVE.add(self)
        deadline = time.monotonic() + self._timeout
        with self._exclusive("LocalGroup()", deadline):
            self._start(deadline, announce=True)
        _STARTED[:] = [r for r in _STARTED if r() is not None] + [weakref.ref(self)]

    # --- public -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world_size

    @property
    def backend(self) -> str:
        """The ``torch.distributed`` backend, ``"gloo"``."""
        return self._backend

    @property
    def timeout(self) -> float:
        """Seconds that bound each call (start, run, resize), plus :data:`MARGIN`."""
        return self._timeout

    @property
    def env(self) -> dict[str, str]:
        """The environment variables this group sets on its ranks (a copy)."""
        return dict(self._env)

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, by rank (empty when stopped)."""
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> int:
        """How many rank processes are alive now."""
        return sum(1 for p in self._procs if p.exitcode() is None)

    @property
    def state(self) -> str:
        """``"idle"``, ``"running"``, ``"stopped"`` (will restart at next run) or ``"closed"``."""
        return self._state

    def _set_state(self, state: str) -> None:
        if not self._closed:  # once closed, always closed
            self._state = state

    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank.

        ``fn`` is ordinary ``torch.distributed`` code: it runs inside the initialised
        default process group and may call ``dist.get_rank()``, ``dist.all_reduce`` and
        so on, so it runs unchanged under torchrun. It may be defined in a notebook
        cell, be a lambda or a closure; it and its arguments are sent by value. It may
        start processes (a ``DataLoader`` with workers), log, use object collectives
        with classes defined in cells, and end with ``dist.destroy_process_group()``.

        Returns:
            ``list`` of length ``world_size``: ``out[r]`` is ``fn``'s return value on rank
            ``r``, sent back by value (tensors included).

        Raises:
            RankError: ``fn`` raised on any rank (the message names the rank(s) and
                carries the remote tracebacks), a rank died, a rank's return value could
                not be pickled, or the call did not finish within ``timeout`` seconds (the
                message says which collective each rank was waiting in).
            TypeError: ``fn`` or its arguments cannot be pickled; nothing was run.
            GroupClosedError: the group was closed, before or during the call (a
                ``RuntimeError``).
            GroupBusyError: another thread's call on this group did not finish within
                ``timeout`` seconds (a ``RuntimeError``); nothing was run.
            KeyboardInterrupt: the kernel was interrupted; the ranks are stopped and
                restart at the next call.

        The bound: the call returns or raises within ``timeout`` + :data:`MARGIN`
        seconds, a restart of the ranks included. Two allowances: the first start in a
        kernel also waits for the forkserver to import torch (2 to 3 s, once); and
        once ``fn`` has returned on every rank within the timeout, large return values
        keep arriving for as long as they make progress: they travel in chunks of
        :data:`reducelab.rank_loop.CHUNK` bytes, and the call fails only when no chunk
        arrives for ``timeout`` seconds (400 MB per rank take about a second).

        What each rank printed is printed in the kernel in rank order, each line
        prefixed ``[rank N]``, also when the call fails (at most
        :data:`reducelab.capture.MAX_CHARS` characters per stream, rank and call).
        """
        if not callable(fn):
            raise TypeError(f"run() needs a function to run on every rank, got {fn!r}")
        deadline = time.monotonic() + self._timeout
        with self._exclusive("run()", deadline):
            if self._state == "idle":
                dead = {p.rank: p.exitcode() for p in self._procs if p.exitcode() is not None}
                if dead:
                    print(reports.idle_deaths(dead, self._world_size), file=sys.stderr)
                    self._shutdown()
            if self._state != "idle":
                deadline = self._start(deadline)
            sources = self._new_sources()  # after any restart: fresh ranks need every cell
            try:
                payload = cloudpickle.dumps((fn, args, kwargs, os.getcwd(), sources),
                                            protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                raise TypeError(f"cannot send {getattr(fn, '__name__', fn)!r} and its "
                                f"arguments to the ranks: {type(e).__name__}: {e}") from None
            self._check_open("run()")
            self._sent_sources.update(sources)
            name = getattr(fn, "__name__", "fn")
            self._set_state("running")
            self._returned, self._chunks = {}, {}
            try:
                try:
                    with processes.interrupts_deferred():  # every rank gets the job
                        for p in self._procs:
                            try:
                                p.send({"kind": "run", "payload": payload})
                            except OSError:
                                pass  # the rank died just now: _gather sees its sentinel
                except BaseException:  # interrupted: the ranks run a job nobody waits for
                    self._shutdown()
                    raise
                return self._collect_results(name, deadline)
            finally:
                self._chunks = {}  # a large value of a failed call is not kept
                if self._state == "running":
                    self._set_state("idle")

    def resize(self, world_size: int) -> None:
        """Stop the ranks and start ``world_size`` new ones (state on the ranks is lost).

        Does nothing if the group already has ``world_size`` idle ranks. Returns within
        ``timeout`` + :data:`MARGIN` seconds, a wait for another thread's call included.

        Raises:
            TypeError, ValueError: bad ``world_size``; the running group is kept.
            GroupClosedError: the group was closed.
            GroupBusyError: another thread's call did not finish within ``timeout``.
            RankError: the new ranks could not start (the group restarts at the next run).
            KeyboardInterrupt: interrupted while starting; likewise.
        """
        _validate(world_size, self._backend, self._timeout)
        deadline = time.monotonic() + self._timeout
        with self._exclusive("resize()", deadline):
            if world_size == self._world_size and self._state == "idle" and \
                    not self._restart_next:
                return
            self._shutdown(polite=True)
            self._world_size = world_size
            self._start(deadline, announce=callable(self._progress))

    def close(self) -> None:
        """Stop every rank (and all they started) and remove the group's temporary directory.

        Idempotent, and safe from any thread: a :meth:`run` in progress in another
        thread stops at once with :class:`GroupClosedError`. From inside a call on the
        same thread (a progress callback), the group closes when that call returns.
        Returns within about :data:`MARGIN` seconds (or 5 s if another thread's call is
        busy in the kernel, unpickling a large result, say).
        """
        with self._flags:
            if self._closed:
                return
            self._closed = True
            self._state = "closed"
            if self._wake_w is not None and self._fds.alive:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")  # wake a run() waiting in another thread
        _LIVE.discard(self)
        if self._owner == threading.get_ident():
            return  # inside this thread's own call: it stops everything when it returns
        if self._lock.acquire(timeout=_CLOSE_WAIT):
            try:
                self._shutdown(polite=True)
            finally:
                self._lock.release()
                self._fds()  # no call can be waiting on the wake pipe any more
        else:
            # another thread's call is busy in the kernel: stop the ranks under it (its
            # next wait or send fails and it raises GroupClosedError), and let it clean up
            finalizer = self._finalizer
            if finalizer is not None:
                finalizer()

    def __enter__(self) -> "LocalGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return display.group_repr(self._world_size, self._backend, self._timeout, self._env,
                                  self._state, self.alive)

    def _repr_html_(self) -> str:
        return display.group_html(self._world_size, self._backend, self._timeout, self._state,
                                  [p.exitcode() is None for p in self._procs])

    # --- one call at a time -----------------------------------------------------------
    def _check_open(self, what: str) -> None:
        """Raise :class:`GroupClosedError` if :meth:`close` came meanwhile."""
        if self._closed:
            raise GroupClosedError(_CLOSED_DURING.format(what=what))

    @contextlib.contextmanager
    def _exclusive(self, what: str, deadline: float):
        """Hold the group for one call: wait for another thread's call until ``deadline``
        (the call's own bound), then run; stop everything if the group was closed."""
        if self._owner == threading.get_ident():
            raise RuntimeError(f"{what} was called while this thread is already inside a "
                               f"call on the same LocalGroup (from a callback?); call it "
                               f"after that call returns")
        if self._closed:
            raise GroupClosedError(_CLOSED)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise GroupBusyError(f"{what} waited {self._timeout:g} s for another thread's "
                                 f"call on this LocalGroup to finish, and it has not; "
                                 f"nothing was run. Try again when it has returned.")
        self._owner = threading.get_ident()
        try:
            if self._closed:
                raise GroupClosedError(_CLOSED)
            yield
        except (OSError, ValueError, EOFError, IndexError, KeyError) as e:
            if not self._closed:
                raise
            raise GroupClosedError(_CLOSED_DURING.format(what=what)) from e
        finally:
            self._owner = None
            if self._closed:
                self._shutdown()
            self._lock.release()
            if self._closed:
                with self._flags:
                    self._fds()

    # --- lifecycle --------------------------------------------------------------------
    def _start(self, deadline: float, announce: bool = False) -> float:
        """Start ``world_size`` ranks and wait until all joined the process group.

        ``deadline`` is a ``time.monotonic()`` value. Two one-off costs extend it: the
        forkserver's first start, and, with the spawn start method, each rank's import of
        torch. Returns the deadline in force. ``announce`` shows the progress line
        (explicit starts); restarts after a failure are quiet, since the error already
        said the ranks restart.
        """
        self._shutdown()
        self._restart_next = False
        ctx = processes.context()
        deadline += processes.warm(ctx)
        ifname = loopback_interface()
        env = {**os.environ, **self._env}
        procs: list[_Proc] = []
        tmpdir = None
        try:
            with processes.interrupts_deferred():
                tmpdir = tempfile.mkdtemp(prefix="reducelab-")  # mode 0700
                # The reaper removes these if the kernel is killed (multiprocessing's own
                # temporary directory holds the forkserver's socket: only then is it ours
                # to remove).
                Reaper.tell(f"dir {tmpdir}", f"dir {mp.util.get_temp_dir()}")
                for rank in range(self._world_size):
                    parent, child = ctx.Pipe(duplex=True)
                    try:
                        proc = ctx.Process(
                            target=_rank_main, name=f"{processes.PROCESS_PREFIX}rank-{rank}",
                            daemon=True,
                            args=(rank, self._world_size, self._backend, tmpdir,
                                  self._timeout + 5.0, child, ifname, list(sys.path), env))
                        proc.start()
                    except BaseException:
                        parent.close()
                        child.close()
                        raise
                    child.close()
                    procs.append(_Proc(rank, proc, parent))
                Reaper.tell(*[f"pg {p.pid} {p.created}" for p in procs])
                if procs:
                    processes.register_forkserver(procs[0].pid)
                self._procs, self._tmpdir = procs, tmpdir
                self._finalizer = weakref.finalize(self, processes.stop, procs, tmpdir)
        except BaseException:
            processes.stop(procs, tmpdir)
            self._procs, self._tmpdir, self._finalizer = [], None, None
            raise
        self._sent_sources = set()
        self.restarts += 1
        progress = StartProgress(self._world_size, self._backend,
                                 self._progress if announce else False)
        try:
            booted_at = time.monotonic()
            state = self._gather(booted_at + BOOT_LIMIT, stop_on_error=True, until="booted")
            deadline += time.monotonic() - booted_at  # importing torch (spawn) is not the call's
            replies, died, pending = state
            unbooted = set(pending)
            if not died:
                replies, died, pending = self._gather(
                    deadline, stop_on_error=True, state=(replies, died, set(range(len(procs)))
                                                         - set(replies) - set(died)),
                    on_reply=progress.update)
        except BaseException:
            progress.done(0, ok=False)
            self._shutdown()
            raise
        errors = {r: m for r, m in replies.items() if m["kind"] != "ready"}
        progress.done(len(replies) - len(errors), ok=not (errors or died or pending))
        if errors or died or pending:
            self._shutdown()
            raise reports.start_failure(self._world_size, self._backend, self._timeout,
                                        BOOT_LIMIT, errors, died, pending, unbooted,
                                        self._booted)
        self._set_state("idle")
        return deadline

    def _shutdown(self, polite: bool = False) -> None:
        """Stop the ranks and all they started, once, whatever interrupts arrive meanwhile.

        The finalizer stops them at most once: here, when the group is garbage collected,
        or at interpreter exit (before the atexit close), whichever comes first."""
        with processes.interrupts_deferred():
            finalizer = self._finalizer
            if finalizer is not None and finalizer.alive:
                if polite and self._state in ("idle", "closed") and self._procs:
                    processes.ask_to_leave(self._procs, lambda p: p.send({"kind": "close"}),
                                           _POLITE_WAIT)
                finalizer()
            self._finalizer = None
            self._procs, self._tmpdir = [], None
            self._set_state("stopped")

    def _new_sources(self) -> dict[str, list[str]]:
        """Cell sources the ranks have not seen, so remote tracebacks show the code line.

        The caller marks them as sent (``_sent_sources``) once the job is pickled."""
        new = {}
        for filename, entry in list(linecache.cache.items()):
            if filename in self._sent_sources or len(entry) < 3:
                continue
            if entry[1] is None or not os.path.exists(filename):  # a cell, not a file
                new[filename] = entry[2]
        return new

    # --- waiting ----------------------------------------------------------------------
    def _wait_list(self, objects: list) -> list:
        return objects + ([self._wake_r] if self._wake_r is not None else [])

    def _gather(self, deadline: float, stop_on_error: bool, state=None, on_reply=None,
                until: str = "reply"):
        """Wait for one message from every rank, or until ``deadline`` (monotonic seconds).

        Returns ``(replies, died, pending)``: messages by rank, exit codes of the ranks
        that died, and the ranks that had not answered. Once a rank fails, the others
        get ``_GRACE`` seconds; a death ends the wait soon after. Pass a previous return
        value as ``state`` to go on waiting; ``on_reply(n)`` is called with the number of
        ``ready`` replies after each one. With ``until="booted"`` the wait ends for a rank
        once it has booted (its imports done); an error it sends first is a reply.

        Only ``ready``, ``done`` and ``error`` are replies; ``returned`` and ``chunk``
        record a value on its way; anything else (a late ``stack`` or ``closed``) is
        ignored.

        Raises:
            GroupClosedError: :meth:`close` was called from another thread meanwhile.
        """
        if until == "booted":
            self._booted = set()
        replies, died, pending = state or ({}, {}, set(range(len(self._procs))))
        cut = deadline
        while pending:
            left = cut - time.monotonic()
            if left <= 0:
                break
            by_conn = {self._procs[r].conn: r for r in pending}
            by_sentinel = {self._procs[r].process.sentinel: r for r in pending}
            ready = mp_wait(self._wait_list(list(by_conn) + list(by_sentinel)), timeout=left)
            self._check_open("the call")
            for obj in ready:
                r = by_conn.get(obj, by_sentinel.get(obj))
                if r not in pending:
                    continue
                proc = self._procs[r]
                if obj in by_conn or proc.conn.poll():
                    try:
                        msg = proc.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None:
                        kind = msg["kind"]
                        if kind in ("returned", "chunk"):
                            self._value_moved(r, msg)  # its result is on its way
                        elif kind == "booted":
                            self._booted.add(r)
                            if until == "booted":
                                pending.discard(r)
                        elif kind in ("ready", "done", "error"):
                            replies[r] = msg
                            pending.discard(r)
                            if kind == "done" and msg.get("chunks"):
                                self._last_progress = time.monotonic()
                            if on_reply is not None:
                                on_reply(sum(1 for m in replies.values() if m["kind"] == "ready"))
                                self._check_open("the call")
                            if stop_on_error and kind == "error":
                                self._chunks.pop(r, None)
                                cut = min(cut, time.monotonic() + _GRACE)
                        continue
                proc.process.join(0.5)
                died[r] = proc.exitcode()
                pending.discard(r)
                # a dead rank: do not wait on the rest, but let the ranks it left inside a
                # collective report the error gloo gives them (a closed connection)
                cut = min(cut, time.monotonic() + _DEATH_GRACE)
        return replies, died, pending

    def _where(self, ranks: set[int]) -> tuple[dict[int, dict], dict[int, dict]]:
        """Ask running ranks where they are.

        Returns ``(stacks, late)``: ``{rank: stack message}`` and the ``done``/``error``
        replies that arrived meanwhile (a rank that finished just then, or one whose big
        return value was on its way); the caller counts those as replies."""
        asked = {}
        for r in ranks:
            p = self._procs[r]
            if p.exitcode() is None:
                try:
                    p.send({"kind": "stack"})
                    asked[r] = p
                except (OSError, ValueError):
                    pass
        answers, late = {}, {}
        deadline = time.monotonic() + _STACK_WAIT
        while asked and time.monotonic() < deadline:
            ready = mp_wait(self._wait_list([p.conn for p in asked.values()]),
                            timeout=max(0.0, deadline - time.monotonic()))
            self._check_open("the call")
            for conn in ready:
                r = next((r for r, p in asked.items() if p.conn is conn), None)
                if r is None:
                    continue
                try:
                    msg = asked[r].recv()
                except (EOFError, OSError):
                    del asked[r]
                    continue
                if msg["kind"] in ("returned", "chunk"):
                    self._value_moved(r, msg)
                    continue
                if msg["kind"] == "stack":
                    answers[r] = msg
                elif msg["kind"] in ("done", "error"):
                    late[r] = msg  # its reply came first; its stack answer comes late
                else:
                    continue
                del asked[r]
        return answers, late

    def _value_moved(self, rank: int, msg: dict) -> None:
        """Record a ``returned`` or ``chunk`` message: the rank's value is on its way.

        Only a chunk is progress: a value that is still being pickled when the timeout
        ends gets no more time (a pickler that hangs must not extend the call)."""
        now = time.monotonic()
        self._returned.setdefault(rank, now)
        if msg["kind"] == "chunk":
            self._last_progress = now
            self._chunks.setdefault(rank, []).append(msg["data"])

    def _collect_results(self, name: str, deadline: float) -> list:
        self._last_progress = 0.0
        try:
            state = self._gather(deadline, True)
            while True:
                replies, died, pending = state
                stacks = {}
                if pending:
                    stacks, late = self._where(pending)
                    replies.update(late)
                    pending -= set(late)
                arriving = pending and not died and set(pending) <= set(self._returned) \
                    and all(m["kind"] == "done" for m in replies.values())
                # fn returned everywhere in time and large values are still arriving in
                # chunks: go on while they arrive, each chunk within a timeout of the last
                if not arriving or time.monotonic() - self._last_progress >= self._timeout:
                    break
                state = self._gather(self._last_progress + self._timeout, True,
                                     (replies, died, pending))
            stacks = {r: m for r, m in stacks.items() if r in pending}
        except KeyboardInterrupt:
            self._shutdown()
            print(reports.interrupted(self._world_size), file=sys.stderr)
            raise
        self._check_open("run()")
        outputs = {r: (m["out"], m["err"]) for r, m in {**replies, **stacks}.items()
                   if "out" in m}
        print_rank_outputs(outputs)
        failed = any(m["kind"] != "done" for m in replies.values()) or died or pending
        if not failed:
            results, bad = [], {}
            for r in range(self._world_size):
                data = b"".join(self._chunks.pop(r, [])) + replies[r]["result"]
                try:
                    results.append(cloudpickle.loads(data))
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001 - a __reduce__ may call sys.exit
                    bad[r] = e
            if bad:
                raise reports.unloadable(name, bad)
            self._check_default_groups(name, replies)
            return results
        raise self._failure(name, replies, died, pending, stacks)

    def _check_default_groups(self, name: str, replies: dict) -> None:
        """After a successful call: ranks that destroyed their default process group
        join a fresh one at the next call, which needs all of them to agree."""
        up = sorted(r for r, m in replies.items() if m.get("pg", True))
        down = sorted(r for r, m in replies.items() if not m.get("pg", True))
        if up and down:
            self._restart_next = True
            self._set_state("stopped")
            print(reports.destroyed_on_some(name, down, self._world_size), file=sys.stderr)

    def _failure(self, name, replies, died, pending, stacks) -> RankError:
        """The error of a failed call (worded in :mod:`reducelab.reports`); the ranks
        are stopped first when it says that fresh ones start."""
        error, restart = reports.run_failure(name, self._world_size, self._timeout, replies,
                                             died, pending, stacks, self._returned)
        if restart:
            self._shutdown()
        return error


_CLOSED = "this LocalGroup is closed; create a new one (in a notebook: run the setup cell again)"
_CLOSED_DURING = ("this LocalGroup was closed while {what} was in progress; its ranks were "
                  "stopped. Create a new one to go on (in a notebook: run the setup cell again).")


def _rank_main(*args) -> None:
    from .rank_loop import main
    main(*args)
