"""Tests of notebook 02 (reduce, in-place buffers and aliasing): the facts it teaches,
its explorer, its check and its solution.

The reference for what gloo leaves in every rank's tensor is a single-process replay of
gloo's ring reduce (gloo/reduce.cc), written here from the algorithm, not from torch.
"""
from __future__ import annotations

import json
import re
import pathlib
import sys
import time

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist

import conftest
from reducelab.checks import reveal, why
from reducelab.plots import message_png
from reducelab.checks.reduce import check_reduce_to_owners, exercise_input, expected_sums
from reducelab.plots.reduce import (FULL, PARTIAL, STATUS_HATCHES, UNCHANGED, ReduceGrid,
                                    cell_label, sweep_figure)
from reducelab.widgets.reduce import (PATTERNS, ReduceExplorer, buffer_status,
                                      contributors)

# Send this module's rank functions by value: importing the test module on every rank
# (matplotlib, ipywidgets) would cost seconds per fresh group.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_solution():
    return conftest.load_solution("02_reduce_to_owners")


def gloo_reduce_reference(inputs: list[np.ndarray], dst: int) -> list[np.ndarray]:
    """Every rank's buffer after gloo's ring reduce (SUM), replayed in one process.

    gloo cuts the tensor into >= 2 * world_size segments of ceil(n / (2 * world_size))
    elements; at step i rank r sends segment ((r + 1) * spr + i) of its buffer to rank
    r - 1, which adds it into its own buffer; then every rank sends its chunk r to dst.
    """
    bufs = [np.array(x, dtype=float) for x in inputs]
    ws, n = len(bufs), len(bufs[0])
    if ws == 1:
        return bufs
    seg = -(-n // (2 * ws))
    num = max(-(-n // seg), 2 * ws)
    num = -(-num // ws) * ws
    spr = num // ws
    for i in range(num - 2):
        msgs = []
        for r in range(ws):
            off = (((r + 1) * spr + i) * seg) % (num * seg)
            if off < n:
                msgs.append(((r - 1) % ws, off, bufs[r][off:off + seg].copy()))
        for to, off, data in msgs:
            bufs[to][off:off + len(data)] += data
    chunk = spr * seg
    for r in range(ws):
        if r != dst and r * chunk < n:
            bufs[dst][r * chunk:(r + 1) * chunk] = bufs[r][r * chunk:(r + 1) * chunk]
    return bufs


# --- rank functions (the notebook's, in the form the explorer calls) -------------------
def reduce_once(n, dst, pattern="10**rank"):
    rank = dist.get_rank()
    if pattern == "10**rank":
        x = torch.full((n,), 10.0 ** rank)
    elif pattern == "rank + 1":
        x = torch.full((n,), rank + 1.0)
    else:
        torch.manual_seed(rank)
        x = torch.randint(1, 10, (n,)).float()
    before = x.clone()
    dist.reduce(x, dst=dst)
    return before, x


def many_reduces(configs):
    rank = dist.get_rank()
    out = []
    for n, dst in configs:
        x = torch.full((n,), 10.0 ** rank)
        dist.reduce(x, dst=dst)
        out.append(x)
    return out


def inputs_10(ws, n):
    return [np.full(n, 10.0 ** r) for r in range(ws)]


# --- the fact the notebook is about -------------------------------------------------------
@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 8])
def test_gloo_reduce_matches_ring_replay(group, ws):
    group.resize(ws)
    configs = [(n, dst) for n in (1, 2, 3, 4, 5, 7, 8, 13, 16, 32)
               for dst in sorted({0, ws // 2, ws - 1})]
    out = group.run(many_reduces, configs)
    for k, (n, dst) in enumerate(configs):
        want = gloo_reduce_reference(inputs_10(ws, n), dst)
        for r in range(ws):
            np.testing.assert_array_equal(out[r][k].numpy(), want[r],
                                          err_msg=f"ws={ws} n={n} dst={dst} rank={r}")
        np.testing.assert_array_equal(out[dst][k].numpy(), np.full(n, sum(10.0 ** r for r in range(ws))))


def test_step_2_at_two_elements_leaves_rank_3_untouched(group):
    """Step 2's run: 4 ranks, 2 elements, dst=0. The sum travels 3 -> 2 -> 1 -> 0, so
    ranks 1 and 2 hold partial sums and rank 3, which only sends, keeps its input."""
    group.resize(4)
    out = group.run(reduce_once, 2, 0)
    changed = [r for r, (before, after) in enumerate(out) if not torch.equal(before, after)]
    assert changed == [0, 1, 2]
    assert [after.tolist() for _, after in out] == [[1111.0] * 2, [1110.0] * 2,
                                                    [1100.0] * 2, [1000.0] * 2]
    assert [contributors(after[0], 4) for _, after in out] == [[0, 1, 2, 3], [1, 2, 3],
                                                               [2, 3], [3]]


def test_question_1_with_dst_3_every_rank_changes(group):
    """Question 1: Step 2's run with dst=3. The reduce-scatter does not depend on dst, so
    ranks 1 and 2 hold the same partial sums and rank 0 the full sum of its chunk 0; the
    gather then sends chunk 0 to rank 3: every rank's x changes."""
    group.resize(4)
    out = group.run(reduce_once, 2, 3)
    changed = [r for r, (before, after) in enumerate(out) if not torch.equal(before, after)]
    assert changed == [0, 1, 2, 3]
    assert [after.tolist() for _, after in out] == [[1111.0] * 2, [1110.0] * 2,
                                                    [1100.0] * 2, [1111.0] * 2]
    want = gloo_reduce_reference(inputs_10(4, 2), 3)              # Step 4's algorithm says so too
    assert [list(w) for w in want] == [after.tolist() for _, after in out]
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    asked = next(c for c in cells if "reveal(answer_1, changed," in "".join(c["source"]))
    assert "The real run gives [0, 1, 2, 3]." in conftest.stored_text(asked)


def test_non_dst_ranks_change_and_layout_depends_on_size(group):
    group.resize(4)
    out = group.run(many_reduces, [(4, 0), (8, 0)])
    for r in (1, 2, 3):
        assert not torch.equal(out[r][0], torch.full((4,), 10.0 ** r))  # every non-dst rank changed
    # rank 1 after n=8 holds ranks {1,2,3}, {0..3}, {1} (untouched), {1,2}
    assert out[1][1].tolist() == [1110, 1110, 1111, 1111, 10, 10, 110, 110]
    # which elements change depends on the size: n=4 changes all of rank 1, n=8 not all
    assert (out[1][0] != 10).all() and not (out[1][1] != 10).all()


def aliases():
    rank = dist.get_rank()
    x = torch.full((4,), 10.0 ** rank)
    view, grid, y, copy = x[:2], x.view(2, 2), x + 1, x.clone()
    snap = [t.clone() for t in (view, grid, y, copy)]
    dist.reduce(x, dst=0)
    return [not torch.equal(t, s) for t, s in zip((view, grid, y, copy), snap)]


def test_views_follow_x_new_tensors_do_not(group):
    """Step 6's rule, stated above question 2: a view sees what reduce writes into the
    elements it covers; x + 1 and a clone never change."""
    group.resize(4)
    out = group.run(aliases)
    assert out[2] == [True, True, False, False]  # rank 2, not dst: view, grid change; y, copy not
    # rank 3: gloo writes elements 2 and 3 only, so x[:2] keeps its values while
    # x.view(2, 2), which covers all four, changes
    assert out[3] == [False, True, False, False]
    assert all(not y and not c for _, _, y, c in out)


def notebook_function(name: str):
    """The notebook's own definition of ``name`` (its code cell's def, run in a namespace
    with torch and dist), so that a test breaks when the notebook's code changes."""
    import ast
    for source in notebook_sources():
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                ns = {"torch": torch, "dist": dist, "np": np}
                exec(compile(ast.Module(body=[node], type_ignores=[]), "02", "exec"), ns)
                return ns[name]
    raise AssertionError(f"the notebook defines no {name}")


def test_question_2_detach_and_numpy_share_x_a_copying_reshape_does_not(group):
    """Question 2 (a fourth review: the old one, on x[:2] and x + 1, gave itself away):
    on rank 1, whose x the reduce rewrites entirely, x.detach() and x.numpy() share x's
    storage and show the reduced values; x.view(2, 2).t().reshape(4) had to copy (the
    transpose is not contiguous) and keeps the input. Re-derived with the notebook's
    aliases(), and on every rank: a name changed exactly where it shares x's storage and
    x changed."""
    aliases_nb = notebook_function("aliases")
    group.resize(4)
    out = group.run(aliases_nb, 0)
    changed, shares, x = out[1]
    assert (x != 10.0).all()                                         # rank 1: all four rewritten
    assert tuple(changed.values()) == (True, True, False)
    assert list(changed) == ["x.detach()", "x.numpy()", "x.view(2, 2).t().reshape(4)"]
    for r, (changed, shares, x) in enumerate(out):
        moved = bool((x != 10.0 ** r).any())
        assert shares == {"x.detach()": True, "x.numpy()": True, "x.view(2, 2).t().reshape(4)": False}
        assert changed == {k: v and moved for k, v in shares.items()}, r
    t = torch.arange(4.0).view(2, 2).t()
    assert not t.is_contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible with input tensor's size and stride"):
        t.view(4)                                                    # the reveal quotes this
    assert "Otherwise, it will be a copy" in " ".join(torch.reshape.__doc__.split())
    assert "shares the same storage with the original one" in " ".join(torch.Tensor.detach.__doc__.split())
    assert "changes to the tensor will be reflected in the ndarray" in " ".join(torch.Tensor.numpy.__doc__.split())
    from reducelab.checks.answers import WHY
    for quote in ("Returned Tensor shares the same storage with the original one",
                  "changes to the tensor will be reflected in the ndarray and vice versa",
                  "Otherwise, it will be a copy", "you should not depend on the copying vs. viewing behavior",
                  "view size is not compatible with input tensor's size and stride"):
        assert quote in " ".join(WHY["02"][2].split()), quote


def test_the_nccl_paragraph_states_only_what_its_sources_say():
    """A fourth review: the notebook implied what NCCL leaves on non-dst ranks ("may leave
    other values") without a source. It now cites torch's ProcessGroupNCCL::reduce (x as
    both buffers) and NCCL's header (a const send buffer; the receive buffer may be NULL
    except on root), says it was not run, and says the docstring promises only dst."""
    text = "\n".join(notebook_cells())
    assert "may leave other values" not in text and "MPI" not in text.split("## Step 5")[0]
    # review 5: NCCL notes are a digression, in a part marked optional after the summary
    start = text.index("## What NCCL does with `x` (optional, after the lesson)")
    assert text.index("## Summary") < start
    part = text[start:text.index("## ", start + 3)]
    for fact in ("not run here", "`ProcessGroupNCCL::reduce`", "`ProcessGroupNCCL.cpp`", "`const`",
                 '"may be NULL on all calls except for root device"', "`nccl.h`",
                 "only the result on `dst` (Step 1)"):
        assert fact in part, fact
    doc = " ".join(dist.reduce.__doc__.split())
    assert "Only the process with rank ``dst`` is going to receive the final result." in doc


def read_before_wait():
    """Rank 1 joins the reduce only after rank 0 has read its buffer: a barrier on a
    second process group orders them, with no sleep to race against."""
    rank = dist.get_rank()
    side = dist.new_group([0, 1])
    x = torch.full((4,), 10.0 ** rank)
    if rank == 1:
        dist.barrier(group=side)
    work = dist.reduce(x, dst=0, async_op=True)
    early = x.clone()
    if rank == 0:
        dist.barrier(group=side)
    work.wait()
    return early, x.clone(), work.is_completed()


def test_async_result_only_after_wait(group):
    group.resize(2)
    out = group.run(read_before_wait)
    early, late, done = out[0]
    assert early.tolist() == [1.0] * 4   # rank 1 had not joined: dst still held its input
    assert late.tolist() == [11.0] * 4 and done


def write_before_wait_in_order(n, write_first):
    """Rank 1 adds 5 to its x before wait(), once ordered before gloo can read x (rank 0
    joins the reduce only after the write) and once after the reduce is done on dst; a
    barrier on a second process group orders them."""
    rank = dist.get_rank()
    side = dist.new_group([0, 1])
    x = torch.full((n,), 10.0 ** rank)
    if rank == 0 and write_first:
        dist.barrier(group=side)
    work = dist.reduce(x, dst=0, async_op=True)
    if rank == 0 and not write_first:
        work.wait()
        dist.barrier(group=side)
    if rank == 1:
        if not write_first:
            dist.barrier(group=side)
        x.add_(5)
        if write_first:
            dist.barrier(group=side)
    work.wait()
    return sorted(int(v) for v in x.unique())


@pytest.mark.parametrize("n", [4, 2 ** 18])
def test_a_write_before_wait_can_give_more_than_one_outcome(group, n):
    """Step 7's race: the same code (write, then wait) gives 16 or 11 on dst depending
    only on when the write lands, at the notebook's size (2**18) and at 4 elements."""
    group.resize(2)
    assert group.run(write_before_wait_in_order, n, True)[0] == [16]
    assert group.run(write_before_wait_in_order, n, False)[0] == [11]


def write_after_wait(delay):
    rank = dist.get_rank()
    x = torch.full((2 ** 18,), 10.0 ** rank)
    work = dist.reduce(x, dst=0, async_op=True)
    if rank == 1:
        time.sleep(delay)
    work.wait()
    if rank == 1:
        x.add_(5)
    return sorted(int(v) for v in x.unique())


def test_question_3_a_write_before_wait_reaches_dst_only_if_it_lands_first(group):
    """Question 3 runs the notebook's own rank function: with the write pinned before dst
    calls reduce, dst ends with 16 everywhere; pinned after dst's wait(), with 11. The
    stored reveal says "C", and the explanation cites gloo's send-on-posted-receive."""
    cells = notebook_cells()
    cell = next(c for c in cells if "def write_at_a_pinned_moment" in c)
    namespace = {"__name__": "__main__", "dist": dist, "torch": torch}
    exec(cell[:cell.index("group.resize(2)")], namespace)
    fn = namespace["write_at_a_pinned_moment"]
    group.resize(2)
    for _ in range(3):
        assert group.run(fn, True)[0] == [16.0] * 4
        assert group.run(fn, False)[0] == [11.0] * 4
    stored = json.loads(NOTEBOOK.read_text())["cells"]
    asked = next(c for c in stored if "reveal(answer_3," in "".join(c["source"]))
    shown = conftest.stored_text(asked)
    assert "The real run gives 'C'." in shown
    assert "run (a): dst's x ends with [16.0, 16.0, 16.0, 16.0]" in shown
    assert "run (b): dst's x ends with [11.0, 11.0, 11.0, 11.0]" in shown
    from reducelab.checks import why
    assert "Execute this send if there is a remote pending receive" in why("02", 3)


def test_a_write_after_wait_never_reaches_dst(group):
    group.resize(2)
    assert {tuple(group.run(write_after_wait, k * 0.0003)[0]) for k in range(10)} == {(11,)}


def test_docs_promise_dst_only_and_in_place():
    doc = " ".join(dist.reduce.__doc__.split())
    assert "Only the process with rank ``dst`` is going to receive the final result." in doc
    assert "The function operates in-place." in doc


# --- helpers ------------------------------------------------------------------------------
def test_buffer_status_and_contributors():
    before = np.array([[1.0, 1.0], [10.0, 10.0], [100.0, 100.0]])
    after = np.array([[111.0, 111.0], [110.0, 10.0], [111.0, 100.0]])
    assert buffer_status(before, after).tolist() == [[FULL, FULL], [PARTIAL, UNCHANGED],
                                                     [FULL, UNCHANGED]]
    assert contributors(1101.0, 4) == [0, 2, 3]
    assert contributors(10.0, 2) == [1]
    for bad in (12.0, 0.0, 11111.0, 1.5):
        with pytest.raises(ValueError):
            contributors(bad, 4)
    with pytest.raises(ValueError):
        buffer_status(before, after[:2])
    assert cell_label(11111111.0) == "11111111" and cell_label(2.5) == "2.5"


def test_plots_reject_bad_shapes_and_draw_png():
    grid = ReduceGrid()
    b = np.ones((2, 3))
    with pytest.raises(ValueError, match="shape"):
        grid.draw(b, np.ones((2, 4)), np.zeros((2, 3), int), 0)
    with pytest.raises(ValueError, match="dst"):
        grid.draw(b, b, np.zeros((2, 3), int), 2)
    assert grid.draw(b, b * 2, np.full((2, 3), FULL), 1).startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="empty"):
        sweep_figure({}, 0)
    with pytest.raises(ValueError, match="world_size"):
        sweep_figure({1: np.zeros((2, 1)), 2: np.zeros((3, 2))}, 0)
    assert sweep_figure({1: np.zeros((2, 1)), 3: np.ones((2, 3))}, 0).startswith(PNG_MAGIC)


# --- the explorer -------------------------------------------------------------------------
def test_explorer_matches_reference_and_follows_controls(group):
    e = ReduceExplorer(group, reduce_once, world_size=4, dst=0, n=8)
    assert e.error is None and bytes(e.image.value).startswith(PNG_MAGIC)
    want = gloo_reduce_reference(inputs_10(4, 8), 0)
    np.testing.assert_array_equal(e.result.after, np.stack(want))
    assert e.result.changed_ranks() == [1, 2, 3]
    assert "dst holds the full sum in 8 of 8" in e.message.value
    # rank 1 holds [1110 1110 1111 1111 10 10 110 110]; ranks 2 and 3 the same counts
    assert "ranks 1, 2, 3 each: 2 full, 4 partial, 2 unchanged" in e.message.value

    e.controls["world_size"].value = 3
    e.controls["dst"].value = 2
    e.controls["n"].value = 5
    assert group.world_size == 3
    np.testing.assert_array_equal(e.result.after, np.stack(gloo_reduce_reference(inputs_10(3, 5), 2)))
    assert e.result.after[2].tolist() == [111.0] * 5

    e.controls["world_size"].value = 2          # dst=2 is no rank any more: clamped to 1
    assert e.controls["dst"].value == 1 and e.controls["dst"].max == 1
    assert e.result.dst == 1 and e.result.world_size == 2

    e.controls["pattern"].value = "random ints"
    inputs = []
    for r in range(2):
        torch.manual_seed(r)
        inputs.append(torch.randint(1, 10, (5,)).float().numpy())
    np.testing.assert_array_equal(e.result.before, np.stack(inputs))
    np.testing.assert_array_equal(e.result.after, np.stack(gloo_reduce_reference(inputs, 1)))

    e.controls["world_size"].value = 1
    assert e.controls["dst"].value == 0
    np.testing.assert_array_equal(e.result.after, e.result.before)
    assert "nothing to reduce" in e.text()
    group.resize(4)


def test_explorer_rejects_bad_settings(group):
    for kwargs in (dict(world_size=9), dict(dst=4, world_size=4), dict(n=0), dict(n=33),
                   dict(pattern="zeros")):
        with pytest.raises(ValueError):
            ReduceExplorer(group, reduce_once, **kwargs)
    assert "10**rank" in PATTERNS


def test_explorer_explains_a_failing_rank_function(group):
    def broken(n, dst, pattern):
        raise ZeroDivisionError("boom")

    group.resize(2)
    e = ReduceExplorer(group, broken, world_size=2)
    assert e.result is None and "ZeroDivisionError: boom" in e.message.value
    assert "could not run reduce" in e.text()
    # no stale figure under the message: a plain note stands in for it
    assert bytes(e.image.value) == message_png("No figure for these settings: see the message below.")


@pytest.mark.parametrize("n", [8, 32])
def test_the_input_changes_the_figure_not_the_layout_at_a_fixed_size(group, n):
    """The tip "switch input between patterns at a fixed size: the left panel changes,
    the right one does not". At 32 elements no value fits a cell, yet the figure changes
    (the input panel is coloured by value). Changing the size does move the layout."""
    group.resize(4)
    e = ReduceExplorer(group, reduce_once, world_size=4, dst=0, n=n)
    status = e.result.status.copy()
    for pattern in ("random ints", "rank + 1", "10**rank"):
        before_png = bytes(e.image.value)
        e.controls["pattern"].value = pattern
        assert bytes(e.image.value) != before_png
        np.testing.assert_array_equal(e.result.status, status)
        assert e.message.value.startswith(f"input {pattern}")
    e.controls["pattern"].value = "random ints"
    e.controls["n"].value = 40 - n                      # 8 <-> 32: the right panel changes
    assert e.result.status.shape[1] == 40 - n
    assert not np.array_equal(e.result.status[:, :min(n, 40 - n)],
                              status[:, :min(n, 40 - n)])


@pytest.mark.parametrize("ws,n", [(1, 1), (8, 32), (8, 8), (2, 3)])
def test_grid_follows_the_figure_rules_at_the_extremes(ws, n):
    """Statuses carry a hatch as well as a colour; the audit fixture checks palette,
    10 pt text and width of every figure drawn here."""
    assert len(set(STATUS_HATCHES.values())) == 3
    inputs = inputs_10(ws, n)
    before, after = np.stack(inputs), np.stack(gloo_reduce_reference(inputs, ws - 1))
    grid = ReduceGrid()
    png_bytes = grid.draw(before, after, buffer_status(before, after), ws - 1)
    assert png_bytes.startswith(PNG_MAGIC)
    assert grid.fig.get_figheight() <= 4.5
    hatches = {c.get_hatch() for c in grid.fig.axes[1].collections}
    assert {"//", "xx"} <= hatches


def test_a_new_number_of_elements_reuses_the_figure_and_draws_what_a_new_one_draws():
    """The slider of n costs a redraw, not a new figure (issue 23's speed): at one
    world size, every n of full width shares one figure, and each PNG is the same,
    pixel for pixel, as a new ReduceGrid's for that state, whatever n came before, and
    whether the colour scale changed (the colour bar is redrawn) or not (it is kept)."""
    import io

    from PIL import Image

    from reducelab.plots.reduce import LAYOUT_N
    from reducelab.widgets.reduce import MAX_ELEMENTS
    assert LAYOUT_N == MAX_ELEMENTS

    def state(ws, n, dst, scale="log"):
        # "log": 10**rank, a logarithmic colour scale; "linear": rank + 1, a linear one
        inputs = inputs_10(ws, n) if scale == "log" else [np.full(n, r + 1.0) for r in range(ws)]
        before, after = np.stack(inputs), np.stack(gloo_reduce_reference(inputs, dst))
        return before, after, buffer_status(before, after), dst

    def pixels(png_bytes):
        return np.asarray(Image.open(io.BytesIO(png_bytes)))

    grid = ReduceGrid()
    grid.draw(*state(4, 8, 0))
    fig = grid.fig
    for ws, n, dst, scale in ((4, 32, 0, "log"), (4, 9, 1, "log"), (4, 17, 3, "linear"),
                              (4, 20, 3, "linear"), (4, 5, 0, "log"), (2, 3, 1, "log"),
                              (2, 12, 1, "linear"), (2, 9, 0, "log")):
        reused = pixels(grid.draw(*state(ws, n, dst, scale)))
        want = list(range(n)) if n <= 16 else sorted({*range(0, n, 4), n - 1})
        assert [int(x) for x in grid.fig.axes[0].get_xticks()] == want
        np.testing.assert_array_equal(reused, pixels(ReduceGrid().draw(*state(ws, n, dst, scale))),
                                      err_msg=f"world_size={ws}, n={n}, dst={dst}, {scale}")
        if ws == 4 and n >= 6:
            assert grid.fig is fig, f"n={n} at world size 4 built a new figure"
        top = 10.0 ** (ws - 1) if scale == "log" else float(ws)   # the colour bar's range
        assert grid.fig.axes[2].get_xlim() == pytest.approx((1.0, top)), (ws, n, scale)


@pytest.mark.parametrize("ws,n,dst", [(4, 8, 0), (8, 32, 5), (3, 17, 2), (1, 1, 0)])
def test_hatches_drawn_as_one_path_per_status_have_the_pixels_of_a_patch_per_cell(
        monkeypatch, ws, n, dst):
    """plots.reduce hatches all cells of a status as one path (a path per cell made Agg
    rasterise the hatch per cell): the explorer's grid, whose cells meet on whole
    pixels, is the same, pixel for pixel, as with one hatched square patch per cell,
    and differs from one with no hatches."""
    from matplotlib.patches import Rectangle

    from reducelab.plots import reduce as reduce_plots
    inputs = inputs_10(ws, n)
    before, after = np.stack(inputs), np.stack(gloo_reduce_reference(inputs, dst))
    state = (before, after, buffer_status(before, after), dst)
    one_path = ReduceGrid().draw(*state)

    def per_cell(layers, status):
        for k, layer in layers.items():
            rows, cols = np.nonzero(status == k)
            layer.set_paths([Rectangle((j - 0.5, i - 0.5), 1, 1) for i, j in zip(rows, cols)])
    monkeypatch.setattr(reduce_plots, "_set_hatches", per_cell)
    assert ReduceGrid().draw(*state) == one_path
    monkeypatch.setattr(reduce_plots, "_set_hatches", lambda layers, status: None)
    assert ReduceGrid().draw(*state) != one_path


def test_values_on_the_hatched_panel_sit_on_a_white_box():
    """At the explorer's first state (4 ranks, 8 elements) every value in the after
    panel is written, black on a white box, so no hatch line runs through its digits."""
    import matplotlib.colors as mcolors
    inputs = inputs_10(4, 8)
    before, after = np.stack(inputs), np.stack(gloo_reduce_reference(inputs, 0))
    grid = ReduceGrid()
    grid.draw(before, after, buffer_status(before, after), 0)
    labels = [t for t in grid.fig.axes[1].texts if t.get_text()]
    assert sorted({t.get_text() for t in labels}) == sorted(
        {cell_label(v) for v in after.ravel()})
    assert len(labels) == after.size
    for t in labels:
        box = t.get_bbox_patch()
        assert box is not None and mcolors.to_hex(box.get_facecolor()) == "#ffffff"
        assert t.get_zorder() > max(c.get_zorder() for c in grid.fig.axes[1].collections)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_values_side_by_side_never_touch_and_read_as_one_number(world_size):
    """Boxed values of the after panel stay 4 pixels apart or more, and the input
    panel's 2 or more, at every n the slider offers from 8 up: at 4 ranks and 17
    elements the boxes of 10 and 10 touched and read "1010". Where two boxed values
    would come closer, the panel shows colours and hatches only; at 12 elements the
    2-digit sums are still written."""
    grid = ReduceGrid()
    for n in (8, 12, 14, 15, 16, 17, 24, 32):
        linear = [np.full(n, r + 1.0) for r in range(world_size)]       # sums of 1 or 2 digits
        for inputs in (inputs_10(world_size, n), linear):
            before, after = np.stack(inputs), np.stack(gloo_reduce_reference(inputs, 0))
            grid.draw(before, after, buffer_status(before, after), 0)
            renderer = grid.fig.canvas.get_renderer()
            for panel, gap in ((grid.fig.axes[0], 2), (grid.fig.axes[1], 4)):
                boxes = conftest.text_boxes(panel, renderer)
                if n == 12 and inputs is linear and panel is grid.fig.axes[1]:
                    assert len(boxes) == after.size, (world_size, n)
                conftest.assert_apart(boxes, gap, (world_size, n))


# --- the exercise check and its solution --------------------------------------------------
def test_solution_passes(group):
    group.resize(4)
    verdict = check_reduce_to_owners(group, load_solution().reduce_to_owners)
    assert verdict, verdict.message
    assert group.world_size == 4                 # the check put the world size back
    group.resize(1)
    assert check_reduce_to_owners(group, load_solution().reduce_to_owners, world_sizes=(3,))
    assert group.world_size == 1
    group.resize(4)


def clone_per_chunk(x):                          # another right answer: a clone per chunk
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        part = x[c * k:(c + 1) * k].clone()
        dist.reduce(part, dst=c)
        if c == rank:
            mine = part
    return mine


def test_a_clone_per_chunk_passes_too(group):
    assert check_reduce_to_owners(group, clone_per_chunk, world_sizes=(3,))


def notebook_stub(x):                            # the notebook's def cell, as committed
    rank, world_size = dist.get_rank(), dist.get_world_size()
    k = x.numel() // world_size
    return x[rank * k:(rank + 1) * k]


def in_place(x):                                 # x itself through every reduce
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        dist.reduce(x, dst=c)
    return x[rank * k:(rank + 1) * k]


def slices_of_x(x):                              # views of x: x changes
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = x.tensor_split(n)
    for c, chunk in enumerate(chunks):
        dist.reduce(chunk, dst=c)
    return chunks[rank].clone()


def one_copy_for_all(x):                         # one buffer through every reduce
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    buffer = x.clone()
    for c in range(n):
        dist.reduce(buffer, dst=c)
    return buffer[rank * k:(rank + 1) * k]


def last_reduce_kept(x):                         # the buffer of the last reduce, on every rank
    n = dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        part = x[c * k:(c + 1) * k].clone()
        dist.reduce(part, dst=c)
    return part


def whole_tensor_each_time(x):                   # right sums, world_size times the bytes
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        buffer = x.clone()
        dist.reduce(buffer, dst=c)
        if c == rank:
            mine = buffer[rank * k:(rank + 1) * k]
    return mine


def with_reduce_scatter(x):                      # the collective the exercise builds
    out = torch.empty(x.numel() // dist.get_world_size())
    dist.reduce_scatter_single(out, x.clone())
    return out


def with_all_reduce(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    total = x.clone()
    dist.all_reduce(total)
    return total.tensor_split(n)[rank]


def whole_sum(x):                                # returns the buffer, not the chunk
    buffer = x.clone()
    for c, chunk in enumerate(buffer.tensor_split(dist.get_world_size())):
        dist.reduce(chunk, dst=c)
    return buffer


def returns_nothing(x):
    dist.reduce(x.clone(), dst=0)


def keeps_what_reduce_returns(x):                # reduce's return value taken for the sum
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        got = dist.reduce(x[c * k:(c + 1) * k].clone(), dst=c)
        if c == rank:
            mine = got
    return mine


def raises(x):
    raise ValueError("not written yet")


MISTAKES = [
    (notebook_stub, "That is this rank's own chunk of x, with nothing reduced into it."),
    (in_place, "That is what reducing x itself does"),
    (slices_of_x, "a slice such as x[a:b] is a view"),
    (one_copy_for_all, "one buffer sent through every reduce"),
    (last_reduce_kept, "That is the tensor of the last reduce, whose dst was another rank"),
    (whole_tensor_each_time, "passed a tensor of 4 elements to dist.reduce, where one chunk has 2"),
    (with_reduce_scatter, "your function called dist.reduce_scatter_single"),
    (with_all_reduce, "your function called dist.all_reduce"),
    (whole_sum, "rank 0 returned 4 elements; expected 2"),
    (returns_nothing, "rank 0 returned None"),
    (keeps_what_reduce_returns, "reduce does not return the sum, it writes it into the tensor "
                                "you pass it, on dst."),
    (raises, "ValueError: not written yet"),
]


@pytest.mark.parametrize("fn, says", MISTAKES, ids=[fn.__name__ for fn, _ in MISTAKES])
def test_each_likely_mistake_is_named(group, fn, says):
    group.resize(4)
    verdict = check_reduce_to_owners(group, fn)
    assert not verdict
    assert says in verdict.message, verdict.message
    assert verdict.message.startswith("With world_size=2 and k=2"), verdict.message
    assert group.world_size == 4


def test_no_check_message_prints_the_solution(group):
    code = [line.strip() for line in
            (conftest.SOLUTIONS / "02_reduce_to_owners.py").read_text().splitlines()
            if len(line.strip()) > 12 and not line.strip().startswith(("#", "def ", '"', "import"))]
    for fn, _ in MISTAKES:
        message = check_reduce_to_owners(group, fn).message
        assert not [line for line in code if line.split("#")[0].strip() in message], fn.__name__


def test_bad_settings_are_refused_with_the_valid_choices(group):
    with pytest.raises(ValueError, match="2 or more ranks"):
        check_reduce_to_owners(group, notebook_stub, world_sizes=(1, 2))
    with pytest.raises(ValueError, match="1 or more elements"):
        check_reduce_to_owners(group, notebook_stub, chunk_sizes=(0,))
    with pytest.raises(ValueError, match="k >= 1"):
        exercise_input(0, 4, 0)


def test_exercise_input_reads_by_the_digits_rule():
    assert exercise_input(2, 3, 2).tolist() == [100.0, 100.0, 200.0, 200.0, 300.0, 300.0]
    assert exercise_input(0, 1, 1).dtype == torch.float32
    assert [s.tolist() for s in expected_sums(4, 1)] == [[1111.0], [2222.0], [3333.0], [4444.0]]
    assert expected_sums(2, 3)[1].tolist() == [22.0] * 3


def test_one_buffer_counts_ranks_twice_as_the_message_says(group):
    """The message for one buffer through every reduce says some ranks are counted more
    than once: at 2 ranks, rank 0's chunk comes back as 21 (rank 1 counted twice)."""
    group.resize(2)
    out = group.run(lambda: one_copy_for_all(exercise_input(dist.get_rank(), 2, 2)))
    assert out[0].tolist() == [21.0, 21.0]
    group.resize(4)


def test_the_mistakes_messages_point_to_the_step_that_shows_partial_sums():
    """The one-buffer message sends the learner to where the partial sums on the ranks that
    were not dst are first shown: Step 2's run (it said Step 4, the explorer). A None returned
    is named both ways it comes: a missing return, or dist.reduce's own return value."""
    from reducelab.checks import reduce as checks
    message = checks._WRONG_SUM["one buffer"][1]
    assert "(Step 2)" in message and "(Step 4)" not in message
    step2 = next(c for c in notebook_cells() if c.startswith("## Step 2."))
    shown = next(c for c in notebook_cells() if c.startswith("`dst` holds the full sum, as promised"))
    assert "Run it: whose tensor changes?" in step2 and "**partial sums**" in shown
    assert "without a return statement" in checks._RETURNED_NONE
    assert "what dist.reduce itself returns" in checks._RETURNED_NONE


# --- the notebook itself ------------------------------------------------------------------
NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "02_reduce_and_aliasing.ipynb"


def notebook_cells():
    return ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def notebook_sources():
    """The notebook's code cells."""
    return ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
            if c["cell_type"] == "code"]


def test_the_notebooks_replay_is_gloos_ring():
    """Step 4's replay (math.ceil, one named variable per step) gives what the reference
    replay gives, for sizes and world sizes beyond those the notebook compares."""
    cell = next(c for c in notebook_cells() if "def ring_reduce_replay" in c)
    assert "-(-" not in cell                            # no ceiling-division tricks
    namespace = {}
    exec(cell[:cell.index("compared = differ = 0")], namespace)
    replay = namespace["ring_reduce_replay"]
    for ws in (1, 2, 3, 5, 8):
        for n in (1, 2, 7, 16, 33, 100):
            for dst in sorted({0, ws - 1}):
                inputs = [torch.full((n,), 10.0 ** r) for r in range(ws)]
                got = replay(inputs, dst)
                want = gloo_reduce_reference([x.numpy() for x in inputs], dst)
                for r in range(ws):
                    np.testing.assert_array_equal(got[r].numpy(), want[r])


def test_the_notebook_asks_before_it_explains():
    cells = notebook_cells()
    assert "has changed on ranks that were never meant" not in cells[0]
    assert "do not (`x + 1`" not in cells[0]
    q1 = next(i for i, c in enumerate(cells) if c.startswith("answer_1 = None"))
    assert "dst=3" in cells[q1 - 1] and "2 elements each" in cells[q1 - 1]
    assert "reduce_once, 2, 3" in cells[q1 + 1]
    # an expert review: question 1 hinged on gloo's layout, which the notebook had not shown.
    # It now comes after Step 4 (the cut, the reduce-scatter, the gather, and the replay that
    # matches the real ranks), and after Step 2's run of the same case with dst=0
    asked_1 = "\n".join(cells[:q1])
    assert "def ring_reduce_replay" in asked_1 and "**Gather.**" in asked_1
    assert "reduce_once, 2, 0" in asked_1
    # nothing above it says what a last-rank dst does (the explorer's tip used to)
    for hint in ("now rank 0 carries", "dst` = the last rank", "dst=3", "dst = 3"):
        assert hint not in "\n".join(cells[:q1 - 1]), hint
    q2 = next(i for i, c in enumerate(cells) if c.startswith("answer_2 = None"))
    asked = "\n".join(cells[:q2 + 2])
    # a fourth review: question 2 gave itself away. Step 6 now states the rule (a name sees
    # the writes when it shares x's storage) and asks about three names whose sharing is
    # not plain; nothing above the reveal says which of them share, or that reshape copies
    for hint in ("detach() shares", "numpy() shares", "same storage with the original",
                 "reflected in the ndarray", "must copy", "had to copy", "a copy when",
                 "reshape copies", "not contiguous", "as_strided"):
        assert hint not in asked.split("def aliases")[0], hint
    assert "# views" not in cells[q2 + 1] and "# copies" not in cells[q2 + 1]
    assert "**rank 1**" in cells[q2 - 1]
    # question 2 gives what the reduce writes on rank 1, so that it asks about the names only
    assert "rewrites all four elements of `x`" in cells[q2 - 1]
    for name in ("`d = x.detach()`", "`a = x.numpy()`", "`r = x.view(2, 2).t().reshape(4)`"):
        assert name in cells[q2 - 1], name
    q3 = next(i for i, c in enumerate(cells) if c.startswith("answer_3 = None"))
    # an expert review: question 3 (read before wait) was near-trivial. It now asks what a
    # write before wait() does to dst's result, at two pinned moments, with the three
    # outcomes stated evenly and nothing above it that says whether reduce copies x
    asked_3 = cells[q3 - 1].split("## Step 7")[1]
    for option in ('`"A"`: 11 in both runs', '`"B"`: 16 in both runs',
                   '`"C"`: 16 in run (a), 11 in run (b)', '`"D"`: 11 in run (a), 16 in run (b)'):
        assert option in asked_3, option
    assert "before `dst` (rank 0) has called `reduce`" in asked_3
    assert "after `dst`'s `work.wait()` has returned" in asked_3
    above_3 = "\n".join(cells[:q3 + 2])
    for hint in ("does not copy", "copies x", "snapshot", "pending receive", "remote pending",
                 "timing decides", "either value"):
        assert hint not in above_3, hint
    race = next(c for c in cells if "def write_before_wait" in c)
    assert "2 ** 18" in race and cells.index(race) > q3


def test_question_2s_stated_layout_is_what_the_ranks_do(group):
    """Question 2 states that on rank 1 the reduce rewrites all four elements (and Step 6's
    rule, that rank 3 has elements 2 and 3 written only, as the views test shows)."""
    group.resize(4)
    out = group.run(reduce_once, 4, 0)
    assert (out[1][0] != out[1][1]).tolist() == [True] * 4
    assert (out[3][0] != out[3][1]).tolist() == [False, False, True, True]


def test_what_decides_the_layout_is_stated_in_full(group):
    """The summary said the layout depends on world_size and the size only; question 1
    shows that dst changes it too (through the gather): rank 3 keeps its input at dst=0
    and holds the full sum at dst=3, at the same world size and size."""
    group.resize(4)
    assert group.run(reduce_once, 2, 0)[3][1].tolist() == [1000.0] * 2
    assert group.run(reduce_once, 2, 3)[3][1].tolist() == [1111.0] * 2
    text = "\n".join(notebook_cells())
    assert "depends on `world_size` and the tensor's size, not on the values" not in text
    summary = text.split("## Summary")[1].split("## Further reading")[0]
    assert "through the final gather, `dst`" in summary


def test_the_summary_says_why_reduce_to_rank_0_then_use_everywhere_fails():
    """Review 6 (02-3): the summary carries the consequence of NCCL's contract: a value
    reduced to rank 0 for logging, then used by every rank, differs by backend."""
    summary = next(c for c in notebook_cells() if c.startswith("## Summary"))
    line = next(l for l in summary.splitlines() if "ReduceLROnPlateau" in l)
    for words in ("reduced to rank 0 for logging", "partial sums on gloo",
                  "by NCCL's contract, their input on NCCL (optional part)", "Use `all_reduce`"):
        assert words in line, words
    nccl = next(c for c in notebook_cells() if c.startswith("## What NCCL does with `x` (optional"))
    assert "NCCL does not write a non-`dst` rank's `x`" in nccl


def test_the_myths_state_each_claim_in_full():
    """An expert review: the myth table quoted the popular answer in fragments. Each claim
    is now a sentence of its own, and the section names the learner question by title
    and date."""
    myth = "\n".join(notebook_cells()).split("## Myth vs reality")[1].split("## Summary")[0]
    assert ('"Why does `torch.distributed.reduce` affect tensors other than the destination?" '
            "(2025-01-30)") in myth
    rows = [line for line in myth.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 3
    # review 6 (02-1): no core row cites a run after the summary; the three examples' rows
    # head the optional part that runs them
    assert "after the summary)" not in "\n".join(rows) and "Example" not in "\n".join(rows)
    optional = "\n".join(notebook_cells()).split("## The popular answer's examples, run")[1]
    examples = [line for line in optional.split("**Example 1")[0].splitlines()
                if line.startswith("| Example")]
    assert len(examples) == 3
    for row in rows + examples:
        claim, reality = [part.strip() for part in row.strip("|").split(" | ")]
        assert claim[0].isupper() or claim[0] == "`", claim
        assert claim.endswith(".") and reality.endswith("."), row


def test_the_notebooks_exercise_cell_is_the_stub_the_check_names(group):
    """The def cell as committed fails with the own-chunk message, and its text asks for
    what the check checks."""
    cells = notebook_cells()
    i = next(i for i, c in enumerate(cells) if c.startswith("# %load solutions/02_reduce_to_owners.py"))
    namespace = {"__name__": "__main__", "dist": dist, "torch": torch}
    exec(cells[i], namespace)
    verdict = check_reduce_to_owners(group, namespace["reduce_to_owners"])
    assert not verdict and "own chunk of x, with nothing reduced into it" in verdict.message
    assert cells[i + 1].strip() == "check_reduce_to_owners(group, reduce_to_owners)"
    text = cells[i - 1]
    for rule in ("`dist.reduce` only", "`dst=c`", "not the whole tensor", "unchanged on every rank",
                 "world sizes 2, 3 and 4, with 2 and 3 elements per chunk", "reads 3333"):
        assert rule in text, rule
    assert expected_sums(4, 1)[2].item() == 3333.0     # the number the text gives
    assert "reduce_to_owners" not in cells[0] and "reduce_scatter" not in cells[0]


def test_a_new_world_size_figure_is_built_while_the_ranks_run(group):
    """The explorer builds the figure of a world size it has not shown while the new
    ranks start and run (Explorer.preparation), not after them."""
    e = ReduceExplorer(group, reduce_once, world_size=4, dst=0, n=8)
    conftest.assert_new_world_size_is_built_on_the_preparer(e, e.plot)


def test_question_3_has_four_even_options_and_reads_lower_case():
    """Review 5 (02-4): with A, B and C, C was the only option whose runs differed. D (11,
    then 16) is the other split; the cell maps each option to its runs, and reads "c" as
    "C"."""
    cell = next(c for c in notebook_cells() if "def write_at_a_pinned_moment" in c)
    assert 'options = {"A": [11.0, 11.0], "B": [16.0, 16.0], "C": [16.0, 11.0], "D": [11.0, 16.0]}' in cell
    same = "same=lambda a, b: str(a).strip().upper() == b"
    assert same in cell
    compare = eval(same.split("=", 1)[1])
    assert reveal("c", "C", "", same=compare).passed and reveal(" C", "C", "", same=compare).passed
    assert not reveal("d", "C", "", same=compare).passed


def test_the_explorer_comes_after_question_1s_reveal():
    """Review 5 (02-3): the explorer before question 1 invited the learner to move dst before
    predicting. It now follows question 1's reveal, and nothing above question 1 points at it."""
    cells = notebook_cells()
    q1 = next(i for i, c in enumerate(cells) if "reveal(answer_1," in c)
    explorer = next(i for i, c in enumerate(cells) if c.startswith("explorer = ReduceExplorer("))
    assert q1 < explorer and cells[explorer - 1].startswith("## Step 4. Explore")
    above = "\n".join(cells[:q1])
    assert "predict first, then move it" not in above and "ReduceExplorer(group" not in above


def test_reading_the_table_names_one_thing_and_explains_it():
    """Review 5 (02-1): the text named three things to look for and explained one. It names
    the 2-rank one, and the worked case derives both of its numbers (4 at n = 8, 0 at n = 2)."""
    text = next(c for c in notebook_cells() if c.startswith("**Reading the table.**"))
    assert "three things" not in text.lower()
    assert "On 2 ranks, rank 1 keeps its input at `n` = 1 and 2" in text
    assert "the table's 4" in text and "the table's 0" in text


def test_the_replays_send_schedule_is_commented_and_the_comments_hold():
    """Review 5 (02-2): the replay's send schedule was unexplained. Each of its two lines has a
    comment; what the comment says is checked here on gloo's own formulas: a segment of chunk
    c is sent first by rank c - 1, then by c - 2, ..., every per_rank rounds, reaches its
    owner c last, and, if rounds remain, goes on to rank c - 1."""
    import math
    cell = next(c for c in notebook_cells() if "def ring_reduce_replay" in c)
    lines = cell.splitlines()
    loop = next(i for i, l in enumerate(lines) if "for i in range(num_segments - 2):" in l)
    assert "sends in all" in lines[loop - 2] and "last two rounds" in lines[loop - 1]
    k = next(i for i, l in enumerate(lines) if "k = ((r + 1) * per_rank + i) % num_segments" in l)
    assert "first segment of chunk r + 1" in lines[k - 3] and "reaches its owner c last" in lines[k - 1]
    for ws in range(2, 7):
        for n in range(1, 60):
            segment = math.ceil(n / (2 * ws))
            num_segments = math.ceil(max(math.ceil(n / segment), 2 * ws) / ws) * ws
            per_rank = num_segments // ws
            for seg in range(num_segments):
                c = seg // per_rank
                sends = [(i, r) for i in range(num_segments - 2) for r in range(ws)
                         if ((r + 1) * per_rank + i) % num_segments == seg]
                senders = [r for _, r in sends]
                assert senders[:ws - 1] == [(c - 1 - h) % ws for h in range(ws - 1)], (ws, n, seg)
                assert senders[ws - 1:] in ([], [c]), (ws, n, seg)
                rounds = [i for i, _ in sends]
                assert all(b - a == per_rank for a, b in zip(rounds, rounds[1:]))


from test_notebooks import bound_and_loaded as _bound_and_loaded  # noqa: E402 (one definition, shared)


def test_the_optional_parts_follow_the_summary_and_no_core_cell_needs_them():
    """Review 5: the core fits one study unit. NCCL's contract, the untimed race and the
    popular answer's three examples follow the summary, each marked optional (review 8 adds
    the sums that count a rank twice above 2 * world_size MiB); the myth
    table stays in the core; no code cell outside them uses a name only they bind."""
    from test_notebooks import OPTIONAL_MARK
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    summary = next(i for i, t in enumerate(text) if t.startswith("## Summary"))
    marks = [i for i, t in enumerate(text) if OPTIONAL_MARK.search(t)]
    reading = next(i for i, t in enumerate(text) if t.startswith("## Further reading"))
    assert [text[i].split("\n")[0] for i in marks] == [
        "## What NCCL does with `x` (optional, after the lesson)",
        "## Above 2 · `world_size` MiB: sums that count a rank twice (optional, after the lesson)",
        "## A write before `wait()`, left to timing (optional, after the lesson)",
        "## The popular answer's examples, run (optional, after the lesson)"]
    assert summary < marks[0] and marks[-1] < reading
    assert "## Myth vs reality" in "\n".join(text[:summary])
    code = [(i, *_bound_and_loaded(t)) for i, t in enumerate(text) if cells[i]["cell_type"] == "code"]
    optional = lambda i: marks[0] <= i < reading
    only_there = set().union(*(b for i, b, _ in code if optional(i))) - set().union(*(b for i, b, _ in code if not optional(i)))
    assert only_there and not [(i, loaded & only_there) for i, _, loaded in code
                               if not optional(i) and loaded & only_there]


def test_the_table_s_3_and_4_rank_rows_are_accounted_for_and_no_dunder_import():
    """Review 6 (02-2): the table's 3- and 4-rank rows were left unexplained and the replay's
    printed result unused. The reading says those rows follow from the same three parts
    and that the replay, compared with the real ranks, covers every cell of the table
    (world sizes 2 to 4, sizes 1 to 32 and beyond the table's 8); the stored run found no
    difference. (02-4) Step 5 imports os rather than calling __import__("os")."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    reading = next(t for t in text if t.startswith("**Reading the table.**"))
    assert "The rows for 3 and 4 ranks follow from the same three parts" in reading
    assert "every cell of the table, 3 and 4 ranks included" in reading
    table = next(t for t in text if t.startswith("table_sizes = "))
    assert "for ws in (2, 3, 4):" in table and max(eval(table.split("=", 1)[1].split("\n")[0])) <= 32
    i = next(i for i, t in enumerate(text) if "def ring_reduce_replay" in t)
    assert "for ws in (2, 3, 4):" in text[i] and "sizes = list(range(1, 33))" in "\n".join(text[:i])
    shown = "".join("".join(o.get("text", "")) for o in cells[i]["outputs"])
    assert re.search(r"\b576 rank tensors compared with the replay; 0 differ", shown), shown
    assert not any("__import__" in t for t in text)


def test_review_7_reading_names_what_the_3_and_4_rank_rows_show():
    """Review 7 (02-5): the reading says what to notice in the 3- and 4-rank rows; each
    claim is re-derived from the stored table (dst=0): every rank but the last changes
    elements at every size, the last keeps its input at n = 1 and 2, and at n = 32 every
    rank changes most of its tensor (24 of 32 on 4 ranks). (02-1) The reading stays short."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    reading = next(t for t in text if t.startswith("**Reading the table.**"))
    assert ("every rank but the last changes elements at every size; the last rank keeps its "
            "input at `n` = 1 and 2; at `n` = 32 every rank changes most of its tensor "
            "(24 of 32 on 4 ranks)") in reading
    assert len(reading.split()) < 330
    i = next(i for i, t in enumerate(text) if t.startswith("table_sizes = "))
    shown = "".join("".join(o.get("text", "")) for o in cells[i]["outputs"])
    sizes = [int(s) for s in re.findall(r"n=(\d+)", shown.splitlines()[0])]
    for ws in (3, 4):
        row = next(l for l in shown.splitlines() if re.match(rf"\s*{ws} \|", l))
        counts = [[int(v) for v in c.split(",")] for c in row.split("|")[1].split()]
        for n, per_rank in zip(sizes, counts):
            assert all(v > 0 for v in per_rank[:-1]), (ws, n)
            assert (per_rank[-1] == 0) == (n <= 2), (ws, n)
            if n == 32:
                assert all(v > 16 for v in per_rank), (ws, per_rank)
                assert ws != 4 or per_rank == [24, 24, 24]


def test_review_7_question_3_has_its_reasoning_handle_and_step_2_its_stake():
    """Review 7 (02-2): question 3's option C hinged on gloo's TCP rule, stated only in the
    reveal. Step 7 states, before the question, when a send reads x and when it goes out
    (Pair::send), which lets a learner derive both runs; the existing spoiler test keeps
    the reveal's words ("pending receive") out. (02-4) Step 2 says why partial sums matter
    (ReduceLROnPlateau), before question 1."""
    cells = notebook_cells()
    q3 = next(i for i, c in enumerate(cells) if c.startswith("answer_3 = None"))
    step_7 = cells[q3 - 1]
    assert "a send reads `x` when it goes out" in step_7
    assert "goes out only once the receiver has posted its matching receive" in step_7
    assert "`Pair::send` in `gloo/transport/tcp/pair.cc`" in step_7
    assert "Pair::send" in why("02", 3)
    q1 = next(i for i, c in enumerate(cells) if c.startswith("answer_1 = None"))
    step_2 = next(c for c in cells[:q1] if c.startswith("`dst` holds the full sum"))
    assert "Why it matters" in step_2 and "`ReduceLROnPlateau`" in step_2
    assert "learning rates drift apart" in step_2


def sums_on_a_non_dst_rank(n):
    x = torch.full((n,), 10.0 ** dist.get_rank())
    before = x.clone()
    dist.reduce(x, dst=0)
    return int((x != before).sum())


def test_step_5_says_why_gloo_works_in_x_and_the_sums_outgrow_its_scratch(group):
    """Review 8 (02): the notebook said that gloo uses x as its work buffer, not why. Step 5
    now says gloo's scratch holds only the two segments in flight (tmpAllocation in
    gloo/reduce.cc, segments of at most 1 MiB), so the running sums build up in x. On 2
    ranks with 4M float32 elements (16 MiB: 16 segments of 1 MiB, 262,144 elements each),
    rank 1 (not dst) ends with sums written into 14 segments of its x, the 14 rounds in which
    gloo sends (the replay's schedule): seven times what two segments of scratch hold."""
    group.resize(2)
    try:
        changed = group.run(sums_on_a_non_dst_rank, 2 ** 22)[1]
    finally:
        group.resize(4)
    segment = 2 ** 20 // 4                                   # 1 MiB of float32
    assert changed == 14 * segment and changed > 2 * segment
    said = next(c for c in notebook_cells() if c.startswith("gloo uses each rank's `x` as its work buffer"))
    assert ("Why `x`? gloo's scratch holds only the two segments in flight (`tmpAllocation` in "
            "`gloo/reduce.cc`): the running sums build up in `x`, sparing every rank a second "
            "buffer of its size.") in said
    step4 = next(c for c in notebook_cells() if c.startswith("## Step 4. Explore"))
    assert "coloured and hatched as in Step 3's figure" in step4


def distinct_values(n):
    x = torch.full((n,), 10.0 ** dist.get_rank())
    dist.reduce(x, dst=0)
    values, counts = x.unique(return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}


def test_above_2_world_size_mib_a_non_dst_rank_holds_sums_that_count_a_rank_twice(group):
    """Review 8 (02): the summary said the other ranks hold partial sums, full sums or their
    input. Above 2 * world_size MiB gloo's 1 MiB segments make more than 2 a rank, and the
    extra rounds add a rank's finished chunk into rank r - 1 once more: 21 on 2 ranks (rank 1
    counted twice), 1121, 1211 and 2111 on 4. At 2 * world_size MiB there is no such value.
    The summary names it, an optional part runs it, and its stored run shows 21."""
    MIB = 2 ** 18
    group.resize(2)
    try:
        assert group.run(distinct_values, 4 * MIB)[1] == {10: 2 * MIB, 11: 2 * MIB}
        assert group.run(distinct_values, 16 * MIB)[1] == {10: 2 * MIB, 11: 8 * MIB, 21: 6 * MIB}
        group.resize(4)
        held = group.run(distinct_values, 8 * MIB)
        assert not [v for h in held for v in h if "2" in str(v)], held     # no rank twice
        held = group.run(distinct_values, 32 * MIB)
        assert [max(h) for h in held] == [1111, 1121, 1211, 2111]
    finally:
        group.resize(4)
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    summary = next(t for t in text if t.startswith("## Summary"))
    assert "above 2 · `world_size` MiB also sums that count a rank twice (optional part)" in summary
    start = next(i for i, t in enumerate(text)
                 if t.startswith("## Above 2 · `world_size` MiB: sums that count a rank twice "
                                 "(optional, after the lesson)"))
    assert start > text.index(summary) and "`kMaxSegmentSize` in `gloo/reduce.h`" in text[start]
    replay = next(t for t in text if "def ring_reduce_replay" in t)
    assert "then, if rounds remain, rank c - 1" in replay and "then, if rounds remain, rank c - 1" in text[start]
    shown = "".join("".join(o.get("text", "")) for o in cells[start + 1]["outputs"])
    assert "4 MiB: rank 1's x holds 10 in 2 MiB, 11 in 2 MiB\n" in shown, shown
    assert "16 MiB: rank 1's x holds 10 in 2 MiB, 11 in 8 MiB, 21 in 6 MiB\n" in shown, shown
