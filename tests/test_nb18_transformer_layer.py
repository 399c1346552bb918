"""Notebook 18: a whole transformer layer over tp and dp (split from notebook 09). The
facts the notebook states, run with the notebook's own definitions (read from its code
cells by conftest.notebook_module) on real gloo ranks; what its stored outputs say,
re-derived; each question's answer re-derived from a run; spoiler tests."""
from __future__ import annotations

import ast
import json
import pathlib
import re
import sys

import cloudpickle
import pytest
import torch

from conftest import NotebookCells, notebook_module, stored_text, top_level_names
from reducelab.checks.answers import WHY

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("keep_four_ranks")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "18_transformer_layer.ipynb"
CELLS = json.loads(NOTEBOOK.read_text())["cells"]
KEEP = {"SEQ", "BATCH", "EMBED", "HIDDEN", "HEADS", "HEAD_DIM", "TOL", "CAUSAL", "CALLS", "P_DROP",
        "CUT", "SEQUENCE_PARALLEL", "PLANS"}
"""Module-level names the notebook assigns (constants, tables) that its functions need."""

NB = vars(notebook_module(CELLS, "nb18_cells", KEEP,
                          preamble="from reducelab import LocalGroup, RankError, setup"))
TOL = NB["TOL"]
SEQ, BATCH, EMBED = NB["SEQ"], NB["BATCH"], NB["EMBED"]
WHOLE = (SEQ, BATCH, EMBED)
GRADS_REF = NB["unsharded"]()[1]

_CELLS = NotebookCells(CELLS)
source_with, cell_with, markdown = _CELLS.source_with, _CELLS.cell_with, _CELLS.markdown


def cells():
    return [("".join(c["source"]), c) for c in CELLS]


def shown(start: str) -> str:
    """Everything the code cell starting with ``start`` shows, as committed."""
    return stored_text(next(c for s, c in cells() if s.startswith(start)))


def real_result(start: str) -> str:
    """What the folded verdict of the question cell starting with ``start`` says the real run gave."""
    return re.search(r"The real run gives (.+?)\. ", shown(start)).group(1)


def test_the_header_gives_study_time_run_time_and_what_it_follows():
    header = cells()[0][0]
    assert header.startswith("# How does a whole transformer layer split over tp and dp?")
    assert re.search(r"\*About (3\d|4[0-5]) min to study · about \d+ s to run top to bottom · "
                     r"world sizes? [^·]+ · CPU only \(gloo\) · follows notebooks 05, 08 and 09"
                     r"( · parts marked optional: about \d+ min more, after the lesson)?\*",
                     header), header[:300]
    for part in ("## What you will learn", "## Prerequisites",
                 '"Usage pattern for torch.distributed.all_reduce for gradient synchronization '
                 'within HuggingFace Transformers distributed training"', "2025-12-18"):
        assert part in header, part


def test_the_recap_defines_notebook_09s_blocks_in_the_cell_and_points_to_09():
    recap = source_with("class F(torch.autograd.Function)")
    for name in ("def make_mlp", "def shard_mlp", "def mlp(", "class G(", "def shard_attention",
                 "def attention(", "def unsharded"):
        assert name in recap, name
    text = markdown()
    assert "## Recap" in text and re.search(r"[Nn]otebook 09 shows why", text)
    nb09 = json.loads((ROOT / "notebooks" / "09_tensor_parallel.ipynb").read_text())["cells"]
    src09 = "\n".join("".join(c["source"]) for c in nb09 if c["cell_type"] == "code")
    assert "SEQ, BATCH, EMBED, HIDDEN, HEADS = 4, 2, 8, 16, 4" in src09 and \
        "SEQ, BATCH, EMBED, HIDDEN, HEADS = 4, 2, 8, 16, 4" in recap      # the same numbers


@pytest.mark.parametrize("tp", [2, 4])
def test_the_recaps_blocks_are_notebook_09s_f_and_g_around_the_mlp(group, tp):
    """The recap's MLP under f and g gives one process's output and gradients."""
    def tp_mlp():
        import torch.distributed as dist
        p = NB["shard_mlp"](dist.get_rank(), dist.get_world_size())
        x = NB["make_input"]()
        NB["CALLS"].clear()
        y = NB["tp_forward"](x, p)
        NB["loss_fn"](y).backward()
        return y.detach(), x.grad, list(NB["CALLS"])
    group.resize(tp)
    y_ref, grads = NB["unsharded"]()
    for y, x_grad, calls in group.run(tp_mlp):
        assert (y - y_ref).abs().max() <= TOL and (x_grad - grads["x"]).abs().max() <= TOL
        assert calls == [("forward", "g", "all_reduce", WHOLE), ("backward", "f", "all_reduce", WHOLE)]


# --- step 1: the layer, with sequence parallelism ---------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_the_layer_with_tensor_parallelism_matches_one_process(group, tp):
    group.resize(tp)
    diff = NB["compare"](group.run(NB["layer_on_ranks"], False), False)
    assert len(diff) == 2 + 16 and max(diff.values()) <= TOL, diff


def test_reference_layer_is_torchs_modules_and_not_the_notebooks_own_functions():
    """The one-process reference must not share the code it checks."""
    src = next(s for s, _ in cells() if s.startswith("def reference_layer"))
    body = src.split("CUT =")[0]
    for own in ("block(", "attention(x", "mlp(x", "F.apply", "G.apply"):
        assert own not in body, own
    assert "make_attention()" in body and "make_norm(1)" in body


@pytest.mark.parametrize("tp", [2, 4])
def test_with_sequence_parallelism_exactly_the_parameters_seen_by_one_rank_are_partial(group, tp):
    group.resize(tp)
    out = group.run(NB["layer_on_ranks"], True)
    diff = NB["compare"](out, True)
    assert diff["y"] <= TOL and diff["x.grad"] <= TOL
    wrong = sorted(n for n, d in diff.items() if d > TOL)
    assert wrong == sorted(NB["SEQUENCE_PARALLEL"]), wrong
    _, _, ref = NB["reference_layer"]()
    for name in wrong:                                  # partial sums over the tokens
        assert (sum(o[2][name] for o in out) - ref[name]).abs().max() <= TOL
    fixed = NB["compare"](group.run(NB["sp_step"]), True)
    assert max(fixed.values()) <= TOL, fixed


def test_question_1_stored_answer_is_the_six_sequence_parallel_parameters():
    stored = real_result("group.resize(4)                      # this question's world size, "
                         "whatever the explorer left\nout = group.run(layer_on_ranks, True)")
    assert sorted(ast.literal_eval(stored)) == sorted(NB["SEQUENCE_PARALLEL"])


def test_sequence_parallel_operators_replace_each_all_reduce_by_two_collectives(group):
    for i in (1, 2):
        calls = group.run(NB["layer_on_ranks"], True, (i,))[0][3]
        assert [(w, op, c) for w, op, c, _ in calls] == [
            ("forward", "in", "all_gather"), ("forward", "out", "reduce_scatter"),
            ("backward", "out", "all_gather"), ("backward", "in", "reduce_scatter")]
        assert all(shape == WHOLE for *_, shape in calls)   # S: the whole activation
        calls = group.run(NB["layer_on_ranks"], False, (i,))[0][3]
        assert [c for *_, c, _ in calls] == ["all_reduce", "all_reduce"]


def table_rows(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        m = re.match(r"(attention|MLP)\s+(tp \+ sp|tp)\s+(.+?)\s{2,}(.+?)\s{2,}([\d,]+)\s+(\d+) bytes$",
                     line)
        if m:
            rows[(m[1], m[2])] = (m[3], m[4], int(m[5].replace(",", "")), int(m[6]))
    return rows


def test_the_stored_table_says_the_same_bytes_and_a_quarter_of_the_layernorm_input(group):
    """The prose: the same bytes with and without sequence parallelism, each rank holding
    a quarter of the tokens. Re-derived from the stored table, then from a fresh run."""
    stored = table_rows(shown("def ring_bytes("))
    assert len(stored) == 4, stored
    for block in ("attention", "MLP"):
        tp, sp = stored[(block, "tp")], stored[(block, "tp + sp")]
        assert tp[:2] == ("all_reduce", "all_reduce")
        assert sp[:2] == ("all_gather, reduce_scatter", "all_gather, reduce_scatter")
        S = 4 * SEQ * BATCH * EMBED                     # bytes of the whole activation
        assert tp[2] == sp[2] == 2 * (2 * 3 / 4 * S)    # two ring all_reduces on 4 ranks
        assert sp[3] * 4 == tp[3] == S
    ns = dict(NB, group=group, print=lambda *a, **k: printed.append(" ".join(map(str, a))))
    printed = []
    exec(next(s for s, _ in cells() if s.startswith("def ring_bytes(")), ns)
    assert table_rows("\n".join(printed)) == stored


# --- step 2: parallelize_module ---------------------------------------------------------
def test_parallelize_module_tp_and_sp_plans_run_on_gloo_and_match_one_process(group):
    model, x = NB["NormMLP"](), NB["make_input"]()
    y = model(x)
    NB["loss_fn"](y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    want = {"tp": ({"all_reduce": 1}, 0, "a plain tensor"),
            "tp + sp": ({"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, 2, "Partial(sum)")}
    for plan, (counts, steps, norm) in want.items():
        out = group.run(NB["dtensor_block"], plan)
        join = torch.cat if plan == "tp + sp" else (lambda ts: ts[0])
        assert (join([o[0] for o in out]) - y).abs().max() <= TOL
        assert (join([o[1] for o in out]) - x.grad).abs().max() <= TOL
        _, _, got, grads, step_count, stepped = out[0]
        assert got == {"forward": counts, "backward": counts} and step_count == steps
        assert grads["norm.weight"] == grads["norm.bias"] == norm
        assert grads["mlp.0.weight"] == "Shard(dim=0)" and grads["mlp.2.weight"] == "Shard(dim=1)"
        assert grads["mlp.2.bias"] == "Replicate()"
        for name, p in model.named_parameters():
            assert (stepped[name] - p).abs().max() <= TOL, name


def test_torch_refuses_to_shard_multihead_attention_in_its_own_words(group):
    said = group.run(NB["parallelize_torch_attention"])[0]
    assert said == ("NotImplementedError: ColwiseParallel currently only support nn.Linear "
                    "and nn.Embedding!")
    assert f"torch: {said}" in shown("def parallelize_torch_attention")


# --- step 3: (dp, tp) -------------------------------------------------------------------
def mean_reference() -> dict:
    return {n: (NB["unsharded"](0)[1][n] + NB["unsharded"](1)[1][n]) / 2 for n in GRADS_REF}


def test_averaging_over_dp_only_is_right_and_over_tp_too_mixes_shards(group):
    NB["mean_ref"] = mean_ref = mean_reference()
    out = group.run(NB["dp_tp_step"], "dp")
    assert NB["wrong_grads"](out) == {(0, 0): [], (0, 1): [], (1, 0): [], (1, 1): []}
    out = group.run(NB["dp_tp_step"], "dp and tp")          # runs: no error
    wrong = NB["wrong_grads"](out)
    assert all(w == ["0.weight", "0.bias", "2.weight"] for w in wrong.values()), wrong
    half = NB["HIDDEN"] // 2
    mixed = (mean_ref["0.weight"][:half] + mean_ref["0.weight"][half:]) / 2
    assert (out[0][1]["0.weight"] - mixed).abs().max() <= TOL
    assert out[0][0] == (0, 0) and out[3][0] == (1, 1)



# --- predictions stay unspoiled -----------------------------------------------------------
def test_nothing_before_question_1_names_the_parameters_that_go_wrong():
    all_cells = cells()
    q = next(k for k, (src, _) in enumerate(all_cells) if src.startswith("answer_1 = None"))
    before = "\n".join(src for src, _ in all_cells[:q])
    for spoiler in ("SEQUENCE_PARALLEL", "_allreduce_non_tensor_model_parallel_grads",
                    "_allreduce_layernorm_grads"):
        assert spoiler not in before, spoiler
    prose = "\n".join(src for src, c in all_cells[:q] if c["cell_type"] == "markdown")
    assert "Partial(sum)" not in prose


def test_question_2_does_not_say_whether_it_raises():
    all_cells = cells()
    q = next(k for k, (src, _) in enumerate(all_cells) if src.startswith("answer_2 = None"))
    question = all_cells[q + 1][0]
    code = [line for line in question.splitlines() if not line.startswith("group.resize(")]
    assert "#" not in code[0]
    assert "it runs" not in question.split("reveal(")[0]




def test_question_2_stored_answer_is_the_two_sharded_weights_and_the_bias_of_w1():
    assert ast.literal_eval(real_result("group.resize(4)                      # this question's "
                                        "world size, whatever the explorer left\nout = group.run("
                                        "dp_tp_step")) == ["0.weight", "0.bias", "2.weight"]


def test_the_whys_belong_to_18_and_09_keeps_only_its_own():
    assert "sequence_parallel" in WHY["18"][1] and "mixes the gradients" in WHY["18"][2]
    assert sorted(WHY["09"]) == [1, 2, 3] and "Column → row needs one" in WHY["09"][3]


def test_the_myth_and_summary_say_dp_not_tp_after_the_last_question():
    all_cells = cells()
    q = max(k for k, (src, _) in enumerate(all_cells) if src.startswith("answer_"))
    after = "\n".join(src for src, _ in all_cells[q:])
    assert 'world_mesh["dp", "cp"]' in after and "never over `tp`" in after
    for ref in ("Korthikanti", "Megatron-LM", "torch/distributed/tensor/parallel/style.py"):
        assert ref in after.split("## Further reading")[1], ref


# --- step 4: the explorer ------------------------------------------------------------------
from reducelab.plots.transformer_layer import Hop, layer_figure  # noqa: E402
from reducelab.widgets.transformer_layer import (BLOCKS, PLANS, STAGES, TP_DEGREES,  # noqa: E402
                                                 TransformerLayerExplorer, describe_layer,
                                                 ring_bytes)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def explorer(group):
    return TransformerLayerExplorer(group, NB["layer_stages"], seq=SEQ)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("i", [1, 2])
def test_the_rank_function_reports_each_stage_and_the_collectives_the_operators_ran(group, sp, i):
    out = group.run(NB["layer_stages"], sp, i)
    activation = 4 * SEQ * BATCH * EMBED                     # bytes of the whole (SEQ, BATCH, EMBED)
    for rank, (stages, calls) in enumerate(out):
        assert tuple(stages) == STAGES
        mine = (rank, rank + 1) if sp else (0, SEQ)           # 4 tokens on 4 ranks: one each
        for name, (tokens, nbytes) in stages.items():
            whole = name in ("into the block", "partial sum")
            assert tokens == ((0, SEQ) if whole else mine), (name, tokens)
            assert nbytes == (activation if whole or not sp else activation // 4), (name, nbytes)
        want = ([("forward", "in", "all_gather"), ("forward", "out", "reduce_scatter"),
                 ("backward", "out", "all_gather"), ("backward", "in", "reduce_scatter")] if sp else
                [("forward", "g", "all_reduce"), ("backward", "f", "all_reduce")])
        assert [tuple(c[:3]) for c in calls] == want
        assert all(tuple(c[3]) == WHOLE for c in calls)


def test_the_explorer_starts_on_four_ranks_with_sequence_parallelism(explorer, group):
    r = explorer.result
    assert (r.plan, r.block, r.tp) == ("tp + sp", "MLP", 4) and group.world_size == 4
    assert r.same_calls and r.hop("in") == Hop("all_gather", "reduce_scatter", 384)
    assert r.hop("out") == Hop("reduce_scatter", "all_gather", 384)
    assert r.outside_bytes() == [256] * 4          # 4 stages outside the block, 1 token of 64 B each
    assert bytes(explorer.image.value).startswith(PNG)
    assert "way in all_gather (backward reduce_scatter)" in explorer.message.value
    assert "rank 0 holds 1 of 4 tokens" in explorer.message.value


@pytest.mark.parametrize("plan, block, tp", [("tp only", "attention", 4), ("tp + sp", "attention", 2),
                                             ("tp only", "MLP", 1), ("tp + sp", "MLP", 1),
                                             ("tp only", "MLP", 2)])
def test_every_control_change_runs_real_ranks_and_changes_the_figure(explorer, group, plan, block, tp):
    before = explorer.image.value
    explorer.controls["tp"].value = tp
    explorer.controls["block"].value = block
    explorer.controls["plan"].value = plan
    r = explorer.result
    assert (r.plan, r.block, r.tp) == (plan, block, tp) and group.world_size == tp
    assert len(r.held) == tp and r.same_calls
    into, out = r.hop("in"), r.hop("out")
    if plan == "tp only":
        assert (into.forward, into.backward, out.forward, out.backward) == \
            ("nothing", "all_reduce", "all_reduce", "nothing")
    else:
        assert (into.forward, out.forward) == ("all_gather", "reduce_scatter")
    S = 4 * SEQ * BATCH * EMBED
    # the same bytes either way: one all_reduce each way, or two halves of one
    assert into.sent + out.sent == 2 * ring_bytes("all_reduce", WHOLE, tp) \
        == round(4 * (tp - 1) / tp * S)
    share = SEQ // tp if plan == "tp + sp" else SEQ
    assert r.held[0][1][1] - r.held[0][1][0] == share
    assert bytes(explorer.image.value).startswith(PNG) and bytes(explorer.image.value) != bytes(before)
    assert describe_layer(r) in explorer.message.value.replace("&#x27;", "'")


def test_a_move_that_keeps_tp_starts_no_rank_and_builds_no_group(explorer, group):
    """The rank function takes its tokens from its rank: no mesh, no new process group."""
    starts = group.restarts
    for plan in PLANS:
        for block in BLOCKS:
            explorer.controls["plan"].value = plan
            explorer.controls["block"].value = block
    assert group.restarts == starts
    assert "init_device_mesh" not in source_with("def layer_stages") and \
        "new_group" not in source_with("def layer_stages")


def test_sequence_parallelism_holds_a_tp_th_of_the_tokens_outside_the_block(explorer):
    held = {}
    for plan in PLANS:
        explorer.controls["plan"].value = plan
        held[plan] = explorer.result.held
    for r in range(4):
        for s, name in enumerate(STAGES):
            tp_only, sp = held["tp only"][r][s][2], held["tp + sp"][r][s][2]
            assert sp == (tp_only if name in ("into the block", "partial sum") else tp_only // 4)
    # the right column and the status line count the stages outside the block: a quarter
    explorer.controls["plan"].value = "tp only"
    assert explorer.result.outside_bytes() == [1024] * 4
    assert "outside the block (x, LayerNorm, out, + residual) rank 0 holds 1,024 B" in \
        explorer.message.value
    explorer.controls["plan"].value = "tp + sp"
    assert explorer.result.outside_bytes() == [256] * 4


def test_the_figure_says_by_text_what_it_says_by_colour(explorer):
    from reducelab import plots
    caught = []
    plots.AUDITS.append(caught.append)
    explorer._pngs.clear()
    try:
        explorer.refresh()
    finally:
        plots.AUDITS.remove(caught.append)
    texts = [t.get_text() for t in caught[-1].findobj(lambda a: hasattr(a, "get_text"))]
    for want in ("rank 0", "rank 3", "token 0, 64 B", "all tokens, 256 B", "partial, 256 B",
                 "fwd: all_gather\nbwd: reduce_scatter\n384 B sent (fwd + bwd)", "256 B", "outside"):
        assert want in texts, want
    hatched = [c for c in caught[-1].axes[0].collections if c.get_hatch()]
    assert len(hatched) == 1 and len(hatched[0].get_paths()) == 4 * SEQ   # the partial sums
    explorer.controls["tp"].value = 1                  # one rank's "partial" sum is the whole sum
    explorer._pngs.clear()
    plots.AUDITS.append(caught.append)
    try:
        explorer.refresh()
    finally:
        plots.AUDITS.remove(caught.append)
    texts = [t.get_text() for t in caught[-1].findobj(lambda a: hasattr(a, "get_text"))]
    assert not [c for c in caught[-1].axes[0].collections if c.get_hatch()]
    assert "partial, 256 B" not in texts and "all tokens, 256 B" in texts


def test_layer_figure_refuses_mismatched_input():
    with pytest.raises(ValueError, match="must match stage_names"):
        layer_figure(["x", "y"], [[(0, 4, 1)]], [False, False], [None], 4)
    with pytest.raises(ValueError, match="at most 6 stages"):
        layer_figure(list("abcdefg"), [[(0, 4, 1)] * 7], [False] * 7, [None] * 6, 4)


def test_bad_initial_values_name_the_choices(group):
    with pytest.raises(ValueError, match="plan must be one of tp only, tp \\+ sp"):
        TransformerLayerExplorer(group, NB["layer_stages"], plan="sp")
    with pytest.raises(ValueError, match="block must be one of attention, MLP"):
        TransformerLayerExplorer(group, NB["layer_stages"], block="norm")
    with pytest.raises(ValueError, match="tp must be one of 1, 2, 4"):
        TransformerLayerExplorer(group, NB["layer_stages"], tp=3)
    assert TP_DEGREES == (1, 2, 4)


def test_the_stored_explorer_carries_its_png_and_its_text():
    import base64
    cell = cell_with("TransformerLayerExplorer(group, layer_stages")
    data = next(o["data"] for o in cell["outputs"] if "image/png" in o.get("data", {}))
    shown = base64.b64decode("".join(data["image/png"]))
    assert shown.startswith(PNG)
    import struct
    assert struct.unpack(">I", shown[16:20])[0] == 960
    text = "".join(data["text/plain"])
    assert text.startswith("TransformerLayerExplorer(plan=tp + sp, block=MLP, tp=4)\n")
    assert "way in all_gather" in text


# --- the exercise -----------------------------------------------------------------------
import torch.distributed as dist  # noqa: E402

from reducelab import LocalGroup  # noqa: E402
from reducelab.checks.transformer_layer import (SHARDED_NAMES, SP_NAMES,  # noqa: E402
                                                check_sync_gradients, layer_grads, reference)

SOLUTION_PATH = NOTEBOOK.parent / "solutions" / "18_sync_gradients.py"


def after_loading_the_solution() -> dict:
    """The kernel after the learner ran the notebook's cells, then ``%load``-ed the
    solution and ran it: the notebook's definitions, and the solution's over them."""
    ns = vars(notebook_module(CELLS, "nb18_loaded", KEEP,
                              preamble="from reducelab import LocalGroup, RankError, setup"))
    exec(compile(SOLUTION_PATH.read_text(), str(SOLUTION_PATH), "exec"), ns)
    return ns


def test_the_solution_defines_only_the_learners_function():
    assert top_level_names(SOLUTION_PATH) == {"sync_gradients"}


def test_the_solution_passes_and_the_world_size_is_restored(group):
    group.resize(2)
    verdict = check_sync_gradients(group, after_loading_the_solution()["sync_gradients"])
    assert verdict, verdict.message
    assert group.world_size == 2


def test_the_checks_names_are_the_notebooks_and_its_reference_is_one_process():
    assert sorted(SP_NAMES) == sorted(NB["SEQUENCE_PARALLEL"])
    assert sorted(SHARDED_NAMES) == sorted(NB["CUT"]) and len(SP_NAMES + SHARDED_NAMES) == 16
    ref, every = reference(), {(d, t): layer_grads(d, t) for d in (0, 1) for t in (0, 1)}
    for (d, t), grads in ref.items():
        # a sequence-parallel gradient: the same on all 4 ranks, the mean over dp of the sum over tp
        assert torch.allclose(grads["ln1.weight"], ref[0, 0]["ln1.weight"])
        want = (every[0, 0]["ln1.weight"] + every[0, 1]["ln1.weight"]
                + every[1, 0]["ln1.weight"] + every[1, 1]["ln1.weight"]) / 2
        assert torch.allclose(grads["ln1.weight"], want)
        # a sharded one: the mean over dp of this tp index's shard
        assert torch.allclose(grads["0.weight"], (every[0, t]["0.weight"] + every[1, t]["0.weight"]) / 2)


def test_the_notebooks_stub_runs_and_fails_with_its_mistake_named(group):
    verdict = check_sync_gradients(group, NB["sync_gradients"])
    assert not verdict and "averaged over all 4 ranks" in verdict.message
    stored = stored_text(cell_with("check_sync_gradients(group, sync_gradients)"))
    assert "averaged over all 4 ranks" in stored


def unchanged(grads, mesh):
    pass


def averaged_over_tp_too(grads, mesh):
    for name, g in grads.items():
        if name in SP_NAMES:
            dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["tp"].get_group())
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def sp_not_summed(grads, mesh):
    for g in grads.values():
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def summed_over_dp(grads, mesh):
    for name, g in grads.items():
        if name in SP_NAMES:
            dist.all_reduce(g, group=mesh["tp"].get_group())
        dist.all_reduce(g, group=mesh["dp"].get_group())


def divided_a_loop_variable(grads, mesh):     # the division lands on a new tensor
    for name, g in grads.items():
        if name in SP_NAMES:
            dist.all_reduce(g, group=mesh["tp"].get_group())
        dist.all_reduce(g, group=mesh["dp"].get_group())
        g = g / 2


def sp_summed_over_the_default_group(grads, mesh):   # step 1's line, copied without a group
    for name, g in grads.items():
        if name in SP_NAMES:
            dist.all_reduce(g)
        else:
            dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def everything_over_all_ranks(grads, mesh):
    for g in grads.values():
        dist.all_reduce(g, op=dist.ReduceOp.AVG)


def everything_summed_over_tp(grads, mesh):
    for g in grads.values():
        dist.all_reduce(g, group=mesh["tp"].get_group())
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def dp_forgotten(grads, mesh):
    for name, g in grads.items():
        if name in SP_NAMES:
            dist.all_reduce(g, group=mesh["tp"].get_group())


def replaced_by_a_new_dict(grads, mesh):       # returns new tensors; grads unchanged
    return {n: g * 1 for n, g in grads.items()}


def flat_buffers_never_copied_back(grads, mesh):   # torch.cat copies: grads never change
    sp = torch.cat([grads[n].flatten() for n in SP_NAMES])
    dist.all_reduce(sp, group=mesh["tp"].get_group())
    every = torch.cat([g.flatten() for g in grads.values()])
    dist.all_reduce(every, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def sp_buffer_never_copied_back(grads, mesh):      # the dp mean in place, the tp sum lost
    sp = torch.cat([grads[n].flatten() for n in SP_NAMES])
    dist.all_reduce(sp, group=mesh["tp"].get_group())
    for g in grads.values():
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def dp_buffer_copied_back_tp_forgotten(grads, mesh):   # copied back; only the tp sum is missing
    every = list(grads.values())
    flat = torch.cat([g.flatten() for g in every])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    for g, mean in zip(every, flat.split([g.numel() for g in every])):
        g.copy_(mean.view_as(g))


def sp_buffer_right_sharded_left_out(grads, mesh):   # the SP buffer right and copied back
    sp = [grads[n] for n in SP_NAMES]
    flat = torch.cat([g.flatten() for g in sp])
    dist.all_reduce(flat, group=mesh["tp"].get_group())
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    for g, done in zip(sp, flat.split([g.numel() for g in sp])):
        g.copy_(done.view_as(g))


def raises(grads, mesh):
    dist.all_reduce(grads["nothing"], group=mesh["dp"].get_group())


def test_the_copy_back_hint_comes_only_where_a_buffer_was_reduced(group):
    """A fifth review (18-4): a flat buffer reduced but never copied back left grads as they
    were, and the verdict did not say why. The hint names torch.cat's copy only where a rank
    ran a collective on a tensor outside grads, not where the gradients were reduced in
    place or not at all, nor (a sixth review, 18-1) where the one buffer was copied back and
    the tp sum forgotten."""
    for fn in (unchanged, sp_not_summed, replaced_by_a_new_dict,
               dp_buffer_copied_back_tp_forgotten,     # a sixth review (18-1): it was copied back
               sp_buffer_right_sharded_left_out):      # a seventh (18-1): copied back, some left out
        verdict = check_sync_gradients(group, fn)
        assert not verdict and "torch.cat" not in verdict.message, (fn.__name__, verdict.message)
    assert "notebook 18's" not in check_sync_gradients(group, sp_not_summed).message


@pytest.mark.parametrize("fn, words", [
    (unchanged, "unchanged, as backward left it"),
    (replaced_by_a_new_dict, "unchanged, as backward left it"),
    (averaged_over_tp_too, "half the right one: the tp ranks' partial sums were averaged"),
    (sp_not_summed, "the dp average of this rank's own gradient"),
    (summed_over_dp, "every gradient is 2 times the right one: summed over dp but never divided"),
    (divided_a_loop_variable, "g = g / 2 on a loop variable makes a new tensor and does not "
                              "change grads"),
    (sp_summed_over_the_default_group, "A collective called without a group runs over the default process group, all 4 ranks"),
    (everything_over_all_ranks, "every gradient was averaged over all 4 ranks"),
    (everything_summed_over_tp, "was added with the other tp rank's"),
    (dp_forgotten, "the dp ranks' gradients were never averaged"),
    (flat_buffers_never_copied_back, "unchanged, as backward left it: nothing combined it with "
                                     "the other ranks' gradients. This rank ran a collective on a "
                                     "tensor that is none of grads' tensors: torch.cat makes a "
                                     "copy: copy the reduced buffer back into the grads."),
    (sp_buffer_never_copied_back, "must be added up as well (question 1). This rank ran a "
                                  "collective on a tensor that is none of grads' tensors: "
                                  "torch.cat makes a copy"),
    (dp_buffer_copied_back_tp_forgotten, "the dp average of this rank's own gradient"),
    (sp_buffer_right_sharded_left_out, "changed: the collectives left "),
    (raises, "your function raised on the ranks"),
])
def test_each_usual_mistake_gets_its_explanation(group, fn, words):
    verdict = check_sync_gradients(group, fn)
    assert not verdict and words in verdict.message, verdict.message
    solution = [line.split("#")[0].strip() for line in SOLUTION_PATH.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert not any(line in verdict.message for line in solution[1:] if len(line) > 12)
    assert "all_reduce(" not in verdict.message and "get_group" not in verdict.message
    assert group.world_size == 4


def test_every_gradient_summed_over_dp_names_the_division_not_the_default_group(group):
    """A review (12:20): when every gradient is the dp sum, the message says it was never
    divided and names g = g / 2 on a loop variable; the default group's sentence is for
    the sequence-parallel gradients summed without a group only."""
    verdict = check_sync_gradients(group, divided_a_loop_variable)
    assert verdict.mistake == "summed over dp, never divided"
    assert "default process group" not in verdict.message
    verdict = check_sync_gradients(group, sp_summed_over_the_default_group)
    assert "default process group" in verdict.message


def mesh_as_group(grads, mesh):
    for g in grads.values():
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"])


def test_a_device_mesh_passed_as_group_is_named_with_get_group(group):
    """A review (12:20): torch's raw ValueError ("Process group DeviceMesh(...) is not
    initialized") is named for what it is, and .get_group() with it."""
    verdict = check_sync_gradients(group, mesh_as_group)
    assert not verdict and verdict.mistake == "a mesh as group", verdict.message
    assert "DeviceMesh((dp=2), 'cpu'" in verdict.message and ".get_group()" in verdict.message
    assert group.world_size == 4


def one_collective_per_gradient(grads, mesh):   # right numbers, 22 collectives on a rank
    for name, g in grads.items():
        if name in SP_NAMES:
            dist.all_reduce(g, group=mesh["tp"].get_group())
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def test_right_gradients_in_more_than_two_collectives_are_refused(group):
    """A review (12:20): the exercise was assembly; it now asks for at most 2 collectives
    per rank, as Megatron-LM coalesces. The old per-gradient loop is right but refused,
    counted on the ranks (6 + 16 on rank (0, 0)); the solution makes 2."""
    verdict = check_sync_gradients(group, one_collective_per_gradient)
    assert not verdict and verdict.mistake == "too many collectives", verdict.message
    assert "rank (dp 0, tp 0) made 22 collectives" in verdict.message
    assert "all_reduce(" not in verdict.message and "get_group" not in verdict.message
    from reducelab.checks.transformer_layer import synced_on_mesh
    from reducelab.checks.mesh import run_and_release
    rows = group.run(run_and_release, synced_on_mesh, after_loading_the_solution()["sync_gradients"])
    assert [n for _, _, n, _ in rows] == [2, 2, 2, 2]
    task = next(src for src, c in cells() if src.startswith("## Exercise: both rules at once"))
    assert "at most **two** collectives per rank" in task and "one flat buffer" in task


def test_the_key_insight_has_its_own_paragraph_and_the_sp_sum_says_what_its_absence_does():
    """A review (12:20): "whose loss a gradient belongs to" was buried in a parenthesis;
    and the SP all_reduce's absence fails silently (the copies drift apart)."""
    text = markdown()
    assert "\n\n**What decides between a sum and a mean is whose loss a gradient belongs to.**" in text
    assert "(Step 1's LayerNorm gradients look like an exception" not in text
    assert "the copies drift apart silently, and a checkpoint saved from rank 0 keeps one of them" in text


def test_late_parts_are_marked_optional_and_counted_in_the_header():
    """A review (12:20) timed 18 at 65 to 75 min against 45: step 2, the FSDP2 part and the
    explorer are marked optional."""
    text = markdown()
    assert "· parts marked optional: about 10 min more, after the lesson*" in cells()[0][0]
    for mark in ("## Step 2: torch's own, `parallelize_module` (optional, after the lesson)\n",
                 "*Optional, after the lesson.*\n\n**In practice**",
                 "## Step 4: explore a block, stage by stage (optional, after the lesson)\n"):
        assert mark in text, mark


def half_the_ranks_reduce(grads, mesh):        # only tp rank 0 joins: its tp partner never does
    if mesh.get_coordinate()[1] == 0:
        dist.all_reduce(grads["ln1.weight"], group=mesh["tp"].get_group())


def test_a_hang_is_reported_with_where_each_rank_was():
    short = LocalGroup(world_size=4, timeout=4)
    try:
        verdict = check_sync_gradients(short, half_the_ranks_reduce)
    finally:
        short.close()
    assert not verdict and verdict.mistake == "hung past the timeout", verdict.message
    assert "did not finish" in verdict.message


def test_the_check_cell_follows_the_def_cell_and_its_import_is_in_the_setup_cell():
    code = [src for src, c in cells() if c["cell_type"] == "code"]
    setup = next(c for c in code if "group = LocalGroup(" in c)
    assert "from reducelab.checks.transformer_layer import check_sync_gradients" in setup
    stub = next(c for c in code if c.startswith("# %load solutions/18_sync_gradients.py"))
    assert code[code.index(stub) + 1].strip() == "check_sync_gradients(group, sync_gradients)"
    assert "TODO" in stub


def scaled_by_three(grads, mesh):              # no usual mistake: the generic message
    for g in grads.values():
        g.mul_(3)


def kept_the_other_shard_too(grads, mesh):     # right, but one gradient of the wrong shape
    for name, g in grads.items():
        if name in SP_NAMES:
            dist.all_reduce(g, group=mesh["tp"].get_group())
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    grads["0.weight"] = torch.cat([grads["0.weight"]] * 2)


@pytest.mark.parametrize("fn, words", [
    (scaled_by_three, "differs from one process's by up to"),
    (kept_the_other_shard_too, "has the shape (16, 8), not (8, 8)"),
])
def test_other_mistakes_get_a_question_not_the_rule(group, fn, words):
    verdict = check_sync_gradients(group, fn)
    assert not verdict and words in verdict.message, verdict.message
    assert "summed over tp, averaged over dp" not in verdict.message


def test_fsdp2_on_the_dp_dimension_of_a_tp_model_averages_over_dp_only(group):
    """Step 3's "in practice": fully_shard(model, mesh=mesh["dp"]) on the tp-parallelised MLP
    gives every rank a quarter of the gradient, whose whole is one process's mean over the two
    batches; the stored output says so for all four ranks."""
    group.resize(4)
    grads_0, grads_1 = NB["unsharded"](0)[1], NB["unsharded"](1)[1]
    mean = (grads_0["0.weight"] + grads_1["0.weight"]) / 2
    out = group.run(NB["fsdp_over_dp"])
    assert sorted(coord for coord, _, _ in out) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for _, local, full in out:
        assert local == (full.shape[0] // 4, full.shape[1])          # sharded over dp and tp
        assert torch.allclose(full, mean, atol=TOL)
    assert not torch.allclose(grads_0["0.weight"], mean, atol=TOL)   # the two batches differ
    text = shown("import logging")
    assert text.count("the whole equals one process's mean over the two batches: True") == 4
    assert "False" not in text and "suboptimal" not in text
    assert 'fully_shard(model, mesh=mesh["dp"])' in source_with("def fsdp_over_dp")


from test_notebooks import bound_and_loaded as _bound_and_loaded  # noqa: E402 (one definition, shared)


def test_a_cell_runs_with_the_optional_parts_skipped():
    """A fifth review (18-1): step 3's FSDP2 cell used parallelize_module, ColwiseParallel and
    RowwiseParallel, imported only in step 2, which is marked optional: a learner who skipped
    it got a NameError. No code cell may need a name that only an optional part (step 2, the
    optional part of step 3, step 4) binds, unless it is in that part itself."""
    def part(i):
        for start, heading in ((19, "## Step 2: torch's own"), (30, "*Optional, after the lesson.*"),
                               (32, "## Step 4: explore")):
            assert "".join(CELLS[start]["source"]).startswith(heading)
        return next((s for s, e in ((19, 24), (30, 32), (32, 35)) if s <= i < e), None)
    assert "".join(CELLS[24]["source"]).startswith("## Step 3")
    assert "".join(CELLS[35]["source"]).startswith("## Exercise")
    code = [(i, *_bound_and_loaded("".join(c["source"]))) for i, c in enumerate(CELLS) if c["cell_type"] == "code"]
    optional_only = set().union(*(b for i, b, _ in code if part(i) is not None))
    missing = {}
    for i, bound, loaded in code:
        available = bound.union(*(b for j, b, _ in code if j < i and part(j) in (None, part(i))))
        need = (loaded & optional_only) - available
        if need:
            missing[i] = sorted(need)
    assert missing == {}, missing
    fsdp = next(i for i, _, _ in code if "def fsdp_over_dp" in "".join(CELLS[i]["source"]))
    assert part(fsdp) == 30


def test_the_goals_the_core_teaches_and_the_sp_memory_of_a_real_layer():
    """A fifth review: parallelize_module was a learning goal while step 2, which teaches it,
    is optional (18-2): the goal list now says so. And the toy layer's memory column was the
    only evidence for sequence parallelism's saving (18-3): the text gives Korthikanti et al.'s
    per-layer count, sbh(34 + 5as/h) without parallelism, the 10sbh of LayerNorms and dropouts
    that tensor parallelism alone leaves whole, and sequence parallelism's division of it."""
    header = cells()[0][0]
    goals = header.split("## What you will learn")[1].split("## Prerequisites")[0]
    lines = [line for line in goals.splitlines() if "parallelize_module" in line]
    assert lines and all(line.startswith("- Optional, after the lesson (step 2):") for line in lines), lines
    step_1 = next(s for s, _ in cells() if s.startswith("Each way, each block costs"))
    for words in ("Korthikanti et al. (2022, section 4)", "`sbh(34 + 5as/h)` without parallelism",
                  "except `10sbh`, kept by the LayerNorms and dropouts: `sbh(10 + 24/t + 5as/(ht))`",
                  "Sequence parallelism divides that part too, for `sbh(34 + 5as/h)/t`"):
        assert words in step_1, words
    assert "arXiv:2205.05198" in "\n".join(s for s, c in cells() if c["cell_type"] == "markdown")


def test_the_core_says_why_cp_is_averaged_and_points_to_torchs_own():
    """A sixth review: the core said why sequence-parallel gradients are summed over tp and
    dp's averaged, but not why cp's, whose ranks also hold the same parameters and see
    other tokens, are averaged (18-3); and only the optional parts named fully_shard over
    mesh["dp"] and SequenceParallel (18-4). The summary, in the core, now points to both,
    and each is run in its optional part."""
    cells_ = [s for s, _ in cells()]
    core = cells_[:next(i for i, s in enumerate(cells_) if s.startswith("*Optional, after the lesson.*"))]
    rule = next(s for s in core if s.startswith("This is notebook 05's rule seen from the other side"))
    assert ("`cp` ranks, too, hold the same parameters and see different tokens, yet they are averaged: each "
            "computes the loss of its own tokens, as a `dp` rank does of its batch, and the training loss is "
            "the mean of those losses.") in " ".join(rule.split())
    summary = " ".join(next(s for s in cells_ if s.startswith("## Summary")).split())
    assert "`parallelize_module`, with `SequenceParallel` for the LayerNorms, does all of this" in summary
    assert ('In practice `fully_shard(model, mesh=mesh["dp"])` does it (the optional part after step 3).'
            in summary)
    assert 'fully_shard(model, mesh=mesh["dp"])' in source_with("def fsdp_over_dp")
    assert "SequenceParallel()" in "\n".join(cells_[cells_.index(next(s for s in cells_ if s.startswith(
        "## Step 2: torch's own"))):])


def test_review_7_intro_rule_bullets_and_flat_buffer():
    """Review 7: the question paragraph promised parallelize_module, now optional (18-3);
    the 200-word paragraph on sum against mean is two bullets, one per rule (18-4); and the
    one-flat-buffer rule is met where step 1's loop all-reduces one gradient at a time (18-5)."""
    intro = " ".join(cells()[0][0].split())
    assert "by hand; torch's `parallelize_module` does the same in an optional part." in intro
    assert "by hand and with torch's `parallelize_module`" not in intro
    rule = next(s for s, _ in cells() if s.startswith("This is notebook 05's rule seen from the other side"))
    bullets = [line for line in rule.splitlines() if line.startswith("- ")]
    assert [b.split("**")[1] for b in bullets] == ["A sum over `tp`.", "A mean over `dp` and `cp`."]
    assert all(len(b.split()) < 80 for b in bullets)
    step_1 = " ".join(next(s for s, _ in cells() if s.startswith("So one more `all_reduce` over `tp`")).split())
    assert ("The cell makes one `all_reduce` per gradient, to be read; a real run packs them into one flat "
            "buffer for one call (the exercise):") in step_1
    loop = next(s for s, c in cells() if c["cell_type"] == "code" and "def sp_step" in s)
    assert "for name in SEQUENCE_PARALLEL:" in loop and "dist.all_reduce(grads[name])" in loop   # one per gradient


def test_teach_f_the_rule_after_question_2_names_its_tp_case_before_the_sum_and_the_mean():
    """teach-f review (18): the paragraph after question 2 stated "average over the dimensions
    whose ranks hold the same parameters and see different data; never over tp", then the next
    bullet met tp ranks that hold the same parameter and see different tokens (question 1's)
    and are summed: the stated rule contradicted itself two lines on. It now says combine,
    names question 1's parameters as the one case on tp before asking sum or mean, and keeps
    "never" for the sharded weights. The myth repeated step 3 word for word; it is cut to
    the question 2 it points to."""
    rule = next(s for s, _ in cells() if s.startswith("This is notebook 05's rule seen from the other side"))
    first = rule.split("\n\n")[0]
    assert first.count("Average") == 0 and "Combine a gradient over the mesh dimensions" in first
    assert "A sharded weight is never combined over `tp`" in first
    assert "Question 1's parameters are the one case on `tp`" in first
    assert "look like an exception" not in rule
    assert "- **A sum over `tp`.** Question 1's `tp` ranks share one loss" in rule
    myth = next(s for s, _ in cells() if s.startswith("## Myth vs reality"))
    assert "One exception sits inside" not in myth and "question 1's parameters also need a sum" in myth
    assert "Dropout takes this rank's tokens of one mask" in markdown()
