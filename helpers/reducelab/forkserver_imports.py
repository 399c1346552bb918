"""What the ranks' forkserver imports after it has started the first group: imported
only in the forkserver (it is in its preload list, see :data:`reducelab.processes.PRELOAD`).

The forkserver first imports torch and :mod:`reducelab.rank_loop`, and serves ranks at
once: the notebook's setup cell waits for nothing else. Then a thread of the server
imports what DistributedDataParallel, DTensor, FSDP and distributed checkpoint (DCP)
import on first use (:data:`LATER`, about 1.3 s of CPU on torch 2.13), once, and calls
``gc.freeze()`` (so the garbage collector of each rank does not write to the objects it
inherits, and their pages stay shared with the server). Every group started after that
(a resize) inherits those modules, so its first DDP, DTensor, FSDP or DCP call is as
fast as if they had been preloaded; only the first group imports them on its own, if it
uses them.

When the imports start: :data:`QUIET` seconds after the first group's ranks were forked,
or at once when the kernel starts a second group (it sends ``SIGUSR1``, see
:func:`reducelab.processes.warm`). A fork asked for while the imports run waits until
they are done (``os.register_at_fork``): no rank is forked with a half-imported module,
and a group started during the imports gets them all.

Source: ``os.register_at_fork``, ``gc.freeze``
(https://docs.python.org/3/library/gc.html#gc.freeze).
"""
from __future__ import annotations

import gc
import importlib
import os
import signal
import threading
import time

LATER = ("torch.distributed.tensor", "torch._dynamo", "torch.distributed.fsdp",
         "torch.nn.parallel.distributed", "torch.distributed.checkpoint",
         "torch.distributed.checkpoint._fsspec_filesystem")
"""Imported after the first group, in this order. The last is what ``dcp.save`` and
``dcp.load`` import on a rank's first call to pick a storage (fsspec, 70 ms per rank:
``_storage_setup`` in torch/distributed/checkpoint/_storage_utils.py); with DCP, a
fresh rank's first checkpoint round trip in notebook 14's explorer took 284 ms instead
of 619 ms at 8 ranks (one run, idle 2-core machine). A module a torch version lacks is
skipped."""
QUIET = 1.0
"""Seconds without a fork after the first group's ranks before the imports start."""
SIGNAL = signal.SIGUSR1
"""What the kernel sends the forkserver to start the imports now (a second group comes)."""
WAIT_LIMIT = 120.0
"""Longest a fork waits for the imports, in seconds."""

_forks: list[float] = []        # time.monotonic() of each fork served
_now = threading.Event()        # the kernel asked for the imports
_started = threading.Event()
_done = threading.Event()


def _before_fork() -> None:
    if _started.is_set():
        _done.wait(WAIT_LIMIT)


def _after_fork_in_parent() -> None:
    _forks.append(time.monotonic())


def _after_fork_in_child() -> None:
    signal.signal(SIGNAL, signal.SIG_DFL)  # a rank keeps the default action


def _import_later() -> None:
    # The first fork is the kernel's warm-up process; the first group's ranks follow.
    while not _now.is_set() and (len(_forks) < 2 or time.monotonic() - _forks[-1] < QUIET):
        _now.wait(0.1)
    _started.set()
    try:
        for name in LATER:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a rank that needs it raises the error itself
                pass
        gc.collect()
        gc.freeze()
    finally:
        _done.set()


def _asked(signum, frame) -> None:
    # Runs in the server's main thread before it serves the fork the kernel asks for
    # next: from here on, every fork waits for the imports.
    _started.set()
    _now.set()


def start() -> None:
    """Register the fork hooks and the signal, and start the importing thread (once, in
    the forkserver)."""
    if getattr(start, "started", False):
        return
    start.started = True
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
    signal.signal(SIGNAL, _asked)
    threading.Thread(target=_import_later, name="reducelab-forkserver-imports",
                     daemon=True).start()


def _in_forkserver_preload() -> bool:
    """True while ``multiprocessing.forkserver.main`` imports its preload list (this
    module is then being imported by the forkserver itself, not by a kernel or a test)."""
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(os.path.join("multiprocessing",
                                                                             "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if _in_forkserver_preload():
    start()
