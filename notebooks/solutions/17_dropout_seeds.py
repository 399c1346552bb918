# Solution to notebook 17, exercise: a seed for each dropout draw of a tensor-parallel layer,
# on one rank of a (dp, tp) mesh.


def dropout_seeds(base_seed, mesh):
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    dp_size, tp_size = mesh["dp"].size(), mesh["tp"].size()
    # whole activations (every tp rank holds a copy): the seed depends on dp_rank only, so a
    # tp group draws one mask and the dp groups draw others; each draw a block of its own
    attention_output = base_seed + dp_rank
    mlp_output = base_seed + dp_size + dp_rank
    # a shard (each tp rank its own heads): one seed per rank of the mesh, after both blocks
    attention_probs = base_seed + 2 * dp_size + dp_rank * tp_size + tp_rank
    # nothing but base_seed and the mesh: a rerun, in any process, draws the same masks
    return {"attention_probs": attention_probs, "attention_output": attention_output,
            "mlp_output": mlp_output}
