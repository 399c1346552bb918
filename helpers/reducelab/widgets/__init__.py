"""Widgets that run real collectives when the learner changes a control.

Shared machinery; each notebook's explorer lives in a module of this package named
for its topic (``widgets/all_reduce.py`` for notebook 01, ...).

An :class:`Explorer` owns a row of controls, a figure (an ``ipywidgets.Image`` that
holds PNG bytes, so a redraw replaces bytes rather than re-creating output) and a
message line. Every control change runs :meth:`Explorer.compute` on the group's ranks
and then :meth:`Explorer.draw`. Tests drive an explorer without a browser: set a
control's ``.value`` and read ``.result``, ``.message.value`` and ``.image.value``.
"""
from __future__ import annotations

import html
import time

import ipywidgets as W

from ..errors import GroupClosedError, RankError


class Explorer:
    """Base class: controls -> real run on the ranks -> figure and message.

    Subclasses implement ``compute(**values)`` (returns a result object, may raise
    :class:`~reducelab.RankError`), ``draw(result)`` (returns PNG bytes) and
    ``describe(result)`` (one line of plain text), and may override
    ``explain_error(values, err)``.

    Attributes:
        controls: ``{name: widget}``, in display order.
        result: the last successful result, or ``None`` after a refused combination.
        error: the last :class:`~reducelab.RankError`, or ``None``.
        seconds: wall time of the last refresh (compute + draw), in seconds.
    """

    def __init__(self, controls: dict[str, W.ValueWidget]):
        self.controls = controls
        self.image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.message = W.HTML()
        self.result = None
        self.error: RankError | None = None
        self.seconds = 0.0
        for w in controls.values():
            w.observe(self._on_change, names="value")
        self.box = W.VBox([W.HBox(list(controls.values()), layout=W.Layout(flex_flow="row wrap")),
                           self.image, self.message])

    # --- subclass API -----------------------------------------------------------------
    def compute(self, **values):  # pragma: no cover - abstract
        raise NotImplementedError

    def draw(self, result) -> bytes:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self, result) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def explain_error(self, values: dict, err: RankError) -> str:
        """One sentence for a refused combination; the default quotes the rank's error."""
        first = err.first_summary
        return f"The ranks refused this: {first}"

    # --- machinery --------------------------------------------------------------------
    @property
    def values(self) -> dict:
        """The controls' current values, ``{name: value}``."""
        return {k: w.value for k, w in self.controls.items()}

    def _on_change(self, change) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Run :meth:`compute` with the current values and redraw.

        A :class:`~reducelab.RankError` or a closed group becomes a sentence in
        :attr:`message`, never an exception; other errors (a bug in a subclass, a
        ``ValueError`` from ``resize``) propagate.
        """
        t0 = time.perf_counter()
        values = self.values
        try:
            result = self.compute(**values)
        except GroupClosedError as err:
            self.result, self.error = None, None
            self.message.value = f'<span style="color:#b3261e">⛔ {html.escape(str(err))}</span>'
        except RankError as err:
            self.result, self.error = None, err
            self.message.value = (f'<span style="color:#b3261e">⛔ '
                                  f'{html.escape(self.explain_error(values, err))}</span>')
        else:
            self.result, self.error = result, None
            self.image.value = self.draw(result)
            self.message.value = html.escape(self.describe(result))
        self.seconds = time.perf_counter() - t0

    def text(self) -> str:
        """Plain-text state: the values, then the description or the error sentence."""
        settings = ", ".join(f"{k}={v}" for k, v in self.values.items())
        if self.error is not None:
            return f"{type(self).__name__}({settings})\n{self.explain_error(self.values, self.error)}"
        body = self.describe(self.result) if self.result is not None else "(not run yet)"
        return f"{type(self).__name__}({settings})\n{body}"

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.box._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data = dict(data or {})
        data["text/plain"] = self.text()  # stable text for nbval, instead of widget reprs
        return data
