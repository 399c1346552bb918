"""Checks for notebook 17 (which random numbers should match across ranks), and the code
it runs on the ranks.

This module imports only ``torch`` (and the standard library), so its functions can run
on the ranks:

* :func:`seeds_on_mesh` runs a learner's seeding function on a real ``(dp, tp)`` device
  mesh;
* :func:`mask` draws the dropout mask a seed gives;
* :func:`check_dropout_seeds` checks the exercise: dropout seeds for data-parallel and
  tensor-parallel ranks.

Moved here from notebook 13's module (``checks/ddp_model.py``) when notebook 13 was split;
the check's behaviour is unchanged.

Sources: two random-number streams for tensor parallelism, one the same on every rank of a
tensor-parallel group and one different on each of them (Shoeybi et al., "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism", 2019,
arXiv:1909.08053, appendix B.2; ``model_parallel_cuda_manual_seed`` in
``megatron/core/tensor_parallel/random.py``).
"""
from __future__ import annotations

import itertools

import torch

from . import Verdict, failed, passed, raised_on_ranks, restoring_world_size
from ..errors import RankError

MESHES = ((2, 2), (4, 1), (1, 4))
"""The ``(dp, tp)`` mesh shapes the exercise's check runs, all at world size 4."""
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
    ``shape``, ``ndim``, ``mesh_dim_names``, ``mesh["dp"]``). Anything else raises
    ``AttributeError``, and the check then leaves this comparison out."""

    def __init__(self, sizes: dict, coords: dict, names: tuple):
        self._sizes, self._coords, self.mesh_dim_names = sizes, coords, names
        self.shape = tuple(sizes[n] for n in names)
        self.ndim = len(names)

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
                            {n: self._coords[n] for n in names}, names)


def _another_process(fn, dp: int, tp: int, rows: list) -> str | None:
    """Call ``fn`` in this process (not a rank) with a stand-in mesh of each rank's
    coordinates; a message if it gives other seeds than that rank did, ``None`` if it gives
    the same or cannot run here."""
    for row in rows:
        mesh = _StandInMesh({"dp": dp, "tp": tp},
                            {"dp": row["dp_rank"], "tp": row["tp_rank"]}, ("dp", "tp"))
        for base, seeds in row["seeds"].items():
            try:
                here = fn(base, mesh)
            except Exception:
                return None
            if here != seeds:
                return (f"On a ({dp}, {tp}) mesh, rank (dp {row['dp_rank']}, tp "
                        f"{row['tp_rank']}) got the seeds {seeds} with base seed {base}, and "
                        f"the same call in another Python process gives {here}. Under "
                        f"torchrun every rank is a process of its own, so its seeds would "
                        f"not follow from base_seed and the mesh alone (rule 3). These ranks "
                        f"agreed only because they were forked from one process (step 2). "
                        f"Something in the function changes from process to process: "
                        f"hash() of a string, say, which Python salts per process.")
    return None


def _is_seed(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 63


def _where(dp: int, tp: int) -> str:
    return f"(dp {dp}, tp {tp})"


def _judge(dp: int, tp: int, rows: list[dict]) -> str | None:
    """The first thing wrong with the seeds of one mesh, as a sentence, or ``None``."""
    shape = f"On a ({dp}, {tp}) mesh"
    for row in rows:
        for base, got in row["seeds"].items():
            if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(map(_is_seed, got))):
                return (f"{shape}, rank {_where(row['dp_rank'], row['tp_rank'])} returned "
                        f"{got!r} for base_seed={base}; return two ints from 0 to "
                        f"2**63 - 1: (replicated_seed, sharded_seed).")
            if row["again"][base] != got:
                return (f"{shape}, rank {_where(row['dp_rank'], row['tp_rank'])} returned "
                        f"{got} and then {row['again'][base]} for the same base_seed={base}. "
                        f"Derive the seeds from base_seed and the mesh only, so that a "
                        f"rerun draws the same masks.")
    for base in BASE_SEEDS:
        rep = {(r["dp_rank"], r["tp_rank"]): r["seeds"][base][0] for r in rows}
        shd = {(r["dp_rank"], r["tp_rank"]): r["seeds"][base][1] for r in rows}
        for d in range(dp):
            seeds = {rep[d, t] for t in range(tp)}
            if len(seeds) > 1:
                a, b = next((t, u) for t, u in itertools.combinations(range(tp), 2)
                            if rep[d, t] != rep[d, u])
                return (f"{shape}, ranks {_where(d, a)} and {_where(d, b)} are in the same "
                        f"tensor-parallel group but get the replicated seeds {rep[d, a]} and "
                        f"{rep[d, b]}: they would drop different units of an activation they "
                        f"both hold whole, and their copies of it would no longer agree. The "
                        f"replicated seed must be the same within a tp group.")
        for d, e in itertools.combinations(range(dp), 2):
            if rep[d, 0] == rep[e, 0]:
                return (f"{shape}, the data-parallel groups dp {d} and dp {e} get the same "
                        f"replicated seed {rep[d, 0]}: sample k of dp {d}'s batch and sample k "
                        f"of dp {e}'s lose the same units (step 2). The replicated seed must "
                        f"differ between dp ranks (rule 1).")
        for a, b in itertools.combinations(sorted(shd), 2):
            if shd[a] == shd[b]:
                if a[1] == b[1]:      # the same tp rank in two dp groups: Megatron-LM's default
                    what = (f"they hold the same shard (the same units) of different samples, and "
                            f"would drop the same units of both. That is Megatron-LM's default "
                            f"(its tensor-parallel seed depends on the tp rank only); the "
                            f"exercise's rule 2 excludes it on purpose, as rule 1 does for the "
                            f"replicated seed")
                elif a[0] == b[0]:    # one tp group: two shards of the same samples
                    what = (f"they hold different units of the same samples, and would drop the "
                            f"same positions of their shards, so the mask of the whole activation "
                            f"repeats itself shard by shard")
                else:
                    what = (f"they hold different units of different samples, and would draw one "
                            f"mask where two independent ones belong")
                return (f"{shape}, ranks {_where(*a)} and {_where(*b)} get the same sharded "
                        f"seed {shd[a]}: {what}. Every rank of the mesh needs a sharded seed of "
                        f"its own (rule 2).")
        both = set(rep.values()) & set(shd.values())
        if both:
            s = min(both)
            owner = next(k for k, v in rep.items() if v == s)
            other = next(k for k, v in shd.items() if v == s)
            whose = (f"both the replicated and the sharded seed of rank {_where(*owner)}"
                     if owner == other else f"the replicated seed of rank {_where(*owner)} and "
                                            f"the sharded seed of rank {_where(*other)}")
            return (f"{shape}, the seed {s} is {whose}: two random streams that should be "
                    f"independent are one stream, and the masks repeat. Keep the sharded "
                    f"seeds apart from every replicated seed (Megatron-LM adds an offset for "
                    f"the same reason).")
    first, second = BASE_SEEDS
    for r in rows:
        if r["seeds"][first] == r["seeds"][second]:
            return (f"{shape}, rank {_where(r['dp_rank'], r['tp_rank'])} returns "
                    f"{r['seeds'][first]} for base_seed={first} and for base_seed={second}: "
                    f"the seeds must change with base_seed, or no run can draw other masks.")
    return None


def check_dropout_seeds(group, fn) -> Verdict:
    """Notebook 17's exercise: ``fn(base_seed, mesh) -> (replicated_seed, sharded_seed)``
    gives this rank two seeds (ints from 0 to 2**63 - 1), on a device mesh with
    dimensions ``("dp", "tp")``:

    * the *replicated* seed, for dropout on activations that every rank of a
      tensor-parallel group holds whole: the same within a tp group, different
      between dp ranks;
    * the *sharded* seed, for dropout on activations each tp rank holds a shard of:
      different on every rank of the mesh, and never equal to a replicated seed;
    * both derived from ``base_seed`` and the mesh only (a second call gives the same
      seeds; another ``base_seed`` gives other seeds).

    Runs ``fn`` on real ranks at world size 4 on the meshes :data:`MESHES` (the group is
    resized, then restored), with base seeds :data:`BASE_SEEDS`, and says what is wrong
    with the first seeds that break a rule.

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
    meshes = ", ".join(f"({dp}, {tp})" for dp, tp in MESHES)
    return passed(f"On the (dp, tp) meshes {meshes}, with base seeds "
                  f"{' and '.join(map(str, BASE_SEEDS))}: every tp group shares one replicated "
                  f"seed and the dp ranks' replicated seeds differ; every rank has a sharded "
                  f"seed of its own, apart from every replicated seed; and the same base seed "
                  f"gives the same seeds again. Dropout on a replicated activation now keeps "
                  f"the tp ranks' copies equal, and no two ranks drop the same units of "
                  f"different data.")
