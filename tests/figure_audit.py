"""Checks every figure the package draws while the tests run (registered in conftest).

A figure passes when it is at most ``plots.MAX_WIDTH`` inches wide, every visible text
is at least ``plots.MIN_FONT`` points, and every colour of its lines, markers, bars
and patches is one of ``plots.PALETTE``, ``plots.NEUTRAL``, or a grey (black and white
included). Colour-mapped artists (heatmaps, ``imshow``, ``pcolormesh``) use
``plots.CMAP`` and are not checked here.
"""
from __future__ import annotations

import matplotlib.colors as mcolors
import numpy as np
from matplotlib.collections import Collection
from matplotlib.image import AxesImage
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text

from reducelab import plots

_ALLOWED = np.array([mcolors.to_rgb(c) for c in [*plots.PALETTE.values(), plots.NEUTRAL]])


def colour_ok(rgba) -> bool:
    """True for a palette colour, the neutral grey, any grey, or a fully transparent one."""
    rgba = mcolors.to_rgba(rgba)
    if rgba[3] == 0:
        return True
    rgb = np.array(rgba[:3])
    if np.ptp(rgb) < 0.02:          # a grey: black, white and everything between
        return True
    return bool((np.abs(_ALLOWED - rgb).max(axis=1) < 0.02).any())


def _colours(artist):
    if isinstance(artist, Line2D):
        if artist.get_linestyle() not in ("None", "none", " ", ""):
            yield "line", artist.get_color()
        if artist.get_marker() not in (None, "None", "none", " ", ""):
            yield "marker", artist.get_markerfacecolor()
    elif isinstance(artist, Patch):
        yield "patch", artist.get_facecolor()
        if artist.get_linewidth():
            yield "patch edge", artist.get_edgecolor()
    elif isinstance(artist, Collection):
        if artist.get_array() is not None:      # colour-mapped
            return
        for c in artist.get_facecolors():
            yield "collection", c
        if np.any(artist.get_linewidths()):
            for c in artist.get_edgecolors():
                yield "collection edge", c
    elif isinstance(artist, Text) and artist.get_text().strip():
        yield "text", artist.get_color()


def audit(fig) -> list[str]:
    """Return what is wrong with ``fig``, one sentence per problem (empty if nothing)."""
    problems = []
    width = fig.get_figwidth()
    if width > plots.MAX_WIDTH + 1e-6:
        problems.append(f"figure is {width:.1f} in wide (at most {plots.MAX_WIDTH})")
    title = ""
    if fig._suptitle is not None:
        title = fig._suptitle.get_text()
    for artist in fig.findobj():
        if isinstance(artist, AxesImage) or not artist.get_visible():
            continue
        if artist is fig.patch or any(artist is ax.patch for ax in fig.axes):
            continue
        if isinstance(artist, Text) and artist.get_text().strip() and \
                artist.get_fontsize() < plots.MIN_FONT - 1e-6:
            problems.append(f"text {artist.get_text()[:30]!r} is {artist.get_fontsize():g} pt "
                            f"(at least {plots.MIN_FONT})")
        for what, colour in _colours(artist):
            if not colour_ok(colour):
                problems.append(f"{what} colour {mcolors.to_hex(colour)} of "
                                f"{type(artist).__name__} is not in plots.PALETTE")
    return [f"[{title[:40] or 'figure'}] {p}" for p in dict.fromkeys(problems)]
