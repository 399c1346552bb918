"""Checks and byte formulas for notebook 06 (ring all_reduce built from send and recv).

The formulas are the ones notebook 06 measures on real ranks: in a ring all_reduce
(a reduce-scatter phase, then an all-gather phase, ``world_size - 1`` steps each) every
rank sends ``2 (N - 1) / N * S`` bytes for a tensor of ``S`` bytes on ``N`` ranks.

Sources: Patarasuk & Yuan (2009), "Bandwidth optimal all-reduce algorithms for clusters
of workstations", J. Parallel Distrib. Comput. 69(2), 117-124; Sergeev & Del Balso
(2018), "Horovod: fast and easy distributed deep learning in TensorFlow",
arXiv:1802.05799; ``torch.distributed.send`` / ``isend`` / ``recv`` / ``broadcast``,
https://pytorch.org/docs/stable/distributed.html . The exercise's chain broadcast, piece by
piece, is what NCCL's ring broadcast does: ``runRing`` in NVIDIA/nccl
``src/device/broadcast.h`` (the root sends each chunk, every other rank receives it and
sends it on, the rank before the root only receives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, collectives_except, failed, passed, raised_on_ranks


# --- byte formulas ----------------------------------------------------------------------
def _check_sizes(world_size, size_bytes) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float)) or size_bytes < 0:
        raise ValueError(f"size_bytes must be a number of bytes >= 0, got {size_bytes!r}")


def ring_bytes_per_rank(world_size: int, size_bytes: float) -> float:
    """Bytes each rank sends in a ring all_reduce: ``2 (N - 1) / N * S``.

    ``N - 1`` reduce-scatter steps and ``N - 1`` all-gather steps, each sending one chunk
    of ``S / N`` bytes. With chunks of unequal size (``S`` not divisible by ``N``) this is
    the mean over ranks; each rank is within one chunk's rounding of it.

    Args:
        world_size: ``N``, the number of ranks (int >= 1).
        size_bytes: ``S``, the tensor's size in bytes (``numel * element_size``).

    Raises:
        ValueError: a negative or non-numeric size, or ``world_size < 1``.
    """
    _check_sizes(world_size, size_bytes)
    return 2 * (world_size - 1) / world_size * size_bytes


def naive_bytes_per_rank(world_size: int, size_bytes: float) -> float:
    """Bytes each rank sends when it sends its whole tensor to every other rank: ``S (N - 1)``.

    Raises:
        ValueError: as :func:`ring_bytes_per_rank`.
    """
    _check_sizes(world_size, size_bytes)
    return (world_size - 1) * size_bytes


def root_bytes(world_size: int, size_bytes: float) -> float:
    """Bytes the root sends in reduce-then-broadcast through one root: ``S (N - 1)``.

    Every other rank sends ``S`` (its tensor, to the root); the root sends the sum to each
    of the ``N - 1`` others. Same total as the ring, ``2 (N - 1) S``, but piled on one rank.

    Raises:
        ValueError: as :func:`ring_bytes_per_rank`.
    """
    _check_sizes(world_size, size_bytes)
    return (world_size - 1) * size_bytes


def contributors(value: float, world_size: int) -> list[int]:
    """Ranks whose input is in ``value``, when rank ``r``'s input is ``2 ** r``.

    Notebook 06 gives rank ``r`` the value ``2.0 ** r``; a sum of distinct powers of two
    is exact in float32 for ``world_size <= 24`` and its binary digits say which ranks it
    contains: ``contributors(11.0, 4) == [0, 1, 3]``.

    Raises:
        ValueError: ``value`` is not a whole number in ``0 .. 2 ** world_size - 1``.
    """
    v = float(value)
    if not v.is_integer() or not 0 <= v < 2 ** world_size:
        raise ValueError(f"{value!r} is not a sum of distinct 2**rank for world_size={world_size}")
    bits = int(v)
    return [r for r in range(world_size) if bits >> r & 1]


# --- the exercise: a broadcast along a chain, piece by piece -------------------------
EXERCISE_WORLD_SIZES = (2, 3, 4)
EXERCISE_NUMEL = 12
EXERCISE_PIECES = 4
HANG_TIMEOUT = 3.0
"""Seconds the check's own group waits for the ranks before it stops them and says where
each was waiting (a chain that hangs costs this, not the learner's group's timeout)."""
_COLLECTIVES = collectives_except("send", "recv", "isend", "irecv", "batch_isend_irecv")


def exercise_input(src: int, numel: int = EXERCISE_NUMEL) -> torch.Tensor:
    """The tensor ``src`` broadcasts in notebook 06's exercise: float32, shape ``(numel,)``.

    Element ``i`` is ``100 * (src + 1) + i + 1`` (src 0 holds 101, 102, ...; src 3 holds
    401, 402, ...), so any piece of it says at a glance which elements it is. Every other
    rank starts with zeros in a tensor of the same shape.

    Raises:
        ValueError: ``src < 0`` or ``numel < 1``.
    """
    if src < 0 or numel < 1:
        raise ValueError(f"need src >= 0 and numel >= 1; got src={src}, numel={numel}")
    return 100.0 * (src + 1) + torch.arange(1, numel + 1, dtype=torch.float32)


def _peer(args, kwargs, name: str):
    # dist.send(tensor, dst) / dist.recv(tensor, src), positional or by keyword
    if name in kwargs:
        return kwargs[name]
    if f"group_{name}" in kwargs:
        return kwargs[f"group_{name}"]
    return args[0] if args else None


def _what(t: torch.Tensor, data: torch.Tensor, pieces: int) -> str:
    """What a tensor passed to a send holds: ``"piece j"``, ``"all"``, ``"zeros"`` or
    ``"other"``."""
    flat = t.detach().reshape(-1).float()
    if flat.shape == data.shape and torch.equal(flat, data):
        return "all"
    for j, piece in enumerate(data.tensor_split(pieces)):
        if flat.shape == piece.shape and torch.equal(flat, piece):
            return f"piece {j}"
    return "zeros" if not bool(flat.any()) else "other"


def _run_chain(fn, src: int, numel: int, pieces: int):
    """Runs on each rank: ``fn(x, src, pieces)`` with collectives refused, every send and
    receive recorded in call order (its peer, its elements, what a send held, whether the
    call blocks), then ``x`` as the function left it."""
    rank = dist.get_rank()
    data = exercise_input(src, numel)
    x = data.clone() if rank == src else torch.zeros(numel)
    events: list[dict] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES + ("isend", "send", "recv", "irecv")
             if hasattr(dist, name)}

    def forbid(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"the exercise builds broadcast from send and recv; your "
                               f"function called dist.{name}")
        return refuse

    def sending(original, blocking):
        def wrapper(tensor, *args, **kwargs):
            events.append({"kind": "send", "peer": _peer(args, kwargs, "dst"),
                           "numel": tensor.numel(), "held": _what(tensor, data, pieces),
                           "blocking": blocking})
            return original(tensor, *args, **kwargs)
        return wrapper

    def receiving(original, blocking):
        def wrapper(tensor, *args, **kwargs):
            events.append({"kind": "recv", "peer": _peer(args, kwargs, "src"),
                           "numel": tensor.numel(), "blocking": blocking})
            return original(tensor, *args, **kwargs)
        return wrapper

    try:
        for name in _COLLECTIVES:
            if name in saved:
                setattr(dist, name, forbid(name))
        dist.send, dist.isend = sending(saved["send"], True), sending(saved["isend"], False)
        dist.recv, dist.irecv = receiving(saved["recv"], True), receiving(saved["irecv"], False)
        fn(x, src, pieces)
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    return x.clone(), events


def _where(report) -> str:
    """Where a stuck rank waited, named by the learner's own line: the frame that called
    the check's recording wrapper (the report's summary would name the wrapper)."""
    import re
    frames = re.findall(r'File "([^"]*)", line (\d+), in (\S+)', report.traceback or "")
    for i, (path, _, name) in enumerate(frames):
        if name == "wrapper" and path.endswith(("checks/ring.py", "checks\\ring.py")) and i:
            _, line, caller = frames[i - 1]
            return f"rank {report.rank}: waiting in {report.collective}, called from {caller} line {line}"
    return f"rank {report.rank}: {report.summary}"


def _explain_hang(n: int, src: int, err: RankError, timeout: float) -> str:
    head = (f"With world_size={n} and src={src} the ranks had not finished after "
            f"{timeout:g} s, so the check stopped them.")
    stuck = [r for r in err.reports if r.state == "stuck"]
    where = "; ".join(_where(r) if r.state == "stuck" else f"rank {r.rank}: {r.summary}"
                      for r in err.reports)
    last = (src - 1) % n
    if any(r.rank == last and r.collective == "send" for r in stuck):
        return (f"{head} Where each rank was: {where}. Rank {last} is the last rank of the "
                f"chain, and it was waiting in send: on gloo a send returns only once the "
                f"receiver has called recv (step 1). Its right neighbour is src, which holds "
                f"the data already and never receives, so the chain ends at rank {last}.")
    if stuck and all(r.collective == "send" for r in stuck):
        return (f"{head} Where each rank was: {where}. On gloo a send returns only once the "
                f"receiver has called recv (step 1): which rank did each waiting send go to, "
                f"and does that rank ever receive from it?")
    if stuck and all(r.collective == "recv" for r in stuck):
        return (f"{head} Where each rank was: {where}. Every waiting rank was in recv: nobody "
                f"sent to it. Only src holds the data at the start, so the first send is "
                f"src's.")
    return (f"{head} Where each rank was: {where}. Every send needs a matching recv on the "
            f"rank it goes to.")


def _chain_order(n: int, src: int) -> list[int]:
    return [(src + d) % n for d in range(n)]


def _diagnose_chain(n: int, src: int, numel: int, pieces: int, out) -> str | None:
    """The first thing that differs from a chain broadcast, as one or two sentences that
    name concrete ranks and pieces (never an index formula) and start with "Rank", or
    ``None``."""
    data = exercise_input(src, numel)
    order = _chain_order(n, src)
    last = order[-1]
    for r in order:
        x, events = out[r]
        sends = [e for e in events if e["kind"] == "send"]
        recvs = [e for e in events if e["kind"] == "recv"]
        right, left = (r + 1) % n, (r - 1) % n
        targets = sorted({e["peer"] for e in sends if e["peer"] is not None})
        if r == src and len(targets) > 1:
            return (f"Rank {src} (src) sent to ranks {', '.join(map(str, targets))} "
                    f"itself: that is the root of reduce-then-broadcast, which sends "
                    f"(N - 1) x S. In a chain src sends only to rank {right}, and every rank "
                    f"passes the pieces on to its right neighbour.")
        wrong = next((e["peer"] for e in sends if e["peer"] != right), None)
        if sends and wrong is not None:
            return (f"Rank {r} sent to rank {wrong}; in the chain a rank sends only to "
                    f"its right neighbour, rank {right}.")
        if r == src and recvs:
            return (f"Rank {src} (src) called recv: src holds the data from the start "
                    f"and only sends.")
        came = next((e["peer"] for e in recvs if e["peer"] not in (left, None)), None)
        if came is not None:
            return (f"Rank {r} received from rank {came}; in the chain a rank receives "
                    f"only from its left neighbour, rank {left}.")
        if r == last and sends:
            return (f"Rank {r}, the last rank of the chain, sent to rank {right}, which "
                    f"is src and holds the data already: the chain ends at rank {r}.")
        if r != src and not recvs:
            return f"Rank {r} never called recv, so nothing reached its x."
        if r != last and not sends:
            return (f"Rank {r}{' (src)' if r == src else ''} never sent, so rank "
                    f"{right} and the ranks after it in the chain get nothing.")
        early = next((e for e in sends if e["held"] == "zeros"), None)
        if early is not None:
            return (f"Rank {r} sent a tensor of zeros: it passed a piece on before that "
                    f"piece had arrived.")
        if r != src and not torch.equal(x, data) and recvs and \
                not any(e["blocking"] for e in recvs):
            return (f"Rank {r} received {len(recvs)} time{'s' if len(recvs) != 1 else ''} "
                    f"with irecv, but its x does not hold the data yet: irecv returns "
                    f"before the data arrives, and only the request's wait() says it has. "
                    f"A piece must have arrived before it is passed on or the function "
                    f"returns.")
        if r != src and not torch.equal(x, data) and not x.any():
            return (f"Rank {r} received {len(recvs)} time{'s' if len(recvs) != 1 else ''} "
                    f"but its x still holds zeros: it received into a tensor of its own. A "
                    f"piece of x from tensor_split is a view, so recv can write into x "
                    f"directly.")
    return None


def _describe_x(x: torch.Tensor, data: torch.Tensor, pieces: int, is_src: bool = False) -> str:
    """What ``x`` holds against src's ``data``; on src itself, which held the data before the
    call, zeros mean its own data was overwritten (review 5, 06-4)."""
    if is_src:
        return "src's own data was overwritten: " + _describe_x(x, data, pieces).replace(
            "zeros in every piece, as before the call", "zeros in every piece")
    if not x.any():
        return "zeros in every piece, as before the call"
    parts = []
    for j, (got, want) in enumerate(zip(x.tensor_split(pieces), data.tensor_split(pieces))):
        if torch.equal(got, want):
            continue
        parts.append(f"piece {j} holds {'zeros' if not got.any() else got.tolist()}")
    return "; ".join(parts)


def check_chain_broadcast(fn, world_sizes=EXERCISE_WORLD_SIZES, numel: int = EXERCISE_NUMEL,
                          pieces: int = EXERCISE_PIECES, timeout: float = HANG_TIMEOUT) -> Verdict:
    """Exercise of notebook 06: ``fn(x, src, pieces)`` is ``dist.broadcast`` along a chain.

    On rank ``src``, ``x`` is ``exercise_input(src, numel)``; on the others, zeros of the
    same shape (float32, ``(numel,)``). Afterwards every rank's ``x`` must hold src's
    data (in place, as ``dist.broadcast`` leaves it), sent along the chain src, src + 1,
    ... (mod ``world_size``): every rank receives only from its left neighbour and sends
    only to its right one; the last rank of the chain sends nothing; each rank that sends
    passes ``x`` on in ``pieces`` pieces of ``x.tensor_split(pieces)`` (``S`` bytes in
    all, ``S = numel * 4``), and a rank in the middle of the chain forwards the first
    piece before it receives the last (a pipeline, not store-and-forward; checked where
    its receives are blocking ``dist.recv`` calls).

    While ``fn`` runs, collectives are refused and every send and receive is recorded, so
    a wrong answer is told which rank went where: a star from src, a send or receive to
    the wrong neighbour, a chain that starts at rank 0 or closes into a ring, zeros
    passed on before they arrived, a receive into another tensor than ``x``, the whole
    tensor in one piece, or store-and-forward. No message gives an index formula.

    The check runs on a :class:`~reducelab.LocalGroup` of its own, created and closed
    inside it, with a ``timeout`` of a few seconds: a chain that hangs is stopped after
    ``timeout`` seconds and explained, and the learner's own group is left as it was.

    Args:
        fn: the learner's function, called on every rank as ``fn(x, src, pieces)``.
        world_sizes: the world sizes to try, in order (each an int from 2 up); at each,
            src is the first rank, then the last.
        numel: elements of ``x`` (int >= ``pieces``).
        pieces: how many pieces to cut ``x`` into (int >= 1).
        timeout: seconds the check's group waits for the ranks (float > 0).

    Returns:
        A :class:`~reducelab.checks.Verdict`.

    Raises:
        ValueError: a world size below 2, ``pieces < 1`` or ``numel < pieces``.
    """
    if not callable(fn):
        return failed(f"check_chain_broadcast needs your function, chain_broadcast; got {fn!r}.")
    if not world_sizes or min(world_sizes) < 2:
        raise ValueError(f"world_sizes must be 2 or more ranks each, got {world_sizes!r}")
    if pieces < 1 or numel < pieces:
        raise ValueError(f"need 1 <= pieces <= numel; got pieces={pieces}, numel={numel}")
    size = numel * 4
    with LocalGroup(world_size=world_sizes[0], timeout=timeout, progress=False) as own:
        for n in world_sizes:
            own.resize(n)
            for src in sorted({0, n - 1}):
                at = f"With world_size={n} and src={src}"
                try:
                    out = own.run(_run_chain, fn, src, numel, pieces)
                except RankError as e:
                    if any(r.state == "stuck" for r in e.reports):
                        return failed(_explain_hang(n, src, e, timeout))
                    return raised_on_ranks(at, e)
                data = exercise_input(src, numel)
                hint = _diagnose_chain(n, src, numel, pieces, out)
                bad = next((r for r in _chain_order(n, src) if not torch.equal(out[r][0], data)), None)
                if bad is not None:
                    return failed(f"{at}, rank {bad}'s x afterwards: "
                                  f"{_describe_x(out[bad][0], data, pieces, bad == src)}; expected src's "
                                  f"x, {data.tolist()}." + (f" {hint}" if hint else ""))
                if hint:
                    return failed(f"{at}, every rank ends with src's x, but "
                                  f"{hint[0].lower()}{hint[1:]}")
                verdict = _check_pieces(n, src, numel, pieces, size, out)
                if verdict is not None:
                    return verdict
    return passed(
        f"At world sizes {', '.join(map(str, world_sizes))}, with src the first or the last "
        f"rank, every rank but src received src's x from its left neighbour in {pieces} "
        f"pieces, and every rank but the last of the chain passed the pieces on one by one, "
        f"without waiting for the whole of x: "
        f"each sent S = {size} bytes, src too, where the root of reduce-then-broadcast sent "
        f"(N - 1) x S. NCCL's ring broadcast does this (runRing in its "
        f"src/device/broadcast.h). Now open the answer below: do neighbouring links of your "
        f"chain work at the same time?")


_HELD = {"all": "the whole of x", "other": "neither x nor a piece of it"}
"""How a failing verdict names what a send held (``_what``'s labels ``"all"`` and
``"other"`` read as jargon in a sentence)."""


def _check_pieces(n: int, src: int, numel: int, pieces: int, size: int, out) -> Verdict | None:
    """The failing verdict for a chain that delivers the right data with the wrong pieces
    or without a pipeline, or ``None``."""
    at = f"With world_size={n} and src={src}, every rank ends with src's x, but"
    order = _chain_order(n, src)
    want = [f"piece {j}" for j in range(pieces)]
    for r in order[:-1]:
        sends = [e for e in out[r][1] if e["kind"] == "send"]
        sent = sum(e["numel"] for e in sends) * 4
        if sent != size:
            return failed(f"{at} rank {r} sent {sent} bytes; x is S = {size} bytes, and each "
                          f"rank of the chain but the last sends it once.")
        if [e["held"] for e in sends] != want:
            held = ", ".join(_HELD.get(e["held"], e["held"]) for e in sends)
            return failed(f"{at} rank {r} sent {len(sends)} tensor{'s' if len(sends) != 1 else ''} "
                          f"({held}); expected the {pieces} pieces of x.tensor_split({pieces}), "
                          f"piece 0 first."
                          + (" With one piece, no rank can pass x on before the whole of it "
                             "has arrived: the chain cannot work as a pipeline."
                             if len(sends) == 1 else ""))
    for r in order[1:-1]:
        events = out[r][1]
        recvs = [i for i, e in enumerate(events) if e["kind"] == "recv"]
        sends = [i for i, e in enumerate(events) if e["kind"] == "send"]
        blocking = all(events[i]["blocking"] for i in recvs)
        if pieces > 1 and blocking and recvs and sends and sends[0] > recvs[-1]:
            return failed(
                f"{at} rank {r} received all {pieces} pieces before it sent the first: store "
                f"and forward. Each rank then waits for the whole of x before the next "
                f"one can start; passing each piece on as soon as it arrives lets rank "
                f"{order[order.index(r) + 1]} receive piece 0 before rank {r} has the whole "
                f"of x.")
    return None
