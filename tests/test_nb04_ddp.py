"""Notebook 04: DDP gradients, loss reductions and the real reduce_op warning.

Facts the notebook teaches (on real gloo ranks), the explorer driven headless, the
exercise check, the data helpers and the plots.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import conftest
from reducelab import LocalGroup
from reducelab.checks.ddp import (check_loss_scale, compare_gradients, expected_factor,
                                  explain)
from reducelab.data import (batch_order, first_ranks, load_digits_tensors, local_slice,
                            split_sizes)
from reducelab.plots.ddp import GradientScatter, loss_curves
from reducelab.widgets.ddp import GradientFactorExplorer, gradient_table, run_comparison

PNG = b"\x89PNG"


@pytest.fixture(scope="module")
def group():
    g = LocalGroup(world_size=4, timeout=120)  # first DDP use imports torch._dynamo per rank
    yield g
    g.close()


@pytest.fixture(scope="module")
def batch():
    return load_digits_tensors(840)


def load_solution():
    return conftest.load_solution("04_loss_scale")


# --- rank functions, as in the notebook -------------------------------------------------

def ddp_gradient(X, y, reduction, world_size, split):
    pg = first_ranks(world_size)
    if pg is None:
        return None
    part = local_slice(len(X), world_size, dist.get_rank(pg), split)
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 10), process_group=pg)
    F.cross_entropy(model(X[part]), y[part], reduction=reduction).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def full_batch_gradient(X, y, reduction):
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    F.cross_entropy(model(X), y, reduction=reduction).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def reference_ddp_gradient(X, y, reduction, sizes):
    """What DDP should give, computed in one process: mean over ranks of local gradients."""
    grads, start = [], 0
    for n in sizes:
        grads.append(full_batch_gradient(X[start:start + n], y[start:start + n], reduction))
        start += n
    return torch.stack(grads).mean(0)


def warnings_of(what):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        if what == "reduce_op":
            dist.all_reduce(torch.ones(1), op=dist.reduce_op.SUM)
        else:
            torch.manual_seed(0)
            model = DDP(nn.Linear(10, 5))
            torch.manual_seed(dist.get_rank())
            out = model(torch.randn(4, 10))
            if what == "ce":
                loss = nn.CrossEntropyLoss()(out, torch.randint(0, 5, (4,)))
            else:
                loss = (out - torch.randn(4, 5)).abs().sum()
            loss.backward()
    return [(w.category.__name__, str(w.message)) for w in records]


def accumulate(X, y, use_no_sync, micro_batches=4):
    import contextlib
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 10))
    counter = {"all_reduce": 0}

    def counting_allreduce(state, bucket):
        state["all_reduce"] += 1
        return allreduce_hook(None, bucket)

    model.register_comm_hook(counter, counting_allreduce)
    mine = local_slice(len(X), world_size, rank)
    for i, (xb, yb) in enumerate(zip(X[mine].chunk(micro_batches), y[mine].chunk(micro_batches))):
        last = i == micro_batches - 1
        with model.no_sync() if use_no_sync and not last else contextlib.nullcontext():
            (F.cross_entropy(model(xb), yb) / micro_batches).backward()
    return counter["all_reduce"], torch.cat([p.grad.flatten() for p in model.parameters()])


# --- facts -------------------------------------------------------------------------------

def test_reduce_op_attribute_warns_on_every_call(group):
    for _ in range(2):  # ranks persist: the second call must still record it
        out = group.run(warnings_of, "reduce_op")
        for found in out:
            assert found == [("FutureWarning", "`torch.distributed.reduce_op` is deprecated, "
                              "please use `torch.distributed.ReduceOp` instead")]


def test_ddp_with_cross_entropy_or_summing_loss_does_not_warn(group):
    assert group.run(warnings_of, "ce") == [[]] * 4
    assert group.run(warnings_of, "sum") == [[]] * 4


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split", ["equal", "uneven"])
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_ddp_gradient_is_mean_of_local_gradients(group, batch, reduction, split, world_size):
    X, y = batch
    r = run_comparison(group, ddp_gradient, full_batch_gradient, X, y, reduction, world_size, split)
    ref = reference_ddp_gradient(X, y, reduction, split_sizes(len(X), world_size, split))
    torch.testing.assert_close(r.ddp, ref, rtol=1e-4, atol=1e-5)
    expected = expected_factor(reduction, world_size, split)
    if expected is None:
        assert not r.comparison.constant
        assert r.comparison.ratio_min < 0.9 and r.comparison.ratio_max > 1.1
    else:
        assert r.comparison.constant
        assert r.comparison.factor == pytest.approx(expected, rel=1e-4)
        torch.testing.assert_close(r.ddp, expected * r.full, rtol=1e-4, atol=1e-5)


def test_sum_reduction_gives_full_batch_over_world_size(group, batch):
    X, y = batch
    r = run_comparison(group, ddp_gradient, full_batch_gradient, X, y, "sum", 4, "equal")
    torch.testing.assert_close(r.ddp * 4, full_batch_gradient(X, y, "sum"), rtol=1e-4, atol=1e-4)


def test_no_sync_saves_all_reduces_and_keeps_the_gradient(group, batch):
    X, y = batch[0][:64], batch[1][:64]
    synced = group.run(accumulate, X, y, use_no_sync=False)
    skipped = group.run(accumulate, X, y, use_no_sync=True)
    assert [n for n, _ in synced] == [4] * 4
    assert [n for n, _ in skipped] == [1] * 4
    full = full_batch_gradient(X, y, "mean")
    for _, g in synced + skipped:
        torch.testing.assert_close(g, full, rtol=1e-4, atol=1e-6)


def test_gradient_table_rows(group, batch):
    X, y = batch
    text = gradient_table(group, ddp_gradient, full_batch_gradient, X, y, world_sizes=(1, 2, 4))
    lines = text.splitlines()
    assert lines[2].split()[:5] == ["mean", "equal", "1", "x", "1"]
    assert lines[4].split() == ["sum", "equal", "1", "x", "0.5", "x", "0.25", "x"]
    assert lines[5].split() == ["sum", "uneven", "1", "x", "0.5", "x", "0.25", "x"]
    assert "varies" in lines[3]
    with pytest.raises(ValueError, match="world_size must be an int from 1 to 4"):
        gradient_table(group, ddp_gradient, full_batch_gradient, X, y, world_sizes=(5,))


# --- explorer ------------------------------------------------------------------------------

def test_explorer_follows_controls(group, batch):
    X, y = batch
    e = GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y,
                               reduction="sum", world_size=4, split="equal")
    try:
        assert e.result.comparison.factor == pytest.approx(0.25, rel=1e-4)
        assert bytes(e.image.value).startswith(PNG)
        assert "0.25 x the full-batch gradient" in e.message.value
        e.controls["world_size"].value = 2
        assert e.result.sizes == [420, 420]
        torch.testing.assert_close(e.result.ddp, full_batch_gradient(X, y, "sum") / 2,
                                   rtol=1e-4, atol=1e-4)
        e.controls["reduction"].value = "mean"
        e.controls["split"].value = "uneven"
        assert e.result.sizes == [280, 560]
        assert not e.result.comparison.constant
        ref = reference_ddp_gradient(X, y, "mean", [280, 560])
        torch.testing.assert_close(e.result.ddp, ref, rtol=1e-4, atol=1e-6)
        assert "no single factor" in e.text()
        assert e.text().startswith("GradientFactorExplorer(reduction=mean, world_size=2, split=uneven)")
    finally:
        e.close()


def test_explorer_above_group_size_uses_a_private_group(group, batch):
    X, y = batch
    e = GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y,
                               reduction="sum", world_size=4, split="uneven")
    try:
        e.controls["world_size"].value = 5
        assert e.error is None
        assert e.result.comparison.factor == pytest.approx(0.2, rel=1e-4)
        assert group.world_size == 4  # the notebook's group is left as it was
        assert e._big is not None and e._big.world_size == 8
    finally:
        e.close()
    assert e._big is None


def test_explorer_rejects_bad_initial_values(group, batch):
    X, y = batch
    with pytest.raises(ValueError, match="reduction must be one of"):
        GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y, reduction="max")
    with pytest.raises(ValueError, match="split must be one of"):
        GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y, split="random")
    with pytest.raises(ValueError, match="world_size must be from 1 to 8"):
        GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y, world_size=9)


# --- exercise check ------------------------------------------------------------------------

def test_solution_passes(group, batch):
    v = check_loss_scale(load_solution().loss_scale, group, *batch)
    assert v, v.message


def test_stub_fails_and_says_why(group, batch):
    v = check_loss_scale(lambda reduction, world_size, local_batch, global_batch: 1.0, group, *batch)
    assert not v
    assert "reduction='mean'" in v.message and "uneven" in v.message
    assert "expected exactly 1 x" in v.message and "local_batch" in v.message


def test_scale_that_only_fixes_sum_fails_on_mean(group, batch):
    v = check_loss_scale(lambda r, w, n, N: float(w), group, *batch)
    assert not v
    assert "reduction='mean'" in v.message and "4 x the full-batch gradient" in v.message


def test_scale_right_for_mean_only_fails_on_sum_with_factor(group, batch):
    v = check_loss_scale(lambda r, w, n, N: w * n / N, group, *batch)
    assert not v
    assert "reduction='sum'" in v.message and "0.25 x the full-batch gradient" in v.message
    assert "world_size=4" in v.message


def test_check_reports_none_and_exceptions(group, batch):
    v = check_loss_scale(lambda *a: None, group, *batch)
    assert not v and "TODO" in v.message

    def boom(*a):
        raise ZeroDivisionError("oops")
    v = check_loss_scale(boom, group, *batch)
    assert not v and "ZeroDivisionError: oops" in v.message
    assert not check_loss_scale("not a function", group, *batch)


# --- pure helpers ------------------------------------------------------------------------

def test_compare_gradients():
    full = torch.tensor([1.0, -2.0, 3.0])
    c = compare_gradients(full / 3, full)
    assert c.constant and c.factor == pytest.approx(1 / 3) and c.text() == "0.3333 x"
    c = compare_gradients(torch.tensor([1.0, -1.0, 3.0]), full)
    assert not c.constant and c.ratio_min == pytest.approx(0.5) and c.ratio_max == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same shape"):
        compare_gradients(torch.zeros(2), full)
    with pytest.raises(ValueError, match="all zeros"):
        compare_gradients(full, torch.zeros(3))
    with pytest.raises(TypeError):
        compare_gradients([1.0], full)


def test_expected_factor_and_explain():
    assert expected_factor("sum", 8, "uneven") == pytest.approx(1 / 8)
    assert expected_factor("mean", 8, "equal") == 1.0
    assert expected_factor("mean", 8, "uneven") is None
    assert expected_factor("mean", 1, "uneven") == 1.0
    assert "1/3" in explain("sum", 3, "equal", [1, 1, 1])
    with pytest.raises(ValueError, match="reduction must be one of"):
        expected_factor("avg", 2, "equal")


def test_digits_loader():
    X, y = load_digits_tensors()
    assert X.shape == (1797, 64) and X.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert 0.0 <= X.min().item() and X.max().item() == 1.0
    assert sorted(y.unique().tolist()) == list(range(10))
    X5, _ = load_digits_tensors(5)
    torch.testing.assert_close(X5, X[:5])
    X5[0, 0] = 42.0  # a copy: the cache is unchanged
    assert load_digits_tensors(5)[0][0, 0].item() != 42.0
    with pytest.raises(ValueError, match="from 1 to 1797"):
        load_digits_tensors(0)
    with pytest.raises(TypeError):
        load_digits_tensors(2.5)


def test_split_sizes_and_local_slice():
    assert split_sizes(840, 4, "equal") == [210] * 4
    assert split_sizes(840, 4, "uneven") == [84, 168, 252, 336]
    assert split_sizes(64, 4, "uneven") == [6, 12, 19, 27]
    for w in range(1, 9):
        for split in ("equal", "uneven"):
            sizes = split_sizes(840, w, split)
            assert sum(sizes) == 840 and min(sizes) >= 1 and len(sizes) == w
    assert local_slice(840, 4, 2, "uneven") == slice(252, 504)
    with pytest.raises(ValueError, match="divisible"):
        split_sizes(10, 4, "equal")
    with pytest.raises(ValueError, match="split must be one of"):
        split_sizes(8, 2, "random")
    with pytest.raises(ValueError, match="rank must be"):
        local_slice(8, 2, 2)


def test_batch_order_is_seeded_and_drops_last():
    a = batch_order(100, 32, epochs=2)
    assert len(a) == 6 and all(b.shape == (32,) for b in a)
    assert all(torch.equal(x, z) for x, z in zip(a, batch_order(100, 32, epochs=2)))
    assert not torch.equal(a[0], a[3])  # a new permutation each epoch
    assert len(set(torch.cat(a[:3]).tolist())) == 96


def test_plots_return_png():
    s = GradientScatter()
    assert s.draw([0.5, -1.0], [1.0, -2.0], 0.5, True, title="t").startswith(PNG)
    with pytest.raises(ValueError, match="same length"):
        s.draw([1.0], [1.0, 2.0], 1.0, True)
    assert loss_curves({"a": [2.0, 1.0], "b": [2.0, 1.5]}, reference="a").startswith(PNG)
    with pytest.raises(ValueError, match="reference must be one of"):
        loss_curves({"a": [1.0]}, reference="z")
    with pytest.raises(ValueError, match="empty"):
        loss_curves({})
