"""A pytest plugin for the nbval runs (``-p tests.nbval_report`` in the Makefile): when a
notebook cell fails, its report also shows the stream text the cell printed this run; and
nbval's kernels use Unix sockets, not TCP ports (:class:`_IpcKernelManager`).

nbval names an unexpected output field ("Unexpected output fields from running code:
{'stderr'}") but not its text, and a rare one cannot be found again by re-running. The
text is what tells where it came from: a rank, the forkserver, the kernel or torch.
"""
from __future__ import annotations

import itertools
import os
import tempfile

import nbval.kernel
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    outputs = getattr(item, "test_outputs", None)
    if report.when != "call" or not report.failed or not outputs:
        return
    streams = {}
    for out in outputs:
        if out.get("output_type") == "stream":
            streams[out["name"]] = streams.get(out["name"], "") + out["text"]
    for name, text in streams.items():
        report.sections.append((f"this run's {name} of the cell", text))


_SOCKETS = tempfile.TemporaryDirectory(prefix="nbval-")  # removed when pytest exits
_KERNELS = itertools.count()


class _IpcKernelManager(nbval.kernel.KernelManager):
    """nbval's kernels talk over Unix sockets (``transport="ipc"``), not TCP ports.

    With TCP, jupyter_client picks free ports, closes them and writes them to the
    connection file for the kernel to bind; another process can take one in between
    (jupyter/jupyter_client#154). ``make test`` runs two nbval passes at once, and one CI
    run of d456c18 lost a kernel that way: "Kernel died before replying to kernel_info",
    before any cell ran. IPC sockets are files named after each kernel's own connection
    file, so no two kernels can pick the same one."""

    def __init__(self, **kwargs):
        kwargs.setdefault("transport", "ipc")
        # an absolute path: the kernel runs in the notebook's folder, the client does not
        kwargs.setdefault("ip", os.path.join(_SOCKETS.name, f"kernel-{next(_KERNELS)}"))
        super().__init__(**kwargs)


nbval.kernel.KernelManager = _IpcKernelManager
