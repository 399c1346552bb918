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
