"""Checks for notebook 17 (which random numbers should match across ranks), and the code
it runs on the ranks.

This module imports only ``torch`` (and the standard library), so its functions can run
on the ranks:

* :func:`seeds_on_mesh` runs a learner's seeding function on a real ``(dp, tp)`` device
  mesh;
* :func:`mask` draws the dropout mask a seed gives;
* :func:`check_dropout_seeds` checks the exercise: a seed for each dropout draw of a
  tensor-parallel layer, on every rank of a ``(dp, tp)`` mesh (:data:`DRAWS`).

Moved here from notebook 13's module (``checks/ddp_model.py``) when notebook 13 was split;
the check's behaviour is unchanged.

Sources: two random-number streams for tensor parallelism, one the same on every rank of a
tensor-parallel group and one different on each of them (Shoeybi et al., "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism", 2019,
arXiv:1909.08053, appendix B.2; ``model_parallel_cuda_manual_seed`` in
``megatron/core/tensor_parallel/random.py``).
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError

MESHES = ((2, 2), (4, 1), (1, 4))
"""The ``(dp, tp)`` mesh shapes the exercise's check runs, all at world size 4."""
STAND_IN_MESHES = ((64, 8), (8, 64))
"""Larger ``(dp, tp)`` shapes the check then runs in this process, on stand-in meshes, one
call per coordinate: seeds such as ``base + rank``, ``base + 10 + dp`` and ``base + 20 + dp``
are apart on 4 ranks and collide from dp = 11 on (a fifth review, 17-3)."""
BASE_SEEDS = (0, 1234)
"""The base seeds the check passes."""
MASK_UNITS = 64
"""Units in the masks the check draws from each seed (dropout with p = 0.5)."""


# --- on the ranks ---------------------------------------------------------------------

def seeds_on_mesh(fn, dp: int, tp: int, base_seeds=BASE_SEEDS) -> dict:
    """Run ``fn(base_seed, mesh)`` on this rank of a ``(dp, tp)`` device mesh with
    dimension names ``("dp", "tp")``, twice for each base seed. Runs on the ranks (the
    check of notebook 17's exercise), at world size ``dp * tp``.

    Returns:
        ``{"dp_rank", "tp_rank", "seeds": {base: first result}, "again": {base: second
        result}}``: this rank's coordinates in the mesh and what ``fn`` returned.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != dp * tp:
        raise ValueError(f"a ({dp}, {tp}) mesh needs world size {dp * tp}, "
                         f"not {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    seeds = {base: fn(base, mesh) for base in base_seeds}
    again = {base: fn(base, mesh) for base in base_seeds}
    return {"dp_rank": mesh.get_local_rank("dp"), "tp_rank": mesh.get_local_rank("tp"),
            "seeds": seeds, "again": again}


def mask(seed: int, units: int = MASK_UNITS, p: float = 0.5) -> torch.Tensor:
    """The dropout mask a generator seeded with ``seed`` draws: bool of shape
    ``(units,)``, ``True`` for a dropped unit (probability ``p``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(units, generator=g) < p


# --- the exercise's check -----------------------------------------------------------------

class _StandInMesh:
    """A ``(dp, tp)`` device mesh's coordinates without a process group, for calling the
    learner's function once more in the kernel, another Python process than the ranks: the
    common ``DeviceMesh`` queries (``get_local_rank``, ``get_coordinate``, ``size``,
    ``shape``, ``ndim``, ``mesh_dim_names``, ``mesh["dp"]``, ``get_rank``, the global rank,
    as ``dist.get_rank()`` under :func:`_stand_in_dist`). Anything else raises
    ``AttributeError``, and the check then says that it left this comparison out."""

    def __init__(self, sizes: dict, coords: dict, names: tuple, rank: int | None = None):
        self._sizes, self._coords, self.mesh_dim_names = sizes, coords, names
        self.shape = tuple(sizes[n] for n in names)
        self.ndim = len(names)
        self._rank = rank

    def get_rank(self):
        return self._rank

    def _name(self, dim):
        return self.mesh_dim_names[dim] if isinstance(dim, int) else dim

    def get_local_rank(self, mesh_dim=None):
        return self._coords[self._name(0 if mesh_dim is None else mesh_dim)]

    def get_coordinate(self):
        return [self._coords[n] for n in self.mesh_dim_names]

    def size(self, mesh_dim=None):
        if mesh_dim is None:
            out = 1
            for n in self.mesh_dim_names:
                out *= self._sizes[n]
            return out
        return self._sizes[self._name(mesh_dim)]

    def __getitem__(self, name):
        names = (name,) if isinstance(name, str) else tuple(name)
        return _StandInMesh({n: self._sizes[n] for n in names},
                            {n: self._coords[n] for n in names}, names, self._rank)


@contextlib.contextmanager
def _stand_in_dist(rank: int, world_size: int):
    """While the learner's function runs in this process on a stand-in mesh, make
    ``dist.get_rank()`` and ``dist.get_world_size()`` answer for the coordinate it stands
    in for (the global rank of ``init_device_mesh``'s row-major layout), as they would on
    that rank; the kernel has no process group of its own (a sixth review, 17-1: seeds
    from ``dist.get_rank()`` raised here, and the larger meshes went unchecked)."""
    import torch.distributed as dist
    saved = dist.get_rank, dist.get_world_size
    dist.get_rank = lambda group=None: rank
    dist.get_world_size = lambda group=None: world_size
    try:
        yield
    finally:
        dist.get_rank, dist.get_world_size = saved


def _stand_in_mesh(dp: int, tp: int, d: int, t: int) -> _StandInMesh:
    return _StandInMesh({"dp": dp, "tp": tp}, {"dp": d, "tp": t}, ("dp", "tp"), d * tp + t)


def _another_process(fn, dp: int, tp: int, rows: list) -> str | None:
    """Call ``fn`` in this process (not a rank) with a stand-in mesh of each rank's
    coordinates; a message if it gives other seeds than that rank did, ``None`` if it gives
    the same or cannot run here."""
    for row in rows:
        mesh = _stand_in_mesh(dp, tp, row["dp_rank"], row["tp_rank"])
        for base, seeds in row["seeds"].items():
            try:
                with _stand_in_dist(mesh.get_rank(), dp * tp):
                    here = fn(base, mesh)
            except Exception:
                return None
            if here != seeds:
                return (f"On a ({dp}, {tp}) mesh, rank (dp {row['dp_rank']}, tp "
                        f"{row['tp_rank']}) got the seeds {seeds} with base seed {base}, and "
                        f"the same call in another Python process gives {here}. Under "
                        f"torchrun every rank is a process of its own, so its seeds would "
                        f"not follow from base_seed and the mesh alone. These ranks "
                        f"agreed only because they were forked from one process (step 2). "
                        f"Something in the function changes from process to process: "
                        f"hash() of a string, say, which Python salts per process.")
    return None


def _stand_in_rows(fn, dp: int, tp: int) -> list | Exception:
    """What :func:`seeds_on_mesh` returns on every rank of a ``(dp, tp)`` mesh, computed in
    this process with a stand-in mesh per coordinate (and :func:`_stand_in_dist`); the
    exception instead if ``fn`` cannot run on one."""
    rows = []
    for d, t in itertools.product(range(dp), range(tp)):
        mesh = _stand_in_mesh(dp, tp, d, t)
        try:
            with _stand_in_dist(mesh.get_rank(), dp * tp):
                seeds = {base: fn(base, mesh) for base in BASE_SEEDS}
                again = {base: fn(base, mesh) for base in BASE_SEEDS}
        except Exception as err:
            return err
        rows.append({"dp_rank": d, "tp_rank": t, "seeds": seeds, "again": again})
    return rows


def _is_seed(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 63


def _where(dp: int, tp: int) -> str:
    return f"(dp {dp}, tp {tp})"


DRAWS = {"attention_probs": "shard", "attention_output": "whole", "mlp_output": "whole"}
"""The exercise's three dropout draws in a tensor-parallel transformer layer, and how a tp
group holds the activation each one drops from: ``"shard"``, each tp rank its own part
(the attention probabilities of its own heads), or ``"whole"``, every tp rank a copy (the
output of a row-parallel layer after its all_reduce)."""


def _unwanted_pair(seeds: dict) -> tuple | None:
    """The first two (draw, coordinate) entries of ``seeds`` that share a seed but should
    draw independent masks, ordered so that the most telling mistake comes first; ``None``
    if there are none. Only the same whole draw within one dp coordinate (one tp group)
    should share a seed."""
    def kind(a, b):
        (da, ca), (db, cb) = a, b
        if da == db:
            return 0 if DRAWS[da] == "whole" else 1     # a draw repeated across dp, or a shard repeated
        return 2 if ca == cb else 3                     # two draws on one rank, or across ranks
    by_seed: dict = {}
    for key in sorted(seeds):                           # only entries with one seed can pair
        by_seed.setdefault(seeds[key], []).append(key)
    pairs = [(a, b) for keys in by_seed.values() for a, b in itertools.combinations(keys, 2)
             if not (a[0] == b[0] and DRAWS[a[0]] == "whole" and a[1][0] == b[1][0])]
    return min(pairs, key=lambda ab: (kind(*ab), ab), default=None)


def _judge(dp: int, tp: int, rows: list[dict]) -> str | None:
    """The first thing wrong with the seeds of one mesh, as a sentence, or ``None``."""
    shape = f"On a ({dp}, {tp}) mesh"
    names = ", ".join(f'"{d}"' for d in DRAWS)
    for row in rows:
        for base, got in row["seeds"].items():
            if not (isinstance(got, dict) and set(got) == set(DRAWS)
                    and all(map(_is_seed, got.values()))):
                return (f"{shape}, rank {_where(row['dp_rank'], row['tp_rank'])} returned "
                        f"{got!r} for base_seed={base}; return a dict with the keys {names}, "
                        f"each an int from 0 to 2**63 - 1.")
            if row["again"][base] != got:
                return (f"{shape}, rank {_where(row['dp_rank'], row['tp_rank'])} returned "
                        f"{got} and then {row['again'][base]} for the same base_seed={base}. "
                        f"Derive the seeds from base_seed and the mesh only, so that a "
                        f"rerun draws the same masks.")
    for base in BASE_SEEDS:
        seeds = {(draw, (r["dp_rank"], r["tp_rank"])): r["seeds"][base][draw]
                 for r in rows for draw in DRAWS}
        for draw, held in DRAWS.items():
            for d in range(dp):
                group_seeds = [seeds[draw, (d, t)] for t in range(tp)]
                if held == "whole" and len(set(group_seeds)) > 1:
                    a, b = next((t, u) for t, u in itertools.combinations(range(tp), 2)
                                if group_seeds[t] != group_seeds[u])
                    return (f"{shape}, ranks {_where(d, a)} and {_where(d, b)} are in the same "
                            f"tensor-parallel group but get the {draw} seeds {group_seeds[a]} and "
                            f"{group_seeds[b]}. Each holds a copy of that whole activation: "
                            f"they would drop different units of it, and their copies would no "
                            f"longer agree (step 4).")
        pair = _unwanted_pair(seeds)
        if pair:
            (da, a), (db, b) = pair
            s = seeds[pair[0]]
            if da == db and DRAWS[da] == "whole":
                return (f"{shape}, the data-parallel groups dp {a[0]} and dp {b[0]} get the same "
                        f"{da} seed {s}: sample k of dp {a[0]}'s batch and sample k of dp "
                        f"{b[0]}'s lose the same units (step 2), where one process would draw a "
                        f"mask for each sample.")
            if da == db:
                if a[1] == b[1]:      # the same tp rank in two dp groups: Megatron-LM's default
                    what = ("they hold the same heads of different samples, and would drop the "
                            "same positions of both. That is Megatron-LM's default (its "
                            "tensor-parallel seed depends on the tp rank only); this exercise "
                            "asks for what one process would draw, as step 2 did")
                elif a[0] == b[0]:    # one tp group: different heads of the same samples
                    what = ("they hold different heads of the same samples, and would drop the "
                            "same positions in each, so the mask of the whole activation "
                            "repeats itself head group by head group")
                else:
                    what = ("they hold different heads of different samples, and would draw one "
                            "mask where two independent ones belong")
                return (f"{shape}, ranks {_where(*a)} and {_where(*b)} get the same {da} seed "
                        f"{s}: {what}.")
            if a == b:
                return (f"{shape}, rank {_where(*a)} gets the same seed {s} for {da} and for "
                        f"{db}: a generator started from one seed draws one sequence, so the "
                        f"two dropouts would lose the same positions, where one process draws "
                        f"them one after the other from its stream.")
            return (f"{shape}, the seed {s} is rank {_where(*a)}'s {da} seed and rank "
                    f"{_where(*b)}'s {db} seed: two masks that should be independent would come "
                    f"from one stream, and repeat each other. Keep the seeds of different draws "
                    f"apart (Megatron-LM adds an offset for the same reason).")
    first, second = BASE_SEEDS
    for r in rows:
        if r["seeds"][first] == r["seeds"][second]:
            return (f"{shape}, rank {_where(r['dp_rank'], r['tp_rank'])} returns "
                    f"{r['seeds'][first]} for base_seed={first} and for base_seed={second}: "
                    f"the seeds must change with base_seed, or no run can draw other masks.")
    return None


def check_dropout_seeds(group, fn) -> Verdict:
    """Notebook 17's exercise: ``fn(base_seed, mesh) -> {draw: seed}`` gives this rank, on a
    device mesh with dimensions ``("dp", "tp")``, a seed (an int from 0 to 2**63 - 1) for
    each dropout draw of :data:`DRAWS` in a tensor-parallel transformer layer. The learner
    decides which ranks share each seed; the check holds the masks to what one process
    training on the whole global batch would draw:

    * a draw on an activation every tp rank holds whole: the same seed within a tp group
      (or the copies stop agreeing), different between dp ranks (other samples);
    * a draw on an activation each tp rank holds a shard of: a seed on every rank of its own;
    * no seed shared by two draws that should be independent (two draws on one rank, or
      on different ranks);
    * all derived from ``base_seed`` and the mesh only (a second call, and a call in another
      process, give the same seeds; another ``base_seed`` gives other seeds).

    Runs ``fn`` on real ranks at world size 4 on the meshes :data:`MESHES` (the group is
    resized, then restored), then in this process on stand-in meshes of the shapes
    :data:`STAND_IN_MESHES` (a coordinate at a time; a failed verdict that says so if ``fn``
    needs more of a mesh than :class:`_StandInMesh` offers), with base seeds :data:`BASE_SEEDS`, and says what the
    first mistake would do to the masks.

    Returns:
        A :class:`~reducelab.checks.Verdict`.
    """
    if not callable(fn):
        return failed(f"Pass your function itself, dropout_seeds, not {fn!r}.")
    with restoring_world_size(group):
        group.resize(4)
        for dp, tp in MESHES:
            try:
                rows = group.run(seeds_on_mesh, fn, dp, tp)
            except RankError as err:
                return raised_on_ranks(f"On a ({dp}, {tp}) mesh", err)
            problem = _judge(dp, tp, rows) or _another_process(fn, dp, tp, rows)
            if problem:
                return failed(problem)
    skipped = None
    for dp, tp in STAND_IN_MESHES:
        rows = _stand_in_rows(fn, dp, tp)
        if isinstance(rows, Exception):
            skipped = rows
            break
        problem = _judge(dp, tp, rows)
        if problem:
            return failed(f"Your seeds hold on the 4 ranks' meshes, but not on a larger one "
                          f"(run in this process with a stand-in mesh, {dp * tp} coordinates). "
                          f"{problem}")
    meshes = ", ".join(f"({dp}, {tp})" for dp, tp in MESHES)
    larger = " and ".join(f"({dp}, {tp})" for dp, tp in STAND_IN_MESHES)
    if skipped is not None:
        return failed(f"Your seeds hold on the (dp, tp) meshes {meshes}, but the check could not "
                      f"run your function on its larger stand-in meshes {larger}, where seeds that "
                      f"are apart on 4 ranks can collide: it raised "
                      f"{type(skipped).__name__}: {skipped}. The stand-in mesh answers "
                      f"get_local_rank, get_coordinate, size, get_rank and mesh[\"dp\"], and "
                      f"dist.get_rank() and dist.get_world_size(); use those.")
    return passed(f"On the (dp, tp) meshes {meshes}, and on stand-in meshes {larger}, with base seeds "
                  f"{' and '.join(map(str, BASE_SEEDS))}: attention_output and mlp_output each "
                  f"have one seed per tp group, different across dp, so the tp ranks' copies stay "
                  f"equal and every sample gets masks of its own; attention_probs has a seed on "
                  f"every rank; no two draws share a seed; and the same base seed gives the same "
                  f"seeds again, in any process.")
