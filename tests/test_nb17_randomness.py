"""Tests of notebook 17 (which random numbers should match across ranks): every fact the
notebook states, run with the notebook's own rank functions (read from its code cells) on
real gloo ranks; each question's answer re-derived from a run; FSDP2's patchwork of
initial weights; the explorer driven headlessly through its settings; the exercise's check
on the solution, the stub and each usual mistake (moved from notebook 13's tests with the
exercise); and the figures."""
from __future__ import annotations

import base64
import html
import json
import pathlib
import re
import sys
import types

import cloudpickle
import numpy as np
import pytest
import torch

import conftest
from conftest import NotebookCells, notebook_module, stored_text
from reducelab import LocalGroup
from reducelab.checks.answers import WHY
from reducelab.checks.randomness import BASE_SEEDS, MESHES, check_dropout_seeds, mask
from reducelab.plots import MIN_FONT
from reducelab.plots.ddp_model import mask_figure, mask_labels
from reducelab.plots.randomness import MaskAgreement, mask_names, patchwork_figure, source_rows
from reducelab.widgets.randomness import (MESH_SHAPES, SCHEMES, MaskResult, RandomnessExplorer,
                                          describe_masks)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "17_randomness_across_ranks.ipynb"
CELLS = json.loads(NOTEBOOK.read_text())["cells"]
KEEP = {"SEEDINGS", "SCHEMES"}
"""Module-level names the notebook assigns (tables) that its functions need."""


def notebook_functions() -> types.ModuleType:
    """The notebook's imports, classes, ``def``s and the assignments in :data:`KEEP`, in a
    module the ranks cannot import (:func:`conftest.notebook_module`)."""
    return notebook_module(CELLS, "nb17_cells", KEEP,
                           preamble="from reducelab import LocalGroup, RankError, setup")


NB = notebook_functions()


_CELLS = NotebookCells(CELLS)
source_with, cell_with, markdown = _CELLS.source_with, _CELLS.cell_with, _CELLS.markdown


@pytest.fixture(autouse=True)
def four_ranks(group):
    group.resize(4)
    yield


# --- step 1: initial weights under DDP and FSDP2 ---------------------------------------------------
def test_fully_shard_keeps_each_ranks_own_shard_a_patchwork(group):
    """Question 1: full_tensor() is the same on every rank, and row block k is rank k's
    own initialisation, so the whole is no rank's weight."""
    out = group.run(NB.init_then_wrap, "fully_shard", lambda rank: rank)
    inits = torch.stack([own for own, _ in out])
    full = out[0][1]
    assert all(torch.equal(w, full) for _, w in out)
    assert all(torch.equal(full[2 * k:2 * k + 2], inits[k][2 * k:2 * k + 2]) for k in range(4))
    assert not any(torch.equal(full, inits[k]) for k in range(4))
    assert source_rows(full.numpy(), inits.numpy()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "The real run gives (True, False)." in stored_text(cell_with("actual_1 = ("))


def test_ddp_broadcasts_and_one_seed_makes_fsdp2_whole(group):
    for how, seed_of, rank0s in (("DDP", lambda rank: rank, True), ("DDP", lambda rank: 0, True),
                                 ("fully_shard", lambda rank: 0, True)):
        out = group.run(NB.init_then_wrap, how, seed_of)
        assert all(torch.equal(w, out[0][1]) for _, w in out)
        assert torch.equal(out[0][1], out[0][0]) is rank0s
    text = stored_text(cell_with('for how in ("DDP", "fully_shard"):'))
    assert re.search(r"fully_shard\s+seed = rank\s+whole weight the same on every rank: True\s+"
                     r"rank 0's initial weight: False", text)
    assert text.count("rank 0's initial weight: True") == 3


def test_the_source_shown_is_where_fully_shard_keeps_its_chunk():
    text = stored_text(cell_with('"_chunk_with_empty(param_data" in line'))
    assert "chunks = _chunk_with_empty(param_data, shard_world_size, dim=shard_dim)" in text
    assert "sharded_param = chunks[shard_rank]" in text
    import inspect
    from torch.distributed.fsdp._fully_shard import _fully_shard, _fsdp_param
    assert "broadcast" not in inspect.getsource(_fsdp_param) + inspect.getsource(_fully_shard)


# --- step 2: dropout on data-parallel ranks (moved from notebook 13) ------------------------------
def test_dropout_masks_follow_the_seeds(group):
    same_seed = torch.stack(group.run(NB.dropout_mask, NB.SEEDINGS["torch.manual_seed(0) on every rank"]))
    per_rank = torch.stack(group.run(NB.dropout_mask, NB.SEEDINGS["torch.manual_seed(rank)"]))
    assert all(torch.equal(m, same_seed[0]) for m in same_seed)
    assert len({tuple(m.tolist()) for m in per_rank}) == 4


def test_zero_gradient_rows(group):
    one = group.run(NB.zero_rows, lambda rank: 0)
    own = group.run(NB.zero_rows, lambda rank: 1000 + rank)
    assert len(set(one)) == 1 and len(set(own)) == 1                  # DDP averaged: every rank agrees
    assert abs(one[0] - 32) <= 10 and own[0] <= 10 and one[0] > 3 * own[0]
    assert f"The real run gives ({one[0]}, {own[0]})." in stored_text(cell_with("counts = ("))
    assert "(1/2)^4: about 4 of 64" in WHY["17"][2]


def test_fresh_ranks_share_a_generator_and_dataloader_workers_follow_the_rank_seed(group):
    with LocalGroup(world_size=2, timeout=60) as fresh:
        assert len(set(fresh.run(torch.initial_seed))) == 1
    same_seed = group.run(NB.worker_seeds, NB.SEEDINGS["torch.manual_seed(0) on every rank"])
    own = group.run(NB.worker_seeds, NB.SEEDINGS["torch.manual_seed(rank)"])
    assert all(s == same_seed[0] for s in same_seed) and len({tuple(s) for s in own}) == 4
    assert all(len(set(s)) == 2 for s in own)                         # two workers, two seeds


def test_unseeded_ranks_cpu_from_the_os_cuda_from_one_fixed_seed():
    """A third review (17-1): on CUDA every process's default generator starts from the fixed
    default_rng_seed_val, so unseeded GPU ranks draw the same masks; on CPU a process started
    afresh seeds from the OS, a forked one copies its parent. The header is the installed
    torch's; the CPU half is run, here and in the stored output."""
    import subprocess
    header = pathlib.Path(torch.__file__).parent / "include" / "c10" / "core" / "GeneratorImpl.h"
    assert "constexpr uint64_t default_rng_seed_val = 67280421310721;" in header.read_text()
    seeds = {int(subprocess.run([sys.executable, "-c", "import torch; print(torch.initial_seed())"],
                                capture_output=True, text=True, check=True).stdout) for _ in range(2)}
    assert len(seeds) == 2                                            # afresh: one seed each
    out = stored_text(cell_with("torch.initial_seed"))
    for line in ("torch.initial_seed(), the same on 4 forked ranks: True",
                 "torch.initial_seed(), the same in 2 processes started afresh: False",
                 "constexpr uint64_t default_rng_seed_val = 67280421310721;"):
        assert line in out, line
    text = markdown()
    for cited in ("`getDefaultCPUGenerator` in `aten/src/ATen/CPUGeneratorImpl.cpp`", "`c10/core/GeneratorImpl.h`",
                  "`createCUDAGenerator` in `aten/src/ATen/cuda/CUDAGeneratorImpl.cpp`",
                  "unseeded GPU ranks draw the same dropout masks", "(no CUDA ran here)"):
        assert cited in text, cited


def test_a_dataloaders_own_shuffle_and_accelerates_set_seed_are_cited():
    """A third review (17-3, 17-4): a DataLoader's shuffle=True shuffles with its generator=,
    or without one with a generator seeded from the rank's (RandomSampler.__iter__, read here); accelerate's
    set_seed adds the process index only with device_specific=True, cited by its source and
    said not to be installed."""
    import inspect
    from torch.utils.data import RandomSampler
    body = inspect.getsource(RandomSampler.__iter__)
    assert "if self.generator is None:" in body and "torch.empty((), dtype=torch.int64).random_()" in body
    text = markdown()
    assert "else:\n            generator = self.generator" in body            # generator= is used as given
    # review 5 (the core past one study unit): the sources moved to Further reading
    reading = text.split("## Further reading")[1]
    assert ("each rank shuffles the whole dataset, with the DataLoader's `generator=` or, without one, a "
            "generator seeded from the rank's global one") in text
    assert "`RandomSampler.__iter__` in `torch/utils/data/sampler.py`" in reading
    assert "and so does accelerate's `set_seed(seed)` unless `device_specific=True`" in text
    assert ("`set_seed` in huggingface/accelerate `src/accelerate/utils/random.py` (`device_specific=True` adds "
            "the process index)") in reading


# --- step 3: one stream, two purposes -----------------------------------------------------------------
def test_turning_dropout_on_changes_the_data_order(group):
    """Question 3: a model without dropout draws nothing before randperm; adding dropout
    (p=0.1) draws a mask first and moves the global stream. The question compares no
    dropout with dropout, so it does not hinge on what p=0.0 draws (a second review)."""
    before, after = group.run(NB.epoch_order, False)[0], group.run(NB.epoch_order, True)[0]
    assert before != after and sorted(before) == sorted(after) == list(range(16))
    torch.manual_seed(0)
    assert before == torch.randperm(16).tolist()                 # nothing drew before randperm
    question = source_with("**Question 3.**", "markdown")
    assert "0.0" not in question and "no dropout" in question
    assert "0.0" not in source_with("def epoch_order(", "code")
    stored = stored_text(cell_with("actual_3 = "))
    assert "The real run gives False." in stored and "p=0.0" not in stored
    # the order after dropout's draw depends on how many numbers the CPU's bernoulli kernel
    # draws (torch's own kernel, or MKL's on Intel CPUs in some builds), so the stored
    # output shows only the order without dropout, which randperm alone decides
    assert f"order without dropout: {before}" in stored
    assert "order with dropout, p=0.1: another order of the same 16 samples" in stored


def test_a_generator_per_purpose_and_fork_rng(group):
    for fn in (NB.own_generator, NB.forked):
        assert group.run(fn, False)[0] == group.run(fn, True)[0]
    assert group.run(NB.forked_twice) == [True] * 4
    text = stored_text(cell_with("def own_generator(dropout):"))
    assert text.count("the same order with dropout and without: True") == 2
    assert "the same mask in both: True" in text


def test_distributed_sampler_needs_one_seed(group):
    import collections
    for seed_of, missing in ((lambda rank: 0, False), (lambda rank: rank, True)):
        shares = group.run(NB.sampler_indices, seed_of)
        seen = collections.Counter(i for share in shares for i in share)
        assert sum(seen.values()) == 16 and (set(seen) != set(range(16))) is missing
    text = stored_text(cell_with("def sampler_indices("))
    assert "seed=0 on every rank  samples no rank sees: []; samples seen more than once: []" in text
    assert "g.manual_seed(self.seed + self.epoch)" in stored_text(cell_with("DistributedSampler.__iter__"))


# --- step 4: dp x tp (moved from notebook 13) --------------------------------------------------------
def test_replicated_masks_on_a_dp_tp_mesh(group):
    out = group.run(NB.replicated_masks)
    coords = [c for c, _ in out]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    m = {name: torch.stack([masks[name] for _, masks in out]) for name in out[0][1]}
    by_dp = m["seed = dp rank"]
    assert torch.equal(by_dp[0], by_dp[1]) and torch.equal(by_dp[2], by_dp[3])
    assert not torch.equal(by_dp[0], by_dp[2])
    assert not torch.equal(m["seed = rank"][0], m["seed = rank"][1])
    assert all(torch.equal(x, m["seed 0 on every rank"][0]) for x in m["seed 0 on every rank"])
    assert "reference=first_of_tp_group" in source_with("def replicated_masks(", "code")
    reference = [coords.index((d, 0)) for d, _ in coords]             # the cell's first_of_tp_group
    assert reference == [0, 0, 2, 2]
    assert mask_labels(by_dp.numpy(), reference) == ["rank 0's", "same as rank 0", "rank 2's",
                                                     "same as rank 2"]


def test_the_dp_tp_figure_labels_each_rank_against_its_tp_group(drawn):
    """Figure [38] (a second review): the lesson compares masks within each tp group, so
    the right side names the first rank of the rank's tp group, not rank 0, and a thick
    line separates the tp groups."""
    dropped = np.array([[1, 0, 1, 0], [1, 0, 1, 0], [0, 1, 1, 0], [0, 1, 1, 0]], bool)
    assert mask_figure({"seed = dp rank": dropped}, reference=[0, 0, 2, 2]).startswith(PNG)
    ax = drawn[-1].axes[0]
    right = [t.get_text() for child in ax.child_axes for t in child.get_yticklabels()]
    assert right == ["rank 0's", "same as rank 0", "rank 2's", "same as rank 2"]
    assert [line.get_ydata()[0] for line in ax.get_lines() if line.get_linewidth() >= 3] == [1.5]
    assert mask_labels(dropped) == ["rank 0's", "same", "differs", "differs"]
    with pytest.raises(ValueError, match="reference"):
        mask_figure({"a": dropped}, reference=[0, 0, 2])


# --- the explorer ---------------------------------------------------------------------------------------
@pytest.fixture()
def explorer(group):
    return RandomnessExplorer(group, NB.masks_on_mesh)


def test_the_explorers_rank_function_runs_and_the_default_shows_four_masks(explorer, group):
    r = explorer.result
    assert explorer.error is None and r.coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert r.names == ["A", "B", "C", "D"] and not r.tp_groups_agree() and r.dp_groups_differ()
    assert bytes(explorer.image.value[:8]) == PNG
    assert explorer.text() in stored_text(cell_with("explorer = RandomnessExplorer("))
    direct = group.run(NB.masks_on_mesh, "seed = dp rank", (2, 2), 0.5)   # the cell's function, by hand
    assert [tuple(o["coord"]) for o in direct] == r.coords


@pytest.mark.parametrize("scheme, shape, names, tp_rule, dp_rule", [
    ("seed = dp rank", (2, 2), ["A", "A", "B", "B"], "yes", "yes"),
    ("seed = tp rank", (2, 2), ["A", "B", "A", "B"], "NO", "NO"),
    ("one seed", (4, 1), ["A"] * 4, "yes", "NO"),
    ("seed = rank", (1, 4), ["A", "B", "C", "D"], "NO", "only one dp group"),
])
def test_controls_change_the_figure_and_the_message(explorer, scheme, shape, names, tp_rule, dp_rule):
    first = bytes(explorer.image.value)
    explorer.controls["scheme"].value = scheme
    explorer.controls["shape"].value = shape
    r = explorer.result
    assert r.names == names and bytes(explorer.image.value) != first
    message = html.unescape(explorer.message.value)
    assert f"Every tp group shares one mask: {tp_rule}." in message
    assert f"The dp groups' masks differ: {dp_rule}." in message


def test_p_changes_the_masks_not_who_agrees(explorer):
    explorer.controls["scheme"].value = "seed = dp rank"
    low = explorer.result.dropped.mean()
    explorer.controls["p"].value = 0.9
    assert explorer.result.dropped.mean() > low and explorer.result.names == ["A", "A", "B", "B"]


def test_explorer_rejects_bad_values_and_follows_a_new_group(group):
    with pytest.raises(ValueError, match="one seed, seed = rank"):
        RandomnessExplorer(group, NB.masks_on_mesh, scheme="seed = time")
    with pytest.raises(ValueError, match="shape must be one of"):
        RandomnessExplorer(group, NB.masks_on_mesh, shape=(2, 4))
    with pytest.raises(ValueError, match="p must be from 0.1 to 0.9"):
        RandomnessExplorer(group, NB.masks_on_mesh, p=1.0)
    g = LocalGroup(world_size=4, timeout=60)
    ex = RandomnessExplorer(g, NB.masks_on_mesh)
    g.close()
    ex.controls["scheme"].value = "one seed"
    assert ex.group is not g and ex.error is None and ex.result.names == ["A"] * 4
    assert SCHEMES == tuple(NB.SCHEMES) and MESH_SHAPES == ((4, 1), (2, 2), (1, 4))


def test_the_stored_explorer_shows_a_static_png():
    cell = cell_with("explorer = RandomnessExplorer(")
    data = next(o["data"] for o in cell["outputs"] if "image/png" in o.get("data", {}))
    assert "application/vnd.jupyter.widget-view+json" in data
    assert base64.b64decode("".join(data["image/png"]))[:8] == PNG


# --- the exercise (moved from notebook 13) ----------------------------------------------------------------
def solution_lines() -> list[str]:
    path = ROOT / "notebooks" / "solutions" / "17_dropout_seeds.py"
    return [line.strip() for line in path.read_text().splitlines()
            if len(line.strip()) > 12 and not line.strip().startswith(("#", '"', "def "))]


def test_solution_passes_and_the_world_size_is_restored(group):
    group.resize(2)
    verdict = check_dropout_seeds(group, conftest.load_solution("17_dropout_seeds").dropout_seeds)
    assert verdict, verdict.message
    assert "(2, 2), (4, 1), (1, 4)" in verdict.message and group.world_size == 2
    assert "stand-in meshes (64, 8) and (8, 64)" in verdict.message


def test_the_notebook_stub_fails_without_the_solution(group):
    verdict = check_dropout_seeds(group, NB.dropout_seeds)
    assert not verdict and "get the same attention_output seed 0" in verdict.message
    assert "check_dropout_seeds(group, dropout_seeds)" in \
        source_with("from reducelab.checks.randomness import check_dropout_seeds")


def _rank(mesh):
    return mesh.get_local_rank("dp") * mesh["tp"].size() + mesh.get_local_rank("tp")


def _seeds(probs, output, mlp):
    return {"attention_probs": probs, "attention_output": output, "mlp_output": mlp}


def whole_by_global_rank(base, mesh):
    return _seeds(base + 200 + _rank(mesh), base + _rank(mesh), base + 100 + _rank(mesh))


def one_seed_for_all(base, mesh):
    return _seeds(base, base, base)


def shard_by_tp_only(base, mesh):           # Megatron-LM's default tensor-parallel seed
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    return _seeds(base + 100 + t, base + d, base + 50 + d)


def shard_by_dp_only(base, mesh):
    d = mesh.get_local_rank("dp")
    return _seeds(base + 100 + d, base + d, base + 50 + d)


def shard_by_sum_of_coordinates(base, mesh):
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    return _seeds(base + 100 + d + t, base + d, base + 50 + d)


def one_seed_for_both_whole_draws(base, mesh):
    d = mesh.get_local_rank("dp")
    return _seeds(base + 100 + _rank(mesh), base + d, base + d)


def shard_overlapping_a_whole_block(base, mesh):
    d = mesh.get_local_rank("dp")
    return _seeds(base + 1 + _rank(mesh), base + d, base + 10 + d)


def random_seeds(base, mesh):
    import random
    return _seeds(*(random.randrange(2 ** 40) for _ in range(3)))


def ignores_base(base, mesh):
    d = mesh.get_local_rank("dp")
    return _seeds(100 + _rank(mesh), d, 50 + d)


def offsets_of_ten(base, mesh):             # apart on 4 ranks; from dp = 11 on, rank 11 = 10 + dp 1
    d = mesh.get_local_rank("dp")
    return _seeds(base + _rank(mesh), base + 10 + d, base + 20 + d)


def offsets_of_ten_by_global_rank(base, mesh):   # the same, from dist.get_rank() (a sixth review, 17-1)
    import torch.distributed as dist
    d = mesh.get_local_rank("dp")
    return _seeds(base + dist.get_rank(), base + 10 + d, base + 20 + d)


def needs_more_of_a_mesh(base, mesh):       # right on 4 ranks; the stand-in has no get_group
    d, n = mesh.get_local_rank("dp"), mesh["dp"].size()
    return _seeds(base + 2 * n + _rank(mesh) + 0 * mesh.get_group("tp").size(), base + d, base + n + d)


def a_pair_as_before(base, mesh):           # the exercise's old (replicated, sharded) pair
    return base + mesh.get_local_rank("dp"), base + 100 + _rank(mesh)


@pytest.mark.parametrize("mistake, explanation", [
    (whole_by_global_rank, "ranks (dp 0, tp 0) and (dp 0, tp 1) are in the same tensor-parallel group but "
                           "get the attention_output seeds 0 and 1. Each holds a copy of that whole activation"),
    (one_seed_for_all, "the data-parallel groups dp 0 and dp 1 get the same attention_output seed 0: sample k "
                       "of dp 0's batch and sample k of dp 1's lose the same units (step 2)"),
    (shard_by_tp_only, "ranks (dp 0, tp 0) and (dp 1, tp 0) get the same attention_probs seed 100: they hold the "
                       "same heads of different samples, and would drop the same positions of both. That is "
                       "Megatron-LM's default"),
    (shard_by_dp_only, "ranks (dp 0, tp 0) and (dp 0, tp 1) get the same attention_probs seed 100: they hold "
                       "different heads of the same samples"),
    (shard_by_sum_of_coordinates, "ranks (dp 0, tp 1) and (dp 1, tp 0) get the same attention_probs seed 101: "
                                  "they hold different heads of different samples"),
    (one_seed_for_both_whole_draws, "rank (dp 0, tp 0) gets the same seed 0 for attention_output and for "
                                    "mlp_output: a generator started from one seed draws one sequence"),
    (shard_overlapping_a_whole_block, "the seed 1 is rank (dp 1, tp 0)'s attention_output seed and rank "
                                      "(dp 0, tp 0)'s attention_probs seed"),
    (random_seeds, "Derive the seeds from base_seed and the mesh only"),
    (ignores_base, "the seeds must change with base_seed"),
    # a fifth review (17-3): the 4-rank meshes missed collisions that need dp >= 11
    (offsets_of_ten, "Your seeds hold on the 4 ranks' meshes, but not on a larger one (run in this process with "
                     "a stand-in mesh, 512 coordinates). On a (64, 8) mesh, rank (dp 1, tp 3) gets the same seed "
                     "11 for attention_output and for attention_probs"),
    # a sixth review (17-1): dist.get_rank() raised in the kernel, and the larger meshes went unchecked
    (offsets_of_ten_by_global_rank, "Your seeds hold on the 4 ranks' meshes, but not on a larger one (run in "
                                    "this process with a stand-in mesh, 512 coordinates). On a (64, 8) mesh, "
                                    "rank (dp 1, tp 3) gets the same seed 11 for attention_output and for "
                                    "attention_probs"),
    (needs_more_of_a_mesh, "but the check could not run your function on its larger stand-in meshes (64, 8) "
                           "and (8, 64), where seeds that are apart on 4 ranks can collide: it raised "
                           "AttributeError"),
    (a_pair_as_before, 'return a dict with the keys "attention_probs", "attention_output", "mlp_output"'),
])
def test_each_usual_mistake_gets_its_explanation(group, mistake, explanation):
    verdict = check_dropout_seeds(group, mistake)
    assert not verdict and explanation in verdict.message, verdict.message
    assert not [line for line in solution_lines() if line in verdict.message]
    assert group.world_size == 4


def test_a_raising_function_and_a_non_function(group):
    def raises(base, mesh):
        return mesh.get_local_rank("pp"), 0
    verdict = check_dropout_seeds(group, raises)
    assert not verdict and "raised on the ranks" in verdict.message and "KeyError" in verdict.message
    assert not check_dropout_seeds(group, "dropout_seeds")


def test_masks_from_distinct_seeds_differ():
    seeds = range(10)
    assert len({tuple(mask(s).tolist()) for s in seeds}) == 10
    assert torch.equal(mask(3), mask(3)) and mask(3).dtype == torch.bool
    assert MESHES == ((2, 2), (4, 1), (1, 4)) and len(set(BASE_SEEDS)) == 2


# --- the figures -----------------------------------------------------------------------------------------
def test_static_figures(drawn):
    rng = np.random.default_rng(0)
    masks = {"a": rng.random((4, 16)) < 0.5, "b": rng.random((4, 16)) < 0.5}
    assert mask_figure(masks, title="t").startswith(PNG)
    key = [t for legend in drawn[-1].legends for t in legend.get_texts()]   # black means dropped
    assert [t.get_text() for t in key] == ["a dropped unit (black, cross-hatched)", "a kept unit (white)"]
    assert min(t.get_fontsize() for t in key) >= MIN_FONT
    with pytest.raises(ValueError, match="one shape"):
        mask_figure({"a": np.zeros((4, 16)), "b": np.zeros((4, 8))})
    with pytest.raises(ValueError, match="row_labels"):
        mask_figure(masks, row_labels=["x"])
    inits = rng.normal(0, 0.3, (4, 8, 4))
    full = np.concatenate([inits[k][2 * k:2 * k + 2] for k in range(4)])
    assert patchwork_figure(full, inits, "t").startswith(PNG)
    labels = [t.get_text() for ax in drawn[-1].axes for child in ax.child_axes
              for t in child.get_yticklabels()]
    assert labels.count("rank 3's init") == 2 and labels.count("= left") == 2 and labels.count("differs") == 6
    with pytest.raises(ValueError, match="inits must be"):
        patchwork_figure(full, inits[:, :4])


def test_mask_figure_names_each_mask_by_letter_not_colour_alone(drawn):
    dropped = np.array([[1, 0, 1, 0], [1, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 1]], bool)
    assert mask_names(dropped) == ["A", "A", "B", "C"]
    assert MaskAgreement().draw(dropped, [(0, 0), (0, 1), (1, 0), (1, 1)], "t").startswith(PNG)
    fig = drawn[-1]
    labels = [t.get_text() for ax in fig.axes for child in ax.child_axes for t in child.get_yticklabels()]
    assert labels == ["mask A", "mask A", "mask B", "mask C"]
    assert min(t.get_fontsize() for ax in fig.axes for t in ax.texts + ax.get_yticklabels()) >= MIN_FONT
    hatches = {p.get_hatch() for p in fig.axes[0].patches if p.get_width() > 1}
    assert len(hatches) == 3                                          # one hatch per mask, beside its colour
    with pytest.raises(ValueError, match="one coordinate per rank"):
        MaskAgreement().draw(dropped, [(0, 0)])
    r = MaskResult("seed = rank", (2, 2), 0.5, [(0, 0), (0, 1), (1, 0), (1, 1)], dropped)
    assert describe_masks(r) == ("seed = rank on dp=2 x tp=2, p=0.5: 3 different masks on 4 ranks. "
                                 "Every tp group shares one mask: NO. The dp groups' masks differ: yes.")


# --- the notebook's text --------------------------------------------------------------------------------
def test_header_and_cited_questions():
    head = source_with("# Which random numbers should match across ranks?", "markdown")
    assert re.search(r"\*About (3\d|4[0-5]) min to study · about \d+ s to run top to bottom · world size 4 · "
                     r"CPU only \(gloo\) · follows notebooks 05, 09 and 13 · parts marked optional: "
                     r"about 12 min more, after the lesson\*", head)
    # the optional parts (a third review: about 60 min for the whole; review 5: the core alone
    # 55-70 min), all after the summary: RNGStreams, unseeded ranks and DataLoader workers, the
    # DTensor aside and the explorer
    texts = ["".join(c["source"]) for c in CELLS if c["cell_type"] == "markdown"]
    optional = [t.splitlines()[0] for t in texts if t.splitlines()[0].endswith("(optional, after the lesson)")]
    assert optional == ["## Two streams for `F.dropout` (optional, after the lesson)",
                        "## Unseeded ranks and DataLoader workers (optional, after the lesson)",
                        "## DTensor's own random numbers (optional, after the lesson)",
                        "## Explore: masks on a mesh (optional, after the lesson)"], optional
    first = next(i for i, t in enumerate(texts) if t.startswith(optional[0]))
    assert [i for i, t in enumerate(texts) if t.startswith("## Summary")] == [first - 1]
    assert "## What you will learn" in head and "## Prerequisites" in head
    text = markdown()
    for cited in ("huggingface/transformers#31412, 2024-06-14", "huggingface/transformers#37932, 2025-05-02",
                  "pytorch/examples#760, 2020-04-25", "Lightning-AI/pytorch-lightning#6013, 2021-02-16",
                  "arXiv:1909.08053", "_fsdp_param.py"):
        assert cited in text, cited
    assert len(text.split()) < 3300


def test_questions_1_and_3_stay_unspoiled():
    """Nothing above question 1 says whether fully_shard broadcasts (its answer), and nothing
    above question 3 says that turning dropout on moves the data order (its answer); both
    are said after their reveals."""
    sources = ["".join(c["source"]) for c in CELLS]
    def above(marker):
        upto = next(i for i, s in enumerate(sources) if s.startswith(marker))
        return "\n".join(s for s, c in zip(sources[:upto], CELLS) if c["cell_type"] == "markdown")
    before_1 = above("answer_1 = None")
    assert "patchwork" not in before_1 and "no such broadcast" not in before_1
    assert "keeps each rank's own" not in before_1
    before_3 = above("answer_3 = None")
    assert "changes the data order" not in before_3 and "turning dropout on" not in before_3.lower()
    assert "moves the generator on" not in before_3 and "moves every draw" not in before_3   # the mechanism
    assert "moves the generator on" in WHY["17"][3]
    assert "patchwork" in markdown()[len(before_1):] and "changes the data order" in markdown()[len(before_3):]


def test_dtensor_dropout_on_a_cpu_mesh_repeats_one_mask_in_every_shard_as_stored(group):
    """Step 4's DTensor cell, again (an expert review asked for torch's own answer): on a
    CPU mesh DTensor keeps no RNG tracker, warns in torch's words, and every rank seeded
    alike draws the same row; the names the text cites for CUDA meshes exist in torch."""
    import torch.distributed.tensor._random as dtensor_random
    out = group.run(NB.dtensor_dropout)
    rows = [row for row, _ in out]
    assert all(row == rows[0] for row in rows) and 0 < sum(rows[0]) < 8
    assert out[0][1] == ["DTensor random operators may not have complete support on cpu "
                         "device mesh"]
    stored = stored_text(cell_with("def dtensor_dropout"))
    for rank, row in enumerate(rows):
        assert f"rank {rank}, its row of the mask (1: dropped): {row}" in stored
    assert hasattr(dtensor_random.OffsetBasedRNGTracker, "_set_pre_op_offset")
    assert hasattr(dtensor_random, "is_rng_supported_mesh")
    text = markdown()
    assert "`OffsetBasedRNGTracker`" in text and "None of this ran here" in text


def test_the_exercise_says_whose_choice_differing_dp_seeds_are():
    """An expert review: Megatron-LM seeds dp ranks alike by default, so differing dp seeds
    are a choice; the text says so, and the verdict no longer claims one mask for the batch."""
    task = source_with("## Exercise: dropout seeds", kind="markdown")
    assert "that is this exercise's choice" in task and "--data-parallel-random-init" in task
    from reducelab.checks import randomness
    assert "as if one mask served" not in pathlib.Path(randomness.__file__).read_text()


def test_the_learner_decides_which_ranks_share_each_seed():
    """A third review (17-2): the rules dictated the design (a replicated seed the same in a
    tp group and different across dp, a sharded seed per rank), and the learner copied them.
    Now the task names the draws and the aim, not who shares what; the check names each
    mistake by what it does to the masks (test_each_usual_mistake_gets_its_explanation)."""
    task = " ".join(source_with("## Exercise: dropout seeds", kind="markdown").split())
    assert "Which ranks share a seed, for each draw, is yours to work out from one aim:" in task
    # review 6 (17-5): "yours to decide" and then "the dp ranks must differ" read as a contradiction
    assert "yours to decide" not in task and "must differ" not in task
    for rule in ("replicated_seed", "sharded_seed", "the same on every rank of a tp group, and different",
                 "different on every rank of the mesh", "1. **"):
        assert rule not in task, rule
    stub = source_with("# %load solutions/17_dropout_seeds.py")
    assert "get_local_rank" in stub and "size()" not in stub and "+ " not in stub.split("return", 1)[1]
    from reducelab.checks.randomness import DRAWS
    assert all(f'`"{draw}"`' in task for draw in DRAWS)
    assert DRAWS == {"attention_probs": "shard", "attention_output": "whole", "mlp_output": "whole"}


def salted_by_the_process(base, mesh):           # agrees on forked ranks, not under torchrun
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    return {"attention_output": hash(("output", base, dp)) % 2 ** 61,
            "mlp_output": hash(("mlp", base, dp)) % 2 ** 61 + 2 ** 61,
            "attention_probs": hash(("probs", base, dp, tp)) % 2 ** 61 + 2 ** 62}


def test_seeds_that_change_from_process_to_process_fail(group):
    """A second review: hash() of a string passed, since the forked ranks share one hash
    salt; the check now calls the function again in the kernel, another process."""
    verdict = check_dropout_seeds(group, salted_by_the_process)
    assert not verdict, verdict.message
    assert "the same call in another Python process gives" in verdict.message
    assert "hash() of a string" in verdict.message
    assert not [line for line in solution_lines() if line in verdict.message]
    solution = check_dropout_seeds(group, conftest.load_solution("17_dropout_seeds").dropout_seeds)
    assert solution, solution.message


def test_two_seeds_become_two_streams_with_the_solution(group):
    """A third review: the exercise stopped at two seeds, yet F.dropout takes no generator.
    RNGStreams (the idea of Megatron-LM's CudaRNGStatesTracker.fork) swaps a stream's state
    in around each draw. With the solution's seeds: the replicated mask agrees within each tp
    group and differs across dp, every rank's sharded mask is its own, and the global stream
    is untouched; with the stub (the stored run) every mask is one."""
    stub = NB.dropout_seeds
    NB.dropout_seeds = conftest.load_solution("17_dropout_seeds").dropout_seeds
    try:
        out = group.run(NB.two_streams)
    finally:
        NB.dropout_seeds = stub
    whole = {coord: w for coord, w, _, _ in out}
    assert torch.equal(whole[0, 0], whole[0, 1]) and torch.equal(whole[1, 0], whole[1, 1])
    assert not torch.equal(whole[0, 0], whole[1, 0])
    assert len({tuple(shard.tolist()) for _, _, shard, _ in out}) == 4
    assert all(untouched for *_, untouched in out)
    stored = stored_text(cell_with("import contextlib\n\n\nclass RNGStreams"))
    assert "attention_probs masks all different: False | the global stream untouched on every rank: True" in stored
    text = " ".join(markdown().split())
    assert "`F.dropout` takes no generator" in text and "CudaRNGStatesTracker.fork" in text
    assert "run it once your function passes the check" in text


def broadcast_from_rank0():
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    wanted = nn.Linear(4, 8).state_dict()                    # the checkpoint, read on rank 0 only
    expected = wanted["weight"].clone()                      # (set_model_state_dict changes the dict)
    torch.manual_seed(dist.get_rank())                       # step 1's seed per rank
    model = nn.Linear(4, 8)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    set_model_state_dict(model, wanted if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return torch.equal(model.weight.full_tensor(), expected)


def test_the_fsdp2_remedies_are_torch_2_13s(group):
    """A third review: "load the same checkpoint" left out what production code does. On
    real ranks, set_model_state_dict with broadcast_from_rank0 turns step 1's patchwork into
    rank 0's checkpoint; fully_shard has no sync_module_states, FSDP1 had."""
    import inspect
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    assert group.run(broadcast_from_rank0) == [True] * 4
    assert "sync_module_states" not in inspect.signature(fully_shard).parameters
    assert "sync_module_states" in inspect.signature(FullyShardedDataParallel.__init__).parameters
    text = " ".join(markdown().split())
    for fact in ("StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)", "reset_parameters()",
                 "meta device", "FSDP1's `sync_module_states=True` has no FSDP2 counterpart"):
        assert fact in text, fact


def meta_then_reset_parameters():
    """The recommendation review 4 ran: build on the meta device, fully_shard, to_empty, one
    seed, reset_parameters(). Returns whether each rank's two rows equal rank 0's, and the
    warnings torch gave."""
    import warnings

    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with torch.device("meta"):
        model = nn.Linear(4, 8)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.reset_parameters()
    whole = model.weight.full_tensor()
    return ([torch.equal(whole[2 * k:2 * k + 2], whole[:2]) for k in range(4)],
            sorted({str(w.message) for w in caught}))


def test_reset_parameters_after_sharding_repeats_one_shard_on_a_cpu_mesh(group):
    """Review 4 (17-1): the text recommended meta device, fully_shard, reset_parameters()
    without a device. On a CPU mesh with one seed, every rank's 2 rows of nn.Linear(4, 8) are
    the same (torch's is_rng_supported_mesh: "correct RNG on cuda/cuda-like devices" only);
    the text now keeps that remedy to GPU meshes and sends CPU meshes to the checkpoint."""
    from torch.distributed.tensor import _random as dtensor_random
    assert "Currently we only support correct RNG on cuda/cuda-like devices" in dtensor_random.is_rng_supported_mesh.__doc__
    warning = "DTensor random operators may not have complete support on cpu device mesh"
    for same_as_rank_0, caught in group.run(meta_then_reset_parameters):
        assert same_as_rank_0 == [True] * 4 and caught == [warning]
    # review 5 (17-4): the remedies, once one paragraph, are bullets
    text = source_with("Under FSDP2, give every rank the same initial weights", kind="markdown")
    bullets = [line for line in text.splitlines() if line.startswith("- ")]
    assert [b.split()[1] for b in bullets] == ["Seed", "On", "Load"], bullets
    # review 6 (17-3): the recipe lacked to_empty; it now follows meta_then_reset_parameters' order
    assert ("On GPU meshes, build the model on the meta device, shard it with `fully_shard`, allocate the "
            "shards with `model.to_empty(device=\"cuda\")`, then call `reset_parameters()`: DTensor's "
            "random-number tracker gives each shard its own part of one stream") in bullets[1]
    import inspect
    ran = inspect.getsource(meta_then_reset_parameters)
    assert ran.index('torch.device("meta")') < ran.index("fully_shard(model") < ran.index("model.to_empty(") \
        < ran.index("model.reset_parameters()")
    # teach-e review: "fails silently" then "torch only warns" contradicted itself; it raises nothing
    assert ("On a CPU mesh, like this one, that raises nothing: with one seed, every rank fills its rows with "
            f'the same values, and torch only warns "{warning}".') in bullets[1]
    assert "broadcast_from_rank0=True" in bullets[2]
    step_4 = " ".join(source_with("`OffsetBasedRNGTracker`", kind="markdown").split())
    assert "On this CPU mesh, that `reset_parameters()` repeats one shard's values on every rank" in step_4
    assert "Production code builds it on the meta device" not in " ".join(markdown().split())


def test_the_myths_and_summary_say_what_the_notebook_showed():
    """A third review: the myth's "depends on the model" said nothing the notebook ran; and a
    resume needs the generator states and the sampler's epoch (notebook 14 saves the rest)."""
    text = " ".join(markdown().split())
    assert "depends on the model" not in text
    assert "about half of the first layer's 64 weight rows got no gradient in the step, against about 4" in text
    assert "about 32 of 64" in WHY["17"][2] and "about 4 of 64" in WHY["17"][2]
    assert "`torch.get_rng_state()`, different on every rank) and the sampler's epoch" in text
    assert "one_seed = dp_masks" not in "".join("".join(c["source"]) for c in CELLS)   # the repeat was cut


def _run_the_summary_recipe(code, base):
    """The summary's recipe, run as written on this rank, with `mesh` a 1-D CPU mesh: the
    whole weight, this rank's shard and a dropout mask."""
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    names = {"torch": torch, "nn": nn, "dist": dist, "fully_shard": fully_shard, "base": base,
             "mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    exec(code, names)
    model = names["model"]
    return (model.weight.full_tensor().detach(), model.weight.to_local().detach().clone(),
            F.dropout(torch.ones(64), p=0.5) == 0)


def test_the_summary_recipe_combines_one_seed_for_the_model_and_per_rank_seeds_after(group):
    """A fifth review (17-1): no recipe combined step 1 (the same seed to build an FSDP2
    model) and step 2 (per-rank seeds for dropout). The summary's 4-line block, in that
    order, run on 4 gloo ranks: the shards make up the model one process builds with `base`,
    and the dropout masks differ from rank to rank. Its fourth line, the alternative of one
    stream per purpose, is a comment that names what the notebook ran (steps 3 and 4)."""
    text = markdown().split("## Summary")[1].split("## Further reading")[0]
    intro = "Steps 1 and 2 together, on every rank, in this order"
    assert intro in text
    code = text.split(intro)[1].split("```python\n")[1].split("\n```")[0]
    lines = code.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("torch.manual_seed(base)") and "fully_shard(" in lines[1]
    assert lines[2].startswith("torch.manual_seed(base + dist.get_rank())")
    assert lines[3].startswith("# or, in place of line 3") and "RNGStreams" in lines[3]
    for base in (0, 7):
        out = group.run(_run_the_summary_recipe, code, base)
        torch.manual_seed(base)
        one = torch.nn.Linear(4, 8).weight.detach()
        assert all(torch.equal(whole, one) for whole, _, _ in out)
        assert all(torch.equal(shard, one.chunk(4)[r]) for r, (_, shard, _) in enumerate(out))
        assert len({tuple(m.tolist()) for _, _, m in out}) == 4


def test_the_summary_says_random_control_flow_must_match_and_what_sequence_parallelism_changes():
    """Review 7 (17-1, HIGH): nothing said that a random choice of which layers run (LayerDrop,
    stochastic depth) must match on every rank, or ranks run different collectives: DDP waits
    for a gradient that never comes (notebook 13's error), FSDP2 and tensor parallel hang
    (notebook 11). 17-3: with sequence parallelism the outputs of the row-parallel layers are
    token shards, and Megatron-LM's TransformerBlock forks its tp RNG tracker for the layer."""
    summary = " ".join(markdown().split("## Summary")[1].split("## Further reading")[0].split())
    assert ("A random choice of which layers run (LayerDrop, stochastic depth) must match on every rank: a "
            "layer one rank skips leaves DDP waiting for its gradient (\"Expected to have finished reduction "
            "in the prior iteration\", notebook 13); under FSDP2 or tensor parallel, the ranks call different "
            "collectives and hang (notebook 11).") in summary
    assert "Sequence parallelism (notebook 18) makes the outputs of the row-parallel layers token shards" in summary
    assert "tensor-parallel random-number tracker" in summary
    # the quoted error is the one notebook 13 stores from the installed torch
    nb13 = next((ROOT / "notebooks").glob("13_*.ipynb")).read_text()
    assert "Expected to have finished reduction in the prior iteration" in nb13


def test_step_4_says_why_the_copies_of_a_tp_group_need_one_mask():
    """teach-e review (17, step 4): "or their copies stop being copies" said what, not why. The
    cell now says each tp rank goes on from its own copy into its shard of the next layer, so
    different masks feed the shards different activations: no one model's forward pass. Run
    here without ranks: a whole activation, dropout with each tp rank's mask, then a
    column-parallel Linear split over 2 tp ranks. With one mask the shards make up one
    process's output; with a mask per rank they make up neither rank's."""
    text = " ".join(source_with("## Step 4: data parallel and tensor parallel together", kind="markdown").split())
    assert ("each tp rank goes on from its own copy (the residual sum, the next column-parallel layer), so "
            "different masks would feed the tp ranks' shards different activations: no one model's forward "
            "pass.") in text
    assert "or their copies stop being copies" not in text
    torch.manual_seed(0)
    h, layer = torch.randn(3, 16), torch.nn.Linear(16, 8)
    masks = [torch.nn.functional.dropout(torch.ones(3, 16), p=0.5) for _ in range(2)]   # tp ranks 0 and 1
    def column_parallel(per_rank_masks):       # tp rank t computes output columns 4t .. 4t + 3
        return torch.cat([torch.nn.functional.linear(h * m, layer.weight[4 * t:4 * t + 4], layer.bias[4 * t:4 * t + 4])
                          for t, m in enumerate(per_rank_masks)], dim=1)
    with torch.no_grad():
        assert torch.allclose(column_parallel([masks[0], masks[0]]), layer(h * masks[0]))
        mixed = column_parallel(masks)
        assert not any(torch.allclose(mixed, layer(h * m)) for m in masks)


def test_the_myth_says_what_larger_local_batches_leave():
    """teach-e review (17, myth 2): "Larger local batches leave fewer independent masks, not zero
    rows" read as a riddle. It now says the zero rows become rare and sample k keeps one mask on every
    rank; checked here for 4 ranks of 8 samples seeded alike (one process standing in for each):
    sample k's mask is the same on all 4, and no more than 2 of 64 units are dropped for all 32."""
    text = " ".join(markdown().split())
    assert ("With larger local batches the zero rows become rare, but sample k still gets the same mask on every "
            "rank (step 2).") in text
    assert "not zero rows" not in text
    ranks = []
    for _ in range(4):
        torch.manual_seed(0)
        ranks.append(torch.nn.functional.dropout(torch.ones(8, 64), p=0.5) == 0)
    assert all(torch.equal(r, ranks[0]) for r in ranks)
    assert int(torch.cat(ranks).all(dim=0).sum()) <= 2
