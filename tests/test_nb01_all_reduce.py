"""Notebook 01: the all_reduce explorer (headless), the exercise check, and the facts taught."""
from __future__ import annotations

import json
import math
import pathlib
import re
import sys

import cloudpickle

import pytest
import torch
import torch.distributed as dist

import conftest
from conftest import SOLUTIONS, load_solution
from reducelab.checks import reveal
from reducelab.checks.all_reduce import check_spread_over_ranks, local_values, reference_spread
from reducelab.plots import message_png
from reducelab.widgets.all_reduce import PATTERNS, AllReduceExplorer

# Send this module's functions by value, as a notebook cell's are: the ranks then need
# not import the test module (and everything it imports) before they can run them.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def demo(op, pattern, dtype, n):
    """The notebook's rank function, in short: rank+1, signed or one-hot inputs."""
    rank = dist.get_rank()
    if pattern == "one-hot":
        x = torch.zeros(n)
        x[rank % n] = 1.0
    elif pattern == "signed":
        x = torch.full((n,), (rank // 2 + 1) * (1.0 if rank % 2 == 0 else -1.0))
    else:
        x = torch.full((n,), rank + 1.0)
    x = x.to(getattr(torch, dtype))
    before = x.clone()
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return before, x


@pytest.fixture()
def explorer(group):
    group.resize(4)
    return AllReduceExplorer(group, demo, n=4)


def reference(op, world_size, n=4):
    xs = torch.stack([torch.full((n,), r + 1.0) for r in range(world_size)])
    return {"SUM": xs.sum(0), "PRODUCT": xs.prod(0), "MIN": xs.min(0).values,
            "MAX": xs.max(0).values, "AVG": xs.mean(0)}[op]


@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "AVG"])
def test_changing_the_op_reruns_the_collective(explorer, op):
    explorer.controls["op"].value = op
    assert explorer.error is None
    want = reference(op, 4).numpy()
    assert (explorer.result.after == want).all()
    assert explorer.result.before[:, 0].tolist() == [1, 2, 3, 4]
    assert bytes(explorer.image.value[:4]) == b"\x89PNG"
    assert f"all_reduce({op})" in explorer.message.value


def test_world_size_slider_resizes_the_group(explorer, group):
    explorer.controls["world_size"].value = 7
    assert group.world_size == 7
    assert explorer.result.world_size == 7
    assert (explorer.result.after == 28).all()          # 1 + ... + 7
    explorer.controls["world_size"].value = 4


def test_refused_combination_shows_a_sentence_and_recovers(explorer):
    explorer.controls["dtype"].value = "int64"
    explorer.controls["op"].value = "AVG"
    assert explorer.result is None and explorer.error is not None
    assert "refuses AVG on int64" in explorer.message.value
    assert "Long" in explorer.error.reports[0].summary      # gloo's own words are kept
    explorer.controls["op"].value = "BXOR"                  # 1^2^3^4 = 4
    assert explorer.error is None and (explorer.result.after == 4).all()
    explorer.controls["dtype"].value = "float32"
    assert "refuses BXOR on float32" in explorer.message.value


def test_a_refused_combination_replaces_the_figure_with_a_note(explorer):
    explorer.controls["op"].value = "MAX"
    old = bytes(explorer.image.value)
    explorer.controls["op"].value = "BAND"                  # float32: refused by gloo
    assert explorer.result is None
    assert bytes(explorer.image.value) != old
    assert bytes(explorer.image.value) == message_png(
        "No figure for these settings: see the message below.")
    assert "refuses BAND on float32" in explorer.message.value
    assert "refuses BAND on float32" in explorer.text()     # the static text says it too
    explorer.controls["dtype"].value = "int64"              # 1 & 2 & 3 & 4 = 0
    assert explorer.error is None and (explorer.result.after == 0).all()


def test_signed_inputs_cancel_under_sum_and_the_scale_grows_by_world_size(explorer):
    assert "signed" in PATTERNS
    explorer.controls["pattern"].value = "signed"
    assert explorer.result.before[:, 0].tolist() == [1, -1, 2, -2]
    assert (explorer.result.after == 0).all()               # +1 - 1 + 2 - 2
    assert "Largest |value|: 2 before, 0 after" in explorer.text()
    explorer.controls["world_size"].value = 5               # + 3
    assert (explorer.result.after == 3).all()
    explorer.controls["world_size"].value = 4


def all_reduce_inputs(values):
    x = torch.tensor([values[dist.get_rank()]])
    dist.all_reduce(x)
    return x.item()


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0, 4.0], [1.0, -1.0, 2.0, -2.0], [1.0, -2.0, 3.0, -4.0],
                                    [0.9, 1.1, 1.0, 1.0], [0.5] * 4])
def test_sum_is_world_size_times_the_mean_and_bounded_by_the_largest_input(group, values):
    """Step 2 of the notebook: what SUM does to any inputs. The text's sentence: larger
    than every input whenever all inputs are positive; when signs differ they partly or
    wholly cancel, and the sum can come out smaller than some inputs."""
    group.resize(4)
    total = group.run(all_reduce_inputs, values)[0]
    assert total == pytest.approx(4 * sum(values) / 4, abs=1e-6)
    assert abs(total) <= 4 * max(abs(v) for v in values) + 1e-6
    if all(v > 0 for v in values):
        assert total > max(values)                     # 1, 2, 3, 4 (sizes differ) give 10
    else:
        assert abs(total) < sum(abs(v) for v in values)     # they cancel, partly or wholly
        assert total < max(values)


def all_reduce_avg_int64_caught():
    x = torch.tensor([dist.get_rank() + 1])
    try:
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    except RuntimeError:
        pass
    return x.item()


def test_question_2_a_hidden_avg_refusal_on_int64_leaves_the_sum(group):
    """Question 2 (review 6, 01-1: the signed +1, -1, +2, -2, +3 was addition again): four
    int64 ranks hide gloo's refusal of AVG; every rank holds 10, the SUM the refusal left
    behind, not the mean 2.5 nor its input. The stored reveal shows that run; nothing
    above the question says it, and the WHY opens with the reason, not the answer."""
    group.resize(4)
    assert group.run(all_reduce_avg_int64_caught) == [10] * 4
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    q = next(c for c in cells if "".join(c["source"]).startswith("def all_reduce_avg_int64_caught"))
    assert "group.resize(4)" in "".join(q["source"]) and "answer_2" in "".join(q["source"])
    shown = "".join("".join(o["data"]["text/html"]) for o in q["outputs"] if "data" in o)
    assert "gives 10." in shown and "rank 0 10, rank 1 10, rank 2 10, rank 3 10" in shown, shown
    text = notebook_cells()
    at = next(i for i, c in enumerate(text) if c.startswith("answer_2 = None"))
    above = "\n".join(text[:at])
    assert "dist.all_reduce(x, op=dist.ReduceOp.AVG)" in above.split("**Question 2.**")[1]
    for spoiler in ("stays in the tensor", "after the SUM", "after the `SUM`", "leaves the sum",
                    "[10, 10, 10, 10]"):
        assert spoiler not in above, spoiler
    assert all(c["cell_type"] == "markdown" or "ReduceOp.AVG" not in "".join(c["source"])
               for c in cells[:cells.index(q) - 1])            # the table of refusals follows it
    assert why_01(2).startswith("gloo's AVG is a SUM followed by a true division")
    assert "1 + 2 + 3 + 4 = 10, is written into x on every rank first" in why_01(2)


def changed_by(op, values):
    x = torch.tensor([values[dist.get_rank()]])
    before = x.clone()
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return not torch.equal(before, x)


@pytest.mark.parametrize("op, values, changed", [
    ("MIN", [3.0, 1.0, 4.0, 1.0], [True, False, True, False]),       # question 3: a tie at the minimum
    ("MAX", [3.0, 1.0, 4.0, 1.0], [True, True, False, True]),
    ("MAX", [1.0, 2.0, 3.0, 4.0], [True, True, True, False])])
def test_min_and_max_change_only_the_ranks_not_holding_the_result(group, op, values, changed):
    """Question 3's fact, and its neighbours: a rank that already holds the extreme keeps
    its tensor as it was, ties included."""
    group.resize(4)
    assert group.run(changed_by, op, values) == changed


def keep_the_input():
    value = torch.tensor([dist.get_rank() + 1.0])
    before = value
    dist.all_reduce(value)
    return before.item(), value.item()


def test_question_1_before_is_the_same_tensor_and_shows_the_sum(group):
    """Question 1 (a second review: it was arithmetic, step 1 again with 8 ranks): a
    name bound before the call, without clone, shows the sum on every rank."""
    group.resize(4)
    assert group.run(keep_the_input) == [(10.0, 10.0)] * 4
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    q = next(c for c in cells if "".join(c["source"]).startswith("def keep_the_input"))
    shown = "".join("".join(o["data"]["text/html"]) for o in q["outputs"] if "data" in o)
    assert "rank 0: before 10, value 10" in shown and "gives 10.0." in shown


def test_question_1_is_not_answered_above_it():
    cells = notebook_cells()
    q = next(i for i, c in enumerate(cells) if c.startswith("def keep_the_input"))
    above = "\n".join(cells[:q])
    assert "before = value  " in above                        # the question shows the lines
    for spoiler in (".clone(", "same tensor", "alias", "second name", "before: 10"):
        assert spoiler not in above, spoiler
    assert "before = value.clone()" in why_01(1)             # the reveal says how to keep it


def why_01(q):
    from reducelab.checks import why
    return why("01", q)


def reduced_twice():
    x = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    first = x.item()
    dist.all_reduce(x)
    return first, x.item()


def test_the_same_tensor_reduced_twice_gives_world_size_times_the_sum(group):
    """The everyday cause of values that grow (a second review): 1..4 give 10, then 40;
    the stored cell shows it and the text names the two ways it happens."""
    group.resize(4)
    assert group.run(reduced_twice) == [(10.0, 40.0)] * 4
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    i = next(i for i, c in enumerate(cells) if "".join(c["source"]).startswith("def reduced_twice"))
    out = "".join("".join(o.get("text", "")) for o in cells[i]["outputs"])
    assert "rank 0: after one all_reduce 10, after two 40" in out, out
    assert "the same on every rank: True" in out, out
    # review 6 (01-2): its own point in step 5 (not buried in the myths), with the fix
    text = notebook_cells()
    step5 = next(j for j, c in enumerate(text) if c.startswith("## Step 5"))
    exercise = next(j for j, c in enumerate(text) if c.startswith("# %load solutions/01_"))
    assert step5 < i < exercise
    after = text[i + 1]
    assert after.startswith("10, then 40") and "Reduce each value once" in after
    assert "metric reduced in place" in after and "DDP already averaged" in after
    # review 6 (01-2): the point is the summary's own line, with its two causes and the fix
    summary = next(c for c in notebook_cells() if "## Summary" in c).split("## Summary")[1]
    line = next(l for l in summary.splitlines() if "all-reduced twice" in l)
    assert "metric reduced in place" in line and "DDP already averaged" in line
    assert "into a clone" in line


def signed_sum(n):
    x = torch.full((n,), (dist.get_rank() // 2 + 1) * (1.0 if dist.get_rank() % 2 == 0 else -1.0))
    dist.all_reduce(x)
    return x


def test_the_explorer_try_line_says_what_to_notice(group):
    """Review 6 (01-4): "Try:" says what to notice. The signed pairs cancel on 4 ranks and
    leave +3 on 5; with the explorer's default 6 elements on 4 ranks, neither MIN's nor
    MAX's row of random ints is any one rank's input, so the line's question has a point."""
    try_line = next(l for c in notebook_cells() for l in c.splitlines() if l.startswith("Try, and notice:"))
    assert "the pairs +k and -k sum to 0; the fifth rank's +3 is left" in try_line
    assert "does the result match any one rank's input?" in try_line
    group.resize(4)
    assert all((x == 0).all() for x in group.run(signed_sum, 6))
    group.resize(5)
    try:
        assert all((x == 3).all() for x in group.run(signed_sum, 6))
    finally:
        group.resize(4)
    xs = torch.stack([torch.randint(0, 8, (6,), generator=torch.Generator().manual_seed(r)).float()
                      for r in range(4)])
    for row in (xs.min(0).values, xs.max(0).values):
        assert not any((xs[r] == row).all() for r in range(4))


def test_the_table_sets_each_sum_against_its_ceiling():
    """Review 5 (01-1): SUM / mean was world_size in every row, an identity. The table now
    shows |SUM| / (world_size x largest |input|): 1.00 for equal inputs, 0.00 for inputs
    that cancel wholly (+1, -1, +2, -2, the old question 2's case), between for the rest;
    each stored ratio is re-derived from the stored SUM and largest |input|."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    cell = next(c for c in cells if "".join(c["source"]).startswith("def all_reduce_inputs"))
    assert "group.resize(4)" in "".join(cell["source"])
    rows = "".join(cell["outputs"][0]["text"]).splitlines()
    assert "SUM  largest |input|  |SUM| / (world_size × largest)" in rows[0], rows[0]
    ratios = {}
    for row in rows[1:]:
        total, largest, ratio = (float(v) for v in row.split()[-3:])
        assert ratio == round(abs(total) / (4 * largest), 2) and 0 <= ratio <= 1, row
        ratios[row.split("(")[1].split(")")[0]] = ratio
    assert ratios["equal"] == 1.0 and ratios["opposed"] == 0.0
    assert 0 < ratios["signed"] < ratios["positive"] < ratios["close"] < 1
    text = "".join(cells[cells.index(cell) + 1]["source"]).split("## Step 3")[0]
    assert "ceiling" in text and "(row 3)" in text and "(row 5)" in text
    assert "`world_size` times the mean" in text


def test_sum_over_mean_is_no_longer_shown_as_a_finding():
    text = "\n".join(notebook_cells())
    assert "SUM / mean" not in text


def test_question_3_asks_which_ranks_change_and_the_run_answers_0_and_2(group):
    """A second review: question 3 turned on the word "values"; it asks for the list of
    ranks whose tensor changes, and the stored reveal gives [0, 2]."""
    group.resize(4)
    changed = group.run(changed_by, "MIN", [3.0, 1.0, 4.0, 1.0])
    assert [r for r, c in enumerate(changed) if c] == [0, 2]
    text = "\n".join(notebook_cells())
    assert "On which ranks does the tensor change? Answer with a list" in text
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    q = next(c for c in cells if "".join(c["source"]).startswith("def changed_by"))
    shown = "".join("".join(o["data"]["text/html"]) for o in q["outputs"] if "data" in o)
    assert "The real run gives [0, 2]." in shown
    # review 5 (01-3): [2, 0] names the same ranks; the cell compares as sets do
    same = "same=lambda a, b: sorted(a) == sorted(b)"
    assert same in "".join(q["source"]) and "in any order" in text
    compare = eval(same.split("=", 1)[1])
    assert reveal([2, 0], [0, 2], "", same=compare).passed
    assert not reveal([0, 1], [0, 2], "", same=compare).passed


def test_question_3_asks_about_inputs_the_table_did_not_show():
    """The table of step 3 runs every op on inputs 1, 2, 3, 4: question 3 asks about other
    inputs, so the table does not answer it."""
    text = "\n".join(notebook_cells())
    assert "Four ranks hold 3, 1, 4 and 1 (not the table's inputs)" in text
    assert 'group.run(changed_by, "MIN", [3.0, 1.0, 4.0, 1.0])' in text


def test_one_hot_sum_tells_every_rank_who_set_what(explorer):
    explorer.controls["pattern"].value = "one-hot"
    assert (explorer.result.after == 1).all()
    assert "every rank holds [1, 1, 1, 1]" in explorer.text()


def test_bad_initial_values_name_the_choices(group):
    with pytest.raises(ValueError, match="SUM, PRODUCT"):
        AllReduceExplorer(group, demo, op="MEAN")
    with pytest.raises(ValueError, match="n must be"):
        AllReduceExplorer(group, demo, n=0)


# --- the exercise: mean and spread over ranks, SUM only -----------------------------------------
def stub(n):                                            # the notebook's stub
    x = local_values(dist.get_rank(), n)
    mean, std = x, torch.zeros_like(x)
    return mean, std


def with_avg(n):                                        # right numbers, the op the text forbids
    x = local_values(dist.get_rank(), n)
    mean = x.clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    squares = (x - mean) ** 2
    dist.all_reduce(squares, op=dist.ReduceOp.AVG)
    return mean, squares.sqrt()


def with_avg_positional(n):                             # AVG passed without op=
    x = local_values(dist.get_rank(), n)
    mean = x.clone()
    dist.all_reduce(mean, dist.ReduceOp.AVG)
    squares = (x - mean) ** 2
    dist.all_reduce(squares)
    return mean, (squares / dist.get_world_size()).sqrt()


def reduced_a_copy(n):
    x = local_values(dist.get_rank(), n)
    dist.all_reduce(x.clone())
    return x, torch.zeros_like(x)


def forgot_to_divide(n):
    x = local_values(dist.get_rank(), n)
    dist.all_reduce(x)
    return x, torch.zeros_like(x)


def never_reduced(n):
    x = local_values(dist.get_rank(), n)
    return x / 2, torch.zeros_like(x)


def _mean_and_squares(n):
    x = local_values(dist.get_rank(), n)
    total = x.clone()
    dist.all_reduce(total)
    mean = total / dist.get_world_size()
    squares = (x - mean) ** 2
    dist.all_reduce(squares)
    return mean, squares


def variance(n):
    mean, squares = _mean_and_squares(n)
    return mean, squares / dist.get_world_size()


def sample_std(n):
    mean, squares = _mean_and_squares(n)
    return mean, (squares / (dist.get_world_size() - 1)).sqrt()


def squares_never_reduced(n):                          # each rank's own |x - mean|
    x = local_values(dist.get_rank(), n)
    total = x.clone()
    dist.all_reduce(total)
    mean = total / dist.get_world_size()
    return mean, ((x - mean) ** 2).sqrt()


def never_divided(n):                                   # the summed squares' root
    mean, squares = _mean_and_squares(n)
    return mean, squares.sqrt()


def distances_of_the_sum(n):                            # x is the sum after all_reduce
    x = local_values(dist.get_rank(), n)
    dist.all_reduce(x)
    mean = x / dist.get_world_size()
    squares = (x - mean) ** 2
    dist.all_reduce(squares)
    return mean, (squares / dist.get_world_size()).sqrt()


def root_mean_square(n):
    x = local_values(dist.get_rank(), n)
    total, squares = x.clone(), x ** 2
    dist.all_reduce(total)
    dist.all_reduce(squares)
    return total / dist.get_world_size(), (squares / dist.get_world_size()).sqrt()


def squared_after_in_place(n):                          # E[x²] - mean², x already the sum
    x = local_values(dist.get_rank(), n)
    dist.all_reduce(x)
    mean = x / dist.get_world_size()
    squares = x ** 2
    dist.all_reduce(squares)
    return mean, (squares / dist.get_world_size() - mean ** 2).clamp(min=0).sqrt()


def mean_absolute_deviation(n):                       # |x - mean| averaged, not squared
    x = local_values(dist.get_rank(), n)
    total = x.clone()
    dist.all_reduce(total)
    mean = total / dist.get_world_size()
    distance = (x - mean).abs()
    dist.all_reduce(distance)
    return mean, distance / dist.get_world_size()


def local_std(n):
    x = local_values(dist.get_rank(), n)
    total = x.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size(), x.std().expand(n)


def gathered_single(n):                                # torch 2.13's gather, then torch.std
    x = local_values(dist.get_rank(), n)
    rows = torch.empty(dist.get_world_size() * n)
    dist.all_gather_single(rows, x)
    rows = rows.view(dist.get_world_size(), n)
    return rows.mean(0), rows.std(0, correction=0)


def one_tensor(n):
    x = local_values(dist.get_rank(), n)
    dist.all_reduce(x)
    return x / dist.get_world_size()


def raises(n):
    raise ValueError("not written yet")


def one_pass(n):                                        # E[x²] - mean², done right: passes too
    x = local_values(dist.get_rank(), n)
    sums = torch.stack([x, x ** 2])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    mean, mean_sq = sums / dist.get_world_size()
    return mean, (mean_sq - mean ** 2).clamp(min=0).sqrt()


def one_pass_far_from_zero():
    x = torch.tensor([10000.0 + dist.get_rank() + 1])
    sums = torch.cat([x, x ** 2])
    dist.all_reduce(sums)
    mean, mean_sq = sums / dist.get_world_size()
    return (mean_sq - mean ** 2).item()


def test_the_pass_message_says_why_two_passes_beat_one(group):
    """A second review: a one-pass E[x²] - mean² passes too; the pass message says why the
    two-pass form is preferred, and its example (10001 to 10004) is a run's result."""
    group.resize(4)
    assert all(v <= 0 for v in group.run(one_pass_far_from_zero))
    verdict = check_spread_over_ranks(group, one_pass)
    assert verdict and "one-pass" in verdict.message
    assert "10001 to 10004 get a variance of 0 or below, not 1.25" in verdict.message


def test_reference_is_the_one_process_mean_and_population_std():
    mean, std = reference_spread(4, 4)
    assert mean.tolist() == [2.5, 5.0, 7.5, 10.0]
    assert std.tolist() == pytest.approx([math.sqrt(1.25) * (i + 1) for i in range(4)])


@pytest.mark.parametrize("name", ["solution", "one_pass"])
def test_right_answers_pass(group, name):
    fn = load_solution("01_spread_over_ranks").spread_over_ranks if name == "solution" else one_pass
    verdict = check_spread_over_ranks(group, fn)
    assert verdict, verdict.message
    assert group.world_size == 4                        # the check put the size back


@pytest.mark.parametrize("fn, says", [
    (stub, "never called dist.all_reduce"),
    (with_avg, "called all_reduce with ReduceOp.AVG"),
    (with_avg_positional, "called all_reduce with ReduceOp.AVG"),
    (reduced_a_copy, "did you reduce a copy"),
    (forgot_to_divide, "That is the SUM, 2 times too big"),
    (never_reduced, "never called dist.all_reduce"),
    (variance, "That is the variance over ranks"),
    (sample_std, "divided by world_size - 1 = 1"),
    (squares_never_reduced, "the squared distances were never added up over the ranks"),
    (never_divided, "never divided at all: at world_size 2 the two are the same"),
    (distances_of_the_sum, "the distances of the SUM from the mean"),
    (root_mean_square, "the mean itself was never taken off"),
    (squared_after_in_place, "after all_reduce had overwritten it with the sum"),
    (mean_absolute_deviation, "That is the mean absolute deviation"),
    (local_std, "the spread of this rank's own elements"),
    (gathered_single, "called dist.all_gather_single"),
    (one_tensor, "expected a pair of tensors (mean, std)"),
    (raises, "raised on the ranks"),
])
def test_each_likely_mistake_is_named(group, fn, says):
    verdict = check_spread_over_ranks(group, fn)
    assert not verdict
    assert says in verdict.message, verdict.message
    assert group.world_size == 4


def test_a_mistake_that_passes_at_world_size_2_is_named_for_what_it_is(group):
    """Each rank's own |x - mean| is the std at world_size 2, and at world_size 3 rank 0's
    equals the sample std: the check compares every rank before it names a mistake (an
    expert review found it called this one the sample std)."""
    group.resize(2)
    got = [std for (_, std) in group.run(squares_never_reduced, 4)]
    group.resize(4)
    _, want = reference_spread(2, 4)
    assert all(torch.allclose(std.double(), want) for std in got)
    verdict = check_spread_over_ranks(group, squares_never_reduced)
    assert "With world_size=3" in verdict.message and "sample" not in verdict.message


def test_avg_is_refused_although_its_numbers_are_right(group):
    """The exercise asks for SUM: AVG's numbers are right on gloo, and the check still
    says no (the first review found that it passed)."""
    group.resize(2)
    mean, std = group.run(with_avg, 4)[0]
    group.resize(4)
    want_mean, want_std = reference_spread(2, 4)
    assert torch.allclose(mean.double(), want_mean) and torch.allclose(std.double(), want_std)
    assert not check_spread_over_ranks(group, with_avg)


def test_the_check_leaves_all_reduce_as_it_was(group):
    check_spread_over_ranks(group, stub)
    assert dist.all_reduce.__name__ == "all_reduce"     # the kernel's own is untouched
    assert group.run(lambda: dist.all_reduce.__name__) == ["all_reduce"] * 4   # and the ranks'


def test_no_check_message_prints_the_solution(group):
    code = [line.strip() for line in
            (SOLUTIONS / "01_spread_over_ranks.py").read_text().splitlines()
            if len(line.strip()) > 12 and not line.strip().startswith(("#", "def ", "import", "from"))]
    for fn in (stub, with_avg, reduced_a_copy, forgot_to_divide, variance, sample_std,
               root_mean_square, squared_after_in_place, local_std, one_tensor, raises):
        message = check_spread_over_ranks(group, fn).message
        assert not [line for line in code if line in message], fn.__name__


def test_reveal_explains_with_and_without_a_prediction():
    assert not reveal(None, 36.0, "why")
    assert "No prediction" in repr(reveal(None, 36.0, "why"))
    assert reveal(36, 36.0, "why")
    assert "but the real run gives 36.0" in repr(reveal(20, 36.0, "why"))


def test_gloo_avg_on_float_and_refusals_as_the_notebook_says(group):
    group.resize(4)
    from reducelab import RankError

    def op_on(op, dtype):
        x = torch.tensor([dist.get_rank() + 1], dtype=dtype)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        return x.item()
    assert group.run(op_on, "AVG", torch.float32) == [2.5] * 4
    for op, dtype in [("AVG", torch.int64), ("BAND", torch.float32)]:
        with pytest.raises(RankError):
            group.run(op_on, op, dtype)
    assert group.run(op_on, "BAND", torch.int64) == [0] * 4


def test_explorer_on_a_closed_group_says_so(monkeypatch):
    from reducelab import LocalGroup
    # No open group to follow, as before the learner runs the setup cell again (this
    # module's shared group would otherwise be the kernel's newest open one).
    monkeypatch.setattr("reducelab.widgets.current_group", lambda: None)
    g = LocalGroup(world_size=2)
    ex = AllReduceExplorer(g, demo, n=2)
    g.close()
    ex.controls["op"].value = "MAX"
    assert "closed" in ex.message.value and "setup cell" in ex.message.value
    assert ex.result is None


def test_explorer_follows_the_new_group_once_the_setup_cell_runs_again():
    """The notebook's last cell says so: close the group, run the setup cell again, and
    the explorer runs on the new group."""
    from reducelab import LocalGroup
    old = LocalGroup(world_size=2)
    ex = AllReduceExplorer(old, demo, n=2)
    old.close()
    new = LocalGroup(world_size=2)          # what re-running the setup cell does
    try:
        ex.controls["op"].value = "MAX"
        assert ex.error is None and ex.group is new
        assert (ex.result.after == 2).all()
    finally:
        new.close()


def test_local_values_are_what_the_exercise_text_says():
    """The exercise text: element i of local_values(rank, n) is (rank + 1) * (i + 1),
    float32; the cell before the exercise prints them for four ranks."""
    assert local_values(0, 4).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert local_values(1, 4).tolist() == [2.0, 4.0, 6.0, 8.0]
    assert local_values(3, 2).dtype == torch.float32
    for rank in range(4):
        assert local_values(rank, 5).tolist() == [(rank + 1) * (i + 1) for i in range(5)]


def summed_gradient():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    inputs, targets = torch.randn(8), torch.randn(8)
    mine = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    w = torch.zeros(1, requires_grad=True)
    ((w * inputs[mine] - targets[mine]) ** 2).mean().backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    return grad.item()


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_summing_gradients_gives_world_size_times_the_whole_batch_gradient(group, world_size):
    """The last myth: the "aggregate update" is world_size times the whole-batch gradient;
    SUM / world_size is that gradient (equal shares of the batch)."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(8), torch.randn(8)
    w = torch.zeros(1, requires_grad=True)
    ((w * inputs - targets) ** 2).mean().backward()
    whole = w.grad.item()
    group.resize(world_size)
    summed = group.run(summed_gradient)
    group.resize(4)
    assert len(set(summed)) == 1                        # every rank holds the same sum
    assert abs(whole) > 0.1
    assert summed[0] == pytest.approx(world_size * whole, rel=1e-5)
    assert summed[0] / world_size == pytest.approx(whole, rel=1e-5)


NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "01_all_reduce.ipynb"


def notebook_cells():
    return ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def test_the_notebook_gives_no_answer_before_its_question():
    cells = notebook_cells()
    q2 = next(i for i, c in enumerate(cells) if c.startswith("answer_2 = None"))
    before_q2 = "\n".join(cells[:q2 + 2])
    assert "+ 0.0" not in before_q2 and "can cancel" not in before_q2
    assert "fraction of a second" not in "\n".join(cells)      # no time estimate in prose
    exercise = next(i for i, c in enumerate(cells) if c.startswith("# %load solutions/01_"))
    before = "\n".join(cells[:exercise])
    assert "local_values({rank}, 4)" in before and "(rank + 1) * (i + 1)" in before   # the inputs
    assert "ReduceOp.SUM` only" in cells[exercise - 1] and "correction=0" in cells[exercise - 1]


def test_a_new_world_size_figure_is_built_while_the_ranks_run(explorer):
    """The explorer builds the figure of a world size it has not shown while the new
    ranks start and run (Explorer.preparation), not after them."""
    conftest.assert_new_world_size_is_built_on_the_preparer(explorer, explorer.plot)


def test_after_a_world_size_move_the_next_one_starts_on_spares(explorer):
    """A move that resized the group has it keep world_size + 1 spares (in the
    background); the next world size starts its ranks on them, not on new forks."""
    import os
    import time

    from reducelab import processes
    group = explorer.group
    explorer.controls["world_size"].value = 3
    if processes.context().get_start_method() != "forkserver":
        return
    end = time.monotonic() + 10
    while time.monotonic() < end and len(group._spares) < 4:
        time.sleep(0.05)
    spares = [p.pid for p in group._spares]
    assert len(spares) == 4
    explorer.controls["world_size"].value = 4
    assert group.run(os.getpid) == spares and explorer.result.world_size == 4


def test_claim_1_and_example_3_are_cut_from_the_myths():
    """Review 6 (01-2): the myth section spent a cell on SUM being the default (step 1
    shows it) and on example 3's MAX (step 3's table shows MAX); both are cut."""
    text = "\n".join(notebook_cells())
    assert "def example_3" not in text and "inspect.signature" not in text


from test_notebooks import bound_and_loaded as _bound_and_loaded  # noqa: E402 (one definition, shared)


def test_the_optional_claims_follow_the_summary_and_no_core_cell_needs_them():
    """Review 5 (01-4): the myth section opened with a script's NameError, a distraction.
    That claim, and the ReduceOp docstring's, now follow the summary in a part marked
    optional, the NameError last; the stored NameError output is kept. No code cell
    outside that part uses a name only that part binds."""
    from test_notebooks import OPTIONAL_MARK
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    summary = next(i for i, t in enumerate(text) if "## Summary" in t)
    start = next(i for i, t in enumerate(text) if OPTIONAL_MARK.search(t))
    reading = next(i for i, t in enumerate(text) if t.startswith("## Further reading"))
    assert summary < start < reading
    assert any("## Myth vs reality" in t for t in text[:summary])
    name_error = next(i for i, t in enumerate(text) if "if __name__ == \"__main__\":" in t and cells[i]["cell_type"] == "code")
    assert start < name_error < reading and all(cells[j]["cell_type"] == "markdown" for j in range(name_error + 1, reading))
    out = "".join("".join(o.get("text", "")) for o in cells[name_error]["outputs"])
    assert "NameError: name 'run' is not defined" in out
    assert not any("NameError" in t for t in text[:start])
    # review 6 (01-3): %%ranks is an optional part after the summary, before the claims
    ranks = [i for i, t in enumerate(text) if t.startswith(("%%ranks", "%load_ext"))]
    assert ranks and all(summary < start <= i < name_error for i in ranks)
    assert OPTIONAL_MARK.search(text[start]) and "%%ranks" in text[start]
    code = [(i, *_bound_and_loaded(t)) for i, t in enumerate(text) if cells[i]["cell_type"] == "code"]
    optional = lambda i: start <= i < reading
    only_there = set().union(*(b for i, b, _ in code if optional(i))) - set().union(*(b for i, b, _ in code if not optional(i)))
    assert not [(i, loaded & only_there) for i, _, loaded in code if not optional(i) and loaded & only_there]


def test_review_7_question_2_has_a_reasoning_handle_and_the_wording_holds():
    """Review 7 (01-1): question 2 (what x holds after AVG's caught refusal) was only
    guessable. Step 3 says, before it, how torch builds gloo's AVG (a SUM, then a true
    division), and leaves to the learner which part refuses int64 and what x then holds;
    the spoiler test above still holds. (01-3) Step 1 no longer says "nothing was broadcast",
    which reads wrong next to MPI's all_reduce = reduce + broadcast. (01-4) Two of the
    explorer's five tries are marked optional. (01-2) The factor hides under Adam."""
    text = notebook_cells()
    at = next(i for i, c in enumerate(text) if c.startswith("answer_2 = None"))
    above = "\n".join(text[:at])
    assert ("gloo has no `AVG` of its own: torch runs it as a `SUM` over the ranks, then a true "
            "division by `world_size` (pytorch/pytorch#149781).") in above.split("**Question 2.**")[0]
    assert "written into x" not in above and "10" not in above.split("## Step 3")[1]
    assert why_01(2).startswith("gloo's AVG is a SUM followed by a true division by world_size.")
    step_1 = next(c for c in text if c.startswith("Every rank ends with **10 = 1 + 2 + 3 + 4**"))
    assert "broadcast" not in step_1
    assert "No rank's value was copied to the others" in step_1 and "every rank receives the reduction" in step_1
    try_line = next(l for c in text for l in c.splitlines() if l.startswith("Try, and notice:"))
    assert "; if you have time, `AVG` on `int64` (refused) and `PRODUCT` with 8 ranks" in try_line
    reality = next(c for c in text if c.startswith("Reality: the summed gradient is `world_size` times"))
    assert "Adam and AdamW, which divide by the gradient's running scale, nearly hide the factor; clipping at a fixed norm does not." in reality
