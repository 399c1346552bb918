"""Seeds and print widths, set once for the kernel and for every rank.

Introduced in notebook 01's setup cell. nbval compares the text a notebook prints, so
every notebook calls :func:`setup` first and every rank applies the same print options
when it starts. Seed what runs on a rank inside the rank function itself, from the
rank, e.g. ``torch.manual_seed(rank)``: that is what a learner's torchrun script does.
"""
from __future__ import annotations

import random

PRINT_PRECISION = 4


def print_options() -> None:
    """Fixed ``torch`` and ``numpy`` print options (4 decimals, no scientific notation)."""
    import numpy as np
    import torch
    torch.set_printoptions(precision=PRINT_PRECISION, sci_mode=False, linewidth=100)
    np.set_printoptions(precision=PRINT_PRECISION, suppress=True, linewidth=100)


def setup(seed: int = 0) -> None:
    """Seed ``random``, ``numpy`` and ``torch`` with ``seed``, fix print options, and use
    one intra-op thread in the kernel.

    Call it in a notebook's setup cell. ``seed`` is an ``int``. One thread, as on every
    rank, keeps the kernel's single-process references from competing with the ranks
    for a laptop's few cores, and fixes the order of float sums, so a reference prints
    the same digits on any machine.
    """
    import numpy as np
    import torch
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    print_options()


def within(value: float, tol: float) -> str:
    """``value`` as a stored notebook should show it: the same text on every CPU.

    A difference of the size of rounding noise (float32: about 1e-7 of the values' size
    per operation) changes in its digits with the CPU's vector width (AVX2, AVX-512 or
    none), the thread count and the order gloo adds in, so a notebook shows it against a
    stated tolerance, not as raw digits: ``"≤ 1e-06"`` when ``value <= tol``. A value
    above the tolerance is a result, not noise, and is shown with the bound it passes:
    ``"0.003 (above 1e-06)"``, ``"30 (above 1e-06)"`` (one significant digit, never in
    exponent notation above 1). PyTorch's reproducibility note ("results may not be
    reproducible between CPU and GPU executions, even when using identical seeds") and
    ``torch.testing.assert_close``'s per-dtype tolerances are the sources.

    ``value`` and ``tol`` are floats, in the units of the compared tensors. Raises
    ``ValueError`` for a ``tol`` that is negative or not a number. Used from notebook 05
    on.
    """
    if not tol >= 0:  # also catches NaN
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    if value <= tol:
        return f"≤ {tol:g}"
    return f"{float(f'{value:.1g}'):g} (above {tol:g})"
