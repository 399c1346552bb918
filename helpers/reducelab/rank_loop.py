"""The loop that runs on each rank: join the process group, then run what the kernel sends.

Introduced in notebook 01. Each rank is a process started from a clean forkserver (never
forked from the live kernel). It joins a gloo process group through a ``FileStore`` in the
group's private temporary directory, with gloo pinned to the loopback interface, so
nothing listens beyond 127.0.0.1. Then it waits for jobs on a pipe (an ``AF_UNIX``
socket pair: no network endpoint, and only the kernel holds the other end).

A rank behaves like a process that ``torchrun`` started on one machine, so that the
code a learner brings runs as it would there:

* it is not a daemon, so it may start processes of its own (``DataLoader`` workers);
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set;
* its lasting namespace is its ``__main__`` module, so a class defined in a notebook
  cell can be pickled by reference, as torch's object collectives and ``torch.save`` do;
* a function may end with ``dist.destroy_process_group()``: the rank joins a fresh
  default process group before the next call. ``dist.init_process_group(...)`` called
  while LocalGroup's own default group is up replaces it, and with no ``init_method``
  and no ``MASTER_ADDR`` it meets the other ranks through the group's private
  ``FileStore`` (where torchrun would give it a TCP store);
* it leads a process group of its own (``setpgid``), so everything it starts can be
  stopped with it, by the kernel or by the kernel's :mod:`~reducelab.reaper`.

Messages, each a ``pickle`` of a ``dict`` with a ``"kind"`` (the kernel is the only peer
that can write them):

* kernel -> rank: ``run`` (``payload``), ``stack``, ``close``.
* rank -> kernel: ``booted`` (its imports are done), ``ready`` (``pid``), ``returned``
  (fn returned; its result is being pickled and sent), ``chunk`` (``data``: the next
  :data:`CHUNK` bytes of the pickled result, sent while the pickler writes it),
  ``done`` (``result``: the last bytes of the pickled result), ``error`` (``summary``,
  ``traceback``, ``in_distributed``), ``stack`` (``traceback``, ``collective``,
  ``summary``), ``closed``. ``done``, ``error`` and ``stack`` carry ``out`` and
  ``err``, the text the call printed; ``done`` and ``error`` carry ``pg``, whether a
  default process group is up after the call.

``payload`` and ``result`` are cloudpickle bytes, so functions defined in notebook cells
travel by value, and tensors come back by value (not through torch's shared-memory
reductions, which fail once the sender exits).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
import types
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from .capture import capture, install as install_streams
from .determinism import print_options

_THIS_FILE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.dirname(_THIS_FILE) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DIST_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep

MAX_SUMMARY = 500
"""Characters of an exception's first line kept in the one-line summary."""
MAX_TRACEBACK = 20_000
"""Characters of one remote traceback kept (its head and its tail), whatever the message size."""

CHUNK = 16 << 20
"""Bytes per message of a return value: a large one arrives as ``chunk`` messages, so the
kernel sees it progress."""

MAIN = types.ModuleType("__main__")
"""This rank's ``__main__`` module, installed in ``sys.modules`` when the rank starts."""
NAMESPACE: dict = MAIN.__dict__
"""This rank's lasting namespace (``__main__``'s globals): the globals of cell-defined
functions and of %%ranks cells."""
NAMESPACE["__builtins__"] = __builtins__


def _is_dist_frame(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_DIST_DIR)


def where(frames: list[traceback.FrameSummary]) -> tuple[str | None, str]:
    """Name the ``torch.distributed`` call and the user line in a list of frames.

    Returns ``(collective, summary)``, e.g. ``("all_reduce", "in all_reduce, called
    from my_fn line 4")``. ``collective`` is the outermost function defined in
    ``torch/distributed/distributed_c10d.py`` (the public collective) or ``None``.
    """
    collective = None
    for f in frames:
        if f.filename.endswith("distributed_c10d.py"):
            collective = f.name
            break
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
            and os.path.abspath(f.filename) != _THIS_FILE]
    at = f"{user[-1].name} line {user[-1].lineno}" if user else "fn"
    if collective:
        return collective, f"was waiting in {collective}, called from {at}"
    return None, f"was still running, at {at}"


_LAUNCHERS = ("exec_on_rank",)  # reducelab functions that only run the learner's code


def _after_launcher(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """Drop the frames of the rank's own machinery: everything up to the call of ``fn``
    in :meth:`_Rank.run_job` (and ``%%ranks``' own ``exec_on_rank``). Frames inside
    reducelab helpers that the learner's code called stay."""
    start = 0
    for i, f in enumerate(frames):
        if f.name == "run_job" and os.path.abspath(f.filename) == _THIS_FILE:
            start = i + 1
    rest = frames[start:]
    while rest and rest[0].name in _LAUNCHERS and \
            os.path.abspath(rest[0].filename).startswith(_PACKAGE_DIR):
        rest = rest[1:]
    return rest


def _cut(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and tail with a note."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return (f"{text[:half]}\n[... {len(text) - 2 * half:,} characters cut ...]\n"
            f"{text[-half:]}")


def safe_str(obj) -> str:
    """``str(obj)``, or a note saying why it could not be made (a learner's ``__str__`` may raise)."""
    try:
        return str(obj)
    except BaseException as e:  # noqa: BLE001 - any failure of user code becomes text
        return f"<str() of this {type(obj).__name__} raised {type(e).__name__}>"


def _trim(te: traceback.TracebackException, seen: set) -> None:
    """Cut the launcher frames from ``te`` and from the exceptions chained to it."""
    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list(_after_launcher(list(te.stack)))
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _trim(chained, seen)


def describe_exception(error: BaseException) -> tuple[str, str, bool]:
    """``(summary, traceback_text, in_distributed)`` for an exception raised by ``fn``.

    The traceback starts at ``fn`` and keeps the chained exceptions (``raise ... from``
    and errors during handling), as Python prints them. Safe against exceptions whose
    ``__str__`` raises, and bounded: the summary to :data:`MAX_SUMMARY`, the traceback to
    :data:`MAX_TRACEBACK` characters.
    """
    frames = _after_launcher(traceback.extract_tb(error.__traceback__))
    try:
        te = traceback.TracebackException.from_exception(error)
        _trim(te, set())
        text = "".join(te.format())
    except BaseException:  # noqa: BLE001 - fall back to the frames alone
        text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) \
            + f"{type(error).__name__}: {safe_str(error)}\n"
    first = safe_str(error).strip().splitlines()
    name = type(error).__name__
    summary = _cut(f"{name}: {first[0]}" if first else name, MAX_SUMMARY)
    in_dist = any(_is_dist_frame(f.filename) for f in frames)
    return summary, _cut(text, MAX_TRACEBACK), in_dist


class _ChunkWriter:
    """A file for ``pickle.dump`` that sends a return value in :data:`CHUNK`-byte
    ``chunk`` messages as the pickler writes it, so the kernel sees it progress while it
    is still being pickled."""

    def __init__(self, rank: "_Rank"):
        self.rank = rank
        self.pending = bytearray()
        self.sent = 0

    def write(self, data) -> int:
        self.pending += data
        while len(self.pending) >= CHUNK:
            self.rank.send({"kind": "chunk", "data": bytes(self.pending[:CHUNK])})
            del self.pending[:CHUNK]
            self.sent += CHUNK
            self.rank.sending = self.sent
        return len(data)


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


def _kill_descendants() -> None:
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
    _kill_descendants()
    if hasattr(os, "killpg") and os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(0)


class _Rank:
    def __init__(self, rank: int, world_size: int, backend: str, tmpdir: str,
                 timeout: float, conn):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.tmpdir, self.timeout = tmpdir, timeout
        self.conn = conn
        self.jobs: queue.Queue = queue.Queue()
        self.send_lock = threading.Lock()
        self.main_ident = threading.get_ident()
        self.output = None  # the RankOutput of the call in progress
        self.sending = 0  # bytes of a return value being sent, 0 when not sending
        self.phase = "idle"  # idle -> loading -> (joining) -> running -> pickling -> idle
        self.namespace = NAMESPACE
        self.own_pg = None  # the default process group this rank made itself
        self.stores = 0  # FileStores made so far: each new default group gets a fresh file

    # --- the pipe -------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(data)

    def reader(self) -> None:
        """Thread: read the kernel's messages; answer ``stack`` at once, queue the rest.

        When the pipe closes, the kernel has stopped this rank or is gone: leave now,
        with everything this rank started. Nothing is removed here; the kernel, or its
        reaper once the kernel is dead, removes the group's files."""
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                leave()
            if msg["kind"] == "stack":
                try:
                    self.send(self.stack())
                except (OSError, ValueError):
                    leave()
            else:
                self.jobs.put(msg)

    def stack(self) -> dict:
        out, err = self.output.texts() if self.output else ("", "")
        reply = {"kind": "stack", "traceback": "", "collective": None, "out": out, "err": err}
        if self.sending:
            return {**reply, "summary": f"was sending its return value "
                                        f"({self.sending / 1e6:.0f} MB)"}
        if self.phase not in ("running", "pickling"):
            return {**reply, "summary": {
                "idle": "was between calls (had not received fn)",
                "loading": "was still loading fn (unpickling it, importing its modules)",
                "joining": "was joining a fresh default process group (the last call "
                           "destroyed it)",
            }.get(self.phase, f"was {self.phase}")}
        frame = sys._current_frames().get(self.main_ident)
        frames = _after_launcher(traceback.extract_stack(frame)) if frame else []
        collective, summary = where(frames)
        if self.phase == "pickling":
            summary = "fn returned; its return value was still being pickled" + \
                summary.partition("was still running")[2]
        return {**reply, "traceback": "".join(traceback.format_list(frames)),
                "collective": collective, "summary": summary}

    # --- the default process group ------------------------------------------------------
    def next_store(self) -> "dist.FileStore":
        """A fresh ``FileStore`` in the group's private directory. Every rank makes the
        same sequence of stores, so the n-th one of each rank is the same file."""
        name = "store" if self.stores == 0 else f"store.{self.stores}"
        self.stores += 1
        return dist.FileStore(os.path.join(self.tmpdir, name), self.world_size)

    def join(self) -> None:
        """Join a default process group of all ranks (the first, or after fn destroyed it)."""
        dist.init_process_group(self.backend, store=self.next_store(), rank=self.rank,
                                world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout))
        self.own_pg = dist.group.WORLD

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

    # --- jobs -----------------------------------------------------------------------
    def run_job(self, payload: bytes) -> dict:
        self.phase = "loading"
        try:
            fn, args, kwargs, cwd, sources = cloudpickle.loads(payload)
        except BaseException as e:  # e.g. a module the kernel has and the rank has not
            summary, text, _ = describe_exception(e)
            return {"kind": "error", "summary": f"could not unpickle the job: {summary}",
                    "traceback": text, "in_distributed": False, "out": "", "err": ""}
        for filename, lines in sources.items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        if not dist.is_initialized():
            self.phase = "joining"
            try:
                self.join()
            except BaseException as e:
                summary, text, _ = describe_exception(e)
                return {"kind": "error", "summary": "could not join a fresh default process "
                        f"group: {summary}", "traceback": text, "in_distributed": True,
                        "out": "", "err": ""}
        fn = self.persistent(fn, args, kwargs)
        self.output = None
        self.phase = "running"
        with capture() as self.output:
            try:
                result = fn(*args, **kwargs)
                error = None
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: report them
                error = e
        out, err = self.output.texts()
        pg = dist.is_initialized()
        if error is not None:
            summary, text, in_dist = describe_exception(error)
            return {"kind": "error", "summary": summary, "traceback": text,
                    "in_distributed": in_dist, "out": out, "err": err, "pg": pg}
        # Tell the kernel fn has returned before pickling the result: pickling a big
        # tensor holds the GIL, so the reader thread could not say so while it runs.
        self.send({"kind": "returned"})
        self.phase = "pickling"
        writer = _ChunkWriter(self)
        try:
            cloudpickle.Pickler(writer, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
        except BaseException as e:
            summary, _, _ = describe_exception(e)
            return {"kind": "error", "summary": f"its return value could not be pickled "
                    f"({type(result).__name__}): {summary}", "traceback": "",
                    "in_distributed": False, "out": out, "err": err, "pg": pg}
        return {"kind": "done", "result": bytes(writer.pending), "chunks": writer.sent > 0,
                "out": out, "err": err, "pg": pg}

    def persistent(self, fn, args=(), kwargs=None):
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
        ns = self.namespace
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

    def serve(self, msg: dict) -> None:
        """Run one job and send its reply; any failure of this module is reported too."""
        try:
            reply = self.run_job(msg["payload"])
        except BaseException as e:  # a failure of reducelab itself: say so, do not die
            summary, _, _ = describe_exception(e)
            reply = {"kind": "error", "summary": f"reducelab failed on this rank: {summary}",
                     "traceback": _cut(traceback.format_exc(), MAX_TRACEBACK),
                     "in_distributed": False, "out": "", "err": ""}
        try:
            self.send(reply)
        except (OSError, ValueError, OverflowError, MemoryError) as e:
            self.send({"kind": "error", "summary": f"its return value could not be sent: "
                       f"{safe_str(e)}", "traceback": "", "in_distributed": False,
                       "out": reply.get("out", ""), "err": reply.get("err", ""),
                       "pg": reply.get("pg", True)})
        finally:
            self.sending = 0
            self.output = None
            self.phase = "idle"

    def loop(self) -> None:
        while True:
            msg = self.jobs.get()
            if msg["kind"] == "close":
                return
            if msg["kind"] == "run":
                self.serve(msg)


def main(rank: int, world_size: int, backend: str, tmpdir: str, timeout: float, conn,
         loopback_ifname: str, sys_path: list[str], env: dict[str, str] | None = None) -> None:
    """Entry point of rank ``rank``; called by ``multiprocessing`` in a fresh process.

    Reports ``booted`` (its imports, torch's included, are done), joins the default
    process group (``FileStore`` rendezvous in ``tmpdir``), reports ``ready``, then serves
    jobs until ``close`` or until the kernel is gone. A failure before it is ready is
    reported with its traceback, never only as an exit code.

    Args:
        rank, world_size: this rank and the group's size (ints).
        backend: ``"gloo"``.
        tmpdir: the group's private directory; the store file is ``tmpdir/store``.
        timeout: the process group's timeout in seconds: the kernel's ``timeout`` plus
            5 s, so the kernel's own bound, which can say where each rank was, fires first.
        conn: this rank's end of the socket pair to the kernel.
        loopback_ifname: the loopback interface gloo is pinned to (``lo``, ``lo0``).
        sys_path: the kernel's ``sys.path``, so functions sent by reference import.
        env: the rank's whole environment: the kernel's when the group started, with the
            group's own ``env`` on top (a forkserver child would otherwise see the
            environment of the moment the forkserver started).
    """
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)  # a process group of its own: stopped as one, whatever it starts
    conn.send_bytes(pickle.dumps({"kind": "booted"}, protocol=pickle.HIGHEST_PROTOCOL))
    step = "start"
    try:
        me = _Rank(rank, world_size, backend, tmpdir, timeout, conn)
        # A kernel interrupt reaches the kernel's process group, not this one: a signal
        # here is the learner's own, and the processes this rank starts get the default.
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
        threading.Thread(target=me.reader, name="reducelab-reader", daemon=True).start()
        step = "join the process group"
        me.join()
        me.wrap_init_process_group()
    except BaseException as e:
        summary, text, _ = describe_exception(e)
        conn.send_bytes(pickle.dumps({"kind": "error", "summary": f"could not {step}: {summary}",
                                      "traceback": text, "in_distributed": True,
                                      "out": "", "err": ""}, protocol=pickle.HIGHEST_PROTOCOL))
        return
    me.send({"kind": "ready", "pid": os.getpid()})
    me.loop()
    _kill_descendants()
    if dist.is_initialized():
        dist.destroy_process_group()
    me.send({"kind": "closed"})
