"""The project's palette stays readable for everyone, and figures follow the rules.

Source of the simulation: colorspacious (Machado, Oliveira & Fernandes 2009 model of
colour-vision deficiency; CAM02-UCS colour differences).
"""
from __future__ import annotations

import itertools
import pathlib
import re

import matplotlib.colors as mcolors
import numpy as np
import pytest
from colorspacious import cspace_convert, deltaE

from figure_audit import audit
from reducelab import plots

DEFICIENCIES = ("deuteranomaly", "protanomaly", "tritanomaly")
MIN_DELTA_E = 10.0
"""Smallest CAM02-UCS difference between two of the project's colours, for everyone."""
HELPERS = pathlib.Path(__file__).resolve().parents[1] / "helpers" / "reducelab"


def simulate(hex_colour: str, deficiency: str | None) -> np.ndarray:
    rgb = np.array(mcolors.to_rgb(hex_colour))
    if deficiency is None:
        return rgb
    cvd = {"name": "sRGB1+CVD", "cvd_type": deficiency, "severity": 100}
    return np.clip(cspace_convert(rgb, cvd, "sRGB1"), 0, 1)


@pytest.mark.parametrize("deficiency", [None, *DEFICIENCIES])
def test_every_pair_of_project_colours_stays_distinct(deficiency):
    colours = {**plots.PALETTE, "neutral": plots.NEUTRAL}
    worst = min((deltaE(simulate(a, deficiency), simulate(b, deficiency),
                        input_space="sRGB1"), na, nb)
                for (na, a), (nb, b) in itertools.combinations(colours.items(), 2))
    assert worst[0] >= MIN_DELTA_E, f"{worst[1]} and {worst[2]} differ by ΔE {worst[0]:.1f}"


def test_colour_literals_live_in_the_palette_module_only():
    """Other modules name colours through reducelab.palette, so a new colour cannot slip in."""
    hex_literal = re.compile(r"['\"]#[0-9A-Fa-f]{3}(?:[0-9A-Fa-f]{3})?['\"]")
    named = re.compile(r"colou?rs?\s*=\s*['\"](?:red|green|blue|orange|purple|yellow|cyan|"
                       r"magenta|pink|brown|tab:\w+|C\d)['\"]")
    offenders = []
    for path in HELPERS.rglob("*.py"):
        if path == HELPERS / "palette.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if hex_literal.search(line) or named.search(line):
                offenders.append(f"{path.relative_to(HELPERS)}:{n}: {line.strip()}")
    assert not offenders, "colours outside plots.PALETTE:\n" + "\n".join(offenders)


def test_the_audit_catches_a_small_font_a_foreign_colour_and_a_wide_figure():
    fig = plots.new_figure(8, 3)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], color="#FF0000")
    ax.text(0.5, 0.5, "tiny", fontsize=7)
    fig.set_figwidth(12)
    problems = " ".join(audit(fig))
    assert "#ff0000" in problems and "7 pt" in problems and "12.0 in wide" in problems


def test_a_figure_in_the_house_style_passes_the_audit():
    fig = plots.new_figure(8, 3)
    ax = fig.subplots()
    for k in range(3):
        ax.plot([0, 1], [k, k + 1], marker=plots.MARKERS[k], label=f"rank {k}")
    ax.bar([0, 1], [1, 2], color=plots.NEUTRAL, hatch=plots.HATCHES[1])
    ax.legend()
    assert audit(fig) == []
