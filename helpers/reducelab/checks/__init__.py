"""Answer checks for the exercises and predict-then-run questions.

Shared machinery; each notebook's checks live in a module of this package named for
its topic (``checks/all_reduce.py`` for notebook 01, ...). A check never only asserts:
it says what was expected, what it got, and why, so a learner can act on it. It
returns a :class:`Verdict`, which is truthy when the answer is right, so tests can
``assert check_x(answer)``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass
class Verdict:
    """The outcome of a check.

    Attributes:
        passed: whether the answer is right.
        message: what was expected, what was found and why, in plain sentences.
    """

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        mark = "✅ Correct." if self.passed else "❌ Not yet."
        return f"{mark} {self.message}"

    def _repr_html_(self) -> str:
        import html
        colour = "#1b7f3a" if self.passed else "#b3261e"
        mark = "✅ Correct." if self.passed else "❌ Not yet."
        body = html.escape(self.message).replace("\n", "<br>")
        return f'<div style="border-left:4px solid {colour};padding:4px 8px">{mark} {body}</div>'


def passed(message: str) -> Verdict:
    """A passing :class:`Verdict` with an explanation."""
    return Verdict(True, message)


def failed(message: str) -> Verdict:
    """A failing :class:`Verdict` with an explanation."""
    return Verdict(False, message)


def raised_on_ranks(context: str, err) -> Verdict:
    """A failing :class:`Verdict` for a learner's function that raised on the ranks:
    ``context`` (e.g. ``"With world_size=4"``), then the :class:`~reducelab.RankError`'s
    headline and the first rank's own error."""
    return failed(f"{context} your function raised on the ranks: {err.headline}. "
                  f"{err.first_summary}")


def reveal(prediction, actual, why: str, same=None) -> Verdict:
    """Compare a learner's prediction with what the ranks really did (every notebook's
    predict-then-run questions; introduced in notebook 01).

    Args:
        prediction: the learner's answer; ``None`` means no prediction was made.
        actual: what really happened, as computed by the real collective.
        why: one or two sentences explaining the actual result.
        same: optional ``(prediction, actual) -> bool``; defaults to ``==`` (with a
            float tolerance of 1e-6 for numbers and lists of numbers).

    Returns:
        A :class:`Verdict`; ``passed`` is ``False`` when there was no prediction.
    """
    if prediction is None:
        return failed(f"No prediction yet. The real run gives {actual!r}. {why}")
    ok = (same or _close)(prediction, actual)
    if ok:
        return passed(f"You predicted {prediction!r}, and the real run gives {actual!r}. {why}")
    return failed(f"You predicted {prediction!r}, but the real run gives {actual!r}. {why}")


def _close(a, b) -> bool:
    try:
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
        return a == b
    except Exception:
        return False


@contextlib.contextmanager
def restoring_world_size(group):
    """Let a check resize ``group`` (a :class:`~reducelab.LocalGroup`) freely; put its
    world size back afterwards, also when the check returns early or raises."""
    original = group.world_size
    try:
        yield group
    finally:
        group.resize(original)  # a no-op when the size is already right
