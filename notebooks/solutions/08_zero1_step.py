# Solution to notebook 08, exercise: one step of DDP + ZeroRedundancyOptimizer on this rank,
# each parameter tensor owned whole by one rank.
import torch.distributed as dist

# 0. the owners of 0.weight (2,048 elements), 0.bias (32), 2.weight (320) and 2.bias (10):
#    largest first, each to the rank holding the fewest elements so far.
#    2 ranks: 0.weight -> 0; 2.weight -> 1 (0 < 2,048); 0.bias -> 1 (320 < 2,048); 2.bias -> 1.
#    5 ranks: 0.weight -> 0, 2.weight -> 1, 0.bias -> 2, 2.bias -> 3; rank 4 owns nothing.
owners_ws2 = [0, 1, 1, 1]
owners_ws5 = [0, 2, 1, 3]


def zero1_step(params, optimizer):
    world_size = dist.get_world_size()
    # 1. the owners, by the rule of ZeroRedundancyOptimizer._partition_parameters: largest
    #    first, each to the rank holding the fewest elements so far (the lowest such rank).
    #    Every rank computes the same list, from sizes alone.
    owner, held = [None] * len(params), [0] * world_size
    for i in sorted(range(len(params)), key=lambda i: params[i].numel(), reverse=True):
        owner[i] = held.index(min(held))
        held[owner[i]] += params[i].numel()
    # 2. DDP's part: every gradient averaged over the ranks
    for p in params:
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    # 3. this rank's optimizer holds only the parameters it owns (none on a rank that owns none)
    optimizer.step()
    # 4. _sync_params: every parameter from its owner to every rank, written into the
    #    parameter itself (.data: the same storage, outside autograd)
    for p, src in zip(params, owner):
        dist.broadcast(p.data, src=src)
