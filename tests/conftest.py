"""Shared fixtures. Every group a test opens is closed, and no rank outlives the tests."""
from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import types

import numpy as np
import psutil
import pytest

from reducelab import LocalGroup

SOLUTIONS = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "solutions"

# A Jupyter kernel always turns SIGINT into KeyboardInterrupt (Kernel > Interrupt). A test
# run started in the background without job control (`make test &` in a script, nohup)
# inherits SIGINT ignored, and the interrupt tests then fail for want of an interrupt
# (seen here: 5 of them, when CI was started that way). Give the tests a kernel's handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def load_solution(name: str):
    """Import ``notebooks/solutions/<name>.py`` as a module (solutions are off the run path)."""
    spec = importlib.util.spec_from_file_location(f"solution_{name}", SOLUTIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def notebook_module(cells: list, name: str, keep=(), preamble: str = "") -> types.ModuleType:
    """A notebook's imports, classes, ``def``s and the module-level assignments of names in
    ``keep`` (``A = ...`` or ``A, B = ...``, every name in ``keep``; nothing else of its code
    cells runs), in a module ``name`` of their own that the ranks cannot import, so that its
    functions and classes travel by value as a notebook cell's do. ``preamble`` runs first
    (the setup cell's imports guarded by ``try``)."""
    module = types.ModuleType(name)
    sys.modules.pop(name, None)
    exec(preamble, module.__dict__)
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        tree = ast.parse("".join(cell["source"]))
        kept = [node for node in tree.body
                if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
                or (isinstance(node, ast.Assign) and _assigned(node) and _assigned(node) <= set(keep))]
        exec(compile(ast.Module(body=kept, type_ignores=[]), name, "exec"), module.__dict__)
    return module


def _assigned(node: ast.Assign) -> set:
    """The names an assignment binds (``A = ...`` or ``A, B = ...``); empty if it binds
    anything else (an attribute, a subscript)."""
    names = set()
    for target in node.targets:
        for n in (target.elts if isinstance(target, ast.Tuple) else [target]):
            if not isinstance(n, ast.Name):
                return set()
            names.add(n.id)
    return names


def top_level_names(path) -> set[str]:
    """The names a Python file (a notebook's solution) defines at its top level: functions,
    classes and assigned names; its imports are not counted."""
    tree = ast.parse(pathlib.Path(path).read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    return names


class NotebookCells:
    """Lookups in one committed notebook's cells (``cells``: its JSON ``cells`` list)."""

    def __init__(self, cells: list):
        self.cells = cells

    def source_with(self, text: str, kind: str = "code") -> str:
        """The source of the one cell of ``kind`` that contains ``text``."""
        hits = ["".join(c["source"]) for c in self.cells
                if c["cell_type"] == kind and text in "".join(c["source"])]
        assert len(hits) == 1, f"{len(hits)} {kind} cells contain {text!r}"
        return hits[0]

    def cell_with(self, text: str) -> dict:
        """The one code cell that contains ``text``."""
        hits = [c for c in self.cells if c["cell_type"] == "code" and text in "".join(c["source"])]
        assert len(hits) == 1, f"{len(hits)} code cells contain {text!r}"
        return hits[0]

    def markdown(self) -> str:
        """Every markdown cell's source, joined."""
        return "\n".join("".join(c["source"]) for c in self.cells if c["cell_type"] == "markdown")


def stored_text(cell: dict) -> str:
    """Everything a code cell shows as text: streams, and the folded verdicts' HTML. Consecutive
    outputs of one stream are one text, as JupyterLab shows and saves them (a kernel may send a
    line in two messages, depending on when it flushes)."""
    import html
    import re
    parts = []
    previous = None
    for o in cell["outputs"]:
        if o["output_type"] == "stream" and previous is not None \
                and previous["output_type"] == "stream" and previous["name"] == o["name"]:
            parts[-1] += "".join(o["text"])
        elif o["output_type"] == "stream":
            parts.append("".join(o["text"]))
        elif "text/html" in o.get("data", {}):
            page = "".join(o["data"]["text/html"]).replace("<br>", "\n")
            parts.append(html.unescape(re.sub(r"<[^>]+>", "", page)))
        elif "text/plain" in o.get("data", {}):
            parts.append("".join(o["data"]["text/plain"]))
        previous = o
    return "\n".join(parts)


@pytest.fixture(autouse=True)
def audited_figures(request):
    """Every figure the package draws during a test is audited (``figure_audit``): the
    palette, font sizes and width. The test fails if one is off."""
    from figure_audit import audit
    from reducelab import plots
    problems: list[str] = []

    def record(fig):
        problems.extend(audit(fig))

    def same_as_matplotlib(fig, pixels):
        fig.canvas.draw()                   # matplotlib's own draw, every artist in order
        own = np.asarray(fig.canvas.buffer_rgba())
        if pixels.shape != own.shape or not np.array_equal(pixels, own):
            differ = int((pixels != own).any(axis=-1).sum()) if pixels.shape == own.shape else -1
            problems.append(f"the layered draw differs from matplotlib's in {differ} pixels: "
                            f"{fig.get_suptitle()!r}, axes {[ax.get_title() for ax in fig.axes]}")
    plots.AUDITS.append(record)
    plots.CHECK_LAYERS.append(same_as_matplotlib)
    yield
    plots.AUDITS.remove(record)
    plots.CHECK_LAYERS.remove(same_as_matplotlib)
    if problems and "no_figure_audit" not in request.keywords:
        pytest.fail("figures break the project's rules (see reducelab/plots/__init__.py):\n  "
                    + "\n  ".join(dict.fromkeys(problems)))


@pytest.fixture()
def drawn():
    """The matplotlib figures the package draws during the test, in order."""
    from reducelab import plots
    figures = []
    plots.AUDITS.append(figures.append)
    yield figures
    plots.AUDITS.remove(figures.append)


@pytest.fixture(scope="module")
def group():
    """A 4-rank gloo group shared by the tests of one module. The timeout (60 s) is
    generous because a busy 2-core CI machine can be slow; tests of timeouts make their
    own groups with short ones."""
    g = LocalGroup(world_size=4, timeout=60)
    yield g
    g.close()


@pytest.fixture()
def keep_four_ranks(group):
    """Start and end a test with the module's group at world_size 4 (tests resize it).
    Use it module-wide with ``pytestmark = pytest.mark.usefixtures("keep_four_ranks")``."""
    group.resize(4)  # a no-op when it already has 4 idle ranks
    yield
    group.resize(4)


def run_python(code: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process (a stand-in for a notebook kernel)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def start_python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def gone(pids, within: float) -> bool:
    """True when none of ``pids`` is alive (zombies count as gone) within ``within`` seconds."""
    import time
    end = time.monotonic() + within
    while time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def assert_new_world_size_is_built_on_the_preparer(explorer, figure, world_size: int = 3):
    """Move ``explorer``'s world_size control to ``world_size`` (one it has not shown) and
    assert that ``figure._build`` ran exactly once, on the preparation thread
    (``Explorer.preparation``), while the new ranks started and ran; then the result is
    the new world size with no error. The group is put back to 4 ranks afterwards."""
    import threading
    builds, original = [], figure._build
    figure._build = lambda *a: (builds.append(threading.current_thread().name), original(*a))
    try:
        explorer.controls["world_size"].value = world_size
    finally:
        figure._build = original
    assert len(builds) == 1 and builds[0].startswith("reducelab-prepare"), builds
    assert explorer.result.world_size == world_size and explorer.error is None
    explorer.group.resize(4)


def record_calls(monkeypatch, owner, name: str) -> list:
    """Wrap the method ``owner.name`` so that each call is recorded, then runs as before;
    returns the list of the ``self`` of each call (how a test counts the work a draw
    does: y-axis measurements, axes made, tick objects made)."""
    calls = []
    original = getattr(owner, name)

    def recorded(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(owner, name, recorded)
    return calls


def text_boxes(ax, renderer) -> list:
    """``[(text, box), ...]`` for each non-empty text of ``ax``: its drawn extent in
    pixels, its white box (``bbox``) included when it has one."""
    return [(t.get_text(), (t.get_bbox_patch() or t).get_window_extent(renderer))
            for t in ax.texts if t.get_text()]


def assert_apart(boxes, gap: float, context=None) -> None:
    """Assert that no two of ``boxes`` (``[(name, Bbox), ...]``, pixels) come within
    ``gap`` pixels of each other (0: they may not touch)."""
    for k, (a, box) in enumerate(boxes):
        for b, other in boxes[k + 1:]:
            assert not box.padded(gap / 2).overlaps(other.padded(gap / 2)), (context, a, b)


def points_inside(box, points, margin: float = 0.0):
    """Boolean mask of the ``points`` (``(k, 2)`` array, pixels) inside ``box`` grown by
    ``margin`` pixels on every side (its edges included)."""
    (x0, y0), (x1, y1) = box.padded(margin).get_points()
    return ((x0 <= points[:, 0]) & (points[:, 0] <= x1) &
            (y0 <= points[:, 1]) & (points[:, 1] <= y1))


CALLS = 0


def count_calls() -> int:
    """A module function with state: sent to a rank by reference, it runs with its own
    module's globals, so a ``global`` it rebinds persists across calls (test_group)."""
    global CALLS
    CALLS += 1
    return CALLS


os.environ.setdefault("PYTHONUNBUFFERED", "1")


def nbval_sanitizer(title_start: str) -> tuple[str, str]:
    """The regex and replacement of the section of tests/nbval_sanitize.cfg whose title
    starts with ``title_start``."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).parent / "nbval_sanitize.cfg")
    section = next(s for s in cfg.sections() if s.startswith(title_start))
    return cfg[section]["regex"], cfg[section]["replace"]

