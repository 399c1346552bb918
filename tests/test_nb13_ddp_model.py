"""Tests of notebook 13 (what DDP expects of a model): every fact the notebook states, run
with the notebook's own classes and rank functions (read from its code cells) on real gloo
ranks, hangs under short timeouts; the timing claim re-derived from the stored output; the
explorer driven headlessly through its settings; the exercise's check on the solution,
the stub and each usual mistake; and the figures."""
from __future__ import annotations

import html
import json
import pathlib
import re
import sys
import types

import cloudpickle
import numpy as np
import pytest
import torch

import conftest
from conftest import NotebookCells, notebook_module, stored_text
from reducelab import LocalGroup, RankError
from reducelab.checks.answers import WHY
from reducelab.checks.ddp_model import (SHARD_SIZES, check_evaluate_together, first_elements,
                                        stderr_during)
from reducelab.plots import MAX_WIDTH, MIN_FONT
from reducelab.plots.ddp_model import (NEAR_ZERO, StepFigure, buffers_figure, cell_labels,
                                       construction_figure, same_as_rank0)
from reducelab.widgets.ddp_model import (AUX_USED_ON, GROUPS, OPTIONS, SEEDINGS,
                                         DDPStepExplorer, StepResult, describe_result)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "13_what_ddp_expects_of_a_model.ipynb"
CELLS = json.loads(NOTEBOOK.read_text())["cells"]
HANG = 4.0
"""Timeout (s) of the groups that hang here: the notebook uses 3 s; a busy 2-core test
machine needs a little more to start and restart four ranks."""
KEEP = {"never", "rank_0_only", "every_other", "always", "DDP_OPTIONS"}
"""Module-level names the notebook assigns (lambdas, tables) that its functions need."""


def notebook_functions() -> types.ModuleType:
    """The notebook's imports, classes, ``def``s and the assignments in :data:`KEEP`, in a
    module the ranks cannot import (:func:`conftest.notebook_module`)."""
    return notebook_module(CELLS, "nb13_cells", KEEP,
                           preamble="from reducelab import LocalGroup, RankError, setup")


NB = notebook_functions()


_CELLS = NotebookCells(CELLS)
source_with, cell_with, markdown = _CELLS.source_with, _CELLS.cell_with, _CELLS.markdown


def same(a, b) -> bool:
    return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def quick():
    """Four ranks whose calls end after HANG seconds: for the hangs the notebook shows."""
    g = LocalGroup(world_size=4, timeout=HANG)
    yield g
    g.close()


@pytest.fixture(scope="module")
def info_group():
    g = LocalGroup(world_size=2, timeout=60, env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})
    yield g
    g.close()


@pytest.fixture(autouse=True)
def four_ranks(group, quick):
    group.resize(4)
    quick.resize(4)
    yield


# --- step 1: construction --------------------------------------------------------------------
def test_ddp_broadcasts_parameters_and_buffers_not_plain_attributes(group):
    out = group.run(NB.build_and_wrap)
    built = torch.stack([o[0] for o in out])
    wrapped = torch.stack([o[1] for o in out])
    assert not any(torch.equal(built[r], built[0]) for r in (1, 2, 3))     # each rank drew its own
    assert all(torch.equal(w, built[0]) for w in wrapped)                  # rank 0's, everywhere
    shifts = [after[0] for *_, after in out]
    scales = [(before[1], after[1]) for *_, before, after in out]
    assert shifts == [out[0][2][0]] * 4                                    # rank 0's buffer
    assert all(b == a for b, a in scales) and len({a for _, a in scales}) == 4
    assert "The real run gives (True, True, False)." in stored_text(cell_with("actual_1 = ("))


def non_persistent_buffer_after_ddp():
    torch.manual_seed(torch.distributed.get_rank())
    model = torch.nn.Linear(2, 1)
    model.register_buffer("kept_out_of_state_dict", torch.rand(3), persistent=False)
    assert "kept_out_of_state_dict" not in model.state_dict()
    torch.nn.parallel.DistributedDataParallel(model)
    return model.kept_out_of_state_dict


def test_a_buffer_left_out_of_state_dict_is_broadcast_too(group):
    """Question 1's reveal: DDP broadcasts named_buffers(), persistent=False ones included."""
    out = group.run(non_persistent_buffer_after_ddp)
    assert all(torch.equal(b, out[0]) for b in out)
    torch.manual_seed(0)
    torch.nn.Linear(2, 1)
    assert torch.equal(out[0], torch.rand(3))                              # rank 0's draw
    assert "named_buffers(), a buffer registered with persistent=False" in WHY["13"][1]
    assert "state_dict" not in WHY["13"][1]


def test_the_source_shown_is_the_construction_broadcast():
    text = stored_text(cell_with('"if init_sync:" in line'))
    assert "_verify_param_shape_across_processes(self.process_group, parameters)" in text
    assert "_sync_module_states(" in text and "src=0," in text


# --- step 2: buffers ---------------------------------------------------------------------------
def test_batchnorm_running_mean_follows_rank_0(group):
    synced = group.run(NB.bn_running_mean)
    assert synced == pytest.approx([1.0, 1.2, 1.4, 1.6], abs=1e-6)         # (4 * 1 + (r + 1)) / 5
    assert group.run(NB.bn_running_mean, forward_sync_buffers=False) == pytest.approx([1, 2, 3, 4])
    averaged = group.run(NB.bn_running_mean, average_at_end=True, forward_sync_buffers=False)
    assert averaged == pytest.approx([2.5] * 4)
    assert "The real run gives 1.0." in stored_text(cell_with("synced = group.run(bn_running_mean)"))


def test_broadcast_buffers_warns_and_skips_the_init_broadcast(group):
    out = group.run(NB.wrap_with, {"broadcast_buffers": False})
    assert [v for v, _ in out] == [0.0, 1.0, 2.0, 3.0]
    assert out[0][1][0].startswith("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.")
    out = group.run(NB.wrap_with, {"forward_sync_buffers": False})
    assert [v for v, _ in out] == [0.0] * 4 and out[0][1] == []
    doc = " ".join(NB.DDP.__doc__.split())
    assert "deprecated:: 2.13 Use ``forward_sync_buffers`` instead" in doc
    with pytest.raises(RankError, match="SyncBatchNorm layers only work with GPU modules"):
        group.run(NB.sync_batchnorm)


# --- step 3: unused parameters ---------------------------------------------------------------------
def test_an_unused_branch_skips_the_average_then_raises(group):
    out = group.run(NB.train, NB.never)
    grads = [g[0] for g, _ in out]
    assert [len(g) for g, _ in out] == [1] * 4                                # the error: step 2
    assert not any(same(g, grads[0]) for g in grads[1:])                      # not averaged
    assert all(g[-3:].isnan().all() for g in grads)                           # aux: no gradient
    for rank, (_, error) in enumerate(out):
        assert error.startswith("Expected to have finished reduction in the prior iteration "
                                "before starting a new one.")
        assert f"Parameter indices which did not receive grad for rank {rank}: 4 5" in error
    assert "The real run gives False." in stored_text(cell_with("actual_3 = all("))
    assert "Parameter indices which did not receive grad for rank 0: 4 5" in \
        stored_text(cell_with('print(out[0][1])'))


def test_info_names_the_parameters(info_group):
    error = info_group.run(NB.train, NB.never)[0][1]
    assert "Parameters which did not receive grad for rank 0: aux.bias, aux.weight" in error
    assert "Parameters which did not receive grad for rank 0: aux.bias, aux.weight" in \
        stored_text(cell_with("info_out = info_group.run"))


def test_a_branch_on_some_ranks_only_hangs_rank_0_in_backward(quick):
    with pytest.raises(RankError) as info:
        quick.run(NB.train, NB.rank_0_only)
    states = {r.rank: r.state for r in info.value.reports}
    assert states == {0: "stuck", 1: "returned", 2: "returned", 3: "returned"}
    assert "backward()" in source_with("def train(").splitlines()[15]         # "at train line 16"
    assert "rank 0: was still running, at train line 16" in \
        stored_text(cell_with("group.run(train, rank_0_only)\n"))


def record_train(folder, train, aux_used):
    import torch.distributed as dist
    grads, error = train(aux_used)
    with open(f"{folder}/rank_{dist.get_rank()}", "w") as f:
        f.write(error or "no error")


def test_the_ranks_that_skip_aux_raise_at_their_next_forward(quick, tmp_path):
    """The text: ranks 1 to 3 went on to the next step, whose forward raised, and returned."""
    with pytest.raises(RankError) as info:
        quick.run(record_train, str(tmp_path), NB.train, NB.rank_0_only)
    assert {r.rank: r.state for r in info.value.reports} == {0: "stuck", 1: "returned", 2: "returned", 3: "returned"}, str(info.value)
    written = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(written) == ["rank_1", "rank_2", "rank_3"]
    assert all(t.startswith("Expected to have finished reduction") for t in written.values())


def test_each_option_handles_what_the_notebook_says(group):
    for option, case, works in [({"find_unused_parameters": True}, NB.never, True),
                                ({"find_unused_parameters": True}, NB.rank_0_only, True),
                                ({"find_unused_parameters": True}, NB.every_other, True),
                                ({"static_graph": True}, NB.never, True),
                                ({"static_graph": True}, NB.rank_0_only, True),
                                ({"static_graph": True}, NB.every_other, False)]:
        out = group.run(NB.train, case, 3, **option)
        text = NB.outcome(out)
        if works:
            assert text.startswith("same, aux"), (option, text)
        else:
            assert text == "raises (below)"
            assert [e for _, e in out] == [STATIC_GRAPH_ERROR] * 4
    # review 6 (13-3): one table, the 3 steps and "gradients on all ranks" said once in its header
    table = stored_text(cell_with("cases = {"))
    assert table.startswith("gradients after 3 steps; aux used:")
    assert table.count("same, aux") == 5 and "differ" not in table and "raises" in table
    # review 8 (13-c): the table cut torch's error mid-phrase ("..., e.g., one"); the cell
    # prints it whole under the table, and the row says "raises (below)"
    rows = table.splitlines()
    assert rows[2].split() == ["static_graph=True", "same,", "aux", "none", "same,", "aux", "grad",
                               "raises", "(below)"], rows[2]
    assert rows[3:] == ["", STATIC_GRAPH_ERROR], rows[3:]
    assert "Warning" not in table              # each rank's C++ warning is kept for the optional part


STATIC_GRAPH_ERROR = ("Your training graph has changed in this iteration, e.g., one parameter is "
                      "unused in first iteration, but then got used in the second iteration. this "
                      "is not compatible with static_graph set to True.")
"""torch's whole error when a static graph's unused parameter is used in step 2 (reducer.cpp)."""


def mean_loss_gradient(world_size, aux_used):
    """One process: the gradient of the mean of every rank's loss, at the start (review 6 cut
    the notebook's optional part that ran it: the explorer's try list says what it shows)."""
    torch.manual_seed(0)
    model = NB.Net()
    losses = []
    for r in range(world_size):
        x, y = NB.local_batch(r)
        losses.append(NB.F.mse_loss(model(x, use_aux=aux_used(r, 0)), y))
    (sum(losses) / world_size).backward()
    return NB.first_elements(model.parameters(), grad=True)


def test_aux_gradient_from_rank_0_alone_is_the_mean_loss_gradient(group):
    grads = [g[0] for g, _ in group.run(NB.train, NB.rank_0_only, 1, find_unused_parameters=True)]
    reference = mean_loss_gradient(4, NB.rank_0_only)
    assert max((g - reference).abs().max().item() for g in grads) <= 1e-6
    assert not reference[-3:].isnan().any() and reference[-3:].abs().sum() > 0


def test_find_unused_parameters_warns_once_per_process_with_torchs_words():
    with LocalGroup(world_size=2, timeout=60) as g:
        first = [t for _, t in g.run(stderr_during, NB.train, NB.always, 1, find_unused_parameters=True)]
        again = [t for _, t in g.run(stderr_during, NB.train, NB.always, 1, find_unused_parameters=True)]
    assert all("This flag results in an extra traversal of the autograd graph every iteration" in t
               for t in first)
    assert again == ["", ""]
    stored = stored_text(cell_with("logs = [text for _, text in"))
    assert stored.startswith("ranks that warned: 4 of 4")
    assert "results in an extra traversal of the autograd graph every iteration" in stored
    quote = "an extra traversal of the autograd graph every iteration, which can adversely affect performance"
    assert quote in " ".join(first[0].lower().split()) and quote in " ".join(markdown().lower().split())


def test_collectives_per_step(group):
    default = group.run(NB.collectives_per_step)[0]
    assert default == ["all_reduce of 58", "all_reduce of 58, broadcast of 1, broadcast of 7",
                       "all_reduce of 58"]
    # The profiler records the two all_reduces of one backward in either order (1 run in 15
    # on an idle machine): the notebook sorts them, so that its stored output holds.
    for _ in range(3):
        unused = group.run(NB.collectives_per_step, find_unused_parameters=True)[0]
        assert unused == ["all_reduce of 6, all_reduce of 58"] * 3
    static = group.run(NB.collectives_per_step, static_graph=True)[0]
    assert static == ["all_reduce of 6, all_reduce of 58", "all_reduce of 58",
                      "all_reduce of 58, broadcast of 1, broadcast of 7"]
    assert sum(p.numel() for p in NB.Net().parameters()) == 58 and len(list(NB.Net().parameters())) == 6


def test_the_timing_claim_holds_in_the_stored_output():
    """The prose: find_unused_parameters=True costs CPU time in most steps; static_graph=True
    about what the default costs. Re-derived from the cell's stored output."""
    cell = cell_with("def step_cpu_times(")
    assert cell["metadata"].get("tags") == ["nbval-ignore-output"]
    text = stored_text(cell)
    assert "Warning" not in text                   # the warning of step 4 is not shown again
    m = re.search(r"find_unused_parameters=True\s+median ([\d.]+) ms; minus the default's, step by "
                  r"step: median \+?(-?[\d.]+) ms \(quartiles \+?(-?[\d.]+) to \+?(-?[\d.]+)\), more CPU "
                  r"in (\d+) of (\d+) steps", text)
    assert m, text
    median_extra, q1, more, n = float(m[2]), float(m[3]), int(m[5]), int(m[6])
    assert n >= 15 and more > n / 2 and median_extra > 0        # "in most steps"
    base = float(re.search(r"default\s+median ([\d.]+) ms", text)[1])
    static = float(re.search(r"static_graph=True\s+median ([\d.]+) ms", text)[1])
    s = re.search(r"static_graph=True\s+median [\d.]+ ms; minus the default's, step by step: median "
                  r"\+?(-?[\d.]+) ms \(quartiles \+?(-?[\d.]+) to \+?(-?[\d.]+)\), more CPU in (\d+) of "
                  r"(\d+) steps", text)
    assert s, text
    static_extra, static_q1, static_q3 = float(s[1]), float(s[2]), float(s[3])
    # A third round: "differs from the default by less than the noise here (its quartiles lie
    # on both sides of zero)" failed in 3 of 4 re-runs (quartiles +0.008 to +0.105, +0.013 to
    # +0.088, +0.005 to +0.076 ms; once -0.058 to +0.091): a small cost is real on some runs. What
    # held in every run: the median extra under half the flag's, the quartiles below the flag's.
    assert static_extra < median_extra / 2, (static_extra, median_extra)
    # the Summary's "for less CPU than find_unused_parameters=True": the spreads do not overlap
    assert static_q3 < q1 and static_q1 < static_q3
    prose = source_with("The extra traversal and bookkeeping cost CPU time in most steps", "markdown")
    assert ("`static_graph=True` costs far less: its median extra is under half the flag's, and its "
            "quartiles lie below the flag's") in prose
    assert "less than the noise" not in prose
    assert "also costs some CPU in most steps" not in prose


# --- step 5: evaluation on rank 0 ------------------------------------------------------------------------
def test_evaluating_through_the_wrapper_hangs_and_module_does_not(quick):
    with pytest.raises(RankError) as info:
        quick.run(NB.evaluate_on_rank_0, "model")
    assert {r.rank: r.state for r in info.value.reports} == {0: "stuck", 1: "returned",
                                                            2: "returned", 3: "returned"}
    assert quick.run(NB.evaluate_on_rank_0, "model.module") == ["returned"] * 4
    assert quick.run(NB.evaluate_on_rank_0, "model", batchnorm=False) == ["returned"] * 4
    with pytest.raises(RankError):
        quick.run(NB.evaluate_on_rank_0, "model", batchnorm=False, grad=True)
    assert "The real run gives True." in stored_text(cell_with("actual_4 = "))


def train_through_module():
    """Two ranks' gradients after one training forward and backward through
    ``model.module``: each rank's data differ, so an all_reduce would make them equal."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(nn.Linear(2, 1))
    x = torch.ones(3, 2) * (dist.get_rank() + 1)
    model(x).sum().backward()                       # one step through the wrapper: averaged
    through_wrapper = model.module.weight.grad.clone()
    model.zero_grad()
    model.module(x).sum().backward()                # the same through model.module
    return through_wrapper, model.module.weight.grad.clone()


def test_training_through_model_module_is_not_averaged_and_the_timeouts_are_torchs(quick):
    """Cell "On rank 0 alone, evaluate `model.module`" and the Summary (an expert review:
    the advice invites training through model.module, which nothing reports)."""
    quick.resize(2)
    (w0, m0), (w1, m1) = quick.run(train_through_module)
    assert torch.equal(w0, w1) and not torch.equal(m0, m1)
    assert torch.equal(m0, w0 * 2 / 3) and torch.equal(m1, w0 * 4 / 3)   # each rank's own gradient
    from datetime import timedelta

    import torch.distributed.constants as constants
    assert constants.default_pg_timeout == timedelta(minutes=30)
    assert constants.default_pg_nccl_timeout in (None, timedelta(minutes=10))
    header = pathlib.Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if header.exists():
        assert "kProcessGroupNCCLDefaultTimeout =\n    std::chrono::milliseconds(10 * 60 * 1000)" in header.read_text()
    import inspect
    from torch.nn.parallel import DistributedDataParallel
    assert "self.reducer.prepare_for_backward(" in inspect.getsource(DistributedDataParallel._post_forward)
    cell = source_with("On rank 0 alone, evaluate `model.module`", "markdown")
    for words in ("a training forward and `backward()` through `model.module` bypass DDP's `forward`",
                  "no gradient is all-reduced and each rank steps on its own, with no error",
                  "`torch.distributed.constants.default_pg_timeout`, 30 min, for gloo; 10 min for NCCL"):
        assert words in cell, words
    summary = source_with("## Summary", "markdown")
    # review 6 (13-3): the summary keeps the rule; the timeouts are said once, in step 5
    assert "only evaluate: a training step through it is silently not averaged" in summary
    assert "(another rank's, its history plus its own last batch)" not in summary
    assert ("rank 0's hold its own batches alone, another rank's hold rank 0's history plus that "
            "rank's last batch") in summary


def test_question_3_does_not_say_what_ddp_promises():
    """An expert review: "..., as DDP promises?" gave the answer away."""
    question = source_with("**Question 3.**", "markdown")
    assert "do the 4 ranks hold the same gradient? Answer `True` or `False`." in question
    assert "promise" not in question
    # review 7 (13-2): the question needs the one bucket, which step 3's intro now states and
    # WHY["13"][3] says again: Net's parameters, all of them, fit DDP's first bucket (1 MiB)
    step_3 = " ".join(source_with("## Step 3:", "markdown").split())
    assert "In this small model every parameter shares one bucket." in step_3
    # review 8 (13-a): step 3 said DDP "at the end of backward() waits for every bucket", from
    # which a learner predicts a hang at question 3; the wait is queued only once the last
    # bucket is launched (Reducer::mark_variable_ready), so with a bucket never ready no
    # collective runs and backward() returns (_collectives_of_one_backward, run below)
    assert "waits for every bucket" not in step_3
    assert ("Only when the last bucket has been launched does it queue a wait for them all at the "
            "end of `backward()`.") in step_3
    assert "queued the wait at the end of backward()" in WHY["13"][3]
    assert "Reducer::mark_variable_ready" in source_with("## Further reading", "markdown")
    import torch.distributed as dist
    size = sum(p.numel() * p.element_size() for p in NB.Net().parameters())
    assert size < dist._DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024, size


def test_the_summary_says_static_graph_s_lower_cost_is_shown_in_an_optional_part():
    """Review 7 (13-4): the cost of the two options is measured only in an optional part."""
    summary = source_with("## Summary", "markdown")
    assert "fixes a set that is the same in every step, at less cost (optional part)." in summary


def test_own_batchnorm_statistics_miss_by_several_percent(group):
    """The check's training data are shifted per rank (mean r + 1, as step 2): an expert
    review saw "4 different models" reported for a 0.1% difference."""
    from reducelab.checks.ddp_model import SHARD_SIZES, evaluate_on_every_rank
    rows = group.run(evaluate_on_every_rank, own_batchnorm_statistics)
    own = sum(row["share_own"] for row in rows) / sum(SHARD_SIZES)
    reference = rows[0]["reference"]
    assert abs(own - reference) > 0.05 * reference, (own, reference)


# --- the explorer --------------------------------------------------------------------------------------
@pytest.fixture()
def explorer(quick):
    return DDPStepExplorer(quick, NB.one_step)


def test_explorer_default_shows_the_unaveraged_step(explorer):
    r = explorer.result
    assert explorer.error is None and (r.aux_used_on, r.option) == ("no rank", "default")
    assert bytes(explorer.image.value[:8]) == PNG
    assert StepResult.rows_equal(r.wrapped) and not StepResult.rows_equal(r.built)
    assert not StepResult.rows_equal(r.grad) and not StepResult.rows_equal(r.after)
    assert all(t.startswith("Expected to have finished reduction") for t in r.next_forward)
    assert "The next forward raises on 4 of 4 ranks: RuntimeError: Expected to have finished " \
           "reduction in the prior iteration before starting a new one." in explorer.message.value
    assert explorer.text() in stored_text(cell_with("explorer = DDPStepExplorer("))
    # the body's gradient, far smaller than the head's, is never labelled "0" (a second review)
    group_of = np.repeat(np.arange(len(GROUPS)), [k for _, k in GROUPS])
    _, labels = cell_labels(r.grad, group_of)
    assert not ((labels == "0") & (r.grad != 0)).any()
    assert (labels[:, :2] != NEAR_ZERO).sum() >= 4                    # body's own unit: digits


def test_a_small_gradient_never_reads_as_zero(drawn):
    """The explorer's body gradient is about a hundred times smaller than the head's, and in
    the panel's one unit it read "0 0" beside "differs" (a second review). The gradient panel
    gives each column group its own unit, written under its name; a value that is not zero
    but rounds to 0 reads "~0", which the key explains; an exact zero stays "0"."""
    nan = np.nan
    grad = np.array([[2.4e-2, 9.6e-3, -0.14, 0.29, nan, nan],
                     [-3.9e-4, 0.0, 0.56, -0.48, nan, nan]])
    data = np.full((2, 6), 0.1)
    StepFigure().draw(data, data, np.zeros((2, 8), bool), grad, data, GROUPS, "t")
    fig = drawn[-1]
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("gradient"))
    assert [t.get_text() for t in panel.get_xticklabels()] == ["body\n×10⁻³", "head\n×10⁻²", "aux"]
    shown = [t.get_text() for t in panel.texts if t.get_text() and t.get_text() != "none"]
    assert shown == ["24", "10", "-14", "29", NEAR_ZERO, "0", "56", "-48"]
    key = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert f"{NEAR_ZERO}: not zero, under half" in key
    exponents, labels = cell_labels(np.array([[0.5, 0.001, 0.0]]))   # one unit for the panel
    assert exponents == [-2] and labels.tolist() == [["50", NEAR_ZERO, "0"]]


@pytest.mark.parametrize("option", ["find_unused_parameters", "static_graph"])
def test_explorer_options_average_and_leave_aux_without_gradient(explorer, option):
    explorer.controls["option"].value = option
    r = explorer.result
    assert StepResult.rows_equal(r.grad) and StepResult.rows_equal(r.after)
    assert np.isnan(r.grad[:, 4:]).all() and not np.isnan(r.grad[:, :4]).any()
    assert r.next_forward == [""] * 4 and "The next forward runs." in explorer.message.value


def test_explorer_rank_0_only(explorer):
    explorer.controls["option"].value = "find_unused_parameters"
    explorer.controls["aux_used_on"].value = "rank 0 only"
    r = explorer.result
    assert StepResult.rows_equal(r.grad) and not np.isnan(r.grad).any()
    assert "rank 0's own divided by 4" in html.unescape(explorer.message.value)
    explorer.controls["option"].value = "default"
    assert explorer.result is None and explorer.error is not None
    message = html.unescape(explorer.message.value)
    assert "A hang, ended by the group's 4 s timeout: rank 0 used aux" in message
    assert "ranks 1, 2, 3 did not use aux" in message
    explorer.controls["aux_used_on"].value = "every rank"
    assert explorer.error is None and StepResult.rows_equal(explorer.result.grad)


def test_explorer_seeding_and_world_size(explorer, quick):
    explorer.controls["seeding"].value = "same seed"
    r = explorer.result
    assert StepResult.rows_equal(r.built) and all(np.array_equal(m, r.dropped[0]) for m in r.dropped)
    assert "Dropout drew the same mask on every rank." in explorer.message.value
    explorer.controls["world_size"].value = 2
    assert quick.world_size == 2 and explorer.result.world_size == 2
    assert explorer.result.grad.shape == (2, 6)


def test_explorer_rejects_bad_values_and_follows_a_new_group(quick):
    with pytest.raises(ValueError, match="every rank, no rank, rank 0 only"):
        DDPStepExplorer(quick, NB.one_step, aux_used_on="sometimes")
    with pytest.raises(ValueError, match="default, find_unused_parameters, static_graph"):
        DDPStepExplorer(quick, NB.one_step, option="gradient_as_bucket_view")
    with pytest.raises(ValueError, match="from 2 to 4"):
        DDPStepExplorer(quick, NB.one_step, world_size=5)
    with pytest.raises(TypeError, match="must be a function"):
        DDPStepExplorer(quick, "one_step")
    g = LocalGroup(world_size=2, timeout=60)
    ex = DDPStepExplorer(g, NB.one_step, world_size=2)
    g.close()
    ex.controls["seeding"].value = "same seed"
    assert ex.group is not g and ex.error is None and ex.result.world_size == 2


def test_describe_has_no_numbers_of_rounding_size():
    n = 2
    r = StepResult("every rank", "default", "seed + rank", n, np.ones((n, 6)), np.ones((n, 6)),
                   np.full((n, 6), 0.1234567), np.ones((n, 6)), np.zeros((n, 8), bool), ["", ""])
    text = describe_result(r)
    assert "0.12" not in text and "every rank holds the same gradient" in text
    assert AUX_USED_ON == ("every rank", "no rank", "rank 0 only")
    assert OPTIONS == ("default", "find_unused_parameters", "static_graph")
    assert SEEDINGS == ("same seed", "seed + rank") and sum(k for _, k in GROUPS) == 6


# --- the exercise --------------------------------------------------------------------------------------
def solution_lines() -> list[str]:
    path = ROOT / "notebooks" / "solutions" / "13_evaluate_together.py"
    return [line.strip() for line in path.read_text().splitlines()
            if len(line.strip()) > 12 and not line.strip().startswith(("#", '"', "def "))]


def test_solution_passes_and_the_world_size_is_restored(group):
    group.resize(2)
    verdict = check_evaluate_together(group, conftest.load_solution("13_evaluate_together").evaluate)
    assert verdict, verdict.message
    assert f"all {sum(SHARD_SIZES)} validation samples" in verdict.message and group.world_size == 2


def test_the_notebook_stub_fails_without_the_solution(group):
    verdict = check_evaluate_together(group, NB.evaluate)
    assert not verdict and "the model ran in training mode" in verdict.message
    assert not [line for line in solution_lines() if line in verdict.message]
    assert "check_evaluate_together(group, evaluate)" in \
        source_with("from reducelab.checks.ddp_model import check_evaluate_together")


def _sum_and_count(loss_sum, n):
    import torch.distributed as dist
    t = torch.stack([loss_sum, torch.tensor(float(n))])
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def through_the_wrapper(model, x, y):        # right: the wrapper's forward broadcasts rank 0's buffers
    import torch.nn.functional as F
    model.eval()
    with torch.no_grad():
        value = _sum_and_count(F.mse_loss(model(x), y, reduction="sum"), len(x))
    model.train()
    return value


def own_share_only(model, x, y):
    import torch.nn.functional as F
    model.eval()
    with torch.no_grad():
        value = F.mse_loss(model.module(x), y).item()
    model.train()
    return value


def mean_of_means(model, x, y):
    import torch.distributed as dist
    import torch.nn.functional as F
    model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    model.train()
    return loss.item()


def own_batchnorm_statistics(model, x, y):   # model.module on every rank: four sets of statistics
    import torch.nn.functional as F
    model.eval()
    with torch.no_grad():
        value = _sum_and_count(F.mse_loss(model.module(x), y, reduction="sum"), len(x))
    model.train()
    return value


def training_mode(model, x, y):              # no eval(): BatchNorm takes in the validation batch
    import torch.nn.functional as F
    with torch.no_grad():
        return _sum_and_count(F.mse_loss(model(x), y, reduction="sum"), len(x))


def left_in_eval_mode(model, x, y):
    import torch.nn.functional as F
    model.eval()
    with torch.no_grad():
        return _sum_and_count(F.mse_loss(model(x), y, reduction="sum"), len(x))


def steps_the_optimizer(model, x, y):        # a backward and an update while evaluating
    import torch.nn.functional as F
    model.eval()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.train()
    return _sum_and_count(loss.detach() * len(x), len(x))


def with_gradients_enabled(model, x, y):     # right numbers, but no torch.no_grad(): a graph per forward
    import torch.distributed as dist
    import torch.nn.functional as F
    model.eval()
    for buffer in model.module.buffers():
        dist.broadcast(buffer, src=0)
    value = _sum_and_count(F.mse_loss(model.module(x), y, reduction="sum").detach(), len(x))
    model.train()
    return value


def averaged_statistics(model, x, y):      # review 8 (13-d): eval mode, but the buffers averaged in place
    import torch.distributed as dist
    import torch.nn.functional as F
    model.eval()
    for buffer in model.module.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, op=dist.ReduceOp.AVG)
    with torch.no_grad():
        value = _sum_and_count(F.mse_loss(model.module(x), y, reduction="sum"), len(x))
    model.train()
    return value


def returns_a_list(model, x, y):
    return [0.0]


@pytest.mark.parametrize("mistake, explanation", [
    (own_share_only, "Each rank returned the mean loss of its own share (7, 5, 3 and 2 samples)"),
    (mean_of_means, "the mean of the 4 ranks' own means. It weights every rank alike"),
    (own_batchnorm_statistics, "each rank evaluated its share with its own BatchNorm running statistics"),
    (training_mode, "the model ran in training mode"),
    (averaged_statistics, "changed during evaluate, though no forward ran in training mode: your "
                          "function changed them itself (an all_reduce of them, for instance)."),
    (left_in_eval_mode, "the model is still in eval mode"),
    (steps_the_optimizer, "The parameters changed during evaluate"),
    (with_gradients_enabled, "the model's output required grad: evaluate ran with gradients enabled"),
    (returns_a_list, "Return the mean loss as a Python float"),
])
def test_each_usual_mistake_gets_its_explanation(group, mistake, explanation):
    verdict = check_evaluate_together(group, mistake)
    assert not verdict and explanation in verdict.message, verdict.message
    assert not [line for line in solution_lines() if line in verdict.message]
    assert group.world_size == 4


def test_the_wrappers_own_buffer_broadcast_passes_too(group):
    """Every rank calls the wrapper: its forward broadcasts rank 0's buffers first
    (forward_sync_buffers, step 2), so the loss is rank 0's model's."""
    verdict = check_evaluate_together(group, through_the_wrapper)
    assert verdict, verdict.message
    # and the pass says which path did the broadcast (an expert review: it credited the
    # learner with a broadcast the wrapper made); the solution's pass does not say it
    assert "reached every rank through the wrapper" in verdict.message
    # the option the notebook teaches (torch 2.13's will_sync_module_buffers reads it)
    assert "forward_sync_buffers=True" in verdict.message and "broadcast_buffers" not in verdict.message
    solution = check_evaluate_together(group, conftest.load_solution("13_evaluate_together").evaluate)
    assert solution and "through the wrapper" not in solution.message


def test_rank_0_alone_through_the_wrapper_hangs_and_is_told(quick):
    def rank_0_alone(model, x, y):
        import torch.distributed as dist
        import torch.nn.functional as F
        if dist.get_rank() == 0:
            model.eval()
            value = F.mse_loss(model(x), y).item()
            model.train()
            return value
        return 0.0
    verdict = check_evaluate_together(quick, rank_0_alone)
    assert not verdict and "did not finish" in verdict.message and verdict.mistake == "hung past the timeout"


def test_a_non_function_is_refused(group):
    assert not check_evaluate_together(group, "evaluate")


# --- helpers on the ranks ----------------------------------------------------------------------------
def test_first_elements():
    lin = torch.nn.Linear(3, 2)
    flat = first_elements(lin.parameters())
    assert flat.shape == (4,) and torch.equal(flat[:2], lin.weight.detach().flatten()[:2])
    assert first_elements(lin.parameters(), grad=True).isnan().all()
    lin(torch.ones(1, 3)).sum().backward()
    assert torch.equal(first_elements(lin.parameters(), grad=True, k=1), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="1 or more"):
        first_elements(lin.parameters(), k=0)


def test_stderr_during_keeps_fd_2_and_restores_it(capfd):
    import os

    def write():
        os.write(2, b"from C++\n")
        return 7
    assert stderr_during(write) == (7, "from C++\n")
    os.write(2, b"after\n")
    assert "after" in capfd.readouterr().err

    def fails():
        raise ValueError("boom")
    with pytest.raises(ValueError, match="boom"):
        stderr_during(fails)
    os.write(2, b"still restored\n")
    assert "still restored" in capfd.readouterr().err


# --- the figures ---------------------------------------------------------------------------------------
def test_static_figures(drawn):
    rng = np.random.default_rng(0)
    b = rng.normal(0, 0.3, (4, 10))
    w = np.tile(b[0], (4, 1))
    groups = [("body", 4), ("head", 3), ("aux", 3)]
    assert construction_figure(b, w, groups, "t").startswith(PNG)
    labels = [t.get_text() for ax in drawn[-1].axes for child in ax.child_axes
              for t in child.get_yticklabels()]
    assert labels.count("same") == 3 and labels.count("differs") == 3, labels
    with pytest.raises(ValueError, match="same shape"):
        construction_figure(b, w[:, :5], groups)
    with pytest.raises(ValueError, match="must name 10 columns"):
        construction_figure(b, w, [("body", 4)])
    assert buffers_figure([1, 1.2], [1, 2], 1.5).startswith(PNG)
    with pytest.raises(ValueError, match="one value per rank"):
        buffers_figure([1, 2], [1], 1.5)
    assert same_as_rank0(np.array([[1, np.nan], [1, np.nan], [1, 2]])) == [True, True, False]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_explorer_figure_fits_and_labels_fit_their_cells(drawn, world_size):
    rng = np.random.default_rng(world_size)
    data = rng.normal(0, 0.3, (world_size, 6))
    grad = data.copy()
    grad[:, 4:] = np.nan
    dropped = rng.random((world_size, 8)) < 0.5
    assert StepFigure().draw(data, data, dropped, grad, data, GROUPS, "t").startswith(PNG)
    fig = drawn[-1]
    assert fig.get_figwidth() <= MAX_WIDTH
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    heat = [ax for ax in fig.axes if ax.get_images()]
    assert len(heat) == 4
    for ax in heat:
        cell = ax.get_window_extent().width / 6
        for t in ax.texts:
            assert t.get_fontsize() >= MIN_FONT
            assert t.get_window_extent(renderer).width < cell, (t.get_text(), cell)
    with pytest.raises(ValueError, match="one row per rank"):
        StepFigure().draw(data, data, dropped[:1], grad, data, GROUPS)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_a_run_of_cells_with_no_value_says_none_once_and_no_labels_touch(drawn, world_size):
    """At 4 ranks the aux group's two "none" boxes used to touch and read "none,none"
    across the cell border (3 pixels of hatch between them): now each run of empty cells
    within a column group has one "none", centred on the run, and any two labels' boxes
    are 6 pixels (0.06 in) apart or more. A run stops at a group
    border (body | head | aux), and a cell that has a value again shows its own number."""
    rng = np.random.default_rng(world_size)
    data = rng.normal(0, 0.3, (world_size, 6))
    grad = data.copy()
    grad[:, 1:] = np.nan            # body's second column, both of head's, both of aux's
    dropped = rng.random((world_size, 8)) < 0.5
    figure = StepFigure()
    figure.draw(data, data, dropped, grad, data, GROUPS, "t")
    fig = drawn[-1]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("gradient"))
    nones = [t for t in panel.texts if t.get_text() == "none"]
    assert sorted(t.get_position() for t in nones) == sorted(
        (x, float(i)) for i in range(world_size) for x in (1.0, 2.5, 4.5))
    for ax in (a for a in fig.axes if a.get_images()):
        conftest.assert_apart(conftest.text_boxes(ax, renderer), 6, ax.get_title())
    # the same figure, drawn again with every gradient present, equals a new figure's
    again = figure.draw(data, data, dropped, data, data, GROUPS, "t")
    assert again == StepFigure().draw(data, data, dropped, data, data, GROUPS, "t")


def test_going_back_to_a_world_size_reuses_its_figure_and_draws_the_same(drawn):
    """Back at a world size drawn before, the explorer's figure is the one built for it
    (no new figure and layout), and its PNG is the same as a new figure's."""
    def state(ws):
        rng = np.random.default_rng(ws)
        data = rng.normal(0, 0.3, (ws, 6))
        grad = data.copy()
        grad[1:, 4:] = np.nan
        return data, data, rng.random((ws, 8)) < 0.5, grad, data, GROUPS

    figure = StepFigure()
    figure.draw(*state(4), title="t")
    first = figure.fig
    figure.draw(*state(2), title="t")
    assert figure.fig is not first
    again = figure.draw(*state(4), title="t")
    assert figure.fig is first
    assert again == StepFigure().draw(*state(4), title="t")


# --- the notebook's text ---------------------------------------------------------------------------------
def test_header_and_cited_questions():
    head = source_with("# What does DDP expect of my model?", "markdown")
    assert re.search(r"\*About (3\d|4[0-5]) min to study · about \d+ s to run top to bottom", head)
    # the review's 60-70 min against a 45 min header: the myths are marked optional, with their time
    assert "· parts marked optional: about 25 min more, after the lesson*" in head
    assert "## Myth vs reality (optional, after the lesson)" in markdown()
    text = markdown()
    for cited in ("open-mmlab/mmdetection#2153", "open-mmlab/mmdetection#4742, 2021-03-10",
                  "pytorch/pytorch#36613 (2020-04-14)", "modelscope/DiffSynth-Studio#1001, 2025-10-17",
                  "Lightning-AI/pytorch-lightning#6013, 2021-02-16", "pytorch/examples#760, 2020-04-25"):
        assert cited in text, cited


def test_a_new_world_size_figure_is_built_while_the_ranks_run(explorer):
    """The explorer builds the figure of a world size it has not shown while the new
    ranks start and run (Explorer.preparation), not after them."""
    conftest.assert_new_world_size_is_built_on_the_preparer(explorer, explorer.figure)


def frozen_aux_with_defaults(steps=2):
    """Runs on a rank: step 3's model with aux frozen before DDP(...), DDP's defaults,
    aux never used: returns the steps completed."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    module = NB.Net()
    module.aux.requires_grad_(False)
    model = DDP(module)
    x, y = NB.local_batch(dist.get_rank())
    done = 0
    for _ in range(steps):
        F.mse_loss(model(x, use_aux=False), y).backward()
        done += 1
    return done


def test_a_frozen_branch_needs_no_flag(group):
    """Step 4's cheapest fix (an expert review): DDP registers only the parameters that
    require a gradient (_build_params_for_reducer), so a frozen, never-used aux trains with
    DDP's defaults, where the same branch unfrozen raised (question 3's run)."""
    out = group.run(frozen_aux_with_defaults)
    assert out == [2] * 4
    assert "`model.aux.requires_grad_(False)`" in source_with("A branch that no step uses can simply be frozen",
                                                        kind="markdown")


def frozen_aux_after_wrapping(steps=2):
    """Runs on a rank: step 3's model wrapped first, then aux frozen, DDP's defaults, aux never
    used: the first element of the body's weight gradient after each step completed, and
    torch's error text (None if none)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(NB.Net())
    model.module.aux.requires_grad_(False)                 # too late: DDP built its reducer already
    x, y = NB.local_batch(dist.get_rank())
    grads = []
    for _ in range(steps):
        try:
            F.mse_loss(model(x, use_aux=False), y).backward()
        except RuntimeError as err:
            return grads, str(err)
        grads.append(model.module.body.weight.grad.flatten()[0].item())
        model.zero_grad()
    return grads, None


def test_freezing_after_wrapping_is_too_late_as_the_text_says():
    """A fourth review (13-1): the text said "frozen before wrapping" and never warned about
    the usual fine-tuning slip, requires_grad_(False) after DDP(model). On 2 ranks the first
    step completes with each rank's own gradient (not averaged: the ranks differ) and the
    second raises torch's "Expected to have finished reduction" error, as the sentence says."""
    with LocalGroup(world_size=2, timeout=60) as g:
        out = g.run(frozen_aux_after_wrapping)
    (grads0, error0), (grads1, error1) = out
    assert len(grads0) == len(grads1) == 1 and grads0[0] != grads1[0]       # step 1: no error, not averaged
    quote = "Expected to have finished reduction in the prior iteration before starting a new one"
    assert error0.startswith(quote) and error1.startswith(quote)
    text = " ".join(source_with("## Freezing a branch after wrapping (optional, after the lesson)", kind="markdown").split())
    assert ("Freezing **after** `DDP(model)`, a common fine-tuning slip, is too late: on 2 ranks the first step is "
            f"silently not averaged and the second raises \"{quote}\"") in text
    # review 5 (13-4): the claim is run in the notebook too, and its stored output says the same
    stored = stored_text(cell_with("def frozen_after_wrapping("))
    assert "step 1 completed on both ranks: True; the same gradient on both: False" in stored
    assert stored.count(f"step 2, rank 0: {quote}") == 1 and stored.count(f"step 2, rank 1: {quote}") == 1
    assert "after wrapping it is too late (optional part at the end)" in source_with(
        "A branch that no step uses can simply be frozen", kind="markdown")


def test_reentrant_checkpointing_clashes_with_find_unused_parameters_as_stored(group):
    """The myth cell's four runs, again: a layer run twice under reentrant checkpointing
    trains with DDP's defaults, raises torch's 'marked ready twice' error with
    find_unused_parameters=True, and trains with static_graph=True or with the flag and
    use_reentrant=False; the stored output says the same."""
    cases = [(True, {}), (True, {"find_unused_parameters": True}),
             (True, {"static_graph": True}), (False, {"find_unused_parameters": True})]
    results = [group.run(NB.stderr_during, NB.two_steps, reentrant, **options)[0][0]
               for reentrant, options in cases]
    assert results[0] == results[2] == results[3] == "trained"
    assert results[1].startswith("Expected to mark a variable ready only once.")
    assert "Reused parameters in multiple reentrant backward passes" in results[1]
    stored = stored_text(cell_with("class LayerTwice"))
    for (reentrant, options), result in zip(cases, results):
        line = f"use_reentrant={reentrant}, DDP(model, **{options}): {result.splitlines()[0]}"
        assert line in stored, line
    assert "This is the message's reason 2)" in markdown()


# --- a third review's findings (13-1 to 13-4) ----------------------------------------------------
def _second_no_grad_forward_broadcasts():
    """On 2 ranks: one training step through the wrapper, then two eval forwards under
    torch.no_grad(), rank 1's buffer changed before each: whether each forward brought rank
    0's buffer back."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(1, 1), nn.BatchNorm1d(1)))
    model(torch.randn(4, 1) + dist.get_rank()).sum().backward()
    model.eval()
    brought_back = []
    for _ in range(2):
        if dist.get_rank() == 1:
            model.module[1].running_mean.fill_(7.0)
        with torch.no_grad():
            model(torch.zeros(2, 1))
        brought_back.append(model.module[1].running_mean.item() != 7.0)
    return brought_back


def test_the_wrappers_broadcast_needs_a_forward_with_gradients_before_it(group):
    """A third review (13-3): the pass note said the wrapper broadcasts rank 0's buffers
    whenever it is called in forward; it does so only after a forward with gradients enabled
    (require_forward_param_sync), so a second no_grad call broadcasts nothing. Run here."""
    with LocalGroup(world_size=2, timeout=30) as two:
        assert two.run(_second_no_grad_forward_broadcasts)[1] == [True, False]
    verdict = check_evaluate_together(group, through_the_wrapper)
    assert verdict and "when the wrapper's previous forward ran with gradients enabled" in verdict.message
    assert "a second call through the wrapper, for a second validation batch, broadcasts nothing" in verdict.message


def test_the_pre_forward_excerpts_are_the_installed_source_unabridged():
    """A third review (13-2): the excerpt of _pre_forward was a filter of scattered lines
    (comment lines without their code); now two contiguous slices, as the stored outputs
    show: the buffer sync above question 4, the bucket rebuild after its reveal."""
    import inspect
    from torch.nn.parallel import DistributedDataParallel as DDP
    source = inspect.getsource(DDP._pre_forward)
    out = stored_text(cell_with('if "# sync params according to location" in line'))
    sync = out.split(inspect.getsource(DDP.will_sync_module_buffers), 1)[1].strip("\n")
    assert sync in source and sync.lstrip().startswith("# sync params according to location")
    assert sync.rstrip().endswith("self._sync_buffers()") and sync.count("\n") == 3
    rebuild = stored_text(cell_with("# the bucket rebuild, earlier in _pre_forward")).strip("\n")
    assert rebuild in source and rebuild.count("\n") >= 7
    assert rebuild.lstrip().startswith("# Calling _rebuild_buckets before forward computation,")
    assert rebuild.rstrip().endswith("self._has_rebuilt_buckets = True")
    assert "unabridged" in source_with("DDP's `forward` starts with `_pre_forward`", "markdown")


def _broadcasts_per_call():
    """On 2 ranks: the gloo collectives of one training forward, its backward, then a forward
    under torch.no_grad() and a forward with gradients, each profiled alone."""
    import os
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.environ["KINETO_LOG_LEVEL"] = "99"

    def calls(fn):
        with torch.profiler.profile() as prof:
            fn()
        return sorted(e.name for e in prof.events() if e.name.startswith("gloo:"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    x = torch.ones(4, 2) * (dist.get_rank() + 1)
    out = {}
    out["forward 1"] = calls(lambda: setattr(model, "_y", model(x)))
    out["backward 1"] = calls(lambda: model._y.sum().backward())

    def no_grad_forward():
        with torch.no_grad():
            model(x)
    out["no_grad forward"] = calls(no_grad_forward)
    out["forward with gradients"] = calls(lambda: model(x))
    return out


def test_the_rebuild_rule_is_in_step_3_far_above_question_4():
    """A fifth review (13-1) had the rule that decides question 4 (the bucket rebuild runs in
    the forward, and only with gradients enabled) stated above the question; a sixth
    (13-1) found that sentence, right above it, answers it; a seventh (13-1) found question
    4 a guess without it. The rule is stated in step 3, where the buckets are introduced,
    two steps above question 4: the learner must see that rank 0's evaluation is that first
    forward. The reveal (WHY["13"][4]) says it. The run here holds it: the rebuild's two
    broadcasts come in the first forward with gradients after the first backward, not in
    the backward, and a torch.no_grad() forward puts them off."""
    import inspect
    from torch.nn.parallel import DistributedDataParallel as DDP
    with LocalGroup(world_size=2, timeout=30) as two:
        out = two.run(_broadcasts_per_call)[0]
    assert out == {"forward 1": [], "backward 1": ["gloo:all_reduce"], "no_grad forward": [],
                   "forward with gradients": ["gloo:broadcast", "gloo:broadcast"]}
    assert "if torch.is_grad_enabled() and self.reducer._rebuild_buckets():" in inspect.getsource(DDP._pre_forward)
    q4 = next(i for i, c in enumerate(CELLS) if "**Question 4.**" in "".join(c["source"]))
    for c in CELLS[:q4 + 1]:
        text = "".join(c["source"]) + (stored_text(c) if c["cell_type"] == "code" else "")
        assert "rebuilds its buckets" not in text and "leaves the rebuild" not in text
        assert "It hangs, buffers or not" not in text and "a collective only rank 0 runs" not in text
    assert "with gradients enabled it rebuilds the gradient buckets" in WHY["13"][4]
    assert "Under torch.no_grad() that forward rebuilds nothing" in WHY["13"][4]
    step_3 = next(i for i, c in enumerate(CELLS) if "".join(c["source"]).startswith("## Step 3:"))
    step_5 = next(i for i, c in enumerate(CELLS) if "".join(c["source"]).startswith("## Step 5:"))
    assert step_3 < step_5 < q4
    assert ("DDP builds its buckets when you wrap the model; with its defaults, the first forward "
            "with gradients enabled after the first `backward()` rebuilds them in the order the "
            "gradients arrived, and broadcasts rank 0's order to every rank.") in "".join(CELLS[step_3]["source"])


def test_step_4_s_wording_and_the_hang_s_line():
    """A sixth review (13-5): "First, the three cases" promised a second part that moved to
    an optional part; the text now says an optional part measures the cost. "train line 16"
    is a line of the cell that defines train, which starts at def local_batch."""
    text = "\n".join("".join(c["source"]) for c in CELLS if c["cell_type"] == "markdown")
    assert "First, the three cases" not in text
    assert ('The three cases of step 3 with each option, three steps each (what each option costs: an '
            'optional part):') in text
    assert "## What the two options cost: collectives and CPU time (optional, after the lesson)" in text
    assert ('"train line 16" is line 16 of the cell that defines `train`, which starts at '
            '`def local_batch`: `loss.backward()`.') in text
    cell = source_with("def train(")
    assert cell.startswith("def local_batch") and "loss.backward()" in cell.splitlines()[15]


def test_question_4_is_not_answered_above_it():
    """An own finding of the third round: question 4 (no buffers, through the wrapper) was
    asked under torch.no_grad() right below an excerpt that showed the rebuild runs only
    with gradients enabled and the sync only with buffers: the answer could be read off.
    Now it is asked with gradients enabled, and the rebuild's code is shown after the reveal;
    step 4 states the rule in words (the test above), so question 4 is a deduction, not a
    guess, and no cell above it names the code."""
    cells = CELLS
    q4 = next(i for i, c in enumerate(cells) if "**Question 4.**" in "".join(c["source"]))
    above = [c for c in cells[:q4 + 1]]
    for c in above:
        text = "".join(c["source"]) + (stored_text(c) if c["cell_type"] == "code" else "")
        assert not re.search(r"\b_rebuild_buckets", text) and "is_grad_enabled" not in text
    assert "forgets `torch.no_grad()`: gradients stay enabled" in "".join(cells[q4]["source"])
    assert WHY["13"][4].startswith("This is the first forward after the first backward")   # review 6: the reason first


def _sampler_batches(n, world_size, batch_size):
    from torch.utils.data import DataLoader, DistributedSampler
    return [[len(b) for b in DataLoader(range(n), batch_size=batch_size,
                                        sampler=DistributedSampler(range(n), world_size, rank))]
            for rank in range(world_size)]


def test_distributed_sampler_gives_every_rank_the_same_batch_sizes_as_the_text_says():
    """A third review (13-1) asked for the fairness caveat of averaging the ranks' statistics.
    With DistributedSampler the ranks' shares, and so their last batches, are the same size
    (it pads, or trims with drop_last=True); only the last batch is smaller than the rest."""
    assert _sampler_batches(10, 4, 2) == [[2, 1]] * 4                # 10 -> 12: 3 each, last batch 1
    from torch.utils.data import DistributedSampler
    assert [len(DistributedSampler(range(10), 4, r, drop_last=True)) for r in range(4)] == [2] * 4
    text = " ".join(markdown().split())
    assert ("so every rank gets `num_samples` samples (`DistributedSampler.__init__` and `__iter__` in "
            "`torch/utils/data/distributed.py`), and the ranks' last batches match in size") in text


def test_moe_experts_without_tokens_are_unused_only_when_skipped():
    """A third review (13-4): an expert run on zero tokens still gets a gradient (zeros); one
    the layer skips gets none, the unused parameter of step 3."""
    import torch.nn as nn
    expert = nn.Linear(4, 2)
    expert(torch.empty(0, 4)).sum().backward()
    assert expert.weight.grad is not None and not expert.weight.grad.any()
    text = " ".join(markdown().split())
    assert ("A mixture-of-experts layer that skips an expert no token was routed to leaves it unused on that "
            "rank only (run on zero tokens, it would get a gradient of zeros).") in text


# --- review 5: the core is one study unit, the late parts optional ------------------------------------




def test_rule_3_allows_the_copy_of_rank_0_s_buffers_that_rule_1_asks_for():
    """Review 6 (13-4): rule 3 said "no running statistic updated", yet the solution
    broadcasts rank 0's BatchNorm statistics to every rank, as rule 1 asks (rank 0's model,
    its buffers too). Rule 3 now forbids what the validation data would do to them, and the
    check accepts a rank's own buffers or rank 0's (its buffers_ok)."""
    task = source_with("## Exercise: evaluate on every rank", "markdown")
    assert "its parameters and its buffers" in task
    assert "3. it trains nothing: dropout off, no running statistic updated from the validation data," in task
    solution = (ROOT / "notebooks" / "solutions" / "13_evaluate_together.py").read_text()
    assert "dist.broadcast(buffer, src=0)" in solution
    import inspect
    from reducelab.checks import ddp_model
    assert "the buffers after fn are this rank's own or rank 0's" in inspect.getsource(ddp_model)


def _collectives_of_one_backward(aux_used):
    """The gloo collectives of the first backward() of step 3's Net under DDP, and whether it
    returned, on each rank."""
    import os
    os.environ["KINETO_LOG_LEVEL"] = "99"
    torch.manual_seed(0)
    model = NB.DDP(NB.Net())
    x, y = NB.local_batch(NB.dist.get_rank())
    loss = NB.F.mse_loss(model(x, use_aux=aux_used), y)
    with torch.profiler.profile() as prof:
        loss.backward()
    return sorted(e.name for e in prof.events() if e.name.startswith("gloo:"))


def test_a_bucket_never_ready_launches_nothing_and_backward_does_not_wait(group):
    """Review 8 (13-a): with aux unused, the one bucket is never launched and backward()
    returns at once with no collective; with aux used, its backward all-reduces the bucket
    (and waits for it). The timeout of the default group would end a wait that never ends."""
    group.resize(2)
    assert group.run(_collectives_of_one_backward, False) == [[], []]
    assert group.run(_collectives_of_one_backward, True) == [["gloo:all_reduce"]] * 2
