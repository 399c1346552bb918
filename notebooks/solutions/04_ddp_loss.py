# Solution to notebook 04, exercise: a penalty every rank computes whole, or only its part of.


def ddp_loss(data_loss, penalty, reduction, world_size, penalty_in_parts):
    """The loss each rank calls backward() on, so that DDP's gradient equals one process's
    gradient of the full-batch data loss plus the whole penalty: for "sum" with any local
    batch sizes, and for "mean" with equal ones (the cases the check runs)."""
    if reduction == "sum":
        # the local sums already add up to the full-batch sum; undo DDP's division by world_size
        data_loss = data_loss * world_size
    # "mean" over equal local batches: each rank weighs a sample 1/local_batch, and DDP's
    # average over world_size ranks makes that 1/global_batch, as in one process.
    if penalty_in_parts:
        # the parts differ from rank to rank and add up to the whole penalty, as the local
        # sums of a "sum" loss do: DDP divides each by world_size, so undo that
        penalty = penalty * world_size
    # A whole penalty is the same on every rank, so is its gradient, and DDP's average of
    # world_size equal gradients is that gradient: it needs no scale.
    return data_loss + penalty
