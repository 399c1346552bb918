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
per byte that a rank really sends and ``1 / β`` is a bandwidth; busbw keeps nccl-tests'
definition, so it falls below ``1 / β`` where gloo sends more than the best algorithm.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist

from ..errors import RankError
from ..group import LocalGroup
from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size

COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast")
"""The collectives notebook 10 times, by their torch 2.13 names (``all_gather_single`` and
``reduce_scatter_single`` were ``all_gather_into_tensor`` and ``reduce_scatter_tensor``);
``S`` is always the size of the whole result, as in nccl-tests: the all_reduce tensor,
the all_gather output, the reduce_scatter input, the broadcast tensor."""

TOLERANCE = 3.0
"""The exercise's check accepts a real run within this factor of the prediction (either
way): timing on a laptop shared with other programs is noisy."""


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
def time_all_reduces(sizes_bytes: list[int], repeats: int = 5) -> list[float]:
    """Rank function of the exercise's real run: all_reduce one float32 tensor of each
    size in ``sizes_bytes``, one after another, ``repeats`` times (after one warm-up,
    with a barrier before each repeat). Returns this rank's seconds per repeat."""
    tensors = [torch.ones(max(1, int(s) // 4)) for s in sizes_bytes]
    for t in tensors:  # warm-up
        dist.all_reduce(t)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            dist.all_reduce(t)
        seconds.append(time.perf_counter() - t0)
    return seconds


def measured_seconds(group: LocalGroup, sizes_bytes: list[int], repeats: int = 5) -> float:
    """Median over repeats of the slowest rank's time for :func:`time_all_reduces`."""
    out = group.run(time_all_reduces, list(sizes_bytes), repeats)
    return float(np.median(np.max(np.array(out), axis=0)))


class _NotANumber(Exception):
    """The learner's function returned something other than a number."""


def _predict(fn, sizes, alpha, beta, world_size) -> float:
    value = fn(list(sizes), alpha, beta, world_size)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise _NotANumber(f"your function returned {value!r} (a {type(value).__name__}); "
                          f"return a number of seconds, such as 0.002")
    return float(value)


def _diagnose(got, sizes, alpha, beta, n, what) -> str | None:
    """A sentence naming the usual mistake ``got`` matches, or ``None`` if it is right."""
    f = 2 * (n - 1) / n
    total = float(sum(sizes))
    want = len(sizes) * alpha + beta * f * total
    if math.isclose(got, want, rel_tol=1e-6):
        return None
    k = len(sizes)
    candidates = [
        (alpha + beta * f * total,
         f"it counts α once for all {k} tensors. Each all_reduce is one message and pays "
         f"α again: {k} tensors cost {k} α."),
        (k * alpha + beta * total,
         f"it leaves out the factor 2(n - 1)/n = {f:g} for world_size={n}. In an "
         f"all_reduce every rank sends 2(n - 1)/n bytes per byte of the tensor (a "
         f"reduce-scatter and an all-gather), and β is seconds per byte sent."),
        (alpha + beta * total,
         f"it counts α once for all {k} tensors and leaves out the factor 2(n - 1)/n = "
         f"{f:g}: each all_reduce pays α, and every rank sends 2(n - 1)/n bytes per byte."),
        (k * alpha + beta * (n - 1) / n * total,
         f"it uses (n - 1)/n, the factor of a reduce_scatter or an all_gather alone. An "
         f"all_reduce is both, so its factor is 2(n - 1)/n = {f:g}."),
        (k * alpha + beta * (n - 1) * total,
         "it uses (n - 1), the bytes of a naive all_reduce that sends the whole tensor to "
         f"every other rank; the ring sends 2(n - 1)/n = {f:g} bytes per byte."),
        (k * alpha + beta * 2 * f * total,
         "it counts the bytes twice: 2(n - 1)/n already holds both the reduce-scatter "
         "and the all-gather half."),
        (k * alpha, "it has only the α term: the bytes cost time too, β per byte sent."),
        (beta * f * total, "it has only the bandwidth term: every message also costs α."),
        (k * alpha + beta * f * total / 4,
         "it counts elements, not bytes: a float32 element is 4 bytes, and the sizes "
         "given are already in bytes."),
    ]
    for value, sentence in candidates:
        if math.isclose(got, value, rel_tol=1e-6):
            return f"For {what} (world_size={n}) your prediction is {seconds_label(got)}: {sentence}"
    if got <= 0:
        return (f"For {what} (world_size={n}) your prediction is {seconds_label(got)}; every "
                f"all_reduce costs at least α = {seconds_label(alpha)}.")
    return (f"For {what} (world_size={n}) your prediction is {seconds_label(got)}, but the model "
            f"gives {seconds_label(want)}. Look again at step 3: what does one all_reduce pay "
            f"per call, what per byte, and how many bytes does a rank send in an all_reduce "
            f"of S bytes?")


def check_all_reduce_prediction(group: LocalGroup, fn, fits: dict, grad_bytes: list[int],
                                bucket_bytes: list[int], world_size: int = 4,
                                repeats: int = 5) -> Verdict:
    """The exercise of notebook 10: ``fn(sizes_bytes, alpha, beta, world_size)`` must
    predict the seconds to all_reduce one float32 tensor of each size, one after the
    other, from the fitted α (seconds per message) and β (seconds per byte sent).

    First the prediction is compared with the α-β model at every world size of
    ``fits`` (to 1e-6), for the model's gradients one tensor at a time
    (``grad_bytes``) and bucketed (``bucket_bytes``); a wrong prediction is matched
    against the usual mistakes (α counted once for everything, the factor
    ``2 (n - 1) / n`` left out, ...). Then both predictions are compared with a real
    run on ``world_size`` ranks (the group is resized, then restored): they pass the
    real run's test when it lies within a factor :data:`TOLERANCE` of them.

    Args:
        group: the :class:`~reducelab.LocalGroup`.
        fn: the learner's function; returns a float (seconds).
        fits: ``{("all_reduce", n): (alpha, beta)}`` from the notebook's sweep, seconds and
            seconds per byte; must hold ``world_size``.
        grad_bytes, bucket_bytes: the gradients' sizes and the DDP buckets' sizes, bytes.
        world_size: where the real run happens (4: the factor is 1.5, not 1).
        repeats: repeats of the real run (the median of the slowest rank counts).

    Returns:
        A :class:`~reducelab.checks.Verdict`; a right model passes, with the real run's
        comparison said either way (a noisy run is no fault of the learner's).
    """
    key = ("all_reduce", world_size)
    if key not in fits:
        return failed(f"fits has no entry {key!r}: run the sweep and the fit cells above "
                      f"first (they measure world sizes 2 and 4).")
    # the largest world size first: at n = 2 the factor 2(n - 1)/n is 1, and leaving it
    # out changes nothing there
    ns = sorted((n for c, n in fits if c == "all_reduce"), reverse=True)
    predictions = {}
    for n in ns:
        alpha, beta = fits[("all_reduce", n)]
        for what, sizes in (("one all_reduce per gradient", grad_bytes),
                            ("one all_reduce per bucket", bucket_bytes)):
            try:
                got = _predict(fn, sizes, alpha, beta, n)
            except _NotANumber as err:
                return failed(f"For {what} (world_size={n}) {err}.")
            except Exception as err:  # the learner's code: any error becomes a sentence
                return failed(f"For {what} (world_size={n}) your function raised "
                              f"{type(err).__name__}: {err}")
            wrong = _diagnose(got, sizes, alpha, beta, n, what)
            if wrong:
                return failed(wrong)
            predictions[(n, what)] = got
    with restoring_world_size(group):
        group.resize(world_size)
        try:
            real = {"one all_reduce per gradient": measured_seconds(group, grad_bytes, repeats),
                    "one all_reduce per bucket": measured_seconds(group, bucket_bytes, repeats)}
        except RankError as err:
            return raised_on_ranks(f"With world_size={world_size}, the real run", err)
    lines, within = [], True
    for what, seconds in real.items():
        predicted = predictions[(world_size, what)]
        ratio = seconds / predicted
        ok = 1 / TOLERANCE <= ratio <= TOLERANCE
        within &= ok
        lines.append(f"{what}: predicted {seconds_label(predicted)}, real run {seconds_label(seconds)} "
                     f"(x{ratio:.2g}{'' if ok else ', outside the tolerance'})")
    per_param = predictions[(world_size, "one all_reduce per gradient")]
    per_bucket = predictions[(world_size, "one all_reduce per bucket")]
    saving = (f"Bucketing saves {len(grad_bytes) - len(bucket_bytes)} messages: "
              f"{len(grad_bytes) - len(bucket_bytes)} α = {seconds_label(per_param - per_bucket)} "
              f"predicted, {seconds_label(real['one all_reduce per gradient'] - real['one all_reduce per bucket'])} "
              f"in the real run.")
    header = (f"Your predictions match the α-β model at world sizes "
              f"{', '.join(map(str, sorted(ns)))}. "
              f"Real run on {world_size} ranks (tolerance: a factor of {TOLERANCE:g} either "
              f"way, since timing is noisy):")
    body = "\n".join([header, *lines, saving])
    if within:
        return passed(body)
    return passed(body + "\nThe model is right, but this run strayed beyond the tolerance: "
                  "other programs, or more ranks than cores, slow a run unevenly. Run the "
                  "check again, or re-run the sweep to refresh α and β.")
