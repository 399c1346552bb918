"""Learner code runs on a LocalGroup as it runs under torchrun (README, "Faults tried").

Each test is code that learners really bring: DataLoader workers, logging, object
collectives with classes defined in a cell, a torchrun-style ``main()`` that joins and
destroys the default process group. A "kernel" here is a fresh Python process whose
``__main__`` plays the notebook: what it defines travels to the ranks by value, exactly
as a cell's definitions do.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import run_python
from reducelab import LocalGroup


def test_a_dataloader_with_worker_processes_runs_on_a_rank(group):
    def load():
        import psutil
        from torch.utils.data import DataLoader, TensorDataset
        data = TensorDataset(torch.arange(12.0) + 100 * dist.get_rank())
        loader = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
        batches = [b[0].tolist() for b in loader]
        workers = len(psutil.Process().children())
        return batches, workers
    out = group.run(load)
    assert out[2][0] == [[200.0 + i for i in range(k, k + 4)] for k in (0, 4, 8)]
    assert [workers for _, workers in out] == [2] * 4


KERNEL_WITH_A_CELL_CLASS = """
    import json, torch, torch.distributed as dist
    from reducelab import LocalGroup

    class Score:                                   # defined in __main__, like a cell
        def __init__(self, rank, value):
            self.rank, self.value = rank, value

    def gather_scores():
        mine = Score(dist.get_rank(), 10.0 * dist.get_rank())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)   # torch pickles Score by reference
        at_dst = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, at_dst, dst=0)
        return [(s.rank, s.value) for s in everyone], at_dst and len(at_dst)

    def save_and_load(score):
        import io
        buf = io.BytesIO()
        torch.save(score, buf)                   # by reference too
        buf.seek(0)
        return torch.load(buf, weights_only=False).value + dist.get_rank()

    with LocalGroup(world_size=3, timeout=30) as g:
        gathered = g.run(gather_scores)
        loaded = g.run(save_and_load, Score(0, 5.0))
        back = g.run(lambda: Score(dist.get_rank(), 1.0))
        print(json.dumps({"gathered": gathered, "loaded": loaded,
                          "same_class": all(isinstance(s, Score) for s in back)}))
"""


def test_object_collectives_and_torch_save_work_with_a_class_defined_in_a_cell():
    res = run_python(KERNEL_WITH_A_CELL_CLASS)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    everyone = [[r, 10.0 * r] for r in range(3)]
    assert out["gathered"] == [[everyone, 3], [everyone, None], [everyone, None]]
    assert out["loaded"] == [5.0, 6.0, 7.0]
    assert out["same_class"] is True        # results come back as the kernel's own class


def test_a_logging_handler_from_an_earlier_call_writes_into_the_current_one(group, capsys):
    def configure():
        import logging
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s",
                            force=True)
    def log():
        import logging
        logging.info("step %d on rank %d", 7, dist.get_rank())
    group.run(configure)
    capsys.readouterr()
    group.run(log)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"[rank {r}] INFO step 7 on rank {r}" for r in range(4)]


def test_a_function_that_closes_or_replaces_stdout_does_not_break_the_rank(group, capsys):
    def close_it():
        import sys
        print("before close")
        sys.stdout.close()
        try:
            print("after close")
        except ValueError as e:
            return str(e)
    def replace_it():
        import sys
        sys.stdout = None                          # print() now writes nowhere
        print("lost")
    assert group.run(close_it) == ["I/O operation on closed file."] * 4
    group.run(replace_it)
    group.run(lambda: print("back", dist.get_rank()))
    out = capsys.readouterr().out
    assert "[rank 0] before close" in out and "after close" not in out and "lost" not in out
    assert "[rank 3] back 3" in out


def test_a_function_may_end_by_destroying_the_default_process_group(group):
    def torchrun_style_end():
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()
    assert group.run(torchrun_style_end) == [4.0] * 4
    assert group.run(lambda: (dist.is_initialized(), dist.get_world_size())) == [(True, 4)] * 4
    t = group.run(lambda: dist.all_reduce(torch.ones(1)) or 1)
    assert t == [1] * 4


def test_a_torchrun_main_that_joins_and_destroys_its_own_group_runs_unchanged(group):
    def main():                          # the body of a train.py written for torchrun
        import os
        dist.init_process_group("gloo")  # env:// as under torchrun
        rank = int(os.environ["RANK"])
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        world = dist.get_world_size()
        dist.destroy_process_group()
        return rank, int(os.environ["LOCAL_RANK"]), world, t.item()
    assert group.run(main) == [(r, r, 4, 6.0) for r in range(4)]
    assert group.run(main) == [(r, r, 4, 6.0) for r in range(4)]   # again, on fresh stores
    assert group.run(lambda: dist.get_rank()) == [0, 1, 2, 3]


def test_no_rank_leaves_a_join_before_every_rank_has_joined(group):
    # Gloo can finish connecting on some ranks before others. Had ranks 1 to 3 gone on
    # (say, to destroy the group at once, as a torchrun main() does with LocalGroup's
    # group), rank 0's join would fail with "Connection closed by peer" (seen on CI).
    # Here rank 0 finishes joining 1 s after the others: each rank's function must
    # still start only once rank 0 has joined.
    def make_rank_0_join_late():
        import time
        if dist.get_rank() == 0:
            real = dist.init_process_group
            def late(*args, **kwargs):
                real(*args, **kwargs)
                time.sleep(1.0)
                dist.init_process_group = real
            dist.init_process_group = late
        dist.destroy_process_group()               # every rank joins again at the next run
    def started():
        import time
        return time.monotonic()
    group.run(make_rank_0_join_late)
    starts = group.run(started)
    assert max(starts) - min(starts) < 0.5, starts
    assert group.run(lambda: dist.get_world_size()) == [4] * 4


def test_destroying_the_group_on_one_rank_only_restarts_the_ranks(group, capsys):
    def one_rank_leaves():
        if dist.get_rank() == 1:
            dist.destroy_process_group()
        return dist.is_initialized()
    assert group.run(one_rank_leaves) == [True, False, True, True]
    assert "destroyed the default process group on rank 1 only" in capsys.readouterr().err
    restarts = group.restarts
    assert group.run(lambda: dist.get_world_size()) == [4] * 4
    assert group.restarts == restarts + 1


def test_closing_after_a_destroyed_group_prints_nothing():
    res = run_python("""
        import torch.distributed as dist
        from reducelab import LocalGroup
        g = LocalGroup(world_size=2, timeout=30)
        g.run(dist.destroy_process_group)
        g.close()
        print("closed")
    """)
    assert res.returncode == 0 and res.stdout.strip() == "closed", res.stderr
    assert "Error" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_script_read_from_standard_input_starts_ranks():
    """multiprocessing would make each rank re-run the kernel's __main__ from a file
    named '<stdin>'; ranks get functions by value and never need it."""
    import subprocess
    code = ("import torch.distributed as dist\nfrom reducelab import LocalGroup\n"
            "with LocalGroup(world_size=2, timeout=30) as g:\n"
            "    print(g.run(lambda: dist.get_rank()))\n")
    res = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(__file__))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[0, 1]"


def test_a_script_whose_top_level_has_side_effects_is_not_rerun_by_the_ranks(tmp_path):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"""
import os, torch.distributed as dist
from reducelab import LocalGroup
with open({str(marker)!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
if __name__ == "__main__":
    with LocalGroup(world_size=2, timeout=30) as g:
        print(g.run(lambda: dist.get_rank()))
""")
    import subprocess
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[0, 1]"
    assert len(marker.read_text().split()) == 1    # only the kernel ran the top level


def test_environment_variables_are_those_torchrun_sets_on_one_node():
    with LocalGroup(world_size=2, timeout=30) as g:
        env = g.run(lambda: {k: os.environ.get(k) for k in
                             ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")})
    assert env == [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": "2"} for r in range(2)]


def test_a_rank_that_kills_its_own_process_group_does_not_touch_the_kernel():
    with LocalGroup(world_size=2, timeout=30) as g:
        def kill_my_group():
            import signal
            if dist.get_rank() == 1:
                os.killpg(0, signal.SIGKILL)
            return dist.get_rank()
        from reducelab import RankError
        with pytest.raises(RankError, match="rank 1 died: killed by SIGKILL"):
            g.run(kill_my_group)
        assert g.run(lambda: dist.get_rank()) == [0, 1]


def test_a_cell_class_inside_a_list_argument_travels_through_object_collectives():
    res = run_python("""
        import json, torch.distributed as dist
        from reducelab import LocalGroup

        class Score:
            def __init__(self, v):
                self.v = v

        def gather_list(items):
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, items)
            return [[s.v for s in lst] for lst in everyone]

        with LocalGroup(world_size=2, timeout=30) as g:   # a fresh group: no earlier call
            print(json.dumps(g.run(gather_list, [Score(1), Score(2)])))
    """)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [[[1, 2], [1, 2]]] * 2


def test_spawned_dataloader_workers_on_a_rank_load_a_cell_defined_dataset():
    """DataLoader workers started with spawn (the default on macOS and Windows) get the
    cell's Dataset class by value, as a torchrun script's workers would import it."""
    res = run_python("""
        import json, torch, torch.distributed as dist
        from torch.utils.data import DataLoader, Dataset
        from reducelab import LocalGroup

        class Squares(Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return torch.tensor([float(i * i)])

        def load():
            loader = DataLoader(Squares(), batch_size=2, num_workers=1,
                                multiprocessing_context="spawn")
            return [b.flatten().tolist() for b in loader]

        with LocalGroup(world_size=1, timeout=120) as g:
            print(json.dumps(g.run(load)))
    """, timeout=240)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [[[0.0, 1.0], [4.0, 9.0]]]


def test_the_kernels_environment_when_the_group_starts_reaches_the_ranks():
    os.environ["REDUCELAB_TEST_SETTING"] = "42"      # set after the forkserver started
    try:
        with LocalGroup(world_size=2, timeout=30) as g:
            assert g.run(lambda: os.environ.get("REDUCELAB_TEST_SETTING")) == ["42", "42"]
    finally:
        del os.environ["REDUCELAB_TEST_SETTING"]


def test_a_traceback_keeps_the_learners_frames_and_the_chained_cause(group):
    from reducelab import RankError

    def my_step():
        from reducelab.checks.all_reduce import local_values
        try:
            local_values(dist.get_rank(), "three")         # fails inside a helper
        except TypeError as e:
            raise ValueError("my step could not build its input") from e
    with pytest.raises(RankError) as info:
        group.run(my_step)
    tb = info.value.tracebacks[0]
    assert "in my_step" in tb and "local_values" in tb
    assert "direct cause" in tb and "could not build its input" in tb
    assert "rank_loop.py" not in tb


def test_a_value_whose_unpickling_exits_is_reported_not_raised(group):
    from reducelab import RankError

    class ExitsWhenLoaded:
        def __reduce__(self):
            import sys
            return (sys.exit, (3,))
    with pytest.raises(RankError, match="could not be unpickled in the kernel: SystemExit"):
        group.run(lambda: ExitsWhenLoaded())
    assert group.run(lambda: dist.get_rank()) == [0, 1, 2, 3]


def test_a_group_with_a_short_timeout_starts_whatever_the_start_method():
    """Importing torch in each rank (spawn) is not charged to the timeout."""
    with LocalGroup(world_size=2, timeout=2) as g:
        assert g.run(lambda: dist.get_world_size()) == [2, 2]
