# Solution to notebook 08, exercise: one ZeRO-2 step on this rank.
import torch
import torch.distributed as dist
import torch.nn.functional as F


def zero2_step(flat_params, flat_grad, my_shard, optimizer):
    world_size = dist.get_world_size()
    k = my_shard.numel()                          # ceil(numel / world_size): shards are equal
    padding = world_size * k - flat_grad.numel()  # zeros at the end make the sizes divide
    # 1. reduce_scatter: this rank keeps the sum of its k elements, over every rank...
    grad_shard = torch.empty(k)
    dist.reduce_scatter_single(grad_shard, F.pad(flat_grad, (0, padding)))
    my_shard.grad = grad_shard / world_size       # ...and the mean is the sum / world_size
    # 2. step the local shard: Adam's state covers these k elements only
    optimizer.step()
    # 3. all_gather the updated shards; every rank writes all of them into flat_params
    gathered = torch.empty(world_size * k)
    dist.all_gather_single(gathered, my_shard.detach())
    flat_params.copy_(gathered[:flat_params.numel()])
