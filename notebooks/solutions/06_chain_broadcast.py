# Solution to notebook 06, exercise: broadcast along a chain, piece by piece.
import torch.distributed as dist


def chain_broadcast(x, src, pieces):
    rank, n = dist.get_rank(), dist.get_world_size()
    place = (rank - src) % n                  # 0 for src, n - 1 for the last rank of the chain
    parts = x.tensor_split(pieces)            # views into x: a receive writes into x itself
    # On gloo a send returns only once the receiver has posted its receive (step 1), so
    # post the receive of the next piece before forwarding this one: then the left
    # neighbour can send piece j + 1 while this rank still forwards piece j.
    incoming = dist.irecv(parts[0], src=(rank - 1) % n) if place > 0 else None
    for j, piece in enumerate(parts):
        if incoming is not None:
            incoming.wait()                   # piece j has arrived
            incoming = dist.irecv(parts[j + 1], src=(rank - 1) % n) if j + 1 < pieces else None
        if place < n - 1:
            # A blocking send is safe here: the right neighbour has posted (or will post)
            # the matching receive, and the chain ends before src, so nothing waits in a cycle.
            dist.send(piece, dst=(rank + 1) % n)
