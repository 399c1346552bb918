"""Nothing a learner does breaks the kernel (README, "Faults tried"): interrupts at any
moment, processes that ranks start, ranks stuck in C code, calls from several threads,
user objects that break while being reported, and one time bound for every call.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import gone, run_python, start_python
from reducelab import GroupBusyError, GroupClosedError, LocalGroup, RankError
from reducelab.group import MARGIN


# --- what a rank starts dies with it ------------------------------------------------

def start_children():
    """On every rank: a subprocess in the rank's process group, one in a session of its
    own, and a multiprocessing child; return their pids."""
    import multiprocessing as mp
    import subprocess
    import sys
    global kept                                       # keep the handles alive on the rank
    same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                           start_new_session=True)
    child = mp.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    kept = (same, own, child)
    return [same.pid, own.pid, child.pid]


def test_close_stops_what_the_ranks_started():
    g = LocalGroup(world_size=2, timeout=30)
    pids = [pid for per_rank in g.run(start_children) for pid in per_rank]
    assert all(psutil.pid_exists(p) for p in pids)
    g.close()
    assert gone(pids, within=5)


def test_a_restart_after_a_failure_stops_what_the_failed_ranks_started():
    with LocalGroup(world_size=2, timeout=30) as g:
        same, own, child = zip(*g.run(start_children))
        with pytest.raises(RankError):
            g.run(lambda: os._exit(1) if dist.get_rank() == 0 else dist.barrier())
        # what rank 0 started in its process group, and all that rank 1 started; a
        # process in a session of its own is not found once its rank has died
        assert gone(list(same) + list(child) + [own[1]], within=5)
        os.kill(own[0], signal.SIGKILL)
        assert g.run(lambda: dist.get_rank()) == [0, 1]


KERNEL = """
    import json, sys, time
    import torch.distributed as dist
    from reducelab import LocalGroup
    from reducelab.reaper import Reaper
    from faults.test_lifecycle import start_children
    g = LocalGroup(world_size=2, timeout=60)
    children = g.run(start_children)
    print(json.dumps({"ranks": g.pids, "children": [p for c in children for p in c],
                      "reaper": Reaper.pid(), "tmp": g._tmpdir}), flush=True)
    {tail}
"""


def _kernel(tail: str):
    proc = start_python(KERNEL.replace("{tail}", tail), cwd=os.path.dirname(
        os.path.dirname(__file__)))
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)


@pytest.mark.parametrize("busy", ["idle", "holding the GIL in C"])
def test_a_killed_kernel_leaves_no_rank_and_nothing_they_started(busy):
    """The kernel dies by SIGKILL (no finalizer runs). A rank stuck in C code holding the
    GIL cannot run Python to notice; the reaper kills its process group instead."""
    tail = "time.sleep(600)" if busy == "idle" else (
        "import threading\n    threading.Timer(0.1, lambda: print('x', flush=True)).start()\n"
        "    g.run(lambda: __import__('ctypes').PyDLL(None).sleep(600))")
    proc, info = _kernel(tail)
    try:
        if busy != "idle":
            assert proc.stdout.readline().strip() == "x"
            time.sleep(1.0)                    # the ranks are inside sleep(), GIL held
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert gone(info["ranks"] + info["children"], within=10)
        assert gone([info["reaper"]], within=5)
        assert not os.path.exists(info["tmp"])
    finally:
        proc.kill()
        for pid in info["ranks"] + info["children"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# --- interrupts at any moment -----------------------------------------------------------

INTERRUPTS = """
    import json, os, signal, threading, time
    import torch.distributed as dist
    from reducelab import LocalGroup

    def interrupt_after(delay, action):
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        try:
            action()
            what = "finished"
        except KeyboardInterrupt:
            what = "interrupted"
        timer.cancel()
        time.sleep(max(0.0, delay - (time.monotonic() - t0)) + 0.05)  # no late signal
        return what, time.monotonic() - t0

    report = []
    for delay in {delays}:
        # the first group of a fresh kernel: the forkserver starts, then the ranks
        what, took = interrupt_after(delay, lambda: LocalGroup(world_size=4, timeout=30))
        with LocalGroup(world_size=2, timeout=30) as g:       # at once, no restart
            ok = g.run(lambda: dist.get_rank()) == [0, 1]
            what2, _ = interrupt_after(delay / 4, lambda: g.resize(3))
            ok2 = g.run(lambda: dist.get_world_size()) in ([2, 2], [3, 3, 3])
            what3, _ = interrupt_after(0.01, g.close)
            g.close()
        report.append({{"delay": delay, "start": what, "took": took, "ok": ok and ok2,
                       "resize": what2, "close": what3}})
    print(json.dumps(report))
"""


def test_interrupts_while_starting_resizing_and_closing_leave_the_kernel_able_to_start_groups():
    """An interrupt that lands while the first group starts (forkserver start, rank
    start, joining), while a group resizes, or while it closes: the kernel can start a
    new group at once, and no process outlives the kernel."""
    res = run_python(INTERRUPTS.replace("{delays}", "[0.05, 0.3, 1.0, 2.5]")
                     .replace("{{", "{").replace("}}", "}"), timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "FileNotFoundError" not in res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(r["ok"] for r in report), report
    assert any(r["start"] == "interrupted" for r in report), report
    for r in report:
        if r["start"] == "interrupted":
            assert r["took"] < r["delay"] + 2.0, report   # promptly, not at the end


def test_no_process_outlives_an_interrupted_kernel():
    code = INTERRUPTS.replace("{delays}", "[0.3, 1.0]").replace("{{", "{").replace("}}", "}")
    code = code.replace('print(json.dumps(report))',
                        'print(json.dumps(report), flush=True)\n    import psutil\n'
                        '    print(json.dumps([c.pid for c in psutil.Process().children(recursive=True)]))')
    res = run_python(code, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    leftover = json.loads(res.stdout.strip().splitlines()[-1])
    assert gone(leftover, within=10)


# --- several threads ---------------------------------------------------------------------

def test_two_threads_calling_run_at_once_are_served_one_after_the_other(group):
    results, errors = {}, []

    def caller(k):
        try:
            def f():
                t = torch.tensor([float(k)])
                dist.all_reduce(t)
                time.sleep(0.2)
                return t.item()
            results[k] = group.run(f)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=caller, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {k: [4.0 * k] * 4 for k in (1, 2, 3)}
    assert group.run(lambda: dist.get_rank()) == [0, 1, 2, 3]


def test_a_second_caller_waits_for_the_first_or_gets_a_clear_error_within_its_timeout():
    slow_progress = threading.Event()

    def progress(up, n):                     # runs inside resize(), which holds the group
        if slow_progress.is_set() and up == n:
            time.sleep(5)
    with LocalGroup(world_size=2, timeout=3, progress=progress) as g:
        first = threading.Thread(target=g.run, args=(time.sleep, 1.0))
        first.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        assert g.run(lambda: dist.get_rank()) == [0, 1]   # waited for the first call
        assert 0.5 < time.monotonic() - t0 < 3
        first.join()
        slow_progress.set()
        slow = threading.Thread(target=g.resize, args=(3,))
        slow.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(GroupBusyError, match="waited 3 s for another thread"):
            g.run(lambda: 1)
        assert 3 <= time.monotonic() - t0 < 3 + 0.5
        slow.join(15)
        assert g.run(lambda: dist.get_world_size()) == [3, 3, 3]


def test_close_from_another_thread_stops_a_run_at_once_and_says_the_group_is_closed():
    g = LocalGroup(world_size=3, timeout=60)
    caught = []

    def runner():
        try:
            g.run(lambda: dist.barrier() if dist.get_rank() else time.sleep(60))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            caught.append(e)
    t = threading.Thread(target=runner)
    t.start()
    time.sleep(1.0)
    pids = g.pids
    t0 = time.monotonic()
    g.close()
    t.join(10)
    # "at once": measured 0.03 to 0.29 s (10 runs, 2 cores under load, load average 5
    # to 9); twice the slowest fails. (It was MARGIN, 3 s: ten times the slowest.)
    assert time.monotonic() - t0 < 0.5
    assert len(caught) == 1 and isinstance(caught[0], GroupClosedError), caught
    assert "closed" in str(caught[0]) and "fresh ranks" not in str(caught[0])
    assert gone(pids, within=5)
    assert g.state == "closed" and g.pids == []
    with pytest.raises(GroupClosedError):
        g.run(lambda: 1)


def test_a_call_from_inside_a_call_on_the_same_thread_is_refused_at_once():
    calls = []

    def progress(up, n):
        if up == n and calls and calls[0] is not None:
            try:
                calls[0].run(lambda: 1)
            except RuntimeError as e:
                calls.append(str(e))
    g = LocalGroup(world_size=2, timeout=30, progress=progress)
    try:
        calls.insert(0, g)
        g.resize(3)
        assert "already inside a call on the same LocalGroup" in calls[1]
        assert g.run(lambda: dist.get_world_size()) == [3, 3, 3]
    finally:
        calls[0] = None
        g.close()


# --- user objects that break the reporting -----------------------------------------------

class _BadStr(Exception):
    def __str__(self):
        raise RuntimeError("__str__ is broken too")


def test_an_exception_whose_str_raises_is_reported_by_rank(group):
    def raise_it():
        if dist.get_rank() == 1:
            raise _BadStr()
        return dist.get_rank()
    with pytest.raises(RankError) as info:
        group.run(raise_it)
    assert info.value.ranks == [1]
    assert "rank 1 raised _BadStr" in info.value.headline
    assert "raise_it" in info.value.tracebacks[1]
    assert "rank_loop.py" not in info.value.tracebacks[1]
    assert group.run(lambda: dist.get_rank()) == [0, 1, 2, 3]


def test_a_huge_exception_message_gives_a_bounded_error(group):
    def shout():
        raise ValueError("x" * 20_000_000)
    with pytest.raises(RankError) as info:
        group.run(shout)
    text = str(info.value)
    assert "rank 0 raised ValueError" in text or "ranks 0, 1, 2, 3 raised ValueError" in text
    assert len(text) < 100_000
    assert "characters cut" in text


def test_a_return_value_whose_pickling_never_ends_is_bounded():
    """fn returns at once, but pickling its value hangs: only a chunk that arrives is
    progress, so the call ends with its timeout (README: "a return value whose pickling
    never ends")."""
    class Slow:
        def __reduce__(self):
            time.sleep(60)
            return (int, (0,))
    with LocalGroup(world_size=2, timeout=2) as g:
        t0 = time.monotonic()
        with pytest.raises(RankError, match="fn returned; its return value was still being "
                                            "pickled, at __reduce__"):
            g.run(lambda: Slow())
        # The value makes no progress (no chunk), so it gets no more time than the
        # timeout: measured 2.03 to 2.25 s in 10 runs on 2 cores under load (load
        # average 5 to 9). (It was 2 x timeout + MARGIN, 7 s, which a second timeout
        # passed.)
        assert time.monotonic() - t0 < 2 + 1.5
        assert g.run(lambda: dist.get_rank()) == [0, 1]


# --- one bound -----------------------------------------------------------------------

def test_every_failing_call_ends_within_timeout_plus_the_margin():
    timeout = 2.0
    with LocalGroup(world_size=3, timeout=timeout) as g:
        cases = {
            "skipped collective": lambda: dist.get_rank() == 1 or dist.all_reduce(torch.ones(1)),
            "sleeps": lambda: time.sleep(30),
            "mismatched": lambda: dist.broadcast(torch.ones(1), src=0) if dist.get_rank()
            else dist.all_reduce(torch.ones(1)),
        }
        for name, fn in cases.items():
            t0 = time.monotonic()
            with pytest.raises(RankError, match=f"did not finish within {timeout:g} s"):
                g.run(fn)               # the first of these also restarts the ranks
            took = time.monotonic() - t0
            # README: timeout + MARGIN (3 s). Measured 0.02 to 0.64 s past the timeout (a
            # restart included) in 10 runs on 2 cores under load (load average 5 to 9);
            # a report twice as slow as the slowest fails this tighter bound
            assert took < timeout + 1.5, (name, took)
        assert g.run(lambda: dist.get_rank()) == [0, 1, 2]


# --- found by review: each of these failed before its fix ----------------------------

def test_close_and_resize_stop_children_in_a_session_of_their_own():
    """A polite close lets the ranks leave first; they take what they started along,
    also children that left the rank's process group (start_new_session)."""
    def start_own_session_child():
        import subprocess
        import sys
        global kept_child
        kept_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                      start_new_session=True)
        return kept_child.pid
    g = LocalGroup(world_size=2, timeout=30)
    first = g.run(start_own_session_child)
    g.resize(3)
    assert gone(first, within=5)
    second = g.run(start_own_session_child)
    g.close()
    assert gone(second, within=5)


def test_an_interrupt_while_stopping_is_held_until_everything_is_stopped():
    from reducelab import processes
    g = LocalGroup(world_size=2, timeout=30)
    pids, tmp = g.pids, g._tmpdir
    with pytest.raises(KeyboardInterrupt):
        with processes.interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)   # lands inside the block
            g.close()                               # ... which still completes
    assert g.state == "closed" and g.pids == []
    assert gone(pids, within=5) and not os.path.exists(tmp)


def test_an_ignored_sigint_stays_ignored_through_a_deferred_block():
    from reducelab import processes
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with processes.interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_close_while_another_thread_pickles_the_arguments_raises_group_closed():
    class SlowArgument:                  # a learner's object, slow to pickle in the kernel
        def __reduce__(self):
            time.sleep(6)
            return (int, (1,))
    from reducelab.group import current_group
    g = LocalGroup(world_size=2, timeout=30)
    caught = []

    def runner():
        try:
            g.run(lambda x: x, SlowArgument())
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            caught.append(e)
    t = threading.Thread(target=runner)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    g.close()                             # gives up waiting after 5 s, stops the ranks
    assert time.monotonic() - t0 < 5 + MARGIN
    t.join(30)
    assert len(caught) == 1 and isinstance(caught[0], GroupClosedError), caught
    assert g.state == "closed" and current_group() is not g


def test_close_from_a_progress_callback_during_resize_closes_the_group():
    holder = []

    def progress(up, n):
        if holder and up == 1 and n == 3:
            holder[0].close()
    g = LocalGroup(world_size=2, timeout=30, progress=progress)
    holder.append(g)
    with pytest.raises(GroupClosedError):
        g.resize(3)
    assert g.state == "closed" and g.pids == []


def test_a_second_caller_ends_within_its_own_bound_counting_its_wait():
    timeout = 3.0
    with LocalGroup(world_size=2, timeout=timeout) as g:
        first = threading.Thread(target=pytest.raises, args=(RankError, g.run, time.sleep, 30))
        first.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises((RankError, GroupBusyError)):
            g.run(time.sleep, 30)           # waits for the first, then runs out of time
        assert time.monotonic() - t0 < timeout + MARGIN
        first.join(20)


def test_a_rank_stuck_in_c_code_holding_the_gil_is_killed_when_the_ranks_restart():
    """Such a rank cannot run Python to notice its pipe close: the kernel kills it (and
    its process group) when the call fails, and the group runs again."""
    with LocalGroup(world_size=2, timeout=2) as g:
        pids = g.pids
        with pytest.raises(RankError, match="did not finish within 2 s"):
            g.run(lambda: __import__("ctypes").PyDLL(None).sleep(600))
        assert gone(pids, within=5)
        assert g.run(lambda: dist.get_rank()) == [0, 1]


def test_idle_ranks_that_leave_at_once_are_not_waited_for():
    """The polite wait ends as soon as the idle ranks have left: closing a group of 3 took
    0.17 to 0.25 s (8 runs, 2 cores, load average 14 to 17); waiting out the whole
    0.5 s allowance would take twice that."""
    g = LocalGroup(world_size=3, timeout=30)
    g.run(lambda: None)
    pids = g.pids
    t0 = time.monotonic()
    g.close()
    took = time.monotonic() - t0
    assert gone(pids, within=5)
    assert took < 0.45, took


def test_close_waits_at_most_half_a_second_for_an_idle_rank_that_does_not_leave():
    """README ("Faults tried", interrupts): stopping ranks takes milliseconds, "at most
    0.5 s while idle ranks leave". A rank that cannot leave (stopped by SIGSTOP) is
    killed once that half second is up."""
    g = LocalGroup(world_size=2, timeout=30)
    pids = g.pids
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    g.close()
    took = time.monotonic() - t0
    assert gone(pids, within=5)
    assert 0.5 <= took < 0.5 + 0.4, took     # measured 0.52 to 0.55 s (6 runs, load 7 to 12)


def test_a_stuck_rank_gets_no_extra_time_while_another_ranks_large_value_arrives():
    """Only when fn has returned on every rank do arriving chunks extend the call: rank 0's
    120 MB value arriving just before the timeout does not keep run() waiting for rank 1,
    which never returns."""
    def one_big_one_stuck(return_at):
        time.sleep(max(0.0, return_at - time.time()))
        if dist.get_rank() == 1:
            time.sleep(60)
        return torch.zeros(30_000_000)
    with LocalGroup(world_size=2, timeout=3) as g:
        t0 = time.monotonic()
        with pytest.raises(RankError, match="did not finish within 3 s on rank") as info:
            g.run(one_big_one_stuck, time.time() + 2.0)
        took = time.monotonic() - t0
        assert "rank 1: was still running" in str(info.value)
        # waiting a timeout past the last chunk takes 5 s or more (8.1 s in the mutant of
        # _collect_results that did)
        assert took < 3 + 1.5, took


def test_a_pickler_that_hangs_right_before_the_timeout_gets_no_second_timeout():
    class Slow:
        def __reduce__(self):
            time.sleep(60)
            return (int, (0,))

    def late(return_at):
        time.sleep(max(0.0, return_at - time.time()))
        return Slow()
    with LocalGroup(world_size=2, timeout=3) as g:
        t0 = time.monotonic()
        with pytest.raises(RankError, match="still being pickled"):
            g.run(late, time.time() + 2.5)
        # measured 3.02 to 3.23 s (10 runs, 2 cores under load): no second timeout
        assert time.monotonic() - t0 < 3 + 1.5


def test_the_prewarm_flag_starts_one_forkserver_not_a_chain():
    res = run_python("""
        import os, time, psutil
        os.environ["REDUCELAB_PREWARM"] = "1"
        import reducelab
        time.sleep(8)
        me = psutil.Process()
        servers = [p for p in me.children(recursive=True)
                   if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        print(len(servers))
    """, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "1"


def test_kill_trees_leaves_alone_a_process_that_reused_a_ranks_pid():
    """A stand-in for pid reuse: a live process whose start time is not the rank's."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from reducelab import processes
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        time.sleep(0.3)
        fake_rank = SimpleNamespace(pid=other.pid, created=1.0,   # started long ago
                                    process=SimpleNamespace(kill=lambda: None,
                                                            join=lambda t: None))
        processes.kill_trees([fake_rank], wait=0.2)
        time.sleep(0.3)
        assert other.poll() is None, "an unrelated process with the rank's pid was killed"
    finally:
        other.kill()
        other.wait()
