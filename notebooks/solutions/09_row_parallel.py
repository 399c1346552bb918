# Solution to notebook 09, exercise: the forward of a row-parallel linear layer.
# Megatron-LM's g (all_reduce in forward, identity in backward), then the bias once.
import torch
import torch.distributed as dist


class G(torch.autograd.Function):
    """Megatron-LM's g: all_reduce (SUM) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()                # all_reduce writes in place
        dist.all_reduce(total, group=group)    # SUM of every rank's partial output
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None                      # every rank already holds the full gradient


def row_parallel_linear(h_shard, weight_shard, bias):
    partial = h_shard @ weight_shard.T         # (batch, out): this rank's share of the sum
    return G.apply(partial, None) + bias       # the sum over ranks, then the bias, once
