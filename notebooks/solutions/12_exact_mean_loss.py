# Solution to notebook 12, exercise: the exact mean loss over a data set, from the shares of
# a padded, shuffled DistributedSampler, each sample counted once.
import torch
import torch.distributed as dist


def exact_mean_loss(losses, indices, dataset_size):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The sampler padded its shuffled list of dataset_size indices to a multiple of
    # world_size and gave this rank the positions rank, rank + world_size, ...: the k-th
    # index here sits at position k * world_size + rank of that list. The positions from
    # dataset_size on hold the repeats, whichever samples they are this epoch.
    positions = torch.arange(len(indices)) * world_size + rank
    kept = positions < dataset_size
    totals = torch.stack([losses[kept].sum(), kept.sum().to(losses.dtype)])
    dist.all_reduce(totals)                        # over ranks: the sum of the losses, the count
    return (totals[0] / totals[1]).item()
