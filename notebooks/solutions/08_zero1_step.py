# Solution to notebook 08, exercise: one step of DDP + ZeroRedundancyOptimizer on this rank,
# each parameter tensor owned whole by one rank.
import torch.distributed as dist


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
