"""The ``%%ranks`` cell magic: plain torch.distributed code in a cell, run on every rank.

Introduced in notebook 01's "plain code" step; load it with ``%load_ext reducelab``.
Like ipyparallel's ``%%px`` and nbdistributed's ``%%distributed``, but on a
:class:`~reducelab.LocalGroup`, so errors, timeouts and interrupts behave exactly as in
:meth:`LocalGroup.run` (it is one ``run()`` call).

Usage::

    %%ranks [--ranks 0,2] [--world-size N] [--group NAME]
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    x

* Each rank runs the cell in its own namespace, which persists across cells (and is
  shared with the globals of cell-defined functions sent by ``group.run``). ``torch``,
  ``dist``, ``rank`` and ``world_size`` are predefined.
* What each rank prints, then the value of the cell's last expression, appear per rank
  in rank order: ``[rank 0] Out: tensor([10.])``.
* ``--ranks`` runs the cell on a subset only (others do nothing, so the cell must not
  call collectives); ``--world-size`` resizes the group first (or starts one);
  ``--group`` names a LocalGroup variable of the kernel (default: the group made last,
  or a new 2-rank group).
"""
from __future__ import annotations

import argparse
import shlex

from .group import MAX_WORLD_SIZE, LocalGroup, current_group

_OWN: list = []  # a group the magic started itself, when the kernel had none
_COUNTER = [0]  # numbers the cells, for traceback file names


def exec_on_rank(code: str, filename: str, only: list[int] | None):
    """Run ``code`` in this rank's namespace; return ``repr`` of the last expression.

    Runs on a rank (sent by reference). Returns ``None`` if the rank is not in
    ``only``, or when the last statement is not an expression or its value is ``None``.
    """
    import ast
    import linecache

    import torch
    import torch.distributed as dist

    from .rank_loop import NAMESPACE

    rank = dist.get_rank()
    if only is not None and rank not in only:
        return None
    NAMESPACE.setdefault("torch", torch)
    NAMESPACE.setdefault("dist", dist)
    NAMESPACE["rank"], NAMESPACE["world_size"] = rank, dist.get_world_size()
    lines = code.splitlines(keepends=True)
    linecache.cache[filename] = (len(code), None, lines, filename)
    tree = ast.parse(code, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), NAMESPACE)
    if last is not None:
        value = eval(compile(last, filename, "eval"), NAMESPACE)
        return None if value is None else repr(value)
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%%ranks", add_help=False)
    p.add_argument("--ranks", default=None, help="comma-separated ranks, e.g. 0,2")
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--group", default=None)
    return p


def parse_options(line: str) -> argparse.Namespace:
    """Parse the ``%%ranks`` line. Raises ValueError naming the valid options."""
    try:
        opts, extra = _parser().parse_known_args(shlex.split(line))
    except SystemExit:
        opts, extra = None, [line]
    if opts is None or extra:
        raise ValueError(f"%%ranks: cannot read {' '.join(extra)!r}; options are --ranks 0,2 "
                         f"--world-size N --group NAME")
    if opts.ranks is not None:
        try:
            opts.ranks = sorted({int(r) for r in opts.ranks.split(",") if r.strip()})
        except ValueError:
            raise ValueError(f"%%ranks: --ranks takes comma-separated ints, e.g. 0,2; "
                             f"got {opts.ranks!r}") from None
    if opts.world_size is not None and not 1 <= opts.world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"%%ranks: --world-size must be from 1 to {MAX_WORLD_SIZE}, "
                         f"got {opts.world_size}")
    return opts


def resolve_group(opts, user_ns: dict) -> LocalGroup:
    """The group a ``%%ranks`` cell runs on, resized or started as its options say."""
    if opts.group is not None:
        g = user_ns.get(opts.group)
        if not isinstance(g, LocalGroup):
            raise ValueError(f"%%ranks: --group {opts.group} is not a LocalGroup in this kernel")
    else:
        g = current_group()
        if g is None:
            _OWN[:] = [LocalGroup(world_size=opts.world_size or 2)]
            g = _OWN[0]
    if opts.world_size is not None and opts.world_size != g.world_size:
        print(f"%%ranks: resizing the group to world_size {opts.world_size}; "
              f"the ranks' namespaces start empty.")
        g.resize(opts.world_size)
    if opts.ranks is not None:
        bad = [r for r in opts.ranks if not 0 <= r < g.world_size]
        if bad:
            raise ValueError(f"%%ranks: --ranks {bad} not in 0..{g.world_size - 1}")
    return g


def ranks(line: str, cell: str, user_ns: dict | None = None, opts=None,
          group: LocalGroup | None = None) -> list:
    """Run ``cell`` on the ranks as the ``%%ranks`` options in ``line`` say.

    Prints each rank's output, then ``[rank N] Out: <repr>`` for each rank whose last
    expression has a value. Returns the list of those reprs by rank (``None`` where
    there is none), which IPython does not echo.

    Raises:
        ValueError: bad options. RankError: as :meth:`LocalGroup.run`.
    """
    opts = opts or parse_options(line)
    g = group or resolve_group(opts, user_ns or {})
    _COUNTER[0] += 1
    out = g.run(exec_on_rank, cell, f"<%%ranks cell {_COUNTER[0]}>", opts.ranks)
    for r, value in enumerate(out):
        if value is not None:
            print(f"[rank {r}] Out: " + value.replace("\n", f"\n[rank {r}]      "))
    return out


def load_ipython_extension(ipython) -> None:
    """``%load_ext reducelab`` registers the ``%%ranks`` cell magic."""
    from IPython.core.error import UsageError

    def _ranks(line, cell):
        try:
            opts = parse_options(line)
            group = resolve_group(opts, ipython.user_ns)
        except ValueError as e:
            raise UsageError(str(e)) from None  # a sentence, not a traceback
        ranks(line, cell, ipython.user_ns, opts, group)
    ipython.register_magic_function(_ranks, magic_kind="cell", magic_name="ranks")
