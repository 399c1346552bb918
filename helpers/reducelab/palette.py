"""The project's colours, in one place (no matplotlib needed to import it).

Okabe and Ito's "Color Universal Design" set (2008): every pair stays distinct under
simulated deuteranopia, protanopia and tritanopia (``tests/test_figures.py`` checks it
with colorspacious). Figures (:mod:`reducelab.plots`), the group's HTML status and the
checks' verdicts all take their colours from here, and say with text or symbols
whatever a colour says.
"""

PALETTE = {
    "blue": "#0072B2", "orange": "#E69F00", "green": "#009E73", "vermillion": "#D55E00",
    "sky": "#56B4E9", "purple": "#CC79A7", "yellow": "#F0E442", "black": "#000000",
}
"""The project's colours, by name."""
NEUTRAL = "#BBBBBB"
"""Grey for "nothing here" (an unchanged input, a padded slot, an unanswered question);
distinct from every colour of :data:`PALETTE` under the three simulated deficiencies."""
TEXT_GREY = "#333333"
"""Grey for secondary text."""
PANEL_GREY = "#F2F2F2"
"""Light grey background of a note that stands in for a figure."""
RIGHT, WRONG, WAIT = PALETTE["green"], PALETTE["vermillion"], PALETTE["orange"]
"""Colours of a right answer, a wrong one or a refusal, and of something in progress;
always beside a ✅, ❌, ⛔ or a word."""
