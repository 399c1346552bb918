# Solution to notebook 05, exercise: sync the gradients when ranks hold different numbers
# of real tokens.
import torch
import torch.distributed as dist


def sync_grads(model, mesh, n_tokens):
    # This rank's loss is a mean over its n_tokens real tokens, so n_tokens * p.grad is the
    # gradient of their SUM. Sums add up across ranks; means of different counts do not.
    # One flat buffer holds every weighted gradient and, last, the count: one all_reduce
    # of everything, not one per parameter (the optional part on the loop's cost). init_device_mesh already made one
    # process group per mesh dimension: a SUM along dp, then along cp, covers the dp x cp
    # ranks without making a new group (and never the tp ranks, which hold other parameters).
    # Give every parameter a gradient, zeros if need be, before the sync: a parameter that
    # has no gradient on some ranks only (a branch, an MoE expert no token was routed to)
    # would otherwise change the buffer's size on those ranks, and ranks whose calls do not
    # match hang or fail.
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    params = list(model.parameters())
    flat = torch.cat([p.grad.flatten() * n_tokens for p in params]
                     + [torch.tensor([float(n_tokens)])])
    for dim in ("dp", "cp"):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=mesh[dim].get_group())
    grads = flat[:-1] / flat[-1]                 # the gradient of the mean over every real token
    for p, g in zip(params, grads.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))
