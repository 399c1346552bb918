"""Starting and stopping rank processes: the kernel side, below :class:`~reducelab.LocalGroup`.

Introduced with notebook 01's ``LocalGroup``. This module owns what is about processes
rather than about a process group:

* the multiprocessing context ranks start from: a **forkserver** that imports torch
  once per kernel (``spawn`` where there is no forkserver, as on Windows), warmed once
  so that its start-up is never charged to a group's timeout;
* ranks never re-run the kernel's ``__main__`` (they get functions by value), so a
  script read from standard input, or one with side effects at its top level, starts
  ranks as well as a notebook does;
* stopping a rank stops **everything it started**: each rank leads its own process
  group, so ``killpg`` reaches its DataLoader workers and subprocesses, and psutil
  finds descendants that left the group (``start_new_session``). Kills are by process
  id and process group, never by name;
* stopping is not cut short by a ``KeyboardInterrupt``: an interrupt that arrives while
  ranks are being started or stopped is held until that is done, then raised.

Source: ``multiprocessing`` start methods,
https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.spawn
import os
import shutil
import signal
import sys
import threading
import time
from multiprocessing.connection import wait as mp_wait

import psutil

from .reaper import Reaper

PROCESS_PREFIX = "reducelab-"
"""Name prefix of the processes LocalGroup starts (``reducelab-rank-0``, ...)."""

_forkserver_lock = threading.Lock()
_forkserver_ready: list[int] = []  # [kernel pid] once the forkserver has served a process
_forkservers_told: set[int] = set()  # forkserver pids registered with the reaper


def _without_main(original):
    """Wrap ``multiprocessing.spawn.get_preparation_data`` so that processes named
    :data:`PROCESS_PREFIX`... do not import the kernel's ``__main__`` when they start."""
    def get_preparation_data(name):
        data = original(name)
        if name.startswith(PROCESS_PREFIX):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data
    get_preparation_data.reducelab_original = original
    return get_preparation_data


if not hasattr(mp.spawn.get_preparation_data, "reducelab_original"):
    mp.spawn.get_preparation_data = _without_main(mp.spawn.get_preparation_data)


PRELOAD = {
    "full": ["reducelab.rank_loop", "reducelab.forkserver_imports"],
    "eager": ["reducelab.rank_loop", "torch.distributed.tensor", "torch._dynamo",
              "torch.distributed.fsdp", "torch.nn.parallel.distributed",
              "torch.distributed.checkpoint", "torch.distributed.checkpoint._fsspec_filesystem"],
    "torch": ["reducelab.rank_loop"],
}
"""What the forkserver imports before it serves ranks, by ``REDUCELAB_PRELOAD``.

``full`` (the default) imports torch and serves the first group at once; later, when
the notebook uses DistributedDataParallel, DTensor, FSDP or DCP (the kernel imported
them, or a rank did), it imports what they import on first use
(:data:`reducelab.forkserver_imports.LATER`, about 1.3 s of CPU on torch 2.13), in the
background, so that every later group (after a resize) inherits them and its first such
call is fast (see :mod:`reducelab.forkserver_imports`). ``eager`` imports all that
before the first group starts (the setup cell waits for it). ``torch`` never imports it
in the server: every group pays for it at its first DDP call (about 2.5 s for 4 ranks
on 2 cores)."""


def context():
    """The multiprocessing context ranks start from: forkserver with torch preloaded
    (``REDUCELAB_START_METHOD=spawn`` forces spawn, as on Windows)."""
    if "forkserver" in mp.get_all_start_methods() and \
            os.environ.get("REDUCELAB_START_METHOD", "forkserver") == "forkserver":
        ctx = mp.get_context("forkserver")
        from .forkserver_imports import FILE_ENV  # where the server reads what to import
        os.environ[FILE_ENV] = os.path.join(mp.util.get_temp_dir(), "reducelab-later-imports")
        ctx.set_forkserver_preload(PRELOAD.get(os.environ.get("REDUCELAB_PRELOAD", "full"),
                                               PRELOAD["full"]))
        return ctx
    return mp.get_context("spawn")


def _noop() -> None:
    pass


WARM_LIMIT = 120.0
"""Seconds the first start may take to bring the forkserver up (it imports torch)."""


def warm(ctx, group: bool = True) -> float:
    """Make sure the forkserver runs and has imported torch; return the seconds spent.

    The first call in a kernel starts the forkserver and waits for one no-op process
    from it (about 1 to 3 s: the server imports torch once); later calls return at
    once, except where the server has later imports to make for the notebook (at most
    about 1.3 s of CPU, once; see :func:`ask_for_later`): a group then waits for them,
    so that its ranks start with them. Callers add the time to their deadline: it is a
    one-off cost of the kernel, not part of any group's timeout.

    Args:
        ctx: the context from :func:`context`.
        group: ``True`` when a group is about to start its ranks (``False`` for the
            background pre-warm at import).

    Raises:
        RuntimeError: the forkserver did not serve a process within :data:`WARM_LIMIT`.
    """
    if ctx.get_start_method() != "forkserver":
        return 0.0
    t0 = time.monotonic()
    with _forkserver_lock:  # the background pre-warm may hold it: waiting counts too
        if _forkserver_ready != [os.getpid()]:
            watch_kernel_shutdown()
            start_forkserver()
            _serve_noop(ctx)
            _forkserver_ready[:] = [os.getpid()]
        if group:
            _before_group(ctx)
    return time.monotonic() - t0


def start_forkserver() -> None:
    """Start multiprocessing's forkserver, if it is not running, with ``SIGINT`` blocked
    in this thread while it is started, so that the server runs with it blocked.

    Kernel > Interrupt, and the interrupt jupyter_client sends before every shutdown and
    restart, go to the kernel's whole process group (``os.killpg`` in
    ``LocalProvisioner.send_signal``), the forkserver included. multiprocessing's
    forkserver ignores ``SIGINT`` once its preload is done ("protect the process from
    ^C", ``main`` in multiprocessing/forkserver.py), but not during it: an interrupt in
    the second or two after ``import reducelab`` stopped the server halfway through
    importing torch, wrote a ``KeyboardInterrupt`` traceback to the terminal JupyterLab
    runs in, and left the next group to start a new server (1.1 to 1.6 s). Blocked, an
    interrupt waits until the server ignores it, and is dropped then. multiprocessing
    starts its resource tracker the same way (``resource_tracker.ensure_running``). The
    ranks unblock it (:func:`reducelab.rank_env.setup`). The kernel's own interrupts are
    not held: the block is this thread's, and the kernel's other threads take the signal
    (Python runs its handler in the main thread either way)."""
    from multiprocessing import forkserver, resource_tracker
    if not hasattr(signal, "pthread_sigmask"):
        forkserver._forkserver.ensure_running()
        return
    # the server's start starts the tracker first, if it is not running, and that
    # unblocks SIGINT (and SIGTERM) in this thread after it: start it before blocking
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver._forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _serve_noop(ctx) -> None:
    p = ctx.Process(target=_noop, name=f"{PROCESS_PREFIX}warm-up", daemon=True)
    p.start()
    p.join(WARM_LIMIT)
    if p.exitcode is None:
        p.kill()
        p.join(1.0)
        raise RuntimeError(f"the forkserver that starts the ranks did not start a process "
                           f"within {WARM_LIMIT:g} s (it imports torch first); is the "
                           f"machine out of memory?")
    p.close()


SHUTDOWN_LIMIT = 1.0
"""Seconds :func:`stop_servers` waits for the forkserver and the resource tracker."""

_shutdown_watched: list[int] = []  # [kernel pid] once the kernel's shutdown is watched


def stop_servers(limit: float = SHUTDOWN_LIMIT) -> bool:
    """Stop this process's multiprocessing forkserver, then its resource tracker, and
    wait for both at most ``limit`` seconds; return ``True`` if they stopped in time.

    Why: ipykernel, asked to shut down or restart, sends ``SIGTERM`` to every child
    process in its process group and waits until none is left before it exits
    (``Kernel._progressively_terminate_all_children``, ipython/ipykernel#869). The
    resource tracker that the forkserver brings ignores ``SIGTERM`` by design
    (``multiprocessing.resource_tracker.main``) and exits only when every holder of its
    pipe has closed it, the kernel included. So a kernel that had started ranks was
    still waiting when jupyter_client's ``shutdown_wait_time`` ran out (half of 5 s),
    and was killed with ``SIGTERM``: a restart took 2.6 s instead of under 1 s, and
    its ``atexit`` handlers never ran. Closing the server's and the tracker's pipes
    (their own private ``_stop``, which waits for the process) lets both exit at once;
    the tracker first unlinks what is still registered, as at any exit. A forkserver that
    has not served a process yet is still importing torch and reads its pipe only after
    that (with ``SIGINT`` blocked, see :func:`start_forkserver`): it is sent ``SIGTERM``
    first, which ends it at once (a restart 0.2 to 0.6 s after the setup cell began,
    instead of 1.3 s). Each ``_stop`` runs in a daemon thread of its own, so the wait is
    bounded; where one is missing (another Python version) nothing is stopped and the
    kernel is killed as before."""
    from multiprocessing import forkserver, resource_tracker

    def stop(server) -> None:
        try:
            server._stop()
        except Exception:  # noqa: BLE001 - already stopped, or another version
            pass
    # A forkserver that has not served a process yet is still importing torch: it reads
    # its pipe only after that (and jupyter_client's SIGINT waits, see start_forkserver),
    # so it is ended here rather than after the wait, by ipykernel's SIGTERM.
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None and _forkserver_ready != [os.getpid()]:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    # one thread each, so the wait is bounded; the tracker's pipe is closed meanwhile
    workers = [threading.Thread(target=stop, args=(server,), daemon=True,
                                name="reducelab-stop-servers")
               for server in (forkserver._forkserver, resource_tracker._resource_tracker)]
    deadline = time.monotonic() + limit
    for w in workers:
        w.start()
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    return not any(w.is_alive() for w in workers)


def watch_kernel_shutdown() -> None:
    """In a Jupyter kernel, close every group and stop the servers (:func:`stop_servers`)
    when the kernel is told to shut down or restart: ipykernel's ``do_shutdown`` sets the
    shell's ``exit_now`` trait, before it stops its child processes."""
    if _shutdown_watched == [os.getpid()] or "ipykernel" not in sys.modules:
        return
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        return
    if shell is None or not shell.has_trait("exit_now"):
        return
    _shutdown_watched[:] = [os.getpid()]

    def on_exit_now(change) -> None:
        if change["new"]:
            from .group import _close_all
            _close_all()
            stop_servers()
    shell.observe(on_exit_now, names="exit_now")


_groups_started: dict[int, int] = {}  # {forkserver pid: groups started from it}
_later_asked: dict[int, set[str]] = {}  # {forkserver pid: modules of LATER asked for}
_later_unserved: set[int] = set()  # forkservers asked since their last group start
_imports_served: dict[int, int] = {}  # {forkserver pid: later-import requests waited for}
_held: list = []  # [the post_run_cell callback] while requests wait for the end of the first group's cell
_released_later: list[int] = []  # [forkserver pid] once the released requests named LATER's


def _server():
    """``(pid, True if it makes later imports)`` of this kernel's running forkserver, or
    ``(None, False)``."""
    from multiprocessing import forkserver
    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    later = "reducelab.forkserver_imports" in (getattr(server, "_preload_modules", None) or ())
    return pid, later


def _named_in_main(module: str) -> bool:
    """True when the kernel's namespace (``__main__``: a notebook's globals) holds
    ``module`` itself or something defined in it (a class or function it imported)."""
    main = sys.modules.get("__main__")
    target = sys.modules.get(module)
    for value in list(vars(main).values()) if main is not None else ():
        try:
            if value is target or getattr(value, "__module__", None) == module:
                return True
        except Exception:  # an object whose attributes raise says nothing
            continue
    return False


def kernel_later() -> set[str]:
    """The modules of :data:`~reducelab.forkserver_imports.LATER` this kernel has imported
    (what the notebook's own imports say its ranks will use), with what their first use
    imports on a rank (:data:`~reducelab.forkserver_imports.FIRST_USE`). A module that
    ``import torch`` imports by itself (:data:`~reducelab.forkserver_imports.WITH_TORCH`)
    counts only when the notebook's namespace holds something of it. Then the modules of
    :data:`~reducelab.forkserver_imports.RANK_PACKAGES` it has imported (the checks
    whose helpers its rank functions call)."""
    from .forkserver_imports import FIRST_USE, LATER, WITH_TORCH, imported
    found = {m for m in LATER if m in sys.modules
             and (m not in WITH_TORCH or _named_in_main(m))}
    # imported() re-reads sys.modules only when it grew: group.run calls this after
    # every run, and a notebook kernel holds about 3000 modules.
    return found.union(*(FIRST_USE.get(m, ()) for m in found),
                       (m for m in imported() if m not in LATER))


def ask_for_later(modules) -> None:
    """Ask the forkserver to import ``modules`` (names of
    :data:`~reducelab.forkserver_imports.LATER` or modules of
    :data:`~reducelab.forkserver_imports.RANK_PACKAGES`; others are ignored) in the
    background, if it has not been asked for them: the kernel writes their names in the file that
    ``REDUCELAB_LATER_IMPORTS`` names and sends ``SIGUSR1``. The next group start waits
    until the server has imported them (:func:`warm`). Does nothing without a
    forkserver that makes later imports (``REDUCELAB_PRELOAD=full``)."""
    from .forkserver_imports import FILE_ENV, SIGNAL, askable
    pid, later = _server()
    path = os.environ.get(FILE_ENV)
    if not (pid and later and path) or _held:
        return
    asked = _later_asked.setdefault(pid, set())
    new = {m for m in modules if askable(m)} - asked
    if not new:
        return
    try:
        with open(path + ".new", "w", encoding="utf-8") as f:
            f.write("".join(f"{m}\n" for m in sorted(asked | new)))
        os.replace(path + ".new", path)  # the server never reads half a list
        os.kill(pid, SIGNAL)
    except OSError:
        return  # no server or no file: each new rank imports what it uses, as ever
    asked |= new
    _later_unserved.add(pid)


def forked_in_hold() -> bool:
    """``True`` while :func:`hold_requests_for_first_cell` holds requests: ranks forked now
    lack what the kernel's imports call for (:meth:`reducelab.LocalGroup.run`)."""
    return bool(_held)


def released_later() -> bool:
    """``True`` once the held requests have been sent to the running forkserver and named
    a module of :data:`~reducelab.forkserver_imports.LATER` that ``import torch`` does not
    bring (DDP's dynamo, DTensor, FSDP, DCP): ranks forked in the hold lack it."""
    pid, _ = _server()
    return bool(pid) and _released_later == [pid]


def hold_requests_for_first_cell() -> bool:
    """In a Jupyter kernel, hold every later-import request from now until the end of the
    cell that starts the kernel's first group (IPython's ``post_run_cell`` event), or
    until a group's first run, whichever comes first (:func:`release_requests`); return
    ``True`` if held.

    Why: the server forks nothing while it imports (a fork in the middle of an import
    would leave the rank with a half-imported module), and DDP's first use imports
    ``torch._dynamo`` (about 1.3 s of CPU). A setup cell that imported DDP waited for
    that before its first group could start: 2.0 s against 0.75 s for a bare ``import
    torch`` in notebook 03 (workshop benchmark, idle 2-core machine). Held, the setup
    cell's groups start at once; the server imports while the learner reads, and a
    group whose ranks have run nothing yet is started again from it before its first
    run (about 60 ms for 4 ranks, plus whatever of the import is left). Called once, at
    ``import reducelab``, by the background pre-warm's caller."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        return False
    if shell is None or not hasattr(shell, "events") or _held:
        return False

    def at_cell_end(result=None) -> None:
        if _groups_started.get(_server()[0]):
            release_requests()
    _held[:] = [at_cell_end]
    shell.events.register("post_run_cell", at_cell_end)
    return True


def release_requests() -> None:
    """End the hold of :func:`hold_requests_for_first_cell`, if any: ask the server for
    what the kernel's imports call for (:func:`kernel_later`), in the background."""
    try:
        callback = _held.pop()  # one caller wins: list.pop is atomic
    except IndexError:
        return
    try:
        from IPython import get_ipython
        get_ipython().events.unregister("post_run_cell", callback)
    except Exception:  # noqa: BLE001 - no shell, or already gone: nothing fires it again
        pass
    _ask_for_kernel_later()


def _ask_for_kernel_later() -> None:
    """Ask the server for what the kernel's imports call for (:func:`kernel_later`); if
    that names DDP's dynamo, DTensor, FSDP or DCP, a group forked in the hold is started
    again before its first run (:func:`released_later`)."""
    from .forkserver_imports import LATER, WITH_TORCH
    wanted = kernel_later()
    ask_for_later(wanted)
    pid, later = _server()  # an eager server imported all of LATER before it served ranks
    if pid and later and any(m in LATER and m not in WITH_TORCH for m in wanted):
        _released_later[:] = [pid]  # the server has WITH_TORCH: torch imports it


READING_DELAY = 0.5
"""Seconds a Jupyter kernel stays idle after the cell that called
:func:`import_while_reading` before it imports the modules named there."""
_reading: list[str] = []  # modules import_while_reading was given and has not imported yet


def import_while_reading(*modules: str) -> bool:
    """Import ``modules`` (dotted names, e.g. ``"torch.distributed.tensor"``) in this
    kernel, and have the ranks' forkserver import those it can preload, while the
    learner reads: after the current cell has ended and the kernel has been idle for
    :data:`READING_DELAY` seconds, or at the start of the next :meth:`LocalGroup.run`,
    whichever comes first. Returns ``True`` if the imports wait for one of those,
    ``False`` if they were made at once (outside a Jupyter kernel, or already imported).

    Why: DTensor, FSDP2 and distributed checkpoint (DCP) cost about 0.6 s of CPU each to
    import after torch (most of it ``sympy``, through ``torch.fx.experimental
    .symbolic_shapes``; ``python -X importtime``, torch 2.13): a setup cell that imports
    them took about 2 times a bare ``import torch`` (issue 23's goal: 1.3 times). A
    notebook's setup cell names them here and imports them in the step that uses them,
    where the import is then already done. The ranks get them as they get what a setup
    cell imports (:func:`hold_requests_for_first_cell`): the server imports them in the
    background and a group whose ranks have run nothing yet is started again from it
    before its first run, so the first DTensor or FSDP call is as fast as before.

    The imports run on the kernel's own thread (IPython's ``post_run_cell`` event, then
    ``call_later`` on its event loop), never beside a cell's own code.

    Raises ``ModuleNotFoundError`` naming the module, before anything is imported or
    scheduled, for a name that no installed module has."""
    for name in modules:
        if not isinstance(name, str):
            raise TypeError(f"import_while_reading() takes module names, such as "
                            f"'torch.distributed.tensor'; got {name!r}")
        if not _installed(name):
            raise ModuleNotFoundError(f"import_while_reading(): no module named {name!r} is "
                                      f"installed in this kernel (torch {_torch_version()})",
                                      name=name)
    _reading.extend(m for m in modules if m not in sys.modules and m not in _reading)
    if not _reading:
        return False
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is None or not hasattr(shell, "events") or "ipykernel" not in sys.modules:
        import_read_modules()
        return False

    def at_cell_end(result=None) -> None:
        import asyncio
        shell.events.unregister("post_run_cell", at_cell_end)
        try:
            asyncio.get_running_loop().call_later(READING_DELAY, import_read_modules)
        except RuntimeError:  # no running loop: the next run, or the step's own import
            pass
    shell.events.register("post_run_cell", at_cell_end)
    return True


def _installed(name: str) -> bool:
    """Whether module ``name`` is installed, found without importing it or its parents
    (``importlib.util.find_spec`` would import ``torch.distributed.checkpoint`` to find
    ``torch.distributed.checkpoint.state_dict``)."""
    import importlib.machinery
    import importlib.util
    parts = name.split(".")
    if parts[0] in sys.modules:
        spec = getattr(sys.modules[parts[0]], "__spec__", None)
    else:
        try:
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            return False
    for i in range(1, len(parts)):
        full = ".".join(parts[:i + 1])
        if full in sys.modules:
            spec = getattr(sys.modules[full], "__spec__", None)
            continue
        path = getattr(spec, "submodule_search_locations", None)
        if not path:
            return False
        spec = importlib.machinery.PathFinder.find_spec(full, list(path))
    return spec is not None


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", "not imported")


def import_read_modules() -> None:
    """Make the imports :func:`import_while_reading` left for later, if any, then ask
    the forkserver for what it can preload of them (:func:`kernel_later`). If that names
    DTensor, FSDP or DCP, a group whose ranks were forked in the setup cell's hold and
    have run nothing yet is started again before its first run, with them
    (:meth:`reducelab.LocalGroup.run`). An import that fails is left for the step's own
    ``import`` line to raise, with torch's message."""
    import importlib
    if not _reading:
        return
    while True:
        try:
            name = _reading.pop(0)  # atomic: an explorer's thread may call this too
        except IndexError:
            break
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the cell that imports it says why
            continue
    if not _held:  # else release_requests asks for them with the rest, when the hold ends
        _ask_for_kernel_later()


def _before_group(ctx) -> None:
    """Count a group start. Ask for the later imports this kernel's own imports call for
    (from the second group on; for the first group too when the kernel has imported some
    already: a setup cell that imports DDP says its ranks will call it, and a first DDP
    call that imports dynamo on every rank took longer than notebook 13's 3 s timeout on a
    loaded machine); then, if the server has requests this kernel has not waited for,
    wait until it has made them (the fork of a no-op process waits for them in the
    server), so that this group's ranks are forked with them. A first group whose kernel
    imported none of them starts at once: that setup cell waits for nothing but torch. In
    a Jupyter kernel, requests are held until the end of the cell that starts the first
    group (:func:`hold_requests_for_first_cell`): its groups start at once, and each is
    started again before its first run if the released requests named DDP, DTensor, FSDP
    or DCP (:meth:`reducelab.LocalGroup.run`)."""
    pid, _ = _server()
    if not pid:
        return
    _groups_started[pid] = n = _groups_started.get(pid, 0) + 1
    from .forkserver_imports import LATER
    wanted = kernel_later()
    if n >= 2 or any(m in LATER for m in wanted):  # reducelab's own never hold up a first group
        ask_for_later(wanted)
    if pid in _later_unserved:
        _later_unserved.discard(pid)
        _serve_noop(ctx)
        _imports_served[pid] = _imports_served.get(pid, 0) + 1


EARLY_LIMIT = 120.0
"""Seconds after the forkserver is up in which :func:`ask_early` watches the kernel's
imports, unless a group starts first."""
EARLY_POLL = 0.05
"""Seconds between two looks at the kernel's imports in :func:`ask_early`. A look reads
the notebook's namespace, and ``sys.modules`` again when it grew: 0.02 ms, and 0.5 ms
while imports add modules (1,500 modules; one process, 200 looks each)."""


def ask_early(limit: float = EARLY_LIMIT, poll: float = EARLY_POLL) -> None:
    """Until this kernel's first group starts, ask the forkserver for the later imports
    as soon as the kernel has made them, not when that group starts.

    Run by the background pre-warm once the server is up (``reducelab/__init__.py``): a
    setup cell that imports DDP, DTensor, FSDP or DCP says its ranks will use them, and
    the first group waits until the server has imported them (:func:`_before_group`).
    Asked here, the server imports them on the machine's other core while the kernel
    goes on with the rest of its setup cell (plotting, data, a single-process
    reference), instead of after it: the group then waits for what is left, if
    anything. The same test as the first group's decides what to ask for, so a notebook
    that never imports them never gets them; from the second group on,
    :func:`_before_group` asks as before. Returns when a group has started, after
    ``limit`` seconds, or at once where the server makes no later imports or requests
    are held (:func:`hold_requests_for_first_cell`, a Jupyter kernel: there the server
    imports only once the setup cell's groups have started, since it forks nothing while
    it imports; ``limit`` and ``poll`` in seconds)."""
    from .forkserver_imports import LATER
    pid, later = _server()
    if not (pid and later) or _held:
        return
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not _groups_started.get(pid):
        wanted = kernel_later()
        if any(m in LATER for m in wanted):
            with _forkserver_lock:  # a group start counts and asks under it too
                if not _groups_started.get(pid):
                    ask_for_later(wanted)
        time.sleep(poll)


def generation() -> tuple:
    """What the processes the forkserver forks now start with: ``(server pid, how many
    of its later-import requests a group has waited for)``. A spare forked under an
    older value lacks modules a new rank would have (:meth:`reducelab.LocalGroup.keep_spares`)."""
    pid, _ = _server()
    return pid, _imports_served.get(pid, 0)


def create_time(pid: int) -> float | None:
    """When process ``pid`` started (psutil's ``create_time``), or ``None`` if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same_process(pid: int, created: float | None) -> bool | None:
    """``True`` if ``pid`` is still the process that started at ``created``, ``False`` if
    another process now has that pid, ``None`` if no process has it."""
    now = create_time(pid)
    if now is None:
        return None
    return created is not None and abs(now - created) < 0.01


def register_forkserver(rank_pid: int) -> None:
    """Tell the reaper about the forkserver, found as the parent of a running rank."""
    try:
        parent = psutil.Process(rank_pid).ppid()
    except psutil.Error:
        return
    if parent != os.getpid() and parent not in _forkservers_told:
        _forkservers_told.add(parent)
        Reaper.tell(f"pid {parent} {create_time(parent)}")


@contextlib.contextmanager
def interrupts_deferred():
    """Hold a ``KeyboardInterrupt`` (SIGINT) that arrives inside the block until its end.

    Only in the main thread (where Python delivers signals); elsewhere the block runs
    as is. Used around the few milliseconds in which processes are started or stopped,
    so an interrupt cannot leave a rank running that nothing knows of.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if caught and previous is not signal.SIG_IGN:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt


def descendants(pids) -> list[psutil.Process]:
    """Every living descendant of the processes ``pids``, from one scan of the process
    table (none without ``pids``: the scan reads every process's ``/proc`` entry)."""
    pids = list(pids)
    if not pids:
        return []
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    found, todo, seen = [], list(pids), set()
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
                try:
                    found.append(psutil.Process(child))
                except psutil.Error:
                    pass
    return found


def kill_trees(procs, wait: float = 1.0) -> None:
    """Kill the ranks ``procs`` (``_Proc`` objects, each with ``pid``, ``created`` and its
    ``multiprocessing.Process``) and all they started.

    Each rank leads a process group (see :mod:`reducelab.rank_env`): ``killpg`` stops
    it and every process it started that stayed in the group; descendants that left the
    group are found with psutil first and killed by pid. A pid that another process has
    taken since is left alone (Linux does not reuse a pid while its process group has
    members, so the group of a rank whose pid was reused is empty). Then the ranks are
    reaped, within ``wait`` seconds in all.
    """
    ours = [p for p in procs if p.pid is not None
            and same_process(p.pid, p.created) is not False]
    victims = descendants(p.pid for p in ours if same_process(p.pid, p.created))
    for p in ours:
        # A rank's process group outlives the rank while anything it started is alive,
        # so it is killed even when the rank itself has exited.
        with contextlib.suppress(OSError, AttributeError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            p.process.kill()
    for v in victims:
        try:
            v.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + wait
    for p in procs:
        with contextlib.suppress(OSError, ValueError, AssertionError):
            p.process.join(max(0.0, deadline - time.monotonic()))


def ask_to_leave(procs, send, wait: float = 1.0) -> None:
    """Send ``close`` to idle ranks with ``send(proc)`` and wait up to ``wait`` seconds for
    them to leave the process group and exit (without reaping them)."""
    for p in procs:
        try:
            send(p)
        except (OSError, ValueError):
            pass
    sentinels = {p.process.sentinel for p in procs if p.process.exitcode is None}
    deadline = time.monotonic() + wait
    while sentinels and time.monotonic() < deadline:
        for s in mp_wait(list(sentinels), timeout=max(0.0, deadline - time.monotonic())):
            sentinels.discard(s)


def stop(procs, tmpdir: str | None) -> None:
    """Stop the ranks ``procs`` (``_Proc`` objects) and all they started, reap them, close
    their pipes and remove the group's temporary directory ``tmpdir``. Idempotent; an
    interrupt arriving meanwhile is raised once everything is stopped. Returns at once
    with nothing to stop (a resize stops its unused spares, most often none)."""
    if not procs and not tmpdir:
        return
    with interrupts_deferred():
        kill_trees(procs)
        for p in procs:
            p.conn.close()
            try:
                p.process.close()
            except ValueError:
                pass
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        Reaper.tell(*[f"-pg {p.pid}" for p in procs], *([f"-dir {tmpdir}"] if tmpdir else []))
