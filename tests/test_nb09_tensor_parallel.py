"""Notebook 09: tensor parallelism. The facts the notebook states, run with the notebook's
own definitions; the explorer driven headlessly; the exercise's check on the stub, the
solution and each usual mistake.

The notebook's ``def``, ``class``, import and constant statements are read from its code
cells (nothing else of the notebook runs here), so these tests check the code the learner
reads, not a copy of it.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from reducelab import LocalGroup
from reducelab.checks.tensor_parallel import check_row_parallel, reference
from reducelab.plots.tensor_parallel import MAX_HEIGHT
from reducelab.widgets.tensor_parallel import TensorParallelExplorer

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("keep_four_ranks")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "09_tensor_parallel.ipynb"


def notebook_definitions() -> dict:
    """Execute the notebook's imports, constants (UPPER_CASE names), functions and classes
    in a fresh namespace, as a kernel would; skip every other statement."""
    ns = {"__name__": "nb09_cells"}   # not importable: cloudpickle sends it all by value
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or src.lstrip().startswith("%"):
            continue
        keep = [node for node in ast.parse(src).body
                if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
                or (isinstance(node, ast.Assign) and all(
                    isinstance(n, ast.Name) and n.id.isupper()
                    for t in node.targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])))]
        exec(compile(ast.Module(keep, []), str(NOTEBOOK), "exec"), ns)
    return ns


NB = notebook_definitions()
Y_REF, GRADS_REF = NB["unsharded"]()
NB["y_ref"], NB["grads_ref"] = Y_REF, GRADS_REF     # differences() reads these globals
TOL = NB["TOL"]


# --- step 2: f and g by hand ----------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_by_hand_output_and_every_gradient_match_one_process(group, tp):
    group.resize(tp)
    out = group.run(NB["tp_mlp"])
    diff = NB["differences"](out)
    assert set(diff) == {"y", "x", "0.weight", "0.bias", "2.weight", "2.bias"}
    assert max(diff.values()) <= TOL, diff
    want = [("forward", "g", "all_reduce", (3, 4)), ("backward", "f", "all_reduce", (3, 4))]
    assert all(o[2] == want for o in out)


def test_without_f_only_the_input_gradient_is_wrong_and_its_sum_is_right(group):
    out = group.run(NB["tp_mlp"], False, True)
    diff = NB["differences"](out)
    assert sorted(k for k, d in diff.items() if d > TOL) == ["x"]
    assert all(o[2] == [("forward", "g", "all_reduce", (3, 4))] for o in out)
    summed = sum(o[1]["x"] for o in out)
    assert (summed - GRADS_REF["x"]).abs().max() <= TOL


def test_without_g_each_rank_holds_a_partial_sum_and_every_gradient_is_wrong(group):
    out = group.run(NB["tp_mlp"], True, False)
    ys = [o[0] for o in out]
    assert all(not torch.equal(ys[i], ys[j]) for i in range(4) for j in range(i + 1, 4))
    b2 = NB["make_mlp"]()[2].bias.detach()
    assert (sum(ys) - 3 * b2 - Y_REF).abs().max() <= TOL
    diff = NB["differences"](out)
    assert all(d > TOL for d in diff.values()), diff


# --- step 3: DTensor --------------------------------------------------------------------
def test_dtensor_placements_what_each_rank_holds_and_its_collectives(group):
    from torch.distributed.tensor import Partial, Replicate, Shard
    out = group.run(NB["dtensor_mlp"])
    table, counts = out[0][0], out[0][1]
    assert all(o[0] == table for o in out)
    assert table["param 0.weight"] == ("DTensor", (Shard(0),), (8, 4), (2, 4))
    assert table["param 0.bias"] == ("DTensor", (Shard(0),), (8,), (2,))
    assert table["param 2.weight"] == ("DTensor", (Shard(1),), (4, 8), (4, 2))
    assert table["param 2.bias"] == ("DTensor", (Replicate(),), (4,), (4,))
    assert table["h (Linear 1's output)"] == ("Tensor", "-", (3, 2), (3, 2))
    assert table["Linear 2's input"] == ("DTensor", (Shard(1),), (3, 8), (3, 2))
    assert table["Linear 2's raw output"] == ("DTensor", (Partial("sum"),), (3, 4), (3, 4))
    assert repr(Partial("sum")) == "Partial(sum)"
    assert table["y (the model's output)"][0] == "AsyncCollectiveTensor"
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert table[f"grad {name}"] == table[f"param {name}"]
    assert counts == {"forward": {"c10d_functional.all_reduce": 1},
                      "backward": {"c10d_functional.all_reduce": 1}}
    hand = group.run(NB["tp_mlp"])
    for d, h in zip(out, hand):
        assert (d[2] - Y_REF).abs().max() <= TOL
        assert (d[4] - GRADS_REF["x"]).abs().max() <= TOL
        assert max((d[3][n] - h[1][n]).abs().max().item() for n in d[3]) <= TOL
    assert group.run(NB["hand_counts"])[0] == {"forward": {"c10d.allreduce_": 1},
                                               "backward": {"c10d.allreduce_": 1}}


def test_without_an_input_gradient_backward_runs_no_collective(group):
    counts = group.run(NB["dtensor_mlp"], False)[0][1]
    assert (sum(counts["forward"].values()), sum(counts["backward"].values())) == (1, 0)


def test_visualize_sharding_prints_the_layout_on_rank_0_only(group):
    assert importlib.util.find_spec("tabulate"), "tabulate is a dependency (pyproject.toml)"
    out = group.run(NB["show_sharding"])
    assert out[1:] == [""] * 3                        # only mesh coordinate 0 prints
    tables = out[0]
    for line in ("0.weight: Shard(dim=0), global shape (8, 4)", "Row 0-1  cpu:0",
                 "Row 6-7  cpu:3", "2.weight: Shard(dim=1), global shape (4, 8)",
                 "Col 6-7", "2.bias: Replicate(), global shape (4,)", "Row 0-3  cpu:0,1,2,3"):
        assert line in tables, line
    assert "ValueError" not in tables


def test_the_notebook_shows_the_visualiser_and_keeps_one_pitfall():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "neither torch nor Reduce Lab installs" not in text
    assert "### What does not work here\nOne thing" in text
    shown = "".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code"
                    and "".join(c["source"]).startswith("from torch.distributed.tensor.debug "
                                                        "import visualize_sharding")
                    for o in c["outputs"])
    assert "Row 0-1  cpu:0" in shown and "ranks 1 to 3 printed: ['', '', '']" in shown


def test_a_comm_debug_mode_entered_again_for_backward_fails(group):
    assert group.run(NB["reused_comm_debug_mode"]) == ["KeyError: 'Sequential.0'"] * 4


# --- step 4: (dp, tp) -------------------------------------------------------------------
def mean_reference() -> dict:
    return {n: (NB["unsharded"](0)[1][n] + NB["unsharded"](1)[1][n]) / 2 for n in GRADS_REF}


def test_averaging_over_dp_only_is_right_and_over_tp_too_mixes_shards(group):
    NB["mean_ref"] = mean_ref = mean_reference()
    out = group.run(NB["dp_tp_step"], "dp")
    assert NB["wrong_grads"](out) == {(0, 0): [], (0, 1): [], (1, 0): [], (1, 1): []}
    out = group.run(NB["dp_tp_step"], "dp and tp")          # runs: no error
    wrong = NB["wrong_grads"](out)
    assert all(w == ["0.weight", "0.bias", "2.weight"] for w in wrong.values()), wrong
    mixed = (mean_ref["0.weight"][:4] + mean_ref["0.weight"][4:]) / 2
    assert (out[0][1]["0.weight"] - mixed).abs().max() <= TOL
    assert out[0][0] == (0, 0) and out[3][0] == (1, 1)


# --- step 5: the two splits -------------------------------------------------------------
def test_column_then_row_needs_one_collective_each_way_row_then_column_two(group):
    fwd = lambda calls, w: [(op, c) for when, op, c, _ in calls if when == w]  # noqa: E731
    calls = group.run(NB["tp_block"], "column-row", 8)[0][2]
    assert fwd(calls, "forward") == [("g", "all_reduce")]
    assert fwd(calls, "backward") == [("f", "all_reduce")]
    calls = group.run(NB["tp_block"], "row-column", 8)[0][2]
    assert fwd(calls, "forward") == [("g", "all_reduce"), ("gather", "all_gather")]
    assert fwd(calls, "backward") == [("f", "all_reduce"), ("f", "all_reduce")]


# --- the explorer -----------------------------------------------------------------------
@pytest.fixture()
def explorer(group):
    return TensorParallelExplorer(group, NB["tp_block"])


def test_the_explorer_starts_on_four_ranks_and_matches_one_process(explorer):
    r = explorer.result
    assert (r.tp, r.split, r.width) == (4, "column-row", 8)
    assert r.y_error <= 1e-5 and r.grad_error <= 1e-5 and r.same_calls
    assert [h["A"].shape for h in r.held] == [torch.Size([8, 2])] * 4
    assert bytes(explorer.image.value[:4]) == b"\x89PNG"
    text = explorer.text()
    assert "forward: 1 collective(s) per rank (g: all_reduce of 3×8)" in text
    assert "stays sharded (3×2 per rank)" in text and "equal one process's" in text


@pytest.mark.parametrize("tp, split, width", [(2, "row-column", 12), (1, "column-row", 4),
                                              (3, "row-column", 6), (4, "row-column", 12)])
def test_every_control_change_runs_real_ranks(explorer, group, tp, split, width):
    explorer.controls["width"].value = width
    explorer.controls["split"].value = split
    explorer.controls["tp"].value = tp
    r = explorer.result
    assert group.world_size == tp and (r.tp, r.split, r.width) == (tp, split, width)
    assert r.y_error <= 1e-5 and r.grad_error <= 1e-5
    n_fwd = 1 if split == "column-row" else 2
    assert len(r.collectives("forward")) == n_fwd == len(r.collectives("backward"))
    h_cols = width // tp if split == "column-row" else width
    assert all(h["h"].shape == (3, h_cols) for h in r.held)
    assert f"forward: {n_fwd} collective(s)" in explorer.message.value


def test_an_uneven_split_is_refused_with_the_valid_choices(explorer):
    explorer.controls["width"].value = 6
    assert explorer.result is None and explorer.error is not None
    assert "does not split into 4 equal shards" in explorer.error.reports[0].summary
    message = explorer.message.value
    assert "Pick tp 1, 2 or 3 for width 6, or width 4, 8 or 12 for tp 4" in message
    explorer.controls["width"].value = 12
    assert explorer.error is None and explorer.result.width == 12


def test_the_figure_fits_a_screen_at_every_setting(explorer):
    from PIL import Image
    import io
    for tp, width in [(1, 4), (4, 12), (2, 8)]:
        for split in ("row-column", "column-row"):
            explorer.controls["tp"].value = tp
            explorer.controls["width"].value = width
            explorer.controls["split"].value = split
            w, h = Image.open(io.BytesIO(explorer.image.value)).size
            assert w <= 960 and h <= MAX_HEIGHT * 100 + 1, (tp, width, split, w, h)


def drawn_figure(explorer):
    """The matplotlib figure behind the explorer's current PNG (caught as it is encoded)."""
    from reducelab import plots
    caught = []
    plots.AUDITS.append(caught.append)
    try:
        explorer.refresh()
    finally:
        plots.AUDITS.remove(caught.append)
    return caught[-1]


def test_the_figure_has_one_colour_scale_with_a_colour_bar_and_values_on_top(explorer):
    from matplotlib.image import AxesImage
    from reducelab.plots.tensor_parallel import COLOUR_BAR_LABEL
    explorer.controls["tp"].value = 1
    explorer.controls["width"].value = 4
    fig = drawn_figure(explorer)
    held = explorer.result.held[0]
    values = torch.cat([held[k].flatten() for k in ("x", "A", "h", "B", "partial", "y")])
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    assert COLOUR_BAR_LABEL + ":" in texts
    assert f"{values.min().item():.1f}" in texts and f"{values.max().item():.1f}" in texts
    assert any(isinstance(a, AxesImage) for ax in fig.axes for a in ax.get_children())
    # the blocks' image lies under the axes, so the values written in the cells show
    assert all(im.get_zorder() < ax.get_zorder() for im in fig.images for ax in fig.axes)
    assert f"{held['x'][0, 0].item():.1f}" in texts


def test_the_hatch_of_a_partial_sum_is_thin_and_light():
    import numpy as np
    from reducelab.plots.tensor_parallel import _paint_block
    values = np.linspace(0, 1, 12).reshape(3, 4)
    plain = np.zeros((200, 200, 4), dtype=np.uint8)
    hatched = plain.copy()
    _paint_block(plain, 0.1, 0.1, 0.4, 0.4, values, 0.0, 1.0, partial=False)
    _paint_block(hatched, 0.1, 0.1, 0.4, 0.4, values, 0.0, 1.0, partial=True)
    changed = (plain != hatched).any(axis=-1)
    assert 0.05 < changed.mean() / (plain[..., 3] > 0).mean() < 0.15   # most pixels keep colour
    assert (hatched[changed][:, :3] >= plain[changed][:, :3]).all()      # lighter, never darker


def test_bad_initial_values_name_the_choices(group):
    with pytest.raises(ValueError, match="tp must be one of 1, 2, 3, 4"):
        TensorParallelExplorer(group, NB["tp_block"], tp=8)
    with pytest.raises(ValueError, match="split must be one of column-row, row-column"):
        TensorParallelExplorer(group, NB["tp_block"], split="row")
    with pytest.raises(ValueError, match="width must be one of 4, 6, 8, 12"):
        TensorParallelExplorer(group, NB["tp_block"], width=5)


def test_the_explorer_on_a_closed_group_says_so(monkeypatch):
    # no open group to follow, as before the learner runs the setup cell again
    monkeypatch.setattr("reducelab.widgets.current_group", lambda: None)
    g = LocalGroup(world_size=2)
    ex = TensorParallelExplorer(g, NB["tp_block"])
    g.close()
    ex.controls["split"].value = "row-column"
    assert "closed" in ex.message.value and "setup cell" in ex.message.value


def test_the_explorer_follows_the_new_group_after_its_own_was_closed(group):
    """What the notebook's closing words promise: close, run the setup cell, go on."""
    g = LocalGroup(world_size=2)
    ex = TensorParallelExplorer(g, NB["tp_block"])
    g.close()
    newer = LocalGroup(world_size=2)              # the setup cell, run again
    try:
        ex.controls["split"].value = "row-column"
        assert ex.group is newer and ex.result is not None and ex.result.split == "row-column"
    finally:
        newer.close()


# --- the exercise -----------------------------------------------------------------------
SOLUTION_PATH = NOTEBOOK.parent / "solutions" / "09_row_parallel.py"
G = NB["G"]


def after_loading_the_solution() -> dict:
    """The kernel after the learner ran the notebook's cells, then ``%load``-ed the
    solution and ran it: the notebook's definitions, and the solution's over them."""
    ns = notebook_definitions()
    exec(compile(SOLUTION_PATH.read_text(), str(SOLUTION_PATH), "exec"), ns)
    return ns


def test_the_solution_defines_only_the_learners_function():
    tree = ast.parse(SOLUTION_PATH.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    assert defined == {"row_parallel_linear"}        # nothing of the notebook's is replaced


def test_after_loading_the_solution_the_cells_and_the_explorer_still_record_g(group):
    ns = after_loading_the_solution()
    assert check_row_parallel(group, ns["row_parallel_linear"])
    out = group.run(ns["tp_mlp"])
    assert out[0][2] == [("forward", "g", "all_reduce", (3, 4)),
                         ("backward", "f", "all_reduce", (3, 4))]
    explorer = TensorParallelExplorer(group, ns["tp_block"])
    assert "forward: 1 collective(s) per rank (g: all_reduce of 3×8)" in explorer.text()
    g = explorer._operators(explorer.result)["g"]
    assert (g.forward, g.backward) == ("all_reduce", "identity")


def test_the_solution_passes_at_tp_2_and_4_and_the_world_size_is_restored(group):
    verdict = check_row_parallel(group, after_loading_the_solution()["row_parallel_linear"])
    assert verdict, verdict.message
    assert "1 collective(s) in your forward and 0 in backward" in verdict.message
    assert group.world_size == 4


def test_the_notebooks_stub_fails_and_says_why(group):
    verdict = check_row_parallel(group, NB["row_parallel_linear"])
    assert not verdict and "returned None" in verdict.message
    assert group.world_size == 4


def no_sum(h_shard, weight_shard, bias):
    return h_shard @ weight_shard.T + bias


def bias_on_every_rank(h_shard, weight_shard, bias):
    return G.apply(h_shard @ weight_shard.T + bias, None)


def bias_on_rank_0_only(h_shard, weight_shard, bias):
    y = G.apply(h_shard @ weight_shard.T, None)
    return y + bias if dist.get_rank() == 0 else y


def bias_before_the_sum_on_rank_0(h_shard, weight_shard, bias):
    partial = h_shard @ weight_shard.T
    return G.apply(partial + bias if dist.get_rank() == 0 else partial, None)


def all_reduce_both_ways(h_shard, weight_shard, bias):
    import torch.distributed.nn.functional as dist_nn
    return dist_nn.all_reduce(h_shard @ weight_shard.T) + bias


def plain_all_reduce(h_shard, weight_shard, bias):
    partial = h_shard @ weight_shard.T
    dist.all_reduce(partial)
    return partial + bias


def sum_the_hidden_shards(h_shard, weight_shard, bias):
    h = h_shard.clone()
    dist.all_reduce(h)                       # a sum where an all_gather was needed
    return G.apply(h @ weight_shard.T, None) + bias


def gather_the_partial_outputs(h_shard, weight_shard, bias):
    partial = h_shard @ weight_shard.T
    pieces = [torch.empty_like(partial) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, partial)
    return torch.cat(pieces, dim=-1)


def detached(h_shard, weight_shard, bias):
    with torch.no_grad():
        return G.apply(h_shard @ weight_shard.T, None) + bias


@pytest.mark.parametrize("fn, words", [
    (no_sum, "That is this rank's partial sum"),
    (bias_on_every_rank, "plus 3 extra copies of the bias: every rank added the bias before"),
    (bias_on_rank_0_only, "It lacks the bias, on rank(s) 1, 2, 3"),
    (bias_before_the_sum_on_rank_0, "only rank(s) 0 got the bias's gradient"),
    (all_reduce_both_ways, "4 times too large: your sum runs an all_reduce in backward too"),
    (plain_all_reduce, "autograd ran backward through dist.all_reduce itself"),
    (sum_the_hidden_shards, "summing the ranks' h_shard tensors first"),
    (gather_the_partial_outputs, "an all_gather concatenates them"),
    (detached, "no gradient reached h_shard or weight_shard"),
])
def test_each_usual_mistake_gets_its_explanation(group, fn, words):
    verdict = check_row_parallel(group, fn, tps=(4,))
    assert not verdict and words in verdict.message, verdict.message
    assert "G.apply" not in verdict.message and "return" not in verdict.message


def test_the_bias_mistake_at_tp_2_counts_one_extra_copy(group):
    verdict = check_row_parallel(group, bias_on_every_rank)
    assert "At tp=2" in verdict.message and "1 extra copy of the bias" in verdict.message


def test_the_reference_is_nn_linear():
    from reducelab.checks.tensor_parallel import layer_tensors
    t, ref = layer_tensors(), reference()
    layer = torch.nn.Linear(8, 4)
    with torch.no_grad():
        layer.weight.copy_(t["weight"])
        layer.bias.copy_(t["bias"])
    assert torch.allclose(layer(t["h"]), ref["out"])


def test_the_check_cell_is_the_check_and_its_import_is_in_the_setup_cell():
    code = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
            if c["cell_type"] == "code"]
    setup = next(c for c in code if "group = LocalGroup(" in c)
    assert "from reducelab.checks.tensor_parallel import check_row_parallel" in setup
    after_stub = code[code.index(next(c for c in code if c.startswith(
        "# %load solutions/09_row_parallel.py"))) + 1]
    assert after_stub == "check_row_parallel(group, row_parallel_linear)"


# --- predictions stay unspoiled -----------------------------------------------------------
def cells():
    return [("".join(c["source"]), c) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def test_nothing_before_question_1_answers_it():
    all_cells = cells()
    q = next(k for k, (src, _) in enumerate(all_cells) if src.startswith("answer_1 = None"))
    before = "\n".join(src for src, _ in all_cells[:q])
    assert "only counts the paths through its own hidden units" not in before
    assert "needed no collective" not in before and "need no collective" not in before
    question = all_cells[q + 1][0]
    assert 'o[1]["x"]' not in question and "summed_x_grad" not in question
    assert "the weight gradients need no collective at all" in question   # in the why
    follow_up = next(src for src, c in all_cells[q + 2:] if c["cell_type"] == "code")
    assert follow_up.startswith("summed_x_grad = sum(")


def test_question_3_does_not_say_whether_it_raises():
    all_cells = cells()
    q = next(k for k, (src, _) in enumerate(all_cells) if src.startswith("answer_3 = None"))
    question = all_cells[q + 1][0]
    code = [line for line in question.splitlines() if not line.startswith("group.resize(")]
    assert "#" not in code[0]
    assert "it runs" not in question.split("reveal(")[0]


# --- myth vs reality ----------------------------------------------------------------------
def test_a_plain_all_reduce_in_forward_backprops_as_identity_with_a_deprecation_warning(group):
    out = group.run(NB["plain_all_reduce_in_forward"])
    for rank, (grad, caught) in enumerate(out):
        assert torch.equal(grad, torch.full((3,), rank + 1.0))
        assert any("an autograd kernel was not registered" in c and "deprecated" in c
                   for c in caught)


def test_the_warning_is_printed_whole_and_says_what_the_text_quotes(group):
    import re
    import textwrap
    caught = group.run(NB["plain_all_reduce_in_forward"])[1][1]
    warning = next(c for c in caught if "an autograd kernel was not registered" in c)
    all_cells = cells()
    k = next(k for k, (src, _) in enumerate(all_cells)
             if src.startswith("def plain_all_reduce_in_forward():"))
    shown = "".join("".join(o.get("text", "")) for o in all_cells[k][1]["outputs"])
    assert "torch warned: " + textwrap.fill(warning, 100) in shown       # all of it
    quotes = re.findall(r'"([^"]+)"', all_cells[k + 1][0].split("**Claim")[0])
    assert len(quotes) == 2
    for quote in quotes:
        assert quote in warning, quote


def test_torch_distributed_nn_all_reduce_sums_in_backward_too(group):
    out = group.run(NB["differentiable_all_reduce"])
    for rank, (grad, caught) in enumerate(out):
        assert torch.equal(grad, torch.full((3,), 4 * (rank + 1.0)))
        assert any("torch.distributed.nn.functional.all_reduce is deprecated" in c
                   for c in caught)
