"""Checks for notebook 02 (reduce, in-place buffers and aliasing).

The exercise: build the reduce_scatter pattern (rank ``c`` ends with the sum over ranks
of chunk ``c``) out of ``dist.reduce`` calls, one per chunk, without changing the input.
It applies what the notebook shows about one reduce to several in a row: a reduce writes
gloo's partial sums into the tensor it is given on the ranks other than ``dst``, so a
buffer that goes through a second reduce adds those partial sums in again; and a slice
of ``x`` is a view, so reducing it writes into ``x``.

Source: ``torch.distributed.reduce``,
https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce ("Input and
output of the collective. The function operates in-place."); the learner question "Why
does `torch.distributed.reduce` affect tensors other than the destination?" (2025-01-30).
"""
from __future__ import annotations

import sys

import torch

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, collectives_except, failed, passed, raised_on_ranks, restoring_world_size

WORLD_SIZES = (2, 3, 4)
"""World sizes the exercise check tries."""
CHUNK_SIZES = (2, 3)
"""Elements per chunk (``k``) the exercise check tries; ``x`` holds ``world_size * k``."""
FORBIDDEN = collectives_except("reduce")
"""Collectives and point-to-point calls the exercise's function may not call: it builds
the pattern from reduce alone (a reduce of every chunk to rank 0, then sends from rank 0
to the owners, gets the right sums without ``dst=c``). Every rank refuses them at once, so
a send refused on one rank leaves no receive waiting on another."""


def exercise_input(rank: int, world_size: int, k: int) -> torch.Tensor:
    """The tensor rank ``rank`` passes to the learner's function: float32, shape
    ``(world_size * k,)``.

    Chunk ``c`` (elements ``c * k`` to ``c * k + k - 1``) holds ``(c + 1) * 10.0 ** rank``,
    so by notebook 02's digits rule the sum of chunk ``c`` over 4 ranks reads
    ``(c + 1)`` in every digit (chunk 2: 3333), and a digit that differs says how often
    that rank was counted.

    Raises:
        ValueError: a negative rank, ``world_size < 1`` or ``k < 1``.
    """
    if rank < 0 or world_size < 1 or k < 1:
        raise ValueError(f"need rank >= 0, world_size >= 1 and k >= 1; got rank={rank}, "
                         f"world_size={world_size}, k={k}")
    chunk_index = torch.arange(world_size * k) // k
    return (chunk_index + 1).to(torch.float32) * 10.0 ** rank


def expected_sums(world_size: int, k: int) -> list[torch.Tensor]:
    """What each rank must return: entry ``r`` is the sum over ranks of chunk ``r`` of
    :func:`exercise_input`, float32, shape ``(k,)``, computed in one process."""
    total = sum(exercise_input(r, world_size, k) for r in range(world_size))
    return [total[r * k:(r + 1) * k] for r in range(world_size)]


# --- likely mistakes, run on the ranks to tell which one the learner made ----------------
# Each takes x (this rank's input) and returns what it returns; the check compares the
# learner's x afterwards and result with theirs. None of them is the solution.
def _in_place(x):
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        dist.reduce(x, dst=c)
    return x[rank * k:(rank + 1) * k].clone()


def _views_of_x(x):
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        dist.reduce(x[c * k:(c + 1) * k], dst=c)
    return x[rank * k:(rank + 1) * k].clone()


def _one_buffer(x):
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    buffer = x.clone()
    for c in range(n):
        dist.reduce(buffer, dst=c)
    return buffer[rank * k:(rank + 1) * k]


def _last_buffer(x):
    import torch.distributed as dist
    n = dist.get_world_size()
    k = x.numel() // n
    for c in range(n):
        buffer = x[c * k:(c + 1) * k].clone()
        dist.reduce(buffer, dst=c)
    return buffer


def _own_chunk(x):
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    return x[rank * k:(rank + 1) * k].clone()


_X_CHANGED = {
    "in place": (
        _in_place,
        "That is what reducing x itself does: dist.reduce writes into the tensor it is "
        "given, on every rank (the sum on dst, gloo's partial sums on the others), so x "
        "no longer holds the input."),
    "views of x": (
        _views_of_x,
        "That is what reducing slices of x does: a slice such as x[a:b] is a view, it "
        "shares x's storage, so what dist.reduce writes into the slice lands in x."),
}
_WRONG_SUM = {
    "one buffer": (
        _one_buffer,
        "That is what one buffer sent through every reduce gives. After a reduce, the "
        "buffer holds gloo's partial sums on the ranks that were not its dst (Step 2), "
        "and the next reduce adds them in again: some ranks are counted more than once "
        "(read the digits). A buffer must go into one reduce only, or each reduce must "
        "touch elements no earlier reduce wrote."),
    "last buffer": (
        _last_buffer,
        "That is the tensor of the last reduce, whose dst was another rank: it holds "
        "another rank's chunk (gloo's partial sums of it, the input, or for some elements "
        "its full sum; torch promises the sum on dst only), not the sum of this rank's "
        "chunk. Return what the reduce whose dst was this rank left."),
    "own chunk": (
        _own_chunk,
        "That is this rank's own chunk of x, with nothing reduced into it."),
}


_RETURNED_NONE = (
    " None is what a function without a return statement gives, and what dist.reduce "
    "itself returns (a work handle only with async_op=True): reduce does not return the "
    "sum, it writes it into the tensor you pass it, on dst.")


def _on_rank(fn, k: int, record: bool):
    # Runs on every rank: call fn on a fresh input, with the forbidden collectives
    # refused and (when record) the number of elements of every dist.reduce recorded.
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    x = exercise_input(rank, n, k)
    before = x.clone()
    saved = {name: getattr(dist, name) for name in FORBIDDEN + ("reduce",) if hasattr(dist, name)}
    reduced: list[int] = []
    called: list[str] = []
    unpaired: list[str] = []

    def refuse(name):
        def refused(*args, **kwargs):
            called.append(name)
            raise RuntimeError(f"the exercise builds the pattern from dist.reduce; your "
                               f"function called dist.{name}")
        return refused

    def recording(tensor, *args, **kwargs):
        reduced.append(tensor.numel() if isinstance(tensor, torch.Tensor) else -1)
        # Collectives pair up in call order: every rank's i-th reduce is one collective.
        # Ranks that pass different dst to the same call would wait on each other until
        # the timeout; compare the dst of this call over the ranks first and say where.
        dst = kwargs.get("dst", args[0] if args else None)
        dst = kwargs.get("group_dst") if dst is None else dst
        mine = torch.tensor([-1 if dst is None else int(dst)])
        every = [torch.empty_like(mine) for _ in range(n)]
        saved["all_gather"](every, mine)
        dsts = [int(t) for t in every]
        if len(set(dsts)) > 1:
            caller = sys._getframe(1)
            unpaired.append(
                f"At call {len(reduced)} of dist.reduce (line {caller.f_lineno} of the cell that "
                f"defines {caller.f_code.co_name}), the ranks passed dst "
                + ", ".join(f"{d} (rank {r})" for r, d in enumerate(dsts)) + ".")
            raise RuntimeError(unpaired[-1])
        return saved["reduce"](tensor, *args, **kwargs)

    try:
        if record:
            for name in FORBIDDEN:
                if name in saved:
                    setattr(dist, name, refuse(name))
            dist.reduce = recording
        try:
            result = fn(x)
        except RuntimeError:
            if called or unpaired:
                return before, x.clone(), None, reduced, called, unpaired
            raise
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    if isinstance(result, torch.Tensor):
        result = result.detach().clone()
    return before, x.clone(), result, reduced, called, unpaired


def _matches(group: LocalGroup, candidates: dict, k: int, out, what: str) -> str:
    """The message of the first candidate whose result (``what="result"``) or whose x
    afterwards (``what="x"``) equals the learner's on every rank, else ``""``."""
    for fn, message in candidates.values():
        theirs = group.run(_on_rank, fn, k, False)
        index = 2 if what == "result" else 1
        if all(isinstance(o[index], torch.Tensor) and o[index].shape == t[index].shape
               and torch.equal(o[index].float(), t[index]) for o, t in zip(out, theirs)):
            return " " + message
    return ""


def _values(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"


def check_reduce_to_owners(group: LocalGroup, fn, world_sizes=WORLD_SIZES,
                           chunk_sizes=CHUNK_SIZES) -> Verdict:
    """Exercise of notebook 02: ``fn(x)`` runs on every rank with ``x`` of
    ``world_size * k`` elements, and rank ``r`` must return the sum over ranks of chunk
    ``r`` (``k`` elements), using ``dist.reduce`` only, one call per chunk with
    ``dst`` its owner, each carrying that chunk's ``k`` elements, and leaving ``x``
    unchanged on every rank.

    Runs ``fn`` on the group's real ranks at each world size in ``world_sizes`` and each
    ``k`` in ``chunk_sizes`` (the group is resized, then put back), with
    ``x = exercise_input(rank, world_size, k)``, and compares with
    :func:`expected_sums`, computed in one process. While ``fn`` runs, the collectives
    in :data:`FORBIDDEN` raise and every ``dist.reduce`` records its tensor's size. A
    wrong answer is compared with likely mistakes run on the same ranks (reducing ``x``
    itself, reducing slices of ``x``, one buffer through every reduce, the last reduce's
    buffer returned, no reduce at all), so the verdict can name it; no message prints a
    line of the solution. Before each ``dist.reduce`` the ranks compare its ``dst``, so
    ranks that pass different ``dst`` to the same call (each reducing its own chunk
    first) are named at that call and line rather than left to hang.

    Args:
        group: the :class:`~reducelab.LocalGroup` to run on.
        fn: the learner's function, run on every rank as ``fn(x)`` with ``x`` a float32
            tensor of shape ``(world_size * k,)``.
        world_sizes: ints of 2 or more.
        chunk_sizes: ints of 1 or more.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says what was expected and why.

    Raises:
        ValueError: a world size below 2 (one rank has nothing to reduce) or a chunk
            size below 1.
    """
    if not world_sizes or min(world_sizes) < 2:
        raise ValueError(f"world_sizes must be 2 or more ranks each, got {world_sizes!r}: "
                         f"with one rank there is nothing to reduce")
    if not chunk_sizes or min(chunk_sizes) < 1:
        raise ValueError(f"chunk_sizes must be 1 or more elements each, got {chunk_sizes!r}")
    with restoring_world_size(group):
        for ws in world_sizes:
            group.resize(ws)
            for k in chunk_sizes:
                verdict = _check_at(group, fn, ws, k)
                if verdict is not None:
                    return verdict
    return passed(
        f"At world sizes {', '.join(map(str, world_sizes))}, with "
        f"{' and '.join(map(str, chunk_sizes))} elements per chunk, every rank got the sum "
        f"of its own chunk and x was unchanged everywhere. One reduce per chunk, each "
        f"on elements no other reduce touched: that is a reduce_scatter, made of "
        f"world_size collectives where dist.reduce_scatter_single makes one (notebook 08).")


def _check_at(group: LocalGroup, fn, ws: int, k: int) -> Verdict | None:
    """The failing verdict at world size ``ws`` with ``k`` elements per chunk, or ``None``."""
    at = f"With world_size={ws} and k={k} ({ws * k} elements, chunk c to rank c)"
    try:
        out = group.run(_on_rank, fn, k, True)
    except RankError as e:
        return raised_on_ranks(at, e)
    called = sorted({name for o in out for name in o[4]})
    if called:
        return failed(f"{at}, your function called dist.{called[0]}. The exercise builds "
                      f"the pattern from dist.reduce alone, one reduce per chunk.")
    unpaired = next((o[5][0] for o in out if o[5]), "")
    if unpaired:
        return failed(
            f"{at}: {unpaired} Collectives pair up in call order: every rank's first "
            f"dist.reduce is one collective, its second the next, and so on, so at each "
            f"call every rank must pass the same dst. With different dst they would wait "
            f"on each other until the group's timeout; the check stopped them first.")
    want = expected_sums(ws, k)
    changed = [r for r, o in enumerate(out) if not torch.equal(o[0], o[1])]
    if changed:
        r = changed[0]
        before, after = out[r][0], out[r][1]
        return failed(
            f"{at}, x changed on {'rank' if len(changed) == 1 else 'ranks'} "
            f"{', '.join(map(str, changed))}; it must stay as it was, the caller still needs "
            f"it. On rank {r} x was {_values(before)} before your function and "
            f"{_values(after)} after it."
            + _matches(group, _X_CHANGED, k, out, "x"))
    for r, o in enumerate(out):
        got = o[2]
        if not isinstance(got, torch.Tensor):
            return failed(f"{at}, rank {r} returned {got!r}; expected a tensor of {k} "
                          f"elements, the sum over ranks of chunk {r}: {_values(want[r])}."
                          + (_RETURNED_NONE if got is None else ""))
        if got.numel() != k:
            return failed(f"{at}, rank {r} returned {got.numel()} elements; expected {k}: "
                          f"chunk {r} of the sum only, {_values(want[r])}.")
    wrong = [r for r, o in enumerate(out)
             if not torch.equal(o[2].reshape(-1).float(), want[r])]
    if wrong:
        r = wrong[0]
        return failed(
            f"{at}, rank {r} returned {_values(out[r][2].reshape(-1))}; expected the sum "
            f"over ranks of chunk {r}, {_values(want[r])}."
            + _matches(group, _WRONG_SUM, k, out, "result"))
    for r, o in enumerate(out):
        big = [m for m in o[3] if m != k]
        if big and big[0] > k:
            return failed(
                f"{at}, every rank returned the right sum and x is unchanged, but rank {r} "
                f"passed a tensor of {big[0]} elements to dist.reduce, where one chunk has "
                f"{k}. A reduce of more than the chunk moves bytes that dst does not need "
                f"(world_size times them for the whole tensor); reduce only the chunk that "
                f"goes to dst.")
        if big:
            return failed(
                f"{at}, every rank returned the right sum and x is unchanged, but rank {r} "
                f"passed a tensor of {big[0]} element{'' if big[0] == 1 else 's'} to "
                f"dist.reduce, where one chunk has {k}: more reduces than chunks, each "
                f"paying a collective's fixed cost. One reduce per chunk is enough.")
    return None


__all__ = ["check_reduce_to_owners", "exercise_input", "expected_sums", "WORLD_SIZES",
           "CHUNK_SIZES", "FORBIDDEN"]
