"""A Jupyter kernel that started ranks shuts down (and restarts) by itself.

ipykernel, asked to shut down, stops the child processes in its process group before it
exits, and jupyter_client kills it with ``SIGTERM`` if it has not exited after half of
its ``shutdown_wait_time``. multiprocessing's resource tracker ignores ``SIGTERM``, so
until reducelab stopped it at the shutdown request, every kernel that had started ranks
was killed: 2.6 s per restart, and its ``atexit`` handlers never ran
(:func:`reducelab.processes.stop_servers`).
"""
from __future__ import annotations

import json
import os
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

SETUP = r"""
import atexit, json, os, psutil
from reducelab import LocalGroup
group = LocalGroup(2)
group.run(lambda: 1)
me = psutil.Process()
atexit.register(lambda: open({marker!r}, "w").write("atexit ran"))
print(json.dumps([p.pid for p in me.children(recursive=True)]))
"""


def _run(kc, code: str) -> str:
    out = []
    kc.execute_interactive(code, timeout=120, output_hook=lambda m: out.append(
        m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
    return "".join(out)


@pytest.mark.parametrize("restart", [False, True], ids=["shutdown", "restart"])
def test_a_kernel_with_ranks_exits_by_itself_and_runs_its_atexit(tmp_path, restart):
    marker = tmp_path / "atexit"
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        printed = _run(kc, SETUP.format(marker=str(marker)))
        children = json.loads(printed.strip().splitlines()[-1])
        assert len(children) >= 4, printed  # 2 ranks, the forkserver, the tracker
        kernel = km.provisioner.process
        if restart:
            km.restart_kernel()
        else:
            km.shutdown_kernel()
        # exited by itself: a kernel jupyter_client had to stop has exit status -15
        assert kernel.returncode == 0, f"the kernel ended with {kernel.returncode}"
        assert marker.read_text() == "atexit ran"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in children):
            time.sleep(0.1)
        left = [p for p in children if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes left: {left}"
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
