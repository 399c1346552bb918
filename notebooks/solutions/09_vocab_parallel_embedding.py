# Solution to notebook 09, exercise: an embedding whose table is split by rows (token ids).
# An embedding lookup is one_hot(ids) @ table: a row-parallel layer. Each rank contributes
# the rows it holds and zeros for every other token; G from step 2 sums the ranks' shares.


def vocab_parallel_embedding(ids, weight_shard):
    rows = weight_shard.shape[0]
    first = dist.get_rank() * rows                        # the first token id this rank holds
    mine = (ids >= first) & (ids < first + rows)           # the tokens whose row is here
    local = torch.where(mine, ids - first, 0)              # any valid row for the others...
    share = torch.nn.functional.embedding(local, weight_shard) * mine.unsqueeze(-1)   # ...zeroed
    return G.apply(share, None)                            # each token's row, from its one rank
