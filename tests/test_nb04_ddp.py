"""Notebook 04: DDP gradients, loss reductions and the real reduce_op warning.

Facts the notebook teaches (on real gloo ranks, against single-process references), the
torch source it shows, the explorer driven headless, the exercise check, the data
helpers and the figures.
"""
from __future__ import annotations

import contextlib
import html
import inspect
import json
import pathlib
import re
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import conftest
from reducelab import plots
from reducelab.checks.answers import WHY
from reducelab.checks.ddp import (CHECK_WORLD_SIZES, PENALTY, check_ddp_loss, compare_gradients,
                                  TOLERANCE, _penalty, expected_factor, explain, full_gradients,
                                  penalty_rows)
from reducelab.data import batch_order, load_digits_tensors, local_slice, split_sizes
from reducelab.plots import message_png
from reducelab.plots.ddp import GAP_FLOOR, GradientScatter, loss_curves, sample_weights
from reducelab.widgets.ddp import GradientFactorExplorer

PNG = b"\x89PNG"
NOTE_PNG = message_png("No figure for these settings: see the message below.")

pytestmark = pytest.mark.usefixtures("keep_four_ranks")


@pytest.fixture(scope="module")
def batch():
    return load_digits_tensors(840)


def load_solution():
    return conftest.load_solution("04_ddp_loss")


# --- rank functions, as in the notebook -------------------------------------------------

def ddp_gradient(X, y, reduction, split):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    part = local_slice(len(X), world_size, rank, split)
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 10))
    F.cross_entropy(model(X[part]), y[part], reduction=reduction).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def full_batch_gradient(X, y, reduction):
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    F.cross_entropy(model(X), y, reduction=reduction).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def reference_ddp_gradient(X, y, reduction, sizes):
    """What DDP should give, computed in one process: each local gradient divided by
    world_size, then summed."""
    grads, start = [], 0
    for n in sizes:
        grads.append(full_batch_gradient(X[start:start + n], y[start:start + n], reduction)
                     / len(sizes))
        start += n
    return torch.stack(grads).sum(0)


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


def accumulate(X, y, use_no_sync, forward_inside=True, micro_batches=4):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 10))
    counter = {"all_reduce": 0}

    def counting_allreduce(state, bucket):
        state["all_reduce"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(counter, counting_allreduce)
    mine = local_slice(len(X), world_size, rank)
    for i, (xb, yb) in enumerate(zip(X[mine].chunk(micro_batches), y[mine].chunk(micro_batches))):
        last = i == micro_batches - 1
        context = model.no_sync() if use_no_sync and not last else contextlib.nullcontext()
        if forward_inside:
            with context:
                (F.cross_entropy(model(xb), yb) / micro_batches).backward()
        else:
            loss = F.cross_entropy(model(xb), yb) / micro_batches
            with context:
                loss.backward()
    return counter["all_reduce"], torch.cat([p.grad.flatten() for p in model.parameters()])


def both_orders():
    g = torch.tensor([40000.0], dtype=torch.float16)
    world_size = dist.get_world_size()
    late = g.clone()
    dist.all_reduce(late, op=dist.ReduceOp.SUM)
    late /= world_size
    early = g / world_size
    dist.all_reduce(early, op=dist.ReduceOp.SUM)
    return late.item(), early.item()


def ddp_float16_gradient(hook=None):
    """As in the notebook: DDP over a float16 Linear whose weight's local gradient is 40000."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(1, 1, bias=False).half())
    if hook is not None:
        model.register_comm_hook(None, hook)
    x = torch.ones(1, 1, dtype=torch.float16)
    (40000 * model(x)).sum().backward()
    return model.module.weight.grad.item()


def sum_then_divide(state, bucket):
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / dist.get_world_size())


def bucket_sizes_per_iteration(iterations=3):
    """Bytes of each bucket DDP hands a (recording, then allreduce_hook) comm hook, per
    backward(), for 8 Linear(256, 256) layers (about 2 MiB of float32 gradients)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]))
    seen = []

    def recording(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, recording)
    out = []
    for _ in range(iterations):
        seen.clear()
        model(torch.randn(4, 256)).sum().backward()
        out.append(list(seen))
    return out


def bucket_as_the_hook_sees_it(X, y):
    """A comm hook that records the bucket DDP hands it, then runs torch's allreduce_hook."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 10))
    seen = {}

    def recording(state, bucket):
        seen["bucket"] = bucket.buffer().clone()
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, recording)
    part = local_slice(len(X), world_size, rank)
    F.cross_entropy(model(X[part]), y[part]).backward()
    return seen["bucket"], torch.cat([p.grad.flatten() for p in model.parameters()])


# --- facts -------------------------------------------------------------------------------

def test_reduce_op_attribute_warns_on_every_call(group):
    for _ in range(2):  # ranks persist: the second call must still record it
        out = group.run(warnings_of, "reduce_op")
        for found in out:
            assert found == [("FutureWarning", "`torch.distributed.reduce_op` is deprecated, "
                              "please use `torch.distributed.ReduceOp` instead")]


def test_ddp_with_cross_entropy_or_summing_loss_does_not_warn(group):
    group.resize(2)
    assert group.run(warnings_of, "ce") == [[]] * 2
    assert group.run(warnings_of, "sum") == [[]] * 2


def test_the_default_hook_divides_before_the_all_reduce():
    """The source the notebook prints: the division comes first, for the stated reason."""
    src = inspect.getsource(default_hooks._allreduce_fut)
    assert "Apply the division first to avoid overflow, especially for FP16." in src
    assert src.index("tensor.div_(group_to_use.size())") < src.index("dist.all_reduce(")
    assert "_allreduce_fut(process_group, bucket.buffer())" in inspect.getsource(
        default_hooks.allreduce_hook)
    # the hook's docstring, which the notebook quotes, still says the mean comes after
    assert "callback takes the mean" in " ".join(default_hooks.allreduce_hook.__doc__.split())


def test_with_a_hook_the_bucket_arrives_undivided_and_leaves_averaged(group, batch):
    """The reducer leaves the division to a registered hook (Note [DDP Communication Hook])."""
    X, y = batch
    out = group.run(bucket_as_the_hook_sees_it, X, y)
    sizes = split_sizes(len(X), 4)
    local = [full_batch_gradient(X[r * sizes[0]:(r + 1) * sizes[0]], y[r * sizes[0]:(r + 1) * sizes[0]],
                                 "mean") for r in range(4)]
    for rank, (bucket, grad) in enumerate(out):
        # the bucket holds this rank's own gradient, in reverse parameter order (bias first)
        assert torch.allclose(bucket.sort().values, local[rank].sort().values, atol=1e-6)
        torch.testing.assert_close(grad, torch.stack(local).mean(0), rtol=1e-4, atol=1e-6)


def test_float16_dividing_first_does_not_overflow(group):
    assert group.run(both_orders) == [(float("inf"), 40000.0)] * 4


def test_ddp_itself_divides_first_in_float16(group):
    """Step 3's DDP run: with no hook (the reducer's C++ path) and with allreduce_hook the
    float16 gradient 40000 on 4 ranks stays 40000; a hook that sums first overflows."""
    assert group.run(ddp_float16_gradient) == [40000.0] * 4
    assert group.run(ddp_float16_gradient, default_hooks.allreduce_hook) == [40000.0] * 4
    assert group.run(ddp_float16_gradient, sum_then_divide) == [float("inf")] * 4


def sum_only(state, bucket):
    """A comm hook that all_reduces the bucket and divides by nothing."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def hooked_gradient(use_hook):
    """Rank r's local gradient is r + 1; DDP's gradient, with sum_only registered or no hook."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(1, 1, bias=False))
    if use_hook:
        model.register_comm_hook(None, sum_only)
    ((dist.get_rank() + 1.0) * model(torch.ones(1, 1))).sum().backward()
    return model.module.weight.grad.item()


def test_a_registered_hook_gets_the_gradients_undivided_and_must_divide_them_itself(group):
    """Step 3 (review 8): "A registered hook gets the gradients undivided, and must divide
    them itself." On 4 ranks with local gradients 1, 2, 3 and 4: no hook gives the mean,
    2.5; a hook that only sums gives the sum, 10, so nothing divided before the hook."""
    assert group.run(hooked_gradient, False) == [2.5] * 4
    assert group.run(hooked_gradient, True) == [10.0] * 4
    step = next(c for c in notebook_cells() if c.startswith("## Step 3: what DDP does with your gradients"))
    assert "A registered hook gets the gradients undivided, and must divide them itself." in step


def test_the_first_bucket_is_1_mib_by_default_once_buckets_are_rebuilt(group):
    """Step 3's sentence on bucket_cap_mb: 25 MiB, the first bucket 1 MiB (after DDP rebuilds
    its buckets in the 2nd iteration; the 1st has one bucket for all)."""
    from torch.nn.parallel.distributed import _BucketCapacityConfig
    config = _BucketCapacityConfig.create(None, None, False)
    assert config.bucket_bytes_cap == 25 * 2**20
    assert config.first_bucket_bytes_cap == dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    group.resize(2)
    first, second, third = group.run(bucket_sizes_per_iteration)[0]
    total = 8 * (256 * 256 + 256) * 4
    assert first == [total]                       # one bucket before the rebuild
    assert second == third and len(second) == 2 and sum(second) == total
    # the first bucket closes once it reaches 1 MiB (it may pass it by one tensor)
    assert 2**20 <= second[0] < 2**20 + (256 * 256) * 4


def test_the_hook_docstring_the_notebook_quotes():
    doc = " ".join(default_hooks.allreduce_hook.__doc__.split())
    assert "DDP results is expected to be same as the case where no hook was registered" in doc


@pytest.mark.parametrize("world_size", [1, 3, 4, 8])
def test_ddp_gradient_is_the_sum_of_local_gradients_over_world_size(group, batch, world_size):
    X, y = batch
    group.resize(world_size)
    for reduction in ("mean", "sum"):
        full = full_batch_gradient(X, y, reduction)
        for split in ("equal", "uneven"):
            outs = group.run(ddp_gradient, X, y, reduction, split)
            assert all(torch.equal(o, outs[0]) for o in outs)  # the same on every rank
            ref = reference_ddp_gradient(X, y, reduction, split_sizes(len(X), world_size, split))
            torch.testing.assert_close(outs[0], ref, rtol=1e-4, atol=1e-5)
            comparison = compare_gradients(outs[0], full)
            expected = expected_factor(reduction, world_size, split)
            if expected is None:
                assert not comparison.constant
                assert comparison.ratio_min < 0.9 and comparison.ratio_max > 1.1
            else:
                assert comparison.constant
                assert comparison.factor == pytest.approx(expected, rel=1e-4)
            if (reduction, split, world_size) == ("sum", "uneven", 8):  # question 2
                k = (outs[0] @ full / (full @ full)).item()
                assert round(k, 4) == 0.125


def test_no_sync_saves_all_reduces_and_keeps_the_gradient(group, batch):
    X, y = batch[0][:64], batch[1][:64]
    synced = group.run(accumulate, X, y, use_no_sync=False)
    skipped = group.run(accumulate, X, y, use_no_sync=True)
    backward_only = group.run(accumulate, X, y, use_no_sync=True, forward_inside=False)
    assert [n for n, _ in synced] == [4] * 4
    assert [n for n, _ in skipped] == [1] * 4
    assert [n for n, _ in backward_only] == [4] * 4      # question 3: no_sync acts at the forward
    full = full_batch_gradient(X, y, "mean")
    for _, g in synced + skipped + backward_only:
        torch.testing.assert_close(g, full, rtol=1e-4, atol=1e-6)


# --- explorer ------------------------------------------------------------------------------

def test_explorer_follows_controls_and_resizes_the_one_group(group, batch):
    X, y = batch
    e = GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y,
                               reduction="sum", world_size=4, split="equal")
    assert e.result.comparison.factor == pytest.approx(0.25, rel=1e-4) and e.result.agree
    assert bytes(e.image.value).startswith(PNG)
    assert "0.25 x the full-batch gradient" in e.message.value
    e.controls["world_size"].value = 2
    assert group.world_size == 2 and e.result.sizes == [420, 420]
    torch.testing.assert_close(e.result.ddp, full_batch_gradient(X, y, "sum") / 2,
                               rtol=1e-4, atol=1e-4)
    e.controls["reduction"].value = "mean"
    e.controls["split"].value = "uneven"
    assert e.result.sizes == [280, 560]
    assert not e.result.comparison.constant
    torch.testing.assert_close(e.result.ddp, reference_ddp_gradient(X, y, "mean", [280, 560]),
                               rtol=1e-4, atol=1e-6)
    assert "no single factor" in e.text()
    assert e.text().startswith("GradientFactorExplorer(reduction=mean, world_size=2, split=uneven)")


def test_explorer_extremes_run_on_the_one_group(group, batch):
    X, y = batch
    e = GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y,
                               reduction="sum", world_size=8, split="uneven")
    for reduction, world_size, split, factor in [
            ("sum", 8, "uneven", 0.125), ("mean", 8, "uneven", None), ("mean", 8, "equal", 1.0),
            ("mean", 1, "equal", 1.0), ("mean", 1, "uneven", 1.0)]:
        for name, value in (("reduction", reduction), ("world_size", world_size), ("split", split)):
            e.controls[name].value = value
        assert e.error is None and group.world_size == world_size  # no second, private group
        assert e.result.sizes == split_sizes(840, world_size, split)
        if factor is None:
            assert not e.result.comparison.constant
        else:
            assert e.result.comparison.factor == pytest.approx(factor, rel=1e-4)
        assert bytes(e.image.value).startswith(PNG)


def test_explorer_refuses_a_global_batch_it_cannot_split(group, batch):
    X, y = batch[0][:10], batch[1][:10]
    e = GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y,
                               reduction="mean", world_size=2, split="equal")
    figure = e.image.value
    e.controls["world_size"].value = 3
    assert e.result is None and "pick another world_size or split" in e.message.value
    assert "divisible" in e.text()
    assert e.image.value == NOTE_PNG != figure
    e.controls["world_size"].value = 5
    assert e.result is not None and e.result.sizes == [2] * 5


def test_explorer_rejects_bad_initial_values(group, batch):
    X, y = batch
    with pytest.raises(ValueError, match="reduction must be one of"):
        GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y, reduction="max")
    with pytest.raises(ValueError, match="split must be one of"):
        GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y, split="random")
    with pytest.raises(ValueError, match="world_size must be from 1 to 8"):
        GradientFactorExplorer(group, ddp_gradient, full_batch_gradient, X, y, world_size=9)
    with pytest.raises(TypeError, match="ddp_gradient"):
        GradientFactorExplorer(group, None, full_batch_gradient, X, y)


# --- exercise check ------------------------------------------------------------------------

def test_solution_passes_and_the_world_size_is_restored(group, batch):
    group.resize(2)
    v = check_ddp_loss(group, load_solution().ddp_loss, *batch)
    assert v, v.message
    assert "world_size 4 and 3" in v.message
    assert group.world_size == 2


def _scale(reduction, world_size):
    return world_size if reduction == "sum" else 1


def notebook_stub(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss + penalty


def scales_everything(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return (data_loss + penalty) * _scale(reduction, world_size)


def divides_the_penalty(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss * _scale(reduction, world_size) + penalty / world_size


def drops_the_penalty(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss * _scale(reduction, world_size)


def fixes_sum_only(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss * world_size + penalty


def hard_codes_four(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss * (4 if reduction == "sum" else 1) + penalty * (4 if penalty_in_parts else 1)


def parts_times_four(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss * _scale(reduction, world_size) + penalty * (4 if penalty_in_parts else 1)


def whole_penalty_times_four(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return (data_loss * _scale(reduction, world_size)
            + penalty * (world_size if penalty_in_parts else 4 if world_size == 3 else 1))


def ignores_the_parts(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss * _scale(reduction, world_size) + penalty


def scales_every_penalty(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss * _scale(reduction, world_size) + penalty * world_size


def scales_the_penalty_for_sum_only(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return data_loss + penalty * (world_size if reduction == "sum" else 1)


def parts_scaled_for_mean_only(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return (data_loss * _scale(reduction, world_size)
            + penalty * (world_size if penalty_in_parts and reduction == "mean" else 1))


def mean_scaled_for_four_ranks(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return (data_loss * (world_size if reduction == "sum" else world_size / 4)
            + penalty * (world_size if penalty_in_parts else 1))


def multiplies_the_terms(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return (data_loss * _scale(reduction, world_size)
            + penalty * (world_size if penalty_in_parts else 1) + data_loss * penalty)


def returns_a_number(data_loss, penalty, reduction, world_size, penalty_in_parts):
    return (data_loss + penalty).item()


def raises(*args):
    raise ZeroDivisionError("oops")


MISTAKES = [
    (notebook_stub, "reduction='sum', world_size=4, equal",
     "The data term's gradient came out 0.25 x one process's; expected 1 x. Why: DDP divides "
     "every rank's gradient by world_size=4 before it sums them"),
    (scales_everything, "reduction='sum', world_size=4, equal",
     "The penalty's gradient came out 4 x one process's; expected 1 x. That is the penalty "
     "scaled like the data term, by world_size=4."),
    (divides_the_penalty, "reduction='mean', world_size=4, equal",
     "The penalty's gradient came out 0.25 x one process's; expected 1 x. That is 1/4 of it, as "
     "if each rank divided the penalty by world_size=4, or one rank alone added it."),
    (drops_the_penalty, "reduction='mean', world_size=4, equal", "The penalty's gradient is missing"),
    (fixes_sum_only, "reduction='mean', world_size=4, equal",
     "The data term's gradient came out 4 x one process's; expected 1 x. Why: with 'mean' "
     "and equal local batches every rank's loss weighs each of its 210 samples 1/210"),
    (hard_codes_four, "reduction='sum', world_size=3, equal",
     "The data term's gradient came out 1.3333 x one process's; expected 1 x. That is a factor "
     "4 where world_size is 3: a number written into the loss does not follow the world size."),
    (parts_times_four, "reduction='mean', world_size=3, equal local batches [280, 280, 280] "
                       "(global batch 840), the penalty in parts",
     "The penalty's gradient came out 1.3333 x one process's; expected 1 x. That is a factor 4 "
     "where world_size is 3"),
    (whole_penalty_times_four, "reduction='mean', world_size=3, equal",
     "The penalty's gradient came out 4 x one process's; expected 1 x. That is a factor 4 "
     "where world_size is 3"),
    (returns_a_number, "reduction='mean', world_size=4, equal",
     "ddp_loss must return the loss to call backward() on"),
    (raises, "reduction='mean', world_size=4, equal", "ZeroDivisionError: oops"),
    (ignores_the_parts, "reduction='mean', world_size=4, equal local batches [210, 210, 210, 210] "
                        "(global batch 840), the penalty in parts",
     "The penalty's gradient came out 0.25 x one process's; expected 1 x. That is each rank's "
     "part left as it is."),
    (scales_every_penalty, "reduction='mean', world_size=4, equal local batches [210, 210, 210, "
                           "210] (global batch 840), the whole penalty on every rank",
     "The penalty's gradient came out 4 x one process's; expected 1 x. That is the penalty "
     "multiplied by world_size=4."),
    # the data term left as it is: a penalty multiplied by world_size is not "like" it
    (scales_the_penalty_for_sum_only, "reduction='sum', world_size=4, equal",
     "The data term's gradient came out 0.25 x one process's; expected 1 x. Why: DDP divides "
     "every rank's gradient by world_size=4 before it sums them, and the local sums already "
     "add up to the full-batch sum. The penalty's gradient came out 4 x one process's; expected "
     "1 x. That is the penalty multiplied by world_size=4."),
    (parts_scaled_for_mean_only, "reduction='sum', world_size=4, uneven local batches",
     "The penalty's gradient came out 0.25 x one process's; expected 1 x. That is each rank's "
     "part left as it is."),
    (mean_scaled_for_four_ranks, "reduction='mean', world_size=3, equal local batches [280, 280, "
                                 "280] (global batch 840)",
     "The data term's gradient came out 0.75 x one process's; expected 1 x. Why: with 'mean' and "
     "equal local batches every rank's loss weighs each of its 280 samples 1/280, DDP divides by "
     "world_size=3 before it sums, and one process weighs each of the 840 samples 1/840."),
    (multiplies_the_terms, "reduction='mean', world_size=4, equal",
     "DDP's gradient differs from one process's. Each part alone comes out right, but not the "
     "two together"),
]


@pytest.mark.parametrize("fn, case, says", MISTAKES, ids=[fn.__name__ for fn, _, _ in MISTAKES])
def test_each_likely_mistake_is_named(group, batch, fn, case, says):
    v = check_ddp_loss(group, fn, *batch)
    assert not v
    assert f"For {case}" in v.message, v.message
    assert says in v.message, v.message
    assert group.world_size == 4


def test_only_the_wrong_part_is_named(group, batch):
    """Scaling everything is right for the data term, so only the penalty is named; a
    missing scale on the data term leaves the penalty unnamed."""
    v = check_ddp_loss(group, scales_everything, *batch)
    assert "The data term" not in v.message
    v = check_ddp_loss(group, fixes_sum_only, *batch)
    assert "The data term" in v.message and "The penalty's gradient" not in v.message


def test_bad_input_is_refused(group, batch):
    assert not check_ddp_loss(group, "not a function", *batch)
    with pytest.raises(ValueError, match="divisible"):
        check_ddp_loss(group, raises, batch[0][:10], batch[1][:10])
    for bad in (1, 11):
        with pytest.raises(ValueError, match="must be from 2 .* to 10"):
            check_ddp_loss(group, raises, *batch, world_sizes=(bad,))
    with pytest.raises(ValueError, match="reduction must be one of"):
        full_gradients(*batch, "max")
    assert group.world_size == 4
    assert CHECK_WORLD_SIZES == (4, 3)             # a loss that hard-codes 4 ranks fails at 3


def test_the_penalty_s_parts_share_out_every_row_once_and_add_up_to_the_whole():
    """``penalty_in_parts``: rank r takes rows r, r + world_size, ... of the weight; every
    row goes to one rank, so the parts' penalties add up to the whole penalty."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    for world_size in range(2, 11):
        rows = [penalty_rows(r, world_size) for r in range(world_size)]
        assert sorted(sum(rows, [])) == list(range(10)), world_size
        parts = sum(_penalty(model, "mean", r) for r in rows)
        assert torch.allclose(parts, _penalty(model, "mean"), rtol=1e-6), world_size
    assert penalty_rows(1, 4) == [1, 5, 9] and penalty_rows(2, 3) == [2, 5, 8]
    with pytest.raises(ValueError, match="rank must be from 0 to world_size - 1 = 3"):
        penalty_rows(4, 4)


def test_the_penalty_matters_beside_either_reduction(batch):
    """The exercise's λ makes the penalty's gradient a sizeable part of each full-batch
    gradient, so a penalty off by world_size is far outside the check's tolerance."""
    for reduction in ("mean", "sum"):
        data, penalty = full_gradients(*batch, reduction)
        assert 0.05 < penalty.abs().max() / data.abs().max() < 20, reduction
        assert penalty[-10:].abs().max() == 0                   # no penalty on the bias
    assert PENALTY["sum"] == 840 * PENALTY["mean"] and len(batch[0]) == 840


def test_check_messages_never_print_the_solution(group, batch):
    solution = [line.split("#")[0].strip() for line in
                (conftest.SOLUTIONS / "04_ddp_loss.py").read_text().splitlines()
                if len(line.strip()) > 12 and not line.strip().startswith(("#", "def ", '"'))]
    for fn, _, _ in MISTAKES:
        message = check_ddp_loss(group, fn, *batch).message
        assert not [line for line in solution if line in message], fn.__name__


def test_the_exercise_cells_as_committed(group, batch):
    cells = json.loads((pathlib.Path(conftest.SOLUTIONS).parent / "04_ddp_gradients.ipynb").read_text())["cells"]
    src = ["".join(c["source"]) for c in cells]
    i = next(i for i, s in enumerate(src) if s.startswith("# %load solutions/04_ddp_loss.py"))
    namespace = {"__name__": "__main__"}
    exec(src[i], namespace)
    v = check_ddp_loss(group, namespace["ddp_loss"], *batch)
    shown = "".join(t for o in cells[i + 1]["outputs"] for t in o.get("data", {}).get("text/plain", []))
    assert not v and v.message in shown
    assert src[i + 1].strip() == "check_ddp_loss(group, ddp_loss, X, y)"
    for rule in ("λ·Σw²", "the same on every rank", "λ is 0.5", "840 times", "4 and then 3 ranks",
                 "Run the def cell, then the check", "1e-4 times the largest element"):
        assert rule in src[i - 1], rule
    assert TOLERANCE == 1e-4       # the tolerance the exercise text states


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
    assert "divides each rank's gradient by world_size=3" in explain("sum", 3, "equal", [1, 1, 1])
    with pytest.raises(ValueError, match="reduction must be one of"):
        expected_factor("avg", 2, "equal")


def test_sample_weights_explain_the_factors():
    assert sample_weights([84, 168, 252, 336], "mean").tolist() == pytest.approx([2.5, 1.25, 5 / 6, 0.625])
    assert sample_weights([210] * 4, "mean").tolist() == [1.0] * 4
    assert sample_weights([1, 5], "sum").tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="reduction"):
        sample_weights([1], "max")
    with pytest.raises(ValueError, match="positive"):
        sample_weights([0, 2], "mean")


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


def test_the_digits_read_from_scikit_learns_file_equal_its_loader(monkeypatch):
    """reducelab reads sklearn/datasets/data/digits.csv.gz itself (no SciPy import in the
    setup cell): the same pixels and labels as load_digits(), in the same order; where the
    file is not found it calls load_digits(). A fresh process shows that the read imports
    no part of scikit-learn."""
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits
    from reducelab import data
    want = load_digits()
    assert data._digits_file() is not None
    pixels, labels = data._digits()
    assert pixels.dtype == want.data.dtype and np.array_equal(pixels, want.data)
    assert labels.dtype == np.int64 and np.array_equal(labels, want.target)
    monkeypatch.setattr(data, "_digits_file", lambda: None)
    pixels, labels = data._digits()
    assert np.array_equal(pixels, want.data) and np.array_equal(labels, want.target)
    code = ("import sys; from reducelab.data import _digits; _digits(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr + out.stdout


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


def test_plots_return_png_and_refuse_bad_input():
    s = GradientScatter()
    assert s.draw([0.5, -1.0], [1.0, -2.0], 0.5, True, sizes=[3, 5], reduction="mean",
                  title="t").startswith(PNG)
    assert s.draw([0.5, -1.0], [1.0, -2.0], 0.5, True).startswith(PNG)  # no weight panel
    with pytest.raises(ValueError, match="same length"):
        s.draw([1.0], [1.0, 2.0], 1.0, True)
    assert loss_curves({"a": [2.0, 1.0], "b": [2.0, 1.5]}, reference="a").startswith(PNG)
    with pytest.raises(ValueError, match="reference must be one of"):
        loss_curves({"a": [1.0]}, reference="z")
    with pytest.raises(ValueError, match="empty"):
        loss_curves({})


def test_the_scatter_redrawn_shows_what_a_fresh_one_shows(monkeypatch):
    """The explorer redraws one GradientScatter on every move (its weight panel keeps
    its axes, removing only the last bars, labels, line and legend): each draw has the
    pixels of a new figure drawn with the same input, across world sizes, both
    reductions, gradients of other scales (longer tick labels, wider margins, after a
    draw that reused a cached layout), and the panel without local batch sizes, in and
    out of it. The new figure is laid out on its own (no cached layouts): a kept figure
    that kept stale margins also cached them, so a new one with that key drew the same
    wrong layout and the comparison held."""
    rng = np.random.default_rng(4)
    moves = [([8] * 4, "mean", 1), ([3, 9, 1, 7], "mean", 1), ([3, 9, 1, 7], "sum", 1000),
             (None, None, 1), ([2, 5], "mean", 1), ([2, 5], "mean", 1e-3),
             ([1, 2, 3, 4, 5, 6, 7, 8], "mean", 1), ([8] * 3, "sum", 1)]
    cached = {}
    monkeypatch.setattr(plots, "_LAYOUTS", cached)
    kept, reused = GradientScatter(), []
    for sizes, reduction, scale in moves:
        x = scale * rng.standard_normal(20)
        args = (1.5 * x, x, 1.5, True, sizes, reduction)
        shown = kept.draw(*args, title=f"{sizes}")
        reused.append(kept.fig._reducelab_layout_reused)
        monkeypatch.setattr(plots, "_LAYOUTS", {})
        assert shown == GradientScatter().draw(*args, title=f"{sizes}"), (sizes, reduction, scale)
        monkeypatch.setattr(plots, "_LAYOUTS", cached)
    assert reused.index(True) < moves.index(([2, 5], "mean", 1e-3))   # a reuse came before


def test_figures_fit_beside_the_controls_and_legends_cover_no_data(drawn):
    curves = {f"run {k}": [2.0 - 0.1 * k - 0.01 * s for s in range(50)] for k in range(6)}
    loss_curves(curves, reference="run 0")
    fig = drawn[-1]
    assert fig.get_figheight() <= 4.5 and fig.get_figwidth() <= plots.MAX_WIDTH
    legend = fig.legends[0]
    fig.canvas.draw()
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent())  # the legend is below the panels
    s = GradientScatter()
    s.draw([0.5, -1.0], [1.0, -2.0], 0.5, True, sizes=[3, 5], reduction="sum")
    assert drawn[-1].get_figheight() <= 4.5


@pytest.mark.parametrize("factor, constant, spread", [(1.011, False, 0.004), (0.25, True, 0.0),
                                                     (1.0, True, 0.0), (0.9, False, 0.008)])
def test_the_scatter_s_legend_covers_no_gradient_element(factor, constant, spread):
    """The legend sits in the upper-left corner, where gradient elements of positive
    ratio do not go; with the fit's label on one line ("y = 1.011 x, best fit: the points
    miss it") it reached right of x = 0 and covered elements near the diagonal (16 of
    them in 04's explorer at 2 ranks, mean, uneven). The label now takes two lines."""
    rng = np.random.default_rng(1)
    full = rng.normal(0, 0.03, 600)
    ddp = factor * full + rng.normal(0, spread, full.size)
    s = GradientScatter()
    s.draw(ddp, full, factor, constant, sizes=[280, 560], reduction="mean")
    box = s._legend.get_window_extent(s.fig.canvas.get_renderer())
    points = s.ax.transData.transform(np.column_stack([full, ddp]))
    inside = conftest.points_inside(box, points)
    assert not inside.any(), points[inside][:3]


@pytest.mark.parametrize("scale", [0.0093, 0.085, 0.093, 0.17, 0.93, 9.3, 93.0])
def test_the_scatter_s_tick_labels_stay_apart(scale):
    """At gradients up to about 0.1, matplotlib's ticks of 0.025 ran together on the
    x axis ("−0.100−0.075"); the scatter's x ticks step by 1, 2 or 5 times a power of
    ten, at most 9, and no two drawn tick labels come within 2 pixels."""
    full = np.linspace(-scale, scale, 50)
    s = GradientScatter()
    s.draw(full, full, 1.0, True, sizes=[4, 4], reduction="mean")
    renderer = s.fig.canvas.get_renderer()
    lo, hi = s.ax.get_xlim()
    boxes = sorted((t.get_window_extent(renderer) for t, x in
                    zip(s.ax.get_xticklabels(), s.ax.get_xticks()) if lo <= x <= hi),
                   key=lambda b: b.x0)
    assert 3 <= len(boxes) <= 9
    assert all(b.x0 - a.x1 >= 2 for a, b in zip(boxes, boxes[1:])), scale


# --- the notebook's text ------------------------------------------------------------------

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "04_ddp_gradients.ipynb"


def notebook_cells():
    return ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def test_step_3_describes_ddp_s_own_path_and_pins_its_sources():
    cells = notebook_cells()
    text = "\n".join(cells)
    assert "DDP's default hook is Python" not in text
    assert "(or in its default comm hook)" not in text
    assert "1 / div_factor_)" not in text  # a paraphrase must not pass for the source
    step3 = next(c for c in cells if c.startswith("## Step 3"))
    for name in ("25 MiB by default", "no communication hook registered",
                 "Divides while copying into the bucket view to save one scan"):
        assert name in step3, name
    # review 6 (04-5): the C++ names are in Further reading, not in the core's step 3
    reading = next(c for c in cells if c.startswith("## Further reading"))
    for name in ("Reducer::run_allreduce_hook()", "_AllReduceBySumCommHook",
                 "at::native::wrapped_scalar_tensor(1. / div_factor_)"):
        assert name in reading and name not in step3, name
    assert "1 MiB" in next(c for c in cells if c.startswith("More on buckets:"))
    links = re.findall(r"https://github\.com/pytorch/pytorch/blob/[^/\s)]+/", text)
    assert links and set(links) == {"https://github.com/pytorch/pytorch/blob/v2.13.0/"}
    ddp_run = next(i for i, c in enumerate(cells) if c.startswith("def ddp_float16_gradient"))
    assert "DDP(nn.Linear(1, 1, bias=False).half())" in cells[ddp_run]
    assert "40000.0" in cells[ddp_run + 1] and "not `inf`" in cells[ddp_run + 1]


def test_the_ddp_float16_cell_shows_40000_then_inf():
    nb = json.loads(NOTEBOOK.read_text())
    cell = next(c for c in nb["cells"] if "".join(c["source"]).startswith("def ddp_float16_gradient"))
    shown = "".join("".join(o.get("text", "")) for o in cell["outputs"])
    assert shown.splitlines() == [
        "DDP, no hook:                 [40000.0, 40000.0, 40000.0, 40000.0]",
        "DDP with allreduce_hook:      [40000.0, 40000.0, 40000.0, 40000.0]",
        "DDP with a sum-first hook:    [inf, inf, inf, inf]"]


def test_questions_2_and_3_are_asked_before_they_are_explained():
    cells = notebook_cells()
    q2 = next(i for i, c in enumerate(cells) if c.startswith("answer_2 = None"))
    table = next(i for i, c in enumerate(cells) if c.startswith("WORLD_SIZES = "))
    rows = next(i for i, c in enumerate(cells) if c.startswith("Read it row by row"))
    assert table < q2 < rows            # review 6 (04-2): the table shows "varies", not 2.5
    before = "\n".join(cells[:q2])
    for spoiler in ("1/W", "W n_r", "2.5", "1/336", "count more", "weighs more"):
        assert spoiler not in before, spoiler
    q3 = next(i for i, c in enumerate(cells) if c.startswith("answer_3 = None"))
    asked = cells[q3 - 1]
    assert "DDP offers `model.no_sync()` for gradient accumulation" in asked
    for mechanism in ("accumulate locally", "all_reduces the accumulated", "only accumulate",
                      "unless it runs inside"):
        assert mechanism not in asked, mechanism
    assert "accumulates locally" in WHY["04"][3]  # the mechanism is in the why
    assert "only `loss.backward()` inside `no_sync()`" in asked and WHY["04"][3].startswith("As many as without no_sync.")
    for mechanism in ("acts at the forward", "decides at the forward", "_post_forward"):
        assert mechanism not in "\n".join(cells[:q3]), mechanism


def _stored(cell):
    return "".join("".join(o.get("text", "")) for o in cell["outputs"])


def import_then_ddp_step():
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        hasattr(dist.reduce_op, "SUM")
        torch.manual_seed(0)
        model = DDP(nn.Linear(10, 5))
        torch.manual_seed(dist.get_rank())
        nn.CrossEntropyLoss()(model(torch.randn(4, 10)), torch.randint(0, 5, (4,))).backward()
        torch.optim.SGD(model.parameters(), lr=0.01).step()
    return [str(w.message) for w in records]


def test_question_1_follows_step_2_and_counts_a_library_s_read_plus_a_ddp_step(group):
    """Review 6 (04-1): question 1 before step 1 was a coin flip. It follows step 2 and
    asks for the reduce_op warnings of a library's hasattr at import plus one DDP step
    with CrossEntropyLoss: 1 per rank, the hasattr's; DDP adds none. Re-derived here and
    stored; nothing above it says DDP adds none, and the WHY opens with the reason."""
    group.resize(2)
    found = group.run(import_then_ddp_step)
    assert [sum("reduce_op" in m for m in w) for w in found] == [1, 1]
    assert all(len(w) == 1 for w in found)
    cells = notebook_cells()
    q1 = next(i for i, c in enumerate(cells) if c.startswith("answer_1 = None"))
    step2 = next(i for i, c in enumerate(cells) if "\n## Step 2" in c)
    step3 = next(i for i, c in enumerate(cells) if c.startswith("## Step 3"))
    assert step2 < q1 < step3
    asked = cells[q1 - 1].split("**Question 1.**")[1]
    assert "runs `somelib`'s line 3" in asked and "`nn.CrossEntropyLoss()`" in asked
    assert "How many `reduce_op` warnings does each rank record?" in asked
    above = "\n".join(cells[:q1 + 1])
    for spoiler in ("adds none", "does not warn", "DDP does not", "nothing in a DDP step"):
        assert spoiler not in above, spoiler
    nb = json.loads(NOTEBOOK.read_text())
    assert 'hasattr(dist.reduce_op, "SUM")' in cells[q1 + 1]
    shown = html.unescape("".join("".join(o["data"].get("text/html", ""))
                                  for o in nb["cells"][q1 + 1]["outputs"] if "data" in o))
    assert "The real run gives 1." in shown
    assert shown.count("1 warning(s), raised by ['has_sum = hasattr(dist.reduce_op") == 2, shown
    assert WHY["04"][1].startswith("somelib's feature check reads dist.reduce_op once")


def weight_of_each_sample(n, split):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    part = local_slice(n, world_size, rank, split)
    model = DDP(nn.Linear(n, 1, bias=False))
    model(torch.eye(n)[part]).mean().backward()
    return model.module.weight.grad.flatten()


def test_question_2_a_sample_on_rank_0_weighs_2_5_times_its_full_batch_weight(group):
    """Review 6 (04-2): question 2 (sum, 8 ranks, k = 1/8) repeated 03's question 2. It asks
    for the weight of a sample on rank 0 with mean and uneven local batches on 4 ranks:
    840 / (4 x 84) = 2.5. Re-derived from a run of the cell's one-weight-per-sample model,
    against the formula, and stored."""
    group.resize(4)
    k = group.run(weight_of_each_sample, 840, "uneven")[0] * 840
    sizes = split_sizes(840, 4, "uneven")
    assert sizes == [84, 168, 252, 336]
    firsts = [sum(sizes[:r]) for r in range(4)]
    assert [round(k[i].item(), 4) for i in firsts] == [2.5, 1.25, 0.8333, 0.625]
    assert sample_weights(sizes, "mean").tolist() == pytest.approx([k[i].item() for i in firsts])
    nb = json.loads(NOTEBOOK.read_text())
    cell = next(c for c in nb["cells"] if "".join(c["source"]).startswith("def weight_of_each_sample"))
    shown = html.unescape("".join("".join(o["data"].get("text/html", "")) for o in cell["outputs"]
                                  if "data" in o))
    assert "The real run gives 2.5." in shown and "[2.5, 1.25, 0.8333, 0.625]" in shown, shown
    assert WHY["04"][2].startswith("Each rank's mean divides by its own local batch")


def test_any_read_of_the_old_name_warns_and_the_stored_cell_says_so():
    """A review (12:20): not only a library using the old name; hasattr, docstrings and
    tools that walk an object (dir, inspect.getmembers) warn too. Run here and stored."""
    import inspect as inspect_module

    def warns(read):
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            read()
        return len(records) > 0
    assert warns(lambda: hasattr(dist.reduce_op, "SUM"))
    assert warns(lambda: dist.reduce_op.__doc__)
    assert warns(lambda: dir(dist.reduce_op))
    assert warns(lambda: isinstance(dist.reduce_op, int))
    assert not warns(lambda: dir(dist))
    assert not warns(lambda: inspect_module.getmembers(dist))
    assert warns(lambda: inspect_module.getmembers(dist, inspect_module.isfunction))
    assert not warns(lambda: dist.reduce_op is None)
    nb = json.loads(NOTEBOOK.read_text())
    cell = next(c for c in nb["cells"] if "".join(c["source"]).startswith("def warns(read)"))
    rows = _stored(cell).splitlines()
    assert [(r.split(" warns: ")[0].strip(), r.rsplit(" ", 1)[1]) for r in rows] == [
        ("hasattr(dist.reduce_op, 'SUM')", "True"), ("dist.reduce_op.__doc__", "True"),
        ("dir(dist.reduce_op)", "True"), ("isinstance(dist.reduce_op, int)", "True"),
        ("dir(dist)", "False"), ("inspect.getmembers(dist)", "False"),
        ("inspect.getmembers(dist, inspect.isfunction)", "True"),
        ("dist.reduce_op is None (no attribute)", "False")], rows


def test_step_1_says_which_walks_of_the_module_warn():
    """Review 8 (04-1): step 1 said "a tool that walks a module (`dir`, `inspect.getmembers`)
    warns", but dir(dist) and inspect.getmembers(dist) read no attribute of dist.reduce_op and
    do not warn (the test above runs both); a walk that tests each member does, because
    isinstance reads __class__ when the type does not match."""
    step = next(c for c in notebook_cells() if c.startswith("So the warning means"))
    assert "a tool that walks a module (`dir`, `inspect.getmembers`) warns" not in step
    assert "`inspect.getmembers(dist, inspect.isfunction)`" in step and "(`isinstance` reads `__class__`)" in step
    assert "listing the module, `dir(dist)`, does not" in step
    summary = next(c for c in notebook_cells() if c.startswith("## Summary"))
    assert "(`hasattr`, `isinstance` and `dir(dist.reduce_op)` too; `dir(dist)` does not warn)" in summary


def test_minus_w_error_turns_the_warning_into_a_traceback_that_names_the_reader(tmp_path):
    """The notebook's -W error::FutureWarning run: the traceback leads to the library's line,
    and ends in torch's own text."""
    import os
    import subprocess
    import sys
    (tmp_path / "somelib.py").write_text(
        'import torch.distributed as dist\n\nHAS_SUM = hasattr(dist.reduce_op, "SUM")\n')
    (tmp_path / "train.py").write_text("import somelib\n")
    env = {k: v for k, v in os.environ.items() if k != "FORCE_COLOR"}
    proc = subprocess.run([sys.executable, "-W", "error::FutureWarning", "train.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert re.search(r'somelib\.py", line 3', proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("FutureWarning: `torch.distributed.reduce_op` is deprecated, please use "
                    "`torch.distributed.ReduceOp` instead")
    nb = json.loads(NOTEBOOK.read_text())
    cell = next(c for c in nb["cells"] if '"-W", "error::FutureWarning"' in "".join(c["source"]))
    shown = _stored(cell)
    assert "frames in our files: ['train.py, line 1', 'somelib.py, line 3']" in shown
    assert last in shown
    assert "`python -W error::FutureWarning train.py`" in "\n".join(notebook_cells())


def test_step_3_keeps_the_division_and_the_three_reducer_functions_and_moves_the_rest():
    """A review (12:20): step 3 was overloaded. In step 3: divide by world_size, then sum,
    and the three reducer functions. The bucket rules and batched_grad_copy, once folded in
    it, are in an optional part after the lesson (review 5: the core ran past 45 min)."""
    cells = notebook_cells()
    step3 = next(c for c in cells if c.startswith("## Step 3"))
    assert "divided by `world_size` as it is copied" in step3
    reading = next(c for c in cells if c.startswith("## Further reading"))
    for name in ("Reducer::set_divide_factor()", "Reducer::mark_variable_ready_dense()",
                 "Reducer::run_allreduce_hook()"):                # review 6 (04-5)
        assert name in reading and name not in step3, name
    later = next(i for i, c in enumerate(cells) if c.startswith("More on buckets:"))
    assert optional_parts()[later] is not None
    for name in ("batched_grad_copy", "compute_bucket_size_limits", "first iteration",
                 "mark_bucket_ready", "_DEFAULT_FIRST_BUCKET_BYTES"):
        assert name in cells[later] and name not in step3, name


def test_an_optimizer_s_weight_decay_acts_in_step_after_the_all_reduce():
    """The exercise's line (a review, 12:20): weight_decay of SGD or AdamW is applied by
    optimizer.step(), with no gradient from the loss at all."""
    for opt_class in (torch.optim.SGD, torch.optim.AdamW):
        p = nn.Parameter(torch.ones(3))
        p.grad = torch.zeros(3)
        opt_class([p], lr=1.0, weight_decay=0.1).step()
        assert torch.allclose(p.detach(), torch.full((3,), 0.9))
    text = "\n".join(notebook_cells())
    assert "`weight_decay` in SGD or AdamW, needs none of this: `optimizer.step()` applies it " \
        "after DDP's all_reduce" in text


def test_myth_vs_reality_is_marked_optional_and_counted_in_the_header():
    """A review (12:20) timed 04 at about 55 min against 40; review 5 timed the core at
    50: the myths, the run of every read of the old name, DDP's own float16 run with the
    bucket rules, and the explorer are optional, after the exercise. Review 8 added three
    module walks to the run of every read of the old name: 13 min."""
    cells = notebook_cells()
    assert "· parts marked optional: about 13 min more, after the lesson*" in cells[0]
    parts = optional_parts()
    exercise = next(i for i, c in enumerate(cells) if c.startswith("# %load solutions/04_ddp_loss.py"))
    summary = next(i for i, c in enumerate(cells) if c.startswith("## Summary"))
    for start in ("## Myth vs reality (optional, after the lesson)\n",
                  "## Every read of the old name warns (optional, after the lesson)\n",
                  "## DDP's own float16 path, and its buckets (optional, after the lesson)\n",
                  "## Explore the factor (optional, after the lesson)\n"):
        i = next(i for i, c in enumerate(cells) if c.startswith(start))
        assert exercise < summary < i and parts[i] == i, start    # review 6: after the summary
    for name in ("def warns(read)", "def ddp_float16_gradient", "explorer = GradientFactorExplorer"):
        assert parts[next(i for i, c in enumerate(cells) if c.startswith(name))] is not None, name


def optional_parts() -> list:
    """For each cell, the index of the cell that starts the optional part it is in, or None
    (test_notebooks.parts, as study_minutes reads the marks)."""
    from test_notebooks import parts
    return parts(NOTEBOOK)


def test_dividing_first_underflows_in_float16_and_reducing_in_float32_does_not(group):
    """Review 5 (04-2): the text presented divide-first as free. A float16 gradient of 1.2e-7
    divided by 4 rounds to 0 before the sum; divided and summed in float32 it survives. Run
    here on 4 ranks, and stored."""
    def tiny_gradient():
        g = torch.tensor([1.2e-7], dtype=torch.float16)
        in_float16 = g / dist.get_world_size()
        dist.all_reduce(in_float16)
        in_float32 = g.float() / dist.get_world_size()
        dist.all_reduce(in_float32)
        return g.item(), in_float16.item(), in_float32.half().item()
    group.resize(4)
    for g, in_float16, in_float32 in group.run(tiny_gradient):
        assert in_float16 == 0.0 and in_float32 == g > 0
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    i = next(i for i, c in enumerate(cells) if "".join(c["source"]).startswith("def tiny_gradient"))
    assert _stored(cells[i]).strip() == (
        "the mean of four 1.19e-07: divide first in float16: 0     in float32: 1.19e-07")
    said = "".join(cells[i - 1]["source"])
    assert "rounds to 0" in said and "reduce in float32" in said
    assert "MixedPrecisionPolicy(reduce_dtype=torch.float32)" in said
    summary = next(c for c in notebook_cells() if c.startswith("## Summary"))
    assert "reduce in float32" in summary


def test_the_learning_rate_against_world_size_is_answered_with_its_source():
    """Review 5 (04-1): what to do with the learning rate when the global batch grows with
    world_size: the linear scaling rule, cited by its paper, in the core after the figure."""
    cells = notebook_cells()
    i = next(i for i, c in enumerate(cells) if c.startswith("**Reading the figure.**"))
    assert "linear scaling rule" in cells[i] and "arXiv:1706.02677" in cells[i]
    assert "Accurate, Large Minibatch SGD" in cells[i] and optional_parts()[i] is None
    assert "https://arxiv.org/abs/1706.02677" in next(c for c in cells if c.startswith("## Further reading"))


def test_the_exercise_s_parts_are_per_shard_terms_with_a_pointer():
    """Review 5 (04-3): the penalty "in parts" read as contrived; the exercise says where
    such per-shard terms come from (a rank holding a shard of the weight; notebook 14)."""
    cells = notebook_cells()
    i = next(i for i, c in enumerate(cells) if c.startswith("# %load solutions/04_ddp_loss.py"))
    assert "holds only a shard of the weight" in cells[i - 1] and "notebook 14" in cells[i - 1]


def test_the_gap_panel_says_where_an_exact_zero_is_drawn(drawn):
    loss_curves({"a": [2.0, 1.0, 0.5], "b": [2.0, 1.0, 0.6]}, reference="a")
    fig = drawn[-1]
    gap = fig.axes[1]
    assert gap.get_yscale() == "log"
    assert "exact 0 drawn at 1e-9" in gap.get_title(loc="left")
    ys = gap.get_lines()[0].get_ydata()
    assert ys[0] == ys[1] == GAP_FLOOR == 1e-9  # the two exact zeros


def test_the_summary_says_when_ddp_follows_one_process_step_for_step():
    """Review 6 (04-4): "step for step" holds up to rounding and only without
    batch-dependent layers; the summary says so and points to BatchNorm's notebook.
    Review 7 (04-5): nor with dropout, whose notebook is 17."""
    summary = next(c for c in notebook_cells() if c.startswith("## Summary"))
    line = next(l for l in summary.splitlines() if "step for step" in l)
    assert line.endswith("step for step, up to rounding, for a model without batch-dependent "
                         "layers (BatchNorm: notebook 13) or dropout (notebook 17: each rank draws "
                         "masks for its own samples, not the masks one process draws).")
    nb13 = NOTEBOOK.parent / "13_what_ddp_expects_of_a_model.ipynb"
    assert "BatchNorm" in nb13.read_text()
    nb17 = NOTEBOOK.parent / "17_randomness_across_ranks.ipynb"
    assert "dropout" in nb17.read_text().lower()


def test_review_7_question_3_quotes_no_sync_s_docstring_and_the_summary_names_dropout():
    """Review 7 (04-2): question 3 (only backward inside no_sync) needed a source fact. Step 5
    quotes no_sync's docstring, read here from the installed torch, without its "or else"
    clause, which would give the answer. (04-5) Step for step also needs no dropout. (04-4)
    The exercise says why a rank would compute only its part of the penalty."""
    from torch.nn.parallel import DistributedDataParallel
    doc = " ".join(DistributedDataParallel.no_sync.__doc__.split())
    assert "The forward pass should be included inside the context manager, or else gradients will still be synchronized." in doc
    cells = notebook_cells()
    q3 = next(i for i, c in enumerate(cells) if c.startswith("answer_3 = None"))
    asked = cells[q3 - 1]
    assert 'its docstring warns: "The forward pass should be included inside the context manager"' in asked
    assert "still be synchronized" not in "\n".join(cells[:q3 + 1])
    summary = next(c for c in cells if c.startswith("## Summary"))
    assert "or dropout (notebook 17: each rank draws masks for its own samples" in summary
    exercise = next(c for c in cells if "## Exercise: a penalty every rank computes whole" in c)
    assert "a shard of the weight, as under FSDP or tensor parallelism, computes the term of its part" in exercise
