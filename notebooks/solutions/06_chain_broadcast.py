# Solution to notebook 06, exercise: broadcast along a chain, piece by piece.
import torch.distributed as dist


def chain_broadcast(x, src, pieces):
    rank, n = dist.get_rank(), dist.get_world_size()
    place = (rank - src) % n                  # 0 for src, n - 1 for the last rank of the chain
    for piece in x.tensor_split(pieces):      # views into x: recv writes into x itself
        if place > 0:
            dist.recv(piece, src=(rank - 1) % n)
        if place < n - 1:
            # A blocking send is safe here: the right neighbour's next call is the matching
            # recv, and the chain ends before src, so no rank waits on one behind it.
            dist.send(piece, dst=(rank + 1) % n)
