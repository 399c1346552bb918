"""Tests of notebook 05 (syncing gradients by hand on a device mesh): the mesh explorer, the
exercise check, the figures, and the facts the notebook teaches, each measured on real gloo
ranks against a layout or gradient computed in one process."""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import conftest
from reducelab.checks.mesh import (check_mesh_sync, global_batch, local_batch, local_grads,
                                   reference_grads, tiny_model)
from reducelab.plots.mesh import MeshGrid, group_index, timeline_figure
from reducelab.widgets.mesh import MESH_SHAPES, MeshExplorer, expected_groups

PNG = b"\x89PNG\r\n\x1a\n"
MESH_3D = (2, 2, 1)  # (dp, tp, cp), as in the notebook


def load_solution():
    return conftest.load_solution("05_mesh_sync")




pytestmark = pytest.mark.usefixtures("keep_four_ranks")


# --- the notebook's rank functions -----------------------------------------------------------
def mesh_groups(dp, cp, dim):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    group_ = mesh[dim].get_group()
    x = torch.tensor([dist.get_rank()])
    dist.all_reduce(x, group=group_)
    return {"coord": mesh.get_coordinate(), "ranks": dist.get_process_group_ranks(group_),
            "sum": x.item()}


def sum_divide_vs_avg(n, dtype):
    g = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    g = g.to(getattr(torch, dtype))
    summed, averaged = g.clone(), g.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    summed = summed / dist.get_world_size()
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    return g, summed, averaged


def dp_cp_group(world):
    tp_major = world.mesh.permute(1, 0, 2)
    mine, _ = dist.new_subgroups_by_enumeration(tp_major.reshape(tp_major.shape[0], -1).tolist())
    return mine


def compare_flatten():
    from torch.distributed.device_mesh import init_device_mesh
    world = init_device_mesh("cpu", MESH_3D, mesh_dim_names=("dp", "tp", "cp"))
    private = world["dp", "cp"]._flatten(mesh_dim_name="dp_cp").get_group()
    return dist.get_process_group_ranks(private), dist.get_process_group_ranks(dp_cp_group(world))


def input_for(dp_index, cp_index):
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * dp_index + cp_index))


def tp_step(rows):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    world = init_device_mesh("cpu", MESH_3D, mesh_dim_names=("dp", "tp", "cp"))
    torch.manual_seed(0)
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(rows, 3), world["tp"], [Shard(0)]))
    dp_index, _, cp_index = world.get_coordinate()
    x = DTensor.from_local(input_for(dp_index, cp_index), world["tp"], [Replicate()])
    ((x @ weight.T) ** 2).sum().backward()
    return world, weight


def all_reduce_dtensor_directly():
    world, weight = tp_step(4)
    try:
        dist.all_reduce(weight.grad, group=dp_cp_group(world))
    except NotImplementedError as e:
        return str(e)
    return "worked"


def seed_dtensor_sync(rows):
    from torch.distributed.tensor import DTensor
    world, weight = tp_step(rows)
    sync_mesh = world["dp", "cp"]._flatten(mesh_dim_name="dp_cp")
    g = weight.grad
    local_grad = g.to_local()
    dist.all_reduce(local_grad, op=dist.ReduceOp.SUM, group=sync_mesh.get_group())
    aliased = torch.equal(g.to_local(), local_grad)
    local_grad = local_grad / sync_mesh.size()
    weight.grad = DTensor.from_local(local_grad, device_mesh=g.device_mesh, placements=g.placements)
    return aliased, weight.grad.full_tensor()


def public_dtensor_sync(rows):
    world, weight = tp_step(rows)
    dist.all_reduce(weight.grad.to_local(), op=dist.ReduceOp.AVG, group=dp_cp_group(world))
    return weight.grad.full_tensor()


def reference_grad(rows):
    torch.manual_seed(0)
    w = torch.randn(rows, 3)
    grads = []
    for dp_index in range(MESH_3D[0]):
        for cp_index in range(MESH_3D[2]):
            w_ = w.clone().requires_grad_()
            ((input_for(dp_index, cp_index) @ w_.T) ** 2).sum().backward()
            grads.append(w_.grad)
    return torch.stack(grads).mean(0)


def ddp_then_cp(sync_cp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = DDP(tiny_model(), process_group=mesh["dp"].get_group())
    x, y = local_batch(*mesh.get_coordinate(), 2, 2)
    F.mse_loss(model(x), y).backward()
    out = {}
    for name, p in model.named_parameters():
        if sync_cp:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=mesh["cp"].get_group())
        out[name.removeprefix("module.")] = p.grad.clone()
    return out


# wrong answers to the exercise
def no_sync(model, mesh):
    pass


def dp_only(model, mesh):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())


def cp_only(model, mesh):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=mesh["cp"].get_group())


def sum_only(model, mesh):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def reduce_a_copy(model, mesh):
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g, op=dist.ReduceOp.AVG)


def raises(model, mesh):
    raise ValueError("not written yet")


# --- the layout, in one process --------------------------------------------------------------
def test_expected_groups_row_major_layout():
    assert expected_groups(2, 2, "dp") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert expected_groups(2, 4, "cp")[5] == [4, 5, 6, 7]
    assert expected_groups(4, 2, "dp")[3] == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="dp, cp"):
        expected_groups(2, 2, "tp")
    with pytest.raises(ValueError, match="positive ints"):
        expected_groups(0, 2, "dp")


def test_group_index_numbers_groups_by_lowest_rank():
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    grid = group_index(coords, expected_groups(2, 2, "dp"))
    assert grid.tolist() == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="one coordinate and one group per rank"):
        group_index(coords, [[0]])


# --- step 1 and the explorer -----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 4), (2, 2), (4, 1)])
def test_real_mesh_groups_match_the_layout(group, shape):
    for dim in ("dp", "cp"):
        out = group.run(mesh_groups, *shape, dim)
        assert [sorted(o["ranks"]) for o in out] == expected_groups(*shape, dim)
        assert [o["sum"] for o in out] == [sum(g) for g in expected_groups(*shape, dim)]
        assert [tuple(o["coord"]) for o in out] == [divmod(r, shape[1]) for r in range(4)]


def test_explorer_draws_real_groups_and_resizes(group):
    ex = MeshExplorer(group, mesh_groups, shape=(2, 2), dim="dp")
    assert ex.result.groups == expected_groups(2, 2, "dp") and ex.result.sums_match
    assert ex.image.value[:8] == PNG
    assert ex.text() == ("MeshExplorer(shape=(2, 2), dim=dp)\n2 dp group(s) of 2 rank(s) on 4 ranks: "
                         "[0, 2] [1, 3]; each rank's all_reduce(SUM) of rank ids equals its "
                         "group's sum.")
    first = ex.image.value
    ex.controls["dim"].value = "cp"
    assert ex.result.groups == expected_groups(2, 2, "cp")
    assert ex.image.value != first
    ex.controls["shape"].value = (1, 4)
    assert group.world_size == 4 and ex.result.groups == expected_groups(1, 4, "cp")
    ex.controls["shape"].value = (2, 4)
    assert group.world_size == 8
    assert ex.result.groups == expected_groups(2, 4, "cp")
    assert ex.result.sums == [6, 6, 6, 6, 22, 22, 22, 22]
    assert "2 cp group(s) of 4 rank(s) on 8 ranks" in ex.message.value


def test_explorer_rejects_bad_initial_values(group):
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        MeshExplorer(group, mesh_groups, shape=(3, 3))
    with pytest.raises(ValueError, match="dp, cp"):
        MeshExplorer(group, mesh_groups, dim="tp")
    assert (2, 2) in MESH_SHAPES


# --- step 3: SUM then divide against AVG -----------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_avg_is_sum_then_divide_bit_for_bit_on_gloo(group, dtype):
    out = group.run(sum_divide_vs_avg, 100_000, dtype)
    for _, summed, averaged in out:
        assert torch.equal(summed, averaged)
        assert torch.equal(averaged, out[0][2])
    exact = torch.stack([o[0].double() for o in out]).mean(0)
    ulp = torch.finfo(getattr(torch, dtype)).eps * exact.abs().clamp(min=1)
    assert ((out[0][2].double() - exact).abs() <= 2 * ulp).all()
    assert not torch.equal(out[0][2].double(), exact)  # rounded, not exact


# --- step 5: the private call and the public stand-in ----------------------------------------
def test_flatten_is_private_and_new_subgroups_gives_the_same_ranks(group):
    from torch.distributed.device_mesh import DeviceMesh
    assert hasattr(DeviceMesh, "_flatten") and not hasattr(DeviceMesh, "flatten")
    out = group.run(compare_flatten)
    assert out == [([0, 2], [0, 2]), ([1, 3], [1, 3]), ([0, 2], [0, 2]), ([1, 3], [1, 3])]


# --- step 6: DTensor gradients -----------------------------------------------------------------
def test_all_reduce_refuses_a_dtensor(group):
    assert all("sharding strategy" in m for m in group.run(all_reduce_dtensor_directly))


def test_seed_dtensor_pattern_works_for_even_shards_and_to_local_aliases(group):
    want = reference_grad(4)
    for aliased, full in group.run(seed_dtensor_sync, 4):
        assert aliased
        torch.testing.assert_close(full, want, atol=1e-6, rtol=1e-5)


def test_seed_dtensor_pattern_fails_for_uneven_shards(group):
    from reducelab import RankError
    with pytest.raises(RankError) as info:
        group.run(seed_dtensor_sync, 5)
    assert "size '[6, 3]'" in str(info.value) and "'[5, 3]'" in str(info.value)


def test_in_place_avg_on_to_local_works_for_uneven_shards(group):
    for full in group.run(public_dtensor_sync, 5):
        torch.testing.assert_close(full, reference_grad(5), atol=1e-6, rtol=1e-5)


# --- myth vs reality: DDP over dp, manual sync over cp ------------------------------------------
def test_ddp_over_dp_needs_the_manual_cp_sync(group):
    ref = reference_grads()
    for got in group.run(ddp_then_cp, True):
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)
    unsynced = group.run(ddp_then_cp, False)
    assert max((unsynced[0][k] - v).abs().max().item() for k, v in ref.items()) > 1e-2


# --- the exercise check ------------------------------------------------------------------------
def test_exercise_data_mean_of_local_grads_is_the_reference():
    ref = reference_grads()
    for dp, cp in [(2, 2), (1, 4), (4, 1)]:
        grads = [local_grads(i, j, dp, cp) for i in range(dp) for j in range(cp)]
        for k, v in ref.items():
            torch.testing.assert_close(torch.stack([g[k] for g in grads]).mean(0), v,
                                       atol=1e-6, rtol=1e-5)
    x, _ = local_batch(1, 1, 2, 2)
    assert x.shape == (8, 4)
    torch.testing.assert_close(x, global_batch()[0][2:4, 4:8].reshape(-1, 4))
    with pytest.raises(ValueError, match="dp must divide"):
        local_batch(0, 0, 3, 1)
    with pytest.raises(ValueError, match="outside"):
        local_batch(2, 0, 2, 2)


def test_solution_passes(group):
    verdict = check_mesh_sync(group, load_solution().sync_grads)
    assert verdict, verdict.message
    assert "(2, 2), (1, 4), (4, 1)" in verdict.message


@pytest.mark.parametrize("fn, says", [
    (no_sync, "own local gradients"),
    (reduce_a_copy, "own local gradients"),
    (dp_only, "mean over the dp group only"),
    (cp_only, "mean over the cp group only"),
    (sum_only, "SUM over all 4 ranks"),
    (raises, "raised on the ranks"),
])
def test_wrong_answers_fail_with_an_explanation(group, fn, says):
    verdict = check_mesh_sync(group, fn)
    assert not verdict
    assert says in verdict.message
    if fn is not raises:
        assert "Expected every rank to hold the mean over all 4 ranks" in verdict.message


# --- figures -----------------------------------------------------------------------------------
def test_timeline_figure_and_its_errors():
    runs = {"blocking": [[("all_reduce 0", 0.0, 0.01), ("compute", 0.01, 0.03)]] * 2,
            "async": [[("all_reduce 0", 0.0, 0.02), ("compute", 0.0, 0.02), ("wait", 0.02, 0.021)]] * 2}
    assert timeline_figure(runs)[:8] == PNG
    with pytest.raises(ValueError, match="runs is empty"):
        timeline_figure({})
    with pytest.raises(ValueError, match="compute, wait or all_reduce"):
        timeline_figure({"x": [[("sleep", 0.0, 1.0)]]})


def test_mesh_grid_rejects_bad_shapes():
    grid = MeshGrid()
    assert grid.draw(np.zeros((2, 2), int), [["a", "b"], ["c", "d"]])[:8] == PNG
    with pytest.raises(ValueError, match="labels"):
        grid.draw(np.zeros((2, 2), int), [["a"]])
