"""The README's benchmark figures are those of the stored runs (``benchmarks/results/``):
a re-run of ``make bench`` or ``make workshop-bench`` that is not carried into the
README fails here, as does a README figure no run produced."""
from __future__ import annotations

import json
import pathlib
import re
import statistics

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"
README_LINES = set(README.splitlines())


def not_in_readme(rows: list[str], width: int = 60) -> list[str]:
    """The start of each of ``rows`` that is not a line of the README as it is."""
    return [row[:width] for row in rows if row not in README_LINES]


def test_the_readme_shows_the_stored_benchmark_tables_as_they_are():
    """Every table row of latest.md (start-up by world size, failures, explorers) and its
    lines that say when and how the explorers were measured are in the README verbatim."""
    lines = (RESULTS / "latest.md").read_text().splitlines()
    shown = [line for line in lines
             if line.startswith("|") or line.startswith(("Explorers, ", "Widget round trip"))]
    assert len(shown) >= 30            # 4 world sizes, 5 failure cases, 16 explorers, headers
    missing = not_in_readme(shown, 90)
    assert not missing, f"not in the README as stored: {missing}"


def test_the_readme_sizing_table_quotes_the_stored_class_figures():
    """The sizing table's waits per class size, median (95th percentile) in ms, and its
    memory range are those of workshop.json; the class table's rows are workshop.md's."""
    run = json.loads((RESULTS / "workshop.json").read_text())
    parts = [f"{round(c['wait_median_s'] * 1e3)} ({round(c['wait_p95_s'] * 1e3)}) ms for {c['learners']}"
             for c in run["classroom"]]
    waits = ", ".join([parts[0] + " learner", *parts[1:]])      # "80 (302) ms for 1 learner, 93 ..."
    assert f"median (95th percentile): {waits}, on 2 cores" in README
    pss = [c["pss_per_learner_gib"] for c in run["classroom"]]
    row = next(line for line in README.splitlines() if line.startswith("| memory (PSS"))
    low, high = map(float, re.search(r"\| ([\d.]+) to ([\d.]+) GiB", row).groups())
    assert (low, high) == (round(min(pss), 2), round(max(pss), 2))
    assert f"{run['alone']['pss_gib']:.2f} GiB for one learner on notebook 01" in row
    rows = [line for line in (RESULTS / "workshop.md").read_text().splitlines()
            if re.match(r"\| \d+ \| \d+ \| [\d.]+ GiB \|", line)]
    assert len(rows) == len(run["classroom"])
    missing = not_in_readme(rows)
    assert not missing, f"class rows not in the README as stored: {missing}"


def test_the_readme_names_the_explorers_that_meet_the_median_goal_in_the_stored_run():
    """The README's count and list of explorers at or under the goal of issue 23 (a
    median wait of 100 ms per move) are those of latest.json's explorer run."""
    run = json.loads((RESULTS / "latest.json").read_text())
    meet = sorted(name[:2] for name, e in run["explorers"].items() if e["median_s"] <= 0.100)
    text = " ".join(README.split())                      # the paragraph, unwrapped
    said = re.search(r"(\d+) of the (\d+) explorers meet it in the run of [^(]*\(([^);]*)", text)
    assert said, "the README no longer says which explorers meet the median goal"
    count, total, names = int(said[1]), int(said[2]), re.findall(r"\d\d", said[3])
    assert (count, total, sorted(names)) == (len(meet), len(run["explorers"]), meet)


def test_the_same_world_size_medians_are_those_of_the_stored_moves_and_the_readme_names_who_meets_the_goal():
    """Issue 23 states its median goal at world size 4: a move of a control that does not
    resize the group. Each explorer's stored "same world size" median, its count and its
    world sizes are re-derived from its stored moves (a move is ``[control, value, first,
    complete, world size before, after]``), and the README's count and list of explorers
    at or under 100 ms on that measure are the stored run's."""
    run = json.loads((RESULTS / "latest.json").read_text())
    meet = []
    for name, e in run["explorers"].items():
        kept = [m for m in e["waits"] if len(m) == 6 and m[4] == m[5]]
        assert len(kept) == e["kept_moves"] and sorted({m[4] for m in kept}) == e["kept_world_sizes"], name
        if kept:
            median = statistics.median(m[2] for m in kept)
            assert abs(median - e["kept_median_s"]) < 1e-12, name
            if median <= 0.100:
                meet.append(name[:2])
    text = " ".join(README.split())
    said = re.search(r"Counting only the moves that keep the group's world size, (\d+) of "
                     r"the (\d+) explorers meet it \(([^)]*)\)", text)
    assert said, "the README no longer says which explorers meet the goal at one world size"
    count, total, names = int(said[1]), int(said[2]), re.findall(r"\d\d", said[3])
    assert (count, total, sorted(names)) == (len(meet), len(run["explorers"]), sorted(meet))


RESTARTS = {"04_ddp_gradients": (("world_size",), "a fraction of a second"),
            "08_sharded_data_parallel": (("world_size",), "under a second on an idle 2-core machine"),
            "13_what_ddp_expects_of_a_model": (("world_size",), "under a second on an idle 2-core machine"),
            "14_clipping_and_checkpoints_across_shards": (("saved_on", "loaded_on"),
                                                          "under a second on an idle 2-core machine")}
"""Notebooks whose explorer note says how long a move that restarts the ranks takes: the
controls that restart them, and the words."""


def test_the_explorer_waits_the_notebooks_state_are_those_of_the_stored_sweep():
    """An explorer note that tells the learner how long a restart of the ranks, or 13's
    hang, keeps the explorer waiting says what the stored sweep of every control
    (latest.json, an idle 2-core machine) measured: every such move under a second, and
    13's hang just over its group's 3 s timeout."""
    sweep = json.loads((RESULTS / "latest.json").read_text())["explorers"]
    for name, (controls, words) in RESTARTS.items():
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        prose = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        assert words in prose and "a second or two" not in prose, name
        moves = [m for m in sweep[name]["waits"] if m[0] in controls and m[1] != "rank 0 only"]
        assert len(moves) >= 3 and max(m[2] for m in moves) < 1.0, (name, moves)
    nb = json.loads((ROOT / "notebooks" / "13_what_ddp_expects_of_a_model.ipynb").read_text())
    assert "the 3-second timeout ends it (just over 3 s before the explorer answers)" in \
        "".join("".join(c["source"]) for c in nb["cells"])
    hang = [m[2] for m in sweep["13_what_ddp_expects_of_a_model"]["waits"] if m[1] == "rank 0 only"]
    assert hang and all(3.0 <= s < 3.5 for s in hang), hang


def test_the_readme_quotes_the_stored_cpu_per_move():
    """"A move costs 0.11 to 0.37 s of CPU in 13 of the 16 explorers, more where ... (14's
    ..., 0.53 s; 15's ..., 0.91 s; 10's ..., 1.43 s)": the range, the count and the three
    named explorers are latest.json's."""
    cpu = {name[:2]: e["cpu_per_move_s"]
           for name, e in json.loads((RESULTS / "latest.json").read_text())["explorers"].items()}
    text = " ".join(README.split())
    said = re.search(r"A move costs ([\d.]+) to ([\d.]+) s of CPU in (\d+) of the (\d+) explorers, "
                     r"more where the lesson's own runs are heavier \(([^)]*)\)", text)
    assert said, "the README no longer says what a move costs in CPU"
    named = {nb: float(s) for nb, s in re.findall(r"(\d\d)'s [^,]*, ([\d.]+) s", said[5])}
    rest = sorted(v for nb, v in cpu.items() if nb not in named)
    assert (float(said[1]), float(said[2])) == (round(rest[0], 2), round(rest[-1], 2))
    assert (int(said[3]), int(said[4])) == (len(rest), len(cpu))
    assert named == {nb: round(cpu[nb], 2) for nb in named} and min(named.values()) > rest[-1]


def test_each_header_states_the_slowest_stored_browser_run_plus_room():
    """Every notebook's header run time is the slowest of its browser runs stored in
    browser_run_times.json, plus 20 %, rounded up to 5 s (the README's footnote; the README
    column equals the header, tests/test_notebooks.py). A stored run that outgrows a header,
    or a header with room to spare beyond that rule, fails here; so does a footnote whose
    range no stored run gives. A run may hold some notebooks only (a notebook added after
    the earlier runs); every notebook needs at least one run, and every stored name a
    notebook."""
    runs = json.loads((RESULTS / "browser_run_times.json").read_text())["runs"]
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    names = {p.name for p in notebooks}
    assert runs and all(run["run_all_s"] and set(run["run_all_s"]) <= names for run in runs)
    wrong = []
    for path in notebooks:
        header = "".join(json.loads(path.read_text())["cells"][0]["source"])
        stated = int(re.search(r"about (\d+) s to run top to bottom", header).group(1))
        mine = [run["run_all_s"][path.name] for run in runs if path.name in run["run_all_s"]]
        assert mine, f"{path.name} has no stored browser run"
        slowest = max(mine)
        if not (slowest * 1.2 <= stated < slowest * 1.2 + 5):
            wrong.append(f"{path.name}: 'about {stated} s', slowest stored run {slowest} s")
    assert not wrong, wrong
    times = [(t, name[:2]) for run in runs for name, t in run["run_all_s"].items()]
    (low, low_nb), (high, high_nb) = min(times), max(times)
    prose = " ".join(README.split())
    count = dict(enumerate(("two", "three", "four", "five", "six", "seven", "eight", "nine",
                             "ten"), start=2)).get(len(runs), str(len(runs)))
    assert (f"The {count} runs stored" in prose
            and f"took {low} s ({low_nb}) to {high} s ({high_nb})" in prose)


def test_the_readme_shows_the_stored_first_start_rows_with_the_first_calls_after_a_resize():
    """The first-start table (setup cell by preload, then the first DDP, DTensor and FSDP2
    call after a resize) is workshop.md's, row for row; the README marks the default."""
    rows = [line for line in (RESULTS / "workshop.md").read_text().splitlines()
            if re.match(r"\| (full|eager|torch) \| [\d.]+ s \|", line)]
    run = json.loads((RESULTS / "workshop.json").read_text())
    assert len(rows) == 3 and all(len(f["first_calls"]) == 3 for f in run["first_start"])
    shown = [r.replace("| full |", "| full (default) |", 1) for r in rows]
    missing = not_in_readme(shown)
    assert not missing, f"first-start rows not in the README as stored: {missing}"


def test_the_readme_shows_each_notebooks_stored_setup_cell_time_and_who_meets_the_goal():
    """Every notebook's own setup-cell row of workshop.md is in the README as stored, one
    per notebook, and the README's range of ratios and the notebooks it says meet
    issue 23's goal (1.3x a bare ``import torch``) are workshop.json's."""
    rows = [line for line in (RESULTS / "workshop.md").read_text().splitlines()
            if re.match(r"\| \d\d_\S+ \| [\d.]+ s \(", line)]
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [row.split(" | ")[0][2:] for row in rows] == notebooks
    missing = not_in_readme(rows)
    assert not missing, f"not in the README as stored: {missing}"
    ratios = {name[:2]: x["ratio"] for name, x in
              json.loads((RESULTS / "workshop.json").read_text())
              ["notebooks_first_start"]["notebooks"].items()}
    low, high = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    meet = [k for k, r in ratios.items() if r <= 1.3]
    text = " ".join(README.split())
    said = re.search(r"own setup cell takes ([\d.]+)x \((\d\d)\) to ([\d.]+)x \((\d\d)\) at [\d:]+, "
                     r"and (\d+) of the (\d+) meet it \(((?:\d\d's(?:, | and )?)+)\)", text)
    assert said, "the README no longer says how the notebooks' own setup cells compare"
    assert said.groups()[:4] == (f"{ratios[low]:.2f}", low, f"{ratios[high]:.2f}", high), \
        said.groups()
    assert (int(said.group(5)), int(said.group(6))) == (len(meet), len(ratios))
    assert re.findall(r"\d\d", said.group(7)) == meet, (said.group(7), meet)
