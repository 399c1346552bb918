"""Real data for the notebooks, and how a global batch is split into local batches.

Introduced in notebook 04 (DDP gradients and loss reductions). The data set is
scikit-learn's *digits* (1,797 images of 8x8 pixels, 10 classes), which ships inside
scikit-learn: nothing is downloaded. It is read from scikit-learn's own file, without
importing ``sklearn.datasets`` (see :func:`_digits`). See
https://scikit-learn.org/stable/modules/generated/sklearn.datasets.load_digits.html

The split helpers run on the ranks as well as in the kernel: they only need ``torch``.
"""
from __future__ import annotations

import functools

import torch

SPLITS = ("equal", "uneven")
"""How a global batch is split into local batches: ``"equal"`` or ``"uneven"``."""

NUM_FEATURES = 64
NUM_CLASSES = 10


def _digits_file():
    """The path of the file scikit-learn's ``load_digits`` reads
    (``sklearn/datasets/data/digits.csv.gz``: one row per image, 64 pixel values and the
    label), found without importing scikit-learn; ``None`` where it is not there."""
    import importlib.util
    import pathlib
    spec = importlib.util.find_spec("sklearn")      # a top-level package: not imported
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = pathlib.Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def _digits():
    """``(pixels, labels)``: float64 ``(1797, 64)`` and int64 ``(1797,)``, as
    ``sklearn.datasets.load_digits()`` gives ``data`` and ``target``. Read from its file
    the way that function reads it (``np.loadtxt`` of the gzipped CSV,
    ``sklearn/datasets/_base.py``): ``import sklearn.datasets`` imports SciPy, about 1 s
    of a notebook's setup cell on a 2-core machine, for 21 ms of reading. Falls back to
    ``load_digits`` where the file is not where scikit-learn keeps it;
    ``tests/test_nb04_ddp.py`` holds the two equal. Read once per process, by
    :func:`_digits_tensors`, which keeps the tensors."""
    import gzip

    import numpy as np
    path = _digits_file()
    if path is None:
        from sklearn.datasets import load_digits
        d = load_digits()
        return d.data, d.target.astype(np.int64)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


@functools.lru_cache(maxsize=1)
def _digits_tensors():
    pixels, labels = _digits()
    X = torch.tensor(pixels, dtype=torch.float32) / 16.0   # pixel values 0..16 -> 0..1
    y = torch.tensor(labels, dtype=torch.int64)
    return X, y


def load_digits_tensors(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits data set as tensors, in scikit-learn's fixed order.

    Args:
        n: keep the first ``n`` samples (``1 <= n <= 1797``); ``None`` keeps all.

    Returns:
        ``(X, y)``: ``X`` is ``float32`` of shape ``(n, 64)`` with pixel values scaled to
        ``[0, 1]``; ``y`` is ``int64`` of shape ``(n,)`` with class labels ``0..9``.
        Fresh tensors on every call (changing them does not change the cache).

    Raises:
        TypeError, ValueError: ``n`` is not an ``int`` from 1 to 1797.
    """
    X, y = _digits_tensors()
    if n is None:
        return X.clone(), y.clone()
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int from 1 to {len(X)} or None, got {n!r}")
    if not 1 <= n <= len(X):
        raise ValueError(f"n must be from 1 to {len(X)} (the digits data set has {len(X)} "
                         f"samples), got {n}")
    return X[:n].clone(), y[:n].clone()


def split_sizes(global_batch: int, world_size: int, split: str = "equal") -> list[int]:
    """Local batch sizes, by rank, for one global batch.

    ``"equal"``: every rank gets ``global_batch // world_size`` samples (the global batch
    size must be divisible by ``world_size``). ``"uneven"``: rank ``r`` gets a share
    proportional to ``r + 1`` (rank 0 the fewest), the last rank takes what rounding
    leaves; with ``world_size == 1`` the single rank holds the whole batch.

    Returns:
        ``list[int]`` of length ``world_size`` that sums to ``global_batch``; every
        entry is at least 1.

    Raises:
        TypeError, ValueError: bad ``global_batch``/``world_size``, a ``split`` other than
            ``"equal"``/``"uneven"``, or a global batch that cannot be split that way.
    """
    for name, v in (("global_batch", global_batch), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be a positive int, got {v!r}")
        if v < 1:
            raise ValueError(f"{name} must be a positive int, got {v}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if global_batch < world_size:
        raise ValueError(f"global_batch ({global_batch}) must be at least world_size "
                         f"({world_size}) so that every rank gets a sample")
    if split == "equal":
        if global_batch % world_size:
            raise ValueError(f"an equal split needs global_batch divisible by world_size; "
                             f"{global_batch} is not divisible by {world_size}")
        return [global_batch // world_size] * world_size
    total = world_size * (world_size + 1) // 2
    sizes = [max(1, global_batch * (r + 1) // total) for r in range(world_size - 1)]
    last = global_batch - sum(sizes)
    if last < 1:
        raise ValueError(f"global_batch {global_batch} is too small for an uneven split "
                         f"over {world_size} ranks")
    return sizes + [last]


def local_slice(global_batch: int, world_size: int, rank: int, split: str = "equal") -> slice:
    """The ``slice`` of a global batch that ``rank`` holds, under :func:`split_sizes`.

    Ranks hold consecutive pieces in rank order, so the pieces of all ranks put
    together are the global batch. Raises like :func:`split_sizes`, and ``ValueError``
    for a ``rank`` outside ``0..world_size-1``.
    """
    sizes = split_sizes(global_batch, world_size, split)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int from 0 to {world_size - 1}, got {rank!r}")
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def batch_order(num_samples: int, global_batch: int, epochs: int, seed: int = 0) -> list[torch.Tensor]:
    """Indices of every global batch of a training run, the same on every rank.

    Each epoch is a fresh permutation of ``range(num_samples)`` drawn from a
    ``torch.Generator`` seeded with ``seed + epoch``, cut into global batches of
    ``global_batch`` samples (a last, smaller batch is dropped, as with
    ``drop_last=True``). Every rank calls this with the same arguments and gets the
    same list, then keeps its own :func:`local_slice` of each batch.

    Returns:
        ``list`` of ``int64`` tensors of shape ``(global_batch,)``.
    """
    if global_batch < 1 or global_batch > num_samples:
        raise ValueError(f"global_batch must be from 1 to num_samples ({num_samples}), "
                         f"got {global_batch}")
    out = []
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(seed + epoch)
        perm = torch.randperm(num_samples, generator=g)
        out += list(perm[: num_samples // global_batch * global_batch].split(global_batch))
    return out
