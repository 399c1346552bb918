# Solution to notebook 14, exercise: the 2-norm of the whole gradient on a 2 x 2 (dp, tp) mesh,
# where torch's clip_grad_norm_ raises because the parameters live on two meshes.
import torch
import torch.distributed as dist


def global_grad_norm(model, mesh):
    # Each rank adds the squares of the elements it holds. Two sums, by who else holds them:
    # - split over tp (a Shard placement on the tp dimension: 0.weight's columns): every one
    #   of the 4 ranks holds different elements, so add over all 4 ranks;
    # - copied over tp (Replicate on tp, or a DTensor on the dp mesh only: 0.bias, 2.weight,
    #   2.bias): the 2 tp ranks of one dp index hold the same elements, so add over dp only,
    #   once per copy. Adding these over all ranks counts them twice (NeMo-RL #3788).
    split, copied = torch.zeros(()), torch.zeros(())
    for p in model.parameters():
        squares = p.grad.to_local().pow(2).sum()
        if p.grad.device_mesh.ndim == 2 and p.grad.placements[1].is_shard():
            split += squares
        else:
            copied += squares
    dist.all_reduce(split)                                  # over all ranks (the default group)
    dist.all_reduce(copied, group=mesh.get_group("dp"))     # over dp only
    return (split + copied).sqrt().item()
