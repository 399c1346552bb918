"""LocalGroup: a gloo process group of local ranks, driven from notebook cells.

Introduced in notebook 01; every notebook builds on it. This module is the kernel side
of the group's lifecycle: start the ranks, send them work, collect results, report
failures, stop them. The loop each rank runs is in :mod:`reducelab.rank_loop`.

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
* **Every wait is bounded** by ``timeout``: a rank that skips a collective costs
  ``timeout`` seconds, not gloo's default 30 minutes; a dead rank is reported at once.
"""
from __future__ import annotations

import atexit
import html
import linecache
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import wait as mp_wait

import cloudpickle
import psutil

from .capture import print_rank_outputs
from .errors import GroupClosedError, RankError, RankReport
from .progress import StartProgress

BACKENDS = ("gloo",)
"""Backends LocalGroup can start. gloo is the one torch backend that runs on any CPU."""

MAX_WORLD_SIZE = 64
_GRACE = 1.0  # seconds the other ranks get to report once one rank has failed
_DEATH_GRACE = 0.3  # seconds the other ranks get to report once a rank has died
_STACK_WAIT = 1.0  # seconds to wait for stuck ranks to say where they are
_MAX_EXTENSIONS = 10  # extra timeouts granted while finished ranks are still sending


def _context():
    """The multiprocessing context ranks start from: forkserver with torch preloaded."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # torch._dynamo is what DistributedDataParallel and DTensor import on first use
        # (about 1.2 s of CPU per rank); loading it once in the server saves that on
        # every rank of every group.
        ctx.set_forkserver_preload(["reducelab.rank_loop", "torch._dynamo"])
        return ctx
    return mp.get_context("spawn")


def loopback_interface() -> str:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS).

    Raises:
        RuntimeError: if no interface holds 127.0.0.1.
    """
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    raise RuntimeError("no network interface holds 127.0.0.1; gloo cannot be kept on loopback")


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "died"
    if code < 0:
        try:
            return f"died: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"died: killed by signal {-code}"
    return f"died: exited with code {code} without returning"


def _error_kind(summary: str) -> str:
    """``"ValueError"`` from ``"ValueError: bad"``; ``"an error"`` for a sentence."""
    head = summary.split(":")[0]
    return head if re.fullmatch(r"[A-Za-z_][\w.]*", head) else "an error"


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
    """Kernel-side handle of one rank: its process and its end of the pipe."""

    def __init__(self, rank: int, process, conn):
        self.rank = rank
        self.process = process
        self.conn = conn

    def send(self, msg: tuple) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> tuple:
        return pickle.loads(self.conn.recv_bytes())


def _ask_to_close(procs: list[_Proc], wait: float = 2.0) -> None:
    """Ask idle ranks to leave the process group and exit; wait up to ``wait`` seconds."""
    for p in procs:
        try:
            p.send(("close",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + wait
    for p in procs:
        p.process.join(max(0.0, deadline - time.monotonic()))


def _stop(procs: list[_Proc], tmpdir: str | None) -> None:
    """Kill the ranks still alive, reap them, and remove the group's temporary directory."""
    for p in procs:
        if p.process.is_alive():
            p.process.kill()
    for p in procs:
        p.process.join(2.0)
        p.conn.close()
        try:
            p.process.close()
        except ValueError:
            pass
    if tmpdir:
        shutil.rmtree(tmpdir, ignore_errors=True)


_LIVE: "weakref.WeakSet[LocalGroup]" = weakref.WeakSet()
_LATEST: list = []  # [weakref to the LocalGroup made last]


def current_group() -> "LocalGroup | None":
    """The LocalGroup made most recently in this kernel, if it is still open."""
    g = _LATEST[0]() if _LATEST else None
    return g if g is not None and g.state != "closed" else None


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
        timeout: seconds (``float``) that bound every wait: starting the ranks, each
            :meth:`run` call, and each collective inside it.
        progress: how to show ranks joining while the group starts (here and in
            :meth:`resize`): ``None`` shows a status line in a Jupyter kernel,
            ``False`` shows nothing, a callable gets ``(up, world_size)``.

    Raises:
        TypeError, ValueError: bad ``world_size``, ``backend`` or ``timeout``; nothing
            is started.
        RankError: a rank could not start or join the process group.

    Ranks persist across :meth:`run` calls, so state (a model, a tensor in a global)
    survives between cells and a widget change costs one round trip. After a rank dies,
    hangs or fails inside a collective, the group stops its ranks and starts fresh ones
    at the next :meth:`run`. :meth:`close` is idempotent; ranks also stop when the kernel
    exits or is killed.

    Source: ``torch.distributed.init_process_group`` and ``FileStore``,
    https://pytorch.org/docs/stable/distributed.html
    """

    def __init__(self, world_size: int = 2, backend: str = "gloo", timeout: float = 30.0,
                 progress=None):
        _validate(world_size, backend, timeout)
        self._progress = progress
        self._world_size = world_size
        self._backend = backend
        self._timeout = float(timeout)
        self._procs: list[_Proc] = []
        self._tmpdir: str | None = None
        self._state = "stopped"
        self._closed = False
        self._sent_sources: set[str] = set()
        self._returned: set[int] = set()  # ranks whose fn returned in the current run()
        self.restarts = 0
        """How many times the ranks were (re)started, the first start included."""
        self._finalizer = None
        _LIVE.add(self)
        _LATEST[:] = [weakref.ref(self)]
        self._start(announce=True)

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
        """Seconds that bound each wait (start, run, collective)."""
        return self._timeout

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, by rank (empty when stopped)."""
        return [p.process.pid for p in self._procs]

    @property
    def alive(self) -> int:
        """How many rank processes are alive now."""
        return sum(1 for p in self._procs if p.process.is_alive())

    @property
    def state(self) -> str:
        """``"idle"``, ``"running"``, ``"stopped"`` (will restart at next run) or ``"closed"``."""
        return self._state

    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank.

        ``fn`` is ordinary ``torch.distributed`` code: it runs inside the initialised
        default process group and may call ``dist.get_rank()``, ``dist.all_reduce`` and
        so on, so it runs unchanged under torchrun. It may be defined in a notebook
        cell, be a lambda or a closure; it and its arguments are sent by value.

        Returns:
            ``list`` of length ``world_size``: ``out[r]`` is ``fn``'s return value on rank
            ``r``, sent back by value (tensors included).

        Raises:
            RankError: ``fn`` raised on any rank (the message names the rank(s) and
                carries the remote tracebacks), a rank died, a rank's return value could
                not be pickled, or the call did not finish within ``timeout`` seconds (the
                message says which collective each rank was waiting in).
            TypeError: ``fn`` or its arguments cannot be pickled; nothing was run.
            GroupClosedError: the group was closed (a ``RuntimeError``).
            KeyboardInterrupt: the kernel was interrupted; the ranks are stopped and
                restart at the next call.

        What each rank printed is printed in the kernel in rank order, each line
        prefixed ``[rank N]``, also when the call fails.
        """
        if self._closed:
            raise GroupClosedError("this LocalGroup is closed; create a new one "
                                   "(in a notebook: run the setup cell again)")
        if not callable(fn):
            raise TypeError(f"run() needs a function to run on every rank, got {fn!r}")
        if self._state == "idle":
            dead = {p.rank: p.process.exitcode for p in self._procs if not p.process.is_alive()}
            if dead:
                print(f"Note: {'; '.join(f'rank {r} {_describe_exit(c)}' for r, c in dead.items())}"
                      f" while idle; starting {self._world_size} fresh ranks.", file=sys.stderr)
                self._shutdown()
        if self._state != "idle":
            self._start()
        sources = self._new_sources()  # after any restart: fresh ranks need every cell
        try:
            payload = cloudpickle.dumps((fn, args, kwargs, os.getcwd(), sources),
                                        protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments "
                            f"to the ranks: {type(e).__name__}: {e}") from None
        self._sent_sources.update(sources)
        name = getattr(fn, "__name__", "fn")
        self._state = "running"
        self._returned = set()
        try:
            try:
                for p in self._procs:
                    try:
                        p.send(("run", payload))
                    except OSError:
                        pass  # the rank died just now: _gather sees its sentinel and reports it
            except BaseException:  # interrupted while sending: some ranks may be running
                self._shutdown()
                raise
            return self._collect_results(name)
        finally:
            if self._state == "running":
                self._state = "idle"

    def resize(self, world_size: int) -> None:
        """Stop the ranks and start ``world_size`` new ones (state on the ranks is lost).

        Does nothing if the group already has ``world_size`` idle ranks.

        Raises:
            TypeError, ValueError: bad ``world_size``; the running group is kept.
            GroupClosedError: the group was closed.
            RankError: the new ranks could not start (the group restarts at the next run).
            KeyboardInterrupt: interrupted while starting; likewise.
        """
        if self._closed:
            raise GroupClosedError("this LocalGroup is closed; create a new one "
                                   "(in a notebook: run the setup cell again)")
        _validate(world_size, self._backend, self._timeout)
        if world_size == self._world_size and self._state == "idle":
            return
        self._shutdown(polite=True)
        self._world_size = world_size
        self._start(announce=True)

    def close(self) -> None:
        """Stop every rank and remove the group's temporary directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutdown(polite=True)
        self._state = "closed"
        _LIVE.discard(self)

    def __enter__(self) -> "LocalGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LocalGroup(world_size={self._world_size}, backend={self._backend!r}, "
                f"timeout={self._timeout:g}, state={self._state!r}, "
                f"alive={self.alive}/{self._world_size})")

    def _repr_html_(self) -> str:
        colour = {"idle": "#2a7", "running": "#d80", "stopped": "#888", "closed": "#888"}
        dots = "".join(
            f'<span title="rank {p.rank}" style="color:{"#2a7" if p.process.is_alive() else "#c33"}">●</span>'
            for p in self._procs) or "–"
        return (f'<div style="font-family:monospace"><b>LocalGroup</b> '
                f'backend={html.escape(self._backend)} world_size={self._world_size} '
                f'timeout={self._timeout:g}s ranks alive {self.alive}/{self._world_size} {dots} '
                f'<span style="color:{colour.get(self._state, "#888")}">{self._state}</span></div>')

    # --- lifecycle --------------------------------------------------------------------
    def _start(self, announce: bool = False) -> None:
        """Start ``world_size`` ranks and wait until all joined the process group.

        ``announce`` shows the progress line (explicit starts); restarts after a failure
        are quiet, since the error already said the ranks restart.
        """
        self._shutdown()
        ctx = _context()
        ifname = loopback_interface()
        tmpdir = tempfile.mkdtemp(prefix="reducelab-")  # mode 0700
        # multiprocessing's own temp dir (the forkserver's socket): if the kernel is
        # killed, no finalizer runs, so the ranks remove it along with ours.
        mp_tmp = mp.util.get_temp_dir()
        procs = []
        try:
            for rank in range(self._world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_rank_main, name=f"reducelab-rank-{rank}", daemon=True,
                    args=(rank, self._world_size, self._backend, tmpdir,
                          self._timeout + 5.0, child, os.getpid(), ifname, list(sys.path),
                          mp_tmp))
                proc.start()
                child.close()
                procs.append(_Proc(rank, proc, parent))
        except BaseException:
            _stop(procs, tmpdir)
            raise
        self._procs, self._tmpdir = procs, tmpdir
        self._sent_sources = set()
        self._finalizer = weakref.finalize(self, _stop, procs, tmpdir)
        self.restarts += 1
        progress = StartProgress(self._world_size, self._backend,
                                 self._progress if announce else False)
        try:
            replies, died, pending = self._gather(time.monotonic() + self._timeout,
                                                  stop_on_error=True, on_reply=progress.update)
        except KeyboardInterrupt:
            progress.done(0, ok=False)
            self._shutdown()
            raise
        errors = {r: m for r, m in replies.items() if m[0] != "ready"}
        progress.done(len(replies) - len(errors), ok=not (errors or died or pending))
        if errors or died or pending:
            reports = [RankReport(r, "raised", m[1], m[2]) for r, m in errors.items()]
            reports += [RankReport(r, "died", _describe_exit(c)) for r, c in died.items()]
            reports += [RankReport(r, "stuck", f"did not join within {self._timeout:g} s")
                        for r in pending]
            self._shutdown()
            raise RankError(f"the {self._world_size} ranks could not start a "
                            f"{self._backend} process group", reports)
        self._state = "idle"

    def _shutdown(self, polite: bool = False) -> None:
        # The finalizer stops the ranks at most once: here, when the group is garbage
        # collected, or at interpreter exit (before the atexit close), whichever is first.
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None and finalizer.alive:
            if polite and self._state == "idle":
                _ask_to_close(self._procs)
            finalizer()
        self._procs, self._tmpdir = [], None
        if not self._closed:
            self._state = "stopped"

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
    def _gather(self, deadline: float, stop_on_error: bool, state=None, on_reply=None):
        """Wait for one message from every rank, or until ``deadline`` (monotonic seconds).

        Returns ``(replies, died, pending)``: messages by rank, exit codes of the ranks
        that died, and the ranks that had not answered. Once a rank fails, the others
        get ``_GRACE`` seconds; a death ends the wait soon after. Pass a previous return
        value as ``state`` to go on waiting; ``on_reply(n)`` is called with the number of
        replies after each one.
        """
        replies, died, pending = state or ({}, {}, set(range(len(self._procs))))
        cut = deadline
        while pending:
            left = cut - time.monotonic()
            if left <= 0:
                break
            by_conn = {self._procs[r].conn: r for r in pending}
            by_sentinel = {self._procs[r].process.sentinel: r for r in pending}
            for obj in mp_wait(list(by_conn) + list(by_sentinel), timeout=left):
                r = by_conn.get(obj, by_sentinel.get(obj))
                if r not in pending:
                    continue
                proc = self._procs[r]
                if obj in by_conn or proc.conn.poll():
                    try:
                        msg = proc.recv()
                        if msg[0] == "returned":
                            self._returned.add(r)  # its result is on its way
                            continue
                        if msg[0] == "stack":
                            continue  # a late answer to an earlier stack request
                        replies[r] = msg
                        pending.discard(r)
                        if on_reply is not None:
                            on_reply(sum(1 for m in replies.values() if m[0] == "ready"))
                        if stop_on_error and replies[r][0] == "error":
                            cut = min(cut, time.monotonic() + _GRACE)
                        continue
                    except (EOFError, OSError):
                        pass
                proc.process.join(0.5)
                died[r] = proc.process.exitcode
                pending.discard(r)
                # a dead rank: do not wait on the rest, but let the ranks it left inside a
                # collective report the error gloo gives them (a closed connection)
                cut = min(cut, time.monotonic() + _DEATH_GRACE)
        return replies, died, pending

    def _where(self, ranks: set[int]) -> tuple[dict[int, tuple], dict[int, tuple]]:
        """Ask running ranks where they are.

        Returns ``(stacks, late)``: ``{rank: ("stack", ...)}`` and the ``"done"``/``"error"``
        replies that arrived meanwhile (a rank that finished just then, or one whose big
        return value was on its way); the caller counts those as replies."""
        asked = {}
        for r in ranks:
            p = self._procs[r]
            if p.process.is_alive():
                try:
                    p.send(("stack",))
                    asked[r] = p
                except (OSError, ValueError):
                    pass
        answers, late = {}, {}
        deadline = time.monotonic() + _STACK_WAIT
        while asked and time.monotonic() < deadline:
            for conn in mp_wait([p.conn for p in asked.values()],
                                timeout=deadline - time.monotonic()):
                r = next(r for r, p in asked.items() if p.conn is conn)
                try:
                    msg = asked[r].recv()
                except (EOFError, OSError):
                    del asked[r]
                    continue
                if msg[0] == "returned":
                    self._returned.add(r)
                    continue
                if msg[0] == "stack":
                    answers[r] = msg
                else:  # its reply came first; its stack answer, still to come, is stale
                    late[r] = msg
                del asked[r]
        return answers, late

    def _collect_results(self, name: str) -> list:
        try:
            replies, died, pending = self._gather(time.monotonic() + self._timeout, True)
            stacks, extensions = {}, 0
            while pending:
                stacks, late = self._where(pending)
                replies.update(late)
                pending -= set(late)
                sending = pending and not died and all(
                    m[0] == "done" for m in replies.values()) and pending <= self._returned
                if not sending or extensions == _MAX_EXTENSIONS:
                    break
                # fn finished everywhere; big return values are still on their way
                extensions += 1
                replies, died, pending = self._gather(time.monotonic() + self._timeout, True,
                                                      (replies, died, pending))
            stacks = {r: m for r, m in stacks.items() if r in pending}
        except KeyboardInterrupt:
            self._shutdown()
            print(f"Interrupted: the {self._world_size} ranks were stopped; they restart "
                  f"at the next run().", file=sys.stderr)
            raise
        outputs = {r: (m[-2], m[-1]) for r, m in {**replies, **stacks}.items()
                   if m[0] in ("done", "error", "stack")}
        print_rank_outputs(outputs)
        failed = any(m[0] != "done" for m in replies.values()) or died or pending
        if not failed:
            results, bad = [], []
            for r in range(self._world_size):
                try:
                    results.append(cloudpickle.loads(replies[r][1]))
                except Exception as e:
                    bad.append(RankReport(r, "raised", "its return value could not be "
                                          f"unpickled in the kernel: {type(e).__name__}: {e}"))
            if not bad:
                return results
            raise RankError(f"{name} returned a value the kernel cannot load", bad)
        raise self._failure(name, replies, died, pending, stacks)

    def _failure(self, name, replies, died, pending, stacks) -> RankError:
        reports = []
        restart = bool(died or pending)
        for r, m in replies.items():
            if m[0] == "error":
                reports.append(RankReport(r, "raised", m[1], m[2]))
                restart = restart or m[3]  # an error inside torch.distributed
            else:
                reports.append(RankReport(r, "returned", f"{name} returned"))
        for r, code in died.items():
            reports.append(RankReport(r, "died", _describe_exit(code)))
        for r in pending:
            if r in stacks:
                _, text, collective, summary, _, _ = stacks[r]
                reports.append(RankReport(r, "stuck", summary, text, collective))
            elif r in self._returned:
                reports.append(RankReport(r, "stuck", f"{name} returned; its return value was "
                                                      f"still being pickled or sent"))
            else:
                reports.append(RankReport(r, "stuck", "was still running"))
        raised = sorted(r for r, m in replies.items() if m[0] == "error")
        if died:
            r = min(died)
            headline = f"rank {r} {_describe_exit(died[r])} during {name}"
        elif raised:
            kinds = sorted({_error_kind(replies[r][1]) for r in raised})
            who = f"rank {raised[0]}" if len(raised) == 1 else \
                f"ranks {', '.join(map(str, raised))}"
            named = [k for k in kinds if k != "an error"]
            verb = f"raised {' / '.join(named)}" if named else "failed"
            headline = f"{who} {verb} in {name}"
        else:
            collectives = {r: stacks[r][2] for r in pending if r in stacks}
            headline = (f"{name} did not finish within {self._timeout:g} s on "
                        f"rank{'s' if len(pending) > 1 else ''} "
                        f"{', '.join(map(str, sorted(pending)))}")
            in_collective = {c for c in collectives.values() if c}
            if in_collective and (len(set(collectives.values())) > 1 or any(
                    m[0] == "done" for m in replies.values())):
                headline += ": the ranks are not in the same collective"
        hint = ""
        if restart:
            hint = (f"The ranks were stopped; {self._world_size} fresh ranks start at the "
                    f"next run().")
            self._shutdown()
        return RankError(headline, reports, hint)


def _rank_main(*args) -> None:
    from .rank_loop import main
    main(*args)
