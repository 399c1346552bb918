"""LocalGroup: a gloo process group of local ranks, driven from notebook cells.

Introduced in notebook 01; every notebook builds on it. ``LocalGroup`` keeps the public
API and delegates to one room per concern; this module is its **lifecycle**: starting
the ranks under a deadline (and again after a failure), resizing, closing, and the
registry of open groups that explorers follow (:func:`current_group`). The other rooms,
kernel side:

* :mod:`reducelab.launch`: the settings checked, one process and one pipe per rank;
* :mod:`reducelab.dispatch`: one call at a time, the job sent to every rank, the
  replies gathered under one deadline, large return values moved in chunks;
* :mod:`reducelab.reports`: the wording of every failure and restart note;
* :mod:`reducelab.display`: the group's ``repr`` and HTML line;
* :mod:`reducelab.processes`: the forkserver, and stopping a rank with all it started.

On each rank: :mod:`reducelab.rank_loop` (the loop), :mod:`reducelab.rank_env` (what
makes a rank behave like torchrun's processes), :mod:`reducelab.rank_reports` (its
tracebacks, and where a stuck rank stands).

Design, and the failures of the usual tools it avoids:

* Ranks start from a **forkserver** that imports torch once per kernel (about 2 s),
  after which a group of ranks starts in well under a second. The live kernel is never
  forked: once the kernel has run an OpenMP op, a forked child's matmul can deadlock,
  which is how accelerate's ``notebook_launcher`` hangs. Where there is no forkserver
  (Windows) ranks are started with ``spawn``.
* Functions travel by value with **cloudpickle**, so functions, lambdas and closures
  defined in cells work (``torch.multiprocessing.spawn`` cannot pickle them).
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
import itertools
import multiprocessing as mp
import multiprocessing.util
import os
import sys
import tempfile
import threading
import time
import weakref

from . import display, processes, reports
from .capture import print_rank_outputs
from .dispatch import Call, CallGate, new_sources, outputs, pack
from .launch import BACKENDS, MAX_WORLD_SIZE, _Proc, loopback_interface, start_ranks, start_spares, \
    validate, validate_env
from .progress import StartProgress
from .reaper import Reaper

MARGIN = 3.0
"""Seconds a call may take beyond its ``timeout``: the other ranks' time to report a
failure (:data:`reducelab.dispatch.GRACE`), the stuck ranks' time to say where they are
(:data:`reducelab.dispatch.STACK_WAIT`), and stopping the ranks."""
_POLITE_WAIT = 0.5  # seconds idle ranks get to leave the process group before being killed
_CLOSE_WAIT = 5.0  # seconds close() waits for a run() in another thread to stop
BOOT_LIMIT = 120.0
"""Seconds a starting rank may take to import torch before it is called stuck: a fraction
of a second from the forkserver, a few seconds with the spawn start method (Windows);
not counted against ``timeout``."""


_LIVE: "weakref.WeakSet[LocalGroup]" = weakref.WeakSet()
_START_ORDER = itertools.count(1)  # LocalGroup.started: which group's ranks started last
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
    at the next :meth:`run`; not after the same refusal on every rank, such as gloo's
    ``ReduceOp.BAND`` on float32, which leaves them in step
    (:func:`reducelab.reports.the_same_refusal`). :meth:`close` is idempotent; ranks,
    and every process they started, also stop when the kernel exits or is killed.

    Source: ``torch.distributed.init_process_group`` and ``FileStore``,
    https://pytorch.org/docs/stable/distributed.html
    """

    def __init__(self, world_size: int = 2, backend: str = "gloo", timeout: float = 30.0,
                 progress=None, env: dict[str, str] | None = None):
        validate(world_size, backend, timeout)
        self._env = validate_env(env)
        self._progress = progress
        self._world_size = world_size
        self._backend = backend
        self._timeout = float(timeout)
        self._procs: list[_Proc] = []
        self._forked_in_hold = False  # ranks forked while the setup cell held requests
        self._runs_since_start = 0
        self._tmpdir: str | None = None
        self._state = "stopped"
        self._sent_sources: set[str] = set()  # cells the ranks have seen (this start)
        self._restart_next = False  # the ranks disagree on the default process group
        self.restarts = 0
        """How many times the ranks were (re)started, the first start included."""
        self.started = 0
        """When the ranks last started, in this kernel's order of starts (an int): process
        ids do not tell it, since a start may take spares forked earlier."""
        self._finalizer = None
        self._spares: list[_Proc] = []  # forked ahead for the next start (keep_spares)
        self._spares_lock = threading.Lock()  # guards _spares (keep_spares runs in a thread)
        self._spares_finalizer = weakref.finalize(self, processes.stop, self._spares, None)
        self._gate = CallGate(self._timeout)  # one call at a time; close from any thread
        _LIVE.add(self)
        deadline = time.monotonic() + self._timeout
        with self._gate.exclusive("LocalGroup()", deadline, self._shutdown):
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
        if not self._gate.closed:  # once closed, always closed
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
        seconds, a restart of the ranks included. Three allowances: the first start in a
        kernel also waits for the forkserver to import torch (2 to 3 s, once); in a
        Jupyter kernel whose setup cell imported DDP, DTensor, FSDP or DCP, a group's
        first run starts its ranks again, with what the forkserver imported for them
        after the setup cell, and waits for what is left of that import (at most about
        1.3 s of CPU, once; :func:`reducelab.processes.hold_requests_for_first_cell`); and
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
        processes.import_read_modules()  # what import_while_reading left, not on the clock
        deadline = time.monotonic() + self._timeout
        with self._gate.exclusive("run()", deadline, self._shutdown):
            if self._state == "idle":
                dead = {p.rank: p.exitcode() for p in self._procs if p.exitcode() is not None}
                if dead:
                    print(reports.idle_deaths(dead, self._world_size), file=sys.stderr)
                    self._shutdown()
            processes.release_requests()  # a first run ends the setup cell's hold
            if self._state == "idle" and self._runs_since_start == 0 and \
                    self._forked_in_hold and processes.released_later():
                # Ranks that have run nothing, forked before the server was asked for
                # DDP, DTensor, FSDP or DCP: new ones have them (the first DDP(model)
                # imports dynamo on every rank otherwise, about 2 s of CPU each).
                leaving = self._detach_ranks(polite=True)
                try:
                    deadline = self._start(deadline)
                finally:
                    leaving()
            if self._state != "idle":
                deadline = self._start(deadline)
            self._runs_since_start += 1
            # after any restart: fresh ranks need every cell
            sources = new_sources(self._sent_sources)
            payload = pack(fn, args, kwargs, sources)
            self._gate.check_open("run()")
            self._sent_sources.update(sources)
            name = getattr(fn, "__name__", "fn")
            self._set_state("running")
            call = Call(self._procs, self._gate, self._timeout)
            try:
                try:
                    with processes.interrupts_deferred():  # every rank gets the job
                        call.send({"kind": "run", "payload": payload})
                except BaseException:  # interrupted: the ranks run a job nobody waits for
                    self._shutdown()
                    raise
                return self._collect_results(name, call, deadline)
            finally:
                call.chunks.clear()  # a large value of a failed call is not kept
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
        validate(world_size, self._backend, self._timeout)
        deadline = time.monotonic() + self._timeout
        with self._gate.exclusive("resize()", deadline, self._shutdown):
            if world_size == self._world_size and self._state == "idle" and \
                    not self._restart_next:
                return
            leaving = self._detach_ranks(polite=True)
            try:
                self._world_size = world_size
                self._start(deadline, announce=callable(self._progress))
            finally:
                leaving()

    def keep_spares(self, n: int) -> int:
        """Keep ``n`` spare processes ready for the next start of ranks (a :meth:`resize`,
        or a restart after a failure): forked from the forkserver, torch imported, each
        waiting to be told its rank. A start takes them for its first ranks, so it waits
        for gloo to connect them, not for new processes. Forking was 40 to 60 % of a
        resize to 2 to 8 ranks on an idle 2-core machine (16 to 53 ms), and 50 to 85 %
        (58 to 206 ms) with four busy processes beside it.
        Each spare is a fresh process, never a former rank: a resize still loses all state.

        Forks the missing spares (about 6 ms each, idle) and stops any beyond ``n``,
        without holding the group: a :meth:`run` meanwhile is not delayed. Spares forked
        before the forkserver's later imports (:func:`reducelab.processes.generation`) are
        not used; they are stopped at the next start. They stop with the group. Explorers
        call this in the background after a move that resized the group. Returns the
        number of spares kept (0 with the ``spawn`` start method, where a process
        imports torch itself).

        Raises:
            TypeError, ValueError: ``n`` is not an int from 0 to ``MAX_WORLD_SIZE``.
            OSError: a process could not be forked (the spares made so far are kept).
        """
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int from 0 to {MAX_WORLD_SIZE}, got {n!r}")
        if not 0 <= n <= MAX_WORLD_SIZE:
            raise ValueError(f"n must be from 0 to {MAX_WORLD_SIZE}, got {n}")
        ctx = processes.context()
        if ctx.get_start_method() != "forkserver" or self._state == "closed":
            return 0
        with self._spares_lock:
            extra = self._spares[n:]
            del self._spares[n:]
            missing = n - len(self._spares)
        processes.stop(extra, None)
        if missing <= 0:
            return n
        generation = processes.generation()
        new: list[_Proc] = []
        try:
            with processes.interrupts_deferred():
                start_spares(ctx, new, missing)
        finally:
            for p in new:
                p.generation = generation
            with self._spares_lock:
                closed = self._state == "closed"
                if not closed:
                    self._spares.extend(new)
            if closed:
                processes.stop(new, None)
        return 0 if closed else len(self._spares)

    def _take_spares(self) -> list[_Proc]:
        """The spares a start may use now (forked with the forkserver's current imports);
        the others are stopped."""
        generation = processes.generation()
        with self._spares_lock:
            spares = list(self._spares)
            self._spares.clear()
        fresh = [p for p in spares if getattr(p, "generation", None) == generation
                 and p.exitcode() is None]
        processes.stop([p for p in spares if p not in fresh], None)
        return fresh

    def _return_spares(self, spares: list[_Proc]) -> None:
        with self._spares_lock:
            if self._state != "closed":
                self._spares[:0] = spares
                spares = []
        processes.stop(spares, None)

    def _stop_spares(self) -> None:
        with self._spares_lock:
            spares = list(self._spares)
            self._spares.clear()
        processes.stop(spares, None)

    def close(self) -> None:
        """Stop every rank (and all they started) and remove the group's temporary directory.

        Idempotent, and safe from any thread: a :meth:`run` in progress in another
        thread stops at once with :class:`GroupClosedError`. From inside a call on the
        same thread (a progress callback), the group closes when that call returns.
        Returns within about :data:`MARGIN` seconds (or 5 s if another thread's call is
        busy in the kernel, unpickling a large result, say).
        """
        if not self._gate.close():  # wakes a run() waiting in another thread
            return
        with self._spares_lock:
            self._state = "closed"
        _LIVE.discard(self)
        self._stop_spares()
        if self._gate.held_here():
            return  # inside this thread's own call: it stops everything when it returns
        if not self._gate.when_free(lambda: self._shutdown(polite=True), _CLOSE_WAIT):
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
        self._forked_in_hold = processes.forked_in_hold()  # without what the kernel imported
        self._runs_since_start = 0
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
                spares = self._take_spares()
                try:
                    start_ranks(ctx, procs, self._world_size, self._backend, tmpdir,
                                self._timeout + 5.0, ifname, env, spares)
                finally:
                    self._return_spares(spares)  # those a smaller group did not need
                self._procs, self._tmpdir = procs, tmpdir
                self._finalizer = weakref.finalize(self, processes.stop, procs, tmpdir)
        except BaseException:
            processes.stop(procs, tmpdir)
            self._procs, self._tmpdir, self._finalizer = [], None, None
            raise
        self._sent_sources = set()
        self.restarts += 1
        self.started = next(_START_ORDER)
        progress = StartProgress(self._world_size, self._backend,
                                 self._progress if announce else False)
        call = Call(procs, self._gate, self._timeout)
        try:
            booted_at = time.monotonic()
            state = call.gather(booted_at + BOOT_LIMIT, stop_on_error=True, until="booted")
            deadline += time.monotonic() - booted_at  # importing torch (spawn) is not the call's
            replies, died, pending = state
            unbooted = set(pending)
            if not died:
                replies, died, pending = call.gather(
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
                                        call.booted)
        self._set_state("idle")
        processes.ask_for_later(processes.kernel_later())  # in the background
        return deadline

    def _shutdown(self, polite: bool = False) -> None:
        """Stop the ranks and all they started, once, whatever interrupts arrive meanwhile.

        ``polite``: idle ranks are first told to leave and given :data:`_POLITE_WAIT`
        seconds to exit."""
        with processes.interrupts_deferred():
            self._detach_ranks(polite)()

    def _detach_ranks(self, polite: bool):
        """Detach the ranks from the group (its state is then ``stopped``) and return the
        call that stops them and all they started.

        If ``polite`` and the ranks are idle, they are told to leave (``close``) now, and
        the call returned waits what is left of :data:`_POLITE_WAIT` for them to exit
        before it stops and reaps them: a resize starts the new ranks in between (about a
        quarter less wait than leaving first, measured at 2 to 8 ranks). Ranks that are
        not idle are stopped here, and the call returned does nothing.

        The finalizer stops them at most once: in that call, when the group is garbage
        collected, or at interpreter exit (before the atexit close), whichever comes first."""
        with processes.interrupts_deferred():
            finalizer, procs = self._finalizer, self._procs
            alive = finalizer is not None and finalizer.alive
            told = bool(polite and alive and procs and self._state in ("idle", "closed"))
            if told:
                processes.ask_to_leave(procs, lambda p: p.send({"kind": "close"}), 0.0)
            self._finalizer = None
            self._procs, self._tmpdir = [], None
            self._set_state("stopped")
        until = time.monotonic() + _POLITE_WAIT

        def finish():
            with processes.interrupts_deferred():
                if told:
                    processes.ask_to_leave(procs, lambda p: None,
                                           max(0.0, until - time.monotonic()))
                if alive:
                    finalizer()
        if told:
            return finish
        finish()
        return lambda: None

    # --- what a run's outcome does to the group ---------------------------------------
    def _collect_results(self, name: str, call: Call, deadline: float) -> list:
        """Wait for the ranks' replies to ``call``'s job until ``deadline``, print what
        they printed, and return their values; or raise the failure, having stopped the
        ranks when fresh ones must start."""
        try:
            replies, died, pending, stacks = call.wait(deadline)
        except KeyboardInterrupt:
            self._shutdown()
            print(reports.interrupted(self._world_size), file=sys.stderr)
            raise
        self._gate.check_open("run()")
        processes.ask_for_later(processes.kernel_later().union(
            *(m.get("later", ()) for m in replies.values())))
        print_rank_outputs(outputs(replies, stacks))
        failed = any(m["kind"] != "done" for m in replies.values()) or died or pending
        if not failed:
            results, unloadable = call.results(replies)
            if unloadable:
                raise reports.unloadable(name, unloadable)
            self._check_default_groups(name, replies)
            return results
        error, restart = reports.run_failure(name, self._world_size, self._timeout, replies,
                                             died, pending, stacks, call.returned)
        if restart:
            self._shutdown()
        raise error

    def _check_default_groups(self, name: str, replies: dict) -> None:
        """After a successful call: ranks that destroyed their default process group
        join a fresh one at the next call, which needs all of them to agree."""
        up = sorted(r for r, m in replies.items() if m.get("pg", True))
        down = sorted(r for r, m in replies.items() if not m.get("pg", True))
        if up and down:
            self._restart_next = True
            self._set_state("stopped")
            print(reports.destroyed_on_some(name, down, self._world_size), file=sys.stderr)

