# Solution to notebook 15, exercise: after FSDP2 has averaged the gradients over dp, average
# them over cp too, on a 2 x 2 (dp, cp) mesh.
import torch.distributed as dist


def cp_sync(model, mesh):
    # FSDP2's reduce-scatter over dp left each rank its dp shard's rows, averaged over the dp
    # ranks of its cp index. The cp ranks of one dp index hold the same rows, for different
    # samples (different tokens, in real context parallelism): average over them only.
    cp_group = mesh.get_group("cp")
    for p in model.parameters():
        local = p.grad.to_local()        # a view of this rank's rows of the DTensor gradient
        dist.all_reduce(local, op=dist.ReduceOp.AVG, group=cp_group)   # in place
