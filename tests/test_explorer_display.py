"""What an explorer displays (README, "Figures read without a kernel"): its mime bundle
carries, beside the live widget, an ``image/png`` and a ``text/plain`` of the state it
is in, so GitHub, nbviewer and nbval see what the widget shows.

Issue 20 found that an explorer's display could lose its ``image/png`` while every test
passed: nbval does not compare images, and no test called ``_repr_mimebundle_``. Here
every explorer class of every notebook is built the way its notebook builds it (the
notebook's own explorer cell, with the notebook's own functions), and its bundle is
read after the first draw and after a control change; the base class is also driven
without ranks, through a refused combination and a closed group.
"""
from __future__ import annotations

import ast
import base64
import json
import pathlib
import struct
import sys
import types

import cloudpickle
import ipywidgets as W
import pytest

from reducelab import GroupClosedError, RankError, RankReport
from reducelab.plots import message_png, new_figure, png
from reducelab.widgets import Explorer

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("notebooks/[0-9][0-9]_*.ipynb"))
PNG = b"\x89PNG\r\n\x1a\n"
WIDGET = "application/vnd.jupyter.widget-view+json"
NO_FIGURE = "No figure for these settings: see the message below."


def png_width(data: bytes) -> int:
    assert data.startswith(PNG), "not a PNG"
    return struct.unpack(">I", data[16:20])[0]


def assert_bundle_shows(explorer, bundle: dict) -> None:
    """The bundle is the explorer's state now: its widget, its figure, its text."""
    assert bundle[WIDGET]["model_id"] == explorer.box.model_id
    assert "image/png" in bundle, "the display lost its static picture"
    shown = base64.b64decode(bundle["image/png"])
    assert shown == explorer.image.value, "the picture is not the figure the widget shows"
    assert 600 <= png_width(shown) <= 960
    assert bundle["text/plain"] == explorer.text()
    name = type(explorer).__name__
    settings = ", ".join(f"{k}={v}" for k, v in explorer.values.items())
    assert bundle["text/plain"].startswith(f"{name}({settings})\n")


# --- the base class, without ranks ------------------------------------------------------------

def _figure(label: str) -> bytes:
    fig = new_figure(7, 2)
    ax = fig.subplots()
    ax.text(0.5, 0.5, label, ha="center")
    ax.set_axis_off()
    return png(fig)


class Toy(Explorer):
    """An explorer whose 'ranks' are a dict: ``"refused"`` raises a RankError,
    ``"closed"`` a GroupClosedError, ``"bug"`` a ValueError (a bug of the subclass)."""

    def __init__(self):
        self.calls = 0
        super().__init__({"choice": W.Dropdown(options=["a", "b", "refused", "closed", "bug"],
                                               value="a")})
        self.refresh()

    def compute(self, choice):
        self.calls += 1
        if choice == "refused":
            raise RankError("rank 1 raised ValueError in f",
                            [RankReport(1, "raised", "ValueError: no such op")])
        if choice == "closed":
            raise GroupClosedError("this LocalGroup is closed")
        if choice == "bug":
            raise ValueError("a bug in the subclass")
        return {"choice": choice}

    def draw(self, result):
        return _figure(f"choice {result['choice']}")

    def describe(self, result):
        return f"the ranks chose {result['choice']} <b>"


def test_the_bundle_carries_the_widget_the_figure_and_the_text_of_one_state():
    toy = Toy()
    first = toy._repr_mimebundle_()
    assert_bundle_shows(toy, first)
    assert first["text/plain"] == "Toy(choice=a)\nthe ranks chose a <b>"
    assert toy.message.value == "the ranks chose a &lt;b&gt;"     # HTML-escaped in the widget
    toy.controls["choice"].value = "b"                             # the observer reruns
    second = toy._repr_mimebundle_()
    assert_bundle_shows(toy, second)
    assert second["image/png"] != first["image/png"]
    assert second["text/plain"] == "Toy(choice=b)\nthe ranks chose b <b>"
    assert toy.calls == 2 and 0 < toy.seconds < 30          # the last refresh's wall time


def test_a_refused_combination_shows_a_note_and_the_ranks_own_words_in_every_form():
    toy = Toy()
    toy.controls["choice"].value = "refused"
    assert toy.result is None and toy.error is not None
    bundle = toy._repr_mimebundle_()
    assert_bundle_shows(toy, bundle)
    assert base64.b64decode(bundle["image/png"]) == message_png(NO_FIGURE)   # no stale figure
    assert bundle["text/plain"] == ("Toy(choice=refused)\n"
                                    "The ranks refused this: ValueError: no such op")
    assert toy.message.value.startswith('<span style="color:') and "⛔" in toy.message.value
    toy.controls["choice"].value = "a"                              # and back
    assert toy.error is None and toy._repr_mimebundle_()["text/plain"].endswith("chose a <b>")


def test_a_second_refusal_draws_no_new_figure(monkeypatch):
    import matplotlib.figure
    toy = Toy()
    toy.controls["choice"].value = "refused"
    note = bytes(toy.image.value)
    toy.controls["choice"].value = "a"

    def no_new_figure(*args, **kwargs):
        raise AssertionError("a refusal built a new figure")
    monkeypatch.setattr(matplotlib.figure, "Figure", no_new_figure)
    toy.controls["choice"].value = "refused"
    assert bytes(toy.image.value) == note


def test_a_closed_group_is_a_sentence_not_an_exception_and_a_subclass_bug_is_raised():
    toy = Toy()
    toy.controls["choice"].value = "closed"
    assert toy.result is None and toy.error is None
    assert "this LocalGroup is closed" in toy.message.value
    assert toy.image.value == message_png(NO_FIGURE)
    assert toy.text() == "Toy(choice=closed)\n(not run yet)"
    with pytest.raises(ValueError, match="a bug in the subclass"):
        toy.controls["choice"].value = "bug"


def test_an_explorer_follows_the_kernels_new_group_once_its_own_is_closed(monkeypatch):
    from types import SimpleNamespace

    import reducelab.widgets as widgets
    toy = Toy()
    assert toy.group is None                               # never given one
    mine, newer = SimpleNamespace(state="idle"), SimpleNamespace(state="idle")
    toy.group = mine
    monkeypatch.setattr(widgets, "current_group", lambda: newer)
    assert toy.group is mine                               # open: its own, whatever is newer
    mine.state = "closed"
    monkeypatch.setattr(widgets, "current_group", lambda: None)
    assert toy.group is mine                               # closed, and nothing newer yet
    monkeypatch.setattr(widgets, "current_group", lambda: newer)
    assert toy.group is newer and toy.group is newer       # the setup cell ran again


def test_an_explorer_not_run_yet_shows_no_picture_and_says_so():
    class Idle(Toy):
        def __init__(self):
            Explorer.__init__(self, {"choice": W.Dropdown(options=["a"], value="a")})
    idle = Idle()
    assert idle.seconds == 0.0 and idle.result is None and idle.error is None
    bundle = idle._repr_mimebundle_()
    assert "image/png" not in bundle and bundle["text/plain"] == "Idle(choice=a)\n(not run yet)"


# --- every explorer of every notebook, as its notebook builds it ---------------------------------

DEFS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)


def _names(nodes) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def _targets(node) -> set[str]:
    if not isinstance(node, ast.Assign):
        return set()
    return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _imports_only(node) -> bool:
    return isinstance(node, ast.Try) and all(isinstance(b, (ast.Import, ast.ImportFrom))
                                              for b in node.body)


def build_explorer(notebook: pathlib.Path):
    """Run the notebook's explorer cell after its setup cell, imports, ``def``s and the
    assignments that they or the explorer cell read (no question, no measurement), in a
    module of its own whose functions travel to the ranks by value, as a cell's do.
    Returns ``(explorer, namespace)``."""
    cells = ["".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
             if c["cell_type"] == "code"]
    at = next(i for i, s in enumerate(cells) if "Explorer(" in s)
    statements = []
    for i, source in enumerate(cells[:at + 1]):
        try:
            statements += [(i, node) for node in ast.parse(source).body]
        except SyntaxError:          # a cell magic
            continue
    needed = _names([n for i, n in statements if isinstance(n, DEFS) or i == at])
    keep = [n for i, n in statements
            if (isinstance(n, DEFS) or _imports_only(n) or (i == at and not isinstance(n, ast.Expr))
                or (isinstance(n, ast.Assign) and (i == 0 or _targets(n) & needed)))]
    module = types.ModuleType(f"{notebook.stem[:2]}_explorer_cells")
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    for node in keep:
        if isinstance(node, ast.Assign) and ".run(" in ast.unparse(node):
            continue                 # a result of the ranks: a question's, not the explorer's
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), notebook.name, "exec"),
                 module.__dict__)
        except NameError:
            if not isinstance(node, ast.Assign):
                raise                # an assignment may read a name that a question made
    return module.__dict__["explorer"], module.__dict__


def _another_value(widget):
    """A value of ``widget`` other than its current one."""
    options = getattr(widget, "options", None)
    if options:
        values = [o[1] if isinstance(o, tuple) else o for o in options]
        return next(v for v in reversed(values) if v != widget.value)
    if hasattr(widget, "max"):
        return widget.max if widget.value != widget.max else widget.min
    if isinstance(widget.value, str) and "," in widget.value:   # a list typed as text
        return ",".join(reversed(widget.value.split(",")))
    return None


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_explorer_displays_its_figure_and_text_after_each_change(notebook):
    explorer, ns = build_explorer(notebook)
    try:
        assert isinstance(explorer, Explorer)
        assert explorer.result is not None, explorer.text()        # it drew on creation
        assert_bundle_shows(explorer, explorer._repr_mimebundle_())
        name, widget = next((k, w) for k, w in explorer.controls.items()
                            if _another_value(w) is not None)
        new = _another_value(widget)
        widget.value = new                                          # one control change
        bundle = explorer._repr_mimebundle_()
        assert_bundle_shows(explorer, bundle)
        assert f"{name}={new}" in bundle["text/plain"].splitlines()[0]
    finally:
        for value in list(ns.values()):
            if type(value).__name__ == "LocalGroup":
                value.close()
