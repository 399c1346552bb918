"""The loop that runs on each rank: join the process group, then run what the kernel sends.

Introduced in notebook 01. Each rank is a process started from a clean forkserver (never
forked from the live kernel). It joins a gloo process group through a ``FileStore`` in the
group's private temporary directory, with gloo pinned to the loopback interface, so
nothing listens beyond 127.0.0.1. Then it waits for jobs on a pipe (an ``AF_UNIX``
socket pair: no network endpoint, and only the kernel holds the other end).

Messages, each a ``pickle`` of a tuple (the kernel is the only peer that can write them):

* kernel -> rank: ``("run", payload)``, ``("stack",)``, ``("close",)``.
* rank -> kernel: ``("ready", pid)``, ``("returned",)`` (fn returned; its result is
  being pickled and sent), ``("done", result_bytes, out, err)``,
  ``("error", summary, traceback, in_distributed, out, err)``, ``("stack", text,
  collective, summary, out, err)``.

``payload`` and ``result_bytes`` are cloudpickle bytes, so functions defined in notebook
cells travel by value, and tensors come back by value (not through torch's
shared-memory reductions, which fail once the sender exits).
"""
from __future__ import annotations

import linecache
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
import types
from datetime import timedelta

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from .capture import capture
from .determinism import print_options

_THIS_FILE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.dirname(_THIS_FILE) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DIST_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep


NAMESPACE: dict = {"__builtins__": __builtins__, "__name__": "__rank__"}
"""This rank's lasting namespace: the globals of cell-defined functions and of %%ranks cells."""


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


class _Rank:
    def __init__(self, rank: int, conn, kernel_pid: int, tmpdir: str, mp_tmpdir: str = ""):
        self.mp_tmpdir = mp_tmpdir
        self.rank = rank
        self.conn = conn
        self.kernel_pid = kernel_pid
        self.tmpdir = tmpdir
        self.jobs: queue.Queue = queue.Queue()
        self.send_lock = threading.Lock()
        self.main_ident = threading.get_ident()
        self.output = None  # the RankOutput of the call in progress
        self.sending = 0  # bytes of a return value being sent, 0 when not sending
        self.phase = "idle"  # idle -> loading -> running -> (sending) -> idle
        self.namespace = NAMESPACE

    # --- the pipe -------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(data)

    def kernel_gone(self) -> None:
        """The kernel exited or was killed: remove the group's files and leave now."""
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        if self.mp_tmpdir and os.path.basename(self.mp_tmpdir).startswith("pymp-"):
            shutil.rmtree(self.mp_tmpdir, ignore_errors=True)
        os._exit(0)

    def reader(self) -> None:
        """Thread: read the kernel's messages; answer ``stack`` at once, queue the rest."""
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                self.kernel_gone()
                return
            if msg[0] == "stack":
                self.send(self.stack())
            else:
                self.jobs.put(msg)

    def watchdog(self) -> None:
        """Thread: leave if the kernel process disappears (belt and braces beside EOF)."""
        try:
            kernel = psutil.Process(self.kernel_pid)
            created = kernel.create_time()
        except psutil.Error:
            self.kernel_gone()
            return
        while True:
            time.sleep(0.5)
            try:
                if not kernel.is_running() or kernel.create_time() != created \
                        or kernel.status() == psutil.STATUS_ZOMBIE:
                    self.kernel_gone()
            except psutil.Error:
                self.kernel_gone()

    def stack(self) -> tuple:
        out, err = self.output.texts() if self.output else ("", "")
        if self.sending:
            return ("stack", "", None,
                    f"was sending its return value ({self.sending / 1e6:.0f} MB)", out, err)
        if self.phase != "running":
            return ("stack", "", None, {
                "idle": "was between calls (had not received fn)",
                "loading": "was still loading fn (unpickling it, importing its modules)",
            }.get(self.phase, f"was {self.phase}"), out, err)
        frame = sys._current_frames().get(self.main_ident)
        frames = _after_launcher(traceback.extract_stack(frame)) if frame else []
        collective, summary = where(frames)
        return ("stack", "".join(traceback.format_list(frames)), collective, summary, out, err)

    # --- jobs -----------------------------------------------------------------------
    def run_job(self, payload: bytes) -> tuple:
        self.phase = "loading"
        try:
            fn, args, kwargs, cwd, sources = cloudpickle.loads(payload)
        except BaseException as e:  # e.g. a module the kernel has and the rank has not
            return ("error", f"could not unpickle the job: {type(e).__name__}: {e}",
                    traceback.format_exc(), False, "", "")
        for filename, lines in sources.items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        fn = self.persistent(fn)
        self.output = None
        self.phase = "running"
        with capture() as self.output:
            try:
                result = fn(*args, **kwargs)
                error = None
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: report them
                error = e
        out, err = self.output.texts()
        if error is not None:
            frames = _after_launcher(traceback.extract_tb(error.__traceback__))
            text = "".join(traceback.format_list(frames)) + "".join(
                traceback.format_exception_only(type(error), error))
            in_dist = any(_is_dist_frame(f.filename) for f in frames)
            first = str(error).strip().splitlines()
            summary = f"{type(error).__name__}: {first[0]}" if first else type(error).__name__
            return ("error", summary, "Traceback (most recent call last):\n" + text,
                    in_dist, out, err)
        # Tell the kernel fn has returned before pickling the result: pickling a big
        # tensor holds the GIL, so the reader thread could not say so while it runs.
        self.send(("returned",))
        try:
            data = cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:
            return ("error", f"its return value could not be pickled "
                             f"({type(result).__name__}): {type(e).__name__}: {e}",
                    "", False, out, err)
        self.sending = len(data)
        return ("done", data, out, err)

    def persistent(self, fn):
        """Give a function sent by value (defined in a cell) this rank's lasting globals.

        cloudpickle rebuilds such a function with a fresh dict of the globals it uses, so
        ``global x`` on a rank would be forgotten by the next call. Here the shipped
        globals are copied into one namespace that lives as long as the rank, and the
        function runs with that namespace: the kernel's current values win for the names
        it sends, and names a rank function assigns with ``global`` persist.
        """
        if not isinstance(fn, types.FunctionType):
            return fn
        module = sys.modules.get(fn.__module__ or "")
        if module is not None and fn.__globals__ is vars(module):
            return fn  # imported from a module: its globals already persist
        ns = self.namespace
        ns.update((k, v) for k, v in fn.__globals__.items() if k != "__builtins__")
        new = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__qualname__ = fn.__qualname__
        new.__module__ = fn.__module__
        return new

    def loop(self) -> None:
        while True:
            msg = self.jobs.get()
            if msg[0] == "close":
                return
            if msg[0] == "run":
                reply = self.run_job(msg[1])
                try:
                    self.send(reply)
                except (OSError, ValueError, OverflowError, MemoryError) as e:
                    self.send(("error", f"its return value could not be sent: {e}", "",
                               False, reply[-2], reply[-1]))
                finally:
                    self.sending = 0
                    self.output = None
                    self.phase = "idle"


def main(rank: int, world_size: int, backend: str, tmpdir: str, timeout: float, conn,
         kernel_pid: int, loopback_ifname: str, sys_path: list[str],
         mp_tmpdir: str = "") -> None:
    """Entry point of rank ``rank``; called by ``multiprocessing`` in a fresh process.

    Joins the default process group (``FileStore`` rendezvous in ``tmpdir``), reports
    ``("ready", pid)``, then serves jobs until ``("close",)`` or until the kernel is gone.

    Args:
        rank, world_size: this rank and the group's size (ints).
        backend: ``"gloo"``.
        tmpdir: the group's private directory; the store file is ``tmpdir/store``.
        timeout: the process group's timeout in seconds: the kernel's ``timeout`` plus
            5 s, so the kernel's own bound, which can say where each rank was, fires first.
        conn: this rank's end of the socket pair to the kernel.
        kernel_pid: the kernel's pid, watched so the rank leaves if the kernel dies.
        loopback_ifname: the loopback interface gloo is pinned to (``lo``, ``lo0``).
        sys_path: the kernel's ``sys.path``, so functions sent by reference import.
        mp_tmpdir: multiprocessing's temp dir in the kernel, removed if the kernel dies.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel decides what an interrupt does
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_ifname
    sys.path[:] = list(dict.fromkeys(sys_path + sys.path))
    torch.set_num_threads(1)  # world_size ranks share a laptop's few cores
    print_options()
    me = _Rank(rank, conn, kernel_pid, tmpdir, mp_tmpdir)
    threading.Thread(target=me.reader, name="reducelab-reader", daemon=True).start()
    threading.Thread(target=me.watchdog, name="reducelab-watchdog", daemon=True).start()
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
    except BaseException as e:
        me.send(("error", f"could not join the process group: {type(e).__name__}: {e}",
                 traceback.format_exc(), True, "", ""))
        return
    me.send(("ready", os.getpid()))
    me.loop()
    try:
        dist.destroy_process_group()
    finally:
        me.send(("closed",))
