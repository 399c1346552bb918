"""Stored outputs that hold on any CPU (``reducelab.determinism``).

The notebooks print rounding-size differences through ``within(value, tol)``: the text
must not depend on the digits of ``value`` while it is within ``tol``, and must show a
real result (a value above ``tol``) so that nbval fails on it.
"""
from __future__ import annotations

import math

import pytest

from reducelab.determinism import within


@pytest.mark.parametrize("value", [0.0, 3e-9, 4.1e-8, 5.2e-8, 2.38e-7, 1e-6])
def test_rounding_noise_prints_the_same_text_whatever_its_digits(value):
    # The digits that another CPU changes (4.1e-08 against 5.2e-08) never reach the text.
    assert within(value, 1e-6) == "≤ 1e-06"


def test_a_value_above_the_tolerance_is_shown_with_the_bound_it_passes():
    assert within(3.2e-3, 1e-6) == "0.003 (above 1e-06)"
    assert within(1.5e-6, 1e-6) == "2e-06 (above 1e-06)"
    assert within(31.2, 1e-6) == "30 (above 1e-06)" and within(12.0, 1e-5) == "10 (above 1e-05)"
    assert within(math.inf, 1e-6) == "inf (above 1e-06)"


def test_a_nan_difference_is_never_within_a_tolerance():
    assert within(math.nan, 1e-6) == "nan (above 1e-06)"


@pytest.mark.parametrize("tol", [-1e-6, math.nan])
def test_a_tolerance_that_is_not_a_bound_is_refused(tol):
    with pytest.raises(ValueError, match="tol must be a number >= 0"):
        within(1e-7, tol)
