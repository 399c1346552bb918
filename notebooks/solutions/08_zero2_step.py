# Solution to notebook 08, exercise: one ZeRO-2 step on this rank, when the number of
# parameters does not divide by world_size.
import torch
import torch.distributed as dist
import torch.nn.functional as F


def zero2_step(flat_params, flat_grad, my_shard, optimizer):
    world_size = dist.get_world_size()
    k = my_shard.numel()                          # ceil(numel / world_size): shards are equal
    # 1. padding: zeros at the end make the gradient world_size * k long, so that piece r
    #    of the reduce_scatter is elements r*k .. r*k + k - 1, rank r's shard
    padded_grad = F.pad(flat_grad, (0, world_size * k - flat_grad.numel()))
    # 2. the bare step: the mean gradient of this rank's shard, then Adam on the shard
    grad_shard = torch.empty(k)
    dist.reduce_scatter_single(grad_shard, padded_grad, op=dist.ReduceOp.AVG)
    my_shard.grad = grad_shard
    optimizer.step()
    # 3. every rank's updated shard, into a padded buffer; the padding stays out of the
    #    parameters, and flat_params is written in place (the caller holds that tensor)
    gathered = torch.empty(world_size * k)
    dist.all_gather_single(gathered, my_shard.detach())
    flat_params.copy_(gathered[:flat_params.numel()])
