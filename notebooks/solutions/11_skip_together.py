# Solution to notebook 11, exercise: skip a corrupt step on every rank, or on none.
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reducelab.checks.disagree import step_batch


def train_skipping_bad_steps(bad, steps=6):
    rank = dist.get_rank()
    torch.manual_seed(0)                             # the same initial model on every rank
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = 0
    for step in range(steps):
        x, y = step_batch(rank, step, bad)           # sometimes a corrupt sample: inf
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        broken = torch.tensor([0.0 if all(g.isfinite().all() for g in grads) else 1.0])
        dist.all_reduce(broken, op=dist.ReduceOp.MAX)    # 1.0 on every rank if any rank's is
        if broken.item() > 0:                        # the same decision on every rank
            continue
        for g in grads:                              # average the gradients over ranks
            dist.all_reduce(g, op=dist.ReduceOp.AVG)
        opt.step()
        taken += 1
    return taken, model.weight.detach().clone()
