"""The %%ranks cell magic, driven through a real IPython shell (no browser, no kernel)."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython

from reducelab import LocalGroup, RankError


@pytest.fixture(scope="module")
def ip():
    shell = start_ipython()
    shell.run_line_magic("load_ext", "reducelab")
    g = LocalGroup(world_size=3, timeout=5)
    shell.user_ns["g"] = g
    yield shell
    g.close()


def cell(ip, line, code):
    return ip.run_cell_magic("ranks", line, code)


def test_plain_code_runs_on_every_rank_and_shows_values_in_rank_order(ip, capsys):
    cell(ip, "--group g", "x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\nprint('hi', rank)\nx")
    out = capsys.readouterr().out.splitlines()
    assert out == ["[rank 0] hi 0", "[rank 1] hi 1", "[rank 2] hi 2",
                   "[rank 0] Out: tensor([6.])", "[rank 1] Out: tensor([6.])",
                   "[rank 2] Out: tensor([6.])"]


def test_each_rank_keeps_its_namespace_across_cells(ip, capsys):
    cell(ip, "--group g", "mine = rank * 10")
    cell(ip, "--group g", "mine + world_size")
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] Out: 3", "[rank 1] Out: 13", "[rank 2] Out: 23"]


def test_subset_of_ranks(ip, capsys):
    cell(ip, "--group g --ranks 0,2", "print('only', rank)\nrank")
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] only 0", "[rank 2] only 2", "[rank 0] Out: 0", "[rank 2] Out: 2"]


def test_errors_are_rank_errors_with_the_cell_line(ip):
    with pytest.raises(RankError) as info:
        cell(ip, "--group g", "a = 1\nif rank == 1:\n    1 / 0\n")
    assert info.value.ranks == [1]
    tb = info.value.tracebacks[1]
    assert "<%%ranks cell" in tb and "1 / 0" in tb and "ZeroDivisionError" in tb


def test_a_skipped_collective_times_out_like_run(ip):
    with pytest.raises(RankError, match="did not finish within 5 s"):
        cell(ip, "--group g", "if rank != 2:\n    dist.barrier()\n")
    cell(ip, "--group g", "rank")  # the group runs again


def test_world_size_option_resizes(ip, capsys):
    cell(ip, "--group g --world-size 2", "world_size")
    out = capsys.readouterr().out
    assert "[rank 0] Out: 2" in out and "[rank 1] Out: 2" in out
    assert ip.user_ns["g"].world_size == 2
    ip.user_ns["g"].resize(3)


def test_bad_options_are_one_sentence(ip):
    with pytest.raises(UsageError, match="options are --ranks"):
        cell(ip, "--bogus", "1")
    with pytest.raises(UsageError, match="comma-separated ints"):
        cell(ip, "--ranks a,b", "1")
    with pytest.raises(UsageError, match="not in 0..2"):
        cell(ip, "--group g --ranks 5", "1")
    with pytest.raises(UsageError, match="not a LocalGroup"):
        cell(ip, "--group nothing_here", "1")
    with pytest.raises(UsageError, match="from 1 to 64"):
        cell(ip, "--group g --world-size 0", "1")
    assert ip.user_ns["g"].world_size == 3


def test_logging_configured_in_one_cell_reaches_a_later_cell(ip, capsys):
    cell(ip, "--group g", "import logging\n"
                          "logging.basicConfig(level=logging.INFO, format='%(message)s', "
                          "force=True)")
    capsys.readouterr()
    cell(ip, "--group g", "logging.info('loss %.1f on rank %d', 0.5, rank)")
    assert capsys.readouterr().err.splitlines() == [
        f"[rank {r}] loss 0.5 on rank {r}" for r in range(3)]


def test_a_class_defined_in_a_ranks_cell_travels_through_object_collectives(ip, capsys):
    cell(ip, "--group g", "class Note:\n    def __init__(self, r):\n        self.r = r\n"
                          "notes = [None] * world_size\n"
                          "dist.all_gather_object(notes, Note(rank))\n"
                          "[n.r for n in notes]")
    assert capsys.readouterr().out.splitlines() == [
        f"[rank {r}] Out: [0, 1, 2]" for r in range(3)]
