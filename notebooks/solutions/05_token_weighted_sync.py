# Solution to notebook 05, exercise: sync the gradients when ranks hold different numbers
# of real tokens.
import torch
import torch.distributed as dist


def sync_grads(model, mesh, n_tokens):
    # This rank's loss is a mean over its n_tokens real tokens, so n_tokens * p.grad is the
    # gradient of their SUM. Sums add up across ranks; means of different counts do not.
    # init_device_mesh already made one process group per mesh dimension: a SUM along dp,
    # then along cp, covers the whole dp x cp grid without making a new group.
    groups = (mesh["dp"].get_group(), mesh["cp"].get_group())
    total = torch.tensor(float(n_tokens))
    for g in groups:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=g)   # real tokens on all ranks
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(n_tokens)                  # the gradient of this rank's sum of losses
            for g in groups:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=g)
            p.grad.div_(total)                     # the gradient of the mean over every real token
