"""Adversarial suite (README, "Faults tried"): nothing a learner does freezes the notebook, loses the
group or opens a port. Each case checks the error a learner sees and that the same
LocalGroup runs again afterwards.

A "kernel" here is a fresh Python process that uses LocalGroup the way a notebook
kernel does; the tests kill it, run two at once, and inspect their sockets.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import stat
import tempfile
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import gone, start_python
from reducelab import LocalGroup, RankError

LOOPBACK = {"127.0.0.1", "::1"}


def ranks_of(g):
    return g.run(lambda: (dist.get_rank(), dist.get_world_size()))


@pytest.fixture()
def g3():
    g = LocalGroup(world_size=3, timeout=4)
    yield g
    g.close()


# --- faults -------------------------------------------------------------------------

def test_exception_inside_a_collective_is_reported_within_seconds(g3):
    def fails_inside():
        t = torch.ones(4)
        if dist.get_rank() == 1:
            dist.all_reduce(t, op=dist.ReduceOp.BAND)   # refused for float32
        else:
            dist.all_reduce(t)
        return t
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        g3.run(fails_inside)
    # Not the 4 s timeout: the others get _GRACE (1 s) to report. Measured 1.05 to 1.23 s
    # in 10 runs on the 2-core machine under load (load average 5 to 9); a report twice
    # as slow (a doubled grace, say) fails this bound. (It was 3.0 s: a tripled grace
    # passed it by 30 ms.)
    assert time.monotonic() - t0 < 2.0
    err = info.value
    assert 1 in err.ranks and "rank 1 raised RuntimeError" in str(err)
    assert "BAND" in err.tracebacks[1] and "fails_inside" in err.tracebacks[1]
    assert ranks_of(g3) == [(0, 3), (1, 3), (2, 3)]


def test_mismatched_collectives_say_which_rank_was_in_which(g3):
    def mismatched():
        t = torch.ones(2)
        r = dist.get_rank()
        if r == 0:
            dist.all_reduce(t)
        elif r == 1:
            dist.broadcast(t, src=1)
        return r                                     # rank 2 skips the collective
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        g3.run(mismatched)
    # the 4 s timeout, then the report: measured 0.04 to 0.28 s past it (10 runs, 2 cores
    # under load, and up to 0.81 s for the same path in test_group); the README's bound
    # is timeout + 3 s, this one fails a report twice as slow as the slowest measured
    assert time.monotonic() - t0 < 4 + 1.5
    err = info.value
    by_rank = {r.rank: r for r in err.reports}
    assert by_rank[0].collective == "all_reduce"
    assert by_rank[1].collective == "broadcast"
    assert by_rank[2].state == "returned"
    assert "not in the same collective" in err.headline
    assert ranks_of(g3) == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.parametrize("how", ["sigkill", "os_exit"])
def test_dead_rank_is_reported_within_seconds(how):
    with LocalGroup(world_size=3, timeout=60) as g:
        def dies():
            if dist.get_rank() == 2:
                time.sleep(0.3)                         # let the others reach the barrier
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(3)
            dist.barrier()
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            g.run(dies)
        # the timeout is 60 s; a death is reported at once: measured 0.34 to 1.15 s (the
        # 0.3 s sleep included) in 10 runs of each kind on 2 cores under load (load
        # average 5 to 9); twice the slowest fails it
        assert time.monotonic() - t0 < 2.0
        text = str(info.value)
        assert "rank 2 died" in text
        assert ("SIGKILL" in text) if how == "sigkill" else ("exited with code 3" in text)
        rank0 = next(r for r in info.value.reports if r.rank == 0)
        assert "barrier" in rank0.summary + rank0.traceback     # where the survivors were
        assert ranks_of(g) == [(0, 3), (1, 3), (2, 3)]


def test_rank_killed_from_outside_while_idle_is_replaced(g3, capsys):
    victim = g3.pids[1]
    os.kill(victim, signal.SIGKILL)
    assert gone([victim], within=5)
    deadline = time.monotonic() + 5      # until the forkserver has told the kernel
    while g3.alive != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ranks_of(g3) == [(0, 3), (1, 3), (2, 3)]
    assert "rank 1 died: killed by SIGKILL while idle" in capsys.readouterr().err
    assert victim not in g3.pids


def test_unpicklable_return_value_names_the_rank(g3):
    def returns_a_lock():
        return threading.Lock() if dist.get_rank() == 1 else dist.get_rank()
    with pytest.raises(RankError) as info:
        g3.run(returns_a_lock)
    assert info.value.ranks == [1]
    assert "return value could not be pickled" in str(info.value)
    assert ranks_of(g3) == [(0, 3), (1, 3), (2, 3)]


def test_very_large_return_value_works():
    with LocalGroup(world_size=2, timeout=60) as g:
        out = g.run(lambda: torch.full((50_000_000,), float(dist.get_rank())))  # 200 MB each
        assert [t.numel() for t in out] == [50_000_000] * 2
        assert float(out[1][-1]) == 1.0


def test_big_return_values_still_on_their_way_at_the_timeout_are_not_stuck():
    """fn returns 0.4 s before the 3 s timeout, but pickling and sending 2 x 400 MB (a
    list of 50 tensors, like a state_dict) takes longer than that: the values travel in
    chunks as they are pickled, so run() sees them progress and waits for them rather
    than calling the ranks stuck."""
    def big(return_at):
        values = [torch.full((2_000_000,), float(dist.get_rank())) for _ in range(50)]
        time.sleep(max(0.0, return_at - time.time()))
        return values
    with LocalGroup(world_size=2, timeout=3) as g:
        t0 = time.monotonic()
        out = g.run(big, time.time() + 2.6)
        assert time.monotonic() - t0 > 3      # the path under test was taken
        assert [len(v) for v in out] == [50, 50]
        assert [float(v[-1][-1]) for v in out] == [0.0, 1.0]


def test_resize_after_close_raises_and_starts_nothing():
    from reducelab import GroupClosedError
    g = LocalGroup(world_size=2)
    g.close()
    with pytest.raises(GroupClosedError):
        g.resize(3)
    assert g.pids == [] and g.state == "closed"


@pytest.mark.parametrize("work", ["sleep", "busy loop"])
def test_interrupt_during_run_arrives_within_2_s_and_the_group_runs_again(work):
    def learner_code(kind):
        if kind == "sleep":
            time.sleep(60)
        while True:
            pass
    with LocalGroup(world_size=2, timeout=120) as g:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            g.run(learner_code, work)
        # README: within 2 s. Measured 0.02 to 0.12 s after the signal (10 runs, 2 cores
        # under load); 0.5 s after it leaves room for a slow day, not for a lost wake-up
        assert time.monotonic() - t0 < 0.5 + 0.5
        assert ranks_of(g) == [(0, 2), (1, 2)]


KERNEL = """
    import json, multiprocessing.util, sys, time
    from reducelab import LocalGroup
    g = LocalGroup(world_size=3, timeout=30)
    print(json.dumps({"pids": g.pids, "tmp": g._tmpdir,
                      "mp_tmp": multiprocessing.util.get_temp_dir()}), flush=True)
    g.run(lambda: 1)
    {tail}
"""


def _kernel_info(proc) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return json.loads(line)


@pytest.mark.parametrize("busy", [False, True])
def test_killed_kernel_leaves_no_rank_and_no_temp_files(busy):
    tail = ("import torch.distributed as dist\n    g.run(lambda: dist.barrier() "
            "if dist.get_rank() else time.sleep(600))" if busy else "time.sleep(600)")
    proc = start_python(KERNEL.replace("{tail}", tail))
    try:
        info = _kernel_info(proc)
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert gone(info["pids"] + descendants, within=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (os.path.exists(info["tmp"])
                                               or os.path.exists(info["mp_tmp"])):
            time.sleep(0.1)
        assert not os.path.exists(info["tmp"])
        assert not os.path.exists(info["mp_tmp"])
    finally:
        proc.kill()


def test_exiting_kernel_stops_its_ranks():
    proc = start_python(KERNEL.replace("{tail}", "sys.exit(0)"))
    info = _kernel_info(proc)
    proc.wait(30)
    assert gone(info["pids"], within=10)
    assert not os.path.exists(info["tmp"])


def test_two_kernels_run_groups_at_the_same_time():
    code = """
        import torch, torch.distributed as dist
        from reducelab import LocalGroup
        with LocalGroup(world_size=3, timeout=30) as g:
            total = 0
            for i in range(30):
                def f(i=i):
                    t = torch.tensor([float(dist.get_rank() + i)])
                    dist.all_reduce(t)
                    return t.item()
                out = g.run(f)
                assert out == [3.0 + 3 * i] * 3, out
                total += out[0]
            print(total)
    """
    a, b = start_python(code), start_python(code)
    outs = [p.communicate(timeout=120) for p in (a, b)]
    assert [p.returncode for p in (a, b)] == [0, 0], outs
    assert [o[0].strip() for o in outs] == [str(sum(3.0 + 3 * i for i in range(30)))] * 2


def test_fifty_groups_leak_no_process_fd_or_temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # groups' dirs go here alone
    me = psutil.Process()
    before_tmp = set(glob.glob(os.path.join(tempfile.gettempdir(), "reducelab-*")))
    LocalGroup(world_size=2).close()   # warm the forkserver: it lives as long as the kernel
    fds, children = me.num_fds(), {p.pid for p in me.children(recursive=True)}
    for i in range(50):
        with LocalGroup(world_size=2) as g:
            assert g.run(lambda: dist.get_world_size()) == [2, 2]
    time.sleep(0.5)
    assert {p.pid for p in me.children(recursive=True)} <= children
    assert me.num_fds() <= fds + 2
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "reducelab-*"))) == before_tmp


# --- security -----------------------------------------------------------------------

def _listening(pids) -> list:
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.append((c.pid, c.laddr.ip, c.laddr.port))
    return out


def test_only_loopback_listens_while_a_group_runs():
    me = os.getpid()
    before = _listening({me})
    with LocalGroup(world_size=4) as g:
        def hold():
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()
        assert g.run(hold) == [4.0] * 4
        pids = set(g.pids) | {me}
        listening = _listening(pids)
        assert listening, "gloo listens on something; the test must see it to mean anything"
        assert all(ip in LOOPBACK for _, ip, _ in listening), listening
        assert _listening({me}) == before        # the kernel itself opens no listener


def test_store_directory_is_private_and_removed_on_close():
    g = LocalGroup(world_size=2)
    path = g._tmpdir
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode == 0o700
    assert os.listdir(path) == ["store"]
    g.close()
    assert not os.path.exists(path)


def test_no_endpoint_accepts_pickled_data():
    """Jobs reach ranks only over socket pairs the kernel holds: no inet socket of the
    kernel or a rank other than gloo's loopback pairs, and no unix socket path the
    group creates (the forkserver's lives in multiprocessing's private 0700 dir)."""
    with LocalGroup(world_size=2) as g:
        g.run(lambda: None)
        for pid in g.pids:
            for c in psutil.Process(pid).net_connections(kind="unix"):
                if c.status == psutil.CONN_LISTEN and c.laddr:
                    pytest.fail(f"rank {pid} listens on unix socket {c.laddr}")
        for pid in g.pids:
            listeners = [c for c in psutil.Process(pid).net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN]
            assert all(c.laddr.ip in LOOPBACK for c in listeners)
