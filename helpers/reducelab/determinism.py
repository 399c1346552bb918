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
    """Seed ``random``, ``numpy`` and ``torch`` with ``seed`` and fix print options.

    Call it in a notebook's setup cell. ``seed`` is an ``int``.
    """
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    print_options()
