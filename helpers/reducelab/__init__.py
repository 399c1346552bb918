"""Reduce Lab: real ``torch.distributed`` collectives on local gloo ranks, from notebook cells.

Start with :class:`LocalGroup` (notebook 01).
"""
from .errors import GroupBusyError, GroupClosedError, RankError, RankReport
from .determinism import setup
from .group import LocalGroup
from .processes import import_while_reading

__all__ = ["GroupBusyError", "GroupClosedError", "LocalGroup", "RankError", "import_while_reading", "RankReport", "setup", "load_ipython_extension"]


def _prewarm() -> None:
    """Start the ranks' forkserver (it imports torch) in the background, at import.

    In a notebook, the setup cell then imports torch in the kernel while the forkserver
    imports it in its own process, and the first ``LocalGroup`` finds it ready, instead
    of paying for the two imports one after the other. Then, until the first group
    starts, the same thread asks the server for what the setup cell imports of DDP,
    DTensor, FSDP or DCP as soon as it is imported (:func:`reducelab.processes.ask_early`),
    except in a Jupyter kernel, where those requests wait for the end of the cell that
    starts the first group (:func:`reducelab.processes.hold_requests_for_first_cell`).
    Only in a Jupyter kernel's main process (or with ``REDUCELAB_PREWARM=1``);
    ``REDUCELAB_PREWARM=0`` turns it off.
    """
    import os
    import sys
    import threading
    flag = os.environ.get("REDUCELAB_PREWARM", "")
    if flag == "0":
        return
    import multiprocessing as mp
    if mp.parent_process() is not None or "multiprocessing.forkserver" in sys.modules:
        return  # a rank, a DataLoader worker, or the forkserver itself (it imports us)
    if flag != "1" and "ipykernel" not in sys.modules:
        return

    from .processes import hold_requests_for_first_cell, watch_kernel_shutdown
    watch_kernel_shutdown()  # before the server starts: a restart may come at any time
    hold_requests_for_first_cell()  # a Jupyter kernel's setup cell waits for torch alone

    def warm_up() -> None:
        from .processes import ask_early, context, warm
        try:
            warm(context(), group=False)
        except Exception:  # noqa: BLE001 - the first LocalGroup will start it and say why
            return
        ask_early()  # what the setup cell imports of DDP, DTensor, FSDP, DCP: asked at once
    threading.Thread(target=warm_up, name="reducelab-prewarm", daemon=True).start()


_prewarm()


def _join_workshop() -> None:
    """Join the workshop whose join address is in ``REDUCELAB_WORKSHOP``, in the
    background (:mod:`reducelab.workshop`): in a Jupyter kernel's main process only,
    never in a rank or a process torchrun starts."""
    import os
    import sys
    if not os.environ.get("REDUCELAB_WORKSHOP") or "ipykernel" not in sys.modules:
        return
    import multiprocessing as mp
    if mp.parent_process() is None and "multiprocessing.forkserver" not in sys.modules:
        from .workshop import start_from_env
        start_from_env()


_join_workshop()


def load_ipython_extension(ipython) -> None:
    """``%load_ext reducelab``: registers the ``%%ranks`` cell magic (see reducelab.magic)."""
    from .magic import load_ipython_extension as load
    load(ipython)
__version__ = "0.1.0"
