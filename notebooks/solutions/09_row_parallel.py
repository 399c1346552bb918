# Solution to notebook 09, exercise: the forward of a row-parallel linear layer.
# It uses G from step 2 of the notebook (Megatron-LM's g: all_reduce in forward, identity
# in backward), so the cells and the explorer above still record g's collective.


def row_parallel_linear(h_shard, weight_shard, bias):
    partial = h_shard @ weight_shard.T         # (batch, out): this rank's share of the sum
    return G.apply(partial, None) + bias       # g sums the shares; then the bias, once
