"""Tests of notebook 06 (ring all_reduce from send and recv): the notebook's own rank
functions on real gloo ranks against single-process references, the explorer, the
exercise check, and the facts the notebook teaches (bytes, float order, deadlock)."""
from __future__ import annotations

import ast
import inspect
import json
import pathlib
import re
import sys
import time

import cloudpickle

import numpy as np
import pytest
import torch
import torch.distributed as dist

import conftest
from reducelab import LocalGroup, RankError
from reducelab.checks.ring import (HANG_TIMEOUT, check_ring_all_gather, contributors,
                                   exercise_input, naive_bytes_per_rank, ring_bytes_per_rank,
                                   root_bytes)
from reducelab.group import MARGIN
from reducelab.plots.ring import RingStepsPlot, bytes_figure, cell_label, cyclic_run
from reducelab.widgets.ring import RingExplorer, phase_of, run_from_traces

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOK = ROOT / "notebooks" / "06_ring_all_reduce.ipynb"


def notebook_functions() -> dict:
    """The functions defined in the notebook's code cells (only the ``def``s, not the calls),
    so that these tests run the very code a learner reads."""
    nb = json.loads(NOTEBOOK.read_text())
    namespace = {"torch": torch, "dist": dist, "time": time, "__name__": "nb06_cells"}
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if source.lstrip().startswith("%") or source.lstrip().startswith("# %load"):
            continue
        tree = ast.parse(source)
        defs = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        if defs:
            exec(compile(ast.Module(body=defs, type_ignores=[]), f"<{NOTEBOOK.name} cell {index}>",
                         "exec"), namespace)
    return namespace


NB = notebook_functions()
# Send this module's rank functions by value: importing this module on a rank would also
# import pytest, matplotlib and ipywidgets, which takes seconds per rank on a busy machine.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def load_solution():
    return conftest.load_solution("06_ring_all_gather")


pytestmark = pytest.mark.usefixtures("keep_four_ranks")


# --- rank functions used by the tests -----------------------------------------------------
def seeded_input(rank, numel):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))


def ring_on_seeded(ring_all_reduce, numel):
    x = seeded_input(dist.get_rank(), numel)
    sent = ring_all_reduce(x)
    return x, sent


def ring_bytes(ring_all_reduce, numel):
    return ring_all_reduce(torch.ones(numel))


# --- the ring computes the sum ------------------------------------------------------------
@pytest.mark.parametrize("world_size,numel", [(2, 10), (3, 1000), (4, 7), (5, 3), (4, 1)])
def test_ring_all_reduce_is_the_sum_over_ranks(group, world_size, numel):
    group.resize(world_size)
    out = group.run(ring_on_seeded, NB["ring_all_reduce"], numel)
    want = torch.stack([seeded_input(r, numel) for r in range(world_size)]).sum(0)
    for x, _ in out:
        assert x.shape == (numel,)
        assert torch.allclose(x, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(x, out[0][0])          # every rank holds the same bits


def test_ring_matches_real_all_reduce_up_to_rounding(group):
    group.resize(4)
    out = group.run(NB["ring_vs_all_reduce"], 1000)
    ring, expected, _ = out[0]
    assert torch.allclose(ring, expected, rtol=1e-5, atol=1e-6)
    assert (ring - expected).abs().max().item() < 1e-5
    assert not torch.equal(ring, expected)            # "but not bit for bit"


@pytest.mark.parametrize("world_size", [3, 4, 5, 8])
def test_ring_and_all_reduce_differ_by_less_than_the_finfo_bound(group, world_size):
    """The notebook's bound: two summation orders of N float32 numbers differ by at most
    eps x (N - 1) x sum of |inputs|, element by element."""
    group.resize(world_size)
    out = group.run(NB["ring_vs_all_reduce"], 1000)
    ring, expected, _ = out[0]
    bound = torch.finfo(torch.float32).eps * (world_size - 1) * \
        torch.stack([inputs.abs() for _, _, inputs in out]).sum(0)
    assert ((ring - expected).abs() <= bound).all()
    group.resize(4)


def test_the_prose_states_the_agreement_the_cell_prints():
    cell = _cells()[_index_of("def ring_vs_all_reduce")]
    printed = "".join(t for o in cell["outputs"] for t in o.get("text", []))
    # the bound itself is rounding-sized and differs from CPU to CPU: only the verdict is shown
    assert "largest difference ≤ 1e-05; every element within eps x (N - 1) x sum of |inputs|: True" \
        in printed, printed
    assert "every element equal bit for bit: False" in printed, printed   # what the prose says
    after = _src(_cells()[_index_of("def ring_vs_all_reduce") + 1])
    assert "about 1e-7" not in after and "torch.finfo(torch.float32).eps" in after


def test_after_reduce_scatter_rank_r_owns_chunk_r_plus_1(group):
    for n in (3, 4, 5):
        group.resize(n)
        held = group.run(NB["after_reduce_scatter"])
        for r, x in enumerate(held):
            complete = [c for c, v in enumerate(x.tolist()) if len(contributors(v, n)) == n]
            assert complete == [(r + 1) % n]


# --- bytes --------------------------------------------------------------------------------
def test_each_rank_sends_2_n_minus_1_over_n_times_s(group):
    sent = group.run(ring_bytes, NB["ring_all_reduce"], 1_000_000)
    assert sent == [6_000_000] * 4
    assert ring_bytes_per_rank(4, 4_000_000) == 6_000_000


@pytest.mark.parametrize("world_size,numel", [(3, 1000), (5, 12), (8, 100)])
def test_ring_bytes_mean_equals_formula_and_ranks_differ_by_at_most_a_few_elements(
        group, world_size, numel):
    group.resize(world_size)
    sent = group.run(ring_bytes, NB["ring_all_reduce"], numel)
    assert sum(sent) == 2 * (world_size - 1) * numel * 4          # every chunk, once per step
    assert sum(sent) / world_size == pytest.approx(ring_bytes_per_rank(world_size, 4 * numel))
    assert max(sent) - min(sent) <= 2 * (world_size - 1) * 4


def test_naive_and_root_bytes_and_their_sums(group):
    group.resize(5)
    naive = group.run(NB["bytes_of"], NB["naive_all_reduce"], 100)
    root = group.run(NB["bytes_of"], NB["reduce_then_broadcast"], 100)
    ring = group.run(NB["bytes_of"], NB["ring_all_reduce"], 100)
    assert naive == [naive_bytes_per_rank(5, 400)] * 5 == [1600] * 5
    assert root == [root_bytes(5, 400), 400, 400, 400, 400]
    assert sum(root) == sum(ring) == 2 * 4 * 400                   # same total ...
    assert max(root) > 2 * max(ring)                               # ... piled on the root


def test_formulas_refuse_bad_input():
    with pytest.raises(ValueError, match="world_size"):
        ring_bytes_per_rank(0, 10)
    with pytest.raises(ValueError, match="size_bytes"):
        naive_bytes_per_rank(2, -1)
    with pytest.raises(ValueError, match="sum of distinct"):
        contributors(2.5, 4)
    assert contributors(11.0, 4) == [0, 1, 3]
    assert cell_label(15.0, 4) == "all" and cell_label(5.0, 4) == "0+2"


def test_labels_name_runs_of_ranks_around_the_ring():
    bits = lambda ranks: float(sum(2 ** r for r in ranks))  # noqa: E731
    assert cell_label(bits([5, 6, 7, 0, 1]), 8) == "5→1"
    assert cell_label(bits([2, 3, 4, 5]), 8) == "2→5"
    assert cell_label(bits([0, 1, 2]), 8) == "0+1+2"
    assert cell_label(bits([0, 2, 4, 6]), 8) == "4 ranks"        # not a run: no range
    assert cell_label(bits(range(8)), 8) == "all"
    assert cyclic_run([7, 0], 8) == (7, 0) and cyclic_run([0, 2], 8) is None


# --- float order ----------------------------------------------------------------------------
def test_ring_adds_chunk_c_in_ring_order_from_rank_c(group):
    values = [1e8, 1.0, -1e8, 1.0]
    x, _ = group.run(NB["order_matters"])[0]
    want = []
    for c in range(4):                       # chunk c: rank c's value, then c+1, c+2, c+3
        acc = torch.tensor(values[c], dtype=torch.float32)
        for k in range(1, 4):
            acc = torch.tensor(values[(c + k) % 4], dtype=torch.float32) + acc
        want.append(acc.item())
    assert x.tolist() == want == [1.0, 0.0, 1.0, 0.0]     # not the exact sum, 2


# --- deadlock -------------------------------------------------------------------------------
def test_a_ring_of_blocking_sends_hangs_in_send():
    with LocalGroup(world_size=3, timeout=2) as short:
        with pytest.raises(RankError) as info:
            short.run(NB["blocking_ring"])
    assert {r.state for r in info.value.reports} == {"stuck"}
    assert all("waiting in send" in r.summary for r in info.value.reports)


def test_gloo_send_returns_only_after_the_matching_recv(group):
    (isend_back, wait_back, send_back), (first_recv, second_recv) = \
        group.run(NB["when_does_send_return"])[:2]
    assert isend_back < first_recv <= wait_back      # isend returns at once; wait does not
    assert send_back >= second_recv                  # send waited for rank 1's recv


# --- the explorer -----------------------------------------------------------------------------
def simulate_ring(n):
    """Single-process reference: the sets of ranks in each chunk, after each step."""
    held = [[{r} for _ in range(n)] for r in range(n)]
    states = [[[sum(2 ** q for q in s) for s in row] for row in held]]
    for step in range(2 * (n - 1)):
        new = [[set(s) for s in row] for row in held]
        for r in range(n):
            left = (r - 1) % n
            if step < n - 1:
                c = (r - step - 1) % n
                new[r][c] = held[r][c] | held[left][c]
            else:
                c = (r - (step - (n - 1))) % n
                new[r][c] = set(held[left][c])
        held = new
        states.append([[sum(2 ** q for q in s) for s in row] for row in held])
    return np.array(states, dtype=float)


def test_explorer_steps_match_a_single_process_simulation(group):
    e = RingExplorer(group, NB["ring_demo"], step=0)
    assert np.array_equal(e.result.run.values, simulate_ring(4))
    first = e.image.value
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Step 0 of 6 (input)" in e.message.value
    e.controls["step"].value = 3
    assert e.result.step == 3
    assert list(e.result.run.sent[3]) == [(r - 2) % 4 for r in range(4)]
    assert list(e.result.run.received[3]) == [(r - 3) % 4 for r in range(4)]
    assert "rank 0: [1], rank 1: [2], rank 2: [3], rank 3: [0]" in e.message.value
    assert e.image.value != first
    e.controls["step"].value = 6
    assert "rank 3: [0, 1, 2, 3]" in e.text()


def test_explorer_world_size_resizes_and_clamps_step(group):
    e = RingExplorer(group, NB["ring_demo"], step=6)
    e.controls["world_size"].value = 3
    assert group.world_size == 3
    assert e.controls["step"].max == 4 and e.controls["step"].value == 4
    assert e.result.step == 4
    assert np.array_equal(e.result.run.values, simulate_ring(3))
    assert e.text().startswith("RingExplorer(world_size=3, step=4)")
    e.controls["world_size"].value = 8
    assert e.controls["step"].max == 14
    assert np.array_equal(e.result.run.values, simulate_ring(8))


def test_explorer_refuses_bad_arguments(group):
    with pytest.raises(ValueError, match="world_size"):
        RingExplorer(group, NB["ring_demo"], world_size=9)
    with pytest.raises(ValueError, match="step"):
        RingExplorer(group, NB["ring_demo"], step=7)
    with pytest.raises(TypeError):
        RingExplorer(group, "ring_demo")
    with pytest.raises(ValueError, match="record"):
        run_from_traces([[(None, None, torch.ones(2))]] * 2)
    with pytest.raises(ValueError, match="world_size"):
        RingStepsPlot().draw(np.ones((9, 9)))
    assert [phase_of(k, 4) for k in range(7)] == ["input"] + ["reduce-scatter"] * 3 + ["all-gather"] * 3


# --- the figures ------------------------------------------------------------------------------
def test_ring_figure_fits_the_notebook_and_every_label_fits_its_cell():
    plot = RingStepsPlot()
    for n in (2, 4, 8):
        states = simulate_ring(n)
        for k in (0, n - 1, 2 * (n - 1)):
            sent = None if k == 0 else [0] * n
            plot.draw(states[k], sent, sent, f"step {k}")
            assert plot.fig.get_figwidth() <= 9.6 and plot.fig.get_figheight() <= 4.5
            renderer = plot.fig.canvas.get_renderer()
            cell_px = plot._ax.get_window_extent().width / n
            for row in plot._texts:
                for t in row:
                    assert t.get_fontsize() >= 10
                    assert t.get_window_extent(renderer).width < 0.95 * cell_px, t.get_text()


def test_bytes_figure_is_a_png():
    rows = [dict(world_size=n, size_bytes=400, ring=ring_bytes_per_rank(n, 400),
                 naive=naive_bytes_per_rank(n, 400), root=root_bytes(n, 400)) for n in (2, 4)]
    assert bytes_figure(rows)[:4] == b"\x89PNG"


# --- the exercise check -------------------------------------------------------------------------
INDEX_FORMULA = re.compile(
    r"%\s*[A-Za-z(]"                                              # "... % n", "% N"
    r"|\bmod\b"
    r"|\b(?:r|s|i|k|n|rank|step)\s*[-+]\s*(?:r|s|i|k|n|1|rank|step)\b")   # "r - s", "r - 1"
"""An index formula in a check message: "which slice at step s" is the exercise's solution,
so a message may name concrete slices, ranks and steps, never the rule."""


def assert_no_formula(message: str) -> None:
    found = INDEX_FORMULA.search(message)
    assert not found, f"the check's message gives an index formula ({found.group()!r}): {message}"


def test_the_formula_guard_catches_the_formulas_of_the_solution():
    """The guard would have caught the old messages, and catches the solution's own lines."""
    for old in ("At step s rank r sends the slice it received at step s - 1 (its own at step "
                "0), that is slice (r - s) % n, and receives slice (r - s - 1) % n from rank "
                "r - 1.", "receive it into slice (r - s - 1) % n", "slice (r - s) % n"):
        assert INDEX_FORMULA.search(old), old
    solution = (ROOT / "notebooks" / "solutions" / "06_ring_all_gather.py").read_text()
    assert INDEX_FORMULA.search(solution.split("def ring_all_gather")[1])
    assert not INDEX_FORMULA.search("rank 2 sent slice 0 at step 1; with world_size=3 it "
                                    "takes 2 ring steps")


def test_solution_passes(group):
    verdict = check_ring_all_gather(load_solution().ring_all_gather)
    assert verdict, verdict.message
    assert_no_formula(verdict.message)
    assert group.world_size == 4 and group.state != "closed"    # the learner's group untouched


def stub(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(n * x.numel(), dtype=x.dtype)
    out.tensor_split(n)[rank].copy_(x)
    return out


def test_the_notebook_stub_fails_and_says_what_is_missing():
    verdict = check_ring_all_gather(stub)
    assert not verdict
    assert "slice 1 is still zero" in verdict.message
    assert "Rank 0 made 0 ring steps" in verdict.message
    assert "Which slice does a rank pass on at each step" in verdict.message
    assert_no_formula(verdict.message)


def test_the_check_message_stored_in_the_notebook_gives_no_formula():
    check = _cells()[_index_of("check_ring_all_gather(ring_all_gather)")]
    shown = "".join(t for o in check["outputs"] for t in o.get("data", {}).get("text/plain", []))
    assert "made 0 ring steps" in shown
    assert_no_formula(shown)


def make_ring(send_recv, send_index, recv_index, own_buffer=False, copy_x=True):
    """A ring all_gather whose step s sends slice send_index(rank, step, n) and receives into
    slice recv_index(rank, step, n) (straight into it, or into a buffer of its own that is
    then copied there)."""
    def ring(x):
        rank, n = dist.get_rank(), dist.get_world_size()
        out = torch.zeros(n * x.numel())
        slices = out.tensor_split(n)
        if copy_x:
            slices[rank].copy_(x)
        for step in range(n - 1):
            target = slices[recv_index(rank, step, n)]
            if own_buffer:
                incoming = torch.empty_like(x)
                send_recv(slices[send_index(rank, step, n)], incoming)
                target.copy_(incoming)
            else:
                send_recv(slices[send_index(rank, step, n)], target)
        return out
    return ring


def right_send(rank, step, n):
    return (rank - step) % n


def right_recv(rank, step, n):
    return (rank - step - 1) % n


def test_a_wrong_send_index_is_named_as_the_send():
    wrong = make_ring(NB["send_recv"], lambda r, s, n: (r + s) % n, right_recv)
    verdict = check_ring_all_gather(wrong, world_sizes=(3,))
    assert not verdict
    assert "send at step 1 is off" in verdict.message
    assert re.search(r"at step 1 it sends slice \d", verdict.message)   # this rank, this step
    assert "receive at step" not in verdict.message and "sends are right" not in verdict.message
    assert_no_formula(verdict.message)


def test_a_wrong_first_send_is_named_without_a_formula():
    wrong = make_ring(NB["send_recv"], lambda r, s, n: (r + 1) % n, right_recv)
    verdict = check_ring_all_gather(wrong, world_sizes=(3,))
    assert not verdict
    assert "send at step 0 is off" in verdict.message
    assert "the only slice a rank holds is its own" in verdict.message
    assert_no_formula(verdict.message)


def test_a_wrong_receive_slice_is_named_as_the_receive():
    wrong = make_ring(NB["send_recv"], right_send, lambda r, s, n: (r + s + 1) % n)
    verdict = check_ring_all_gather(wrong, world_sizes=(3,))
    assert not verdict
    assert "sends are right" in verdict.message
    assert "receive at step 0 is off" in verdict.message
    assert re.search(r"belongs in slice \d", verdict.message)
    assert_no_formula(verdict.message)


def test_a_wrong_copy_from_a_buffer_of_its_own_is_named():
    wrong = make_ring(NB["send_recv"], right_send, lambda r, s, n: (r + s + 1) % n,
                      own_buffer=True)
    verdict = check_ring_all_gather(wrong, world_sizes=(3,))
    assert not verdict
    assert "sends are right" in verdict.message and "did not land there" in verdict.message
    assert_no_formula(verdict.message)


def test_forgetting_the_own_slice_is_named():
    wrong = make_ring(NB["send_recv"], right_send, right_recv, copy_x=False)
    verdict = check_ring_all_gather(wrong, world_sizes=(2,))
    assert not verdict
    assert "copy x into slice" in verdict.message
    assert_no_formula(verdict.message)


def test_sending_too_many_bytes_is_caught():
    send_recv = NB["send_recv"]

    def whole_output(x):     # right answer, but sends the whole output at each step
        rank, n = dist.get_rank(), dist.get_world_size()
        out = torch.zeros(n * x.numel())
        out.tensor_split(n)[rank].copy_(x)
        for _ in range(n - 1):
            incoming = torch.empty_like(out)
            send_recv(out, incoming)
            out = torch.maximum(out, incoming)   # inputs are positive, zeros are "missing"
        return out

    verdict = check_ring_all_gather(whole_output, world_sizes=(3,))
    assert not verdict
    assert "bytes" in verdict.message and str(2 * 3 * 4) in verdict.message
    assert_no_formula(verdict.message)


def test_using_the_real_collective_is_refused():
    def cheat(x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        return torch.cat(parts)

    verdict = check_ring_all_gather(cheat, world_sizes=(2,))
    assert not verdict
    assert "dist.all_gather" in verdict.message


def blocking(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(n * x.numel())
    dist.send(x, dst=(rank + 1) % n)
    dist.recv(out[: x.numel()], src=(rank - 1) % n)
    return out


def receiving_first(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(n * x.numel())
    dist.recv(out[: x.numel()], src=(rank - 1) % n)
    dist.send(x, dst=(rank + 1) % n)
    return out


@pytest.mark.parametrize("fn, expected", [(blocking, "waiting in a blocking dist.send"),
                                          (receiving_first, "waiting in dist.recv")])
def test_a_ring_that_hangs_is_stopped_within_seconds_and_explained(fn, expected):
    start = time.monotonic()
    verdict = check_ring_all_gather(fn)
    elapsed = time.monotonic() - start
    assert not verdict
    assert expected in verdict.message
    assert f"after {HANG_TIMEOUT:g} s" in verdict.message
    assert_no_formula(verdict.message)
    # bounded by the check's own group (its timeout + LocalGroup's margin), not 30 s
    assert elapsed < HANG_TIMEOUT + MARGIN + 5, elapsed


def test_a_raising_function_is_reported_with_the_ranks_error():
    def broken(x):
        raise ValueError("my bug")

    verdict = check_ring_all_gather(broken, world_sizes=(2,))
    assert not verdict and "my bug" in verdict.message


def test_exercise_inputs_are_distinct_per_rank():
    assert exercise_input(2).tolist() == [21.0, 22.0, 23.0]


# --- the ring's direction ---------------------------------------------------------------------
class Mirrored:
    """torch.distributed with the ranks numbered the other way round the ring: real rank r
    is called (-r) % N, so the notebook's "send to rank + 1" goes to real rank r - 1.
    Records the real rank of every send."""

    def __init__(self):
        self.sent_to = []

    def __getattr__(self, name):
        return getattr(dist, name)

    def get_rank(self):
        return -dist.get_rank() % dist.get_world_size()

    def isend(self, tensor, dst):
        real = -dst % dist.get_world_size()
        self.sent_to.append(real)
        return dist.isend(tensor, dst=real)

    def recv(self, tensor, src):
        return dist.recv(tensor, src=-src % dist.get_world_size())


def mirrored_ring(numel):
    namespace = notebook_functions()
    namespace["dist"] = mirrored = Mirrored()
    x = seeded_input(dist.get_rank(), numel)
    namespace["ring_all_reduce"](x)
    return x, sorted(set(mirrored.sent_to))


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_ring_the_other_way_round_gives_the_same_sums(group, world_size):
    """Cell 9: the direction does not matter (gloo's reduce, notebook 02, sends to r - 1)."""
    group.resize(world_size)
    out = group.run(mirrored_ring, 10)
    want = torch.stack([seeded_input(r, 10) for r in range(world_size)]).sum(0)
    for rank, (x, sent_to) in enumerate(out):
        assert sent_to == [(rank - 1) % world_size]               # leftwards only
        assert torch.allclose(x, want, rtol=1e-5, atol=1e-6)
    group.resize(4)


# --- the notebook, where its rules are particular to it ----------------------------------------
def _cells():
    return json.loads(NOTEBOOK.read_text())["cells"]


def _src(cell) -> str:
    return "".join(cell["source"])


def _index_of(text: str) -> int:
    return next(i for i, c in enumerate(_cells()) if text in _src(c))


def test_question_2_comes_before_the_byte_formula():
    """Question 2 asks for a prediction, not for the formula's value: the formula appears
    only in its why and after it, and not among the objectives."""
    cells = _cells()
    question = _index_of("**Question 2.**")
    check = _index_of("reveal(answer_2")
    formula = re.compile(r"2 \(N - 1\) / N")
    first = next(i for i, c in enumerate(cells) if formula.search(_src(c)))
    assert first == check, (first, check)                  # the why holds it first ...
    assert any(formula.search(_src(c)) for c in cells[check + 1:] if c["cell_type"] == "markdown")
    assert not re.search(r"\(N - 1\) × S|S bytes", _src(cells[0]))   # ... not the objectives
    assert question < check


def test_the_text_says_why_the_check_takes_no_group():
    params = list(inspect.signature(check_ring_all_gather).parameters)
    assert params[0] == "fn"
    check = _index_of("check_ring_all_gather(ring_all_gather)")
    before = "\n".join(_src(c) for c in _cells()[:check] if c["cell_type"] == "markdown")
    assert "takes no `group`" in before and "3 seconds" in before


def test_the_text_says_the_ring_direction_is_a_choice():
    text = _src(_cells()[_index_of("In reduce-scatter step `s`")])
    assert "direction does not matter" in text and "notebook 02" in text
