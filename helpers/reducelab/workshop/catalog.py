"""What the dashboard has columns for: every notebook's predict-then-run questions and
exercises, read from the notebooks themselves.

A question is a code cell that calls ``reveal(answer_K, ...)``; its column is
``answer_K``. An exercise is a def cell whose first line is
``# %load solutions/NN_name.py`` followed by its check cell, which calls one
``check_*`` function; its column is that check's name, and its solution is
``NN_name.py`` (the README's "One solution flow"). Reading the notebooks, rather than
keeping a list, means a new notebook or question appears on the dashboard with no
change here.
"""
from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass, field

LOAD_LINE = re.compile(r"^# %load solutions/(\d\d_\w+\.py)\s*$")
"""The first line of a def cell (README, "One solution flow")."""
CHECK_CALL = re.compile(r"\b(check_\w+)\s*\(")
REVEAL_CALL = re.compile(r"\breveal\(\s*(?:prediction\s*=\s*)?(answer_\w+)")


@dataclass(frozen=True)
class Item:
    """One dashboard column.

    Attributes:
        notebook: the notebook's two-digit number, such as ``"05"``.
        key: ``"answer_1"`` for a question, the check's name (``"check_mesh_sync"``)
            for an exercise.
        kind: ``"question"`` or ``"exercise"``.
        label: a short column heading, such as ``"Q1"`` or ``"token_weighted_sync"`` (an
            exercise's solution file name without its number and ``.py``).
        solution: an exercise's solution file name (``"05_token_weighted_sync.py"``), else ``""``.
    """

    notebook: str
    key: str
    kind: str
    label: str
    solution: str = ""


@dataclass
class Catalog:
    """The notebooks' questions and exercises, in notebook order.

    Attributes:
        notebooks: ``{"05": "05_device_mesh_sync", ...}``, number to file stem.
        items: every column, notebook by notebook, questions then exercises in cell order.
        solutions_dir: where the solution files are (``<notebooks>/solutions``).
    """

    notebooks: dict[str, str] = field(default_factory=dict)
    items: list[Item] = field(default_factory=list)
    solutions_dir: pathlib.Path | None = None

    def find(self, notebook: str | None, key: str) -> Item | None:
        """The column for a report: a check by its name alone (check names are unique
        across notebooks), a question by its notebook and ``answer_K``; else ``None``."""
        for item in self.items:
            if item.key == key and (item.kind == "exercise" or item.notebook == notebook):
                return item
        return None

    def solution(self, filename: str) -> Item | None:
        """The exercise whose solution file is ``filename``, or ``None``."""
        return next((i for i in self.items if i.solution and i.solution == filename), None)

    def as_json(self) -> dict:
        return {"notebooks": self.notebooks,
                "items": [{"notebook": i.notebook, "key": i.key, "kind": i.kind,
                           "label": i.label, "solution": i.solution} for i in self.items]}


def read_catalog(folder: pathlib.Path) -> Catalog:
    """Read every ``NN_*.ipynb`` in ``folder`` (see the module docstring).

    Raises:
        FileNotFoundError: ``folder`` holds no notebooks.
    """
    paths = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no notebooks (NN_name.ipynb) in {folder}")
    catalog = Catalog(solutions_dir=folder / "solutions")
    for path in paths:
        number = path.name[:2]
        catalog.notebooks[number] = path.stem
        cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                 if c["cell_type"] == "code"]
        sources = ["".join(c["source"]) for c in cells]
        questions, exercises = [], []
        for i, src in enumerate(sources):
            for name in REVEAL_CALL.findall(src):
                if name not in questions:
                    questions.append(name)
            first = src.split("\n", 1)[0]
            m = LOAD_LINE.match(first)
            if m and i + 1 < len(sources):
                check = CHECK_CALL.search(sources[i + 1])
                if check:
                    exercises.append((check.group(1), m.group(1)))
        for q in questions:
            catalog.items.append(Item(number, q, "question", "Q" + q.split("_", 1)[1]))
        for check, solution in exercises:
            label = solution[3:-3]
            catalog.items.append(Item(number, check, "exercise", label, solution))
    return catalog
