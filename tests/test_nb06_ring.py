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
from reducelab.checks.answers import WHY
from reducelab.checks.ring import (EXERCISE_NUMEL, EXERCISE_PIECES, HANG_TIMEOUT,
                                   check_chain_broadcast, contributors, exercise_input,
                                   naive_bytes_per_rank, ring_bytes_per_rank, root_bytes)
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
    return conftest.load_solution("06_chain_broadcast")


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


def test_question_2_asks_which_rank_sends_most_of_10_elements_and_the_why_gives_the_even_case(group):
    """Question 2. Review 5 (06-2) found "which rank sends most" of 10 elements needed tracing
    all 6 steps and asked 12 elements (72 bytes each); review 6 (06-3) found that plain
    arithmetic and asked for the uneven case again. It is asked now, with the explorer of
    step 4 (which shows every send) as the way to trace it: rank 1 sends the most (64 bytes;
    3, 3, 2, 2 elements a chunk). The even case, 72 bytes on every rank, is in the why and
    run in the evidence."""
    assert [c.numel() for c in torch.ones(10).tensor_split(4)] == [3, 3, 2, 2]
    group.resize(4)
    sent = group.run(ring_bytes, NB["ring_all_reduce"], 10)
    assert sent == [60, 64, 60, 56] and max(range(4), key=sent.__getitem__) == 1
    assert group.run(ring_bytes, NB["ring_all_reduce"], 12) == [72] * 4
    assert 72 == ring_bytes_per_rank(4, 48)
    cells = _cells()
    stored = conftest.stored_text(cells[_index_of("reveal(answer_2")])
    assert "The real run gives 1." in stored and "10 elements: [60, 64, 60, 56]" in stored
    assert "(chunks of 3 each): [72, 72, 72, 72]" in stored
    assert WHY["06"][2].startswith("Rank r never sends chunk (r + 1) % N")
    assert "so it sends the most: 2 x 10 - 2 - 2 = 16 elements, 64 bytes" in WHY["06"][2]
    assert "72 bytes, 1.5 times the tensor" in WHY["06"][2]
    question = _src(cells[_index_of("**Question 2.**")])
    assert "**10** elements" in question and "Which rank sends the most bytes" in question
    answer = _index_of("answer_2 = None")
    above = "\n".join(_src(c) + json.dumps(c.get("outputs", [])) for c in cells[:answer])
    for spoiler in ("64 bytes", "[60, 64", "rank 1 sends", "(r + 2) % N", "72 bytes"):
        assert spoiler not in above, spoiler


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
    x, _ = group.run(NB["order_matters"])[0]
    want, _ = group_free_ring_result()
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
    r"|\b(?:r|s|i|k|n|rank|step|src|place)\s*[-+]\s*(?:r|s|i|k|n|1|rank|step|src)\b")
"""An index formula in a check message: which rank a rank sends to and whether it is the
last of the chain is the exercise's solution, so a message names concrete ranks and
pieces, never the rule."""


def assert_no_formula(message: str) -> None:
    found = INDEX_FORMULA.search(message)
    assert not found, f"the check's message gives an index formula ({found.group()!r}): {message}"


def test_the_formula_guard_catches_the_formulas_of_the_solution():
    solution = (ROOT / "notebooks" / "solutions" / "06_chain_broadcast.py").read_text()
    assert INDEX_FORMULA.search(solution.split("def chain_broadcast")[1])
    for formula in ("place = (rank - src) % n", "send to rank + 1", "src=(rank - 1) % n"):
        assert INDEX_FORMULA.search(formula), formula
    assert not INDEX_FORMULA.search("rank 2 sent to rank 0; in the chain a rank sends only "
                                    "to its right neighbour, rank 3. (N - 1) x S")


def test_solution_passes(group):
    verdict = check_chain_broadcast(load_solution().chain_broadcast)
    assert verdict, verdict.message
    assert_no_formula(verdict.message)
    assert "each sent S = 48 bytes" in verdict.message
    assert "every rank but src received src's x from its left neighbour" in verdict.message
    assert group.world_size == 4 and group.state != "closed"    # the learner's group untouched


def chain(x, src, pieces, *, order="pipeline", start_at_zero=False, close=False,
          buffer=False, zeros_first=False, nonblocking=False):
    """A chain broadcast with one mistake switched on (none: a right answer)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    head = 0 if start_at_zero else src
    place = (rank - head) % n
    parts = [x] if order == "one piece" else list(x.tensor_split(pieces))
    targets = [p.clone() for p in parts] if buffer else parts

    def receive(p):
        if place > 0:
            (dist.irecv(p, src=(rank - 1) % n).wait() if nonblocking
             else dist.recv(p, src=(rank - 1) % n))

    def send(p):
        if place < n - 1 or close:
            (dist.isend(p, dst=(rank + 1) % n).wait() if nonblocking
             else dist.send(p, dst=(rank + 1) % n))

    if order == "store and forward":
        for p in targets:
            receive(p)
        for p in targets:
            send(p)
        return
    for p in targets:
        if zeros_first and place not in (0, n - 1):
            send(p)
            receive(p)
        else:
            receive(p)
            send(p)


def right(x, src, pieces):
    chain(x, src, pieces)


def right_nonblocking(x, src, pieces):
    chain(x, src, pieces, nonblocking=True)


def right_all_irecvs_first(x, src, pieces):     # posts every receive, then waits piece by piece
    rank, n = dist.get_rank(), dist.get_world_size()
    place = (rank - src) % n
    parts = x.tensor_split(pieces)
    works = [dist.irecv(p, src=(rank - 1) % n) for p in parts] if place else []
    for j, p in enumerate(parts):
        if works:
            works[j].wait()
        if place < n - 1:
            dist.send(p, dst=(rank + 1) % n)


@pytest.mark.parametrize("fn", [right, right_nonblocking, right_all_irecvs_first])
def test_other_right_answers_pass(fn):
    verdict = check_chain_broadcast(fn, world_sizes=(3,))
    assert verdict, verdict.message


def notebook_stub(x, src, pieces):
    rank, n = dist.get_rank(), dist.get_world_size()


def star(x, src, pieces):                       # the root sends to every rank itself
    rank, n = dist.get_rank(), dist.get_world_size()
    for p in x.tensor_split(pieces):
        if rank == src:
            for r in range(n):
                if r != src:
                    dist.send(p, dst=r)
        else:
            dist.recv(p, src=src)


def starts_at_zero(x, src, pieces):
    chain(x, src, pieces, start_at_zero=True)


def store_and_forward(x, src, pieces):
    chain(x, src, pieces, order="store and forward")


def one_piece(x, src, pieces):
    chain(x, src, pieces, order="one piece")


def own_buffers(x, src, pieces):
    chain(x, src, pieces, buffer=True)


def forwards_before_receiving(x, src, pieces):
    chain(x, src, pieces, zeros_first=True)


def never_waits(x, src, pieces):                 # irecv, and its request never waited on
    rank, n = dist.get_rank(), dist.get_world_size()
    place = (rank - src) % n
    for p in x.tensor_split(pieces):
        if place > 0:
            dist.irecv(p, src=(rank - 1) % n)
        if place < n - 1:
            dist.send(p, dst=(rank + 1) % n)


def closes_the_ring(x, src, pieces):             # the last rank sends back to src: a hang
    chain(x, src, pieces, close=True)


def with_broadcast(x, src, pieces):
    dist.broadcast(x, src=src)


def raises(x, src, pieces):
    raise ValueError("my bug")


MISTAKES = [
    (notebook_stub, (2,), "]. Rank 0 (src) never sent, so rank 1"),
    (notebook_stub, (2,), "zeros in every piece, as before the call"),
    (star, (3,), "rank 0 (src) sent to ranks 1, 2 itself: that is the root of reduce-then-broadcast"),
    (starts_at_zero, (2,), "Rank 1 (src) called recv: src holds the data from the start"),
    (starts_at_zero, (2,), "rank 1's x afterwards: src's own data was overwritten: zeros in every piece;"),
    (store_and_forward, (3,), "rank 1 received all 4 pieces before it sent the first: store and forward"),
    (one_piece, (2,), "rank 0 sent 1 tensor (the whole of x); expected the 4 pieces of x.tensor_split(4)"),
    (one_piece, (2,), "With one piece, no rank can pass x on before the whole of it has arrived"),
    (own_buffers, (2,), "received 4 times but its x still holds zeros: it received into a tensor of its own"),
    (never_waits, (2,), "with irecv, but its x does not hold the data yet: irecv returns before"),
    (forwards_before_receiving, (3,), "Rank 1 sent a tensor of zeros: it passed a piece on before"),
    (with_broadcast, (2,), "your function called dist.broadcast"),
    (raises, (2,), "ValueError: my bug"),
]


@pytest.mark.parametrize("fn, sizes, says", MISTAKES, ids=[f"{fn.__name__}-{i}" for i, (fn, _, _) in enumerate(MISTAKES)])
def test_each_likely_mistake_is_named(fn, sizes, says):
    verdict = check_chain_broadcast(fn, world_sizes=sizes)
    assert not verdict
    assert says in verdict.message, verdict.message
    assert_no_formula(verdict.message)


def test_the_one_piece_message_says_nothing_false_of_the_last_rank():
    """Teach-c review: at world size 2 the one-piece message said "rank 1 can pass nothing
    on until the whole of x has arrived", of rank 1, the last rank of the chain, which passes
    nothing on at all; and it named what rank 0 sent "(all)", the check's own label."""
    for sizes in ((2,), (3,)):
        message = check_chain_broadcast(one_piece, world_sizes=sizes).message
        assert "can pass nothing on" not in message and "(all)" not in message, message
        assert "(the whole of x)" in message, message


def test_a_chain_that_closes_into_a_ring_hangs_and_is_explained_within_seconds():
    start = time.monotonic()
    verdict = check_chain_broadcast(closes_the_ring, world_sizes=(3,))
    elapsed = time.monotonic() - start
    assert not verdict
    assert f"after {HANG_TIMEOUT:g} s" in verdict.message
    assert "Rank 2 is the last rank of the chain, and it was waiting in send" in verdict.message
    assert re.search(r"rank 2: waiting in send, called from \w+ line \d+", verdict.message)
    assert "wrapper" not in verdict.message                      # the learner's line, not ours
    assert_no_formula(verdict.message)
    # bounded by the check's own group (its timeout + LocalGroup's margin), not 30 s
    assert elapsed < HANG_TIMEOUT + MARGIN + 10, elapsed


def test_a_ring_of_blocking_receives_is_explained():
    def everyone_receives(x, src, pieces):
        rank, n = dist.get_rank(), dist.get_world_size()
        dist.recv(x, src=(rank - 1) % n)

    verdict = check_chain_broadcast(everyone_receives, world_sizes=(2,))
    assert not verdict and "Every waiting rank was in recv" in verdict.message


def test_no_check_message_prints_the_solution():
    code = [line.split("#")[0].strip() for line in
            (ROOT / "notebooks" / "solutions" / "06_chain_broadcast.py").read_text().splitlines()
            if len(line.strip()) > 12 and not line.strip().startswith(("#", "def ", "import"))]
    for fn, sizes, _ in MISTAKES:
        message = check_chain_broadcast(fn, world_sizes=sizes).message
        assert not [line for line in code if line in message], fn.__name__


def test_bad_arguments_are_refused_with_the_valid_choices():
    assert not check_chain_broadcast("chain_broadcast")
    with pytest.raises(ValueError, match="2 or more ranks"):
        check_chain_broadcast(right, world_sizes=(1,))
    with pytest.raises(ValueError, match="pieces <= numel"):
        check_chain_broadcast(right, numel=3, pieces=4)
    with pytest.raises(ValueError, match="src >= 0"):
        exercise_input(-1)


def test_exercise_input_says_which_elements_a_piece_holds():
    assert exercise_input(0)[:3].tolist() == [101.0, 102.0, 103.0]
    assert exercise_input(3).tolist()[-1] == 400.0 + EXERCISE_NUMEL
    assert [p.numel() for p in exercise_input(0).tensor_split(EXERCISE_PIECES)] == [3, 3, 3, 3]


def test_the_chain_sends_s_per_rank_where_the_root_sends_n_minus_1_times_s(group):
    """The fact the exercise rests on, counted on real ranks: in the solution's chain
    every rank but the last sends S, the last nothing; the star root sends (N - 1) S."""
    solution = load_solution().chain_broadcast

    def bytes_sent(fn, src):
        sent = []
        original = dist.send

        def counting(tensor, *args, **kwargs):
            sent.append(tensor.numel() * tensor.element_size())
            return original(tensor, *args, **kwargs)

        dist.send = counting
        try:
            x = exercise_input(src) if dist.get_rank() == src else torch.zeros(EXERCISE_NUMEL)
            fn(x, src, EXERCISE_PIECES)
        finally:
            dist.send = original
        return sum(sent), x

    group.resize(4)
    size = EXERCISE_NUMEL * 4
    for src in (0, 2):
        chained = group.run(bytes_sent, solution, src)
        assert [b for b, _ in chained] == [0 if r == (src - 1) % 4 else size for r in range(4)]
        assert all(torch.equal(x, exercise_input(src)) for _, x in chained)
        starred = group.run(bytes_sent, star, src)
        assert starred[src][0] == 3 * size == root_bytes(4, size)
    group.resize(4)


# --- the exercise's pipeline, timed (an expert review: with blocking send and recv, src's send
# of piece 1 waited until its neighbour had forwarded piece 0; cell 31 now says so) ---------------
SLOW = 0.6     # seconds the last rank of the chain waits before it posts each receive


def timed_chain(fn):
    """``fn(x, 0, 4)`` on 3 ranks; rank 2, the last of the chain, posts every receive SLOW s
    late. Returns, by rank, the time each of its sends returned, and its x."""
    rank = dist.get_rank()
    returned, send, recv, irecv = [], dist.send, dist.recv, dist.irecv

    def timed_send(*args, **kwargs):
        send(*args, **kwargs)
        returned.append(time.time())

    def late(original):
        def wrapper(*args, **kwargs):
            time.sleep(SLOW)
            return original(*args, **kwargs)
        return wrapper

    x = exercise_input(0) if rank == 0 else torch.zeros(EXERCISE_NUMEL)
    dist.barrier()
    dist.send = timed_send
    if rank == 2:
        dist.recv, dist.irecv = late(recv), late(irecv)
    try:
        fn(x, 0, EXERCISE_PIECES)
    finally:
        dist.send, dist.recv, dist.irecv = send, recv, irecv
    return returned, x


def test_the_solution_lets_src_send_piece_1_while_its_neighbour_forwards_piece_0(group):
    group.resize(3)
    out = group.run(timed_chain, load_solution().chain_broadcast)
    assert all(torch.equal(x, exercise_input(0)) for _, x in out)
    src_sent, middle_sent = out[0][0], out[1][0]
    # rank 1's send of piece 0 waits about SLOW s for rank 2; src's send of piece 1 does not
    assert middle_sent[0] - src_sent[1] > SLOW / 2, (src_sent, middle_sent)
    group.resize(4)


def test_a_chain_of_blocking_recv_then_send_makes_neighbouring_links_take_turns(group):
    group.resize(3)
    out = group.run(timed_chain, right)
    assert all(torch.equal(x, exercise_input(0)) for _, x in out)
    src_sent, middle_sent = out[0][0], out[1][0]
    assert src_sent[1] >= middle_sent[0] - 0.05, (src_sent, middle_sent)
    assert verdict_passes(right)          # it is still a right answer to the check
    group.resize(4)


def verdict_passes(fn):
    return bool(check_chain_broadcast(fn, world_sizes=(3,)))


def chain_finish_time(n: int, pieces: int, pipelined: bool) -> int:
    """Piece-times until the last of n ranks on a chain holds all pieces: a link carries one
    piece per piece-time; a rank forwards a piece once it has it (pipelined), or only once it
    has them all (store and forward); with pipelining every link may carry at once."""
    have = [[0] * pieces] + [[None] * pieces for _ in range(n - 1)]   # time each piece arrived
    for r in range(1, n):
        free = 0                                                      # the link r-1 -> r
        ready_all = max(have[r - 1])
        for j in range(pieces):
            start = max(free, have[r - 1][j] if pipelined else ready_all)
            have[r][j] = free = start + 1
    return max(have[-1])


def test_the_pieces_buy_time_not_bytes():
    """Review 6 (06-1, HIGH): the text said what the chain saves (bytes) but not what the
    pieces buy (time). The exercise and the summary now say: each rank still sends S; the whole
    tensor forwarded once it has all arrived takes (N - 1)·P piece-times, pieces passed on as they
    arrive P + N - 2, where every link can carry one while its neighbours carry theirs (the
    condition the timing tests below show the solution's irecv meets and blocking recv-then-send
    does not). The model is re-derived here."""
    for n in range(2, 9):
        for p in range(1, 9):
            assert chain_finish_time(n, p, pipelined=False) == (n - 1) * p
            assert chain_finish_time(n, p, pipelined=True) == p + n - 2
    exercise = _src(_cells()[_index_of("## Exercise: a broadcast that spreads its bytes")])
    summary = _src(_cells()[_index_of("## Summary")])
    for text in (exercise, summary):
        assert "The pieces buy time, not bytes" in text or "Its pieces buy time, not bytes" in text
        assert "`(N - 1) · P`" in text and "`P + N - 2`" in text
        assert "can carry" in text and "while its neighbours carry theirs" in text   # the condition
    assert "in pieces that each rank passes on as they arrive, it costs no rank more than" not in summary


def test_the_text_claims_only_the_overlap_the_tests_time():
    """No cell or message promises piece-times or links working at once without the
    condition that the solution's irecv meets (review 6 asked for the piece-times: they come
    with it); the reveal says when src waits, and why."""
    cells = _cells()
    text = "\n".join(_src(c) for c in cells)
    for sentence in re.split(r"(?<=\.)\s", text):
        if "piece-time" in sentence:
            assert "while its neighbours carry theirs" in sentence, sentence
    assert "the links work at the same time" not in text
    reveal_cell = _src(cells[_index_of("The exercise asked two questions")])
    for claim in ("src's `send` of piece 1 waits too", "neighbouring links take turns",
                  "with `irecv` before it forwards piece `j`"):
        assert claim in reveal_cell, claim
    verdict = check_chain_broadcast(load_solution().chain_broadcast, world_sizes=(3,))
    assert "piece-time" not in verdict.message and "Now open the answer below" in verdict.message
    assert "dist.irecv(parts[j + 1]" in (ROOT / "notebooks" / "solutions" /
                                        "06_chain_broadcast.py").read_text()


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
    """The direction does not matter (gloo's own rings, cell 18, send to r - 1)."""
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
    assert not any(formula.search(_src(c)) for c in cells[:check + 1])
    assert formula.search(WHY["06"][2])                    # the why holds it first ...
    assert any(formula.search(_src(c)) for c in cells[check + 1:] if c["cell_type"] == "markdown")
    assert not re.search(r"\(N - 1\) × S|S bytes", _src(cells[0]))   # ... not the objectives
    assert question < check


def test_the_text_says_why_the_check_takes_no_group():
    params = list(inspect.signature(check_chain_broadcast).parameters)
    assert params[0] == "fn"
    check = _index_of("check_chain_broadcast(chain_broadcast)")
    before = "\n".join(_src(c) for c in _cells()[:check] if c["cell_type"] == "markdown")
    assert "takes no `group`" in before and "3 seconds" in before


def test_the_exercise_cells_as_committed():
    """The def cell fails with the message stored under the check, which names the rank
    that never sent and gives no formula; the text names the rules the check checks."""
    cells = _cells()
    i = _index_of("# %load solutions/06_chain_broadcast.py")
    namespace = {"__name__": "__main__", "dist": dist, "torch": torch}
    exec(_src(cells[i]), namespace)
    verdict = check_chain_broadcast(namespace["chain_broadcast"], world_sizes=(2,))
    shown = "".join(t for o in cells[i + 1]["outputs"] for t in o.get("data", {}).get("text/plain", []))
    assert not verdict and verdict.message in shown
    assert_no_formula(shown)
    text = _src(cells[i - 1])
    for rule in ("**chain**", "only receives", "as soon as it has arrived", "x.tensor_split(pieces)",
                 "more than `S` bytes", "world sizes 2, 3 and 4", "12 elements in 4 pieces",
                 "Can a chain of blocking sends hang?", "Run the def cell, then the check"):
        assert rule in text, rule
    assert (EXERCISE_NUMEL, EXERCISE_PIECES) == (12, 4)


def test_the_ring_direction_aside_is_cut_and_gloos_direction_stays_named():
    """Review 6 (06-2) cut cell 9's aside on the direction (time); cell 18 still says gloo's
    ring sends to rank `r - 1`, which the mirrored ring above shows gives the same sums."""
    assert "direction does not matter" not in _src(_cells()[_index_of("In reduce-scatter step `s`")])
    assert "it sends to rank `r - 1`" in _src(_cells()[_index_of("The sums agree within the float32 bound")])


def test_question_3_asks_which_elements_keep_a_1_and_nothing_above_it_says():
    """The float-order example is a question (an expert review: it was shown, not predicted):
    the ranks' run gives elements 0 and 2, the stored reveal says so, and neither the result
    nor the order of the additions per element appears above the answer cell."""
    x, _ = group_free_ring_result()
    assert [i for i, v in enumerate(x) if v == 1.0] == [0, 2]
    cells = _cells()
    answer, check = _index_of("answer_3 = None"), _index_of("reveal(answer_3")
    assert answer < check
    stored = conftest.stored_text(cells[check])
    assert "The real run gives [0, 2]." in stored and "ring_all_reduce: [1.0, 0.0, 1.0, 0.0]" in stored
    above = "\n".join(_src(c) + "".join(json.dumps(c.get("outputs", []))) for c in cells[:answer])
    for spoiler in ("[1.0, 0.0, 1.0, 0.0]", "tensor([1., 0., 1., 0.])", "Element 0 is added",
                    "Elements 0 and 2", "elements 0 and 2"):
        assert spoiler not in above, spoiler
    # review 6: a reveal that opens with its answer says it twice ("gives [0, 2]. Elements 0 and 2.")
    assert WHY["06"][3].startswith("Chunk c starts at rank c") and "Elements 0 and 2." not in WHY["06"][3]
    assert "The real run gives [0, 2]. Chunk c starts at rank c" in stored


def group_free_ring_result():
    """Chunk c added in ring order from rank c (rank c's value, then c+1, c+2, c+3), in
    float32, as the notebook's ring does."""
    values = [1e8, 1.0, -1e8, 1.0]
    out = []
    for c in range(4):
        acc = torch.tensor(values[c], dtype=torch.float32)
        for k in range(1, 4):
            acc = torch.tensor(values[(c + k) % 4], dtype=torch.float32) + acc
        out.append(acc.item())
    return out, None


def _the_two_phases_as_torchs_collectives():
    """reduce_scatter_single, then all_gather_single, on integers (exact in any order), beside
    all_reduce: the piece each rank keeps and whether the pair equals all_reduce."""
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * rank
    piece = torch.empty(2)
    dist.reduce_scatter_single(piece, x)
    gathered = torch.empty(2 * n)
    dist.all_gather_single(gathered, piece)
    whole = x.clone()
    dist.all_reduce(whole)
    return torch.equal(piece, whole[2 * rank:2 * rank + 2]), torch.equal(gathered, whole)


def test_the_phases_are_torchs_own_collectives_and_sharded_training_calls_them_apart(group):
    """Review r8 (06-1): the text names the two phases as torch 2.13's collectives (piece r on
    rank r; the older names deprecated there), and says what notebooks 08 and 15 measure when
    ZeRO-2 and FSDP2 call them apart; the bytes only after question 2's reveal."""
    group.resize(4)
    assert group.run(_the_two_phases_as_torchs_collectives) == [(True, True)] * 4
    for old, new in (("reduce_scatter_tensor", "reduce_scatter_single"),
                     ("all_gather_into_tensor", "all_gather_single")):
        assert f"`{old}` is deprecated. Users should use\n    `{new}` instead." in \
            inspect.getdoc(getattr(dist, old))
    cells = _cells()
    phases = _src(cells[_index_of("## Step 3: phase 2, all-gather")])
    assert "Each phase is also a collective of torch's own: phase 1 is `dist.reduce_scatter_single`, " \
           "which leaves piece `r` on rank `r` (our ring leaves another: question 1), and phase 2 is " \
           "`dist.all_gather_single` (torch 2.13's names; older releases call them " \
           "`dist.reduce_scatter_tensor` and `dist.all_gather_into_tensor`)." in phases
    # review 6 (06-2) cut the bytes of ZeRO-2 and FSDP2 from the core (time): 08 and 15 teach them
    assert "Sharded training calls the two phases apart" not in "\n".join(_src(c) for c in cells)
    summary = _src(cells[_index_of("## Summary")])
    assert "- torch has each phase as a collective, `dist.reduce_scatter_single` and " \
           "`dist.all_gather_single`; sharded training calls them apart (ZeRO and FSDP2: notebooks " \
           "08 and 15)." in summary
    # what notebooks 08 and 15 measure and say (their own tests re-derive it from runs)
    def markdown_of(name):
        nb = json.loads((ROOT / "notebooks" / name).read_text())
        return "\n".join(_src(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "- ZeRO-2 sends what DDP sends." in markdown_of("08_sharded_data_parallel.ipynb")
    assert "It sends about 1.5 times DDP's bytes, because it gathers the parameters again " \
        "before backward." in markdown_of("15_fsdp2.ipynb")


# --- review 5: one study unit -----------------------------------------------------------------
def test_the_misconceptions_are_optional_after_the_exercise_and_the_summary_is_core():
    """Review 5 timed the core at about 60 min: the misconceptions (with question 3) are an
    optional part after the exercise; the summary and further reading are cells of their
    own after it; nothing in the core runs what only that part defines."""
    from test_notebooks import OPTIONAL_MARK
    cells = _cells()
    start = _index_of("## Common misconceptions (optional, after the lesson)")
    assert OPTIONAL_MARK.search(_src(cells[start]))
    assert _index_of("check_chain_broadcast(chain_broadcast)") < start < _index_of("answer_3 = None")
    summary = _index_of("## Summary")
    assert _src(cells[summary]).startswith("## Summary") and "## Further reading" not in _src(cells[summary])
    # review 7 (06-3): the summary follows the exercise's reveal, before the optional parts
    assert _src(cells[summary - 1]).startswith("<details><summary>The exercise asked two questions")
    assert summary + 1 == start
    reading = _index_of("## Further reading")
    assert all(not OPTIONAL_MARK.search(_src(c)) for c in cells[reading:])
    core = "\n".join(_src(c) for c in cells[:start] + cells[reading:] if c["cell_type"] == "code")
    for name in ("order_matters", "blocking_ring", "mismatched_recv", "ring_sum"):
        assert name not in core, name
    assert "an optional part at the end runs it" in _src(cells[_index_of("So on gloo, if every rank called `send` first")])


def test_the_core_teaches_what_the_summary_cites_and_the_chain_s_last_rank_sends_nothing():
    """Review 7: the summary's first bullet cites batch_isend_irecv, which only an optional
    part taught (06-3): step 1 says it in one sentence; the chain's last rank only receives,
    so "each rank still sends S" was wrong for it (06-4); the reveal cited a test file that
    an installed reducelab lacks without saying where it is (06-5)."""
    cells = _cells()
    step1 = _src(cells[_index_of("So on gloo, if every rank called `send` first")])
    assert "On any backend, NCCL included, `dist.batch_isend_irecv` posts the send and the receive together" in step1
    assert "`dist.batch_isend_irecv`" in _src(cells[_index_of("## Summary")])
    exercise = _src(cells[_index_of("## Exercise: a broadcast that spreads its bytes")])
    assert "each rank but the last still sends `S`" in exercise and "each rank still sends" not in exercise
    reveal_cell = _src(cells[_index_of("The exercise asked two questions")])
    assert "`tests/test_nb06_ring.py` of the Reduce Lab repository; an installed `reducelab` does not include it" in reveal_cell


def test_the_ring_s_rotation_and_torch_s_piece_r_on_rank_r_are_reconciled():
    """Review 5 (06-1): step 3 said reduce_scatter leaves piece r on rank r, just after
    question 1 found the ring leaves another chunk there. The text says both, without
    stating question 1's answer. Review 6 (06-2) cut the sentence to a clause (time)."""
    phases = _src(_cells()[_index_of("## Step 3: phase 2, all-gather")])
    assert "which leaves piece `r` on rank `r` (our ring leaves another: question 1)" in phases
    assert "(r + 1)" not in phases


def _mismatched_recv(buffer):
    if dist.get_rank() == 0:
        dist.send(torch.ones(4), dst=1)
    else:
        dist.recv(buffer, src=0)
        return buffer.tolist()


def test_a_recv_that_does_not_match_its_send_is_said_and_run_on_gloo():
    """Review 5 (06-5): a send and recv of another size or dtype. On gloo the bytes must fit
    the receive buffer, or the receiving process aborts; the same bytes as another dtype pass
    silently. Run here, and stored in the optional part."""
    from reducelab import LocalGroup, RankError
    with LocalGroup(world_size=2, timeout=3, progress=False) as short:
        got = short.run(_mismatched_recv, torch.empty(2, dtype=torch.float64))[1]
        assert got == torch.ones(4).view(torch.float64).tolist()
        with pytest.raises(RankError) as err:
            short.run(_mismatched_recv, torch.empty(3))
    assert any("SIGABRT" in r.summary for r in err.value.reports), [r.summary for r in err.value.reports]
    cells = _cells()
    i = _index_of("def mismatched_recv(buffer)")
    shown = conftest.stored_text(cells[i])
    assert "into 2 float64: no error, the bytes read as float64: [0.007812501848093234, 0.007812501848093234]" in shown
    assert "rank 1: died: killed by SIGABRT" in shown
    said = _src(cells[i - 1])
    assert "gloo checks only that the bytes fit the receive buffer" in said and "a hang" in said


def fewest_transfers_for_all_reduce(n: int) -> int:
    """The fewest one-way transfers of one element after which every one of n ranks holds a
    value that depends on all n inputs (a transfer lets the receiver combine what the sender
    holds with its own): breadth-first over who depends on whom, each rank's set a bitmask."""
    start = tuple(1 << r for r in range(n))
    full = (1 << n) - 1
    seen, frontier, steps = {start}, [start], 0
    while frontier:
        if any(all(m == full for m in state) for state in frontier):
            return steps
        steps += 1
        nxt = []
        for state in frontier:
            for a in range(n):
                for b in range(n):
                    if a != b and state[a] | state[b] != state[b]:
                        new = list(state)
                        new[b] |= state[a]
                        new = tuple(new)
                        if new not in seen:
                            seen.add(new)
                            nxt.append(new)
        frontier = nxt
    raise AssertionError("unreachable")


def test_why_no_all_reduce_sends_less_than_the_ring():
    """Teach-c review: step 5 called the ring bandwidth optimal without saying why. It now
    argues that each element needs at least N - 1 transfers for its inputs to meet and N - 1
    more for the sum to reach the others, 2 (N - 1) x S bytes in all, which the ring shares
    out equally. The count is searched here for small N (the one-way gossip bound), and the
    ring and reduce-then-broadcast of step 5 move exactly that total."""
    for n in (2, 3, 4, 5):
        assert fewest_transfers_for_all_reduce(n) == 2 * (n - 1), n
    text = _src(_cells()[_index_of("## Exercise: a broadcast that spreads its bytes")])
    assert "Why can no all_reduce do better?" in text
    assert "at least `N - 1` transfers" in text and "one more transfer into each" in text
    assert "at least `2 (N - 1) × S` bytes in all" in text and "*bandwidth optimal*" in text
    assert "no all_reduce can do with less" in _src(_cells()[_index_of("## Summary")])
    assert "`2 (N - 1) × S`, the least any all_reduce moves (step 5)" in \
        _src(_cells()[_index_of("## Common misconceptions")])
    for n in (2, 3, 4, 8):
        size = 4_000
        assert ring_bytes_per_rank(n, size) * n == pytest.approx(2 * (n - 1) * size)
        assert root_bytes(n, size) + (n - 1) * size == 2 * (n - 1) * size   # root + the others


def test_the_pipelined_chain_s_time_is_derived_where_it_is_stated():
    """Teach-c review: the exercise gave P + N - 2 without its reason. It says piece 0 takes
    N - 1 piece-times to reach the last rank and the other P - 1 follow one piece-time apart;
    the chain model of test_the_pieces_buy_time_not_bytes is read for both."""
    for n in range(2, 7):
        for p in range(1, 7):
            assert chain_finish_time(n, 1, pipelined=True) == n - 1              # piece 0 alone
            assert chain_finish_time(n, p, pipelined=True) - (n - 1) == p - 1    # one apart
    text = _src(_cells()[_index_of("## Exercise: a broadcast that spreads its bytes")])
    assert ("`P + N - 2`: piece 0 reaches the last rank after `N - 1` piece-times, and the "
            "other `P - 1` follow one piece-time apart") in text


def test_step_1_quotes_what_torch_s_docstrings_say_of_send_and_isend():
    """Teach-c review: step 1 said "the torch docs call dist.send blocking"; torch 2.13's
    docstrings say "Send a tensor synchronously." and "Send a tensor asynchronously." (send
    and isend in torch/distributed/distributed_c10d.py). The text quotes them."""
    assert dist.send.__doc__.strip().startswith("Send a tensor synchronously.")
    assert dist.isend.__doc__.strip().startswith("Send a tensor asynchronously.")
    text = _src(_cells()[_index_of("## Step 1: one ring step")])
    assert '`dist.send` sends "synchronously" and `dist.isend` "asynchronously"' in text
    assert "call `dist.send` blocking" not in text


def test_step_4_names_the_diagonal_the_figure_shows(group):
    """Teach-c review: step 4 said "the diagonal of complete chunks appears", but the
    complete chunks sit at chunk r + 1 of rank r, off the main diagonal and wrapping round
    (the figure at step N - 1). The text names where; the run is read here."""
    group.resize(4)
    held = group.run(NB["after_reduce_scatter"])
    assert [[c for c, v in enumerate(x.tolist()) if v == 15] for x in held] == [[1], [2], [3], [0]]
    text = _src(_cells()[_index_of("At step `N - 1` (the last reduce-scatter step)")])
    assert "the diagonal of complete chunks appears" not in text
    assert "chunk `r + 1` of each rank `r` is complete: the diagonal just right of the main one" in text
