import math


def recursive_doubling_seconds(size_bytes, world_size, alpha, beta):
    """α-β model of recursive_doubling_all_reduce: seconds for S = size_bytes on world_size ranks."""
    rounds = math.log2(world_size)          # the partner's distance doubles: 1, 2, 4, ..., n/2
    return rounds * (alpha + beta * size_bytes)   # each round: one message of the whole tensor
