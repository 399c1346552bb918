# Solution to notebook 03, exercise: the global mean loss with uneven local batch sizes.
import torch
import torch.distributed as dist


def global_mean_loss(per_sample_losses):
    """The mean loss over the global batch, on every rank.

    per_sample_losses: this rank's 1-D float tensor, one loss per sample of the local batch.
    """
    # all-reduce the local sum and the local count together: one collective, not two
    stats = torch.stack([per_sample_losses.sum(),
                         torch.tensor(float(per_sample_losses.numel()))])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    total, count = stats
    return total / count  # also right when a rank's local batch is empty (sum 0, count 0)
