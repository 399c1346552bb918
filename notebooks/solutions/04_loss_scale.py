def loss_scale(reduction, world_size, local_batch, global_batch):
    """Factor to multiply this rank's local loss by, so that DDP's gradient equals the
    single-process full-batch gradient with the same loss reduction."""
    if reduction == "sum":
        # the local sums already add up to the full-batch sum; undo DDP's division by world_size
        return float(world_size)
    # "mean": DDP gives (1/world_size) * (1/local_batch) per sample; we want 1/global_batch
    return world_size * local_batch / global_batch
