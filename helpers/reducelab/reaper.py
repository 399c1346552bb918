"""The reaper: a small process that stops what a kernel's groups started once the kernel is gone.

Introduced with :class:`~reducelab.LocalGroup` (notebook 01). A rank that holds the GIL
in C code cannot run the Python thread that would notice its kernel died, and a process
that a rank starts (DataLoader workers, a ``subprocess.Popen``) knows nothing of the
kernel at all. So each kernel starts one reaper, in a session of its own (a kernel
restart in JupyterLab kills the kernel's whole process group; the reaper survives it),
and tells it over a pipe what to clean up:

* ``pg N T``: a rank's process group (each rank makes its own, so everything it starts
  is in it), killed with ``killpg``; ``T`` is the rank's start time (psutil's
  ``create_time``), so a pid that another process took since is left alone; ``-pg N``
  forgets it;
* ``pid N T``: one process to kill, such as the forkserver; ``-pid N`` forgets it;
* ``dir PATH``: a directory to remove (a group's store, multiprocessing's temporary
  directory); ``-dir PATH`` forgets it.

It kills by process id and process group only, never by name. When its parent (the
kernel) is gone, it kills the descendants of every registered process (found with
psutil while their parents still live), then the process groups, then the processes,
removes the directories and exits. While the kernel lives it only reads lines: it wakes
every :data:`POLL` seconds to check its parent and costs about 15 MB of memory.

Run as ``python -I reaper.py KERNEL_PID`` (stdlib and psutil only; ``-I`` keeps the
script's folder off ``sys.path``). The kernel side is :class:`Reaper`.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

POLL = 0.5
"""Seconds between the reaper's checks that its kernel is still alive."""


def _reused(pid: int, created: float | None, psutil) -> bool:
    """True if another process has taken ``pid`` since the one registered (started at
    ``created``); such a pid, and its process group, are left alone."""
    if created is None or psutil is None:
        return False
    try:
        return abs(psutil.Process(pid).create_time() - created) >= 0.01
    except psutil.Error:
        return False  # gone: its process group may still hold what it started


def _sweep(pgids: dict, pids: dict, dirs: set) -> None:
    """Kill every registered process group and process (and their descendants), remove dirs.

    ``pgids`` and ``pids`` map a pid to its ``create_time`` (or ``None``)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    pgids = {k: v for k, v in pgids.items() if not _reused(k, v, psutil)}
    pids = {k: v for k, v in pids.items() if not _reused(k, v, psutil)}
    descendants: set[int] = set()
    if psutil is not None:
        for pid in set(pgids) | set(pids):
            try:
                descendants.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                pass
    for pg in pgids:
        try:
            os.killpg(pg, signal.SIGKILL)
        except OSError:
            pass
    killed = []
    for pid in set(pids) | set(pgids) | descendants:
        try:
            if psutil is not None:
                killed.append(psutil.Process(pid))
            os.kill(pid, signal.SIGKILL)
        except Exception:   # gone already (OSError, psutil.NoSuchProcess)
            pass
    if psutil is not None:   # a process still exiting may hold a dir's last file
        psutil.wait_procs(killed, timeout=2)
    for d in dirs:
        for _ in range(3):   # a CI run once found a swept dir still there
            shutil.rmtree(d, ignore_errors=True)
            if not os.path.exists(d):
                break
            time.sleep(0.1)


def main(kernel_pid: int) -> None:
    """Serve registrations from standard input until the kernel is gone, then sweep."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the kernel's death ends the reaper
    sets = {"pg": {}, "pid": {}, "dir": set()}
    fd, buf, reading = sys.stdin.fileno(), b"", True
    while os.getppid() == kernel_pid:
        if not reading:
            select.select([], [], [], POLL)
            continue
        ready, _, _ = select.select([fd], [], [], POLL)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            reading = False  # the kernel closed its end (it is exiting): wait for it to go
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            verb, _, arg = line.decode("utf-8", "surrogateescape").partition(" ")
            forget = verb.startswith("-")
            kind = verb.lstrip("-")
            if kind not in sets:
                continue
            if kind == "dir":
                (sets["dir"].discard if forget else sets["dir"].add)(arg)
                continue
            pid, _, created = arg.partition(" ")
            if forget:
                sets[kind].pop(int(pid), None)
            else:
                sets[kind][int(pid)] = float(created) if created and created != "None" else None
    _sweep(sets["pg"], sets["pid"], sets["dir"])


class Reaper:
    """Kernel side: start this kernel's reaper once, and register what it must clean up.

    All methods are thread-safe and never raise: a reaper that cannot start or has died
    only means that a killed kernel leaves its ranks to exit by themselves (each rank
    also leaves when its pipe to the kernel closes).
    """

    _lock = threading.RLock()  # a finalizer may tell it from inside a tell (GC)
    _proc: subprocess.Popen | None = None
    _owner = 0  # the pid that started _proc (a forked child must not use its parent's)

    @classmethod
    def _ensure(cls) -> subprocess.Popen | None:
        if sys.platform == "win32":
            return None  # no process groups to kill there; ranks leave when their pipe closes
        if cls._proc is not None and cls._owner == os.getpid() and cls._proc.poll() is None:
            return cls._proc
        try:
            cls._proc = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
            cls._owner = os.getpid()
        except OSError:
            cls._proc = None
        return cls._proc

    @classmethod
    def tell(cls, *lines: str) -> None:
        """Send registration lines such as ``"pg 1234"`` or ``"-dir /tmp/x"``."""
        with cls._lock:
            proc = cls._ensure()
            if proc is None:
                return
            try:
                proc.stdin.write("".join(f"{line}\n" for line in lines).encode(
                    "utf-8", "surrogateescape"))
                proc.stdin.flush()
            except (OSError, ValueError):
                cls._proc = None  # it died; the next call starts another

    @classmethod
    def pid(cls) -> int | None:
        """The reaper's process id, or ``None`` if none is running (for tests)."""
        with cls._lock:
            proc = cls._ensure()
            return proc.pid if proc is not None else None


if __name__ == "__main__":
    main(int(sys.argv[1]))
