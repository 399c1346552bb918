"""Dispatch and waiting: one call at a time, the job sent to every rank, and the replies
gathered under one deadline (kernel side of :class:`~reducelab.LocalGroup`).

Introduced with notebook 01's ``LocalGroup``, which keeps the public API and delegates
here. The split follows ipyparallel's ``View`` (dispatch) and ``AsyncResult`` (waiting
and results):

* :class:`CallGate`: one call at a time. ``run()``, ``resize()`` and ``close()`` may
  come from any thread; a second caller waits within its own bound (then
  :class:`~reducelab.GroupBusyError`), and ``close()`` wakes a call that waits in
  another thread, which stops with :class:`~reducelab.GroupClosedError`.
* :func:`new_sources` and :func:`pack`: the ``run`` message, the function and its
  arguments by value (cloudpickle) with the notebook cells the ranks have not seen.
* :class:`Call`: one exchange with the ranks. It waits for one message from every rank
  under one deadline, watching each rank's pipe and its process sentinel (a death is
  seen at once), and gives the other ranks a short grace to report once one failed.
  A large return value arrives in chunks (:data:`reducelab.rank_loop.CHUNK` bytes) and
  gets more time only while chunks arrive. When the deadline passes, the ranks still
  running are asked where they are.

The messages are described in :mod:`reducelab.rank_loop`; what a failure says is
worded in :mod:`reducelab.reports`; starting and stopping the ranks is
:class:`~reducelab.LocalGroup`'s own (:mod:`reducelab.group`).
"""
from __future__ import annotations

import contextlib
import linecache
import os
import pickle
import sys
import threading
import time
import weakref
from multiprocessing.connection import wait as mp_wait

import cloudpickle
import cloudpickle.cloudpickle as _cloudpickle_impl

from .errors import GroupBusyError, GroupClosedError

GRACE = 1.0
"""Seconds the other ranks get to report once one rank has failed."""
DEATH_GRACE = 0.3
"""Seconds the other ranks get to report once a rank has died."""
STACK_WAIT = 1.0
"""Seconds to wait for stuck ranks to say where they are."""
_CAN_WAKE = sys.platform != "win32"  # multiprocessing's wait() takes pipe fds on POSIX only

_CLOSED = "this LocalGroup is closed; create a new one (in a notebook: run the setup cell again)"
_CLOSED_DURING = ("this LocalGroup was closed while {what} was in progress; its ranks were "
                  "stopped. Create a new one to go on (in a notebook: run the setup cell again).")


def _close_fds(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class CallGate:
    """One call at a time on one group, and a close that may come from any thread.

    Args:
        timeout: the group's ``timeout`` in seconds, which a second caller waits at
            most (named in :class:`~reducelab.GroupBusyError`'s message).
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.closed = False
        self._lock = threading.Lock()  # held by the one call in progress
        self._owner: int | None = None  # the thread that holds it
        self._flags = threading.Lock()  # guards closed and the wake pipe
        self._wake_r = self._wake_w = None
        if _CAN_WAKE:  # close() wakes a call waiting in another thread through it
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
        self._fds = weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)

    def check_open(self, what: str) -> None:
        """Raise :class:`GroupClosedError` if :meth:`close` came meanwhile."""
        if self.closed:
            raise GroupClosedError(_CLOSED_DURING.format(what=what))

    def wait_list(self, objects: list) -> list:
        """``objects`` for ``multiprocessing.connection.wait``, with the wake pipe that
        :meth:`close` writes to."""
        return objects + ([self._wake_r] if self._wake_r is not None else [])

    @contextlib.contextmanager
    def exclusive(self, what: str, deadline: float, on_closed):
        """Hold the group for one call: wait for another thread's call until ``deadline``
        (the call's own bound, ``time.monotonic()`` seconds), then run; if the group was
        closed meanwhile, ``on_closed()`` stops everything before the gate opens.

        Raises:
            RuntimeError: this thread is already inside a call on the group.
            GroupClosedError: the group is closed, or was closed during the call (an
                ``OSError``, ``ValueError``, ``EOFError``, ``IndexError`` or ``KeyError``
                raised then, by a pipe or process closed under the call, becomes one).
            GroupBusyError: another thread's call did not end by ``deadline``.
        """
        if self._owner == threading.get_ident():
            raise RuntimeError(f"{what} was called while this thread is already inside a "
                               f"call on the same LocalGroup (from a callback?); call it "
                               f"after that call returns")
        if self.closed:
            raise GroupClosedError(_CLOSED)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise GroupBusyError(f"{what} waited {self.timeout:g} s for another thread's "
                                 f"call on this LocalGroup to finish, and it has not; "
                                 f"nothing was run. Try again when it has returned.")
        self._owner = threading.get_ident()
        try:
            if self.closed:
                raise GroupClosedError(_CLOSED)
            yield
        except (OSError, ValueError, EOFError, IndexError, KeyError) as e:
            if not self.closed:
                raise
            raise GroupClosedError(_CLOSED_DURING.format(what=what)) from e
        finally:
            self._owner = None
            if self.closed:
                on_closed()
            self._lock.release()
            if self.closed:
                with self._flags:
                    self._fds()

    def close(self) -> bool:
        """Mark the group closed and wake a call that waits in another thread.

        Returns ``False`` if the group was closed already."""
        with self._flags:
            if self.closed:
                return False
            self.closed = True
            if self._wake_w is not None and self._fds.alive:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")  # wake a run() waiting in another thread
        return True

    def held_here(self) -> bool:
        """Whether this thread is inside a call on the group (a progress callback, say)."""
        return self._owner == threading.get_ident()

    def when_free(self, stop, wait: float) -> bool:
        """After :meth:`close`: call ``stop()`` once no call holds the gate, waiting at
        most ``wait`` seconds, then close the wake pipe. ``False`` if a call still held
        it (``stop`` was not called)."""
        if not self._lock.acquire(timeout=wait):
            return False
        try:
            stop()
        finally:
            self._lock.release()
            self._fds()  # no call can be waiting on the wake pipe any more
        return True


def new_sources(sent: set[str]) -> dict[str, list[str]]:
    """Cell sources the ranks have not seen (not in ``sent``), so remote tracebacks show
    the code line: ``{filename: lines}`` from ``linecache``.

    The caller marks them as sent once the job is pickled."""
    new = {}
    for filename, entry in list(linecache.cache.items()):
        if filename in sent or len(entry) < 3:
            continue
        if entry[1] is None or not os.path.exists(filename):  # a cell, not a file
            new[filename] = entry[2]
    return new


_SCAN = getattr(_cloudpickle_impl, "_find_imported_submodules", None)
_SUBMODULES: dict = {}
"""What :func:`_remembered_submodules` found, by ``(fingerprint of sys.modules, the
code's names, the packages)``: the modules, as cloudpickle returned them."""


def _remembered_submodules(code, top_level_dependencies):
    """cloudpickle's ``_find_imported_submodules``, remembered until ``sys.modules``
    changes.

    To pickle a function by value, cloudpickle looks for the submodules it reaches
    through a package global (``torch.distributed`` through ``torch``) by reading every
    name in ``sys.modules`` for every package the function uses: with torch imported,
    3,000-odd names per package, per function, per :meth:`~reducelab.LocalGroup.run`.
    For notebook 08's rank function (six functions by value) that was 24 of the 33 ms
    of :func:`pack` on an idle 2-core machine, on every move of its explorer. The
    answer depends only on the code's names, the packages among its globals and
    ``sys.modules``, which changes only by imports: the search is done again when the
    number of modules or the last one added differs."""
    packages = tuple(x.__name__ for x in top_level_dependencies
                     if isinstance(x, type(sys)) and getattr(x, "__package__", None))
    fingerprint = (len(sys.modules), next(reversed(sys.modules.keys()), None))
    key = (fingerprint, code.co_names, packages)
    found = _SUBMODULES.get(key)
    if found is None:
        if any(k[0] != fingerprint for k in _SUBMODULES):
            _SUBMODULES.clear()
        found = _SUBMODULES[key] = tuple(_SCAN(code, top_level_dependencies))
    return list(found)


if _SCAN is not None:
    _cloudpickle_impl._find_imported_submodules = _remembered_submodules


def pack(fn, args: tuple, kwargs: dict, sources: dict[str, list[str]]) -> bytes:
    """The ``payload`` of a ``run`` message: ``fn``, its arguments, the kernel's working
    directory and the cell ``sources``, pickled by value with cloudpickle.

    Raises:
        TypeError: ``fn`` or its arguments cannot be pickled.
    """
    try:
        return cloudpickle.dumps((fn, args, kwargs, os.getcwd(), sources),
                                 protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"cannot send {getattr(fn, '__name__', fn)!r} and its "
                        f"arguments to the ranks: {type(e).__name__}: {e}") from None


def outputs(replies: dict[int, dict], stacks: dict[int, dict]) -> dict[int, tuple[str, str]]:
    """What each rank printed during the call, ``{rank: (stdout, stderr)}``, from its
    reply or, for a stuck rank, from its ``stack`` answer."""
    return {r: (m["out"], m["err"]) for r, m in {**replies, **stacks}.items() if "out" in m}


class Call:
    """One exchange with a group's ranks: a start, or a ``run()``.

    Args:
        procs: the ranks' kernel-side handles (:class:`reducelab.launch._Proc`), by rank.
        gate: the group's :class:`CallGate`; a close from another thread ends any wait
            with :class:`~reducelab.GroupClosedError`.
        timeout: seconds a large return value may go without a new chunk.

    What arrived besides the replies is kept here, for this exchange only: which ranks
    finished their imports (``booted``), whose ``fn`` returned (``returned``, rank to
    ``time.monotonic()``), and the chunks of their return values (``chunks``).
    """

    def __init__(self, procs: list, gate: CallGate, timeout: float):
        self.procs, self.gate, self.timeout = procs, gate, timeout
        self.returned: dict[int, float] = {}  # rank -> when its fn returned
        self.chunks: dict[int, list[bytes]] = {}  # rank -> chunks of its value so far
        self.last_progress = 0.0  # when a chunk of a rank's value last arrived
        self.booted: set[int] = set()  # ranks whose imports are done (a start)

    def send(self, msg: dict) -> None:
        """Send ``msg`` to every rank; a rank that died just now is seen by :meth:`gather`."""
        for p in self.procs:
            try:
                p.send(msg)
            except OSError:
                pass  # the rank died just now: gather() sees its sentinel

    def gather(self, deadline: float, stop_on_error: bool, state=None, on_reply=None,
               until: str = "reply"):
        """Wait for one message from every rank, or until ``deadline`` (monotonic seconds).

        Returns ``(replies, died, pending)``: messages by rank, exit codes of the ranks
        that died, and the ranks that had not answered. Once a rank fails, the others
        get :data:`GRACE` seconds; a death ends the wait soon after. Pass a previous
        return value as ``state`` to go on waiting; ``on_reply(n)`` is called with the
        number of ``ready`` replies after each one. With ``until="booted"`` the wait ends
        for a rank once it has booted (its imports done); an error it sends first is a
        reply.

        Only ``ready``, ``done`` and ``error`` are replies; ``returned`` and ``chunk``
        record a value on its way; anything else (a late ``stack`` or ``closed``) is
        ignored.

        Raises:
            GroupClosedError: the group was closed from another thread meanwhile.
        """
        if until == "booted":
            self.booted = set()
        replies, died, pending = state or ({}, {}, set(range(len(self.procs))))
        cut = deadline
        while pending:
            left = cut - time.monotonic()
            if left <= 0:
                break
            by_conn = {self.procs[r].conn: r for r in pending}
            by_sentinel = {self.procs[r].process.sentinel: r for r in pending}
            ready = mp_wait(self.gate.wait_list(list(by_conn) + list(by_sentinel)),
                            timeout=left)
            self.gate.check_open("the call")
            for obj in ready:
                r = by_conn.get(obj, by_sentinel.get(obj))
                if r not in pending:
                    continue
                proc = self.procs[r]
                if obj in by_conn or proc.conn.poll():
                    try:
                        msg = proc.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None:
                        kind = msg["kind"]
                        if kind in ("returned", "chunk"):
                            self.value_moved(r, msg)  # its result is on its way
                        elif kind == "booted":
                            self.booted.add(r)
                            if until == "booted":
                                pending.discard(r)
                        elif kind in ("ready", "done", "error"):
                            replies[r] = msg
                            pending.discard(r)
                            if kind == "done" and msg.get("chunks"):
                                self.last_progress = time.monotonic()
                            if on_reply is not None:
                                on_reply(sum(1 for m in replies.values() if m["kind"] == "ready"))
                                self.gate.check_open("the call")
                            if stop_on_error and kind == "error":
                                self.chunks.pop(r, None)
                                cut = min(cut, time.monotonic() + GRACE)
                        continue
                proc.process.join(0.5)
                died[r] = proc.exitcode()
                pending.discard(r)
                # a dead rank: do not wait on the rest, but let the ranks it left inside a
                # collective report the error gloo gives them (a closed connection)
                cut = min(cut, time.monotonic() + DEATH_GRACE)
        return replies, died, pending

    def where(self, ranks: set[int]) -> tuple[dict[int, dict], dict[int, dict]]:
        """Ask running ranks where they are.

        Returns ``(stacks, late)``: ``{rank: stack message}`` and the ``done``/``error``
        replies that arrived meanwhile (a rank that finished just then, or one whose big
        return value was on its way); the caller counts those as replies."""
        asked = {}
        for r in ranks:
            p = self.procs[r]
            if p.exitcode() is None:
                try:
                    p.send({"kind": "stack"})
                    asked[r] = p
                except (OSError, ValueError):
                    pass
        answers, late = {}, {}
        deadline = time.monotonic() + STACK_WAIT
        while asked and time.monotonic() < deadline:
            ready = mp_wait(self.gate.wait_list([p.conn for p in asked.values()]),
                            timeout=max(0.0, deadline - time.monotonic()))
            self.gate.check_open("the call")
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
                    self.value_moved(r, msg)
                    continue
                if msg["kind"] == "stack":
                    answers[r] = msg
                elif msg["kind"] in ("done", "error"):
                    late[r] = msg  # its reply came first; its stack answer comes late
                else:
                    continue
                del asked[r]
        return answers, late

    def value_moved(self, rank: int, msg: dict) -> None:
        """Record a ``returned`` or ``chunk`` message: the rank's value is on its way.

        Only a chunk is progress: a value that is still being pickled when the timeout
        ends gets no more time (a pickler that hangs must not extend the call)."""
        now = time.monotonic()
        self.returned.setdefault(rank, now)
        if msg["kind"] == "chunk":
            self.last_progress = now
            self.chunks.setdefault(rank, []).append(msg["data"])

    def wait(self, deadline: float):
        """Wait for every rank's reply to a ``run`` until ``deadline`` (monotonic
        seconds), then ask the ranks still running where they are.

        Once ``fn`` has returned on every rank in time, large values that are still
        arriving get more time, each chunk within ``timeout`` seconds of the last.

        Returns ``(replies, died, pending, stacks)``: the ``done`` and ``error`` messages
        by rank, exit codes of the ranks that died, the ranks that did not answer, and
        where each of those was (its ``stack`` message).
        """
        self.last_progress = 0.0
        state = self.gather(deadline, True)
        while True:
            replies, died, pending = state
            stacks = {}
            if pending:
                stacks, late = self.where(pending)
                replies.update(late)
                pending -= set(late)
            arriving = pending and not died and set(pending) <= set(self.returned) \
                and all(m["kind"] == "done" for m in replies.values())
            # fn returned everywhere in time and large values are still arriving in
            # chunks: go on while they arrive, each chunk within a timeout of the last
            if not arriving or time.monotonic() - self.last_progress >= self.timeout:
                break
            state = self.gather(self.last_progress + self.timeout, True,
                                (replies, died, pending))
        stacks = {r: m for r, m in stacks.items() if r in pending}
        return replies, died, pending, stacks

    def results(self, replies: dict[int, dict]) -> tuple[list, dict[int, BaseException]]:
        """Unpickle every rank's return value (its chunks, then the ``done`` message's
        last bytes). Returns ``(results, errors)``: the values by rank, and what
        unpickling raised, by rank (a value's ``__reduce__`` may even call ``sys.exit``).

        Raises:
            KeyboardInterrupt: the kernel was interrupted while unpickling.
        """
        results, errors = [], {}
        for r in range(len(self.procs)):
            data = b"".join(self.chunks.pop(r, [])) + replies[r]["result"]
            try:
                results.append(cloudpickle.loads(data))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - a __reduce__ may call sys.exit
                errors[r] = e
        return results, errors
