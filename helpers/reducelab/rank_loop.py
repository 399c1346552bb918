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
* rank -> kernel: ``ready`` (``pid``), ``returned`` (fn returned; its result is being
  pickled and sent), ``chunk`` (``data``: the next :data:`CHUNK` bytes of a large
  result), ``done`` (``result`` bytes, or ``None`` after chunks), ``error`` (``summary``,
  ``traceback``, ``in_distributed``), ``stack`` (``traceback``, ``collective``,
  ``summary``). ``done``, ``error`` and ``stack`` carry ``out`` and ``err``, the text
  the call printed; ``done`` and ``error`` carry ``pg``, whether a default process group
  is up after the call.

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


def _after_launcher(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """Drop the frames of the rank's own machinery (multiprocessing, this module)."""
    last = -1
    for i, f in enumerate(frames):
        if os.path.abspath(f.filename).startswith(_PACKAGE_DIR):
            last = i
    return frames[last + 1:]


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


def describe_exception(error: BaseException) -> tuple[str, str, bool]:
    """``(summary, traceback_text, in_distributed)`` for an exception raised by ``fn``.

    Safe against exceptions whose ``__str__`` raises, and bounded: the summary to
    :data:`MAX_SUMMARY`, the traceback to :data:`MAX_TRACEBACK` characters.
    """
    frames = _after_launcher(traceback.extract_tb(error.__traceback__))
    try:
        tail = "".join(traceback.format_exception_only(type(error), error))
    except BaseException:  # noqa: BLE001
        tail = f"{type(error).__name__}: {safe_str(error)}\n"
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + tail
    first = safe_str(error).strip().splitlines()
    name = type(error).__name__
    summary = _cut(f"{name}: {first[0]}" if first else name, MAX_SUMMARY)
    in_dist = any(_is_dist_frame(f.filename) for f in frames)
    return summary, _cut(text, MAX_TRACEBACK), in_dist


def leave() -> None:
    """Exit now, and take every process this rank started along: its descendants (also
    those in a session of their own, found before they are orphaned), then its own
    process group, itself included."""
    import psutil
    try:
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    except psutil.Error:
        pass
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
        try:
            data = cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:
            summary, _, _ = describe_exception(e)
            return {"kind": "error", "summary": f"its return value could not be pickled "
                    f"({type(result).__name__}): {summary}", "traceback": "",
                    "in_distributed": False, "out": out, "err": err, "pg": pg}
        self.sending = len(data)
        return {"kind": "done", "result": data, "out": out, "err": err, "pg": pg}

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
        for value in list(args) + list((kwargs or {}).values()):
            cls = value if isinstance(value, type) else type(value)
            if cls.__module__ == "__main__" and "." not in cls.__qualname__:
                ns[cls.__qualname__] = cls
        if not isinstance(fn, types.FunctionType):
            return fn
        module = sys.modules.get(fn.__module__ or "")
        if module is not None and fn.__globals__ is vars(module):
            return fn  # imported from a module (or already ours): its globals persist
        ns.update((k, v) for k, v in fn.__globals__.items()
                  if k not in ("__builtins__", "__name__"))
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
            if reply["kind"] == "done" and len(reply["result"]) > CHUNK:
                data, reply["result"] = memoryview(reply["result"]), None
                for start in range(0, len(data), CHUNK):
                    self.send({"kind": "chunk", "data": bytes(data[start:start + CHUNK])})
                del data
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

    Joins the default process group (``FileStore`` rendezvous in ``tmpdir``), reports
    ``ready``, then serves jobs until ``close`` or until the kernel is gone.

    Args:
        rank, world_size: this rank and the group's size (ints).
        backend: ``"gloo"``.
        tmpdir: the group's private directory; the store file is ``tmpdir/store``.
        timeout: the process group's timeout in seconds: the kernel's ``timeout`` plus
            5 s, so the kernel's own bound, which can say where each rank was, fires first.
        conn: this rank's end of the socket pair to the kernel.
        loopback_ifname: the loopback interface gloo is pinned to (``lo``, ``lo0``).
        sys_path: the kernel's ``sys.path``, so functions sent by reference import.
        env: environment variables to set before joining the process group.
    """
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)  # a process group of its own: stopped as one, whatever it starts
    mp.current_process().daemon = False  # like a torchrun worker: may start processes,
    mp.set_start_method(None, force=True)  # with the platform's default start method
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel decides what an interrupt does
    sys.modules["__main__"] = MAIN
    os.environ.update(env or {})
    if env and "TORCH_DISTRIBUTED_DEBUG" in env:
        dist.set_debug_level_from_env()  # torch read it when the forkserver imported it
    os.environ.update(GLOO_SOCKET_IFNAME=loopback_ifname, RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    sys.path[:] = list(dict.fromkeys(sys_path + sys.path))
    torch.set_num_threads(1)  # world_size ranks share a laptop's few cores
    print_options()
    install_streams()
    me = _Rank(rank, world_size, backend, tmpdir, timeout, conn)
    threading.Thread(target=me.reader, name="reducelab-reader", daemon=True).start()
    try:
        me.join()
    except BaseException as e:
        summary, text, _ = describe_exception(e)
        me.send({"kind": "error", "summary": f"could not join the process group: {summary}",
                 "traceback": text, "in_distributed": True, "out": "", "err": ""})
        return
    me.wrap_init_process_group()
    me.send({"kind": "ready", "pid": os.getpid()})
    me.loop()
    if dist.is_initialized():
        dist.destroy_process_group()
    me.send({"kind": "closed"})
