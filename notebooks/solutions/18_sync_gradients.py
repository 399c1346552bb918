# Solution to notebook 18, exercise: one rank's gradients on a (dp=2, tp=2) mesh with
# sequence parallelism, in two collectives.


def sync_gradients(grads, mesh):
    dp_group, tp_group = mesh["dp"].get_group(), mesh["tp"].get_group()
    # the partial sums over this rank's tokens, in one flat buffer: SUM over tp gives this
    # batch's whole gradient of each
    partial = [grads[name] for name in SEQUENCE_PARALLEL]
    flat = torch.cat([g.flatten() for g in partial])
    dist.all_reduce(flat, group=tp_group)
    for g, whole in zip(partial, flat.split([g.numel() for g in partial])):
        g.copy_(whole.view_as(g))
    # every gradient, in one flat buffer: the mean over the dp ranks' batches
    every = list(grads.values())
    flat = torch.cat([g.flatten() for g in every])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=dp_group)
    for g, mean in zip(every, flat.split([g.numel() for g in every])):
        g.copy_(mean.view_as(g))
