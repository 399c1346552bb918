def predict_all_reduce_seconds(sizes_bytes, alpha, beta, world_size):
    """Seconds to all_reduce one float32 tensor of each size, one after the other."""
    factor = 2 * (world_size - 1) / world_size      # bytes each rank sends per byte of tensor
    return sum(alpha + beta * factor * size for size in sizes_bytes)
