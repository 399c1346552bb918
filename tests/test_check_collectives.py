"""The exercise checks watch one list of torch.distributed's collectives
(:data:`reducelab.checks.COLLECTIVES`): a name torch adds, or a new spelling of an old
call (torch 2.13's ``all_gather_single`` and ``reduce_scatter_single``), reaches every
check at once instead of the one someone remembered to edit."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from reducelab.checks import (COLLECTIVES, OBJECT_COLLECTIVES, POINT_TO_POINT, TENSOR_COLLECTIVES,
                              collectives_except)
from reducelab.checks import all_reduce, reduce, ring, sharded

NOT_DATA = {
    # set up, tear down or describe a process group; move no data between ranks
    "init_process_group", "destroy_process_group", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "split_group", "shrink_group", "get_backend",
    "get_backend_config", "get_debug_level", "get_default_backend_for_device",
    "get_global_rank", "get_group_rank", "get_node_local_rank", "get_pg_count",
    "get_process_group_ranks", "get_rank", "get_world_size", "is_backend_available",
    "is_gloo_available", "is_initialized", "is_mpi_available", "is_nccl_available",
    "is_torchelastic_launched", "is_ucc_available", "is_xccl_available", "supports_complex",
    "record_comm",
    # synchronise without data: a check has no reason to forbid or count them
    "barrier", "monitored_barrier",
}


def test_every_name_is_a_function_of_torch_distributed_once():
    assert len(set(COLLECTIVES)) == len(COLLECTIVES)
    assert COLLECTIVES == TENSOR_COLLECTIVES + OBJECT_COLLECTIVES + POINT_TO_POINT
    for name in COLLECTIVES:
        assert inspect.isfunction(getattr(dist, name)), name


def test_every_function_of_torch_s_list_is_a_collective_or_named_as_moving_no_data():
    with warnings.catch_warnings():          # reading reduce_op warns that it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        functions = {name for name in c10d.__all__
                     if inspect.isfunction(getattr(c10d, name, None))}
    unsorted = functions - set(COLLECTIVES) - NOT_DATA
    assert not unsorted, (f"torch.distributed has functions the checks do not know: "
                          f"{sorted(unsorted)}; add each to reducelab.checks' lists or to NOT_DATA")


@pytest.mark.parametrize("watched, own", [
    (all_reduce.OTHER_COLLECTIVES, {"all_reduce"}),
    (reduce.FORBIDDEN, {"reduce"}),
    (ring._COLLECTIVES, {"send", "recv", "isend", "irecv", "batch_isend_irecv"}),
    (sharded.RECORDED, set()),
])
def test_each_check_watches_every_collective_but_the_ones_its_exercise_is_built_on(watched, own):
    assert set(watched) == set(COLLECTIVES) - own


def test_a_misspelt_exception_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="not collectives of torch.distributed: all_reduse; "
                                         "valid: all_reduce, "):
        collectives_except("all_reduce", "all_reduse")
