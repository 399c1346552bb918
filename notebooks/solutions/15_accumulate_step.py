# Solution to notebook 15, exercise: one optimizer step over micro-batches of unequal sizes
# of an FSDP2 model, with one reduce-scatter per FSDP unit per step.
import torch.nn.functional as F


def accumulate_step(model, micro_batches, optimizer):
    total = sum(len(labels) for _, labels in micro_batches)    # this rank's digits, 210
    for i, (x, labels) in enumerate(micro_batches):
        # Sync off: the backward adds into FSDP2's unsharded gradients, on this rank only.
        # Sync on for the last one: its backward reduce-scatters the sum, once per unit.
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        # Each micro-batch weighs its share of the rank's digits: the sum of these is the
        # mean loss over all of them, whatever the micro-batches' sizes.
        loss = F.cross_entropy(model(x), labels) * (len(labels) / total)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
