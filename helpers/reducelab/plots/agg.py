"""The Agg canvas every Reduce Lab figure is drawn on, and matplotlib's settings for them.

Imported at the first figure (:func:`reducelab.plots.new_figure`,
:func:`reducelab.plots.message_png`), not with :mod:`reducelab.plots`: a notebook's setup
cell imports the plot and explorer modules, and matplotlib (about 0.3 s of CPU after
torch) then waits for the first figure instead of delaying the setup cell (issue 23's
goal: a setup cell within 1.3 times a bare ``import torch``).

Importing it selects the Agg backend (unless one is already chosen), applies
:data:`reducelab.plots.STYLE` to ``matplotlib.rcParams``, and makes matplotlib's text
layout remembered for texts drawn by :class:`Canvas` (:func:`_remembered_layout`).
"""
from __future__ import annotations

import functools
from math import cos, radians, sin

import matplotlib

matplotlib.use("Agg", force=False)
import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg, get_hinting_flag  # noqa: E402
from matplotlib.mathtext import MathTextParser  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from . import STYLE  # noqa: E402

matplotlib.rcParams.update(STYLE)

@functools.lru_cache(maxsize=4096)
def _text_bitmap(font, s: str, size: float, dpi: float, antialiased: bool, flags: int) -> tuple:
    """The glyphs of ``s`` rasterised by ``font`` (an ``FT2Font``) at ``size`` points and
    ``dpi``, as Agg's ``draw_text`` makes them: ``(bitmap, descent, x offset, y offset)``,
    the bitmap a uint8 array of shape ``(height, width)``, the rest in pixels. The
    cache keeps ``font`` alive, so its identity in the key is never reused; matplotlib
    gives each thread its own ``FT2Font`` objects. 4096 bitmaps of a label are a few MB."""
    font.clear()
    font.set_size(size, dpi)
    font.set_text(s, 0, flags=flags)
    font.draw_glyphs_to_bitmap(antialiased=antialiased)
    xo, yo = font.get_bitmap_offset()
    return np.array(font.get_image()), font.get_descent() / 64.0, xo / 64.0, yo / 64.0


_LAYOUT = Text._get_layout
_TEXT_LAYOUTS: dict = {}
"""Text layouts :func:`_remembered_layout` has made, by what they depend on."""
LAYOUTS_KEPT = 4096
"""Most text layouts remembered (:func:`_remembered_layout`); then it starts again. A
layout is a box and a few numbers per line."""


def _remembered_layout(self: Text, renderer):
    """``Text._get_layout`` (matplotlib's measure of a text's box and lines), remembered
    for texts of the same string, font, dpi, line spacing, rotation and alignment (what
    it reads) drawn by a Reduce Lab canvas, whichever figure they are in. An explorer's
    redraw lays out 100 to 300 texts, most of them drawn before, many explorers draw a
    new figure per state, and each layout asks FreeType for metrics through a cache
    keyed on the font's properties (a fifth of notebook 08's redraw under cProfile).
    Other renderers (a learner's own figure, a saved PDF) and TeX texts get matplotlib's
    own. The layout returned is shared by every draw of that text: matplotlib's callers
    (``Text.draw``, ``Text.get_window_extent``, ``TextArea``, 3.10.9) read its box and
    lines and never change them."""
    if not isinstance(renderer, _TextBitmapsRenderer) or self.get_usetex():
        return _LAYOUT(self, renderer)
    key = (self._get_wrapped_text(), hash(self._fontproperties), self.get_parse_math(),
           self.get_figure(root=True).dpi, renderer.dpi, self._linespacing,
           self.get_rotation(), self.get_rotation_mode(), self._get_multialignment(),
           self._horizontalalignment, self._verticalalignment)
    layout = _TEXT_LAYOUTS.get(key)
    if layout is None:
        if len(_TEXT_LAYOUTS) >= LAYOUTS_KEPT:
            _TEXT_LAYOUTS.clear()
        layout = _TEXT_LAYOUTS[key] = _LAYOUT(self, renderer)
    return layout


Text._get_layout = _remembered_layout
_MATHTEXT = MathTextParser("agg")
"""The mathtext parser every :class:`_TextBitmapsRenderer` shares. Agg gives each
renderer its own, and its cache of parsed expressions (log-axis tick labels such as
``10²``, 2 to 3 ms each) is per parser: a figure drawn anew parsed them all again."""


class _TextBitmapsRenderer(RendererAgg):
    """Agg's renderer, rasterising each text once: a redraw blits the glyph bitmap it
    made before for the same string, font, size, dpi, antialiasing and hinting.

    An explorer's figure redraws 80 to 350 texts per change (tick labels, titles,
    values in cells), most of them unchanged; laying out their glyphs in FreeType is
    about a fifth of a redraw. The pixels are those of ``RendererAgg.draw_text``, whose
    steps this follows (``tests/test_explorer_base.py`` compares them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mathtext_parser = _MATHTEXT

    def draw_text(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if ismath:
            return super().draw_text(gc, x, y, s, prop, angle, ismath, mtext)
        font = self._prepare_font(prop)
        bitmap, d, xo, yo = _text_bitmap(font, s, prop.get_size_in_points(), self.dpi,
                                         bool(gc.get_antialiased()), get_hinting_flag())
        x = round(x + xo + d * sin(radians(angle)))
        y = round(y + yo + d * cos(radians(angle)))
        self._renderer.draw_text_image(bitmap, x, y + 1, angle, gc)


class Canvas(FigureCanvasAgg):
    """The Agg canvas of every Reduce Lab figure: ``FigureCanvasAgg`` drawing its texts
    with :class:`_TextBitmapsRenderer`. Same pixels, a fifth less time on a text-heavy
    redraw."""

    def get_renderer(self):
        w, h = self.figure.bbox.size
        key = (w, h, self.figure.dpi)
        if self.__dict__.get("_reducelab_renderer_key") != key:
            self.renderer = _TextBitmapsRenderer(w, h, self.figure.dpi)
            self._reducelab_renderer_key = key
        return self.renderer
