# Solution to notebook 17, exercise: the two dropout seeds of one rank of a (dp, tp) mesh.


def dropout_seeds(base_seed, mesh):
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    dp_size, tp_size = mesh["dp"].size(), mesh["tp"].size()
    # 1. replicated: it depends on dp_rank only, so every rank of a tp group gets the same
    #    seed, and the dp ranks get base_seed .. base_seed + dp_size - 1
    replicated_seed = base_seed + dp_rank
    # 2. sharded: one of its own for every rank of the mesh (its index in the mesh), placed
    #    after the last replicated seed, so that no seed serves both kinds of activation
    sharded_seed = base_seed + dp_size + dp_rank * tp_size + tp_rank
    # 3. nothing but base_seed and the mesh: a rerun draws the same masks
    return replicated_seed, sharded_seed
