# Solution to notebook 06, exercise: all_gather built from the ring's all-gather phase.
import torch
import torch.distributed as dist


def send_recv(send_chunk, recv_buf):
    """One ring step: send to rank + 1, receive from rank - 1. Returns the bytes sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    request = dist.isend(send_chunk, dst=(rank + 1) % n)
    dist.recv(recv_buf, src=(rank - 1) % n)
    request.wait()
    return send_chunk.numel() * send_chunk.element_size()


def ring_all_gather(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(n * x.numel(), dtype=x.dtype)
    slices = out.tensor_split(n)          # N views into out
    slices[rank].copy_(x)                 # our own slice
    for step in range(n - 1):
        # pass on the slice that arrived in the previous step (our own at step 0),
        # and receive the left neighbour's into the slice of the rank it came from
        s, r = (rank - step) % n, (rank - step - 1) % n
        send_recv(slices[s], slices[r])
    return out
