"""The exercise check of notebook 16 (how DDP hides the cost of its all_reduces).

The exercise asks for the buckets DDP forms for a model the notebook did not show: their
sizes in bytes, bucket 0 (the first all-reduced) first, once DDP has rebuilt its buckets
in the order the gradients became ready (from the second iteration on). The check asks
real DDP on real gloo ranks for the answer, case by case, and names the usual mistake a
wrong answer matches.

What DDP does in torch 2.13, and where (every rule is checked against real DDP by
``tests/test_nb16_buckets.py``):

* the buckets are filled in the order the gradients became ready in the first
  ``backward()``, which for a plain stack of layers is the reverse of
  ``model.parameters()`` (``Reducer::rebuild_buckets`` in
  ``torch/csrc/distributed/c10d/reducer.cpp``);
* a bucket closes once its size reaches its cap (``>=``), so it may exceed the cap by
  its last tensor (``compute_bucket_assignment_by_size``, the same file; a maintainer
  explains it in pytorch/pytorch#48880);
* the caps are ``bucket_cap_mb`` MiB (``_MB_TO_BYTES = 1024 * 1024``), and with the
  default ``bucket_cap_mb=None`` the first bucket's cap is
  ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) and the others' 25 MiB
  (``_BucketCapacityConfig`` in ``torch/nn/parallel/distributed.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

MIB = 2 ** 20
"""Bytes in a MiB: what ``bucket_cap_mb`` counts in (``_MB_TO_BYTES`` in torch)."""
DEFAULT_CAP_MB = 25
"""DDP's default cap of every bucket but the first, MiB."""

Layers = list[tuple[int, int, bool]]
"""A stack of ``nn.Linear(in_features, out_features, bias)`` layers, with ``Tanh`` between."""

EXERCISE_LAYERS: Layers = [(64, 512, True), (512, 512, False), (512, 1024, True),
                           (1024, 256, True), (256, 10, True)]
"""The model of the exercise, as in the notebook's exercise cell."""

CASES: list[tuple[str, Layers, float | None]] = [
    ("the exercise's model, bucket_cap_mb=None", EXERCISE_LAYERS, None),
    ("the exercise's model, bucket_cap_mb=1", EXERCISE_LAYERS, 1),
    ("the digits model of step 1, bucket_cap_mb=0.25",
     [(64, 256, True)] + [(256, 256, True)] * 6 + [(256, 10, True)], 0.25),
    ("three 512 x 512 weights without biases, bucket_cap_mb=1",
     [(512, 512, False)] * 3, 1),
    ("three 500 x 500 weights without biases, bucket_cap_mb=1", [(500, 500, False)] * 3, 1),
    ("the exercise's model, bucket_cap_mb=2", EXERCISE_LAYERS, 2),
]
"""What the check asks, in order: ``(description, layers, bucket_cap_mb)``. The third case
is the timeline's of step 2; the fourth has weights of exactly 1 MiB each, the fifth of
exactly 10**6 bytes each."""


def param_bytes_of(layers: Layers) -> list[int]:
    """The float32 parameters' sizes of a stack of ``layers``, in bytes, in the order of
    ``model.parameters()`` (each layer's weight, then its bias)."""
    sizes = []
    for fan_in, fan_out, bias in layers:
        sizes.append(fan_in * fan_out * 4)
        if bias:
            sizes.append(fan_out * 4)
    return sizes


def ddp_bucket_bytes(layers: Layers, bucket_cap_mb, iterations: int = 3) -> list[int]:
    """Rank function: wrap a stack of ``layers`` in DDP with ``bucket_cap_mb``, run
    ``iterations`` forward and backward passes (DDP rebuilds its buckets once, in the
    second), and return the sizes in bytes of the buckets its comm hook received in the
    last one, in the order it received them (bucket 0 first)."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    modules = []
    for fan_in, fan_out, bias in layers:
        modules += [nn.Linear(fan_in, fan_out, bias=bias), nn.Tanh()]
    model = DDP(nn.Sequential(*modules[:-1]), bucket_cap_mb=bucket_cap_mb)
    sizes: list[int] = []

    def recording_hook(state, bucket):
        buffer = bucket.buffer()
        sizes.append(buffer.numel() * buffer.element_size())
        future = torch.futures.Future()
        future.set_result(buffer)                # nothing to all-reduce: only the sizes count
        return future

    model.register_comm_hook(None, recording_hook)
    x = torch.randn(4, layers[0][0])
    for _ in range(iterations):
        sizes.clear()
        model.zero_grad()
        model(x).sum().backward()
    return list(sizes)


def _rule(param_bytes, bucket_cap_mb, order="ready", close="reach", first="default",
          mib=MIB) -> list[int]:
    """DDP's bucket rule and the usual wrong ones, by its switches: the order tensors are
    taken in, when a bucket closes, what caps the first bucket, and the bytes of a MiB."""
    tensors = list(reversed(param_bytes)) if order == "ready" else list(param_bytes)
    cap = int((DEFAULT_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * mib)
    one_mib = dist._DEFAULT_FIRST_BUCKET_BYTES // MIB * mib     # 1 MiB, or 10**6 bytes
    if first == "default":
        first_cap = one_mib if bucket_cap_mb is None else cap
    elif first == "always 1 MiB":
        first_cap = one_mib
    else:  # "none": every bucket has the same cap
        first_cap = cap
    buckets, size, limit = [], 0, first_cap
    for t in tensors:
        if close == "before" and size and size + t > limit:   # never exceed the cap
            buckets.append(size)
            size, limit = 0, cap
        size += t
        if (close == "reach" and size >= limit) or (close == "exceed" and size > limit):
            buckets.append(size)
            size, limit = 0, cap
    if size:
        buckets.append(size)
    return buckets


MISTAKES = [
    (dict(order="parameters"),
     "your buckets follow the order of model.parameters(). DDP fills them in the order the "
     "gradients become ready in backward(): which layer's gradients are ready first?"),
    (dict(close="before"),
     "your buckets never exceed their cap. DDP adds a tensor first and closes the bucket "
     "once its size has reached the cap, so a bucket can end larger than the cap."),
    (dict(close="exceed"),
     "your buckets close only once they exceed the cap. DDP closes a bucket as soon as its "
     "size reaches the cap: a bucket of exactly the cap is closed."),
    (dict(first="none"),
     "your first bucket has the same cap as the others. With bucket_cap_mb=None, DDP caps "
     "the first bucket at dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), so that the first "
     "all_reduce starts early."),
    (dict(first="always 1 MiB"),
     "your first bucket is capped at 1 MiB also when bucket_cap_mb is given. DDP uses the "
     "smaller first bucket only with the default, bucket_cap_mb=None."),
    (dict(mib=10 ** 6),
     "your cap counts a MB as 10**6 bytes. bucket_cap_mb is in MiB: 1024 * 1024 bytes."),
    (dict(order="parameters", close="before"),
     "your buckets follow the order of model.parameters() and never exceed their cap. DDP "
     "fills them in the order the gradients become ready, and closes a bucket once it has "
     "reached its cap."),
]
"""``(switches of _rule, the sentence that names the mistake)``."""


def _as_sizes(value) -> list[int] | None:
    """The learner's answer as a list of ints, or ``None`` when it is not a list of numbers."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
            return None
        out.append(int(v))
    return out


def check_ddp_buckets(group: LocalGroup, fn, world_size: int = 2) -> Verdict:
    """The exercise of notebook 16: ``fn(param_bytes, bucket_cap_mb)`` must return the
    sizes in bytes of the buckets DDP all-reduces, bucket 0 first, once it has rebuilt them
    (``param_bytes``: the float32 parameters' sizes in bytes in the order of
    ``model.parameters()``; ``bucket_cap_mb``: ``None`` or a number of MiB).

    Each case of :data:`CASES` runs real DDP on ``world_size`` ranks (the group is
    resized, then restored) and compares. A wrong answer is matched against the usual
    mistakes (:data:`MISTAKES`: the order of ``model.parameters()``, buckets that never
    exceed their cap, a strict ``>``, the first bucket's cap, MB for MiB, one bucket per
    tensor as the notebook's starting body makes, ...) and gets the
    sentence that names it; otherwise the check shows the first case that differs, with
    what DDP made. It never shows the rule as code.

    Returns:
        A :class:`~reducelab.checks.Verdict`; right at every case passes.
    """
    answers = []
    for what, layers, cap in CASES:
        try:
            value = fn(param_bytes_of(layers), cap)
        except Exception as err:  # the learner's code: any error becomes a sentence
            return failed(f"For {what} your function raised {type(err).__name__}: {err}")
        sizes = _as_sizes(value)
        if sizes is None:
            return failed(f"For {what} your function returned {value!r}; return a list of "
                          f"bucket sizes in bytes, bucket 0 first, such as [1048576, 4096].")
        if not sizes or min(sizes) <= 0:
            return failed(f"For {what} your function returned {value!r}: every gradient is in "
                          f"a bucket, so return a list of positive sizes in bytes, bucket 0 "
                          f"first.")
        answers.append(sizes)
    real, wrong = [], []
    with restoring_world_size(group):       # real DDP, case by case, up to the first miss
        group.resize(world_size)
        try:
            for (_, layers, cap), got in zip(CASES, answers):
                real.append(group.run(ddp_bucket_bytes, layers, cap)[0])
                if got != real[-1]:
                    wrong.append(len(real) - 1)
                    break
        except RankError as err:
            return raised_on_ranks(f"With world_size={world_size}, DDP itself", err)
    if not wrong:
        lines = [f"{what}: {len(truth)} buckets, {', '.join(f'{b:,}' for b in truth)} bytes"
                 for (what, _, _), truth in zip(CASES, real)]
        return passed("Your buckets are DDP's in every case, as real DDP on "
                      f"{world_size} ranks made them:\n" + "\n".join(lines))
    k = wrong[0]
    what, layers, cap = CASES[k]
    head = f"For {what} you returned {answers[k]}, and DDP made {real[k]}"
    if sum(answers[k]) != sum(real[k]):
        if sum(answers[k]) == len(param_bytes_of(layers)):
            return failed(f"{head}: your sizes count tensors. Return each bucket's size in "
                          f"bytes.")
        return failed(f"{head}: your buckets hold {sum(answers[k]):,} bytes in all, the model's "
                      f"gradients {sum(real[k]):,}. Every gradient is in exactly one bucket.")
    tensors = [param_bytes_of(CASES[i][1]) for i in range(len(CASES))]
    if all(answers[i] in (tensors[i], tensors[i][::-1]) for i in range(len(CASES))):
        order = ("in the order of model.parameters()" if answers[k] == tensors[k]
                 else "in the order the gradients become ready")
        return failed(f"{head}: one bucket per tensor, {order}. That is one all_reduce per "
                      f"parameter, the α per call that buckets exist to save (step 3). DDP packs "
                      f"several tensors into a bucket, by the rules after question 1.")
    if answers[k] == list(reversed(real[k])):
        return failed(f"{head}: the right buckets in the reverse order. Bucket 0 is the one "
                      f"DDP all-reduces first.")
    if all(answers[i] == [sum(param_bytes_of(CASES[i][1]))] for i in range(len(CASES))):
        return failed(f"{head}: one bucket holds everything. That is DDP's first iteration, "
                      f"before it rebuilds its buckets by the caps.")
    for switches, sentence in MISTAKES:
        if all(answers[i] == _rule(param_bytes_of(CASES[i][1]), CASES[i][2], **switches)
               for i in range(len(CASES))):
            return failed(f"{head}: {sentence}")
    return failed(f"{head}. Look again at the rules after question 1: the order the "
                  f"buckets are filled in, when a bucket closes, and the cap of the first.")
