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
import subprocess
import sys
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


def test_an_interrupt_while_the_forkserver_imports_torch_leaves_it_serving(tmp_path):
    """Kernel > Interrupt goes to the kernel's whole process group (jupyter_client's
    ``os.killpg``), the forkserver included. In the second or two after ``import
    reducelab``, while the server still imports torch, it used to die of the interrupt
    with a ``KeyboardInterrupt`` traceback on the kernel's stderr (the terminal of
    JupyterLab), and the next group had to start a new one. Now the server starts with
    SIGINT blocked, and multiprocessing ignores it once the server's imports are done
    (:func:`reducelab.processes.start_forkserver`)."""
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        km, kc = start_new_kernel(kernel_name="python3", stderr=stderr)
    try:
        printed = _run(kc, "import time, reducelab, reducelab.processes as P\n"
                           "from multiprocessing import forkserver\n"
                           "while getattr(forkserver._forkserver, '_forkserver_pid', None) is None:\n"
                           "    time.sleep(0.005)\n"
                           "print(forkserver._forkserver._forkserver_pid, P._forkserver_ready == [])")
        pid, importing = printed.split()
        km.interrupt_kernel()
        assert importing == "True", "the server had finished its imports: nothing was tested"
        time.sleep(1.0)
        after = _run(kc, "from reducelab import LocalGroup\ng = LocalGroup(2)\n"
                         "print(g.run(lambda: 1), forkserver._forkserver._forkserver_pid)")
        assert after.split("]")[-1].strip() == pid, f"a new forkserver served the group: {after}"
        assert "KeyboardInterrupt" not in err.read_text()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_stop_servers_ends_a_forkserver_still_importing_torch_at_once():
    """A forkserver reads its pipe only after its imports, so closing it (``_stop``)
    waited for torch's import; ``stop_servers`` ends a server that has not served a
    process yet with SIGTERM, well within a limit shorter than that import."""
    code = ("import psutil, time\n"
            "from multiprocessing import forkserver\n"
            "from reducelab import processes\n"
            "processes.context()\n"
            "forkserver._forkserver.ensure_running()\n"
            "pid = forkserver._forkserver._forkserver_pid\n"
            "stopped = processes.stop_servers(0.3)\n"
            "time.sleep(0.1)\n"
            "print(stopped, psutil.pid_exists(pid))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "REDUCELAB_PREWARM": "0"})
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_a_rank_takes_its_own_sigint_although_the_forkserver_blocks_it():
    """Ranks come from a forkserver started with SIGINT blocked; each unblocks it, so a
    signal a rank's own code sends (or its children's) is a KeyboardInterrupt there, as
    in any Python process (:func:`reducelab.rank_env.setup`)."""
    from reducelab import LocalGroup

    def own_sigint():
        import os
        import signal
        blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            return blocked, "KeyboardInterrupt"
        return blocked, "nothing"

    with LocalGroup(2) as g:
        assert g.run(own_sigint) == [(False, "KeyboardInterrupt")] * 2
