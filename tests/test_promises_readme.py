"""README promises that no other test held (issue 20's walk of the README; the table of
every promise and its test is in the issue's closing note):

* "Clean ranks": an OpenMP op in the kernel cannot deadlock a rank (the way accelerate's
  ``notebook_launcher`` hangs);
* "Everything a group starts dies with it": each rank leads its own process group;
* the faults table's "then" column: a failure inside a collective restarts the ranks at
  the next ``run()``, one outside a collective keeps them ("group kept"), and so does the
  same refusal on every rank, unless a rank is a collective ahead;
* "On Binder": the CPU build of torch and every other version from ``constraints.txt``;
* "Your copy of the notebooks": ``make lab`` opens the working copy, never ``notebooks/``;
* "a fresh Linux machine with Python 3.11+": the oldest Python the pins install on.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import threading

import pytest
import torch
import torch.distributed as dist

from conftest import run_python
from reducelab import RankError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_an_openmp_op_in_the_kernel_does_not_deadlock_a_rank():
    """The kernel runs a multi-threaded 1000 x 1000 matmul first (OpenMP's threads are
    then up in the kernel); a rank forked from it could deadlock in its own matmul. Ranks
    start from the forkserver instead, so both ranks finish."""
    res = run_python("""
        import json, time, torch
        torch.set_num_threads(2)
        a = torch.ones(1000, 1000)
        (a @ a).sum()                                   # OpenMP threads live in the kernel
        from reducelab import LocalGroup
        def matmul():
            b = torch.ones(1000, 1000)
            return float((b @ b)[0, 0])
        with LocalGroup(world_size=2, timeout=60) as g:
            t0 = time.monotonic()
            print(json.dumps([g.run(matmul), time.monotonic() - t0]))
    """, timeout=180, env={**os.environ, "REDUCELAB_PRELOAD": "torch"})   # a lighter start
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    values, seconds = json.loads(res.stdout.strip().splitlines()[-1])
    assert values == [1000.0, 1000.0]
    assert seconds < 60


def test_each_rank_leads_a_process_group_of_its_own(group):
    pids = group.pids
    assert [os.getpgid(pid) for pid in pids] == pids
    assert os.getpgid(0) not in pids                        # the kernel is in none of them
    assert group.run(lambda: os.getpgid(0) == os.getpid()) == [True] * 4


def _fails_outside(rank_to_fail):
    if dist.get_rank() == rank_to_fail:
        raise ValueError("outside any collective")
    return dist.get_rank()


def _fails_inside():
    t = torch.ones(1)
    if dist.get_rank() == 1:
        dist.all_reduce(t, op=dist.ReduceOp.BAND)       # gloo refuses BAND on float32
    else:
        dist.all_reduce(t)


def test_a_failure_outside_a_collective_keeps_the_ranks_and_one_inside_restarts_them(group):
    group.run(lambda: None)
    pids, restarts = group.pids, group.restarts
    with pytest.raises(RankError, match="rank 2 raised ValueError") as info:
        group.run(_fails_outside, 2)
    assert "fresh ranks" not in str(info.value)
    with pytest.raises(RankError, match="could not be pickled"):
        group.run(lambda: threading.Lock())
    assert group.pids == pids and group.state == "idle"     # group kept: the same processes
    assert group.run(lambda: dist.get_rank()) == [0, 1, 2, 3] and group.restarts == restarts
    group.run(lambda: globals().__setitem__("promise_kept", 7))
    with pytest.raises(RankError) as info:
        group.run(_fails_inside)
    assert "The ranks were stopped; 4 fresh ranks start at the next run()." in str(info.value)
    assert group.state == "stopped" and group.pids == []
    assert group.run(lambda: globals().get("promise_kept")) == [None] * 4   # fresh ranks
    assert group.restarts == restarts + 1 and not set(group.pids) & set(pids)


def _refused_everywhere():
    dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND)   # every rank: refused by gloo


def _refused_one_more_time_on_rank_0():
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="Cannot use ReduceOp.BAND"):
            _refused_everywhere()                       # rank 0 is now a collective ahead
    _refused_everywhere()


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_the_same_refusal_on_every_rank_keeps_the_ranks_unless_one_is_a_collective_ahead(group):
    group.run(lambda: globals().__setitem__("promise_kept", 7))
    pids, restarts = group.pids, group.restarts
    with pytest.raises(RankError, match="ranks 0, 1, 2, 3 raised RuntimeError") as info:
        group.run(_refused_everywhere)
    assert "Cannot use ReduceOp.BAND with non-integral dtype" in str(info.value)   # torch's words
    assert "fresh ranks" not in str(info.value)
    assert group.pids == pids and group.restarts == restarts and group.state == "idle"
    assert group.run(_sum_of_ranks) == [6.0] * 4                  # still in step
    assert group.run(lambda: globals().get("promise_kept")) == [7] * 4
    # The same words on every rank, but rank 0 issued one collective more: kept, its next
    # collective would wait for a message the others send under another tag (it hangs).
    with pytest.raises(RankError, match="ranks 0, 1, 2, 3 raised RuntimeError") as info:
        group.run(_refused_one_more_time_on_rank_0)
    assert "The ranks were stopped; 4 fresh ranks start at the next run()." in str(info.value)
    assert group.run(_sum_of_ranks) == [6.0] * 4 and group.restarts == restarts + 1
    assert not set(group.pids) & set(pids)


def test_binder_installs_the_cpu_torch_and_every_other_version_from_the_constraints():
    lines = [line.strip() for line in (ROOT / "binder" / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split()
                if "==" in line)
    assert "-c ../constraints.txt" in lines
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert f"torch=={pins['torch']}+cpu" in lines
    assert (ROOT / "binder" / "runtime.txt").read_text().startswith("python-3.")


def test_the_python_the_readme_names_is_the_oldest_the_pins_install_on(tmp_path):
    """README: "a fresh Linux machine with Python 3.11+". constraints.txt pins packages
    that need 3.11 (numpy 2.4.6, IPython 9.18.1, SciPy 1.17.1, scikit-learn 1.9.1: pip on
    3.10 finds none of them), so the README, pyproject's requires-python, the conda
    environment, Binder and ``reducelab doctor`` say the same version, and ``make`` with an
    older Python says what it needs and how to name another, before it creates anything."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("Python 3.11+") == 2 and "3.10+" not in readme
    assert 'requires-python = ">=3.11"' in (ROOT / "pyproject.toml").read_text()
    assert "  - python>=3.11\n" in (ROOT / "environment.yml").read_text()
    assert (ROOT / "binder" / "runtime.txt").read_text().strip() == "python-3.11"
    old = tmp_path / "python3.10"                 # a Python 3.10, as far as make can tell
    old.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.10.13" && exit 0\nexit 1\n')
    old.chmod(0o755)
    venv = tmp_path / "venv"
    res = subprocess.run(["make", "lab", f"PYTHON={old}", f"VENV={venv}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "MAKEFLAGS": ""})
    assert res.returncode != 0 and not venv.exists()
    assert "Reduce Lab needs Python 3.11 or newer" in res.stdout
    assert "Python 3.10.13" in res.stdout and "make lab PYTHON=python3.11" in res.stdout


def test_make_lab_opens_the_working_copy_not_the_tracked_notebooks():
    plan = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MAKEFLAGS": ""}).stdout
    line = next(l for l in plan.splitlines() if "reducelab lab" in l)
    assert "reducelab-notebooks" in line and "notebooks/" not in line.replace("reducelab-notebooks", "")
    assert "reducelab-notebooks/" in (ROOT / ".gitignore").read_text().split()


def test_the_reaper_is_told_the_forkserver_and_each_ranks_process_group(group, monkeypatch):
    """README: if the kernel is killed, the reaper kills the ranks' process groups and the
    forkserver, and removes the temporary directories. It can only if it was told them."""
    import psutil

    from reducelab import LocalGroup, processes
    from reducelab.reaper import Reaper
    told = []
    monkeypatch.setattr(Reaper, "tell", staticmethod(lambda *lines: told.extend(lines)))
    forkserver = psutil.Process(group.pids[0]).ppid()
    assert forkserver in processes._forkservers_told
    with LocalGroup(world_size=2, timeout=30) as g:
        pids, tmp = g.pids, g._tmpdir
    assert f"dir {tmp}" in told
    assert all(any(line.startswith(f"pg {pid} ") for line in told) for pid in pids)
    assert all(f"-pg {pid}" in told for pid in pids) and f"-dir {tmp}" in told   # and untold


def test_the_forkserver_starts_once_per_kernel_and_is_charged_to_no_call():
    """README ("One bound per call"): importing torch is never charged to a timeout: the
    first warm() brings the forkserver up (it imports torch), and every later one, a
    group's start included, returns at once."""
    res = run_python("""
        import json, time
        from reducelab import LocalGroup, processes
        ctx = processes.context()
        first, again = processes.warm(ctx), processes.warm(ctx)
        LocalGroup(world_size=2, timeout=30).close()
        print(json.dumps([first, again, processes.warm(ctx)]))
    """, timeout=180, env={**os.environ, "REDUCELAB_PRELOAD": "torch"})
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    first, again, after_a_group = json.loads(res.stdout.strip().splitlines()[-1])
    assert first > 0.3                       # the server imported torch
    assert again < 0.01 and after_a_group < 0.01    # no second start, no process
