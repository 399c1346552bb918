def ddp_buckets(param_bytes, bucket_cap_mb=None):
    """Sizes in bytes of the buckets DDP all-reduces, bucket 0 first, once it has rebuilt them."""
    mib = 1024 * 1024                                       # bucket_cap_mb counts MiB
    cap = (25 if bucket_cap_mb is None else bucket_cap_mb) * mib
    first_cap = 1 * mib if bucket_cap_mb is None else cap   # the default's smaller first bucket
    buckets, size, limit = [], 0, first_cap
    for nbytes in reversed(param_bytes):                    # the order the gradients become ready
        size += nbytes
        if size >= limit:                                   # closes once it reaches its cap
            buckets.append(size)
            size, limit = 0, cap
    if size:
        buckets.append(size)
    return buckets
