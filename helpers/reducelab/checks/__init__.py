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

from ..palette import NEUTRAL, RIGHT, WRONG
from .answers import why  # noqa: F401  (the notebooks import it from here, beside reveal)


_observer = None
"""Set by :mod:`reducelab.workshop` while this kernel is in a workshop: told of each
:class:`Verdict` as it is created (``created``) and when it is first shown (``shown``)."""

TENSOR_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast",
                      "all_gather", "all_gather_single", "all_gather_into_tensor",
                      "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
                      "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all",
                      "all_to_all_single")
"""The collectives on tensors of ``torch.distributed`` in torch 2.13, by the names a
learner calls them (``distributed_c10d.__all__``), deprecated spellings included:
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` still work beside the new
``all_gather_single`` and ``reduce_scatter_single``."""
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list")
"""The collectives of ``torch.distributed`` that move picklable Python objects."""
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                  "recv_object_list")
"""The point-to-point calls of ``torch.distributed``."""
COLLECTIVES = TENSOR_COLLECTIVES + OBJECT_COLLECTIVES + POINT_TO_POINT
"""Every ``torch.distributed`` call that moves data between ranks (``barrier`` moves
none). The checks that watch a learner's function for a collective it should not call,
or count the ones it does, each take their names from here, so a name torch adds reaches
all of them; ``tests/test_check_collectives.py`` fails when torch's list has one that
this one lacks."""


def collectives_except(*names: str) -> tuple[str, ...]:
    """:data:`COLLECTIVES` without ``names`` (the calls an exercise itself is built on).

    Raises:
        ValueError: a name is not in :data:`COLLECTIVES` (a misspelling would leave the
            call watched without anyone noticing)."""
    unknown = [n for n in names if n not in COLLECTIVES]
    if unknown:
        raise ValueError(f"not collectives of torch.distributed: {', '.join(unknown)}; "
                         f"valid: {', '.join(COLLECTIVES)}")
    return tuple(n for n in COLLECTIVES if n not in names)


PROMPT = ("No prediction yet. Write yours in the answer cell above, then run both "
          "cells again: the real result stays folded until you do.")
"""What an unanswered predict-then-run question shows, in place of the result."""


@dataclass
class Verdict:
    """The outcome of a check or of a predict-then-run question.

    Attributes:
        passed: whether the answer is right.
        message: what was expected, what was found and why, in plain sentences.
        answered: ``False`` for a question with no prediction yet: then nothing of
            ``message`` is shown unless the learner opens it on purpose (an HTML
            ``<details>``), and the plain-text form shows :data:`PROMPT` only.
        mistake: optional, for a failing check: the kind of mistake it found, in a few
            words (``"divided twice"``), as a workshop's dashboard shows it
            (:mod:`reducelab.workshop`); ``None`` is reported as ``"wrong"``.

    In a workshop (:mod:`reducelab.workshop`), a verdict is reported to the instructor's
    server when it is first shown in the notebook; otherwise nothing happens.
    """

    passed: bool
    message: str
    answered: bool = True
    mistake: str | None = None

    def __post_init__(self) -> None:
        if _observer is not None:
            _observer.created(self)

    def _shown(self) -> None:
        if _observer is not None:
            _observer.shown(self)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def state(self) -> str:
        """``"right"``, ``"wrong"`` or ``"unanswered"``."""
        return "unanswered" if not self.answered else "right" if self.passed else "wrong"

    def __repr__(self) -> str:
        self._shown()
        if not self.answered:
            return f"🤔 {PROMPT}"
        mark = "✅ Correct." if self.passed else "❌ Not yet."
        return f"{mark} {self.message}"

    def _repr_html_(self) -> str:
        self._shown()
        import html
        body = html.escape(self.message).replace("\n", "<br>")
        if not self.answered:
            return (f'<div class="reducelab-verdict" data-state="unanswered" '
                    f'style="border-left:4px solid {NEUTRAL};padding:4px 8px">🤔 '
                    f'{html.escape(PROMPT)}<details><summary>Show the real result '
                    f'anyway</summary>{body}</details></div>')
        colour = RIGHT if self.passed else WRONG
        mark = "✅ Correct." if self.passed else "❌ Not yet."
        return (f'<div class="reducelab-verdict" data-state="{self.state}" '
                f'style="border-left:4px solid {colour};padding:4px 8px">{mark} {body}</div>')


def passed(message: str) -> Verdict:
    """A passing :class:`Verdict` with an explanation."""
    return Verdict(True, message)


def failed(message: str, mistake: str | None = None) -> Verdict:
    """A failing :class:`Verdict` with an explanation, and optionally the kind of mistake
    in a few words (see :attr:`Verdict.mistake`)."""
    return Verdict(False, message, mistake=mistake)


def raised_on_ranks(context: str, err) -> Verdict:
    """A failing :class:`Verdict` for a learner's function that raised on the ranks:
    ``context`` (e.g. ``"With world_size=4"``), then the :class:`~reducelab.RankError`'s
    headline and the first rank's own error. Where no rank raised and some hung past the
    group's timeout, it says the function did not finish, and where each rank was."""
    reports = getattr(err, "reports", [])
    hung = any(r.state == "stuck" for r in reports)
    if hung and not any(r.state == "raised" for r in reports):
        # no rank raised: say where each rank was, not the headline a second time
        where = "; ".join(f"rank {r.rank} " + (r.summary if r.state == "stuck" else
                                                "returned" if r.state == "returned" else
                                                f"{r.state}: {r.summary}") for r in reports)
        return failed(f"{context} your function did not finish on the ranks: {err.headline}. "
                      f"{where[0].upper()}{where[1:]}.", mistake="hung past the timeout")
    own = err.first_summary
    return failed(f"{context} your function raised on the ranks: {err.headline}."
                  + (f" {own}" if own != err.headline else ""),
                  mistake="hung past the timeout" if hung else "raised on the ranks")


def _as_python(prediction, actual):
    """A prediction typed as text (``"False"``, ``"36"``) read as the value it spells,
    when ``actual`` is not text; else the prediction unchanged. Returns
    ``(value, note)``, ``note`` saying what was read, or ``""``."""
    if not isinstance(prediction, str) or isinstance(actual, str):
        return prediction, ""
    import ast
    try:
        value = ast.literal_eval(prediction.strip())
    except (ValueError, SyntaxError):
        kind = ("True or False" if isinstance(actual, bool) else
                "a number such as 4" if isinstance(actual, (int, float)) else
                "a list such as [0, 1]" if isinstance(actual, list) else
                "a tuple such as (True, False)" if isinstance(actual, tuple) else
                f"a {type(actual).__name__}")
        return prediction, f" (Your answer is text; this question expects {kind}, " \
                           f"written without quotes.)"
    return value, (f" (You wrote the text {prediction!r}; it was read as {value!r}. "
                   f"Next time write it without quotes.)")


def reveal(prediction, actual, why: str, same=None, evidence: str = "") -> Verdict:
    """Compare a learner's prediction with what the ranks really did (every notebook's
    predict-then-run questions; introduced in notebook 01).

    With no prediction yet, the result stays folded: the verdict shows :data:`PROMPT`,
    and the result, ``why`` and ``evidence`` only inside an HTML ``<details>`` that
    the learner opens on purpose. A question cell shows nothing else, so the committed
    notebooks give no answer away.

    Args:
        prediction: the learner's answer; ``None`` means no prediction was made. Text
            that spells a value (``"False"``) is read as that value when ``actual`` is
            not text.
        actual: what really happened, as computed by the real collective.
        why: one or two sentences explaining the actual result. The notebooks pass
            :func:`why` (``reducelab.checks.answers``), so that a question cell's
            source does not state the answer.
        same: optional ``(prediction, actual) -> bool``; defaults to ``==`` (with a
            float tolerance of 1e-6 for numbers and lists of numbers).
        evidence: optional text shown with the result, such as each rank's values.

    Returns:
        A :class:`Verdict`; ``passed`` is ``False`` when there was no prediction.
    """
    shown = f"{evidence.rstrip()}\n" if evidence else ""
    if prediction is None:
        return Verdict(False, f"{shown}The real run gives {actual!r}. {why}", answered=False)
    value, note = _as_python(prediction, actual)
    ok = (same or _close)(value, actual)
    if ok:
        return passed(f"{shown}You predicted {value!r}, and the real run gives {actual!r}. "
                      f"{why}{note}")
    return failed(f"{shown}You predicted {value!r}, but the real run gives {actual!r}. "
                  f"{why}{note}")


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
