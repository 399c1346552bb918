"""Tests of notebook 03 (loss aggregation): the explorer, the exercise check, and the facts
the notebook teaches, each measured on real gloo ranks against a single-process reference."""
from __future__ import annotations

import json
import pathlib
import re
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
from reducelab.checks.loss import UNEVEN_BATCHES, check_global_mean_loss, exercise_losses
from reducelab.plots import message_png
from reducelab.plots.loss import LossAggregationPlot, gradient_variants, parameter_drift
from reducelab.widgets.loss import LossExplorer, parse_batch_sizes



def load_solution():
    return conftest.load_solution("03_global_mean_loss")


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
    # (2.0 + 0.0) / 2 against 2.0 / 4, as the notebook's question 1 sets it up
    def q1():
        losses = torch.tensor([2.0]) if dist.get_rank() == 0 else torch.zeros(3)
        loss = losses.mean()
        dist.all_reduce(loss)
        return (loss / dist.get_world_size()).item()
    with LocalGroup(world_size=2, timeout=60) as g:
        assert g.run(q1) == [1.0, 1.0]


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
def test_solution_passes(group):
    verdict = check_global_mean_loss(group, load_solution().global_mean_loss)
    assert verdict, verdict.message
    assert group.world_size == 4  # restored


def stub(per_sample_losses):  # the notebook's TODO stub: the mean of per-rank means
    loss = per_sample_losses.mean()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def test_stub_fails_and_names_the_mean_of_means(group):
    verdict = check_global_mean_loss(group, stub)
    sizes = UNEVEN_BATCHES[0]
    expected = torch.cat([exercise_losses(r, n) for r, n in enumerate(sizes)]).mean().item()
    assert not verdict
    assert f"{expected:.4f}" in verdict.message
    assert "mean of the per-rank means" in verdict.message
    assert group.world_size == 4


def local_only(l):
    return l.mean()


def sum_only(l):
    s = l.sum()
    dist.all_reduce(s)
    return s


def count_not_reduced(l):
    s = l.sum()
    dist.all_reduce(s)
    return s / l.numel()


def raises(l):
    return 1 / 0


def vector(l):
    return torch.zeros(2)


def text(l):
    return "0.5"


def two_all_reduces(l):  # step 1's weighted_mean: right, with two collectives
    from torch.distributed import all_reduce  # counted however it is called
    total, count = l.sum(), torch.tensor(float(l.numel()))
    all_reduce(total)
    dist.distributed_c10d.all_reduce(count)
    return total / count


def local_means_weighted(l):  # one all_reduce, right for non-empty batches, nan for an empty one
    stats = torch.stack([l.mean() * l.numel(), torch.tensor(float(l.numel()))])
    dist.all_reduce(stats)
    return stats[0] / stats[1]


def gathered(l):  # one collective, but not an all_reduce
    stats = torch.stack([l.sum(), torch.tensor(float(l.numel()))])
    out = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(out, stats)
    total, count = torch.stack(out).sum(0)
    return total / count


def gathered_single(l):  # torch 2.13's name for the gather into one tensor
    stats = torch.stack([l.sum(), torch.tensor(float(l.numel()))])
    out = torch.empty(2 * dist.get_world_size())
    dist.all_gather_single(out, stats)
    total, count = out.view(-1, 2).sum(0)
    return total / count


WRONG = {
    "local_only": (local_only, "other ranks' losses are not in it"),
    "sum_only": (sum_only, "the sum of all 18 losses, not their mean"),
    "count_not_reduced": (count_not_reduced, "each rank divides by a different number"),
    "raises": (raises, "ZeroDivisionError"),
    "vector": (vector, "shape (2,)"),
    "text": (text, "returned a str"),
    "two_all_reduces": (two_all_reduces, "rank 0 called all_reduce 2 times. The exercise asks "
                                         "for one all_reduce per rank."),
    "local_means_weighted": (local_means_weighted, "[4, 0, 3] (global batch 7), the global mean "
                             "loss is 1.3025 (the sum of all 7 losses divided by 7), but rank 0 "
                             "returned nan. Rank 1 holds no sample here, and the mean of an empty "
                             "tensor is nan (0 / 0)"),
    "gathered": (gathered, "rank 0 called all_gather once. The exercise asks for one all_reduce"),
    "gathered_single": (gathered_single, "rank 0 called all_gather_single once."),
    "stub": (stub, "mean of the per-rank means"),
}


@pytest.mark.parametrize("name", WRONG)
def test_wrong_answers_are_explained(group, name):
    fn, says = WRONG[name]
    verdict = check_global_mean_loss(group, fn)
    assert not verdict
    assert says in verdict.message, verdict.message
    assert group.world_size == 4


def test_no_check_message_gives_the_recipe(group):
    """What was wrong, never how to write it: no solution line, and none of the recipe's
    words (the review found 'All-reduce the loss sum and the sample count separately,
    then divide.' in an earlier message)."""
    solution = [line.strip() for line in
                (conftest.SOLUTIONS / "03_global_mean_loss.py").read_text().splitlines()
                if len(line.strip()) > 12 and not line.strip().startswith(("#", '"', "def "))]
    recipe = re.compile(r"separately|then divide|two.element|stack|one tensor|sum and the "
                        r"(sample )?count|all-reduce the|divide (it )?by the global", re.I)
    for name, (fn, _) in WRONG.items():
        message = check_global_mean_loss(group, fn).message
        assert not any(line in message for line in solution), (name, message)
        assert not recipe.search(message), (name, message)


def test_a_function_right_only_for_the_first_setting_fails_on_the_second(group):
    # right answer for world_size 4 (hard-coded count 18), wrong for the other setting
    def hard_coded(l):
        s = l.sum()
        dist.all_reduce(s)
        return s / 18
    verdict = check_global_mean_loss(group, hard_coded)
    assert not verdict and "[4, 0, 3]" in verdict.message


def test_the_check_includes_an_empty_local_batch():
    assert any(0 in sizes for sizes in UNEVEN_BATCHES)
    assert exercise_losses(1, 0).shape == (0,)
    assert torch.isnan(exercise_losses(1, 0).mean())  # what the check's nan message says
    assert torch.isnan(torch.tensor([]).mean())


def test_check_rejects_a_non_function(group):
    with pytest.raises(TypeError, match="function"):
        check_global_mean_loss(group, 3)


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
    assert '"sum / global batch"' in cells[q2 - 1] and "How many times" in cells[q2 - 1]
    for spoiler in ("quarter", "0.25", "1/4", "divides by `world_size`", "divides each by"):
        assert spoiler not in before.replace(cells[q2 + 1], ""), spoiler
    assert "reveal(answer_2" in cells[q2 + 1] and '"sum / global batch")' in cells[q2 + 1]


def test_the_exercise_asks_for_one_all_reduce_with_the_check_s_batch_sizes():
    cells = [src for src, _ in notebook_cells()]
    exercise = next(i for i, c in enumerate(cells) if c.startswith("# %load solutions/03_"))
    task = cells[exercise - 1]
    assert "**one** `all_reduce` per rank" in task and "may be 0" in task
    for sizes in UNEVEN_BATCHES:
        assert ", ".join(map(str, sizes)) in task
    assert cells[exercise + 1] == "check_global_mean_loss(group, global_mean_loss)"


def test_the_spawn_cell_shows_what_spawn_started():
    (src, cell), = [(s, c) for s, c in notebook_cells() if "mp.spawn(" in s and c["cell_type"] == "code"]
    assert "join=False" in src and "len(ctx.processes)" in src
    shown = "".join("".join(o.get("text", "")) for o in cell["outputs"])
    if not torch.cuda.is_available():
        assert "processes mp.spawn started: 0" in shown
    text = "\n".join(s for s, c in notebook_cells() if c["cell_type"] == "markdown")
    assert "returns `None` whether it started processes or not" in text
    assert "mp.spawn(..., join=True) returned: None" in shown
    assert "Nothing was printed by `train`" not in text
