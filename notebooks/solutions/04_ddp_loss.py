# Solution to notebook 04, exercise: a loss with a term every rank computes alike.


def ddp_loss(data_loss, penalty, reduction, world_size):
    """The loss each rank calls backward() on, so that DDP's gradient equals one process's
    gradient of the full-batch data loss plus the penalty: for "sum" with any local batch
    sizes, and for "mean" with equal ones (the cases the check runs)."""
    if reduction == "sum":
        # the local sums already add up to the full-batch sum; undo DDP's division by world_size
        data_loss = data_loss * world_size
    # "mean" over equal local batches: each rank weighs a sample 1/local_batch, and DDP's
    # average over world_size ranks makes that 1/global_batch, as in one process.
    # The penalty is the same on every rank, so is its gradient, and DDP's average of
    # world_size equal gradients is that gradient: it needs no scale.
    return data_loss + penalty
