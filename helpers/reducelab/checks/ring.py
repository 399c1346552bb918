"""Checks and byte formulas for notebook 06 (ring all_reduce built from send and recv).

The formulas are the ones notebook 06 measures on real ranks: in a ring all_reduce
(a reduce-scatter phase, then an all-gather phase, ``world_size - 1`` steps each) every
rank sends ``2 (N - 1) / N * S`` bytes for a tensor of ``S`` bytes on ``N`` ranks.

Sources: Patarasuk & Yuan (2009), "Bandwidth optimal all-reduce algorithms for clusters
of workstations", J. Parallel Distrib. Comput. 69(2), 117-124; Sergeev & Del Balso
(2018), "Horovod: fast and easy distributed deep learning in TensorFlow",
arXiv:1802.05799; ``torch.distributed.isend`` / ``recv`` / ``all_gather_into_tensor``,
https://pytorch.org/docs/stable/distributed.html
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks


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


# --- the exercise: all_gather from the ring's all-gather phase ------------------------
EXERCISE_WORLD_SIZES = (2, 3, 4)
EXERCISE_NUMEL = 3
HANG_TIMEOUT = 3.0
"""Seconds the check's own group waits for the ranks before it stops them and says where
each was waiting (a ring that hangs costs this, not the learner's group's timeout)."""
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                "all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object")


def exercise_input(rank: int, numel: int = EXERCISE_NUMEL) -> torch.Tensor:
    """The tensor rank ``rank`` holds in notebook 06's exercise: float32, shape ``(numel,)``.

    Element ``i`` is ``10 * rank + i + 1`` (rank 2 holds 21, 22, 23), so a gathered slice
    says at a glance whose tensor it is.
    """
    return 10.0 * rank + torch.arange(1, numel + 1, dtype=torch.float32)


def _whose(slice_: torch.Tensor, world_size: int, numel: int):
    """The rank whose exercise input ``slice_`` is, or ``None``."""
    for r in range(world_size):
        if slice_.shape == (numel,) and torch.equal(slice_.float(), exercise_input(r, numel)):
            return r
    return None


def _slice_index(t: torch.Tensor, n: int, numel: int, input_storage: int):
    """Which buffer ``t`` is: ``"x"`` (the input), the index of a slice of an ``n * numel``
    buffer (the output, split into ``n`` slices), or ``None`` (some other buffer)."""
    try:
        storage = t.untyped_storage()
    except Exception:  # noqa: BLE001 - not a plain dense tensor
        return None
    if storage.data_ptr() == input_storage:
        return "x"
    if (t.numel() == numel and t.is_contiguous() and t.storage_offset() % numel == 0
            and storage.nbytes() == n * numel * t.element_size()):
        return t.storage_offset() // numel
    return None


def _run_exercise(fn, numel):
    """Runs on each rank: call ``fn(x)`` with collectives forbidden, and record every send
    (its bytes, which buffer, whose data) and every receive (into which buffer)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = exercise_input(rank, numel)
    mine = x.clone()
    input_storage = mine.untyped_storage().data_ptr()
    trace = {"bytes": 0, "sends": [], "recvs": []}
    saved = {name: getattr(dist, name) for name in _COLLECTIVES + ("isend", "send", "recv", "irecv")
             if hasattr(dist, name)}

    def forbid(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"the exercise builds all_gather from send_recv; "
                               f"your function called dist.{name}")
        return refuse

    def sending(original):
        def wrapper(tensor, *args, **kwargs):
            trace["bytes"] += tensor.numel() * tensor.element_size()
            trace["sends"].append({
                "buffer": _slice_index(tensor, n, numel, input_storage),
                "whose": _whose(tensor.detach().reshape(-1), n, numel),
                "zero": not bool(tensor.detach().any()), "numel": tensor.numel()})
            return original(tensor, *args, **kwargs)
        return wrapper

    def receiving(original):
        def wrapper(tensor, *args, **kwargs):
            trace["recvs"].append({"buffer": _slice_index(tensor, n, numel, input_storage)})
            return original(tensor, *args, **kwargs)
        return wrapper

    try:
        for name in _COLLECTIVES:
            if name in saved:
                setattr(dist, name, forbid(name))
        dist.isend, dist.send = sending(saved["isend"]), sending(saved["send"])
        dist.recv, dist.irecv = receiving(saved["recv"]), receiving(saved["irecv"])
        out = fn(mine)
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    # the reference, with the real collective (after restoring it)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    return out, torch.cat(parts), trace


def _held(send: dict, numel: int) -> str:
    if send["numel"] != numel:
        return f"a tensor of {send['numel']} elements, not one slice of {numel}"
    if send["whose"] is not None:
        return f"rank {send['whose']}'s tensor"
    if send["zero"]:
        return "zeros"
    return "values that are no rank's tensor"


def _buffer(name) -> str:
    return ("its input x" if name == "x" else f"slice {name}" if isinstance(name, int)
            else "a buffer of its own")


def _diagnose(n: int, numel: int, traces: list[dict]) -> str:
    """The first step at which a rank's send or receive differs from the ring's: one or two
    sentences that name that mistake for that rank and step, or a question that points at
    what is missing when none is found.

    A message names concrete slices, ranks and steps, never an index formula: the formula
    for "which slice at step s" is the exercise's solution."""
    for s in range(n - 1):
        for r in range(n):
            sends, recvs = traces[r]["sends"], traces[r]["recvs"]
            if s < len(sends):
                send, want = sends[s], (r - s) % n
                if send["whose"] != want or send["numel"] != numel:
                    held = _held(send, numel)
                    right_buffer = send["buffer"] == want or (send["buffer"] == "x" and want == r)
                    if right_buffer and s == 0:
                        return (f"At step 0 rank {r} sent its own slice, as it should, but the "
                                f"slice held {held}: copy x into slice {r} before the first "
                                f"step.")
                    if right_buffer:
                        return (f"Rank {r}'s sends are right: at step {s} it sent slice {want}. "
                                f"But that slice held {held}, because at step {s - 1} the "
                                f"data did not land there. Whose tensor arrived at step "
                                f"{s - 1}, and which slice of the output is that rank's?")
                    if s == 0:
                        return (f"Rank {r}'s send at step 0 is off: it sent "
                                f"{_buffer(send['buffer'])}, holding {held}. At step 0 the only "
                                f"slice a rank holds is its own, slice {r}.")
                    return (f"Rank {r}'s send at step {s} is off: it sent "
                            f"{_buffer(send['buffer'])}, holding {held}. A rank passes on "
                            f"what it received at the step before: at step {s - 1} rank {r} "
                            f"received rank {want}'s tensor, so at step {s} it sends slice "
                            f"{want}.")
            if s < len(recvs) and isinstance(recvs[s]["buffer"], int):
                into, want = recvs[s]["buffer"], (r - s - 1) % n
                if into != want:
                    return (f"Rank {r}'s sends are right, but its receive at step {s} is off: "
                            f"it received into slice {into}. What arrives from rank "
                            f"{(r - 1) % n} at step {s} is rank {want}'s tensor, so it belongs "
                            f"in slice {want}.")
    steps = [len(t["sends"]) for t in traces]
    short = next((r for r, k in enumerate(steps) if k < n - 1), None)
    if short is not None:
        k = steps[short]
        return (f"Rank {short} made {k} ring step{'' if k == 1 else 's'} (send_recv calls); "
                f"with world_size={n} it takes {n - 1} ring step{'' if n == 2 else 's'} for "
                f"every slice to arrive. Which slice "
                f"does a rank pass on at each step, and into which slice does what it "
                f"receives go?")
    return ("Every send and receive went to the right slice, so the mistake is in what "
            "the function returns: return the whole output, slice i holding rank i's x.")


def _explain_hang(n: int, err: RankError, timeout: float) -> str:
    stuck = [r for r in err.reports if r.state == "stuck"]
    where = {r.collective for r in stuck}
    head = (f"With world_size={n} the ranks had not finished after {timeout:g} s, so the "
            f"check stopped them.")
    if stuck and where == {"send"}:
        return (f"{head} Every rank was waiting in a blocking dist.send. On gloo, send "
                f"returns only once the receiver has called recv, so each rank waits for its "
                f"right neighbour, which is itself waiting in send: no rank ever reaches its "
                f"recv. Start the send with dist.isend (or use send_recv), then recv, then "
                f"wait on the send.")
    if stuck and where == {"recv"}:
        return (f"{head} Every rank was waiting in dist.recv for its left neighbour, which "
                f"was itself waiting in recv: nobody sent. Start the send with dist.isend "
                f"first (or use send_recv), then recv.")
    lines = "; ".join(f"rank {r.rank}: {r.summary}" for r in err.reports)
    return (f"{head} The ranks wait for each other: every send needs a matching recv on "
            f"the neighbour at the same step. Where each rank was: {lines}.")


def check_ring_all_gather(fn, world_sizes=EXERCISE_WORLD_SIZES, numel: int = EXERCISE_NUMEL,
                          timeout: float = HANG_TIMEOUT) -> Verdict:
    """Exercise of notebook 06: ``fn(x)`` is ``all_gather`` built from the ring.

    On rank ``r``, ``fn`` gets ``x = exercise_input(r, numel)`` (float32, shape
    ``(numel,)``) and must return a float32 tensor of shape ``(world_size * numel,)``
    whose slice ``i`` is rank ``i``'s ``x``, the result of ``dist.all_gather``
    concatenated, sending only with ``dist.isend``/``dist.send`` (each rank may send
    ``(world_size - 1) * numel * 4`` bytes, as in the ring's all-gather phase).
    Collectives are disabled on the ranks while ``fn`` runs; every send (bytes, which
    slice, whose data) and every receive (into which slice) is recorded, so a wrong
    answer is told which step's send or receive went wrong.

    The check runs on a :class:`~reducelab.LocalGroup` of its own, created and closed
    inside it, with a ``timeout`` of a few seconds: a ring that hangs (every rank in a
    blocking ``send``) is stopped after ``timeout`` seconds and explained, and the
    learner's own group is left as it was.

    Args:
        fn: the learner's function, called on every rank as ``fn(x)``.
        world_sizes: the world sizes to try, in order (each an int from 2 up).
        numel: elements per rank (int >= 1).
        timeout: seconds the check's group waits for the ranks (float > 0).

    Returns:
        A :class:`~reducelab.checks.Verdict` that says, for a wrong answer, which rank's
        slice holds what, and which send or receive made it so.
    """
    if not callable(fn):
        return failed(f"check_ring_all_gather needs your function, ring_all_gather; got {fn!r}.")
    with LocalGroup(world_size=world_sizes[0], timeout=timeout, progress=False) as own:
        for n in world_sizes:
            own.resize(n)
            try:
                out = own.run(_run_exercise, fn, numel)
            except RankError as e:
                if any(r.state == "stuck" for r in e.reports):
                    return failed(_explain_hang(n, e, timeout))
                return raised_on_ranks(f"With world_size={n}", e)
            per_rank = (n - 1) * numel * 4
            traces = [trace for _, _, trace in out]
            for r, (got, want, trace) in enumerate(out):
                if not isinstance(got, torch.Tensor):
                    return failed(f"With world_size={n}, rank {r} returned {got!r}; expected a "
                                  f"tensor of {n * numel} elements: {want}.")
                if got.shape != want.shape:
                    return failed(f"With world_size={n}, rank {r} returned shape "
                                  f"{tuple(got.shape)}; expected {tuple(want.shape)}: "
                                  f"world_size slices of {numel} elements, slice i from rank i.")
                if not torch.equal(got.float(), want):
                    problems = []
                    for i, piece in enumerate(got.float().tensor_split(n)):
                        if torch.equal(piece, exercise_input(i, numel)):
                            continue
                        holder = _whose(piece, n, numel)
                        if holder is not None:
                            problems.append(f"slice {i} holds rank {holder}'s tensor")
                        elif not piece.any() and i == r:
                            problems.append(f"slice {i}, rank {r}'s own, is still zero")
                        elif not piece.any():
                            problems.append(f"slice {i} is still zero (never received)")
                        else:
                            problems.append(f"slice {i} holds {piece.tolist()}")
                    return failed(f"With world_size={n}, rank {r} returned {got}, expected "
                                  f"{want}: {'; '.join(problems)}. "
                                  f"{_diagnose(n, numel, traces)}")
                if trace["bytes"] != per_rank:
                    return failed(f"With world_size={n}, the result is right, but rank {r} "
                                  f"passed {trace['bytes']} bytes to isend/send; the ring's "
                                  f"all-gather phase sends {n - 1} slices of {numel * 4} bytes "
                                  f"= {per_rank} bytes. Send one slice per step, not the whole "
                                  f"output.")
    return passed(f"At world sizes {', '.join(map(str, world_sizes))} every rank gathered "
                  f"every rank's tensor in world_size - 1 ring steps, sending "
                  f"(world_size - 1) x {numel * 4} bytes: the same as the real all_gather. "
                  f"This is the ring's all-gather phase, started from each rank's own "
                  f"slice instead of a reduced chunk.")
