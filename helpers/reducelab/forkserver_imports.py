"""What the ranks' forkserver imports after it has started the first group, when the
notebook needs it: imported only in the forkserver (it is in its preload list, see
:data:`reducelab.processes.PRELOAD`).

The forkserver first imports torch and :mod:`reducelab.rank_loop`, and serves ranks at
once: the notebook's setup cell waits for nothing else. DistributedDataParallel,
DTensor, FSDP and distributed checkpoint (DCP) import more on first use (:data:`LATER`,
about 1.3 s of CPU and 80 MB on torch 2.13). A rank of the first group that uses them
imports them itself; the kernel then asks the server for them (``SIGUSR1``, with their
names in the file that :data:`FILE_ENV` names), and so it does when the kernel itself
has imported them. A thread of the server imports them, once, and calls
``gc.freeze()`` (so the garbage collector of each rank does not write to the objects it
inherits, and their pages stay shared with the server). Every group started after that
(a resize) inherits those modules, so its first DDP, DTensor, FSDP or DCP call is as
fast as if they had been preloaded. The same goes for the modules of reducelab's checks that a
notebook's rank functions call (:data:`RANK_PACKAGES`), except that they never hold up
a first group. A notebook that never uses them never pays for
them: 0.45 GB instead of 0.53 GB for one learner of notebook 01 (PSS, one run).

A fork asked for while imports run waits until they are done (``os.register_at_fork``):
no rank is forked with a half-imported module, and a group started while they run gets
them all. The kernel asks before it starts a group (see
:func:`reducelab.processes.ask_for_later`), so that group's ranks have them; except that
a Jupyter kernel holds its requests until the end of the cell that starts its first
group, and then starts again, before its first run, a group whose ranks were forked
without them (:func:`reducelab.processes.hold_requests_for_first_cell`): a setup cell
that imports DDP no longer waits for the server to import dynamo.

Source: ``os.register_at_fork``, ``gc.freeze``
(https://docs.python.org/3/library/gc.html#gc.freeze).
"""
from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import threading

LATER = ("torch.distributed.tensor", "torch._dynamo", "torch.distributed.fsdp",
         "torch.nn.parallel.distributed", "torch.distributed.checkpoint",
         "torch.distributed.checkpoint._fsspec_filesystem",
         "torch.distributed.algorithms.ddp_comm_hooks")
"""What the server may import after the first group, in this order. The last is what
notebook 16's rank function imports when a fresh rank unpickles it (DDP's communication
hooks, 14 ms per rank). The one before is what
``dcp.save`` and ``dcp.load`` import on a rank's first call to pick a storage (fsspec,
70 ms per rank: ``_storage_setup`` in torch/distributed/checkpoint/_storage_utils.py);
with DCP, a fresh rank's first checkpoint round trip in notebook 14's explorer took
284 ms instead of 619 ms at 8 ranks (one run, idle 2-core machine). A module a torch
version lacks is skipped."""
FIRST_USE = {"torch.nn.parallel.distributed": ("torch._dynamo",)}
"""Modules of :data:`LATER` that a rank imports on a module's first use rather than on its
import: constructing ``DistributedDataParallel`` imports ``torch._dynamo`` (about 2 s of
CPU per fresh rank, seen in a rank's stack when notebook 13's first ``DDP(model)`` ran past
its group's 3 s timeout on a loaded 2-core machine). A kernel that imported the first
asks for both (:func:`reducelab.processes.kernel_later`)."""
WITH_TORCH = ("torch.nn.parallel.distributed",)
"""Modules of :data:`LATER` that ``import torch`` imports by itself
(``torch/nn/parallel/__init__.py`` imports ``DistributedDataParallel``): that one is in
the kernel's ``sys.modules`` says nothing about the notebook. The kernel counts as having
imported it only when its namespace holds something of it, as ``from torch.nn.parallel
import DistributedDataParallel as DDP`` does (:func:`reducelab.processes.kernel_later`).
``test_forkserver_imports`` checks this list against a fresh ``import torch``."""
RANK_PACKAGES = ("reducelab.checks", "reducelab.data")
"""reducelab's modules that rank functions use: a notebook's rank functions call the
helpers of its checks (``make_model``, ``zero_train``, ``load_digits_tensors``), and a fresh
rank imports them when it unpickles such a function. For notebook 08's rank function that
took 47 to 64 ms per rank at 8 fresh ranks, and 0.1 ms the second time (cProfile of the
unpickling on a rank: compiling the sources where no ``.pyc`` is written, the
``dataclass`` classes of reducelab.checks, and ``make_model`` run at the import of
reducelab.checks.sharded, whose ``torch.manual_seed`` formats the Python stack for torch's
lazy CUDA seeding, ``_lazy_call`` in torch/cuda/__init__.py, reading the source file of
every frame). The modules of these packages the kernel has imported, or a rank has, are
asked for as :data:`LATER`'s are, but never make a first group wait
(:func:`reducelab.processes.kernel_later`)."""
FILE_ENV = "REDUCELAB_LATER_IMPORTS"
"""Environment variable with the path of the file in which the kernel lists the modules
of :data:`LATER` it wants, one per line (in the kernel's private temporary directory).
Without it, a request imports all of :data:`LATER`."""
SIGNAL = signal.SIGUSR1
"""What the kernel sends the forkserver once it has written what it wants."""
WAIT_LIMIT = 120.0
"""Longest a fork waits for the imports, in seconds."""

_lock = threading.Lock()
_asked_for = threading.Event()  # a request came that the thread has not read yet
_idle = threading.Event()       # no request pending, no import running
_idle.set()


_RANK_PREFIXES = tuple(p + "." for p in RANK_PACKAGES)


def _in_rank_packages(name: str) -> bool:
    return name in RANK_PACKAGES or name.startswith(_RANK_PREFIXES)


def askable(name: str) -> bool:
    """True for a module the server may be asked to import: one of :data:`LATER`, or a
    module of :data:`RANK_PACKAGES`."""
    return name in LATER or _in_rank_packages(name)


_imported: list = [-1, []]  # [len(sys.modules), what imported() found then]


def imported() -> list[str]:
    """What this process has imported of :data:`LATER` (in its order), then of
    :data:`RANK_PACKAGES` (sorted): a rank reports it after each job. Read again only
    when the number of modules changed (a scan of ``sys.modules`` took 0.2 ms)."""
    if len(sys.modules) != _imported[0]:
        n = len(sys.modules)
        _imported[:] = [n, [m for m in LATER if m in sys.modules] + sorted(
            m for m in list(sys.modules) if _in_rank_packages(m))]
    return list(_imported[1])


def wanted() -> list[str]:
    """The modules the kernel asked for: those of :data:`LATER` in its order, then those
    of :data:`RANK_PACKAGES`, sorted (any other name in the file is ignored)."""
    path = os.environ.get(FILE_ENV)
    if not path:
        return list(LATER)
    try:
        with open(path, encoding="utf-8") as f:
            names = set(f.read().split())
    except OSError:
        return []
    return [m for m in LATER if m in names] + sorted(m for m in names if _in_rank_packages(m))


def _before_fork() -> None:
    _idle.wait(WAIT_LIMIT)


def _after_fork_in_child() -> None:
    signal.signal(SIGNAL, signal.SIG_DFL)  # a rank keeps the default action


def _import_later() -> None:
    while True:
        _asked_for.wait()
        with _lock:
            _asked_for.clear()
        try:
            new = [m for m in wanted() if m not in sys.modules]
            if new:  # a collection writes to every object: only when something came in
                _import(new)
                gc.collect()
                gc.freeze()
        finally:
            with _lock:
                if not _asked_for.is_set():
                    _idle.set()


def _import(names: list[str]) -> None:
    """Import ``names``, leaving what a rank inherits as it was: the global torch random
    generator's state is restored (a module that seeds it at import changes nothing for a
    rank that draws without seeding), and whatever a module runs at import runs on one
    thread, so no OpenMP thread pool is made in the server before it forks (the server's
    thread count is restored)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            for name in names:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - a rank that needs it raises the error itself
                    pass
    finally:
        torch.set_num_threads(threads)


def _asked(signum, frame) -> None:
    # Runs in the server's main thread before it serves the fork the kernel asks for
    # next: from here on, every fork waits until the request is served.
    with _lock:
        _idle.clear()
        _asked_for.set()


def start() -> None:
    """Register the fork hooks and the signal, and start the importing thread (once, in
    the forkserver)."""
    if getattr(start, "started", False):
        return
    start.started = True
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
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
