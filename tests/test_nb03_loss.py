"""Tests of notebook 03 (loss aggregation): the explorer, the exercise check, and the facts
the notebook teaches, each measured on real gloo ranks against a single-process reference."""
from __future__ import annotations

import json
import pathlib
import re
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import conftest
from reducelab import LocalGroup
from reducelab.checks.loss import (UNEVEN_BATCHES, _per_rank, _run_learner, check_backward_and_log,
                                   exercise_batch, exercise_model, reference)
from reducelab.plots import message_png
from reducelab.plots.loss import LossAggregationPlot, gradient_variants, parameter_drift
from reducelab.widgets.loss import LossExplorer, parse_batch_sizes



def load_solution():
    return conftest.load_solution("03_backward_and_log")


# --- the notebook's rank functions, and the same data rebuilt in one process ---------------
def losses_of(rank, local_batch_sizes):
    """Per-sample losses of ``rank`` (what notebook 03's ``rank_losses`` returns there)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    torch.manual_seed(rank)
    n = local_batch_sizes[rank]
    x = torch.randn(n, 4)
    y = torch.randn(n, 1) + rank
    return F.mse_loss(model(x), y, reduction="none").flatten().detach()


def rank_losses(local_batch_sizes):
    return losses_of(dist.get_rank(), local_batch_sizes)


def mean_of_means(local_batch_sizes):
    loss = rank_losses(local_batch_sizes).mean()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def weighted_mean(local_batch_sizes):
    losses = rank_losses(local_batch_sizes)
    total, count = losses.sum(), torch.tensor(float(losses.numel()))
    dist.all_reduce(total)
    dist.all_reduce(count)
    return total / count


def reference_mean(local_batch_sizes):
    return torch.cat([losses_of(r, local_batch_sizes) for r in range(len(local_batch_sizes))]).mean().item()




pytestmark = pytest.mark.usefixtures("keep_four_ranks")


# --- step 1: mean of means against the weighted mean --------------------------------------
def test_mean_of_means_is_not_the_global_mean_with_uneven_batches(group):
    sizes = [3, 5, 8, 2]
    ref = reference_mean(sizes)
    naive = group.run(mean_of_means, sizes)
    weighted = group.run(weighted_mean, sizes)
    local_means = [losses_of(r, sizes).mean().item() for r in range(4)]
    assert all(v.item() == pytest.approx(ref, rel=1e-5) for v in weighted)
    assert all(v.item() == pytest.approx(np.mean(local_means), rel=1e-5) for v in naive)
    assert abs(naive[0].item() - ref) > 0.5


def test_mean_of_means_equals_the_global_mean_with_equal_batches(group):
    sizes = [4, 4, 4, 4]
    ref = reference_mean(sizes)
    assert group.run(mean_of_means, sizes)[0].item() == pytest.approx(ref, rel=1e-5)
    assert group.run(weighted_mean, sizes)[0].item() == pytest.approx(ref, rel=1e-5)


def test_question_1_one_sample_against_three():
    """Review 5 (03-1): question 1 was arithmetic on the code above it. It asks how many times
    as much as one of rank 1's three samples rank 0's one sample counts in mean_of_means; the
    run measures each weight (raise one sample's loss by 1, read how far the result moves):
    1/2 against 1/6, so 3, where the global mean counts every sample the same."""
    def q1(raise_rank, by):
        rank = dist.get_rank()
        losses = torch.tensor([2.0]) if rank == 0 else torch.zeros(3)
        if rank == raise_rank:
            losses[0] += by
        loss = losses.mean()
        dist.all_reduce(loss)
        return (loss / dist.get_world_size()).item()
    with LocalGroup(world_size=2, timeout=60) as g:
        as_given = g.run(q1, 0, 0.0)
        assert as_given == [1.0, 1.0]
        weight = [g.run(q1, r, 1.0)[0] - as_given[0] for r in (0, 1)]
    assert weight[0] == pytest.approx(0.5) and weight[1] == pytest.approx(1 / 6, rel=1e-5)
    assert round(weight[0] / weight[1], 4) == 3.0
    cells = notebook_cells()
    q = next(i for i, (s, _) in enumerate(cells) if s.startswith("answer_1 = None"))
    assert "round(weight[0] / weight[1], 4)" in cells[q + 1][0]
    shown = conftest.stored_text(cells[q + 1][1])
    assert "The real run gives 3.0." in shown
    assert "moves it by 0.5000 on rank 0, 0.1667 on rank 1" in shown
    asked = cells[q - 1][0]
    assert "how many times as much as one of rank 1's samples" in asked
    for spoiler in ("1/2", "1/6", "three times", "3 times", "weighs more"):
        assert spoiler not in "\n".join(s for s, _ in cells[:q + 2]), spoiler


def test_the_three_questions_have_three_different_answers():
    """Review 5 (03-2): questions 2 and 3 both answered 0.25 (and 04's question 2, 1/8).
    Question 3 runs on two ranks now: 3, 0.25 and 0.5, each read from its stored reveal."""
    gives = []
    for s, c in notebook_cells():
        if "reveal(answer_" in s:
            gives.append(re.search(r"The real run gives ([^ <]+?)\.(?:\s|<)", conftest.stored_text(c)).group(1))
    assert gives == ["3.0", "0.25", "0.5"], gives


# --- the explorer ---------------------------------------------------------------------------
def test_explorer_matches_a_single_process_reference(group):
    ex = LossExplorer(group, rank_losses, mean_of_means, weighted_mean, local_batch_sizes="3,5,8,2")
    r = ex.result
    assert r.local_batch_sizes == [3, 5, 8, 2] and r.agree
    assert r.reference == pytest.approx(reference_mean([3, 5, 8, 2]), rel=1e-6)
    assert r.weighted == pytest.approx(r.reference, rel=1e-5)
    assert r.mean_of_means == pytest.approx(
        np.mean([losses_of(k, [3, 5, 8, 2]).mean().item() for k in range(4)]), rel=1e-5)
    assert [len(l) for l in r.losses] == [3, 5, 8, 2]
    assert ex.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(matches)" in ex.message.value and "off by +" in ex.message.value
    assert ex.text().startswith("LossExplorer(local_batch_sizes=3,5,8,2)\n")
    m = re.search(r"reference ([\d.]+),.* mean of means ([\d.]+) \(off by \+([\d.]+)\)", ex.text())
    assert m and f"{float(m[2]) - float(m[1]):.4f}" == m[3]     # the gap of the numbers printed


def test_explorer_resizes_the_group_and_redraws(group):
    ex = LossExplorer(group, rank_losses, mean_of_means, weighted_mean, local_batch_sizes="3,5,8,2")
    first = ex.image.value
    ex.controls["local_batch_sizes"].value = "1, 3"
    assert group.world_size == 2
    assert ex.result.local_batch_sizes == [1, 3]
    assert ex.result.reference == pytest.approx(reference_mean([1, 3]), rel=1e-6)
    assert ex.result.weighted == pytest.approx(ex.result.reference, rel=1e-5)
    assert ex.image.value != first
    ex.controls["local_batch_sizes"].value = "5,5"
    assert ex.result.mean_of_means == pytest.approx(ex.result.reference, rel=1e-5)
    assert "(equal)" in ex.text()


def test_a_new_world_size_s_figure_is_built_while_the_ranks_run(group):
    """Local batch sizes of a new length (a new world size) build that world size's
    figure once, on the preparation thread, while the ranks start and run
    (Explorer.preparation); back at a length shown before, nothing is built."""
    import threading
    ex = LossExplorer(group, rank_losses, mean_of_means, weighted_mean, local_batch_sizes="3,5,8,2")
    builds, original = [], ex.plot._build
    ex.plot._build = lambda *a: (builds.append(threading.current_thread().name), original(*a))
    try:
        ex.controls["local_batch_sizes"].value = "2,6,4"
        assert ex.result.local_batch_sizes == [2, 6, 4] and ex.error is None
        assert len(builds) == 1 and builds[0].startswith("reducelab-prepare"), builds
        ex.controls["local_batch_sizes"].value = "1,1,1,1"
        assert ex.result.local_batch_sizes == [1, 1, 1, 1] and len(builds) == 1
    finally:
        ex.plot._build = original
        group.resize(4)


def test_going_back_to_a_world_size_reuses_its_figure_and_draws_the_same():
    """Each world size keeps its figure (plots.BuiltFigures): back at one shown before,
    the figure is the one built for it, and its PNG is what a new plot draws."""
    def state(sizes):
        losses = [losses_of(r, sizes).numpy() for r in range(len(sizes))]
        means = [float(np.mean(a)) for a in losses]
        return losses, float(np.mean(means)), reference_mean(sizes), reference_mean(sizes)

    plot = LossAggregationPlot()
    plot.draw(*state([3, 5, 8, 2]))
    first = plot.fig
    plot.draw(*state([2, 6, 4]))
    assert plot.fig is not first
    again = plot.draw(*state([1, 1, 1, 30]))
    assert plot.fig is first
    assert again == LossAggregationPlot().draw(*state([1, 1, 1, 30]))


NOTE_PNG = message_png("No figure for these settings: see the message below.")
"""What an explorer shows in place of its figure after a refusal."""


@pytest.mark.parametrize("text, says", [
    ("0,2", "from 1 to 64"), ("2,x", "whole numbers"), ("", "1 to 8"),
    ("1,1,1,1,1,1,1,1,1", "got 9"), ("2,65", "got 65"), ("2,-1", "whole numbers"),
    ("3;5", "separated by commas"),
])
def test_explorer_refuses_bad_batch_sizes_with_one_sentence_and_no_old_figure(group, text, says):
    ex = LossExplorer(group, rank_losses, mean_of_means, weighted_mean)
    figure = ex.image.value
    ex.controls["local_batch_sizes"].value = text
    assert ex.result is None
    assert says in ex.message.value and says in ex.text()
    assert "such as 3,5,8,2" in ex.message.value  # names what is valid
    assert "Traceback" not in ex.message.value
    assert ex.image.value == NOTE_PNG != figure  # the old figure is gone
    assert group.world_size == 4  # nothing was started for bad input
    ex.controls["local_batch_sizes"].value = "2,2,2,2"
    assert ex.result is not None and ex.input_error is None
    assert ex.image.value not in (NOTE_PNG, figure)


@pytest.mark.parametrize("text", ["5", "64,64,64,64,64,64,64,64", "1,1,1,30"])
def test_explorer_draws_the_extremes(group, text, tmp_path):
    ex = LossExplorer(group, rank_losses, mean_of_means, weighted_mean, local_batch_sizes=text)
    sizes = parse_batch_sizes(text)
    assert ex.result.local_batch_sizes == sizes and group.world_size == len(sizes)
    assert ex.result.weighted == pytest.approx(reference_mean(sizes), rel=1e-5)
    assert ex.image.value[:4] == b"\x89PNG"


def test_parse_batch_sizes():
    assert parse_batch_sizes(" 3, 5,8 ,2") == [3, 5, 8, 2]
    with pytest.raises(TypeError, match="str"):
        parse_batch_sizes([3, 5])
    with pytest.raises(ValueError, match="1 to 8"):
        parse_batch_sizes(",,")


def test_explorer_rejects_bad_arguments(group):
    with pytest.raises(TypeError, match="mean_of_means"):
        LossExplorer(group, rank_losses, 3, weighted_mean)
    with pytest.raises(ValueError, match="whole numbers"):
        LossExplorer(group, rank_losses, mean_of_means, weighted_mean, local_batch_sizes="a")


# --- the exercise check ---------------------------------------------------------------------
def stub_from_the_notebook():
    """The def cell as the notebook ships it (its TODO stub), defined from the cell's text."""
    src = next(s for s, _ in notebook_cells() if s.startswith("# %load solutions/03_"))
    namespace = {"F": F, "dist": dist, "torch": torch, "__name__": "notebook_03_def_cell"}
    exec(src, namespace)
    return namespace["backward_and_log"]


def test_solution_passes(group):
    verdict = check_backward_and_log(group, load_solution().backward_and_log)
    assert verdict, verdict.message
    assert "the rank without samples still joins DDP's all_reduce" in verdict.message
    assert group.world_size == 4  # restored


def test_the_notebook_s_stub_fails_and_names_the_local_mean_gradient(group):
    verdict = check_backward_and_log(group, stub_from_the_notebook())
    sizes = UNEVEN_BATCHES[0]
    want, _ = reference(sizes)
    assert not verdict and verdict.mistake == "wrong gradient"
    assert f"local batch sizes {list(sizes)}" in verdict.message
    assert "[" + ", ".join(f"{v:.3f}" for v in want.tolist()) + "]" in verdict.message
    assert "each rank's own local mean loss" in verdict.message
    assert group.world_size == 4


def test_reference_is_one_process_over_the_global_batch():
    """The check's reference, rebuilt here in float64 from the same seeds: the model is
    nn.Linear(3, 1) as torch.manual_seed(0) makes it, and rank r's targets sit r higher."""
    sizes = (4, 0, 3)
    grad, loss = reference(sizes)
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    xs, ys = [], []
    for r, n in enumerate(sizes):
        g = torch.Generator().manual_seed(r)
        xs.append(torch.randn(n, 3, generator=g))
        ys.append(torch.randn(n, 1, generator=g) + r)
    full = F.mse_loss(model(torch.cat(xs).double()), torch.cat(ys).double())
    full.backward()
    assert torch.allclose(grad.double(), torch.cat([model.weight.grad.flatten(), model.bias.grad]),
                          atol=1e-6)
    assert loss == pytest.approx(full.item(), rel=1e-6)
    x, y = exercise_batch(1, 0)
    assert x.shape == (0, 3) and y.shape == (0, 1)


def test_the_stub_s_numbers_sit_far_from_a_rounding_boundary():
    """The stored verdict prints gradients to 3 decimals; float32 sums differ by about 1e-7
    from one CPU to another, so each printed number must sit well away from the point where
    its third decimal would flip."""
    sizes = UNEVEN_BATCHES[0]
    want, _ = reference(sizes)
    stub_grad = sum(g / n for g, n in zip(_per_rank(sizes)[1], sizes)) / len(sizes)
    for v in torch.cat([want.double(), stub_grad]).tolist():
        assert abs(abs(v) * 1000 % 1 - 0.5) > 0.01, v   # at least 1e-5 from x.xxx5


def test_a_rank_that_skips_backward_is_named_and_the_others_are_stopped_at_once(group):
    """Rank 1 holds no sample and returns before backward(): ranks 0 and 2 wait in DDP's
    all_reduce of the gradients. The check names rank 1 well before the group's timeout
    (60 s here), and the group runs again afterwards."""
    def returns_early_when_empty(model, x, y):
        local_sum = F.mse_loss(model(x), y, reduction="sum")
        stats = torch.stack([local_sum.detach(), torch.tensor(float(len(x)))])
        dist.all_reduce(stats)
        if len(x) == 0:
            return stats[0] / stats[1]
        (local_sum * dist.get_world_size() / stats[1]).backward()
        return stats[0] / stats[1]

    start = time.monotonic()
    verdict = check_backward_and_log(group, returns_early_when_empty)
    assert time.monotonic() - start < 15 < group.timeout
    assert not verdict and verdict.mistake == "rank skipped backward()"
    assert "rank 1 (local batch of 0 samples) returned without calling backward()" in verdict.message
    assert "ranks 0 and 2 were left waiting for it" in verdict.message
    assert group.world_size == 4
    assert group.run(dist.get_world_size) == [4, 4, 4, 4]


def test_ddp_s_all_reduce_is_counted_by_a_dispatch_mode_and_left_out_by_the_check(group):
    """The fact the check's counting rests on: DDP's C++ reducer's all_reduce of the
    gradients reaches a TorchDispatchMode (CommDebugMode counts 2 all_reduces for the
    solution: its own and DDP's). The check leaves DDP's out: the solution makes one."""
    solution = load_solution().backward_and_log

    def counted_by_comm_debug_mode(fn):
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.nn.parallel import DistributedDataParallel as DDP

        from reducelab.checks.loss import exercise_batch, exercise_model
        model = DDP(exercise_model())
        x, y = exercise_batch(dist.get_rank(), 3)
        with CommDebugMode() as comm:
            fn(model, x, y)
        return {str(op): n for op, n in comm.get_comm_counts().items()}

    assert group.run(counted_by_comm_debug_mode, solution) == [{"c10d.allreduce_": 2}] * 4
    out = group.run(_run_learner, solution, (3, 5, 8, 2))
    assert [r["collectives"] for r in out] == [{"all_reduce": 1}] * 4

    def with_a_barrier(model, x, y):
        dist.barrier()
        return solution(model, x, y)
    verdict = check_backward_and_log(group, with_a_barrier)
    assert not verdict and "called barrier once and all_reduce once" in verdict.message


def right_with_functional_all_reduce(model, x, y):
    """Right: the one all_reduce is torch's functional one, which the notebook's torch
    warning recommends (_functional_collectives.all_reduce, a _c10d_functional op)."""
    import torch.distributed._functional_collectives as funcol
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    stats = funcol.all_reduce(torch.stack([local_sum.detach(), torch.tensor(float(len(x)))]),
                              "sum", dist.group.WORLD)
    (local_sum * dist.get_world_size() / stats[1]).backward()
    return stats[0] / stats[1]


def right_with_a_second_forward(model, x, y):
    """Right: after backward() the loss is computed again, with grad enabled, to log it.
    That second forward makes DDP rebuild its buckets, which broadcasts: DDP's, not the
    learner's."""
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    stats = torch.stack([local_sum.detach(), torch.tensor(float(len(x)))])
    dist.all_reduce(stats)
    (local_sum * dist.get_world_size() / stats[1]).backward()
    again = F.mse_loss(model(x), y, reduction="sum")
    return stats[0] / stats[1] + 0 * again.detach()


@pytest.mark.parametrize("fn", [right_with_functional_all_reduce, right_with_a_second_forward],
                         ids=lambda f: f.__name__)
def test_right_answers_other_than_the_solution_pass(group, fn):
    verdict = check_backward_and_log(group, fn)
    assert verdict, verdict.message


def test_the_count_goes_on_after_backward_and_after_ddp_s_forward(group):
    """The count is paused only inside DDP: in its forward (a second forward after
    backward() broadcasts, as the raw count shows) and in its all_reduce of the gradients.
    An all_reduce of the learner's after backward(), and one after a second forward, are
    counted."""
    def two_forwards_and_three_all_reduces(model, x, y):
        local_sum = F.mse_loss(model(x), y, reduction="sum")
        count = torch.tensor(float(len(x)))
        dist.all_reduce(count)
        (local_sum * dist.get_world_size() / count).backward()
        total = local_sum.detach().clone()
        dist.all_reduce(total)                    # after backward()
        again = F.mse_loss(model(x), y, reduction="sum").detach()
        dist.all_reduce(again)                    # after DDP's second forward
        return total / count

    out = group.run(_run_learner, two_forwards_and_three_all_reduces, (3, 5, 8, 2))
    assert [r["collectives"] for r in out] == [{"all_reduce": 3}] * 4
    assert [r["in_backward"] for r in out] == [{}] * 4

    def raw_count_of_a_second_forward():
        from torch.nn.parallel import DistributedDataParallel as DDP

        from reducelab.checks.loss import _Collectives
        model = DDP(exercise_model())
        x, y = exercise_batch(dist.get_rank(), 3)
        F.mse_loss(model(x), y).backward()
        with _Collectives() as counter:
            model(x)
        return counter.counts
    assert all(c.get("broadcast", 0) > 0 for c in group.run(raw_count_of_a_second_forward))


def test_a_forward_in_no_sync_is_told_apart_from_a_skipped_backward(group):
    """Rank 1 (no sample) runs its forward and backward() inside model.no_sync(): it gets
    gradients, but DDP starts no all_reduce of them there. The check says so, not that it
    skipped backward(), and stops ranks 0 and 2 at once."""
    def no_sync_when_empty(model, x, y):
        import contextlib
        with model.no_sync() if len(x) == 0 else contextlib.nullcontext():
            local_sum = F.mse_loss(model(x), y, reduction="sum")
            stats = torch.stack([local_sum.detach(), torch.tensor(float(len(x)))])
            dist.all_reduce(stats)
            (local_sum * dist.get_world_size() / stats[1]).backward()
        return stats[0] / stats[1]

    start = time.monotonic()
    verdict = check_backward_and_log(group, no_sync_when_empty)
    assert time.monotonic() - start < 15 < group.timeout
    assert not verdict and verdict.mistake == "no all_reduce of the gradients"
    assert ("rank 1 (local batch of 0 samples) called backward(), but DDP started no "
            "all_reduce of the gradients there, while ranks 0 and 2 were left waiting for it"
            in verdict.message)
    assert "returned without calling backward()" not in verdict.message
    assert "after a forward inside no_sync()" in verdict.message
    assert group.world_size == 4


def test_a_function_right_only_for_the_first_setting_fails_on_the_second(group):
    def hard_coded(model, x, y):  # the global batch of the first setting, 18, written in
        local_sum = F.mse_loss(model(x), y, reduction="sum")
        total = local_sum.detach().clone()
        dist.all_reduce(total)
        (local_sum * dist.get_world_size() / 18).backward()
        return total / 18
    verdict = check_backward_and_log(group, hard_coded)
    assert not verdict and "[4, 0, 3]" in verdict.message


def test_no_check_message_gives_the_recipe(group):
    """What was wrong, never how to write it: none of the recipe's words in the messages
    of the usual mistakes (test_check_mistakes asserts no solution line is quoted)."""
    def no_world_size(model, x, y):
        local_sum = F.mse_loss(model(x), y, reduction="sum")
        stats = torch.stack([local_sum.detach(), torch.tensor(float(len(x)))])
        dist.all_reduce(stats)
        (local_sum / stats[1]).backward()
        return stats[0] / stats[1]

    recipe = re.compile(r"multipl|\* ?world_size|detach|stack|one tensor|two.element|"
                        r"reduction=\"sum\"|call backward\(\) on every|must call|should", re.I)
    for fn in (stub_from_the_notebook(), no_world_size):
        message = check_backward_and_log(group, fn).message
        assert not recipe.search(message), message


def test_the_check_includes_an_empty_local_batch():
    assert any(0 in sizes for sizes in UNEVEN_BATCHES)
    assert torch.isnan(F.mse_loss(torch.zeros(0, 1), torch.zeros(0, 1)))  # the nan message's fact


def test_check_rejects_a_non_function_and_batches_without_a_sample(group):
    with pytest.raises(TypeError, match="function"):
        check_backward_and_log(group, 3)
    with pytest.raises(ValueError, match="at least one above 0"):
        check_backward_and_log(group, load_solution().backward_and_log, [(0, 0)])
    with pytest.raises(ValueError, match="0 or more"):
        check_backward_and_log(group, load_solution().backward_and_log, [(2, -1)])
    assert group.world_size == 4


# --- step 3: the popular answer's loop, without and with DDP ---------------------------------
def example_1_loop(wrap_in_ddp, steps=10, lr=0.01):
    """As in notebook 03: the answer's example 1 on one rank (the same start everywhere)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(10, 2)
    if wrap_in_ddp:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    torch.manual_seed(rank)
    inputs, targets = torch.randn(32, 10), torch.randint(0, 2, (32,))

    def parameters():
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    history, logged = [parameters()], []
    for _ in range(steps):
        optimizer.zero_grad()
        local_loss = criterion(model(inputs), targets)
        local_loss.backward()
        optimizer.step()
        reduced_loss = local_loss.clone()
        dist.all_reduce(reduced_loss, op=dist.ReduceOp.SUM)
        logged.append((reduced_loss / world_size).item())
        history.append(parameters())
    return torch.stack(history), logged


def spread(out):
    """Per step: the largest (max - min over ranks) of any parameter element."""
    h = torch.stack([history for history, _ in out])
    return (h.max(0).values - h.min(0).values).max(1).values


def test_without_ddp_the_ranks_drift_apart_although_they_log_one_loss(group):
    out = group.run(example_1_loop, False)
    gaps = spread(out)
    assert gaps[0] == 0                          # the same start
    assert (gaps[1:] > 0).all() and (gaps.diff() > 0).all()  # apart, and further every step
    assert gaps[-1] > 5 * gaps[1]
    logged = [log for _, log in out]
    assert all(log == logged[0] for log in logged)  # every rank prints the same "Global Loss"


def test_with_ddp_the_ranks_stay_identical(group):
    out = group.run(example_1_loop, True)
    assert (spread(out) == 0).all()
    plain = group.run(example_1_loop, False)
    assert not torch.equal(out[0][0][-1], plain[0][0][-1])  # and DDP really trained


def test_parameter_drift_figure(group):
    runs = [torch.stack([h for h, _ in group.run(example_1_loop, ddp)]) for ddp in (False, True)]
    assert parameter_drift(*runs)[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="shape"):
        parameter_drift(runs[0], runs[1][:, :3])
    with pytest.raises(ValueError, match="shape"):
        parameter_drift(runs[0][0], runs[1][0])


# --- step 4: gradient accumulation ----------------------------------------------------------
def accumulated_grad(variant, micro_batches=4, micro_batch_size=2):
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 1))
    torch.manual_seed(rank)
    x = torch.randn(micro_batches * micro_batch_size, 3)
    y = torch.randn(micro_batches * micro_batch_size, 1)
    global_batch = world_size * micro_batches * micro_batch_size
    model.zero_grad()
    for xb, yb in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        if variant == "zero_grad inside":
            model.zero_grad()
        if variant.startswith("sum / global batch"):
            loss = F.mse_loss(model(xb), yb, reduction="sum") / global_batch
            if variant == "sum / global batch * world_size":
                loss = loss * world_size
        else:
            loss = F.mse_loss(model(xb), yb)
            if variant in ("/ micro_batches", "zero_grad inside"):
                loss = loss / micro_batches
        loss.backward()
    return torch.cat([model.module.weight.grad.flatten(), model.module.bias.grad])


def reference_grad(world_size, micro_batches=4, micro_batch_size=2, keep=None):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    xs, ys = [], []
    for rank in range(world_size):
        torch.manual_seed(rank)
        x = torch.randn(micro_batches * micro_batch_size, 3).chunk(micro_batches)
        y = torch.randn(micro_batches * micro_batch_size, 1).chunk(micro_batches)
        for i in (range(micro_batches) if keep is None else keep):
            xs.append(x[i])
            ys.append(y[i])
    F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    return torch.cat([model.weight.grad.flatten(), model.bias.grad])


def grads_of(group, variant):
    out = group.run(accumulated_grad, variant)
    assert all(torch.allclose(g, out[0]) for g in out)  # DDP leaves every rank the same gradient
    return out[0]


@pytest.mark.parametrize("variant", ["/ micro_batches", "sum / global batch * world_size"])
def test_normalised_accumulation_equals_the_full_batch_gradient(group, variant):
    assert torch.allclose(grads_of(group, variant), reference_grad(4), atol=1e-6)


def test_question_2_without_world_size_ddp_leaves_a_quarter(group):
    """Question 2: the summed loss over the global batch, without * world_size, under DDP
    (which divides by world_size = 4)."""
    ratio = grads_of(group, "sum / global batch") / reference_grad(4)
    assert torch.allclose(ratio, torch.full_like(ratio, 0.25), atol=1e-5)
    assert round(ratio[0].item(), 4) == 0.25


def test_unnormalised_accumulation_is_micro_batches_times_too_large(group):
    assert torch.allclose(grads_of(group, "not normalised"), 4 * reference_grad(4), atol=1e-5)


def test_zero_grad_inside_the_loop_keeps_only_the_last_micro_batch(group):
    g = grads_of(group, "zero_grad inside")
    assert torch.allclose(g, reference_grad(4, keep=[3]) / 4, atol=1e-6)
    assert not torch.allclose(g, reference_grad(4), atol=1e-3)


# --- step 5: backward through all_reduce, and DDP -------------------------------------------
def backward_through_all_reduce():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    torch.manual_seed(rank)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    reduced = F.mse_loss(model(x), y).clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_reduce(reduced)
        (reduced / world_size).backward()
    grad = model.weight.grad.clone()
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    return grad, model.weight.grad.clone(), [str(w.message) for w in caught]


def test_backward_through_all_reduce_stays_local_and_warns(group):
    out = group.run(backward_through_all_reduce)
    for grad, local, messages in out:
        assert torch.allclose(grad, local / 4, atol=1e-7)
        assert any("c10d::allreduce_" in m and "autograd kernel was not registered" in m
                   for m in messages)
    assert not torch.allclose(out[0][0], out[1][0])
    # question 3's evidence shows torch's warning up to its build path, so the words the
    # reveal leans on ("silently incorrect behavior") are there
    shown = out[0][2][0].split(" (Triggered internally")[0]
    assert "This may lead to silently incorrect behavior." in shown and "/pytorch/" not in shown
    cell = next(s for s, _ in notebook_cells() if "def backward_through_all_reduce" in s)
    assert ".split(' (Triggered internally')[0]" in cell and "[:150]" not in cell


def ddp_local_backward():
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 1))
    torch.manual_seed(rank)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), model.module.weight.grad


def test_ddp_syncs_gradients_of_the_local_loss_and_leaves_the_losses_local(group):
    out = group.run(ddp_local_backward)
    reference = reference_grad(4, micro_batches=1, micro_batch_size=8)[:3]
    for _, grad in out:
        assert torch.allclose(grad.flatten(), reference, atol=1e-6)
    assert len({round(loss, 6) for loss, _ in out}) == 4


def backward_through_differentiable_all_reduce():
    """The notebook's myth cell: backward through torch.distributed.nn.functional.all_reduce."""
    import warnings

    import torch.distributed.nn.functional as dist_fn
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    torch.manual_seed(rank)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = dist_fn.all_reduce(F.mse_loss(model(x), y))
    (total / world_size).backward()
    grad = model.weight.grad.clone()
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    return grad, model.weight.grad.clone(), [(w.category.__name__, str(w.message)) for w in caught]


def test_a_differentiable_all_reduce_of_the_loss_leaves_each_rank_its_local_gradient(group):
    """The myth "the aggregated loss is then used to backpropagate", with the all_reduce
    autograd can differentiate: each rank gets exactly its own local gradient (different on
    every rank), and torch 2.13 warns that the function is deprecated."""
    out = group.run(backward_through_differentiable_all_reduce)
    for grad, local, caught in out:
        assert torch.allclose(grad, local, atol=1e-6)
        assert ("FutureWarning", "torch.distributed.nn.functional.all_reduce is deprecated, use "
                "torch.distributed._functional_collectives.all_reduce instead.") in caught
    assert not all(torch.allclose(g, out[0][0]) for g, _, _ in out)
    (src, cell), = [(s, c) for s, c in notebook_cells()
                    if "dist_fn.all_reduce(F.mse_loss" in s and c["cell_type"] == "code"]
    shown = "".join("".join(o.get("text", "")) for o in cell["outputs"])
    assert "FutureWarning: torch.distributed.nn.functional.all_reduce is deprecated" in shown
    assert shown.count("= its local grad: True") == 4


# --- the popular answer's launch on a CPU machine -------------------------------------------
def _never_called(rank, marker):  # pragma: no cover - mp.spawn with nprocs=0 starts nothing
    pathlib.Path(marker).write_text("ran")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fact is about machines without GPUs")
def test_device_count_is_zero_and_spawn_then_starts_nothing(tmp_path):
    """What the notebook's cell runs: join=False returns the ProcessContext, which lists no
    process."""
    assert torch.cuda.device_count() == 0
    marker = tmp_path / "ran"
    ctx = mp.spawn(_never_called, args=(str(marker),), nprocs=torch.cuda.device_count(),
                   join=False)
    assert isinstance(ctx, mp.ProcessContext) and len(ctx.processes) == 0
    assert not marker.exists()


def _writes_a_marker(rank, marker):
    pathlib.Path(marker).write_text(f"rank {rank} ran")


def test_spawn_with_join_returns_none_whether_or_not_it_ran(tmp_path):
    """The notebook's text: mp.spawn(..., join=True) returns None either way, so its return
    value proves nothing (checked by the review with nprocs=1)."""
    marker = tmp_path / "ran"
    assert mp.spawn(_writes_a_marker, args=(str(marker),), nprocs=1, join=True) is None
    assert marker.read_text() == "rank 0 ran"
    assert mp.spawn(_writes_a_marker, args=(str(tmp_path / "never"),), nprocs=0,
                    join=True) is None
    assert not (tmp_path / "never").exists()


# --- plots ------------------------------------------------------------------------------------
def test_plots_refuse_bad_input():
    with pytest.raises(ValueError, match="one entry per rank"):
        LossAggregationPlot().draw([], 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="3 gradient elements"):
        gradient_variants([1.0, 2.0], {"x": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match="2 labels"):
        gradient_variants([1.0, 2.0], {}, names=["a"])
    assert gradient_variants([1.0, -1.0], {"x": [0.5, -0.5]})[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="at most 7"):
        gradient_variants([1.0], {str(k): [1.0] for k in range(8)})


def test_gradient_variants_tell_series_apart_without_colour(drawn):
    gradient_variants([1.0, -1.0], {"a": [1.0, -1.0], "b": [2.0, -2.0], "c": [0.5, 0.5]})
    ax = drawn[-1].axes[0]
    legend = ax.get_legend()
    hatches = [h.get_hatch() or "" for h in legend.legend_handles]
    assert len(set(hatches)) == 4  # every series has its own hatching, the reference none
    assert [t.get_text() for t in legend.get_texts()][1:] == ["a", "b", "c"]
    # the legend sits right of the axes, over no bar
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1


def test_loss_plot_lines_differ_in_dash_and_legend_gives_values(drawn):
    plot = LossAggregationPlot()
    plot.draw([[1.0, 2.0], [3.0]], 2.25, 2.0, 2.0)
    ax = drawn[-1].axes[0]
    lines = ax.get_legend().get_lines()
    dashes = {(line._unscaled_dash_pattern[0], tuple(line._unscaled_dash_pattern[1] or ()))
              for line in lines}
    assert len(dashes) == 3  # solid, dashed, dotted: not told apart by colour alone
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == ["reference, one process: 2.0000", "all_reduce(sum) / all_reduce(count): 2.0000",
                     "all_reduce(mean) / world_size: 2.2500"]


# --- the notebook's text ----------------------------------------------------------------------
NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "03_loss_aggregation.ipynb"


def notebook_cells():
    return [("".join(c["source"]), c) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def test_the_text_claims_no_order_of_the_ranks_losses():
    """Step 1's local means are not ordered by rank (2.36, 8.27, 4.04, 13.9), so the text
    must not say that higher ranks have larger losses."""
    text = "\n".join(src for src, c in notebook_cells() if c["cell_type"] == "markdown")
    assert "higher ranks have larger losses" not in text
    means = [losses_of(r, [3, 5, 8, 2]).mean().item() for r in range(4)]
    assert means != sorted(means)
    assert "rank 3, whose targets sit highest" in text
    one_big = [losses_of(r, [1, 1, 1, 30]).mean().item() for r in range(4)]
    assert max(one_big) == one_big[3]


def test_question_2_is_not_answered_before_it_is_asked():
    cells = [src for src, _ in notebook_cells()]
    q2 = next(i for i, c in enumerate(cells) if c.startswith("answer_2 = None"))
    before = "\n".join(cells[:q2 + 2])
    assert '"sum / global batch"' in cells[q2 - 1] and "What multiple" in cells[q2 - 1]
    for spoiler in ("quarter", "0.25", "1/4", "divides by `world_size`", "divides each by"):
        assert spoiler not in before.replace(cells[q2 + 1], ""), spoiler
    assert "reveal(answer_2" in cells[q2 + 1] and '"sum / global batch")' in cells[q2 + 1]


def test_the_exercise_asks_for_one_all_reduce_with_the_check_s_batch_sizes():
    cells = [src for src, _ in notebook_cells()]
    exercise = next(i for i, c in enumerate(cells) if c.startswith("# %load solutions/03_"))
    task = cells[exercise - 1]
    assert cells[exercise].startswith("# %load solutions/03_backward_and_log.py\n")
    assert (conftest.SOLUTIONS / "03_backward_and_log.py").exists()
    assert "**one** `all_reduce` per rank" in task and "may be 0" in task
    assert "`backward_and_log(model, x, y)`" in task
    # the tolerance as the check applies it: 1e-5 * max(1, max|reference|), over the gradient
    assert "within 1e-5 × max(1, the largest |number| of one process's gradient)" in task
    from reducelab.checks.loss import TOLERANCE, _close
    assert TOLERANCE == 1e-5 and _close(torch.tensor([0.5 + 9e-6]), torch.tensor([0.5]))
    assert not _close(torch.tensor([0.5 + 2e-5]), torch.tensor([0.5]))           # absolute below 1
    assert _close(torch.tensor([2.03, 4e3 + 0.039]), torch.tensor([2.0, 4e3]))    # 1e-5 of the largest
    assert "relative tolerance" not in task
    assert "whatever its forward, `model(x)`, calls" in task
    for sizes in UNEVEN_BATCHES:
        assert ", ".join(map(str, sizes)) in task
    assert cells[exercise + 1] == "check_backward_and_log(group, backward_and_log)"
    from reducelab.checks.loss import TOLERANCE
    assert TOLERANCE == 1e-5


def test_the_spawn_claim_is_one_paragraph_with_what_spawn_does_on_a_cpu():
    """A review (12:20): the mp.spawn / device_count cells were off topic; one paragraph
    keeps the claim and its reality, which the two tests above run."""
    assert not [s for s, c in notebook_cells() if "mp.spawn(" in s and c["cell_type"] == "code"]
    claim = next(s for s, c in notebook_cells() if "torch.cuda.device_count()`, then `mp.spawn" in s)
    assert "`device_count()` is 0: `mp.spawn` then starts no process and returns `None` " \
        "without an error" in claim


def token_grad(variant, lengths):
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 5))
    torch.manual_seed(rank)
    x = torch.randn(2, 2, 6, 4)
    labels = torch.randint(0, 5, (2, 2, 6))
    for m, micro_batch in enumerate(lengths[rank]):
        for s, length in enumerate(micro_batch):
            labels[m, s, length:] = -100
    tokens = (labels != -100).sum().float()
    dist.all_reduce(tokens)
    for xb, yb in zip(x, labels):
        logits, targets = model(xb).flatten(0, 1), yb.flatten()
        if variant == "mean / micro_batches":
            loss = F.cross_entropy(logits, targets, ignore_index=-100) / len(x)
        else:
            loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
            loss = loss / tokens * world_size
        loss.backward()
    return torch.cat([model.module.weight.grad.flatten(), model.module.bias.grad])


def token_reference(lengths):
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    logits, targets = [], []
    for rank, micro_batches in enumerate(lengths):
        torch.manual_seed(rank)
        x, labels = torch.randn(2, 2, 6, 4), torch.randint(0, 5, (2, 2, 6))
        for m, micro_batch in enumerate(micro_batches):
            for s, length in enumerate(micro_batch):
                logits.append(model(x[m, s, :length]))
                targets.append(labels[m, s, :length])
    F.cross_entropy(torch.cat(logits), torch.cat(targets)).backward()
    return torch.cat([model.weight.grad.flatten(), model.bias.grad])


def test_token_losses_need_the_global_token_count_not_a_mean_per_micro_batch(group):
    """A review (12:20): token-level losses were only hinted. With equal numbers of
    sequences but 11, 3 / 6, 12 real tokens, the per-micro-batch mean is far off one
    process's (not a rounding matter), the global token count matches it; the stored cell
    and the text say so, with the weights the text computes (1/12, 1/48, 1/32)."""
    lengths = [[[6, 5], [1, 2]], [[3, 3], [6, 6]]]
    assert [[sum(m) for m in r] for r in lengths] == [[11, 3], [6, 12]]
    assert sum(sum(sum(m) for m in r) for r in lengths) == 32
    group.resize(2)
    reference = token_reference(lengths)
    per_micro = group.run(token_grad, "mean / micro_batches", lengths)
    counted = group.run(token_grad, "sum / global tokens * world_size", lengths)
    group.resize(4)
    assert (per_micro[0] - reference).abs().max() > 0.2 * reference.abs().max()
    assert all(torch.allclose(g, reference, atol=1e-6) for g in counted)
    cells = notebook_cells()
    i, (src, cell) = next((i, sc) for i, sc in enumerate(cells) if sc[0].startswith("def token_grad"))
    shown = "".join("".join(o.get("text", "")) for o in cell["outputs"])
    assert "mean / micro_batches               matches one process: False" in shown
    assert "sum / global tokens * world_size   matches one process: True" in shown
    assert "lengths = [[[6, 5], [1, 2]], [[3, 3], [6, 6]]]" in src
    text = cells[i + 1][0]
    assert "= 1/12" in text and "1/48" in text and "1/32" in text
    assert "huggingface/transformers#24725, 2023-07-10" in text
    assert "meta-pytorch/torchtune#1875, 2024-10-20" in text
    assert "ignore_index" in cells[i - 1][0]


def test_distributed_sampler_pads_by_repeating_samples():
    """Step 1's text (a review, 12:20): DistributedSampler(drop_last=False) evens the ranks
    out by repeating samples, which count twice in an epoch's mean."""
    from torch.utils.data.distributed import DistributedSampler
    data = list(range(10))
    seen = [i for r in range(4) for i in DistributedSampler(data, num_replicas=4, rank=r,
                                                              shuffle=False)]
    assert len(seen) == 12 and sorted(set(seen)) == data
    assert sorted(i for i in set(seen) if seen.count(i) == 2) == [0, 1]
    text = "\n".join(s for s, c in notebook_cells() if c["cell_type"] == "markdown")
    assert "`DistributedSampler(drop_last=False)` evens the ranks out by repeating samples, " \
        "which then count twice in an epoch's mean" in text


def test_question_3_asks_for_the_multiple_of_the_local_gradient_and_the_run_gives_a_half(group):
    """A review (12:20): question 3 was a True/False give-away; it asks what multiple of
    rank 0's local gradient its gradient is. Review 5 (03-2): it runs on two ranks, so its
    answer, 0.5, differs from question 2's 0.25; stored."""
    group.resize(2)
    for grad, local, _ in group.run(backward_through_all_reduce):
        ratio = (grad * local).sum().item() / (local * local).sum().item()
        assert round(ratio, 4) == 0.5
    cells = notebook_cells()
    q = next(i for i, (s, _) in enumerate(cells) if s.startswith("answer_3 = None"))
    assert "what multiple of its **local** gradient" in cells[q - 1][0]
    assert "Try it on two ranks" in cells[q - 1][0]
    assert "group.resize(2)" in cells[q + 1][0]
    shown = "".join("".join(o["data"].get("text/html", "")) for o in cells[q + 1][1]["outputs"]
                    if "data" in o)
    assert "grad / local grad, rank by rank: [0.5, 0.5]" in shown
    assert "The real run gives 0.5." in shown
    before = "\n".join(s for s, _ in cells[:q + 1])
    for spoiler in ("identity", "1 / world_size", "passes the gradient", "stays local",
                    "its local grad / world_size", "half"):
        assert spoiler not in before, spoiler


def test_the_myth_section_is_marked_optional_and_counted_in_the_header():
    """A review (12:20) timed 03 at about 55 min against 40: Myth vs reality is marked
    optional, and the header counts it."""
    cells = notebook_cells()
    assert "· parts marked optional: about 14 min more, after the lesson*" in cells[0][0]
    assert any(s.startswith("## Myth vs reality (optional, after the lesson)\n") for s, _ in cells)


from test_notebooks import bound_and_loaded as _bound_and_loaded  # noqa: E402 (one definition, shared)


def test_the_optional_parts_follow_the_summary_and_no_core_cell_needs_them():
    """Review 5: the core fits one study unit. Token-level losses (a second case of step 4's
    normalisation) and the myth section follow the summary, each marked optional; the
    learning goals say so; no code cell outside them uses a name only they bind."""
    from test_notebooks import OPTIONAL_MARK
    cells = notebook_cells()
    text = [s for s, _ in cells]
    summary = next(i for i, t in enumerate(text) if t.startswith("## Summary"))
    marks = [i for i, t in enumerate(text) if OPTIONAL_MARK.search(t)]
    reading = next(i for i, t in enumerate(text) if t.startswith("## Further reading"))
    assert [text[i].split("\n")[0] for i in marks] == [
        "## Why `zero_grad()` inside the loop keeps only the last micro-batch (optional, after the lesson)",
        "## Token-level losses: count tokens, not samples (optional, after the lesson)",
        "## Myth vs reality (optional, after the lesson)"]
    assert summary < marks[0] and marks[-1] < reading
    assert "Token-level losses, which need the global number of tokens, are an optional part" in text[0]
    # review 6 (03-1): the summary names the token rule, as the optional part's
    assert all(l.endswith("(optional part).") for l in text[summary].splitlines() if "token" in l.lower())
    code = [(i, *_bound_and_loaded(t)) for i, (t, c) in enumerate(cells) if c["cell_type"] == "code"]
    optional = lambda i: marks[0] <= i < reading
    only_there = set().union(*(b for i, b, _ in code if optional(i))) - set().union(*(b for i, b, _ in code if not optional(i)))
    assert not [(i, loaded & only_there) for i, _, loaded in code if not optional(i) and loaded & only_there]


def test_the_variants_figure_shows_each_gradient_over_the_reference(drawn):
    """Review 5 (03-3): "not normalised" (4 times the reference) dwarfed the other bars. The
    figure divides each variant by the reference, element by element, and says so on its
    axis: right variants stand at 1, "sum / global batch" at 0.25, "not normalised" at 4."""
    cell = next(s for s, _ in notebook_cells() if s.startswith("VARIANTS = ("))
    assert "gradient_variants(reference / reference, {v: g / reference for v, g in grads.items()}" in cell
    assert 'ylabel="gradient / reference"' in cell
    reference = torch.tensor([0.28, 1.24, -1.29, -1.11])
    grads = {"right": reference.clone(), "quarter": reference / 4, "four": reference * 4}
    gradient_variants(reference / reference, {v: g / reference for v, g in grads.items()},
                      names=["w0", "w1", "w2", "bias"], ylabel="gradient / reference")
    ax = drawn[-1].axes[0]
    assert ax.get_ylabel() == "gradient / reference"
    heights = sorted({round(p.get_height(), 4) for p in ax.patches})
    assert heights == [0.25, 1.0, 4.0]


def test_question_1_asks_for_the_recipe_not_the_arithmetic():
    """An expert review: question 1 stated its formula, (2 + 0) / 2, so it was arithmetic.
    It now names the recipe above it (mean_of_means) and the global mean the learner may
    expect, and leaves the formula to the code the learner reads."""
    cells = notebook_cells()
    asked = next(src for src, c in cells if src.startswith("## Predict, then run"))
    assert "**Question 1.**" in asked and "`mean_of_means`" in asked
    assert "all_reduce(loss) / world_size" not in asked and "2.0 / 4 = 0.5" in asked
    assert any(src.startswith("def mean_of_means") for src, c in cells
               if c["cell_type"] == "code")


def test_the_summary_carries_the_token_rule_of_the_optional_part():
    """Review 6 (03-1): the summary says that a language model's loss counts real tokens,
    marked as the optional part's, whose text gives the same rule."""
    cells = [text for text, _ in notebook_cells()]
    summary = next(c for c in cells if c.startswith("## Summary"))
    line = next(l for l in summary.splitlines() if "tokens" in l)
    assert "counts real tokens, not samples" in line and line.endswith("(optional part).")
    part = next(c for c in cells if c.startswith("## Token-level losses: count tokens, not samples (optional"))
    rule = next(c for c in cells if "divide by the number of real tokens of the whole step" in c)
    assert cells.index(rule) > cells.index(part) > cells.index(summary)


def test_step_3_says_why_every_rank_starts_alike():
    """Review 6 (03-2): "every rank starts from the same weights (the answer does not seed
    its model)" read as a contradiction: the text says we seed alike where the answer does
    not, and the loop's code does so before it builds the model."""
    cells = [text for text, _ in notebook_cells()]
    i = next(i for i, c in enumerate(cells) if c.startswith("def example_1_loop"))
    assert "The answer leaves its model unseeded; we seed it alike on every rank (`manual_seed(0)`)" in cells[i - 1]
    assert "the answer does not seed its model)" not in cells[i - 1]
    code = cells[i]
    assert code.index("torch.manual_seed(0)") < code.index("nn.Linear(10, 2)")


def test_logging_the_loss_says_its_cost_and_zero_grad_s_evidence_is_kept():
    """Review 6 (03-3): logging the all-reduced loss with .item() at every step is a
    collective and, on a GPU, a sync point: step 5's text says so, in the core. The
    zero_grad-inside diagnosis (only the last micro-batch survives, / 4) left the core for
    an optional part after the summary; the core states it and points there, and the
    stored run there still shows it."""
    cells = notebook_cells()
    text = [s for s, _ in cells]
    from test_notebooks import parts
    part = parts(NOTEBOOK)
    i = next(i for i, t in enumerate(text) if t.startswith("The local losses differ;"))
    assert part[i] is None and "`.item()` is a sync point" in text[i] and "Log every few steps" in text[i]
    core = next(t for t in text if t.startswith('`"/ micro_batches"` and'))
    assert "only the last one survives, divided by 4" in core and "optional part after the summary" in core
    j = next(i for i, t in enumerate(text) if t.startswith("last_only = reference_grad(4, keep=[3]) / 4"))
    summary = next(i for i, t in enumerate(text) if t.startswith("## Summary"))
    assert part[j] is not None and j > summary
    assert "equal: True" in "".join("".join(o.get("text", "")) for o in cells[j][1]["outputs"])


def test_review_7_question_3_states_that_all_reduce_has_no_backward_and_step_1_s_examples_hold():
    """Review 7 (03-1): question 3 had two defensible answers (nothing said that
    dist.all_reduce has no autograd formula; the optional differentiable one behaves
    otherwise). The question's cell states it, as torch's warning in the stored evidence
    says it (c10d::allreduce_ has no autograd kernel); the spoiler test above still holds.
    (03-2) Step 1's examples of unequal batch sizes no longer include one whose sizes are
    equal: DistributedSampler(drop_last=False) is named as the case that is not. (03-4) Step
    4's rule for the micro-batch division points to the token count and its optional part."""
    cells = notebook_cells()
    q = next(i for i, (s, _) in enumerate(cells) if s.startswith("answer_3 = None"))
    asked = cells[q - 1][0]
    assert ("`dist.all_reduce` has no backward formula: torch registers no autograd kernel for "
            "`c10d::allreduce_`, and nothing is exchanged between the ranks in `backward()`.") in asked
    shown = "".join("".join(o["data"].get("text/html", "")) for o in cells[q + 1][1]["outputs"]
                    if "data" in o)
    assert "c10d::allreduce_" in shown and "autograd kernel was not registered" in shown
    text = next(s for s, _ in cells if s.startswith("Local batch sizes differ more often"))
    assert "the last batch of an epoch (" not in text
    assert "(Not the last batch of an epoch: `DistributedSampler(drop_last=False)` evens" in text
    rule = next(s for s, _ in cells if s.startswith('`"/ micro_batches"` and'))
    assert "with token-level losses the global token count: optional part on tokens" in rule
    assert any(s.startswith("## Token-level losses: count tokens, not samples (optional") for s, _ in cells)


def grad_fn_around_all_reduce():
    w = torch.ones(3, requires_grad=True)
    reduced = (w * 2).sum().clone()
    before = type(reduced.grad_fn).__name__
    dist.all_reduce(reduced)
    return before, type(reduced.grad_fn).__name__


def test_question_3_shows_why_the_gradient_passes_through_the_all_reduce(group):
    """Teach-c review: question 3's reveal said autograd passes the gradient through
    dist.all_reduce "as if it were the identity" without saying why a learner should not
    expect a zero gradient instead. With no autograd kernel for c10d::allreduce_, the in-place
    all_reduce records nothing: reduced's grad_fn is the clone's before and after, so
    backward() goes through the clone. Measured here; the stored evidence shows it and the
    why says it, after the question only."""
    from reducelab.checks.answers import WHY
    group.resize(2)
    for before, after in group.run(grad_fn_around_all_reduce):
        assert before == after == "CloneBackward0"
    group.resize(4)
    cells = notebook_cells()
    q = next(i for i, (s, _) in enumerate(cells) if s.startswith("answer_3 = None"))
    shown = "".join("".join(o["data"].get("text/html", "")) for o in cells[q + 1][1]["outputs"]
                    if "data" in o)
    assert "reduced.grad_fn after dist.all_reduce, rank 0: CloneBackward0" in shown
    assert "autograd recorded nothing for it" in WHY["03"][3]
    assert "reduced.grad_fn is CloneBackward0, the clone's" in WHY["03"][3]
    assert "CloneBackward0" not in "\n".join(s for s, c in cells[:q + 1] if c["cell_type"] == "markdown")


def test_step_5_names_the_condition_under_which_ddp_matches_one_process():
    """Teach-c review: step 5 said DDP's gradients "equal one process's gradient over the
    global batch" without the condition, equal local batches (8 samples on every rank), that
    the exercise then drops; with unequal ones DDP of local means weighs samples as the mean of
    means does (the exercise's stored check message)."""
    cells = notebook_cells()
    text = next(s for s, _ in cells if s.startswith("The local losses differ;"))
    assert "with 8 samples on every rank, equal one process's gradient" in text
    cell = next(s for s, _ in cells if "def ddp_local_backward" in s)
    assert "x, y = torch.randn(8, 3), torch.randn(8, 1)" in cell
