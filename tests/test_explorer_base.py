"""The Explorer base (reducelab/widgets/__init__.py): what every explorer does when the
learner moves a control, whatever its topic. No ranks are needed: a toy explorer
computes in the kernel, and the browser's changes are simulated with ``set_state``,
the call ipywidgets makes for a comm message from the frontend."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ipywidgets as W
import pytest

from conftest import record_calls
from reducelab.plots import new_figure, png
from reducelab.widgets import QUIET, Explorer


@dataclass
class Square:
    n: int
    square: int


class ToyExplorer(Explorer):
    """compute: n -> n*n (counted); draw: a figure that says n (counted)."""

    def __init__(self, compute_seconds: float = 0.0):
        self.computed, self.drawn, self.compute_seconds = [], [], compute_seconds
        super().__init__({"n": W.IntSlider(value=0, min=0, max=20),
                          "parity": W.Dropdown(options=["any", "even"], value="any")})
        self.refresh()

    def compute(self, n, parity):
        import time
        time.sleep(self.compute_seconds)   # a run on the ranks takes a while
        self.computed.append(n)
        return Square(n if parity == "any" else n - n % 2, 0)

    def draw(self, result):
        self.drawn.append(result.n)
        fig = new_figure(2, 1)
        fig.text(0.5, 0.5, str(result.n), ha="center", fontsize=12)
        return png(fig)

    def describe(self, result):
        return f"n={result.n}"


def test_a_change_from_python_refreshes_at_once():
    ex = ToyExplorer()
    ex.controls["n"].value = 3
    assert ex.result == Square(3, 0) and ex.message.value == "n=3" and ex.refreshes == 2


def test_a_drag_in_the_browser_collapses_into_one_refresh_for_where_it_stopped():
    """Twenty steps of a drag arrive while the first refresh runs: the kernel applies
    them all, then refreshes once, for the last value; never once per step."""
    async def drag():
        ex = ToyExplorer(compute_seconds=0.05)
        slider = ex.controls["n"]
        for v in range(1, 21):                 # one comm message per step the slider passes
            slider.set_state({"value": v})
        assert ex.refreshes == 1               # nothing ran inside the comm handler
        await asyncio.sleep(QUIET * 20 + 0.2)
        return ex
    ex = asyncio.run(drag())
    assert ex.computed == [0, 20] and ex.refreshes == 2
    assert ex.result.n == 20 and ex.message.value == "n=20"


def test_changes_that_arrive_during_a_refresh_collapse_into_the_latest():
    """A slow refresh (0.3 s) is running when more steps arrive, spaced like a drag:
    afterwards one more refresh runs, for the latest value, and the figure is its."""
    async def drag():
        ex = ToyExplorer(compute_seconds=0.3)
        loop = asyncio.get_running_loop()
        slider = ex.controls["n"]
        slider.set_state({"value": 1})
        # steps 2..10 arrive while the refresh for 1 blocks the loop; they wait, as
        # comm messages wait in the kernel's queue, then are applied one by one
        for v in range(2, 11):
            loop.call_later(QUIET * 2 + 0.001 * v, slider.set_state, {"value": v})
        await asyncio.sleep(1.5)
        return ex
    ex = asyncio.run(drag())
    assert ex.computed[0] == 0 and ex.computed[-1] == 10
    assert len(ex.computed) <= 3, ex.computed    # 0, maybe 1, then 10: never 1..10
    assert ex.result.n == 10


@dataclass
class Gradient:
    n: int
    grad: object         # a torch.Tensor, made anew by every compute


class TensorExplorer(ToyExplorer):
    """compute returns a new tensor each time, as a run on the ranks does (the results
    of 04 and 09 hold tensors)."""

    def compute(self, n, parity):
        import torch
        self.computed.append(n)
        return Gradient(n - n % 2 if parity == "even" else n,
                        torch.arange(4.0) * n)       # new memory on every call


@pytest.mark.parametrize("explorer_class", [ToyExplorer, TensorExplorer],
                         ids=["plain result", "result holding tensors"])
def test_an_equal_result_reuses_its_figure(explorer_class):
    """Going back to earlier settings runs the ranks again, but an equal result with the
    same control values is not drawn again: its PNG bytes come from the cache. Also for
    a result holding tensors: torch pickles a storage under its memory address, so equal
    tensors in new memory never matched and every move was drawn."""
    ex = explorer_class()
    first = ex.image.value
    ex.controls["n"].value = 5
    ex.controls["n"].value = 0
    assert ex.computed == [0, 5, 0] and ex.drawn == [0, 5]
    assert ex.image.value == first
    # another setting with an equal result is drawn: a control may change only the view
    ex.controls["parity"].value = "even"
    assert ex.drawn == [0, 5, 0]
    ex.controls["parity"].value = "any"       # back to settings drawn before: no draw
    assert ex.drawn == [0, 5, 0] and ex.image.value == first


def test_going_back_to_a_world_size_restores_its_figure_without_building_it():
    """RankHeatmaps, ReduceGrid and ShardingFigure keep one built figure per shape: a
    shape seen before is drawn on its own figure again (the same bytes as before), not
    built anew; a new shape is built."""
    import numpy as np

    from reducelab.plots import RankHeatmaps
    heat = RankHeatmaps(("before", "after"))
    builds = []
    original = heat._build
    heat._build = lambda ws, n: (builds.append((ws, n)), original(ws, n))
    four = [np.arange(24.0).reshape(4, 6)] * 2
    first = heat.draw(four, title="four ranks")
    heat.draw([np.arange(30.0).reshape(5, 6)] * 2, title="five ranks")
    again = heat.draw(four, title="four ranks")
    assert builds == [(4, 6), (5, 6)]
    assert again == first


class PreparingExplorer(ToyExplorer):
    """A toy whose figure needs ``prepare_seconds`` of work that the ranks' result does
    not change (as a figure of a new world size does)."""

    def __init__(self, compute_seconds, prepare_seconds, fail=None):
        self.prepare_seconds, self.fail, self.prepared_in = prepare_seconds, fail, []
        super().__init__(compute_seconds)

    def preparation(self, n, parity):
        def work():
            import threading
            import time
            time.sleep(self.prepare_seconds)
            self.prepared_in.append(threading.current_thread().name)
            if self.fail:
                raise self.fail
        return work

    def compute(self, n, parity):
        if n == 13:
            from reducelab import RankError
            raise RankError("refused", reports=[])
        return super().compute(n, parity)


def test_a_preparation_runs_in_a_thread_while_the_ranks_compute():
    """compute 0.3 s and a preparation of 0.3 s: a refresh waits for the longer, not the
    sum, and the preparation is done before the figure is drawn."""
    ex = PreparingExplorer(compute_seconds=0.3, prepare_seconds=0.3)
    ex.controls["n"].value = 4
    assert len(ex.prepared_in) == 2 and ex.drawn == [0, 4]
    assert ex.prepared_in[0].startswith("reducelab-prepare")
    assert len(set(ex.prepared_in)) == 1   # one thread: matplotlib caches fonts per thread
    assert 0.3 <= ex.seconds < 0.5


def test_a_failed_preparation_is_raised_but_a_refusal_is_told_first():
    ex = PreparingExplorer(compute_seconds=0.0, prepare_seconds=0.0)
    ex.fail = ValueError("a bug in the figure code")
    try:
        ex.controls["n"].value = 5
    except ValueError as err:
        assert str(err) == "a bug in the figure code"
    else:
        raise AssertionError("the preparation's error was hidden")
    ex.controls["n"].value = 13                 # the ranks refuse: their sentence is shown
    assert ex.result is None and "refused" in ex.message.value


class InterimExplorer(PreparingExplorer):
    """A toy whose long compute shows an interim result halfway (as notebook 10's sweep
    does); it records the figure and message the learner sees at that moment."""

    def compute(self, n, parity):
        self.seen_before_interim = (self.image.value, self.message.value)
        self.show_interim(Square(-n, 0), f"half of n={n} done")
        self.seen_at_interim = (self.image.value, self.message.value, list(self.prepared_in))
        return super().compute(n, parity)


def test_an_interim_figure_is_shown_during_compute_then_replaced_by_the_complete_one():
    ex = InterimExplorer(compute_seconds=0.0, prepare_seconds=0.2)
    sent = []
    ex.image.observe(lambda change: sent.append(change["new"]), names="value")
    ex.controls["n"].value = 6
    image, message, prepared = ex.seen_at_interim
    assert message == "⏳ half of n=6 done" and ex.interims == 2
    assert len(prepared) == 2        # it waited for the refresh's preparation before drawing
    assert ex.drawn[-2:] == [-6, 6] and sent == [image, ex.image.value] and image != ex.image.value
    assert ex.message.value == "n=6"                 # the complete figure's description
    ex.controls["n"].value = 7
    ex.controls["n"].value = 6                       # back: the complete figure is cached,
    assert ex.image.value == sent[1] and ex.drawn[-1] == -6   # the interim one is drawn anew


def test_a_preparation_leaves_the_figure_as_its_draw_would():
    """Each persistent figure, prepared for a new shape and then drawn, gives the bytes a
    draw alone gives, and the draw builds nothing more."""
    import numpy as np

    from reducelab.plots import RankHeatmaps
    from reducelab.plots.reduce import ReduceGrid
    from reducelab.plots.sharded import ShardingFigure
    from reducelab.widgets.reduce import buffer_status

    def heat(plot, ws):
        return plot.draw([np.arange(ws * 6.0).reshape(ws, 6)] * 2, title=f"{ws} ranks")

    def grid(plot, ws, n=9):
        before = np.arange(ws * n, dtype=float).reshape(ws, n) + 1
        after = before.copy()
        after[0] = before.sum(0)
        return plot.draw(before, after, buffer_status(before, after), 0, title=f"{ws} ranks")

    def sharding(plot, ws, numel=64):
        a = np.linspace(-1, 1, ws * numel).reshape(ws, numel)
        memory = [{"parameters": 4.0 * numel, "gradients": 4.0 * numel, "optimizer state": 0.0}] * ws
        sent = [{"all_reduce": 8.0 * numel}] * ws
        return plot.draw(a, a / 2, a / 3, memory, sent, 4.0 * numel, 8.0 * numel, "formula",
                         title=f"{ws} ranks")

    for make, draw, prepare in [
            (lambda: RankHeatmaps(("before", "after")), heat, lambda p, ws: p.preparation(ws, 6)),
            (ReduceGrid, grid, lambda p, ws: p.preparation(ws, 9)),
            (lambda: ShardingFigure(64), sharding, lambda p, ws: p.preparation(ws))]:
        alone, prepared = make(), make()
        draw(alone, 2), draw(prepared, 2)
        assert prepare(prepared, 2) is None           # current: nothing to prepare
        expected = draw(alone, 5)
        prepare(prepared, 5)()
        builds = []
        prepared._build = lambda *args: builds.append(args)
        assert draw(prepared, 5) == expected and builds == []


def test_functions_explorers_send_to_ranks_come_from_light_modules():
    """A rank imports the module of a function it is sent by reference. The explorers'
    own rank functions live in modules that import neither ipywidgets nor matplotlib,
    which would cost every new rank about 0.4 s of CPU at its first call."""
    import subprocess
    import sys

    from reducelab.checks.disagree import record_on_rank
    from reducelab.checks.mesh import run_and_release
    from reducelab.checks.sharded import zero_train
    from reducelab.widgets.loss import _on_rank
    modules = sorted({f.__module__ for f in (record_on_rank, run_and_release, zero_train, _on_rank)})
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted({'matplotlib', 'ipywidgets'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", (modules, out.stdout, out.stderr[-2000:])


def test_a_figure_drawn_anew_reuses_the_layout_of_its_key_only_where_it_fits():
    """new_figure(..., layout_key=k): the second figure with the same key and margins is
    drawn without the layout engine and comes out pixel for pixel the same; one whose
    tick labels are longer is laid out anew."""
    from reducelab.plots import new_figure, png

    def figure(top: float):
        fig = new_figure(6, 3, layout_key="test figure")
        ax = fig.subplots()
        ax.plot([0, 1], [0, top])
        ax.set_title("a title")
        ax.set_ylabel("value")
        return fig

    first = figure(1.0)
    a = png(first)
    second = figure(1.0)
    b = png(second)
    assert a == b
    assert first._reducelab_layout_reused is False and second._reducelab_layout_reused is True
    wider = figure(123456.0)             # y tick labels like 120000: longer, wider margin
    png(wider)
    assert wider._reducelab_layout_reused is False


def test_a_persistent_figure_that_reused_a_layout_is_laid_out_again_for_new_margins(monkeypatch):
    """A figure drawn again and again (04's scatter) reuses the layout of its key while the
    margins stay, and is laid out anew when they change. Placing the axes at the cached
    positions (``Axes.set_position``) used to take them out of constrained layout for
    good: after one reuse, longer tick labels kept the old margin, and 04's "DDP (rank 0)"
    ran off the figure's left edge. Now the PNG equals a new figure's."""
    from reducelab import plots
    from reducelab.plots import new_figure, png
    monkeypatch.setattr(plots, "_LAYOUTS", {})
    fig = new_figure(6, 3, layout_key="persistent test figure")
    ax = fig.subplots()
    (line,) = ax.plot([0, 1], [0, 1])
    ax.set_ylabel("value")

    def draw(top):
        line.set_ydata([0, top])
        ax.set_ylim(0, top)
        return png(fig)

    draw(1.0)
    draw(1.0)
    assert fig._reducelab_layout_reused is True
    wide = draw(123456.0)                     # y tick labels like 120000: a wider margin
    assert fig._reducelab_layout_reused is False
    plots._LAYOUTS.clear()
    fresh = new_figure(6, 3, layout_key="persistent test figure")
    fax = fresh.subplots()
    fax.plot([0, 1], [0, 123456.0])
    fax.set_ylim(0, 123456.0)
    fax.set_ylabel("value")
    assert wide == png(fresh)
    assert ax.get_position().x0 == pytest.approx(fax.get_position().x0)


def test_in_a_kernel_making_an_explorer_freezes_what_exists_out_of_gc_scans(monkeypatch):
    """In a kernel, an explorer is made after the notebook's imports: every object that
    exists then leaves the garbage collector's scans (``gc.freeze``), after one
    collection (the garbage of earlier cells is freed, not frozen). Outside a kernel (a
    script, this test process) nothing is frozen."""
    import gc
    import weakref

    import reducelab.widgets as widgets

    class Cycle:
        pass

    assert not widgets.in_kernel()
    before = gc.get_freeze_count()             # 0 on 3.11 and 3.13; 3.12.1 starts with 375
    ToyExplorer()
    assert gc.get_freeze_count() == before
    garbage = Cycle()
    garbage.me = garbage                       # a cycle: only a collection frees it
    gone = weakref.ref(garbage)
    del garbage
    kept = Cycle()
    assert any(o is kept for o in gc.get_objects())
    monkeypatch.setattr(widgets, "in_kernel", lambda: True)
    try:
        ToyExplorer()
        assert gc.get_freeze_count() > before
        assert gone() is None                  # collected before the freeze
        assert not any(o is kept for o in gc.get_objects())   # frozen: in no generation
    finally:
        gc.unfreeze()


def _titled_figure(ys=(0.0, 1.0), ticks_on_top: bool = False, layout: str = "none",
                   extra: str = ""):
    """Two titled axes; ``extra`` adds to the right one a ``"secondary"`` y axis (13's
    "same / differs" labels), a ``"twin"`` (twinx), one whose values need an offset text
    (``"twin offset"``), or a secondary x axis on top (``"secondary top"``); or stacks
    the two with a shared x axis (``"sharex"``: the upper one's x labels hidden, 14's)."""
    from reducelab.plots import new_figure
    fig = new_figure(6, 3)
    fig.set_layout_engine(layout)
    left, right = fig.subplots(2, 1, sharex=True) if extra == "sharex" else fig.subplots(1, 2)
    for ax in (left, right):
        ax.plot([0, 1], ys)
        ax.set_title("a title with descenders: gyp")
        ax.set_title("left", loc="left")
    if ticks_on_top:
        right.xaxis.tick_top()
        right.set_xlabel("on top")
        right.xaxis.set_label_position("top")
    if extra == "secondary":
        labels = right.secondary_yaxis("right")
        labels.set_yticks([0.2, 0.8], ["same", "differs"])
    elif extra.startswith("twin"):
        twin = right.twinx()
        twin.plot([0, 1], [1.0, 1.001] if extra == "twin offset" else [0.0, 5.0])
    elif extra == "secondary top":
        right.secondary_xaxis("top").set_xticks([0.2, 0.8], ["a", "b"])
    return fig


@pytest.mark.parametrize("ys, ticks_on_top, layout, extra", [
    ((0.0, 1.0), False, "none", ""), ((0.0, 1.0), False, "constrained", ""),
    ((0.0, 1.0), True, "none", ""),             # x tick labels and label above the axes
    ((0.0, 1e7), False, "none", ""),            # a y offset text ("1e7") over the axes
    ((1.0, 1.001), False, "none", ""),          # and one of another kind ("+1")
    ((0.0, 1.0), False, "constrained", "secondary"), ((0.0, 1.0), False, "none", "twin"),
    ((0.0, 1.0), False, "none", "twin offset"), ((0.0, 1.0), False, "constrained", "secondary top"),
    ((0.0, 1.0), False, "none", "sharex"), ((0.0, 1.0), True, "none", "sharex"),
])
def test_titles_placed_without_measuring_the_y_axis_land_on_the_same_pixels(
        monkeypatch, ys, ticks_on_top, layout, extra):
    """png() skips matplotlib's title placement only where it would not move a title:
    every case draws the same pixels as with the placement run on every draw."""
    from reducelab import plots
    fast = plots.png(_titled_figure(ys, ticks_on_top, layout, extra))
    monkeypatch.setattr(plots, "_place_titles", lambda fig: None)
    assert plots.png(_titled_figure(ys, ticks_on_top, layout, extra)) == fast


def test_a_plain_titled_axes_is_drawn_without_measuring_its_y_axis(monkeypatch):
    """The saving itself: with titles on plain axes, a draw measures no y axis (without
    the shortcut, each titled axes measures its own); with x ticks on top it still does."""
    from matplotlib.axis import YAxis
    from reducelab import plots
    calls = record_calls(monkeypatch, YAxis, "get_tightbbox")
    fig = _titled_figure()
    plots.png(fig)
    assert calls == []
    for ax in fig.axes:                     # an explorer's panel cleared and drawn again
        ax.clear()
        ax.plot([0, 1], [0, 2])
        ax.set_title("again")
    plots.png(fig)
    assert calls == []
    plots.png(_titled_figure(ticks_on_top=True))
    assert len(calls) >= 1
    calls.clear()
    monkeypatch.setattr(plots, "_place_titles", lambda fig: None)
    plots.png(_titled_figure())
    assert len(calls) >= 2


@pytest.mark.parametrize("extra", ["secondary", "twin"])
def test_titled_axes_with_a_secondary_y_axis_or_a_twin_skip_the_measurement(monkeypatch, extra):
    """13's panels have a secondary y axis: their titles are placed without measuring any
    y axis, as are those of an axes with a twin."""
    from matplotlib.axis import YAxis
    from reducelab import plots
    calls = record_calls(monkeypatch, YAxis, "get_tightbbox")
    plots.png(_titled_figure(extra=extra))
    assert calls == []
    monkeypatch.setattr(plots, "_place_titles", lambda fig: None)
    plots.png(_titled_figure(extra=extra))
    assert len(calls) >= 3                  # two axes, and the right one's sibling


def test_a_redrawn_figure_whose_y_axis_gains_an_offset_places_its_title_again(monkeypatch):
    """One figure drawn three times, as an explorer redraws it: plain values, then values
    with a y offset text, then plain again. Each draw has the pixels of a fresh figure
    drawn with matplotlib's placement on every draw."""
    from reducelab import plots
    fig = _titled_figure()
    lines = [ax.lines[0] for ax in fig.axes]
    drawn = []
    for ys in ((0.0, 1.0), (0.0, 1e7), (0.0, 1.0)):
        for line in lines:
            line.set_ydata(ys)
        for ax in fig.axes:
            ax.relim()
            ax.autoscale_view()
        drawn.append(plots.png(fig))
    monkeypatch.setattr(plots, "_place_titles", lambda fig: None)
    assert drawn == [plots.png(_titled_figure(ys)) for ys in ((0.0, 1.0), (0.0, 1e7), (0.0, 1.0))]


def _texts_figure(canvas_class, size: float = 11, antialiased: bool = True):
    """Texts of every kind an explorer draws: rotated, multi-line, non-ASCII, mathtext,
    bold, at two sizes, and the same string twice (the second drawn from the cache)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(4, 3), dpi=100)
    canvas_class(fig)
    kw = dict(fontsize=size, antialiased=antialiased)
    fig.text(0.05, 0.9, "rank 0: −2.5 ◆ µs", **kw)
    fig.text(0.05, 0.75, "two lines\nof gyp", ha="left", va="top", **kw)
    fig.text(0.6, 0.5, "rotated 90", rotation=90, **kw)
    fig.text(0.3, 0.3, "rotated 30", rotation=30, **kw)
    fig.text(0.05, 0.15, r"$\sum_r x_r^2$ and text", **kw)
    fig.text(0.55, 0.15, "bold", fontweight="bold", **kw)
    fig.text(0.8, 0.9, "bold", fontsize=size + 7)
    fig.text(0.8, 0.7, "rank 0: −2.5 ◆ µs"[:6], **kw)
    return fig


@pytest.mark.parametrize("size, antialiased", [(11, True), (10, True), (11, False)])
def test_the_canvas_that_keeps_text_bitmaps_draws_agg_s_pixels(size, antialiased):
    """Every package figure is drawn by plots.agg.Canvas, which rasterises each text once and
    blits the bitmap on later draws: the pixels equal FigureCanvasAgg's on the first
    draw and on the redraws that hit the cache, at every size and antialiasing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from reducelab import plots
    from reducelab.plots import agg
    matplotlibs = plots.png(_texts_figure(FigureCanvasAgg, size, antialiased))
    fig = _texts_figure(agg.Canvas, size, antialiased)
    before = agg._text_bitmap.cache_info().hits
    assert [plots.png(fig) for _ in range(3)] == [matplotlibs] * 3
    assert agg._text_bitmap.cache_info().hits >= before + 2 * 7    # the redraws hit it
    assert type(new_figure(2, 2).canvas) is agg.Canvas


def test_a_text_bitmap_is_not_reused_for_another_size_dpi_or_font():
    """The cache's key holds what changes a bitmap: two figures that differ only in size,
    dpi or font draw what FigureCanvasAgg draws for each, in either order."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from reducelab import plots
    from reducelab.plots import agg

    def one(canvas_class, dpi=100, **kw):
        fig = Figure(figsize=(2, 1), dpi=dpi)
        canvas_class(fig)
        fig.text(0.1, 0.4, "same string", **kw)
        return plots.png(fig)

    for kw in (dict(fontsize=10), dict(fontsize=14), dict(fontsize=10, dpi=150),
               dict(fontsize=10, family="serif"), dict(fontsize=10, family="monospace"),
               dict(fontsize=10)):
        assert one(agg.Canvas, **kw) == one(FigureCanvasAgg, **kw), kw


CHANGES = [("text", lambda t: t.set_text("other\nwords")),
           ("fontsize", lambda t: t.set_fontsize(15)),
           ("rotation", lambda t: t.set_rotation(45)),
           ("rotation_mode", lambda t: (t.set_rotation(30), t.set_rotation_mode("anchor"))),
           ("ha", lambda t: t.set_horizontalalignment("right")),
           ("va", lambda t: t.set_verticalalignment("baseline")),
           ("linespacing", lambda t: t.set_linespacing(2.0)),
           ("multialignment", lambda t: t.set_multialignment("right")),
           ("weight", lambda t: t.set_fontweight("bold")),
           ("family", lambda t: t.set_fontfamily("serif")),
           ("math", lambda t: t.set_text(r"$x_r$ over two\nlines")),
           ("parse_math", lambda t: (t.set_text(r"$x_r$ as is"), t.set_parse_math(False))),
           ("position", lambda t: t.set_position((0.5, 0.2)))]


@pytest.mark.parametrize("name, change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_remembered_text_layout_is_never_used_for_a_changed_text(name, change):
    """plots.agg.Canvas remembers each text's layout (its box and lines) between draws: a
    text changed in anything the layout depends on is laid out again, so the redraw
    draws what FigureCanvasAgg draws for a figure made with the change."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from reducelab import plots
    from reducelab.plots import agg

    def make(canvas_class):
        fig = Figure(figsize=(3, 2), dpi=100)
        canvas_class(fig)
        text = fig.text(0.3, 0.6, "a text of\ntwo lines", fontsize=11, va="top")
        fig.text(0.05, 0.05, "beside it", fontsize=10)
        return fig, text

    agg._TEXT_LAYOUTS.clear()
    fig, text = make(agg.Canvas)
    plots.png(fig)                      # lays the texts out and remembers them
    assert len(agg._TEXT_LAYOUTS) == 2
    change(text)
    fresh, fresh_text = make(FigureCanvasAgg)
    change(fresh_text)
    assert plots.png(fig) == plots.png(fresh)


def test_text_layouts_and_math_are_remembered_across_package_figures_only(monkeypatch):
    """A new package figure reuses the layouts and the parsed mathtext of texts drawn
    before in another one; a learner's own figure (FigureCanvasAgg) does not use them;
    the layouts kept are bounded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from reducelab import plots
    from reducelab.plots import agg
    monkeypatch.setattr(agg, "_TEXT_LAYOUTS", {})
    fig = Figure(figsize=(3, 2), dpi=100)
    FigureCanvasAgg(fig)
    fig.text(0.1, 0.5, "a learner's own figure")
    plots.png(fig)
    assert agg._TEXT_LAYOUTS == {}

    def package_figure(label):
        fig = new_figure(3, 2)
        ax = fig.add_subplot()
        ax.set_yscale("log")
        ax.set_ylim(1, 1000)                       # tick labels 10⁰ ... 10³ (mathtext)
        ax.set_title(label)
        return plots.png(fig)
    package_figure("first")
    parsed = agg._MATHTEXT._parse_cached.cache_info()
    laid_out = len(agg._TEXT_LAYOUTS)
    assert package_figure("second") == package_figure("second")
    assert agg._MATHTEXT._parse_cached.cache_info().misses == parsed.misses
    assert len(agg._TEXT_LAYOUTS) == laid_out + 1          # only the new title
    monkeypatch.setattr(agg, "LAYOUTS_KEPT", 5)
    fig = new_figure(3, 2)
    for k in range(12):
        fig.text(0.1, k / 12, f"text {k}")
    plots.png(fig)
    assert 1 <= len(agg._TEXT_LAYOUTS) <= 5


def _kept_plot(seed: int) -> bytes:
    """A plot an explorer draws anew: errorbars with a legend, a log axis autoscaled to
    the data, a line, a patch, a text and a collection, all from ``seed`` (seed 1 leaves
    the right axes empty, seed 2 sets a margin)."""
    import numpy as np
    from matplotlib.patches import Rectangle
    from reducelab import plots

    def make_axes(fig):
        return fig.subplots(1, 2)
    fig, (ax, bx) = plots.kept_figure("kept test", 6, 3, make_axes)
    rng = np.random.default_rng(seed)
    xs = np.geomspace(4, 4 ** (4 + seed), 5)
    ys = rng.uniform(1, 10, 5) * (seed + 1)
    ax.errorbar(xs, ys, yerr=ys / 4, marker="o", label=f"seed {seed}")
    ax.axvline(xs[seed % 5])
    ax.set_xscale("log")
    if seed == 2:                            # a margin set by one draw only
        ax.set_ymargin(0.3)
    ax.legend(loc="upper left")
    ax.set_title(f"draw {seed}")
    if seed != 1:                            # an axes left empty by one draw
        bx.add_patch(Rectangle((seed, 0), 1, seed + 1))
        bx.scatter(rng.uniform(0, 5, 4 + seed), rng.uniform(0, 5, 4 + seed))
        bx.text(0.5, 0.5, f"text {seed}")
    return plots.png(fig)


def test_a_kept_figure_is_emptied_to_what_a_new_one_draws(monkeypatch):
    """plots.kept_figure gives the figure of a key back emptied: plots of other data drawn
    into it in turn (autoscaled limits, legends, errorbar containers, patches, texts,
    collections) have the bytes of a new figure for each, and no container or legend
    entry of an earlier draw is left."""
    from reducelab import plots
    monkeypatch.setattr(plots, "_KEPT", plots.collections.OrderedDict())
    kept = [_kept_plot(seed) for seed in (0, 2, 1, 0)]
    fig, (ax, bx) = plots._KEPT["kept test"]
    assert len(ax.containers) == 1 and len(ax.get_legend().get_texts()) == 1
    fresh = []
    for seed in (0, 2, 1, 0):
        plots._KEPT.clear()
        fresh.append(_kept_plot(seed))
    assert kept == fresh and kept[0] == kept[3] and kept[0] != kept[1]
    for k in range(plots.KEEP_FIGURES + 1):
        plots.kept_figure(("another", k), 2, 2, lambda fig: [fig.subplots()])
    assert len(plots._KEPT) == plots.KEEP_FIGURES and "kept test" not in plots._KEPT


def test_the_state_key_tells_apart_values_dtype_shape_requires_grad_and_every_bit():
    import torch

    from reducelab.widgets import state_key
    a = torch.tensor([1.0, -0.0])
    same = [state_key({"n": 1}, a.clone()) for _ in range(2)]
    assert same[0] == same[1]
    assert len({same[0], state_key({"n": 2}, a), state_key({"n": 1}, a.double()),
                state_key({"n": 1}, a.reshape(2, 1)),
                state_key({"n": 1}, a.clone().requires_grad_()),
                state_key({"n": 1}, torch.tensor([1.0, 0.0])),
                state_key({"n": 1}, a.to(torch.bfloat16))}) == 7


def test_the_upper_axes_of_a_shared_x_axis_keeps_its_titles_without_measuring():
    """14's checkpoint figure: two stacked axes sharing x, the upper one's x labels hidden
    (matplotlib calls its tick position "unknown" and measures its x axis). What that
    measure finds lies below the axes, so the titles are fixed and the y axis is not
    measured (the pixels are the same: the "sharex" cases above)."""
    fig = _titled_figure(extra="sharex")
    png(fig)
    assert [ax._autotitlepos for ax in fig.axes] == [False, False]


def _bars_figure(heights=(1.0, 2.0, 3.0), change: str = ""):
    """A kept figure's kind of plot (bars under a grid, a titled axes, a secondary y axis
    at its edge), with ``change`` applied to what the static layer holds."""
    fig = new_figure(6, 3, layout=False)
    ax = fig.add_axes((0.15, 0.2, 0.7, 0.65))
    ax.bar(range(3), heights, color="C0", hatch="//")
    ax.grid(True, axis="y")
    ax.set_title("bars")
    ax.set_xticks(range(3), ["rank 0", "rank 1", "rank 2"])
    ax.set_ylim(0, 4)
    ax.set_ylabel("kB")
    ax.secondary_yaxis("right").set_yticks([1, 3], ["low", "high"])
    _static_change(fig, ax, change)
    return fig


def _static_change(fig, ax, change: str) -> None:
    if change == "ylim":
        ax.set_ylim(0, 5)
    elif change == "tick labels":
        ax.set_xticks(range(3), ["r0", "r1", "r2"])
    elif change == "tick colour":
        ax.tick_params(axis="y", colors="C1")
    elif change == "one tick label":
        ax.xaxis.get_major_ticks()[1].label1.set_color("C2")
    elif change == "axis label":
        ax.set_ylabel("MB")
    elif change == "axes background":
        ax.set_facecolor("C3")
    elif change == "place":
        ax.set_position((0.2, 0.2, 0.6, 0.65))
    elif change == "figure size":
        fig.set_size_inches(5, 3)
    elif change == "label place":
        ax.yaxis.set_label_coords(-0.12, 0.3)


STATIC_CHANGES = ["ylim", "tick labels", "tick colour", "one tick label", "axis label",
                  "axes background", "place", "figure size", "label place"]


def test_a_redraw_of_the_same_axes_draws_only_what_changed(monkeypatch):
    """The static layer (backgrounds, ticks, tick labels, axis labels) is drawn once and
    restored while it would come out the same: a second draw with new data updates no
    tick, and its pixels are those of a new figure with that data."""
    from matplotlib.axis import Axis
    from reducelab import plots
    monkeypatch.setattr(plots, "CHECK_LAYERS", [])     # (the check draws it all again)
    fig = _bars_figure()
    png(fig)
    calls = record_calls(monkeypatch, Axis, "_update_ticks")
    for ax in fig.axes:
        for bar, h in zip(ax.patches, (3.0, 1.0, 2.5)):
            bar.set_height(h)
    again = png(fig)
    assert [c for c in calls if c.axes is fig.axes[0]] == []
    assert again == png(_bars_figure((3.0, 1.0, 2.5)))


@pytest.mark.parametrize("change", STATIC_CHANGES)
def test_a_change_to_the_static_layer_draws_it_again(monkeypatch, change):
    """Each thing the static layer shows, changed between two draws of one figure, is
    drawn anew: the second draw's pixels are those of a new figure made with the change
    (a key that missed it would restore the old ticks, labels or background). The
    conftest's check is off here: it draws every figure again, its own way."""
    from reducelab import plots
    monkeypatch.setattr(plots, "CHECK_LAYERS", [])
    fig = _bars_figure()
    png(fig)
    _static_change(fig, fig.axes[0], change)
    assert png(fig) == png(_bars_figure(change=change))


def test_an_axis_without_ticks_keeps_the_static_layer_at_new_limits(monkeypatch):
    """A bar chart's value axis without ticks, its limits set anew on each draw (notebook
    12's metric bars): the limits place no tick, so the static layer is restored, not
    drawn again, and the pixels are those of a new figure with those limits. Where the
    axis has ticks, new limits move them (the "ylim" case above)."""
    from matplotlib.axis import Axis
    from reducelab import plots
    monkeypatch.setattr(plots, "CHECK_LAYERS", [])

    def bars(right: float):
        fig = _bars_figure()
        fig.axes[0].set_xticks([])
        fig.axes[0].set_xlim(-0.5, right)
        return fig
    fig = bars(2.5)
    png(fig)
    calls = record_calls(monkeypatch, Axis, "_update_ticks")
    fig.axes[0].set_xlim(-0.5, 3.5)
    again = png(fig)
    assert [c for c in calls if c.axes is fig.axes[0]] == []
    assert again == png(bars(3.5))


def _label_over_a_spine(y: float = 1.0):
    """Two axes side by side, the right one's y label placed across the left one's right
    spine (as notebook 16's bucket explorer did with long tick labels on its right axes)."""
    fig = new_figure(6, 3, layout=False)
    left = fig.add_axes((0.1, 0.2, 0.4, 0.7))
    right = fig.add_axes((0.62, 0.2, 0.3, 0.7))
    left.plot([0, 1], [0, y], color="C0")
    right.plot([0, 1], [y, 0], color="C1")
    left.set_ylim(0, 1)
    right.set_ylim(0, 1)
    right.set_ylabel("milliseconds, a label long enough")
    right.yaxis.set_label_coords(-0.4, 0.5)    # its centre on the left axes' right spine
    return fig


def test_a_static_label_over_an_earlier_axes_is_drawn_in_matplotlibs_order():
    """The static layer is drawn first; where a static label meets what an axes drawn
    before it draws (here its spine), the figure is drawn the usual way, so that the
    label lies over the spine as matplotlib draws it. The conftest compares every draw's
    pixels with matplotlib's: drawn in layers, the label under the spine differed in
    antialiased pixels. Then a new figure of the same shape comes out the same, drawn
    either way."""
    from reducelab import plots
    fig = _label_over_a_spine()
    first = png(fig)
    subs = plots._subfigures(fig)
    kept = fig._reducelab_background
    assert not plots._layers_keep_order(fig, plots._static_axes(fig, subs), kept[4],
                                        fig.canvas.get_renderer())
    fig.axes[0].lines[0].set_ydata([0, 0.5])
    fig.axes[1].lines[0].set_ydata([0.5, 0])
    again = png(fig)
    assert again == png(_label_over_a_spine(0.5)) and again != first


def test_axes_whose_ticks_point_in_are_drawn_the_usual_way():
    """Ticks inside the axes would lie under the data if drawn first: such an axes stays
    out of the static layer (the conftest compares every draw's pixels with matplotlib's)."""
    from reducelab import plots
    fig = _bars_figure()
    png(fig)                                # (which fixes the title's place)
    assert plots._static_axes(fig, plots._subfigures(fig)) == [fig.axes[0]]
    fig.axes[0].tick_params(direction="in")
    assert plots._static_axes(fig, plots._subfigures(fig)) == []
    png(fig)
