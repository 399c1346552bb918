"""Tests of notebook 14 (clipping and checkpoints across shards): the facts the notebook
states, each run on real gloo ranks with the notebook's own rank functions (read from its
code cells); the claims its prose makes, re-derived from its stored outputs; the facts it
cites from the installed torch's source; the checkpoint explorer driven headlessly; the
exercise check on the solution, the stub and each usual mistake; and the figures."""
from __future__ import annotations

import ast
import dataclasses
import html
import inspect
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import types

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist

import conftest
import reducelab.checks.shards as helper
import reducelab.widgets.shards as widget_module
from reducelab import LocalGroup, RankError
from reducelab.checks.answers import WHY
from reducelab.checks.sharded import ATOL, LAYOUT, initial_flat, load_digits_tensors, reference_run
from reducelab.checks.load_planner import RecordingLoadPlanner
from reducelab.checks.shards import (MESH_SHAPE, check_global_grad_norm,
                                     exercise_run, torch_log)
from reducelab.plots import MAX_WIDTH
from reducelab.plots.shards import CheckpointFigure, norm_figure
from reducelab.widgets.shards import PARAMETERS, CheckpointExplorer

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "14_clipping_and_checkpoints_across_shards.ipynb"
CELLS = json.loads(NOTEBOOK.read_text())["cells"]
TORCH = pathlib.Path(torch.__file__).parent

pytestmark = pytest.mark.usefixtures("keep_four_ranks")


def notebook_functions() -> types.SimpleNamespace:
    """The notebook's imports, ``def``s and the one string constant it hands a process
    (nothing else of its cells runs), in a module of their own that the ranks cannot
    import, so that its functions travel by value as a notebook cell's do."""
    module = types.ModuleType("nb14_cells")
    sys.modules.pop("nb14_cells", None)
    for cell in (c for c in CELLS if c["cell_type"] == "code"):
        tree = ast.parse("".join(cell["source"]))
        keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))
                or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "INFERENCE_SCRIPT")]
        exec(compile(ast.Module(body=keep, type_ignores=[]), "nb14", "exec"), module.__dict__)
    module.X, module.y = load_digits_tensors()
    return module


NB = notebook_functions()
X, y = NB.X, NB.y


def code_cells() -> list[str]:
    return ["".join(c["source"]) for c in CELLS if c["cell_type"] == "code"]


def cell_with(text: str, kind: str | None = None) -> str:
    hits = ["".join(c["source"]) for c in CELLS
            if text in "".join(c["source"]) and kind in (None, c["cell_type"])]
    assert len(hits) == 1, f"{len(hits)} cells contain {text!r}"
    return hits[0]


def markdown() -> str:
    return "\n".join("".join(c["source"]) for c in CELLS if c["cell_type"] == "markdown")


def stored_cell(source_part: str) -> dict:
    return next(c for c in CELLS if c["cell_type"] == "code" and source_part in "".join(c["source"]))


def stored_text(source_part: str) -> str:
    """What the committed notebook prints in the one code cell containing ``source_part``."""
    return "".join("".join(o.get("text", "")) for o in stored_cell(source_part)["outputs"]
                   if o["output_type"] == "stream")


def stored_folded(source_part: str) -> str:
    """The folded result of the question cell containing ``source_part`` (its <details>)."""
    page = "".join("".join(o["data"]["text/html"]) for o in stored_cell(source_part)["outputs"]
                   if "text/html" in o.get("data", {}))
    return html.unescape(re.search(r"<details>(.*)</details>", page, re.S).group(1).replace("<br>", "\n"))


@pytest.fixture(scope="module")
def whole():
    return reference_run(X, y, 1)["grads"][0].double().norm().item()


# --- step 1: the norm of a sharded gradient -------------------------------------------------------
def test_local_norms_add_as_squares(group, whole):
    group.resize(2)
    a, b = group.run(NB.local_norm, X, y)
    assert abs(math.hypot(a, b) - whole) <= ATOL
    # review 5 (14-1): question 1 asks which all_reduce recipe gives the whole norm, run on the ranks
    (n0, r0), (n1, r1) = group.run(NB.recipes, X, y)
    assert (n0, n1) == (a, b)
    for r in (r0, r1):
        assert abs(r[2] - whole) <= ATOL                              # question 1's answer, 2
        assert r[1] > 1.3 * whole and r[3] < whole
        assert abs(r[4] * 2 ** 0.5 - whole) <= ATOL                     # review 6 (14-4): AVG of n², √2 too small
    folded = stored_folded("answer_1, actual_1")
    assert "The real run gives 2." in folded and f"(2) rank 0 gets {whole:.4f}, rank 1 {whole:.4f}" in folded
    question = "".join(next(c for c in CELLS if "**Question 1.**" in "".join(c["source"]))["source"])
    assert "all-reduce `n²` (SUM), then the square root" in question and "`√(a² + b²)`" not in question
    assert "(4) all-reduce `n²` with AVG, as DDP averages gradients, then the square root." in question
    assert "divide by 2 and multiply by √2" not in question
    assert WHY["14"][1].startswith("The squared 2-norm is a sum over elements")   # the reason, not "Recipe 2."
    group.resize(4)
    local = group.run(NB.local_norm, X, y)
    assert len({round(n, 3) for n in local}) == 4 and all(n < whole for n in local)
    stored = stored_text("def local_norm(")                          # the stored values, on this CPU
    assert "ranks 0 to 3, the gradient rows each holds: norms " + ", ".join(f"{n:.3f}" for n in local) in stored


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_all_reduce_of_squares_is_the_whole_norm_on_every_rank(group, whole, world_size):
    group.resize(world_size)
    out = group.run(NB.global_norm, X, y)
    assert all(abs(g - whole) <= ATOL for _, g in out)
    assert abs(math.sqrt(sum(local ** 2 for local, _ in out)) - whole) <= ATOL
    assert stored_text("def global_norm(").count("max |difference| ≤ 1e-06") == 3


# --- step 2: torch's clip_grad_norm_ on DTensors -------------------------------------------------
def test_clip_grad_norm_reduces_through_norm_partial_and_returns_replicate(group, whole):
    out = group.run(NB.torch_clip, X, y, 0.1)
    for o in out:
        assert str(o["one_norm"][0]) == "(_NormPartial(2),)" and o["one_norm"][1] < whole / 2
        assert str(o["total_norm"][0]) == "(Replicate(),)"
        assert abs(o["total_norm"][1] - whole) <= ATOL
        assert o["collectives"] == {"c10d_functional.all_reduce": 1}   # question 2: 1 (review 7, 14-1)
        expected = reference_run(X, y, 1)["grads"][0] * (0.1 / (whole + 1e-6))
        assert (o["clipped"] - expected).abs().max() <= ATOL
        assert abs(o["clipped"].norm().item() - 0.1) < 1e-4
    assert "The real run gives 1." in stored_folded("actual_2 = ")
    assert stored_text("expected = one_process * min(").count("norm after clipping 0.1000; max |clipped") == 4


def test_what_step_2_says_of_the_source():
    clip = (TORCH / "nn" / "utils" / "clip_grad.py").read_text()
    assert "torch.stack([norm.to(first_device) for norm in norms])" in clip   # get_total_norm
    assert "clip_coef = max_norm / (total_norm + 1e-6)" in clip
    assert "torch.clamp(clip_coef, max=1.0)" in clip and "CPU <=> device synchronization" in clip
    assert "torch.distributed" not in clip and "dist." not in clip          # nothing calls a collective
    math_ops = (TORCH / "distributed" / "tensor" / "_ops" / "_math_ops.py").read_text()
    assert "class _NormPartial(Partial):" in math_ops
    assert "isinstance(p, Partial) and p.reduce_op != reduction_op" in math_ops
    assert "#126457" in markdown() + cell_with("actual_2 = ") and "#149768" in markdown()


def test_nothing_above_question_2_says_clip_grad_norm_runs_a_collective():
    """Question 2 asks whether clip_grad_norm_'s total_norm is the whole norm: a text above
    it that names a collective inside clip_grad_norm_ gives the answer (an expert review
    found "where the collective comes from" in What you will learn)."""
    q2 = next(i for i, c in enumerate(CELLS) if "".join(c["source"]).startswith("answer_2 = None"))
    above = "\n".join("".join(c["source"]) for c in CELLS[:q2]).lower()
    for hint in ("where the collective comes from", "collective comes from", "clip_grad_norm_ runs",
                 "replicate()", "commdebugmode() as", "as #170862 reports"):
        assert hint not in above, hint
    learn = "".join(CELLS[0]["source"]).split("## What you will learn")[1].split("## Prerequisites")[0]
    bullet = next(line for line in learn.splitlines() if "clip_grad_norm_" in line)
    assert "collective" not in bullet and "question 2 asks you first" in bullet


# --- step 3: a layer split over tp -------------------------------------------------------------
def test_placements_on_the_2d_mesh(group):
    rows = {name: (str(pl), shape, local) for name, pl, shape, local in
            group.run(NB.what_rank_holds_on_the_mesh, X, y)[0]}
    assert rows == {"0.weight": ("(Shard(dim=0), Shard(dim=1))", (32, 64), (16, 32)),
                    "0.bias": ("(Shard(dim=0), Replicate())", (32,), (16,)),
                    "2.weight": ("(Shard(dim=0), Replicate())", (10, 32), (5, 32)),
                    "2.bias": ("(Shard(dim=0), Replicate())", (10,), (5,))}
    stored = stored_text("def what_rank_holds_on_the_mesh(")
    assert "0.weight  (Shard(dim=0), Shard(dim=1))    (32, 64)      (16, 32)" in stored


def _pieces_of_2_weight(X, y):
    model, mesh = NB.tp_model_after_backward(X, y, 2, "replicated over tp")
    chunk = model[2].weight.grad.__create_chunk_list__()[0]      # what DCP asks a DTensor: its piece's place
    return mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(), tuple(chunk.offsets), tuple(chunk.sizes)


def test_the_two_tp_ranks_of_a_dp_index_hold_the_same_rows_of_2_weight(group):
    """Review 6 (14-2): the old question 3 (how many ranks hold an element of 2.weight) was
    answered by the table above it; the text says it in one sentence, which this run holds."""
    pieces = group.run(_pieces_of_2_weight, X, y)
    assert pieces == [(0, 0, (0, 0), (5, 32)), (0, 1, (0, 0), (5, 32)),
                      (1, 0, (5, 0), (5, 32)), (1, 1, (5, 0), (5, 32))]
    assert ("`2.weight`'s rows are split over `dp` only: ranks 0 and 1, the tp ranks of dp index 0, hold "
            "the same rows, whole. Those are copies, not pieces.") in markdown()


def test_summed_over_every_rank_the_copies_count_tp_times(group, whole):
    ratios, shares = {}, {}
    for tp in (2, 4):
        every_rank, by_torch, logged = group.run(NB.norms_on_the_mesh, X, y, tp, "replicated over tp")[0]
        assert abs(by_torch - whole) <= ATOL
        ratios[tp] = every_rank / whole
        shares[tp] = (every_rank ** 2 - whole ** 2) / ((tp - 1) * whole ** 2)
        assert len(logged) == 1 and "2 sequential all_reduce operations" in logged[0]
        assert 'flatten mesh dimensions ["dp", "tp"]' in logged[0]
    assert shares[2] == pytest.approx(shares[4], rel=1e-4)           # tp - 1 extra copies, each the same
    stored = stored_text("def norms_on_the_mesh(")
    text = markdown()
    assert f"tp = 2: step 1's sum over every rank" in stored and f"({ratios[2]:.2f} x)" in stored
    assert f"{ratios[2]:.2f} times too large at `tp` = 2" in text
    assert f"share of ‖g‖²: {shares[2]:.0%}" in stored and f"{shares[2] * 100:.0f} % of ‖g‖²" in text
    assert "1.19 times the norm here" in text and f"{ratios[2]:.2f}" == "1.19"
    assert "[rank" not in stored and not re.search(r"\bW\d{4} ", stored)   # no time-stamped log lines


def test_clip_grad_norm_raises_when_parameters_live_on_two_meshes(group):
    every_rank, by_torch, _ = group.run(NB.norms_on_the_mesh, X, y, 2, "left alone")[0]
    assert by_torch.startswith("RuntimeError: All operands in aten.stack.default must have the same mesh")
    assert by_torch in stored_text('"left alone")[0]')


def test_torch_log_keeps_the_text_and_restores_the_logger():
    import logging
    logger = logging.getLogger("reducelab.test.nb14")
    propagate, handlers = logger.propagate, list(logger.handlers)
    with torch_log("reducelab.test.nb14") as messages:
        logger.warning("from %s to %s", "a", "b")
    assert messages == ["from a to b"]
    assert logger.propagate == propagate and logger.handlers == handlers


@pytest.mark.parametrize("uncovered", ["replicated over tp", "left alone"])
def test_the_packages_copy_of_the_tp_model_equals_the_notebooks(group, uncovered):
    assert NB.tp_model_after_backward.__module__ == "nb14_cells"

    def grads(build):
        model, mesh = build(X, y, 2, uncovered)
        return [(str(p.grad.placements), p.grad.to_local().clone()) for p in model.parameters()]
    mine = group.run(lambda: grads(NB.tp_model_after_backward))
    theirs = group.run(lambda: grads(helper.tp_model_after_backward))
    for a, b in zip(mine, theirs):
        assert [p for p, _ in a] == [p for p, _ in b]
        assert all(torch.equal(s, t) for (_, s), (_, t) in zip(a, b))
    with pytest.raises(RankError, match="uncovered must be one of"):
        group.run(helper.tp_model_after_backward, X, y, 2, "sharded")


# --- the exercise -------------------------------------------------------------------------------
def every_rank_summed(model, mesh):
    s = sum(p.grad.to_local().pow(2).sum() for p in model.parameters())
    dist.all_reduce(s)
    return s.sqrt().item()


def local_only(model, mesh):
    return sum(p.grad.to_local().pow(2).sum() for p in model.parameters()).sqrt().item()


def dp_only(model, mesh):
    s = sum(p.grad.to_local().pow(2).sum() for p in model.parameters())
    dist.all_reduce(s, group=mesh.get_group("dp"))
    return s.sqrt().item()


def tp_only(model, mesh):
    s = sum(p.grad.to_local().pow(2).sum() for p in model.parameters())
    dist.all_reduce(s, group=mesh.get_group("tp"))
    return s.sqrt().item()


def no_square_root(model, mesh):
    split, copied = torch.zeros(()), torch.zeros(())
    for p in model.parameters():
        sq = p.grad.to_local().pow(2).sum()
        if p.grad.device_mesh.ndim == 2 and p.grad.placements[1].is_shard():
            split += sq
        else:
            copied += sq
    dist.all_reduce(split)
    dist.all_reduce(copied, group=mesh.get_group("dp"))
    return (split + copied).item()


def mesh_only(model, mesh):
    """Looks at the placement on the last mesh dimension only: model[2]'s Shard(0) over dp
    passes for a piece over tp."""
    split, copied = torch.zeros(()), torch.zeros(())
    for p in model.parameters():
        sq = p.grad.to_local().pow(2).sum()
        if p.grad.placements[-1].is_shard():
            split += sq
        else:
            copied += sq
    dist.all_reduce(split)
    dist.all_reduce(copied, group=mesh.get_group("dp"))
    return (split + copied).sqrt().item()


def replicate_as_piece(model, mesh):
    """Counts every DTensor of the 2-D mesh as pieces, 0.bias's Replicate() included."""
    split, copied = torch.zeros(()), torch.zeros(())
    for p in model.parameters():
        sq = p.grad.to_local().pow(2).sum()
        if p.grad.device_mesh.ndim == 2:
            split += sq
        else:
            copied += sq
    dist.all_reduce(split)
    dist.all_reduce(copied, group=mesh.get_group("dp"))
    return (split + copied).sqrt().item()


def gathered_single(model, mesh):   # the right norm, after gathering one gradient's pieces
    piece = next(iter(model.parameters())).grad.to_local().flatten()
    dist.all_gather_single(torch.empty(piece.numel() * dist.get_world_size()), piece)
    return math.sqrt(no_square_root(model, mesh))


def averaged(model, mesh):
    s = sum(p.grad.to_local().pow(2).sum() for p in model.parameters())
    dist.all_reduce(s, op=dist.ReduceOp.AVG)
    return s.sqrt().item()


def every_rank_over_tp(model, mesh):        # review 7 (14-4): undoes the copies' double count on all
    s = sum(p.grad.to_local().pow(2).sum() for p in model.parameters())
    dist.all_reduce(s)
    return (s / mesh["tp"].size()).sqrt().item()


def gathered(model, mesh):
    return torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]).norm().item()


def torchs_own(model, mesh):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def collective_on_a_dtensor(model, mesh):
    s = sum(p.grad.pow(2).sum() for p in model.parameters())
    dist.all_reduce(s)
    return s


def a_list(model, mesh):
    return [1.0, 2.0]


def solution_lines() -> list[str]:
    path = ROOT / "notebooks" / "solutions" / "14_global_grad_norm.py"
    return [line.strip() for line in path.read_text().splitlines()
            if len(line.strip()) > 12 and not line.strip().startswith(("#", '"', "def "))]


def test_the_solution_passes_and_the_stub_fails(group):
    verdict = check_global_grad_norm(group, conftest.load_solution("14_global_grad_norm").global_grad_norm)
    assert verdict, verdict.message
    assert "Checked on the 2 x 2 (dp, tp) mesh: every rank returns one process's norm" in verdict.message
    assert "Two all_reduces" not in verdict.message and group.world_size == 4
    stub = check_global_grad_norm(group, NB.global_grad_norm)    # runs, and is step 1's sum
    assert not stub and "NeMo-RL's bug" in stub.message
    stored = stored_cell("check_global_grad_norm(group, global_grad_norm)")["outputs"][0]["data"]
    assert "NeMo-RL's bug" in "".join(stored["text/plain"])


@pytest.mark.parametrize("mistake, explanation", [
    (every_rank_summed, "counted twice: NeMo-RL's bug (pull request #3788)"),
    (local_only, "Each rank's number is the norm of its own piece only"),
    (dp_only, "It is the sum over dp only"),
    (tp_only, "It is the sum over tp only"),
    (no_square_root, "It is the sum of squares"),
    (mesh_only, "The gradients of model[2] (2.weight, 2.bias) live on the dp mesh only"),
    (replicate_as_piece, "0.bias is Replicate() over tp"),
    (averaged, "It looks like an average over 4 ranks"),
    (every_rank_over_tp, "Dividing the sum over every rank by tp = 2 halves the pieces as well as the "
                         "copies: only the copies were counted twice."),
    (gathered, "The value is right, but your function called full_tensor()"),
    (gathered_single, "The value is right, but your function called dist.all_gather_single"),
    (torchs_own, "torch's own clip_grad_norm_ (or get_total_norm) failing on this model"),
    (collective_on_a_dtensor, "Your function combined DTensors that live on two meshes"),
    (a_list, "return the norm as one number"),
])
def test_each_usual_mistake_gets_its_explanation(group, mistake, explanation):
    verdict = check_global_grad_norm(group, mistake)
    assert not verdict and explanation in verdict.message, verdict.message
    assert not [line for line in solution_lines() if line in verdict.message]
    assert "over dp only." not in verdict.message             # the diagnosis, not the recipe
    assert group.world_size == 4


def test_a_wrong_norm_and_the_right_one_show_four_decimals(group):
    """A fifth review (14-5): with 4 significant digits the by-mesh mistake printed
    "returns 0.32" against "has norm 0.3185", which reads as nearly right. Four decimals
    show both numbers to the same place, so the difference is plain."""
    message = check_global_grad_norm(group, mesh_only).message
    got = re.search(r"returns (\d+\.\d{4}) on every rank; .* has norm (\d+\.\d{4})\.", message)
    assert got, message
    assert got.group(1) != got.group(2)


def test_exercise_data_match_the_docstring(group, whole):
    group.resize(4)
    out = group.run(exercise_run, conftest.load_solution("14_global_grad_norm").global_grad_norm, X, y)
    assert [(o["dp"], o["tp"]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for o in out:
        assert abs(o["value"] - whole) <= 1e-5 * whole and o["gathers"] == {}
        assert abs(math.sqrt(o["squares"]["right"]) - whole) <= 1e-5 * whole
        assert o["squares"]["every rank"] > o["squares"]["right"] > o["squares"]["dp only"]
    assert MESH_SHAPE == (2, 2)


def test_the_exercise_is_a_case_the_notebook_did_not_run():
    code = "\n".join(code_cells())
    assert "get_group(" not in code and "is_shard()" not in code      # the solution's two ideas
    assert "global_grad_norm" in cell_with("# %load solutions/14_global_grad_norm.py")
    assert "full_tensor()" in cell_with("## Exercise: the norm by hand")   # the prompt forbids gathering


# --- step 4: checkpoints ---------------------------------------------------------------------------
def test_ddp_saves_whole_tensors_on_rank_0_and_its_wrapper_adds_module(group):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ddp.pt")
        keys = group.run(NB.ddp_save_on_rank_0, path)
        state = torch.load(path)
        size = os.path.getsize(path)
    assert keys == ["module.0.weight"] * 4 and list(state) == [name for name, _, _ in LAYOUT]
    assert torch.equal(torch.cat([t.flatten() for t in state.values()]), initial_flat())
    assert f"ddp.pt: {size:,} bytes for 2,410 float32 values" in stored_text("def ddp_save_on_rank_0(")


def test_question_3_torch_save_under_fsdp2_keeps_rank_0s_rows(group):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "fsdp.pt")
        group.run(NB.fsdp_save_on_rank_0, path)
        lines = subprocess.run([sys.executable, "-c", NB.INFERENCE_SCRIPT, path], capture_output=True,
                               text=True, timeout=120).stdout.splitlines()
    assert lines == [
        "UnpicklingError: Weights only load failed. ``torch.distributed.tensor`` must be imported to load DTensors",
        "0.weight: DTensor, shape (32, 64), holding (8, 64)",
        "0.weight.full_tensor(): RuntimeError: Could not resolve the process group registered under the name 0"]
    folded = stored_folded("actual_3 = ")
    assert "The real run gives 8." in folded and all(line in folded for line in lines)   # torch's two errors


def test_a_full_state_dict_is_whole_on_rank_0_and_empty_elsewhere(group):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "full.pt")
        entries = group.run(NB.fsdp_full_state_on_rank_0, path)
        state = torch.load(path)
    assert entries == [4, 0, 0, 0] and all(type(t) is torch.Tensor for t in state.values())
    assert torch.equal(torch.cat([t.flatten() for t in state.values()]), initial_flat())
    assert "entries per rank: [4, 0, 0, 0]" in stored_text("def fsdp_full_state_on_rank_0(")


def load_model_only_then_step_2(path, X, y):
    """As the notebook's load_then_step_2, with the model's state only: the control for its
    claim that Adam's state came back too."""
    model, optimizer = NB.fsdp_model_and_adam()
    NB.dcp.load({"model": model.state_dict()}, checkpoint_id=path)      # in place, into the parameters
    NB.train_step(model, optimizer, X, y, 1)
    return torch.cat([p.full_tensor().flatten() for p in model.parameters()])


def test_dcp_reshards_model_and_adam_and_resumes_as_one_process(group):
    two_steps = reference_run(X, y, 2)["params"][1]
    with tempfile.TemporaryDirectory() as checkpoint:
        group.resize(4)
        group.run(NB.save_after_step_1, checkpoint, X, y)
        files = sorted(os.listdir(checkpoint))
        group.resize(3)
        resumed = group.run(NB.load_then_step_2, checkpoint, X, y)
        without_adam = group.run(load_model_only_then_step_2, checkpoint, X, y)
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert all((p - two_steps).abs().max() <= ATOL for p, _ in resumed)
    assert all((p - two_steps).abs().max() > 100 * ATOL for p in without_adam)   # Adam's state matters
    reads = [sorted({(file, chunk[0] + start[0], size[0]) for fqn, file, chunk, start, _, size in r
                     if fqn == "model.2.weight"}) for _, r in resumed]
    assert reads == [[("__0_0.distcp", 0, 3), ("__1_0.distcp", 3, 1)],
                     [("__1_0.distcp", 4, 2), ("__2_0.distcp", 6, 2)],
                     [("__2_0.distcp", 8, 1), ("__3_0.distcp", 9, 1)]]
    stored = stored_text("two_steps = reference_run(")
    assert "rank 1: rows 4-5 from __1_0.distcp, rows 6-7 from __2_0.distcp" in stored
    assert "rank 1's rows 4 to 7 of `2.weight` come from two files" in markdown()
    assert "The checkpoint's folder is gone: True" in stored
    assert "optim.state.0.weight.exp_avg" in stored


def test_the_recording_planner_plans_what_the_default_planner_plans():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    assert issubclass(RecordingLoadPlanner, DefaultLoadPlanner)
    assert [name for name in vars(RecordingLoadPlanner) if not name.startswith("__")] == ["create_local_plan"]
    assert "return plan" in inspect.getsource(RecordingLoadPlanner.create_local_plan)


# --- myth vs reality: values that are not DTensors -------------------------------------------------
def test_one_key_on_every_rank_is_one_value_and_per_rank_keys_do_not_reshard(group):
    with tempfile.TemporaryDirectory() as checkpoint:
        group.resize(3)
        group.run(NB.save_positions, checkpoint)
        same_size = group.run(NB.load_positions, checkpoint)
        group.resize(4)
        more_ranks = group.run(NB.load_positions, checkpoint)
    for rank, state in enumerate(same_size):
        assert state == {"position": 100, "position (an int)": 200, f"dataloader.dp_rank_{rank}": 100 * (rank + 1)}
    assert all(o == ["CheckpointException ranks:dict_keys([3])",
                     "RuntimeError: Missing key in checkpoint state_dict: dataloader.dp_rank_3."] for o in more_ranks)
    stored = stored_text("def save_positions(")
    assert "rank 1: {'position': 100, 'position (an int)': 200, 'dataloader.dp_rank_1': 200}" in stored
    assert "RuntimeError: Missing key in checkpoint state_dict: dataloader.dp_rank_3." in stored
    text = markdown()
    assert "The tensor came back as rank 0's 100, the int as rank 1's 200" in text


def lowest_rank_writes(path):
    from torch.distributed.checkpoint import DefaultSavePlanner
    import torch.distributed.checkpoint as dcp
    dcp.save({"position": torch.tensor(100 * (dist.get_rank() + 1)), "position (an int)": 100 * (dist.get_rank() + 1)},
             checkpoint_id=path, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    state = {"position": torch.tensor(-1), "position (an int)": -1}
    dcp.load(state, checkpoint_id=path)
    return int(state["position"]), state["position (an int)"]


def test_dedup_to_the_lowest_rank_and_the_quoted_source(group):
    with tempfile.TemporaryDirectory() as checkpoint:
        assert group.run(lowest_rank_writes, checkpoint) == [(100, 100)] * 4
    dedup = (TORCH / "distributed" / "checkpoint" / "_dedup_save_plans.py").read_text()
    quoted = "only the smallest SavePlan in terms of planned storage keeps the entry"
    assert quoted in dedup and quoted in markdown()
    planner = (TORCH / "distributed" / "checkpoint" / "default_planner.py").read_text()
    assert 'raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")' in planner
    assert "dedup_save_to_lowest_rank: bool = False" in planner


def test_the_gpu_part_says_what_was_not_run_and_its_sources_say_it():
    part = cell_with("## On GPUs with NCCL")
    assert "None of this was run here" in part
    from torch.distributed.checkpoint import async_save
    doc = " ".join(inspect.getdoc(async_save).split())
    assert "staging storage (defaults to CPU memory)" in doc and "separate thread" in doc


# --- the notebook as a whole -----------------------------------------------------------------------
def test_one_study_unit_and_its_header():
    prose = markdown().split("## Further reading")[0]
    assert 1500 < len(prose.split()) < 3200, len(prose.split())
    header = "".join(CELLS[0]["source"])
    assert "About 45 min to study" in header and "CPU only (gloo)" in header
    run_time = re.search(r"about (\d+) s to run", header).group(1)
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"`14_clipping_and_checkpoints_across_shards.ipynb` \|.*\| about {run_time} s \|", readme)


def test_the_learner_question_and_every_cited_report_are_named_with_their_dates():
    text = markdown()
    for cited in ('"Bug: clip_grad_norm_ doesn\'t work with FSDP2" (pytorch/pytorch#170862, 2025-12-19)',
                  '"fsdp grad norm need to be aggregated manually" (pytorch/torchtitan#766, 2025-01-01)',
                  '"FSDP checkpoints don\'t load when run is restarted with greater world size" (pytorch/torchtitan#811, 2025-01-28)',
                  '"fix(dtensor): count TP-replicated gradients once in get_grad_norm" (2026-08-24)',
                  "torchtitan#816", "torchtitan#291, 2024-05-01", "cosmos-rl", "#121945"):
        assert cited in text, cited


def test_every_temporary_folder_is_removed():
    """Each cell that writes files does so in a folder that its `with` block removes."""
    writing = [c for c in code_cells() if "tempfile." in c]
    assert len(writing) == 5
    for source in writing:
        assert "with tempfile.TemporaryDirectory() as" in source and "mkdtemp" not in source


# --- the explorer --------------------------------------------------------------------------------
@pytest.fixture()
def explorer(group):
    group.resize(4)
    return CheckpointExplorer(group, saved_on=4, loaded_on=3, parameter="2.weight")


def covers(pieces, first, count):
    """The pieces, in order, tile rows first .. first + count - 1."""
    at = first
    for start, n, _ in pieces:
        assert start == at and n > 0
        at += n
    return at == first + count


@pytest.mark.parametrize("saved_on, loaded_on", [(4, 3), (2, 3), (3, 1), (1, 4), (4, 4)])
def test_explorer_saves_and_loads_on_real_ranks(explorer, group, saved_on, loaded_on):
    explorer.controls["saved_on"].value = saved_on
    explorer.controls["loaded_on"].value = loaded_on
    r = explorer.result
    assert explorer.error is None and r.exact and bytes(explorer.image.value[:8]) == PNG
    assert group.world_size == max(saved_on, loaded_on)
    assert r.files == [".metadata"] + [f"__{k}_0.distcp" for k in range(saved_on)]
    for name, _, shape in LAYOUT:
        n = shape[0]
        for k, (first, count) in enumerate(r.saved[name]):            # torch.chunk's rule, as FSDP2's
            c = math.ceil(n / saved_on)
            assert (first, count) == (min(k * c, n), max(0, min(c, n - k * c)))
        c = math.ceil(n / loaded_on)
        for k, pieces in enumerate(r.loaded[name]):
            assert covers(pieces, min(k * c, n), max(0, min(c, n - k * c)))
            for start, count, source in pieces:                        # read from the file that holds it
                first, held = r.saved[name][source]
                assert first <= start and start + count <= first + held
    text = explorer.text()
    assert "every parameter on every loading rank equals the saved one bit for bit" in text
    assert f"Saved on {saved_on} rank" in text
    # a load that differed anywhere is not said to differ everywhere
    other = explorer.describe(dataclasses.replace(r, exact=False))
    assert "not every parameter on every loading rank equals the saved one" in other


def test_explorer_parameter_redraws_the_same_checkpoint(explorer):
    before, image = explorer.result, bytes(explorer.image.value)
    explorer.controls["parameter"].value = "0.weight"
    assert explorer.result is before and bytes(explorer.image.value) != image
    assert "0.weight is read: rank 0 from __0_0 and __1_0" in explorer.text()
    explorer.refresh()                                  # a refresh (as the benchmark times) saves anew
    assert explorer.result is not before and explorer.result.saved == before.saved
    assert PARAMETERS == ("0.weight", "0.bias", "2.weight", "2.bias")


def test_explorer_parameter_from_the_browser_redraws_the_same_checkpoint(explorer):
    """From the browser a change refreshes later, collapsed with the ones after it: a
    parameter click still redraws the last checkpoint (no DCP round trip on the ranks),
    while a loaded_on change followed by a parameter click in the same moment saves and
    loads anew. (The flag that chose the redraw once lived only while the change was
    handled, so every click in the browser saved and loaded again.)"""
    import asyncio

    from reducelab.widgets import QUIET
    ran = []
    real_run = explorer.group.run
    explorer.group.run = lambda *a, **k: ran.append(a[0]) or real_run(*a, **k)

    async def clicks(*changes):
        for name, state in changes:                    # what the browser sends
            explorer.controls[name].set_state(state)
        await asyncio.sleep(QUIET * 4 + 0.1)
    try:
        before, image = explorer.result, bytes(explorer.image.value)
        asyncio.run(clicks(("parameter", {"index": PARAMETERS.index("0.bias")})))
        assert explorer.values["parameter"] == "0.bias"
        assert ran == [] and explorer.result is before and bytes(explorer.image.value) != image
        assert "Loaded on 3 ranks, 0.bias is read" in explorer.text()
        asyncio.run(clicks(("loaded_on", {"value": 2}),
                           ("parameter", {"index": PARAMETERS.index("2.bias")})))
        assert len(ran) == 1 and explorer.result.loaded_on == 2
        assert "Loaded on 2 ranks, 2.bias is read" in explorer.text()
    finally:
        del explorer.group.run


def test_explorer_things_to_try_say_what_it_shows(explorer):
    explorer.controls["saved_on"].value = 2
    explorer.controls["loaded_on"].value = 4
    files = lambda name: [{s for _, _, s in pieces} for pieces in explorer.result.loaded[name]]  # noqa: E731
    assert files("0.weight") == [{0}, {0}, {1}, {1}]
    assert files("2.weight") == [{0}, {0, 1}, {1}, {1}]
    assert "Saved on 2, loaded on 4: `0.weight`'s 32 rows split evenly" in cell_with("Things to try:")
    explorer.controls["saved_on"].value = 4
    assert all(sources == {k} for name in PARAMETERS
               for k, sources in enumerate({s for _, _, s in p} for p in explorer.result.loaded[name]))


def test_explorer_removes_its_folders(explorer, monkeypatch):
    made = []
    real = tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(widget_module.tempfile, "mkdtemp", recording)
    explorer.controls["loaded_on"].value = 2
    assert made and not any(os.path.exists(path) for path in made)


def test_explorer_stored_state_is_the_notebooks(explorer):
    data = next(o["data"] for o in stored_cell("explorer = CheckpointExplorer(")["outputs"] if "data" in o)
    assert "image/png" in data and "".join(data["text/plain"]) == explorer.text()


def test_explorer_rejects_bad_initial_values(group):
    with pytest.raises(ValueError, match="saved_on must be an int from 1 to 8; got 9"):
        CheckpointExplorer(group, saved_on=9)
    with pytest.raises(ValueError, match="loaded_on must be an int from 1 to 8; got True"):
        CheckpointExplorer(group, loaded_on=True)
    with pytest.raises(ValueError, match="0.weight, 0.bias, 2.weight, 2.bias; got '1.weight'"):
        CheckpointExplorer(group, parameter="1.weight")


def test_explorer_follows_the_newest_open_group_when_its_own_is_closed(group):
    g = LocalGroup(world_size=2)
    ex = CheckpointExplorer(g, saved_on=2, loaded_on=1)
    g.close()
    ex.controls["loaded_on"].value = 2
    assert ex.group is group and ex.error is None and ex.result.exact
    assert group.world_size == 2


def refuses(path, saved_on, loaded_on):
    raise RuntimeError("boom")


def test_explorer_refusal_is_a_sentence(explorer, monkeypatch):
    monkeypatch.setattr(widget_module, "checkpoint_round_trip", refuses)
    explorer.controls["saved_on"].value = 2
    assert explorer.result is None and "refused to save on 2 and load on 3" in explorer.message.value
    assert "boom" in explorer.message.value


# --- figures -------------------------------------------------------------------------------------
def test_figures_and_their_errors(drawn):
    assert norm_figure({1: [0.3], 2: [0.2, 0.22], 4: [0.1, 0.2, 0.15, 0.12]}, 0.3).startswith(PNG)
    assert drawn[-1].get_figwidth() <= MAX_WIDTH
    with pytest.raises(ValueError, match="one norm per rank"):
        norm_figure({2: [0.1]}, 0.3)
    with pytest.raises(ValueError, match="global_norm > 0"):
        norm_figure({1: [0.1]}, 0.0)
    figure = CheckpointFigure()
    saved = [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2), (10, 0), (10, 0), (10, 0)]
    loaded = [[(0, 2, 0), (2, 2, 1)], [(4, 2, 2), (6, 2, 3)], [(8, 2, 4)]]
    assert figure.draw("2.weight", 10, saved, loaded, [100] * 8).startswith(PNG)
    fig = drawn[-1]
    assert fig.get_figwidth() <= MAX_WIDTH and fig.get_figheight() <= 5.0
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "held no rows: its file has none" in texts and "from 4" in texts and "rows 0–1" in texts
    assert figure.draw("2.weight", 10, [(0, 10)], [[(0, 3, 0)], [(3, 3, 0)], [(6, 3, 0)], [(9, 1, 0)], []],
                       [100]).startswith(PNG)
    assert "holds no rows: reads nothing" in [t.get_text() for ax in drawn[-1].axes for t in ax.texts]
    with pytest.raises(ValueError, match="within rows 0 .. 9"):
        figure.draw("2.weight", 10, [(0, 11)], [[(0, 11, 0)]], [100])
    with pytest.raises(ValueError, match="one size per saving rank"):
        figure.draw("2.weight", 10, [(0, 10)], [[(0, 10, 0)]], [100, 200])


def test_the_explorer_s_kept_figure_draws_what_a_new_one_draws(monkeypatch):
    """CheckpointFigure keeps a figure per (saving, loading) rank count
    (plots.kept_figure, fixed margins): checkpoints of other parameters, shapes and pieces
    drawn in turn into the kept figures give the bytes of a new figure for each, and a
    second draw of a shape makes no tick objects."""
    from matplotlib.axis import Tick
    from reducelab import plots
    states = [("2.weight", 10, [(0, 3), (3, 3), (6, 3), (9, 1)], [[(0, 3, 0), (3, 2, 1)], [(5, 1, 1), (6, 3, 2), (9, 1, 3)]],
               [300, 300, 300, 100]),
              ("0.weight", 32, [(0, 16), (16, 16)], [[(0, 8, 0)], [(8, 8, 0)], [(16, 8, 1)], [(24, 8, 1)]], [1600, 1600]),
              ("2.bias", 10, [(0, 5), (5, 5), (10, 0), (10, 0)], [[(0, 5, 0), (5, 5, 1)], []], [500, 500, 0, 0]),
              ("0.bias", 32, [(0, 16), (16, 16)], [[(0, 8, 0)], [(8, 8, 0)], [(16, 8, 1)], [(24, 8, 1)]], [1600, 1600])]
    monkeypatch.setattr(plots, "_KEPT", plots.collections.OrderedDict())
    figure = CheckpointFigure()
    kept = [figure.draw(*s) for s in states]
    assert len(plots._KEPT) == 2                    # two shapes: 4 and 2 ranks, 2 and 4
    made = conftest.record_calls(monkeypatch, Tick, "__init__")
    assert figure.draw(*states[0]) == kept[0] and made == []
    fresh = []
    for s in states:
        plots._KEPT.clear()
        fresh.append(figure.draw(*s))
    assert len(made) > 10
    assert kept == fresh and kept[1] != kept[3]


def one_all_reduce_norm(model, mesh):
    """A right answer with one all_reduce: a copy's squares divided by tp, then every rank's
    sum over all 4 ranks (the two tp copies add back to one)."""
    tp = mesh["tp"].size()
    squares = torch.zeros(())
    for p in model.parameters():
        local = p.grad.to_local().pow(2).sum()
        split = p.grad.device_mesh.ndim == 2 and p.grad.placements[1].is_shard()
        squares += local if split else local / tp
    dist.all_reduce(squares)
    return squares.sqrt().item()


def test_the_pass_message_says_what_was_checked_not_how_the_solution_did_it(group):
    """An expert review found the pass message describing the solution ("Two all_reduces of
    one number each") for a right answer with one all_reduce."""
    verdict = check_global_grad_norm(group, one_all_reduce_norm)
    assert verdict, verdict.message
    assert "Checked on the 2 x 2 (dp, tp) mesh" in verdict.message
    assert "Two all_reduces" not in verdict.message and "two all_reduces" not in verdict.message


def test_question_2_is_asked_after_the_pending_norm_of_one_gradient(group):
    """Question 2 leaned to False by its wording and hung on the torch version: the cell
    above it shows one gradient's norm pending (_NormPartial, a local value per rank,
    full_tensor() the whole), and the question is asked without a side."""
    q2 = next(i for i, c in enumerate(CELLS) if "".join(c["source"]).startswith("answer_2 = None"))
    shown = next(i for i, c in enumerate(CELLS) if "def one_gradient_norm(X, y):" in "".join(c["source"]))
    assert shown < q2
    out = group.run(NB.one_gradient_norm, X, y)
    assert all(str(placements) == "(_NormPartial(reduce_op='sum', norm_type=2),)" or
               "_NormPartial" in str(placements) for placements, _, _ in out)
    assert len({round(local, 6) for _, local, _ in out}) == 4
    assert all(abs(full - out[0][2]) <= ATOL for _, _, full in out)
    assert abs(out[0][2] - reference_run(X, y, 1)["grads"][0][:32 * 64].norm().item()) <= ATOL
    stored = stored_text("def one_gradient_norm(X, y):")
    assert "placements (_NormPartial(2),)" in stored
    asked = "".join(CELLS[q2 - 1]["source"])
    # review 7 (14-1): "is total_norm.to_local() the whole norm?" had two defensible answers
    # (older releases returned it pending, #126457); the count of collectives has one, which
    # the rule above it (pending through torch.stack, completed before the norm of norms) gives
    assert ("`CommDebugMode` counts the collectives DTensor runs inside that call: how many on "
            "each rank? Pick one of 0, 1 and 4.") in asked and "as #170862" not in asked
    assert "on the model's 4 gradients, each a DTensor" in asked
    assert [entry[0] for entry in LAYOUT] == ["0.weight", "0.bias", "2.weight", "2.bias"]   # 4 gradients
    assert "not one per gradient" in WHY["14"][2] and "torch.stack of the 4 pending norms" in WHY["14"][2]


def test_the_collectives_every_rank_must_call_are_named_where_rank_0_saves():
    """clip_grad_norm_ on DTensors, get_model_state_dict(full_state_dict=True), dcp.save and
    dcp.load are collectives: said where the notebook has just taught "rank 0 saves", and in
    the summary (an expert review ran clip_grad_norm_ on rank 0 only: it waited)."""
    import torch.distributed.checkpoint as dcp_module
    for fn in (dcp_module.save, dcp_module.load):
        assert "uses collectives to coordinate" in " ".join(fn.__doc__.split())
    cell = next("".join(c["source"]) for c in CELLS
                if "For one file of whole tensors, ask for them" in "".join(c["source"]))
    assert "Unlike `torch.save`, that is a collective" in cell and "`dcp.save` and `dcp.load`" in cell
    assert "Called inside `if rank == 0:`, rank 0 waits in the collective" in cell
    summary = markdown().split("## Summary")[1]
    assert "are collectives: every rank calls them, never inside `if rank == 0:`" in summary


def test_the_tp_result_leads_and_the_internals_sit_in_further_reading():
    text = markdown()
    start = text.index("Counted `tp` times, the copies")
    lead = text[start:text.index("\n\n", start)]
    assert lead.index("1.19 times too large") < lead.index("Further reading")
    assert "_partition_value" not in lead and "#121945" not in lead
    further = text.split("## Further reading")[1]
    assert "_NormPartial._partition_value" in further and "pytorch/pytorch#121945" in further
    # review 5 (14-3): the split of a copy's norm into tp parts of norm/√tp is taught in the core too
    core = text.split("## Exercise")[0]
    # teach-e review: clip_grad.py has no split; DTensor's torch.stack does it (the test below runs it)
    assert ("DTensor's `torch.stack` in `clip_grad_norm_` splits it into `tp` parts of norm/√`tp`, one per tp "
            "rank: their squares add up "
            "to the copy's square once") in core


def test_the_split_of_a_copy_s_norm_is_shown_from_a_run(group):
    """Review 6 (14-5): the core says clip_grad_norm_ splits a copy's norm into tp parts of
    norm/√tp; a cell shows it on the ranks (torch.stack of every gradient's norm, as
    get_total_norm stacks them), and the stored numbers are this run's."""
    group.resize(4)
    out = group.run(NB.a_copy_in_the_stack, X, y)
    for placed, local, stacked, part in out:
        assert str(placed) == "(_NormPartial(2), Replicate())"
        assert str(stacked) == "(_NormPartial(2), _NormPartial(2))"
        assert abs(part - local / math.sqrt(2)) <= ATOL
    placed, local, stacked, part = out[0]
    stored = stored_text("def a_copy_in_the_stack(")
    assert f"rank 0, 2.weight's norm: (_NormPartial(2), Replicate()), local {local:.4f}" in stored
    assert f"(_NormPartial(2), _NormPartial(2)), local {part:.4f} (local / √2 = {local / 2 ** 0.5:.4f})" in stored
    split = markdown().index("`torch.stack` in `clip_grad_norm_` splits it into `tp` parts")
    cell = next(i for i, c in enumerate(CELLS) if "def a_copy_in_the_stack(" in "".join(c["source"]))
    assert "".join(CELLS[cell - 1]["source"]) in markdown()[split - 2000:split + 2000]
    clip = (TORCH / "nn" / "utils" / "clip_grad.py").read_text()
    assert "torch.stack([norm.to(first_device) for norm in norms])" in clip


def test_the_header_says_to_study_it_after_18():
    """Review 6 (14-1): step 3 uses parallelize_module and RowwiseParallel, which notebook 18
    teaches: the header and the prerequisites say so."""
    header = "".join(CELLS[0]["source"])
    assert "follows notebooks 05, 09, 15 and 18: study it after 18" in header.splitlines()[2]
    prerequisites = header.split("## Prerequisites")[1]
    assert "18 (`parallelize_module` and `RowwiseParallel`, which step 3 uses)" in prerequisites


def test_step_3_says_in_plain_words_what_each_call_leaves_on_a_rank():
    """Review 6 (14-1): before step 3's code, what parallelize_module with RowwiseParallel,
    distribute_module and fully_shard leave on each rank, as the installed torch does it
    (torch/distributed/tensor/parallel/style.py: RowwiseParallel's weight Shard(1), bias
    Replicate(); distribute_module with no partition_fn replicates every parameter), and
    the placements step 3's code prints agree."""
    i = next(i for i, c in enumerate(CELLS) if "".join(c["source"]).startswith("## Step 3"))
    box = "".join(CELLS[i]["source"])
    assert "def tp_model_after_backward" in "".join(CELLS[i + 1]["source"])
    assert "In plain words, what each leaves on a rank:" in box
    assert "three calls (notebook 18 uses the first, 15 the last)" in box     # distribute_module is new here
    eighteen = (ROOT / "notebooks" / "18_transformer_layer.ipynb").read_text()
    assert "parallelize_module" in eighteen and "RowwiseParallel" in eighteen
    assert "distribute_module" not in eighteen and "fully_shard" in (ROOT / "notebooks" / "15_fsdp2.ipynb").read_text()
    assert "its weight a DTensor `Shard(1)` over `tp`" in box and "its bias `Replicate()`" in box
    assert "`distribute_module(model[2], mesh[\"tp\"])`" in box
    assert "each parameter becomes a DTensor `Replicate()` over `tp`" in box
    printed = "".join("".join(o.get("text", "")) for o in CELLS[i + 1]["outputs"])
    assert "0.weight  (Shard(dim=0), Shard(dim=1))" in printed
    assert "0.bias    (Shard(dim=0), Replicate())" in printed
    assert "2.weight  (Shard(dim=0), Replicate())" in printed
    import inspect
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import RowwiseParallel
    partition = inspect.getsource(RowwiseParallel._partition_linear_fn)
    assert "[Shard(1)]" in partition and "[Replicate()]" in partition
    assert "if partition_fn is None:" in inspect.getsource(distribute_module)


# --- review 5: the core is one study unit, the late parts optional ------------------------------------


def _pending_through_clip_grad_norm_s_steps(X, y):
    """On a rank: clip_grad_norm_'s steps on FSDP2's gradients (get_total_norm in
    torch/nn/utils/clip_grad.py), each under CommDebugMode: its placements and collectives."""
    from torch.distributed.tensor.debug import CommDebugMode
    grads = [p.grad for p in NB.fsdp_model_after_backward(X, y).parameters()]
    steps = []
    with CommDebugMode() as comms:
        norms = torch._foreach_norm(grads, 2.0)
    steps.append(("norms", str(norms[0].placements), comms.get_total_counts()))
    with CommDebugMode() as comms:
        stacked = torch.stack([n.to(grads[0].device) for n in norms])
    steps.append(("stack", str(stacked.placements), comms.get_total_counts()))
    with CommDebugMode() as comms:
        total = torch.linalg.vector_norm(stacked, 2.0)
    steps.append(("norm of norms", str(total.placements), comms.get_total_counts()))
    return steps


def test_a_pending_norm_stays_pending_through_stack_and_is_completed_before_the_norm_of_norms(group):
    """Review 5 (14-2): question 2 was a guess, and "Nothing in that file calls
    torch.distributed" leaned to False. The cell above it now states the rule: a pending value
    stays pending through an operation that acts on each piece alike (torch.stack), and DTensor
    completes it with an all_reduce before one that needs the value. Run here on the steps of
    get_total_norm: the per-gradient norms and their stack stay _NormPartial with no
    collective; the norm of norms runs one all_reduce first."""
    group.resize(2)
    steps = group.run(_pending_through_clip_grad_norm_s_steps, X, y)[0]
    assert steps[0] == ("norms", "(_NormPartial(2.0),)", 0)
    assert steps[1] == ("stack", "(_NormPartial(2.0),)", 0)
    assert steps[2] == ("norm of norms", "(Replicate(),)", 1)
    q2 = next(i for i, c in enumerate(CELLS) if "**Question 2.**" in "".join(c["source"]))
    rule = ("A pending value stays pending through operations that act on each piece alike, such as "
            "`torch.stack`; before a reduction of another kind, DTensor completes it with an "
            "`all_reduce` on every rank (`common_reduction_strategy` in `_math_ops.py`)")
    assert rule in "".join(CELLS[q2]["source"]).split("**Question 2.**")[0]
    # teach-e review: the reveal said "the norm of those norms needs their values", which question 1
    # refutes (norms of pieces add as squares, so it could stay pending). torch 2.13 completes it
    # because _NormPartial's pending reduction is a sum, not the norm's, and common_reduction_strategy
    # completes a pending value whose reduction differs: both read from the installed torch here.
    from torch.distributed.tensor._ops._math_ops import _NormPartial, _get_norm_reduction_op
    assert _NormPartial(2).reduce_op == "sum" != _get_norm_reduction_op(2)
    math_ops = (TORCH / "distributed" / "tensor" / "_ops" / "_math_ops.py").read_text()
    strategy = math_ops.split("def common_reduction_strategy(")[1].split("\ndef ")[0]
    assert "if isinstance(p, Partial) and p.reduce_op != reduction_op:" in strategy
    assert "replicate_reduction_dims(" in strategy
    text = " ".join(WHY["14"][2].split())
    assert "needs their values" not in text
    assert ("The norm of those norms could stay pending too, since norms of disjoint pieces add as squares "
            "(question 1), but torch 2.13 does not defer it: _NormPartial records its pending reduction as a "
            "sum (of squares), not a norm, and common_reduction_strategy") in text
    assert "Nothing in that file calls `torch.distributed`" not in markdown()
    group.resize(4)


def test_the_setup_cell_s_gradient_is_reference_run_s_first_without_adam():
    """Issue 23: 14's setup cell ran ``reference_run(X, y, 1)`` for its first gradient, and
    Adam's first step imports torch._dynamo (about 1 s): the cell took 2.1 times a bare
    ``import torch``. ``first_gradient`` is the same tensor, bit for bit, without it."""
    import subprocess
    import sys
    code = "".join(CELLS[2]["source"])
    assert "one_process = first_gradient(X, y)" in code and "reference_run(X, y, 1)" not in code
    out = subprocess.run([sys.executable, "-c", (
        "import sys, torch\n"
        "from reducelab.checks.sharded import first_gradient, reference_run\n"
        "from reducelab.data import load_digits_tensors\n"
        "X, y = load_digits_tensors()\n"
        "g = first_gradient(X, y)\n"
        "print('torch._dynamo' in sys.modules, torch.equal(g, reference_run(X, y, 1)['grads'][0]))")],
        capture_output=True, text=True, timeout=240)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
