# Solution to notebook 01, exercise: the mean and the spread over ranks, with ReduceOp.SUM only.
import torch.distributed as dist

from reducelab.checks.all_reduce import local_values


def spread_over_ranks(n):
    x = local_values(dist.get_rank(), n)
    world_size = dist.get_world_size()
    total = x.clone()                             # all_reduce writes in place: keep x as it is
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    mean = total / world_size                     # the same mean on every rank
    squares = (x - mean) ** 2                     # this rank's squared distance from the mean
    dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    return mean, (squares / world_size).sqrt()    # population std: divide by world_size
