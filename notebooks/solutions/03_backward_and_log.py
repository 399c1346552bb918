# Solution to notebook 03, exercise: the loss to call backward() on under DDP when local
# batch sizes differ, and the global mean loss to log, with one all_reduce.
import torch
import torch.distributed as dist
import torch.nn.functional as F


def backward_and_log(model, x, y):
    """One DDP step's backward() and the loss to log, on every rank.

    model: the DDP-wrapped nn.Linear(3, 1); x: float32 (n, 3), y: float32 (n, 1), n this
    rank's local batch size (possibly 0). Returns the global mean loss, a one-element tensor.
    """
    local_sum = F.mse_loss(model(x), y, reduction="sum")   # 0, with a graph, when n is 0
    # the global sum and the global count in one collective; detached: they are for the
    # log and the count, and backward() must not go through the all_reduce
    stats = torch.stack([local_sum.detach(), torch.tensor(float(len(x)))])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    global_sum, global_count = stats
    # DDP divides each rank's gradient by world_size; the factor world_size makes up for it.
    # Every rank calls backward(), an empty one too: DDP's all_reduce needs all of them.
    (local_sum * dist.get_world_size() / global_count).backward()
    return global_sum / global_count
