"""Every committed notebook follows the project's patterns (README, "How a notebook is
built"). These read the tracked notebooks only, as they are committed:

* saved as one clean top-to-bottom run, with a kernelspec;
* explorers stay live after Run All: no notebook closes its group;
* predictions stay unspoiled: an unanswered question shows only the prompt, with the
  real result folded in a ``<details>``, and nothing else in its cell;
* every figure reads without a kernel: an explorer's display carries an ``image/png``,
  and no PNG is wider than a notebook;
* one solution flow: the learner's ``def`` cell starts with ``# %load solutions/…``, the
  check is the next code cell, the text says to run the def cell and then the check,
  and no check message prints the solution;
* no empty output areas;
* the project stands alone: nothing in the repository points outside it.
"""
from __future__ import annotations

import ast
import base64
import html
import json
import pathlib
import re
import struct
import subprocess

import pytest

from reducelab.checks import PROMPT
from reducelab.checks.answers import WHY, why

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WIDTH_PX = 960
"""Widest PNG a notebook may hold: ``plots.MAX_WIDTH`` at ``plots.DPI``."""


def load(path):
    return json.loads(path.read_text())


def code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def source(cell) -> str:
    return "".join(cell["source"])


def texts(output) -> list[str]:
    if output["output_type"] == "stream":
        return ["".join(output["text"])]
    data = output.get("data", {})
    return ["".join(v) if isinstance(v, list) else v for k, v in data.items()
            if k.startswith("text/")]


ids = [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_saved_as_one_clean_run_with_a_kernelspec(path):
    nb = load(path)
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3"
    counts = [c.get("execution_count") for c in code_cells(nb)]
    assert counts == list(range(1, len(counts) + 1)), counts
    for c in code_cells(nb):
        assert not any(o["output_type"] == "error" for o in c["outputs"]), source(c)[:80]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_the_group_stays_open_so_explorers_are_live_after_run_all(path):
    for c in code_cells(load(path)):
        live = "\n".join(line.split("#")[0] for line in source(c).splitlines())
        assert not re.search(r"\bgroup\.close\(\)", live), source(c)[:120]


CLOSING = ("## When you are done\nThe ranks stop by themselves when the kernel shuts down or "
           "restarts. To stop them now, remove the `# ` in the cell below and run it. The "
           "explorers above then say their group is closed, and follow the new group once you "
           "run the setup cell again.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_the_notebook_ends_by_saying_how_to_stop_the_ranks(path):
    """The last cell closes every group, commented out; the text before it says why and how."""
    cells = [source(c) for c in load(path)["cells"]]
    assert cells[-2].endswith(CLOSING), cells[-2][-200:]
    closes = cells[-1].split("; ")
    assert closes[0] == "# group.close()" and all(c.endswith(".close()") for c in closes), cells[-1]


def verdicts(nb):
    for c in code_cells(nb):
        for o in c["outputs"]:
            html_text = "".join(o.get("data", {}).get("text/html", ""))
            if "reducelab-verdict" in html_text:
                yield c, o, html_text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_unanswered_questions_show_only_the_prompt(path):
    nb = load(path)
    questions = [(c, o, h) for c, o, h in verdicts(nb) if 'data-state="unanswered"' in h]
    assert questions, "a notebook has predict-then-run questions"
    for cell, output, page in questions:
        folded = re.sub(r"<details>.*?</details>", "", page, flags=re.S)
        visible = html.unescape(re.sub(r"<[^>]+>", "", folded)).strip()
        assert visible == f"🤔 {PROMPT}", visible
        assert "".join(output["data"]["text/plain"]) == f"🤔 {PROMPT}"
        others = [o for o in cell["outputs"] if o is not output]
        assert not others, f"the question cell shows more than its folded verdict: " \
                           f"{[t[:80] for o in others for t in texts(o)]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_answer_cells_hold_no_answer(path):
    for c in code_cells(load(path)):
        for line in source(c).splitlines():
            if re.match(r"answer(_\w+)?\s*=", line):
                assert re.match(r"answer(_\w+)?\s*=\s*None\b", line), line


def png_size(b64: str) -> tuple[int, int]:
    raw = base64.b64decode(b64)
    return struct.unpack(">II", raw[16:24])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_every_figure_reads_without_a_kernel_and_fits_the_notebook(path):
    for c in code_cells(load(path)):
        for o in c["outputs"]:
            data = o.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data and \
                    "Explorer(" in "".join(data.get("text/plain", "")):
                assert "image/png" in data, f"explorer without a static picture: {source(c)[:80]}"
            if "image/png" in data:
                width, height = png_size("".join(data["image/png"]))
                assert width <= WIDTH_PX, f"{width} px wide: {source(c)[:80]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_no_empty_output_areas(path):
    for c in code_cells(load(path)):
        for o in c["outputs"]:
            if o["output_type"] == "stream" or set(o.get("data", {})) <= {"text/plain"}:
                assert any(t.strip() for t in texts(o)), f"empty output in: {source(c)[:80]}"


def exercises(nb):
    cells = code_cells(nb)
    for i, c in enumerate(cells):
        first = source(c).splitlines()[0] if source(c) else ""
        m = re.match(r"# %load (solutions/\S+\.py)$", first)
        if m:
            yield m.group(1), c, cells[i + 1] if i + 1 < len(cells) else None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_one_solution_flow(path):
    nb = load(path)
    found = list(exercises(nb))
    assert found, "every notebook has an exercise whose def cell starts with # %load"
    markdown = "\n".join(source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    for solution, def_cell, check_cell in found:
        solution_path = path.parent / solution
        assert solution_path.exists(), solution
        assert re.search(r"^(def \w+|\w+ = )", source(def_cell), re.M), \
            "the %load cell holds the learner's def (or assignment)"
        assert check_cell is not None and "check_" in source(check_cell), \
            "the check is the code cell right after the def cell"
        assert "def " not in source(check_cell), "the check cell holds no def"
        assert re.search(r"run (it|the (def|cell)).{0,80}then.{0,40}(run )?the check",
                         markdown, re.I | re.S), "the text says: run the def cell, then the check"
        code = [line.strip() for line in solution_path.read_text().splitlines()
                if len(line.strip()) > 12 and not line.strip().startswith(("#", '"', "def "))]
        shown = "\n".join(t for o in check_cell["outputs"] for t in texts(o))
        leaked = [line for line in code if line in shown]
        assert not leaked, f"the check's message prints the solution: {leaked}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_an_exercise_starts_from_a_body_that_runs_not_a_bare_pass(path):
    """The learner's def starts wrong but runnable, so the check's first message names a
    mistake; a bare ``pass`` only earns "returned None" (an expert review found two)."""
    for _, def_cell, _ in exercises(load(path)):
        for node in ast.parse(source(def_cell)).body:
            if isinstance(node, ast.FunctionDef):
                body = [b for b in node.body if not (isinstance(b, ast.Expr)
                                                     and isinstance(b.value, ast.Constant))]
                assert not all(isinstance(b, ast.Pass) for b in body), \
                    f"{node.name} starts from a bare pass"


# Spelled in pieces so that this pattern is no hit of its own for a grep over the repository.
OUTSIDE = re.compile("|".join([r"shared/" "seeds", r"\.\./" "shared", "/wo" "rk/", "/tmp/" "praxium",
                               "/ro" "ot/", r"/ho" r"me/\w+"]))


def test_the_project_stands_alone():
    """No path outside the repository: a clone has no shared/ and no machine paths."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".whl") or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and name != "tests/test_notebooks.py":
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits[:20])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_the_setup_cell_says_what_to_do_without_reducelab(path):
    """It imports reducelab first (the forkserver then imports torch while the kernel
    does), and a kernel without it gets one sentence with the command, not a bare
    ModuleNotFoundError."""
    setup = source(code_cells(load(path))[0])
    assert setup.startswith("try:"), setup[:80]
    first_import = next(line for line in setup.splitlines()
                        if re.match(r"\s*(from \S+ )?import ", line))
    assert first_import.strip().startswith("from reducelab import")
    namespace = {}
    hidden = "import builtins\n_real = builtins.__import__\n" \
             "def _no_reducelab(name, *a, **k):\n" \
             "    if name.split('.')[0] == 'reducelab': raise ModuleNotFoundError(name)\n" \
             "    return _real(name, *a, **k)\nbuiltins.__import__ = _no_reducelab\n"
    guard = setup.split("\n\n")[0]
    try:
        exec(hidden, namespace)
        with pytest.raises(ModuleNotFoundError) as info:
            exec(guard, namespace)
    finally:
        import builtins
        builtins.__import__ = namespace["_real"]
    message = str(info.value)
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    # the wheel `make wheel` builds (reducelab is not on PyPI), or the clone it sits in
    assert f"%pip install reducelab-{version}-py3-none-any.whl" in message
    assert "%pip install -e .." in message and "restart the kernel" in message


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_a_question_sets_the_world_size_it_needs(path):
    """An explorer may have left the group at any size; a question that runs on the
    ranks resizes the group first, so its answer never depends on the widget."""
    for c in code_cells(load(path)):
        src = source(c)
        run = re.search(r"\bgroup\.run\(", src)
        if "reveal(" in src and run:
            resize = src.find("group.resize(")
            assert 0 <= resize < run.start(), f"question cell without group.resize first: " \
                                              f"{src.splitlines()[0][:80]}"


QUOTED = {"held": 5.960464477539063e-08}
"""A value for each keyword a question cell passes to ``why`` (notebook 16, question 2:
what fp16 holds for 6e-8, 2^-24)."""


def reveal_calls(path) -> list[tuple[list[str], ast.Call]]:
    """Every ``reveal(...)`` call of a notebook's code cells, with the string literals of
    its cell (each cell is parsed once)."""
    calls = []
    for c in code_cells(load(path)):
        src = source(c)
        if "reveal(" in src:
            nodes = list(ast.walk(ast.parse(src)))
            literals = [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            calls += [(literals, node) for node in nodes
                      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "reveal"]
    return calls


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_a_question_cells_source_does_not_state_its_answer(path):
    """A question cell sits right below the learner's answer cell, so its source is read
    before the learner answers: it passes why("NN", q) from reducelab.checks.answers,
    never the explanation itself."""
    number, asked = path.name[:2], []
    for literals, call in reveal_calls(path):
        question = int(call.args[0].id.removeprefix("answer_"))
        explained = call.args[2]
        assert isinstance(explained, ast.Call) and explained.func.id == "why" and \
            [a.value for a in explained.args] == [number, question], \
            f"question {question}: reveal's why must be why({number!r}, {question})"
        text = why(number, question, **{k.arg: QUOTED[k.arg] for k in explained.keywords})
        assert not [t for t in literals if len(t) > 24 and t in text], \
            f"question {question}'s cell quotes its explanation"
        asked.append(question)
    assert sorted(asked) == sorted(WHY[number]), "every explanation belongs to one question"


def test_every_notebooks_questions_are_explained_in_their_stored_outputs():
    """The moved text is the text the committed notebooks show in their folded answers."""
    for path in NOTEBOOKS:
        shown = html.unescape("".join(t for c in code_cells(load(path)) for o in c.get("outputs", [])
                                      for t in texts(o)))
        for _, call in reveal_calls(path):
            number, question = path.name[:2], int(call.args[0].id.removeprefix("answer_"))
            text = why(number, question, **{k.arg: QUOTED[k.arg] for k in call.args[2].keywords})
            assert text in shown, f"{path.name}, question {question}"


def test_why_names_the_valid_choices_on_bad_input():
    with pytest.raises(ValueError, match="notebook must be one of 01, 02"):
        why("1", 1)
    with pytest.raises(ValueError, match="notebook 06 has questions 1, 2, 3; got 4"):
        why("06", 4)
    with pytest.raises(ValueError, match="takes no values; got held"):
        why("06", 1, held=1.0)
    with pytest.raises(ValueError, match="question 2 of notebook 16"):
        why("16", 2)
    assert "4 times 2^-24" in why("16", 2, held=5.960464477539063e-08)


HEADER = re.compile(r"^\*About (\d+) min to study · about (\d+) s to run top to bottom[ ,·]",
                    re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_the_header_gives_the_study_time_and_the_run_time_the_readme_gives(path):
    """One study unit of 30 to 45 minutes, with its run time; the README's table agrees."""
    header = source(load(path)["cells"][0])
    match = HEADER.search(header)
    assert match, f"{path.name}: the header's second line must read '*About N min to study · " \
                  f"about S s to run top to bottom · ...*'"
    study, run = int(match.group(1)), int(match.group(2))
    assert 30 <= study <= 45, f"{path.name}: {study} min is not one study unit (30 to 45 min)"
    row = next((line for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("| ") and f"`{path.name}`" in line), None)
    assert row, f"README.md's notebook table has no row for {path.name}"
    assert row.rstrip().endswith(f"| about {run} s |"), \
        f"README.md gives another run time for {path.name} than its header ({run} s): {row[-40:]}"

OPTIONAL = re.compile(r" · parts marked optional: about (\d+) min more, after the lesson\*$", re.M)
OPTIONAL_MARK = re.compile(r"^## .*\(optional, after the lesson\)$|^\*Optional, after the lesson\.\*",
                           re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_optional_parts_are_marked_where_they_start_and_counted_in_the_header_alike(path):
    """A notebook whose whole would run past one study unit may mark late parts optional
    (reviewers timed 11, 13, 15, 16 and 17 at 50 to 70 min): each such part says so where
    it starts, and the header then adds their time in one form, the same in every
    notebook; a header that counts optional time has a part that is marked."""
    cells = load(path)["cells"]
    header = source(cells[0])
    marked = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
              and OPTIONAL_MARK.search(source(c))]
    counted = OPTIONAL.search(header.strip())
    if "optional" in header.lower():
        assert counted, f"{path.name}: the header names optional parts in another form"
    assert bool(counted) == bool(marked), (path.name, bool(counted), marked)
    if counted:
        assert 5 <= int(counted.group(1)) <= 25


def cell_parts(path) -> list:
    """Per cell: ``"core"``, ``"reading"`` (from "## Further reading" to the next ``## ``
    heading) or, in an optional part, the index of the cell whose ``OPTIONAL_MARK`` starts
    it (a part runs to the next ``## `` heading)."""
    out, part = [], "core"
    for i, cell in enumerate(load(path)["cells"]):
        text = source(cell)
        if cell["cell_type"] == "markdown":
            if OPTIONAL_MARK.search(text):
                part = i
            elif text.startswith("## Further reading"):
                part = "reading"
            elif re.search(r"^## ", text, re.M):
                part = "core"
        out.append(part)
    return out


def output_words(cell) -> int:
    """The words a learner reads in a code cell's stored outputs: printed text, HTML
    (tags left out) and plain results, and an error's last line. Figures and widgets
    count nothing, nor does a question's verdict (its reveal is read in the question's
    own minutes)."""
    count = 0
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if out["output_type"] == "stream":
            count += len("".join(out["text"]).split())
        elif out["output_type"] == "error":
            count += len(f"{out['ename']}: {out['evalue']}".split())
        elif "text/html" in data:
            page = "".join(data["text/html"])
            if "reducelab-verdict" not in page:
                count += len(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())
        elif "text/plain" in data and not data.keys() & {
                "image/png", "application/vnd.jupyter.widget-view+json"}:
            count += len("".join(data["text/plain"]).split())
    return count


def study_minutes(path) -> dict[str, float]:
    """A floor for a learner's study time, in minutes, of the core and of the optional
    parts: markdown and the words of the stored outputs (:func:`output_words`) at 100
    words a minute, code at 30 non-blank lines a minute, 3 minutes a question (predict,
    run, read the reveal) and 10 an exercise (``# %load`` def cell). A part is optional
    from a cell marked ``OPTIONAL_MARK`` to the next ``## `` heading; "## Further
    reading", a list of sources to open later, counts in neither.

    Calibrated on review 5 (29 Nov 2026): four reviewers timed the cores of 01, 02, 03, 04,
    06 and 08 at about 45, 55, 55, 50, 60 and 65 minutes; the model without output words
    gave 48, 52, 51, 55, 55 and 54. Review 6 (29 Nov 2026) still timed cores the model put
    at 42 to 45 minutes at 50 to 65: their outputs (tables, torch's messages) held 140 to
    900 words the model did not count, so it counts them now."""
    cells = load(path)["cells"]
    totals = {"core": [0, 0, 0, 0], "optional": [0, 0, 0, 0], "reading": [0] * 4}
    for cell, part in list(zip(cells, cell_parts(path)))[1:]:
        counts = totals[part if part in ("core", "reading") else "optional"]
        text = source(cell)
        if cell["cell_type"] == "markdown":
            counts[0] += len(text.split())
        else:
            counts[0] += output_words(cell)
            counts[1] += sum(1 for line in text.splitlines() if line.strip())
            counts[2] += len(re.findall(r"^answer_\d+ = None", text, re.M))
            counts[3] += len(re.findall(r"^# %load ", text, re.M))
    return {part: words / 100 + lines / 30 + 3 * questions + 10 * exercises
            for part, (words, lines, questions, exercises) in totals.items() if part != "reading"}


def bound_and_loaded(code: str) -> tuple[set, set]:
    """The names a code cell binds (imports, assignments, defs, classes, arguments) and
    those it loads; IPython lines (``%`` and ``!``) are left out."""
    tree = ast.parse("\n".join(line for line in code.splitlines()
                               if not line.lstrip().startswith(("%", "!"))))
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
    return bound, loaded


def parts(path) -> list:
    """Per cell, the index of the cell that starts its optional part (as ``study_minutes``
    reads them), or ``None`` for the core and Further reading."""
    return [part if isinstance(part, int) else None for part in cell_parts(path)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_a_cell_runs_with_the_optional_parts_skipped(path):
    """A learner may skip every part marked optional (review 5 found 18's FSDP2 cell using
    names only its optional step 2 imported: a NameError for whoever skipped it). No code
    cell needs a name that only an optional part binds, unless it is in that part."""
    cells, part = load(path)["cells"], parts(path)
    code = [(i, *bound_and_loaded(source(c))) for i, c in enumerate(cells)
            if c["cell_type"] == "code"]
    optional_only = set().union(*(b for i, b, _ in code if part[i] is not None))
    missing = {}
    for i, bound, loaded in code:
        available = bound.union(*(b for j, b, _ in code if j < i and part[j] in (None, part[i])))
        need = (loaded & optional_only) - available
        if need:
            missing[i] = sorted(need)
    assert missing == {}, f"{path.name}: cells that need names only an optional part binds: {missing}"


def said_twice(reveal: str) -> str | None:
    """The answer of a reveal ("The real run gives A. WHY") whose WHY opens with A again,
    as in "gives 3.0. 3. mean_of_means ...", or None."""
    match = re.search(r"The real run gives (.{1,80}?)\. (\S+)", html.unescape(reveal))
    if not match:
        return None
    answer, first = (t.strip("'\"`.,:;") for t in match.groups())
    try:
        same = float(answer) == float(first)
    except ValueError:
        same = answer.lower() == first.lower()
    return answer if same else None


def test_said_twice_finds_a_reveal_that_opens_with_its_answer():
    assert said_twice("The real run gives 3.0. 3. mean_of_means counts") == "3.0"
    assert said_twice("The real run gives [0]. [0]: rank 0 was killed") == "[0]"
    assert said_twice("The real run gives &#x27;4&#x27;. 4, as many") == "4"
    assert said_twice("The real run gives 3.0. mean_of_means counts each rank") is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_no_reveal_says_its_answer_twice(path):
    """Review 6 read "The real run gives 3.0. 3. mean_of_means ..." in six notebooks: the
    verdict names the answer, so its explanation (``WHY``) starts with the reason."""
    twice = [(i, said_twice("".join(out["data"]["text/html"])))
             for i, cell in enumerate(load(path)["cells"]) for out in cell.get("outputs", [])
             if "reducelab-verdict" in "".join(out.get("data", {}).get("text/html", ""))]
    twice = [(i, answer) for i, answer in twice if answer]
    assert not twice, f"{path.name}: (cell, answer) of reveals that say their answer twice: {twice}"


def test_output_words_counts_what_a_learner_reads_and_not_figures_widgets_or_reveals():
    cell = {"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["rank 0 has 3.0\n", "rank 1 too\n"]},
        {"output_type": "display_data", "data": {"text/html": "<b>all</b> &amp; <i>four</i>",
                                                "text/plain": "<IPython.core.display.HTML>"}},
        {"output_type": "display_data", "data": {
            "text/html": '<div class="reducelab-verdict">the real run gives 3.0</div>'}},
        {"output_type": "display_data", "data": {"image/png": "iVBO", "text/plain": "<Figure>"}},
        {"output_type": "display_data", "data": {
            "application/vnd.jupyter.widget-view+json": {}, "text/plain": "VBox(children=(...))"}},
        {"output_type": "execute_result", "data": {"text/plain": "tensor([1., 2.])"}},
        {"output_type": "error", "ename": "RuntimeError", "evalue": "Timed out",
         "traceback": ["many", "frames"]}]}
    assert output_words(cell) == 7 + 3 + 2 + 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_the_core_is_one_study_unit_and_the_header_is_not_below_its_length(path):
    """Review 5 timed every core at 55 to 70 minutes against headers of 35 to 45: the
    headers were guesses. The core (what is not marked optional) fits 45 minutes by
    ``study_minutes``, and the header's study time is not under that floor; the optional
    minutes it adds are not under theirs nor more than 5 over (review 6 found three headers
    under the floor, as the old 3 minutes' grace allowed, and 18's optional 20 against 8.5)."""
    header = source(load(path)["cells"][0])
    study = int(HEADER.search(header).group(1))
    minutes = study_minutes(path)
    assert minutes["core"] <= 45, (
        f"{path.name}: the core reads as about {minutes['core']:.0f} min (study_minutes); "
        "cut repetition or mark late parts optional")
    assert study >= round(minutes["core"]), (
        f"{path.name}: the header says {study} min; the core reads as about "
        f"{minutes['core']:.0f} min")
    counted = OPTIONAL.search(header.strip())
    if minutes["optional"]:
        assert round(minutes["optional"]) <= int(counted.group(1)) <= max(5, round(minutes["optional"]) + 5), (
            f"{path.name}: the header adds {counted.group(1)} min of optional parts; they "
            f"read as about {minutes['optional']:.0f} min")


MOVED = {"08": ("15", re.compile(r"FSDP2|fully_shard|reshard_after_forward")),
         "10": ("16", re.compile(r"bucket|overlap|hides?\b|\bhooks?\b|powerSGD")),
         "13": ("17", re.compile(r"dropout|\bseeds?\b|random|dropout_seeds")),
         "09": ("18", re.compile(r"[Ss]equence[- ]parallel|parallelize_module|SequenceParallel|"
                                 r"\(dp, tp\)|transformer layer"))}
"""Material that left a notebook when it was split: notebook 08's FSDP2 is in 15, notebook
10's buckets, overlap and communication hooks are in 16 (issue 21, 4), notebook 13's
randomness across ranks (dropout masks, seeds, the dropout-seeds exercise) is in 17,
notebook 09's sequence parallelism, ``parallelize_module`` and ``(dp, tp)`` mesh are in 18."""


def test_pointers_to_split_notebooks_name_where_the_material_went():
    """A sentence that sends the learner to notebook 08 for FSDP2, to notebook 10 for
    DDP's buckets, overlap or hooks, or to notebook 13 for dropout and seeds, names the
    notebook that now holds it (15, 16, 17)."""
    wrong = []
    for path in NOTEBOOKS + [ROOT / "README.md"]:
        if path.suffix == ".ipynb":
            prose = [source(c) for c in load(path)["cells"] if c["cell_type"] == "markdown"]
        else:
            prose = [path.read_text()]
        for sentence in re.split(r"(?<=[.;:])\s+|\n", "\n".join(prose)):
            for old, (new, topic) in MOVED.items():
                if path.name.startswith(new):
                    continue              # the notebook that holds the material
                pointer = re.search(rf"\b[Nn]otebooks?\b[^.]*?\b{old}\b", sentence)
                if pointer and topic.search(sentence) and f" {new}" not in sentence:
                    wrong.append(f"{path.name}: {sentence.strip()[:160]}")
    assert not wrong, "pointers to material that moved:\n" + "\n".join(wrong)


def test_nbval_reads_a_subprocess_s_traceback_without_python_3_13_s_colours():
    """ipykernel sets FORCE_COLOR=1 for what a cell starts (``init_environment`` in
    ``ipykernel/zmqshell.py``), and Python 3.13 then colours an uncaught traceback
    (``_colorize.can_colorize``). Notebook 01 prints the last line of a script's
    traceback: on 3.13 it came with ANSI codes (this line is from that run), and nbval
    failed on 01 and 11 until its sanitizer drops them."""
    from conftest import nbval_sanitizer
    pattern, repl = nbval_sanitizer("ANSI colours")
    on_313 = "\x1b[1;35mNameError\x1b[0m: \x1b[35mname 'run' is not defined\x1b[0m\n"
    stored = next(line for c in code_cells(load(ROOT / "notebooks" / "01_all_reduce.ipynb"))
                  for o in c.get("outputs", []) if o.get("name") == "stdout"
                  for line in o["text"] if line.startswith("NameError"))
    assert on_313 != stored
    assert re.sub(pattern, repl, on_313) == re.sub(pattern, repl, stored) == stored



def test_the_instructors_plan_gives_each_notebook_its_header_s_study_time():
    """docs/instructors.md plans a day from the headers' study times (after review 5's cuts
    they moved from 35 and 40 to 43 to 45 min, and the plan still said 35 and 40)."""
    plan = (ROOT / "docs" / "instructors.md").read_text()
    named = re.findall(r"\*\*(\d\d)\*\*[^|()]*?\((?:about )?(\d+) min\)", plan)
    named += re.findall(r"[Nn]otebook (\d\d)\s*\([^)]*?, (\d+) min\)", plan)
    assert len(named) >= 6, named
    for number, minutes in named:
        path = next(p for p in NOTEBOOKS if p.name.startswith(number))
        study = int(HEADER.search(source(load(path)["cells"][0])).group(1))
        assert int(minutes) == study, f"docs/instructors.md gives {number} {minutes} min; its header {study}"
