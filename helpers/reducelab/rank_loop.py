"""The loop that runs on each rank: join the process group, then run what the kernel sends.

Introduced in notebook 01. Each rank is a process started from a clean forkserver (never
forked from the live kernel). It joins a gloo process group through a ``FileStore`` in the
group's private temporary directory, with gloo pinned to the loopback interface, so
nothing listens beyond 127.0.0.1. Then it waits for jobs on a pipe (an ``AF_UNIX``
socket pair: no network endpoint, and only the kernel holds the other end), runs each,
and sends back its reply, a large return value in chunks as it is pickled.

The rank's other rooms: :mod:`reducelab.rank_env` makes it behave like a process that
``torchrun`` started (its ``__main__``, environment variables, default process group,
the processes it starts), and :mod:`reducelab.rank_reports` writes its tracebacks and
says where it stands when the kernel asks. The kernel's side is :mod:`reducelab.group`.

Messages, each a ``pickle`` of a ``dict`` with a ``"kind"`` (the kernel is the only peer
that can write them):

* kernel -> rank: ``run`` (``payload``), ``stack``, ``close``.
* rank -> kernel: ``booted`` (its imports are done), ``ready`` (``pid``), ``returned``
  (fn returned; its result is being pickled and sent), ``chunk`` (``data``: the next
  :data:`CHUNK` bytes of the pickled result, sent while the pickler writes it),
  ``done`` (``result``: the last bytes of the pickled result), ``error`` (``summary``,
  ``traceback``, ``in_distributed``, and for an error from ``torch.distributed``
  ``collectives``, how many collectives the rank has issued on its default process
  group), ``stack`` (``traceback``, ``collective``, ``summary``), ``closed``. ``done``,
  ``error`` and ``stack`` carry ``out`` and ``err``, the text the call printed; ``done``
  and ``error`` carry ``pg``, whether a default process group is up after the call.

``payload`` and ``result`` are cloudpickle bytes, so functions defined in notebook cells
travel by value, and tensors come back by value (not through torch's shared-memory
reductions, which fail once the sender exits).
"""
from __future__ import annotations

import linecache
import os
import pickle
import queue
import sys
import threading
import traceback

import cloudpickle
import torch.distributed as dist
import torch.utils.serialization  # noqa: F401 - see below

# A rank's first unpickled tensor (an argument, or one a function closes over) imports
# torch.utils.serialization (torch.load, from _load_from_bytes in torch/storage.py): 10 ms
# per fresh rank, measured at 8 ranks. Imported here, it is imported once, in the
# forkserver that preloads this module.

from .capture import capture
from .forkserver_imports import imported
from .rank_env import (MAIN, NAMESPACE, DefaultGroup, kill_descendants, lead_process_group,
                       leave, persistent, setup)
from .rank_reports import (MAX_SUMMARY, MAX_TRACEBACK, cut, describe_exception, safe_str,
                           stack_reply, where)

# The public names of this module; MAIN, NAMESPACE and leave live in rank_env, and
# MAX_SUMMARY, MAX_TRACEBACK, describe_exception, safe_str and where in rank_reports.
__all__ = ["CHUNK", "MAIN", "MAX_SUMMARY", "MAX_TRACEBACK", "NAMESPACE", "describe_exception",
           "leave", "main", "safe_str", "spare_main", "where"]

CHUNK = 16 << 20
"""Bytes per message of a return value: a large one arrives as ``chunk`` messages, so the
kernel sees it progress."""


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


class _Rank:
    """One rank's loop: its pipe to the kernel, the jobs it runs, and where it is."""

    def __init__(self, rank: int, world_size: int, backend: str, tmpdir: str,
                 timeout: float, conn):
        self.rank, self.world_size = rank, world_size
        self.conn = conn
        self.jobs: queue.Queue = queue.Queue()
        self.send_lock = threading.Lock()
        self.main_ident = threading.get_ident()
        self.output = None  # the RankOutput of the call in progress
        self.sending = 0  # bytes of a return value being sent, 0 when not sending
        self.phase = "idle"  # idle -> loading -> (joining) -> running -> pickling -> idle
        self.pg = DefaultGroup(rank, world_size, backend, tmpdir, timeout)

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
        """The ``stack`` reply: where this rank stands (see
        :func:`reducelab.rank_reports.stack_reply`)."""
        texts = self.output.texts() if self.output else ("", "")
        return stack_reply(self.phase, self.sending, texts, self.main_ident)

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
                self.pg.join()
            except BaseException as e:
                summary, text, _ = describe_exception(e)
                return {"kind": "error", "summary": "could not join a fresh default process "
                        f"group: {summary}", "traceback": text, "in_distributed": True,
                        "out": "", "err": ""}
        fn = persistent(fn, args, kwargs)
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
                    "in_distributed": in_dist, "out": out, "err": err, "pg": pg,
                    "collectives": self.pg.collectives_issued() if in_dist else None}
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

    def serve(self, msg: dict) -> None:
        """Run one job and send its reply; any failure of this module is reported too."""
        try:
            reply = self.run_job(msg["payload"])
        except BaseException as e:  # a failure of reducelab itself: say so, do not die
            summary, _, _ = describe_exception(e)
            reply = {"kind": "error", "summary": f"reducelab failed on this rank: {summary}",
                     "traceback": cut(traceback.format_exc(), MAX_TRACEBACK),
                     "in_distributed": False, "out": "", "err": ""}
        # what of DDP, DTensor, FSDP, DCP or reducelab's checks this rank has imported: the
        # kernel asks the forkserver for it, so that the ranks of the next group start with it
        reply["later"] = imported()
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
    lead_process_group()  # stopped as one, whatever it starts
    conn.send_bytes(pickle.dumps({"kind": "booted"}, protocol=pickle.HIGHEST_PROTOCOL))
    _serve_as(rank, world_size, backend, tmpdir, timeout, conn, loopback_ifname, sys_path, env)


def spare_main(conn) -> None:
    """Entry point of a spare: a process forked ahead of a resize
    (:meth:`reducelab.LocalGroup.keep_spares`). It reports ``booted``, then waits on its
    pipe for ``assign`` (``args``: :func:`main`'s arguments after ``conn``), and from
    there is the rank it was given, as if :func:`main` had started it. It leaves
    without a trace when the pipe closes first (the group closed, or the kernel is gone).
    """
    lead_process_group()
    conn.send_bytes(pickle.dumps({"kind": "booted"}, protocol=pickle.HIGHEST_PROTOCOL))
    try:
        msg = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    if msg.get("kind") != "assign":
        return
    rank, world_size, backend, tmpdir, timeout, loopback_ifname, sys_path, env = msg["args"]
    _serve_as(rank, world_size, backend, tmpdir, timeout, conn, loopback_ifname, sys_path, env)


def _serve_as(rank, world_size, backend, tmpdir, timeout, conn, loopback_ifname, sys_path,
              env) -> None:
    """What a rank does once booted: set up, join, report ``ready``, serve jobs."""
    step = "start"
    try:
        me = _Rank(rank, world_size, backend, tmpdir, timeout, conn)
        setup(rank, world_size, loopback_ifname, sys_path, env)  # like a torchrun worker
        threading.Thread(target=me.reader, name="reducelab-reader", daemon=True).start()
        step = "join the process group"
        me.pg.join(wait_for_all=False)   # the kernel waits for every rank's "ready"
        me.pg.wrap_init_process_group()
    except BaseException as e:
        summary, text, _ = describe_exception(e)
        conn.send_bytes(pickle.dumps({"kind": "error", "summary": f"could not {step}: {summary}",
                                      "traceback": text, "in_distributed": True,
                                      "out": "", "err": ""}, protocol=pickle.HIGHEST_PROTOCOL))
        return
    me.send({"kind": "ready", "pid": os.getpid()})
    me.loop()
    kill_descendants()
    if dist.is_initialized():
        dist.destroy_process_group()
    me.send({"kind": "closed"})
