"""Notebook 09: tensor parallelism. The facts the notebook states, run with the notebook's
own definitions; what its stored outputs say, re-derived; the explorer driven headlessly;
the exercise's check on the stub, the solution and each likely mistake.

The notebook's ``def``, ``class``, import and constant statements are read from its code
cells (nothing else of the notebook runs here), so these tests check the code the learner
reads, not a copy of it.
"""
from __future__ import annotations

import ast
import html
import io
import json
import pathlib
import re
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from conftest import record_calls, top_level_names
from reducelab import LocalGroup
from reducelab.checks.answers import WHY
from reducelab.checks.tensor_parallel import (DIM, IDS_SHAPE, VOCAB, check_vocab_parallel_embedding,
                                              layer_tensors, reference)
from reducelab.plots.tensor_parallel import (COLOUR_BAR_LABEL, MAX_HEIGHT, MIN_CELL, VALUE_GID,
                                             Diagram, Operator, Stage, draw_diagram)
from reducelab.widgets.tensor_parallel import TP_DEGREES, WIDTHS, TensorParallelExplorer

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
SEQ, BATCH, EMBED = NB["SEQ"], NB["BATCH"], NB["EMBED"]
WHOLE = (SEQ, BATCH, EMBED)


def cells():
    return [("".join(c["source"]), c) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def shown(start: str) -> str:
    """Everything the code cell starting with ``start`` shows (streams and text/html,
    the html unescaped), as committed."""
    src, cell = next((s, c) for s, c in cells() if s.startswith(start))
    parts = []
    for o in cell["outputs"]:
        parts.append("".join(o.get("text", "")))
        data = o.get("data", {})
        parts.append(html.unescape("".join(data.get("text/html", data.get("text/plain", "")))))
    return "\n".join(parts)


def real_result(start: str) -> str:
    """What the folded verdict of the question cell starting with ``start`` says the real run gave."""
    return re.search(r"The real run gives (.+?)\. ", shown(start)).group(1)


def test_the_header_gives_study_time_and_run_time():
    header = cells()[0][0]
    assert re.search(r"\*About (3\d|4[0-5]) min to study · about \d+ s to run top to bottom · "
                     r"world sizes 1 to 4 · CPU only \(gloo\)"
                     r"( · parts marked optional: about \d+ min more, after the lesson)?\*", header), \
        header[:200]


# --- step 2: f and g by hand ----------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_by_hand_output_and_every_gradient_match_one_process(group, tp):
    group.resize(tp)
    out = group.run(NB["tp_mlp"])
    diff = NB["differences"](out)
    assert set(diff) == {"y", "x", "0.weight", "0.bias", "2.weight", "2.bias"}
    assert max(diff.values()) <= TOL, diff
    want = [("forward", "g", "all_reduce", WHOLE), ("backward", "f", "all_reduce", WHOLE)]
    assert all(o[2] == want for o in out)


def test_without_f_only_the_input_gradient_is_wrong_and_its_sum_is_right(group):
    out = group.run(NB["tp_mlp"], False, True)
    diff = NB["differences"](out)
    assert sorted(k for k, d in diff.items() if d > TOL) == ["x"]
    assert all(o[2] == [("forward", "g", "all_reduce", WHOLE)] for o in out)
    summed = sum(o[1]["x"] for o in out)
    assert (summed - GRADS_REF["x"]).abs().max() <= TOL
    assert real_result("group.resize(4)                      # this question's world size, "
                       "whatever the explorer left\nout = group.run(tp_mlp, False") == "['x']"


def test_without_g_every_rank_holds_a_partial_sum_and_every_gradient_is_wrong(group):
    """What the summary says: without g, every rank works on a partial sum."""
    out = group.run(NB["tp_mlp"], True, False)
    ys = [o[0] for o in out]
    b2 = NB["make_mlp"]()[2].bias.detach()
    assert (sum(ys) - 3 * b2 - Y_REF).abs().max() <= TOL
    assert all(d > TOL for d in NB["differences"](out).values())


# --- step 3: attention by heads ---------------------------------------------------------
def torch_attention():
    """nn.MultiheadAttention's output and gradients on the notebook's input and loss."""
    mha, x = NB["make_attention"](), NB["make_input"]()
    y = mha(x, x, x, attn_mask=NB["CAUSAL"], need_weights=False)[0]
    NB["loss_fn"](y).backward()
    return y.detach(), x.grad, mha


def test_attention_with_every_head_is_torchs_multihead_attention():
    y, _, _ = torch_attention()
    every = NB["shard_attention"](0, 1)
    x = NB["make_input"]().detach()
    assert (NB["attention"](x, every) + every["o.bias"] - y).abs().max() <= TOL


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_split_by_heads_matches_torch_with_one_collective_each_way(group, tp):
    group.resize(tp)
    y, x_grad, mha = torch_attention()
    out = group.run(NB["attention_on_ranks"])
    for o in out:
        assert (o[0] - y).abs().max() <= TOL and (o[1] - x_grad).abs().max() <= TOL
        assert (o[2]["o.bias"] - mha.out_proj.bias.grad).abs().max() <= TOL
        assert o[3] == [("forward", "g", "all_reduce", WHOLE), ("backward", "f", "all_reduce", WHOLE)]
    qkv = torch.cat([torch.cat([o[2][f"{n}.weight"] for o in out]) for n in "qkv"])
    assert (qkv - mha.in_proj_weight.grad).abs().max() <= TOL
    qkv_bias = torch.cat([torch.cat([o[2][f"{n}.bias"] for o in out]) for n in "qkv"])
    assert (qkv_bias - mha.in_proj_bias.grad).abs().max() <= TOL
    w_o = torch.cat([o[2]["o.weight"] for o in out], dim=1)
    assert (w_o - mha.out_proj.weight.grad).abs().max() <= TOL


def test_question_2_stored_answer_is_one_forward_collective():
    assert real_result("group.resize(4)                      # this question's world size, "
                       "whatever the explorer left\ncalls = group.run(attention_on_ranks)") == "1"


# --- step 4: the two splits -------------------------------------------------------------
def test_column_then_row_needs_one_collective_each_way_row_then_column_two(group):
    fwd = lambda calls, w: [(op, c) for when, op, c, _ in calls if when == w]  # noqa: E731
    calls = group.run(NB["tp_block"], "column-row", 8)[0][2]
    assert fwd(calls, "forward") == [("g", "all_reduce")]
    assert fwd(calls, "backward") == [("f", "all_reduce")]
    calls = group.run(NB["tp_block"], "row-column", 8)[0][2]
    assert fwd(calls, "forward") == [("g", "all_reduce"), ("gather", "all_gather")]
    assert fwd(calls, "backward") == [("f", "all_reduce"), ("f", "all_reduce")]


def test_question_3_stored_answer_is_two_forward_collectives():
    assert real_result("group.resize(4)                      # this question's world size, "
                       "whatever the explorer left\ncalls = group.run(tp_block") == "2"


def test_the_explorers_values_are_small_integers_whose_sums_can_be_checked_by_eye(group):
    for split in ("column-row", "row-column"):
        held = group.run(NB["tp_block"], split, 12)[0][0]
        for t in held.values():
            assert torch.equal(t, t.round()) and t.abs().max() < 100


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
    assert "forward: 1 collective(s) per rank (g: all_reduce of 1×8)" in text
    assert "stays sharded (1×2 per rank)" in text and "equal one process's" in text


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
    assert all(h["h"].shape == (1, h_cols) for h in r.held)
    assert f"forward: {n_fwd} collective(s)" in explorer.message.value


def test_an_uneven_split_is_refused_with_the_valid_choices(explorer):
    explorer.controls["width"].value = 6
    assert explorer.result is None and explorer.error is not None
    assert "does not split into 4 equal shards" in explorer.error.reports[0].summary
    message = explorer.message.value
    assert "Pick tp 1, 2 or 3 for width 6, or width 4, 8 or 12 for tp 4" in message
    explorer.controls["width"].value = 12
    assert explorer.error is None and explorer.result.width == 12


def drawn_figure(explorer):
    """The matplotlib figure behind the explorer's current PNG (caught as it is encoded)."""
    from reducelab import plots
    caught = []
    plots.AUDITS.append(caught.append)
    explorer._pngs.clear()      # a state drawn before would come from the figure cache
    try:
        explorer.refresh()
    finally:
        plots.AUDITS.remove(caught.append)
    return caught[-1]


def test_every_value_is_written_and_fits_its_cell_at_every_setting_offered(explorer):
    """The issue: the explorer showed no values at some widths. Every tp, width and split
    it offers writes every element's value, inside its cell."""
    from PIL import Image
    seen = 0
    for split in ("column-row", "row-column"):
        for width in WIDTHS:
            for tp in TP_DEGREES:
                if width % tp:
                    continue
                explorer.controls["width"].value = width
                explorer.controls["split"].value = split
                explorer.controls["tp"].value = tp
                fig = drawn_figure(explorer)
                diagram = explorer.diagram(explorer.result)
                cells_ = sum(s.lines() * s.tokens * s.whole_columns
                             for s in diagram.items if isinstance(s, Stage))
                values = [t for t in fig.findobj(lambda a: getattr(a, "get_gid", lambda: None)()
                                                 == VALUE_GID)]
                assert len(values) == cells_, (split, width, tp)
                renderer = fig.canvas.get_renderer()
                cell_px = MIN_CELL * 100
                assert max(t.get_window_extent(renderer).width for t in values) < cell_px - 4
                w, h = Image.open(io.BytesIO(explorer.image.value)).size
                assert w == 960 and h <= MAX_HEIGHT * 100 + 1, (split, width, tp, w, h)
                seen += 1
    assert seen == 26


def test_the_figure_has_one_colour_scale_with_a_colour_bar_and_values_on_top(explorer):
    from matplotlib.image import AxesImage
    explorer.controls["tp"].value = 1
    explorer.controls["width"].value = 4
    fig = drawn_figure(explorer)
    held = explorer.result.held[0]
    values = torch.cat([held[k].flatten() for k in ("x", "h", "partial", "y")])
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    assert COLOUR_BAR_LABEL + ":" in texts
    assert f"{values.min().item():.0f}" in texts and f"{values.max().item():.0f}" in texts
    assert any(isinstance(a, AxesImage) for ax in fig.axes for a in ax.get_children())
    assert all(im.get_zorder() < ax.get_zorder() for im in fig.images for ax in fig.axes)


def test_a_stage_that_differs_across_ranks_is_drawn_once_per_rank_not_as_the_same():
    stage = Stage("y", [torch.ones(1, 4).numpy(), torch.zeros(1, 4).numpy()], "each")
    assert stage.lines() == 2
    assert Stage("y", [torch.ones(1, 4).numpy()] * 2, "same").lines() == 1
    with pytest.raises(ValueError, match="kind must be one of same, sharded, partial, each"):
        Stage("y", [torch.ones(1, 4).numpy()], "whole")
    with pytest.raises(ValueError, match="wider than the 12"):
        draw_diagram(Diagram("t", [Stage("y", [torch.ones(1, 13).numpy()])]))


def test_a_diagram_drawn_into_a_kept_figure_has_a_fresh_figure_s_pixels(monkeypatch):
    """draw_diagram keeps a figure per height and empties it for the next diagram of that
    height: diagrams of two heights drawn in turn (values, colour scales, widths, a
    partial sum and a note that come and go) give the bytes a new figure gives each, and the second
    diagram of a height adds no axes."""
    import numpy as np
    from matplotlib.figure import Figure
    from reducelab.plots import tensor_parallel as tp_plots
    rng = np.random.default_rng(0)

    def diagram(seed: int, kind: str, note: str = "", columns: int = 4) -> Diagram:
        values = [np.round(rng.normal(seed, 3, (2, columns)), 2) for _ in range(2)]
        return Diagram(f"diagram {seed}", [Stage("x", values, kind),
                                           Operator("Linear", "all_reduce", "identity"),
                                           Stage("y", [v * seed for v in values], "same")],
                       subtitle="a subtitle" if seed % 2 else "", note=note)

    diagrams = [diagram(1, "partial", "a note"), diagram(2, "each"), diagram(3, "partial", columns=3),
                diagram(4, "each", "another note")]
    monkeypatch.setattr(tp_plots, "_FIGURES", tp_plots.collections.OrderedDict())
    kept = [draw_diagram(d) for d in diagrams]
    assert len(tp_plots._FIGURES) == 2                  # two heights, one figure each
    made = record_calls(monkeypatch, Figure, "add_axes")
    assert draw_diagram(diagrams[0]) == kept[0] and made == []
    fresh = []
    for d in diagrams:
        tp_plots._FIGURES.clear()
        fresh.append(draw_diagram(d))
    assert kept == fresh


def test_the_hatch_of_a_partial_sum_is_thin_and_light():
    import numpy as np
    from reducelab.plots.tensor_parallel import _paint
    values = np.linspace(0, 1, 12).reshape(3, 4)
    plain = np.zeros((200, 300, 4), dtype=np.uint8)
    hatched = plain.copy()
    _paint(plain, 0.1, 0.1, 0.5, values, 0.0, 1.0, partial=False)
    _paint(hatched, 0.1, 0.1, 0.5, values, 0.0, 1.0, partial=True)
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
SOLUTION_PATH = NOTEBOOK.parent / "solutions" / "09_vocab_parallel_embedding.py"
G = NB["G"]
E = torch.nn.functional.embedding


def after_loading_the_solution() -> dict:
    """The kernel after the learner ran the notebook's cells, then ``%load``-ed the
    solution and ran it: the notebook's definitions, and the solution's over them."""
    ns = notebook_definitions()
    exec(compile(SOLUTION_PATH.read_text(), str(SOLUTION_PATH), "exec"), ns)
    return ns


def test_the_solution_defines_only_the_learners_function():
    assert top_level_names(SOLUTION_PATH) == {"vocab_parallel_embedding"}  # nothing else replaced


def test_the_solution_passes_at_tp_2_and_3_and_the_world_size_is_restored(group):
    verdict = check_vocab_parallel_embedding(group, after_loading_the_solution()["vocab_parallel_embedding"])
    assert verdict, verdict.message
    assert "1 collective(s) in your forward and 0 in backward" in verdict.message
    assert group.world_size == 4


def test_after_loading_the_solution_the_cells_and_the_explorer_still_record_g(group):
    ns = after_loading_the_solution()
    out = group.run(ns["tp_mlp"])
    assert out[0][2] == [("forward", "g", "all_reduce", WHOLE), ("backward", "f", "all_reduce", WHOLE)]
    explorer = TensorParallelExplorer(group, ns["tp_block"])
    g = explorer._operators(explorer.result)["g"]
    assert (g.forward, g.backward) == ("all_reduce of 1×8", "identity")


def test_the_notebooks_stub_fails_and_says_why(group):
    verdict = check_vocab_parallel_embedding(group, NB["vocab_parallel_embedding"])
    assert not verdict and "returned None" in verdict.message
    assert group.world_size == 4
    assert "rank 0 returned None" in shown("check_vocab_parallel_embedding(")


def _mine(ids, w):
    k = w.shape[0]
    first = dist.get_rank() * k
    return k, first, (ids >= first) & (ids < first + k)


def global_ids_as_rows(ids, w):
    return G.apply(E(ids, w), None)


def no_sum(ids, w):
    k, first, m = _mine(ids, w)
    return E(torch.where(m, ids - first, 0), w) * m.unsqueeze(-1)


def others_not_zeroed(ids, w):
    k, first, m = _mine(ids, w)
    return G.apply(E(torch.where(m, ids - first, 0), w), None)


def clamped(ids, w):
    k, first, _ = _mine(ids, w)
    return G.apply(E((ids - first).clamp(0, k - 1), w), None)


def modulo(ids, w):
    return G.apply(E(ids % w.shape[0], w), None)


def concatenated(ids, w):
    share = no_sum(ids, w)
    pieces = [torch.empty_like(share) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, share.contiguous())
    return torch.cat(pieces, -1)


def first_id_left_out(ids, w):
    k, first, _ = _mine(ids, w)
    m = (ids > first) & (ids < first + k)
    return G.apply(E(torch.where(m, ids - first, 0), w) * m.unsqueeze(-1), None)


def next_ranks_first_id_let_in(ids, w):
    k, first, _ = _mine(ids, w)
    m = (ids >= first) & (ids <= first + k)
    return G.apply(E(torch.where(m, ids - first, 0), w) * m.unsqueeze(-1), None)


def ids_changed_in_place(ids, w):
    k, first, m = _mine(ids, w)
    ids -= first
    ids[~m] = 0
    return G.apply(E(ids, w) * m.unsqueeze(-1), None)


def whole_table_gathered(ids, w):
    pieces = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, w.detach())
    pieces[dist.get_rank()] = w
    return E(ids, torch.cat(pieces))


def whole_table_all_reduced(ids, w):
    k, first, _ = _mine(ids, w)
    table = torch.zeros(k * dist.get_world_size(), w.shape[1])
    table[first:first + k] = w.detach()
    dist.all_reduce(table)
    return E(ids, torch.cat([table[:first], w, table[first + k:]]))


def all_reduce_both_ways(ids, w):
    import torch.distributed.nn.functional as dist_nn
    return dist_nn.all_reduce(no_sum(ids, w))


def plain_all_reduce(ids, w):
    share = no_sum(ids, w)
    dist.all_reduce(share)
    return share


def cut_off(ids, w):
    with torch.no_grad():
        return G.apply(no_sum(ids, w), None)


class F(torch.autograd.Function):
    """Notebook 09's step 2 defines a class F (Megatron-LM's f), which hides
    ``torch.nn.functional`` imported as F (fifth review, 09-2)."""


def functional_shadowed(ids, w):
    return F.embedding(ids, w)


@pytest.mark.parametrize("fn, words", [
    (functional_shadowed, "F is step 2's autograd Function (Megatron-LM's f)"),
    (global_ids_as_rows, "IndexError: index out of range in self. A rank looked up a row its "
                         "shard does not have"),
    (no_sum, "this rank's share only"),
    (others_not_zeroed, "their ids replaced by row 0"),
    (clamped, "their ids clamped into the shard"),
    (modulo, "their ids taken modulo the shard's size"),
    (concatenated, "an all_gather concatenates them"),
    (first_id_left_out, "Only the tokens with ids 0 and 6 are wrong: the first id of a rank's range"),
    (next_ranks_first_id_let_in, "let through an id of the next rank's range"),
    (ids_changed_in_place, "wrote into the ids it was given (in place)"),
    (whole_table_gathered, "sent rows of the table between the ranks (c10d.allgather_ "),
    (whole_table_all_reduced, "no rank ever holds the whole table"),
    (all_reduce_both_ways, "2 times too large: your sum runs an all_reduce in backward too"),
    (plain_all_reduce, "autograd ran backward through dist.all_reduce itself"),
    (cut_off, "no gradient reached weight_shard"),
])
def test_each_likely_mistake_gets_its_explanation(group, fn, words):
    verdict = check_vocab_parallel_embedding(group, fn)
    assert not verdict and words in verdict.message, verdict.message
    solution = [line.strip() for line in SOLUTION_PATH.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert not any(line in verdict.message for line in solution[1:])
    assert "G.apply" not in verdict.message and "torch.where" not in verdict.message


def test_at_tp_3_the_offsets_are_not_a_power_of_two(group):
    """tp=3 catches a solution that works only when the shard's size divides nicely."""
    ns = after_loading_the_solution()
    assert check_vocab_parallel_embedding(group, ns["vocab_parallel_embedding"], tps=(3,))
    verdict = check_vocab_parallel_embedding(group, first_id_left_out, tps=(3,))
    assert "ids 0, 4 and 8 are wrong" in verdict.message


def test_the_exercise_ids_cover_every_row_and_the_reference_is_nn_embedding():
    t, ref = layer_tensors(), reference()
    assert tuple(t["ids"].shape) == IDS_SHAPE and set(t["ids"].flatten().tolist()) == set(range(VOCAB))
    emb = torch.nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        emb.weight.copy_(t["table"])
    out = emb(t["ids"])
    (out * t["upstream"]).sum().backward()
    assert torch.allclose(out, ref["out"]) and torch.allclose(emb.weight.grad, ref["table_grad"])


def torch_rowwise_embedding():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    t = layer_tensors()
    emb = torch.nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        emb.weight.copy_(t["table"])
    parallelize_module(emb, init_device_mesh("cpu", (dist.get_world_size(),)),
                       RowwiseParallel(input_layouts=Replicate()))
    with CommDebugMode() as comm:
        out = emb(t["ids"])
    return out.detach().clone(), emb.weight.placements, comm.get_total_counts()   # clone waits


def test_torchs_rowwise_parallel_shards_an_embedding_by_rows_as_the_pass_message_says(group):
    from torch.distributed.tensor import Shard
    group.resize(3)
    out = group.run(torch_rowwise_embedding)
    for y, placements, collectives in out:
        assert (y - reference()["out"]).abs().max() <= TOL
        assert placements == (Shard(0),) and collectives == 1


def test_the_check_cell_is_the_check_and_its_import_is_in_the_setup_cell():
    code = [src for src, c in cells() if c["cell_type"] == "code"]
    setup = next(c for c in code if "group = LocalGroup(" in c)
    assert "from reducelab.checks.tensor_parallel import check_vocab_parallel_embedding" in setup
    after_stub = code[code.index(next(c for c in code if c.startswith(
        "# %load solutions/09_vocab_parallel_embedding.py"))) + 1]
    assert after_stub == "check_vocab_parallel_embedding(group, vocab_parallel_embedding)"


# --- predictions stay unspoiled -----------------------------------------------------------
def test_nothing_before_question_1_answers_it():
    all_cells = cells()
    q = next(k for k, (src, _) in enumerate(all_cells) if src.startswith("answer_1 = None"))
    before = "\n".join(src for src, _ in all_cells[:q])
    assert "needed no collective" not in before and "need no collective" not in before
    question = all_cells[q + 1][0]
    assert 'o[1]["x"]' not in question and "summed_x_grad" not in question
    assert "the weight gradients need no collective at all" in WHY["09"][1]   # in the why
    follow_up = next(src for src, c in all_cells[q + 2:] if c["cell_type"] == "code")
    assert follow_up.startswith("summed_x_grad = sum(")


# --- on GPUs with NCCL: what the installed torch says ------------------------------------------
def test_the_nccl_part_prints_torchs_own_words_and_says_what_was_not_run():
    from datetime import timedelta
    from torch.distributed import constants
    text = shown("from torch.distributed import constants")
    assert constants.default_pg_timeout == timedelta(minutes=30)
    assert "default timeout, gloo and the other backends: 0:30:00" in text
    assert ("init_process_group's docstring: Default value is 10 minutes for NCCL and 30 minutes "
            "for other backends.") in text
    assert "Letting the current stream block on the completion of the NCCL work." in \
        " ".join(text.split())
    prose = next(src for src, _ in cells() if src.startswith("## On GPUs with NCCL"))
    assert "Nothing in this part was run here" in prose
    assert prose.startswith("## On GPUs with NCCL (optional, after the lesson)\n")   # review 5


def test_the_output_side_is_named_after_the_exercise():
    """Fifth review, 09-3: after the exercise, one sentence on the vocab-parallel LM head
    and Megatron-LM's vocab-parallel cross-entropy, which all-reduces per-token numbers
    (max: ReduceOp.MAX; target logit and sum of exponentials: SUM), never the logits."""
    prose = next(src for src, _ in cells() if src.startswith("Stuck?"))
    for fact in ("LM head", "split by vocabulary", "cross-entropy", "largest logit",
                 "sum of exponentials", "never the logits", "Shoeybi et al. 2019"):
        assert fact in prose, fact


# --- myth vs reality ----------------------------------------------------------------------
def test_a_plain_all_reduce_in_forward_backprops_as_identity_with_a_deprecation_warning(group):
    out = group.run(NB["plain_all_reduce_in_forward"])
    for rank, (grad, caught) in enumerate(out):
        assert torch.equal(grad, torch.full((3,), rank + 1.0))
        assert any("an autograd kernel was not registered" in c and "deprecated" in c
                   for c in caught)


def test_the_warning_is_printed_whole_and_says_what_the_text_quotes(group):
    import textwrap
    caught = group.run(NB["plain_all_reduce_in_forward"])[1][1]
    warning = next(c for c in caught if "an autograd kernel was not registered" in c)
    all_cells = cells()
    k = next(k for k, (src, _) in enumerate(all_cells)
             if src.startswith("def plain_all_reduce_in_forward():"))
    printed = "".join("".join(o.get("text", "")) for o in all_cells[k][1]["outputs"])
    assert "torch warned: " + textwrap.fill(warning, 100) in printed       # all of it
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


def test_the_nccl_part_gives_the_local_groups_own_process_group_timeout():
    """A LocalGroup of timeout T gives its ranks' process group T + 5 s (test_nb11 runs it:
    test_localgroup_gives_its_ranks_a_process_group_timeout_5_s_longer); the text once said
    30 s, the group's own timeout, for the process group's."""
    text = "\n".join(src for src, c in cells() if c["cell_type"] == "markdown")
    assert "30 s in a `LocalGroup`" not in text
    assert "35 s in this notebook's `LocalGroup` (its 30 s plus 5" in text
    setup = next(src for src, c in cells() if "group = LocalGroup(" in src)
    assert "group = LocalGroup(world_size=4)" in setup      # the default timeout, 30 s


def test_nothing_before_question_3_counts_the_row_then_column_collectives():
    all_cells = cells()
    q = next(k for k, (src, _) in enumerate(all_cells) if src.startswith("answer_3 = None"))
    before = "\n".join(src for src, _ in all_cells[:q])
    for spoiler in ("two collectives", "2 collectives", "Two: g's", "Column → row needs one"):
        assert spoiler not in before, spoiler
    assert "Column → row needs one" in WHY["09"][3]


def test_the_gqa_sentence_comes_after_question_2_and_names_its_source():
    """A review asked about grouped-query attention with fewer key/value heads than tp ranks.
    Megatron-LM's main branch (August 2026) answers it: TransformerConfig raises unless
    num_query_groups is a multiple or a divisor of tensor_model_parallel_size, and
    SelfAttention.get_query_key_value_tensors all-gathers the fused QKV output and keeps the
    slice of the key/value head a rank's query heads share. The sentence sits after question
    2's reveal (it names an all_gather, which would prime a count of collectives), cites that
    code and claims nothing else. Review 6 (09-3) moved it from step 3 to Further reading:
    no core minute for it."""
    all_cells = cells()
    reveal_2 = next(k for k, (src, _) in enumerate(all_cells) if "reveal(answer_2" in src)
    gqa = [k for k, (src, _) in enumerate(all_cells) if "grouped-query attention" in src.lower()]
    assert len(gqa) == 1 and gqa[0] > reveal_2, (gqa, reveal_2)
    assert all_cells[gqa[0]][0].startswith("## Further reading")
    text = " ".join(all_cells[gqa[0]][0].split())
    for fact in ("a multiple or a divisor of `tp`", "all-gathers", "several ranks hold the same one",
                 "`SelfAttention.get_query_key_value_tensors` in `megatron/core/transformer/attention.py`",
                 "`TransformerConfig`", "August 2026"):
        assert fact in text, fact


def test_f_says_every_tp_rank_must_be_fed_the_same_batch(group):
    """Review 6 (09-2): f's forward is the identity because every tp rank reads the same x; the
    text says so where f is taught, and that a loader sharded by global rank trains wrong with
    no error. Run: tp_mlp with each rank fed its own x raises nothing, and its output differs
    from one process's on any one of those inputs."""
    f_cell = next(src for src, _ in cells() if "- **f** starts the column-parallel layer" in src)
    assert ("so every `tp` rank must be fed the same batch: a data loader sharded by global rank "
            "instead of by `dp` rank feeds them different tokens, and the model trains wrong "
            "without an error") in f_cell
    group.resize(4)
    out = group.run(_tp_mlp_on_its_own_batch)
    for rank, (y, wants) in enumerate(out):
        assert torch.isfinite(y).all()                                       # no error, no NaN
        assert all(not torch.allclose(y, w, atol=1e-3) for w in wants), rank   # matches no input's
        assert torch.equal(y, out[0][0])          # g's sum: every rank holds the same wrong output



def _tp_mlp_on_its_own_batch():
    """Every rank's shards, but each rank fed its own input (seed 100 + rank), through f and g."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    p = NB["shard_mlp"](rank, tp)
    y = NB["tp_forward"](NB["make_input"](100 + rank), p).detach()
    wants = [NB["unsharded"](100 + r)[0] for r in range(tp)]     # one process on each rank's input
    return y, wants


def test_questions_2_and_3_are_asked_before_the_code_that_answers_them_by_a_count():
    """Review 6 (09-1): questions 2 and 3 followed tp_attention and tp_block, whose
    `.apply` calls a learner could count instead of reasoning. Each answer cell now comes
    before the cell that defines the function it asks about, and the prompt says so; the
    reveal still runs that function, after it."""
    all_cells = cells()
    def first(text):
        return next(k for k, (src, _) in enumerate(all_cells) if text in src)
    for q, defines, reveal_call in ((2, "def tp_attention(", "reveal(answer_2"),
                                    (3, "def tp_block(", "reveal(answer_3")):
        asked = first(f"**Question {q}.**")
        assert "Answer it before you read the code below." in all_cells[asked][0]
        assert asked < first(f"answer_{q} = None") < first(defines) < first(reveal_call)
        between = "\n".join(src for src, _ in all_cells[:first(f"answer_{q} = None")])
        assert defines not in between


def test_the_summary_says_what_tp_buys_and_what_it_costs():
    """Review 7 (09-1): the core never said what tensor parallelism buys (1/tp of a split
    layer's weights, gradients, optimizer state and matrix products) nor what it costs (an
    all_reduce of the whole activation per block, forward and backward, every micro-batch,
    which the next layer waits for), against data parallelism's once per step, overlapped.
    The collectives per block are the ones step 2 counts on the ranks."""
    summary = next(src for src, _ in cells() if src.startswith("## Summary"))
    for fact in ("What `tp` buys: each rank keeps `1/tp` of a split layer's weights, gradients and "
                 "optimizer state, and does `1/tp` of its matrix products.",
                 "What it costs: an all_reduce of the whole activation per block, forward and backward, "
                 "every micro-batch, which the next layer waits for.",
                 "Data parallelism all-reduces the gradients once per step, overlapped with backward "
                 "(notebook 16)", "(Narayanan et al. 2021)"):
        assert fact in summary, fact
    assert "Narayanan et al. (2021)" in next(src for src, _ in cells() if src.startswith("## Further reading"))
