# Solution to notebook 18, exercise: one rank's gradients on a (dp=2, tp=2) mesh with
# sequence parallelism.


def sync_gradients(grads, mesh):
    dp_group, tp_group = mesh["dp"].get_group(), mesh["tp"].get_group()
    for name, grad in grads.items():
        if name in SEQUENCE_PARALLEL:                  # a partial sum over this rank's tokens
            dist.all_reduce(grad, group=tp_group)      # SUM over tp: this batch's whole gradient
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=dp_group)   # the mean over the batches
