"""Each exercise check, given each mistake its docstring or its notebook's exercise text
names, says what that mistake is, and refuses what the exercise forbids (issue 20: "a
check can accept an answer that its exercise text forbids").

Where each check's mistakes are tested: a table of mistaken answers, each written as a
learner would write it, with the words the verdict must carry. Most tables live in the
notebook's own test module; the rows here are the mistakes those tables lacked, and one
for each check that accepted a forbidden answer until it was fixed (marked "fix").

"likely" stands for test_each_likely_mistake_is_named, "usual" for
test_each_usual_mistake_gets_its_explanation, in tests/test_nbNN_*.py:

- 01 check_spread_over_ranks: test_nb01_all_reduce "likely". Here: an all_gather (fix);
  a reduce then a broadcast, which gathers nothing.
- 02 check_reduce_to_owners: test_nb02_reduce "likely". Here: every chunk reduced to
  rank 0, then sent on (fix); one reduce per element; each rank's own chunk first.
- 03 check_backward_and_log: here, the whole table (test_nb03_loss: the stub, the
  solution and the other right answers, a rank that skips backward() or runs its forward
  in no_sync() stopped at once, and what the count leaves out).
- 04 check_ddp_loss: test_nb04_ddp "likely".
- 05 check_mesh_sync: test_nb05_mesh "likely", and its tests of a new group per call.
  Here: DeviceMesh._flatten (fix).
- 06 check_chain_broadcast: test_nb06_ring "likely", and its ring that hangs. Here: the
  chain run to the left neighbour; the pieces sent last first.
- 07 check_node_command: test_nb07_cluster test_wrong_answers_are_explained.
- 08 check_zero1_step: here, the table of gradient, broadcast and collective mistakes;
  test_nb08_sharded "usual" has the partitions that differ from torch's (round robin,
  greedy unsorted, smallest first), and the right answers other than the solution.
- 09 check_vocab_parallel_embedding: test_nb09_tensor_parallel
  test_each_likely_mistake_gets_its_explanation.
- 10 check_recursive_doubling: test_nb10_cost "usual".
- 11 check_skip_together: test_nb11_disagree "usual", and the given loop's hang. Here: an
  error on the ranks; the right steps skipped but counted as taken (fix); no step skipped.
- 12 check_exact_mean_loss: test_nb12_gathers "usual". Here: a rank's own mean; the
  repeats left out of the sum but not the count.
- 13 check_evaluate_together: test_nb13_ddp_model "usual" (its own share, a mean of
  means, each rank's own BatchNorm statistics, training mode, left in eval mode, a step
  while evaluating, not a number, gradients enabled: a graph built), and rank 0 alone
  through the wrapper, which hangs.
- 14 check_global_grad_norm: test_nb14_shards "usual". Here: the copies added over tp, an all_gather of the local
  pieces (fix), and one sum per parameter, which passes; the copies never summed.
- 15 check_accumulate_step: test_nb15_fsdp2 "usual".
- 16 check_ddp_buckets: test_nb16_buckets "usual" (every entry of checks.buckets.MISTAKES).
- 17 check_dropout_seeds (moved from 13 with its exercise): test_nb17_randomness "usual"
  (with seeds from dist.get_rank() on the larger stand-in meshes, and a function the
  stand-in mesh cannot run, which fails and says so).
- 18 check_sync_gradients: test_nb18_transformer_layer "usual" (gradients unchanged,
  averaged over tp too, sequence-parallel ones not summed, summed over dp, everything over
  all 4 ranks, sharded ones added over tp, dp forgotten, a flat buffer copied back with the
  tp sum forgotten: no copy-back hint, an error), and a hang on a group
  of a short timeout.

(Notebooks 13 and 16 also name torch's own ``_check_sync_bufs_pre_fwd`` and
``_check_comm_hook``: DDP internals, not checks of ours.)

Every row asserts that the verdict fails, that its message names the mistake, and that
it quotes no line of any solution (README: "No check message prints a solution"). The
right answer of each check is run by the notebook's own test.

The rank functions are module-level functions of this file, sent to the ranks by value
(as a notebook cell's are). One 4-rank group (conftest's ``group``) serves the module;
check_chain_broadcast starts its own, as it does in the notebook.
"""
from __future__ import annotations

import pathlib
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reducelab.checks.all_reduce import check_spread_over_ranks, local_values
from reducelab.checks.disagree import check_skip_together, step_batch
from reducelab.checks.gathers import check_exact_mean_loss
from reducelab.checks.loss import check_backward_and_log
from reducelab.checks.mesh import check_mesh_sync
from reducelab.checks.reduce import check_reduce_to_owners
from reducelab.checks.ring import check_chain_broadcast
from reducelab.checks.sharded import check_zero1_step
from reducelab.checks.shards import check_global_grad_norm

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("keep_four_ranks")


SOLUTION_LINES = {
    line.split("#")[0].strip()
    for path in (pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "solutions").glob("*.py")
    for line in path.read_text().splitlines()
    if len(line.split("#")[0].strip()) >= 20
    and not line.strip().startswith(("#", "def ", "import ", "from ", '"""'))}
"""The solutions' lines of code (README: "No check message prints a solution")."""


def assert_names(verdict, *words):
    """The verdict fails, its message carries every one of ``words``, and it quotes no
    line of a solution."""
    assert not verdict, f"the check accepted a mistake: {verdict.message}"
    assert verdict.answered
    missing = [w for w in words if w not in verdict.message]
    assert not missing, f"{missing} not in: {verdict.message}"
    quoted = [line for line in SOLUTION_LINES if line in verdict.message]
    assert not quoted, f"the message prints a solution's code: {quoted}"


# --- 01: check_spread_over_ranks (its table: tests/test_nb01_all_reduce.py) -------------------

def spread_all_gather(n):                # every rank's values gathered: torch does the arithmetic
    x = local_values(dist.get_rank(), n)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    every = torch.stack(parts)
    return every.mean(dim=0), every.std(dim=0, unbiased=False)


def spread_reduce_then_broadcast(n):     # the sums through rank 0: nothing gathered
    x = local_values(dist.get_rank(), n)
    total, squares = x.clone(), x * x
    for t in (total, squares):
        dist.reduce(t, dst=0)
        dist.broadcast(t, src=0)
    count = dist.get_world_size()
    mean = total / count
    return mean, (squares / count - mean * mean).clamp(min=0).sqrt()


@pytest.mark.parametrize("fn, words", [
    (spread_all_gather, ["rank 0 called dist.all_gather",
                         "dist.all_reduce with ReduceOp.SUM only",
                         "With every rank's values gathered"]),
    (spread_reduce_then_broadcast, ["rank 0 called dist.reduce",
                                    "dist.all_reduce with ReduceOp.SUM only"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_spread_over_ranks_names_each_mistake(group, fn, words):
    verdict = check_spread_over_ranks(group, fn)
    assert_names(verdict, *words)
    if fn is spread_reduce_then_broadcast:   # nothing was gathered: the message does not say so
        assert "gathered" not in verdict.message and "receives world_size tensors" not in verdict.message


# --- 02: check_reduce_to_owners (its table: tests/test_nb02_reduce.py) ------------------------

def owners_sent_from_rank_0(x):          # every chunk reduced to rank 0, which sends the sums on
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = x.clone().tensor_split(n)
    for chunk in chunks:
        dist.reduce(chunk, dst=0)
    if rank == 0:
        for c in range(1, n):
            dist.send(chunks[c], dst=c)
        return chunks[0]
    mine = torch.empty_like(chunks[rank])
    dist.recv(mine, src=0)
    return mine


def owners_element_by_element(x):        # the right sums, one reduce per element
    rank, n = dist.get_rank(), dist.get_world_size()
    x = x.clone()
    for owner, chunk in enumerate(x.tensor_split(n)):
        for element in chunk.split(1):
            dist.reduce(element, dst=owner)
    return x.tensor_split(n)[rank].clone()


def owners_own_chunk_first(x):          # each rank reduces its own chunk first (review 7, 02-3)
    rank, n = dist.get_rank(), dist.get_world_size()
    k = x.numel() // n
    for i in range(n):
        c = (rank + i) % n
        chunk = x[c * k:(c + 1) * k].clone()
        dist.reduce(chunk, dst=c)
        if c == rank:
            mine = chunk
    return mine


@pytest.mark.parametrize("fn, words", [
    (owners_own_chunk_first, ["At call 1 of dist.reduce (line",
                              "defines owners_own_chunk_first), the ranks passed dst 0 (rank 0), 1 (rank 1)",
                              "Collectives pair up in call order", "the same dst"]),
    (owners_sent_from_rank_0, ["your function called dist.recv",
                               "from dist.reduce alone, one reduce per chunk"]),
    (owners_element_by_element, ["passed a tensor of 1 element to dist.reduce",
                                 "more reduces than chunks"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_reduce_to_owners_names_each_mistake(group, fn, words):
    assert_names(check_reduce_to_owners(group, fn), *words)


# --- 03: check_backward_and_log ----------------------------------------------------------

def _loss_stats(local_sum, n):           # the global sum and count, one all_reduce
    stats = torch.stack([local_sum.detach(), torch.tensor(float(n))])
    dist.all_reduce(stats)
    return stats


def loss_stub(model, x, y):              # the def cell as shipped: step 5's local mean
    loss = F.mse_loss(model(x), y)
    loss.backward()
    logged = loss.detach().clone()
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged


def loss_without_world_size(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    (local_sum / count).backward()
    return total / count


def loss_world_size_twice(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    (local_sum / count / dist.get_world_size()).backward()
    return total / count


def loss_local_count(model, x, y):       # divided by this rank's own count
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    (local_sum * dist.get_world_size() / max(len(x), 1)).backward()
    return total / count


def loss_summed(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    local_sum.backward()
    return total / count


def loss_through_all_reduce(model, x, y):  # backward() through the all-reduced sum
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    stats = torch.stack([local_sum, torch.tensor(float(len(x)))])
    dist.all_reduce(stats)
    (stats[0] * dist.get_world_size() / stats[1]).backward()
    return (stats[0] / stats[1]).detach()


def loss_popular_answer(model, x, y):    # all_reduce(loss) / world_size, then backward()
    loss = F.mse_loss(model(x), y).clone()
    dist.all_reduce(loss)
    loss = loss / dist.get_world_size()
    loss.backward()
    return loss.detach()


def loss_returns_early(model, x, y):     # a rank with no sample leaves at once
    if len(x) == 0:
        return 0.0
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    (local_sum * dist.get_world_size() / count).backward()
    return total / count


def loss_skips_backward(model, x, y):    # joins the all_reduce, skips backward()
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    if len(x) > 0:
        (local_sum * dist.get_world_size() / count).backward()
    return total / count


def loss_constant_when_empty(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum") if len(x) else torch.tensor(0.0)
    total, count = _loss_stats(local_sum, len(x))
    (local_sum * dist.get_world_size() / count).backward()
    return total / count


def loss_two_all_reduces(model, x, y):   # right numbers, two collectives
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = local_sum.detach().clone(), torch.tensor(float(len(x)))
    dist.all_reduce(total)
    dist.all_reduce(count)
    (local_sum * dist.get_world_size() / count).backward()
    return total / count


def loss_all_gathered(model, x, y):      # right numbers, one collective: an all_gather
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    parts = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.stack([local_sum.detach(), torch.tensor(float(len(x)))]))
    total, count = torch.stack(parts).sum(0)
    (local_sum * dist.get_world_size() / count).backward()
    return total / count


def loss_local_means_weighted(model, x, y):  # right gradient; nan logged with an empty rank
    out = model(x)
    local_sum = F.mse_loss(out, y, reduction="sum")
    stats = torch.stack([F.mse_loss(out, y).detach() * len(x), torch.tensor(float(len(x)))])
    dist.all_reduce(stats)
    (local_sum * dist.get_world_size() / stats[1]).backward()
    return stats[0] / stats[1]


def loss_logs_local_mean(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    (local_sum * dist.get_world_size() / count).backward()
    return local_sum.detach() / len(x)


def loss_logs_mean_of_means(model, x, y):
    out = model(x)
    count = torch.tensor(float(len(x)))
    dist.all_reduce(count)
    (F.mse_loss(out, y, reduction="sum") * dist.get_world_size() / count).backward()
    logged = F.mse_loss(out, y).detach()
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged


def loss_returns_two_numbers(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    stats = _loss_stats(local_sum, len(x))
    (local_sum * dist.get_world_size() / stats[1]).backward()
    return stats


def loss_returns_none(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    _, count = _loss_stats(local_sum, len(x))
    (local_sum * dist.get_world_size() / count).backward()


def loss_no_backward(model, x, y):
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = _loss_stats(local_sum, len(x))
    return total / count


def loss_through_functional_all_reduce(model, x, y):  # backward() through funcol's all_reduce
    import torch.distributed._functional_collectives as funcol
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    stats = funcol.all_reduce(torch.stack([local_sum, torch.tensor(float(len(x)))]), "sum",
                              dist.group.WORLD)
    (stats[0] * dist.get_world_size() / stats[1]).backward()
    return (stats[0] / stats[1]).detach()


def loss_through_dist_nn_all_reduce(model, x, y):  # the myth cell's all_reduce, in backward()
    import warnings

    import torch.distributed.nn.functional as dist_fn
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        stats = dist_fn.all_reduce(torch.stack([local_sum, torch.tensor(float(len(x)))]))
    (stats[0] / stats[1]).backward()
    return (stats[0] / stats[1]).detach()


def loss_all_reduce_coalesced(model, x, y):  # right numbers, one all_reduce_coalesced
    import warnings
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    total, count = local_sum.detach().clone(), torch.tensor(float(len(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_reduce_coalesced([total, count])
    (local_sum * dist.get_world_size() / count).backward()
    return total / count


def loss_sum_all_reduced_after_backward(model, x, y):  # the count before, the sum after
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    count = torch.tensor(float(len(x)))
    dist.all_reduce(count)
    (local_sum * dist.get_world_size() / count).backward()
    total = local_sum.detach().clone()
    dist.all_reduce(total)
    return total / count


def loss_count_averaged(model, x, y):     # ReduceOp.AVG over [sum, count]: the count is N / ws
    local_sum = F.mse_loss(model(x), y, reduction="sum")
    stats = torch.stack([local_sum.detach(), torch.tensor(float(len(x)))])
    dist.all_reduce(stats, op=dist.ReduceOp.AVG)
    (local_sum * dist.get_world_size() / stats[1]).backward()
    return stats[0] / stats[1]


def loss_forward_in_no_sync(model, x, y):  # DDP all-reduces no gradient
    with model.no_sync():
        local_sum = F.mse_loss(model(x), y, reduction="sum")
        total, count = _loss_stats(local_sum, len(x))
        (local_sum * dist.get_world_size() / count).backward()
    return total / count


@pytest.mark.parametrize("fn, words", [
    (loss_stub, ["after your backward() rank 0 holds", "each rank's own local mean loss",
                 "weighs 1/(world_size·n), not 1/18"]),
    (loss_without_world_size, ["That is 1/world_size = 1/4 of it",
                               "DDP divides each rank's gradient by world_size"]),
    (loss_world_size_twice, ["That is 1/world_size² = 1/16 of it", "once more by DDP"]),
    (loss_local_count, ["each rank divided its loss by its own local batch size",
                        "weighs 1/n, not 1/18"]),
    (loss_summed, ["the gradient of each rank's summed loss"]),
    (loss_through_all_reduce, ["rank 0's backward() went through an all_reduce",
                               "c10d::allreduce_: an autograd kernel was not registered",
                               "Autograd has no formula for dist.all_reduce",
                               "The gradient came out right here"]),
    (loss_popular_answer, ["rank 0's backward() went through an all_reduce",
                           "as if it were the identity", "The gradient came out ["]),
    (loss_returns_early, ["local batch sizes [4, 0, 3]",
                          "rank 1 (local batch of 0 samples) returned without calling backward()",
                          "ranks 0 and 2 were left waiting for it (in all_reduce",
                          "the check stopped them at once"]),
    (loss_skips_backward, ["rank 1 (local batch of 0 samples) returned without calling "
                           "backward()", "ranks 0 and 2 were left waiting for it"]),
    (loss_constant_when_empty, ["rank 1 (local batch of 0 samples) called backward() on a "
                                "tensor that does not depend on the model's parameters",
                                "does not require grad"]),
    (loss_two_all_reduces, ["every rank's gradient and logged loss are right",
                            "rank 0 called all_reduce 2 times, not counting what DDP calls "
                            "itself (in model(x), and its all_reduce of the gradients",
                            "The exercise asks for one all_reduce per rank.",
                            "Every collective is a round trip"]),
    (loss_all_gathered, ["rank 0 called all_gather once, not counting what DDP calls"]),
    (loss_local_means_weighted, ["every rank's gradient is right", "returned nan",
                                 "Rank 1 holds no sample here, and the mean of an empty "
                                 "tensor is nan"]),
    (loss_logs_local_mean, ["That is this rank's own local mean"]),
    (loss_logs_mean_of_means, ["That is the mean of the per-rank means"]),
    (loss_returns_two_numbers, ["returned a tensor of shape (2,)", "return one number"]),
    (loss_returns_none, ["returned a NoneType", "return one number"]),
    (loss_no_backward, ["no rank called backward() through the model"]),
    (loss_through_functional_all_reduce, [
        "rank 0's backward() called all_reduce once besides DDP's all_reduce of the gradients",
        "went back through a differentiable collective",
        "torch.distributed._functional_collectives.all_reduce", "The gradient came out ["]),
    (loss_through_dist_nn_all_reduce, [
        "rank 0's backward() called all_reduce once besides DDP's all_reduce of the gradients",
        "The gradient came out right here, but rank 0 called all_reduce 2 times in all"]),
    (loss_all_reduce_coalesced, ["every rank's gradient and logged loss are right",
                                 "rank 0 called all_reduce_coalesced once, not counting"]),
    (loss_sum_all_reduced_after_backward, ["every rank's gradient and logged loss are right",
                                           "rank 0 called all_reduce 2 times"]),
    (loss_count_averaged, ["That is world_size = 4 times it",
                           "a count averaged over the ranks instead of summed"]),
    (loss_forward_in_no_sync, ["every rank called backward() and got gradients, but DDP "
                               "started no all_reduce of the gradients on any rank",
                               "after a forward inside no_sync()"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_backward_and_log_names_each_mistake(group, fn, words):
    assert_names(check_backward_and_log(group, fn), *words)


def test_check_backward_and_log_refuses_what_is_not_a_function(group):
    with pytest.raises(TypeError, match="fn must be the function"):
        check_backward_and_log(group, 0.5)


# --- 05: check_mesh_sync (its table: tests/test_nb05_mesh.py) ----------------------------------

def mesh_private_flatten(model, mesh, n_tokens):   # right numbers, through the page's _flatten
    everyone = mesh["dp", "cp"]._flatten(mesh_dim_name="dp_cp").get_group()
    total = torch.tensor(float(n_tokens))
    dist.all_reduce(total, group=everyone)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(n_tokens)
            dist.all_reduce(p.grad, group=everyone)
            p.grad.div_(total)


@pytest.mark.parametrize("fn, words", [
    (mesh_private_flatten, ["the gradients are right, but sync_grads called DeviceMesh._flatten",
                            "a private API", "The exercise asks for public API only"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_mesh_sync_names_each_mistake(group, fn, words):
    assert_names(check_mesh_sync(group, fn), *words)


# --- 06: check_chain_broadcast (its table: tests/test_nb06_ring.py) --------------------------

def chain_to_the_left(x, src, pieces):   # the chain runs src, src - 1, ...: the wrong neighbour
    rank, n = dist.get_rank(), dist.get_world_size()
    place = (src - rank) % n
    for piece in x.tensor_split(pieces):
        if place > 0:
            dist.recv(piece, src=(rank + 1) % n)
        if place < n - 1:
            dist.send(piece, dst=(rank - 1) % n)


def chain_last_piece_first(x, src, pieces):   # the right chain, the pieces in reverse order
    rank, n = dist.get_rank(), dist.get_world_size()
    place = (rank - src) % n
    for piece in reversed(x.tensor_split(pieces)):
        if place > 0:
            dist.recv(piece, src=(rank - 1) % n)
        if place < n - 1:
            dist.send(piece, dst=(rank + 1) % n)


@pytest.mark.parametrize("fn, words", [
    (chain_to_the_left, ["every rank ends with src's x, but rank 0 sent to rank 2",
                         "sends only to its right neighbour, rank 1"]),
    (chain_last_piece_first, ["expected the 4 pieces of x.tensor_split(4), piece 0 first."]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_chain_broadcast_names_each_mistake(fn, words):
    verdict = check_chain_broadcast(fn, world_sizes=(3,))
    assert_names(verdict, *words)
    if fn is chain_last_piece_first:         # 4 pieces, in the wrong order: not "one piece"
        assert "With one piece" not in verdict.message


# --- 08: check_zero1_step -----------------------------------------------------------------------

def _zero1_owners(params):          # ZeroRedundancyOptimizer's: largest first, fewest elements so far
    held, owner = [0] * dist.get_world_size(), [None] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner[i] = held.index(min(held))
        held[owner[i]] += params[i].numel()
    return owner


def _zero1_average(params, op=dist.ReduceOp.AVG):
    for p in params:
        dist.all_reduce(p.grad, op=op)


def _zero1_broadcast(params, owner):
    for p, src in zip(params, owner):
        dist.broadcast(p.data, src=src)


def zero1_stub(params, optimizer):      # the def cell as shipped
    pass


def zero1_sum(params, optimizer):       # Adam nearly hides it: only the gradient shows it
    _zero1_average(params, dist.ReduceOp.SUM)
    optimizer.step()
    _zero1_broadcast(params, _zero1_owners(params))


def zero1_not_averaged(params, optimizer):
    optimizer.step()
    _zero1_broadcast(params, _zero1_owners(params))


def zero1_steps_before_averaging(params, optimizer):
    optimizer.step()
    _zero1_average(params)
    _zero1_broadcast(params, _zero1_owners(params))


def zero1_never_steps(params, optimizer):
    _zero1_average(params)
    _zero1_broadcast(params, _zero1_owners(params))


def zero1_all_from_rank_0(params, optimizer):
    _zero1_average(params)
    optimizer.step()
    _zero1_broadcast(params, [0] * len(params))


def zero1_no_broadcast(params, optimizer):      # each rank keeps only its own parameters stepped
    _zero1_average(params)
    optimizer.step()


def zero1_broadcasts_a_copy(params, optimizer):
    _zero1_average(params)
    optimizer.step()
    for p, src in zip(params, _zero1_owners(params)):
        dist.broadcast(p.detach().clone(), src=src)


def zero1_copies_into_the_parameter(params, optimizer):   # in place on a leaf that requires grad
    _zero1_average(params)
    optimizer.step()
    for p, src in zip(params, _zero1_owners(params)):
        received = p.detach().clone()
        dist.broadcast(received, src=src)
        p.copy_(received)


def zero1_reduces_to_round_robin_owners(params, optimizer):
    n = dist.get_world_size()
    owner = [i % n for i in range(len(params))]
    for p, dst in zip(params, owner):
        dist.reduce(p.grad, dst=dst, op=dist.ReduceOp.AVG)
    optimizer.step()
    _zero1_broadcast(params, owner)


def zero1_all_reduces_the_parameters(params, optimizer):   # right numbers, no broadcast
    _zero1_average(params)
    optimizer.step()
    rank = dist.get_rank()
    for p, owner in zip(params, _zero1_owners(params)):
        if rank != owner:
            p.data.zero_()
        dist.all_reduce(p.data)


def zero1_averages_the_parameters(params, optimizer):     # review 6 (08-3): all_reduce AVG, no broadcast
    _zero1_average(params)
    optimizer.step()
    for p in params:
        dist.all_reduce(p.data, op=dist.ReduceOp.AVG)


def zero1_gathers_every_gradient(params, optimizer):       # right numbers, gradients travel whole
    n = dist.get_world_size()
    for p in params:
        every = [torch.empty_like(p.grad) for _ in range(n)]
        dist.all_gather(every, p.grad)
        p.grad = torch.stack(every).mean(dim=0)
    optimizer.step()
    _zero1_broadcast(params, _zero1_owners(params))


@pytest.mark.parametrize("fn, words", [
    (zero1_stub, ["With world_size=2, step 1: On rank 0, which owns 0.weight",
                  "It is this rank's own local gradient: nothing was averaged"]),
    (zero1_sum, ["It is their SUM, 2 times the mean", "Adam nearly hides this"]),
    (zero1_not_averaged, ["It is this rank's own local gradient", "420 digits instead of"]),
    (zero1_steps_before_averaging, ["Rank 0 owns 0.weight, and after your call its gradient is the mean",
                                    "with whatever .grad holds at the moment it steps"]),
    (zero1_never_steps, ["Rank 0 owns 0.weight, yet 0.weight still holds its value from before",
                         "never stepped it"]),
    (zero1_all_from_rank_0, ["2.weight (320 elements) was broadcast from rank 0",
                             "made rank 1 its owner", "You used rank 0 for every parameter"]),
    (zero1_no_broadcast, ["still holds its value from before the step: rank 1 owns 0.bias",
                          "no broadcast was called"]),
    (zero1_broadcasts_a_copy, ["although a broadcast of 32 elements from its owner, rank 1, ran",
                               "another tensor than the parameter itself"]),
    (zero1_copies_into_the_parameter, ["your function raised on the ranks", "leaf Variable",
                                       "it refuses an in-place operation on them"]),
    (zero1_reduces_to_round_robin_owners, ["On rank 1, which owns 2.weight",
                                           "2.weight (320 elements) was reduced to rank 0",
                                           "round robin by position"]),
    (zero1_all_reduces_the_parameters, ["the gradients and the parameters are right, but at "
                                        "world_size=2 rank 0 never called dist.broadcast",
                                        "_sync_params sends each parameter once"]),
    (zero1_averages_the_parameters, ["Rank 0 owns 0.weight, yet after your call it is not one process's value",
                                     "no broadcast of 0.weight was recorded",
                                     "mixes its new values with the other ranks' values from before the step"]),
    (zero1_gathers_every_gradient, ["the gradients and the parameters are right, but at "
                                    "world_size=2 rank 0 called dist.all_gather",
                                    "n-1 copies of it"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_zero1_step_names_each_mistake(group, fn, words):
    verdict = check_zero1_step(group, fn)
    assert_names(verdict, *words)
    assert group.world_size == 4


# --- 11: check_skip_together (its table: tests/test_nb11_disagree.py) -------------------------

def skip_counts_every_step(bad, steps=6):    # skips the right steps, but counts them as taken
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = 0
    for step in range(steps):
        x, y = step_batch(rank, step, bad)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        taken += 1
        broken = torch.tensor([0.0 if all(g.isfinite().all() for g in grads) else 1.0])
        dist.all_reduce(broken, op=dist.ReduceOp.MAX)
        if broken.item() > 0:
            continue
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.AVG)
        opt.step()
    return taken, model.weight.detach().clone()


def skip_never(bad, steps=6):             # no rule at all: every step averaged and taken
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = step_batch(rank, step, bad)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
    return steps, model.weight.detach().clone()


def skip_alone_after_the_all_reduce(bad, steps=6):   # a fifth review (11-1): the ranks do not agree
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = 0
    for step in range(steps):
        x, y = step_batch(rank, step, bad)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        own_ok = all(g.isfinite().all() for g in grads)   # decided on this rank's own gradient
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.AVG)
        if not own_ok:
            continue
        opt.step()
        taken += 1
    return taken, model.weight.detach().clone()


def skip_raises(bad, steps=6):
    raise RuntimeError("learner bug")


@pytest.mark.parametrize("fn, words", [
    (skip_raises, ["With world_size=2 and a corrupt batch on rank 1 at step 2, your function raised "
                   "on the ranks", "RuntimeError: learner bug"]),
    (skip_counts_every_step, ["the weights match the reference, so every rank skipped the right step",
                              "every rank says it took 6 steps, not 5",
                              "count a step only when the optimizer really steps"]),
    (skip_never, ["every rank counts all 6 steps", "a gradient that is not finite was averaged in"]),
    (skip_alone_after_the_all_reduce, ["some rank took a step with a gradient that is not finite",
                                       "If a rank skipped alone after the all_reduce"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_skip_together_names_each_mistake(group, fn, words):
    verdict = check_skip_together(group, fn)
    assert_names(verdict, *words)
    assert "The ranks agree" not in verdict.message and "no rank skipped" not in verdict.message
    if fn is skip_never:                     # no rule was used: none is blamed
        assert "on the wrong rule" not in verdict.message


# --- 12: check_exact_mean_loss (its table: tests/test_nb12_gathers.py) ------------------------

def exact_own_mean(losses, indices, dataset_size):          # no collective: this rank's share only
    return losses.mean().item()


def exact_repeats_in_the_count(losses, indices, dataset_size):   # repeats left out of the sum only
    rank, world_size = dist.get_rank(), dist.get_world_size()
    kept = torch.arange(len(indices)) * world_size + rank < dataset_size
    totals = torch.stack([losses[kept].sum(), torch.tensor(float(len(indices)))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


@pytest.mark.parametrize("fn, words", [
    (exact_own_mean, ["Each rank returned the mean of its own share only",
                      "your function called none"]),
    (exact_repeats_in_the_count, ["With 7 samples on 2 ranks", "1 of the indices the ranks hold is a repeat. Step 3 showed where the sampler puts repeats"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_exact_mean_loss_names_each_mistake(group, fn, words):
    assert_names(check_exact_mean_loss(group, fn), *words)


# --- 14: check_global_grad_norm (its table: tests/test_nb14_shards.py) ------------------------

def norm_from_gathered_pieces(model, mesh):    # right value, but every rank's local pieces gathered
    split, copied = [], []
    for p in model.parameters():
        piece = p.grad.to_local().flatten()
        (split if p.grad.device_mesh.ndim == 2 and p.grad.placements[1].is_shard() else copied).append(piece)
    split, copied = torch.cat(split), torch.cat(copied)
    everyone = [torch.empty_like(split) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, split)
    dp = mesh.get_group("dp")
    over_dp = [torch.empty_like(copied) for _ in range(dist.get_world_size(dp))]
    dist.all_gather(over_dp, copied, group=dp)
    return (torch.cat(everyone).pow(2).sum() + torch.cat(over_dp).pow(2).sum()).sqrt().item()


def norm_copies_left_local(model, mesh):       # the copies over tp never summed over dp
    split, copied = torch.zeros(()), torch.zeros(())
    for p in model.parameters():
        squares = p.grad.to_local().pow(2).sum()
        if p.grad.device_mesh.ndim == 2 and p.grad.placements[1].is_shard():
            split += squares
        else:
            copied += squares
    dist.all_reduce(split)
    return (split + copied).sqrt().item()


def norm_copies_added_over_tp(model, mesh):    # review 6 (14-3): the copies added over tp, not dp
    split, copied = torch.zeros(()), torch.zeros(())
    for p in model.parameters():
        squares = p.grad.to_local().pow(2).sum()
        if p.grad.device_mesh.ndim == 2 and p.grad.placements[1].is_shard():
            split += squares
        else:
            copied += squares
    dist.all_reduce(split)
    dist.all_reduce(copied, group=mesh.get_group("tp"))
    return (split + copied).sqrt().item()


@pytest.mark.parametrize("fn, words", [
    (norm_copies_added_over_tp, ["Your function returns different norms on the ranks",
                                 "The copies (0.bias, 2.weight, 2.bias) were added over tp",
                                 "each row counted twice"]),
    (norm_copies_left_local, ["Your function returns different norms on the ranks",
                              "Every rank must clip with the same factor"]),
    (norm_from_gathered_pieces, ["The value is right, but your function called dist.all_gather with a tensor of",
                                 "only a few numbers cross"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_check_global_grad_norm_names_each_mistake(group, fn, words):
    assert_names(check_global_grad_norm(group, fn), *words)


def norm_per_parameter(model, mesh):           # right: one sum of squares per parameter tensor
    def squares(p, split):
        kind = p.grad.device_mesh.ndim == 2 and p.grad.placements[1].is_shard()
        return p.grad.to_local().pow(2).sum() if kind == split else torch.zeros(())
    split = torch.stack([squares(p, True) for p in model.parameters()])
    copied = torch.stack([squares(p, False) for p in model.parameters()])
    dist.all_reduce(split)
    dist.all_reduce(copied, group=mesh.get_group("dp"))
    return (split.sum() + copied.sum()).sqrt().item()


def test_check_global_grad_norm_lets_a_few_numbers_cross(group):
    """The bound on what may cross is the number of parameter tensors: one sum of squares
    per parameter is still "a few numbers"."""
    verdict = check_global_grad_norm(group, norm_per_parameter)
    assert verdict, verdict.message
