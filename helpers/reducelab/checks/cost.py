"""Formulas and the exercise check of notebook 10 (what a collective costs).

The formulas are the ones notebook 10 fits and measures on real ranks:

* the **α-β (Hockney) model**: one message of ``S`` bytes takes ``α + β S`` seconds,
  ``α`` the cost of a message (seconds), ``β`` the cost of a byte (seconds per byte).
  Thakur, Rabenseifner and Gropp use it for every collective of MPICH ("Optimization of
  Collective Communication Operations in MPICH", Int. J. High Performance Computing
  Applications 19(1), 49-66, 2005); Hockney introduced it ("The communication challenge
  for MPP", Parallel Computing 20(3), 1994);
* the **bus factor** of nccl-tests, ``doc/PERFORMANCE.md`` (NVIDIA/nccl-tests): the bytes
  each rank must send per byte of the collective's size ``S`` in the best algorithm,
  ``2 (n - 1) / n`` for all_reduce, ``(n - 1) / n`` for reduce_scatter and all_gather,
  ``1`` for broadcast. ``algbw = S / t`` and ``busbw = algbw * bus factor``;
* the **bytes gloo sends** (:func:`gloo_factor`): what the busiest rank of a gloo group
  really sends per byte of ``S`` in torch 2.13, measured by notebooks 08 and 10 on each
  rank's sockets. It is the bus factor, except for ``reduce_scatter_single`` (gloo
  all-reduces the whole input, then keeps this rank's chunk:
  ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``) and ``broadcast`` (a tree: the
  root sends the whole tensor in each of ``ceil(log2 n)`` rounds, ``gloo/broadcast.cc``).

Notebook 10 fits ``t = α + β · gloo_factor · S`` to each collective, so ``β`` is seconds
per byte that a rank really sends and ``1 / β`` is the rate at which that collective's
busiest rank sends, fitted over all sizes (not the link's bandwidth: it differs from
collective to collective on the same link); busbw keeps nccl-tests' definition, so it
falls below the rate a rank really sends where gloo sends more than the best algorithm.

The exercise (:func:`check_recursive_doubling`) asks for the α-β model of an all_reduce
the notebook does not derive, recursive doubling, and compares it with notebook 06's ring
(:func:`ring_seconds`) on real ranks.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, restoring_world_size

COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast")
"""The collectives notebook 10 times, by their torch 2.13 names (``all_gather_single`` and
``reduce_scatter_single`` were ``all_gather_into_tensor`` and ``reduce_scatter_tensor``);
``S`` is always the size of the whole result, as in nccl-tests: the all_reduce tensor,
the all_gather output, the reduce_scatter input, the broadcast tensor."""

def _check_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def _check_collective(collective) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}")


def bus_factor(collective: str, world_size: int) -> float:
    """Bytes each rank sends per byte of ``S`` in an optimal algorithm (nccl-tests'
    busbw correction factor, ``doc/PERFORMANCE.md``).

    Args:
        collective: one of :data:`COLLECTIVES`.
        world_size: ``n``, the number of ranks (int >= 1).

    Returns:
        ``2 (n - 1) / n`` for all_reduce, ``(n - 1) / n`` for all_gather_single and
        reduce_scatter_single, ``1.0`` for broadcast (float).

    Raises:
        ValueError: an unknown collective or a world size below 1.
    """
    _check_collective(collective)
    _check_world_size(world_size)
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return 1.0
    return (n - 1) / n


def gloo_factor(collective: str, world_size: int) -> float:
    """Bytes the busiest rank of a gloo group sends per byte of ``S`` (torch 2.13), the
    ``f`` that notebook 10 fits with; notebook 10 measures it on each rank's sockets
    (``write_chars`` of ``/proc/self/io``), as notebook 08 does.

    Args:
        collective: one of :data:`COLLECTIVES`.
        world_size: ``n``, the number of ranks (int >= 1).

    Returns:
        :func:`bus_factor`, except ``2 (n - 1) / n`` for reduce_scatter_single (gloo
        all-reduces the whole input and keeps this rank's chunk,
        ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``) and ``ceil(log2 n)`` for
        broadcast (the root sends the whole tensor in each round of a tree,
        ``gloo/broadcast.cc``); a float.

    Raises:
        ValueError: an unknown collective or a world size below 1.
    """
    _check_collective(collective)
    _check_world_size(world_size)
    n = world_size
    if collective == "reduce_scatter_single":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return float(math.ceil(math.log2(n)))
    return bus_factor(collective, n)


def algbw(size_bytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth ``S / t``, in bytes per second."""
    return size_bytes / seconds


def busbw(collective: str, world_size: int, size_bytes: float, seconds: float) -> float:
    """nccl-tests' bus bandwidth ``algbw * bus_factor``, in bytes per second: comparable
    across world sizes and with a link's peak bandwidth."""
    return algbw(size_bytes, seconds) * bus_factor(collective, world_size)


def model_seconds(alpha: float, beta: float, factor: float, size_bytes) -> np.ndarray:
    """The fitted α-β model, ``α + β · factor · S`` seconds (``size_bytes`` a number or an
    array of bytes; returns a float64 array of the same shape)."""
    return alpha + beta * factor * np.asarray(size_bytes, dtype=float)


def crossover_bytes(alpha: float, beta: float, factor: float) -> float:
    """The size ``S*`` where the latency term equals the bandwidth term,
    ``α = β · factor · S*``: below it a collective is latency-bound, above it
    bandwidth-bound. Infinite when ``beta * factor`` is 0 (one rank sends nothing)."""
    denominator = beta * factor
    return math.inf if denominator <= 0 else alpha / denominator


def size_label(size_bytes: float) -> str:
    """``4 B``, ``16 KiB``, ``64 MiB``: powers of 1024, at most 3 significant digits
    (``∞`` for an infinite size, such as the crossover of a flat fit)."""
    if math.isinf(size_bytes):
        return "∞"
    for unit, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if size_bytes >= k:
            return f"{size_bytes / k:.3g} {unit}"
    return f"{size_bytes:.3g} B"


def seconds_label(seconds: float) -> str:
    """``12.3 µs``, ``4.56 ms``, ``1.2 s``: 3 significant digits in a fitting unit."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


# --- the exercise ------------------------------------------------------------------------
def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ... (recursive doubling needs it)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def ring_seconds(size_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """The α-β model of the ring all_reduce of notebook 06 (Thakur et al. 2005):
    ``2 (n - 1)`` messages, each rank sending ``2 (n - 1) / n · S`` bytes. Seconds."""
    n = world_size
    return 2 * (n - 1) * alpha + beta * 2 * (n - 1) / n * size_bytes


def _recursive_doubling_seconds(size_bytes: float, world_size: int, alpha: float,
                                beta: float) -> float:
    """The α-β model of recursive doubling: ``log2 n`` rounds, each a message of the whole
    tensor (Thakur et al. 2005, the all_reduce of MPICH for short messages)."""
    rounds = math.log2(world_size)
    return rounds * (alpha + beta * size_bytes)


def ring_recursive_doubling_crossover(world_size: int, alpha: float, beta: float) -> float:
    """The size ``S*`` (bytes) below which recursive doubling's model
    (:func:`_recursive_doubling_seconds`) is faster than the ring's (:func:`ring_seconds`),
    with ``alpha`` seconds per message and ``beta`` seconds per byte; ``inf`` where
    recursive doubling is never slower (2 ranks: both send one message of ``S`` bytes
    per round, and the ring has as many rounds). Both models are linear in ``S``, so
    ``L (α + β S) = 2 (n - 1) α + 2 (n - 1) / n · β S`` with ``L = log2 n`` gives
    ``S* = (2 (n - 1) - L) α / ((L - 2 (n - 1) / n) β)``."""
    n = world_size
    rounds, ring_share = math.log2(n), 2 * (n - 1) / n
    slope = (rounds - ring_share) * beta   # how much faster recursive doubling's time grows
    return math.inf if slope <= 0 else (2 * (n - 1) - rounds) * alpha / slope


def time_algorithm(algorithm, size_bytes: int, repeats: int = 5) -> list[float]:
    """Rank function of the exercise's real run: ``algorithm(x)`` all-reduces a float32
    tensor ``x`` of ``size_bytes`` in place; one warm-up call, then ``repeats`` calls,
    each after a barrier. Returns this rank's seconds per call."""
    x = torch.ones(max(dist.get_world_size(), int(size_bytes) // 4))
    algorithm(x)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        algorithm(x)
        seconds.append(time.perf_counter() - t0)
    return seconds


class _NotANumber(Exception):
    """The learner's function returned something other than a number."""


def _predict(fn, size, n, alpha, beta) -> float:
    value = fn(size, n, alpha, beta)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise _NotANumber(f"your function returned {value!r} (a {type(value).__name__}); "
                          f"return a number of seconds, such as 0.002")
    return float(value)


def _mistakes(S: float, n: int, alpha: float, beta: float) -> list[tuple[float, str]]:
    """``(what a usual mistake predicts, the sentence that names it)`` for one case."""
    rounds = math.log2(n)
    ring_f = 2 * (n - 1) / n
    return [
        (ring_seconds(S, n, alpha, beta),
         "that is the ring's cost from step 4. Read recursive_doubling_all_reduce again: how "
         "many rounds does it take, and how much does a rank send in each?"),
        ((n - 1) * (alpha + beta * S),
         f"it counts n - 1 = {n - 1} rounds. The distance to the partner doubles every "
         f"round, so after how many rounds has every rank heard from all {n}?"),
        (n / 2 * (alpha + beta * S),
         f"it counts n/2 = {n // 2} rounds. The distance doubles every round: 1, 2, 4, ... "
         f"up to n/2."),
        (rounds * alpha + beta * S,
         "it counts the bytes of one round only. Every round sends the whole tensor to the "
         "partner, and the tensor does not shrink."),
        (rounds * alpha + beta * ring_f * S,
         "it takes the ring's bytes, 2(n - 1)/n per byte of S. Here no rank sends a chunk: "
         "every round sends the whole tensor."),
        (rounds * alpha + beta * (n - 1) / n * S,
         "it takes (n - 1)/n bytes per byte of S, as if the tensor halved every round "
         "(that is recursive halving, another algorithm). recursive_doubling_all_reduce "
         "sends the whole tensor in every round."),
        (math.log(n) * (alpha + beta * S),
         "it uses the natural logarithm. The number of rounds is the base-2 logarithm of "
         "the world size: math.log2."),
        (2 * rounds * (alpha + beta * S),
         "it counts every round twice. In a round a rank sends S bytes and receives S at the "
         "same time; β is seconds per byte a rank sends, and α is paid once per round."),
        (rounds * (alpha + beta * S / 4),
         "it counts elements, not bytes: size_bytes is already in bytes."),
        (rounds * alpha, "it has only the α term: the bytes cost time too, β per byte sent."),
        (rounds * beta * S, "it has only the bandwidth term: every round also costs α."),
        (alpha + beta * S,
         "it counts one round: one exchange pairs ranks two by two, so each rank has heard "
         "from one other rank only."),
        ((rounds + 1) * (alpha + beta * S),
         f"it counts one round too many. The loop runs while distance < n: for n = {n} the "
         f"distances are 1, 2, ... up to n/2, and the loop stops when the distance reaches n."),
        (rounds * (alpha + 2 * beta * S),
         "it counts 2S bytes a round, what a rank sends and what it receives. β is seconds "
         "per byte a rank sends: the receive runs at the same time, on the other direction "
         "of the link."),
    ]


def _diagnose(fn) -> str | None:
    """A sentence naming the mistake of ``fn``, or ``None`` when it is the α-β model of
    recursive doubling at every case tried (world sizes 16, 8, 4 and 2, three sizes, two
    pairs of α and β). A mistake is named only when it explains every case: at a single
    world size two mistakes can give the same number (at 16 ranks, n/2 rounds and twice
    log2 n rounds are both 8)."""
    cases = [(S, n, a, b) for n in (16, 8, 4, 2) for S in (4, 2 ** 20, 64 * 2 ** 20)
             for a, b in ((2e-4, 1e-9), (3e-3, 5e-10))]
    got = []
    for S, n, alpha, beta in cases:
        what = f"S = {size_label(S)} on {n} ranks"
        try:
            got.append(_predict(fn, S, n, alpha, beta))
        except _NotANumber as err:
            return f"For {what} {err}."
        except Exception as err:  # the learner's code: any error becomes a sentence
            return f"For {what} your function raised {type(err).__name__}: {err}"
    right = [_recursive_doubling_seconds(*case) for case in cases]
    wrong = [k for k, (g, r) in enumerate(zip(got, right)) if not math.isclose(g, r, rel_tol=1e-6)]
    if not wrong:
        return None
    # the case where the prediction is furthest from the model, so that the number shown
    # differs visibly from the model's (at 4 B the bytes barely count, and a mistake in
    # them prints the same microseconds as the right answer)
    shown = max(wrong, key=lambda k: abs(got[k] - right[k]) / right[k])
    S, n, alpha, beta = cases[shown]
    first = (f"For S = {size_label(S)} on {n} ranks (α = {seconds_label(alpha)}, "
             f"β = {beta:g} s per byte) your prediction is {seconds_label(got[shown])}")
    for m, (_, sentence) in enumerate(_mistakes(S, n, alpha, beta)):
        if all(math.isclose(g, _mistakes(*case)[m][0], rel_tol=1e-6)
               for case, g in zip(cases, got)):
            return f"{first}: {sentence}"
    if got[wrong[0]] <= 0:
        return f"{first}; every round costs at least α."
    return (f"{first}, which matches none of the usual mistakes either. Count in "
            f"recursive_doubling_all_reduce: how many rounds, and how many bytes does a rank "
            f"send in each? Each round is one message: α, and β for every byte sent.")


def available_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity`` where it exists, else
    ``os.cpu_count()``); notebooks 10 and 16 import it from ``reducelab.widgets.cost``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def race_outcome(predicted: dict, real: dict) -> str:
    """What one size of the exercise's real run says about the model's choice.

    Args:
        predicted: ``{algorithm: seconds}`` from the α-β model, two algorithms.
        real: ``{algorithm: seconds of each repeat}`` (slowest rank), the same keys.

    Returns:
        ``"as predicted"`` or ``"not as predicted"`` where the two algorithms' real ranges
        (fastest to slowest repeat) do not overlap, so the faster one is faster in every
        repeat; else ``"too close to call (their ranges overlap)"``, since on a loaded
        machine (or with more ranks than cores, where the operating system decides which
        rank runs) one repeat can invert the order of the medians.
    """
    a, b = sorted(predicted)
    ta, tb = np.asarray(real[a], dtype=float), np.asarray(real[b], dtype=float)
    if ta.max() < tb.min():
        really = a
    elif tb.max() < ta.min():
        really = b
    else:
        return "too close to call (their ranges overlap)"
    return "as predicted" if really == min(predicted, key=predicted.get) else "not as predicted"


def check_recursive_doubling(group: LocalGroup, fn, ring_fits: dict, ring, recursive_doubling,
                             world_size: int = 4, sizes=(4 * 2 ** 10, 16 * 2 ** 20),
                             repeats: int = 5, cores: int | None = None) -> Verdict:
    """The exercise of notebook 10: ``fn(size_bytes, world_size, alpha, beta)`` must give the
    α-β model's seconds for an all_reduce by recursive doubling (the notebook's
    ``recursive_doubling_all_reduce``) of ``size_bytes`` on ``world_size`` ranks, a power
    of two, with ``alpha`` seconds per message and ``beta`` seconds per byte a rank sends.

    First ``fn`` is compared with the model at world sizes 16, 8, 4 and 2 and three sizes
    (to 1e-6); a wrong prediction is matched against the usual mistakes (the ring's cost,
    ``n - 1`` rounds, the bytes of one round, the natural logarithm, ...) and gets the
    sentence that names it, never the formula. Then, with the learner's fit of notebook
    06's ring at ``world_size`` ranks (its α per call divided by the ring's ``2(n - 1)``
    messages per call), the ring's and recursive doubling's predicted times
    at ``sizes`` are compared with a real run of both algorithms on ``world_size`` ranks
    (the group is resized, then restored): the median of ``repeats`` calls after a
    warm-up, slowest rank, with its range. The real run is reported, never judged: a
    noisy machine is no fault of the learner's. A size is called for one algorithm only
    where the two ranges do not overlap (:func:`race_outcome`); with more ranks than
    ``cores`` the message says that α there is mostly the operating system's scheduling
    of the ranks, not the loopback's; and a real run that raises or outlasts the group's
    timeout is reported, and a right model still passes.

    Args:
        group: the :class:`~reducelab.LocalGroup`.
        fn: the learner's function; returns a float (seconds).
        ring_fits: ``{n: (alpha, beta)}``, the notebook's fit of its Python ring (seconds,
            seconds per byte); must hold ``world_size``.
        ring, recursive_doubling: the notebook's rank functions that all-reduce a float32
            tensor in place (sum).
        world_size: where the real run happens; a power of two, 4 by default.
        sizes: the sizes of the real run, bytes.
        repeats: calls per size and algorithm in the real run.
        cores: CPU cores the ranks share; ``None``: those this process may run on.

    Returns:
        A :class:`~reducelab.checks.Verdict`; a right model passes.

    Raises:
        ValueError: ``world_size`` is not a power of two of at least 2.

    Source: R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of Collective
    Communication Operations in MPICH", Int. J. High Performance Computing Applications
    19(1), 2005 (recursive doubling for short messages, the ring for long ones).
    """
    if not is_power_of_two(world_size) or world_size < 2:
        raise ValueError(f"world_size must be a power of two >= 2 (2, 4, 8, ...), got {world_size!r}")
    if world_size not in ring_fits:
        return failed(f"ring_fits has no entry for {world_size} ranks: run the cells of step 4 "
                      f"first (they fit the Python ring at 2 and 4 ranks).")
    wrong = _diagnose(fn)
    if wrong:
        return failed(wrong)
    per_call, beta = ring_fits[world_size]
    # the notebook fits the ring per call, t = α + β·f·S; the ring sends 2(n - 1) messages
    # per call, so its α per message, the α of the models compared here, is that / 2(n - 1)
    alpha = per_call / (2 * (world_size - 1))
    cores = available_cores() if cores is None else cores
    crossings = []
    for n in (world_size, 2 * world_size):
        S = ring_recursive_doubling_crossover(n, alpha, beta)
        crossings.append(f"{n} ranks: recursive doubling at every size" if math.isinf(S) else
                         f"{n} ranks: recursive doubling below S = {size_label(S)}, the ring above")
    head = [
        "Your function is the α-β model of recursive doubling at world sizes 2 to 16.",
        f"With your fit of the Python ring at {world_size} ranks (α = {seconds_label(per_call)} "
        f"per call, which holds {2 * (world_size - 1)} messages: {seconds_label(alpha)} per "
        f"message; 1/β = {1 / beta / 1e9:.3g} GB/s), the faster algorithm is: "
        f"{'; '.join(crossings)}."]
    if world_size > cores:
        head.append(
            f"{world_size} ranks on {cores} cores: the ranks take turns on the cores, and a "
            f"message waits until the operating system runs the rank that receives it. So "
            f"much of this α, and of the race below, is that wait, not the loopback; on "
            f"{world_size} cores or more they measure the messages.")
    real = {}
    with restoring_world_size(group):
        group.resize(world_size)
        try:
            for name, algorithm in (("ring", ring), ("recursive doubling", recursive_doubling)):
                for S in sizes:
                    out = group.run(time_algorithm, algorithm, S, repeats)
                    real[name, S] = np.max(np.array(out), axis=0)
        except RankError as err:
            # the learner wrote the model, not the algorithms: a run that a loaded machine
            # stops (a timeout) is no reason to fail a right model
            return passed("\n".join(head + [
                f"The real run on {world_size} ranks did not finish ({err.headline}), so "
                f"nothing was raced this time: run the check again when the machine is "
                f"less busy."]))
    lines = []
    for S in sizes:
        predicted = {"ring": ring_seconds(S, world_size, alpha, beta),
                     "recursive doubling": _predict(fn, S, world_size, alpha, beta)}
        cells = []
        for name in ("ring", "recursive doubling"):
            t = real[name, S]
            cells.append(f"{name} predicted {seconds_label(predicted[name])}, real median "
                         f"{seconds_label(float(np.median(t)))} ({seconds_label(float(t.min()))} "
                         f"to {seconds_label(float(t.max()))})")
        outcome = race_outcome(predicted, {k: real[k, S] for k in predicted})
        lines.append(f"S = {size_label(S)}: {'; '.join(cells)}. "
                     f"{min(predicted, key=predicted.get).capitalize()} predicted faster; "
                     f"real run: {outcome}.")
    off = max(max(float(np.median(real[name, S])) / p, p / float(np.median(real[name, S])))
              for S in sizes for name, p in (("ring", ring_seconds(S, world_size, alpha, beta)),
                                             ("recursive doubling",
                                              _predict(fn, S, world_size, alpha, beta))))
    if off >= 3:
        lines.append(
            f"The real medians differ from the model's predictions by up to {off:.0f} times: "
            f"α and β were fitted to other runs of the ring (its α per call divided by its "
            f"messages), and a loaded machine, or more ranks than cores, changes both. Read "
            f"the race for which algorithm is faster, not for the model's seconds.")
    body = "\n".join(head + [
        f"Real run on {world_size} ranks (median of {repeats} calls of the slowest rank, after "
        f"a warm-up, with their range):", *lines,
        "A size is called only where the two ranges do not overlap. A real run on a shared "
        "laptop is noisy: a result not as predicted at one size says more about the machine "
        "than about your model. Libraries make the same choice: "
        "MPICH all-reduces short messages by recursive doubling, and long ones by a "
        "reduce-scatter then an all-gather that send what the ring sends (Rabenseifner's "
        "algorithm; Thakur et al. 2005)."])
    return passed(body)
