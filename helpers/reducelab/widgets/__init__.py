"""Widgets that run real collectives when the learner changes a control.

Shared machinery; each notebook's explorer lives in a module of this package named
for its topic (``widgets/all_reduce.py`` for notebook 01, ...).

An :class:`Explorer` owns a row of controls, a figure (an ``ipywidgets.Image`` that
holds PNG bytes, so a redraw replaces bytes rather than re-creating output) and a
message line. Every control change runs :meth:`Explorer.compute` on the group's ranks
and then :meth:`Explorer.draw`. Tests drive an explorer without a browser: set a
control's ``.value`` and read ``.result``, ``.message.value`` and ``.image.value``.

What every explorer does, whatever its topic:

* **It stays live.** It runs on the kernel's current group: when its own group was
  closed and the learner ran the setup cell again, it follows the new group by itself.
* **It never contradicts itself.** A refused combination replaces the figure with a
  plain note, so no stale picture sits under the error message.
* **It reads without a kernel.** Its display carries, beside the live widget, an
  ``image/png`` of the figure it first drew and a ``text/plain`` of its settings and
  result, so GitHub, nbviewer and nbval see the same state as the widget.
"""
from __future__ import annotations

import base64
import html
import time

import ipywidgets as W

from ..errors import GroupClosedError, RankError
from ..group import current_group
from ..palette import WRONG
from ..plots import message_png


class Explorer:
    """Base class: controls -> real run on the ranks -> figure and message.

    Subclasses implement ``compute(**values)`` (returns a result object, may raise
    :class:`~reducelab.RankError`), ``draw(result)`` (returns PNG bytes) and
    ``describe(result)`` (one line of plain text), and may override
    ``explain_error(values, err)``. They use :attr:`group`, which follows the kernel's
    current :class:`~reducelab.LocalGroup` once the one they were given is closed.

    Attributes:
        controls: ``{name: widget}``, in display order.
        result: the last successful result, or ``None`` after a refused combination.
        error: the last :class:`~reducelab.RankError`, or ``None``.
        seconds: wall time of the last refresh (compute + draw), in seconds.
    """

    def __init__(self, controls: dict[str, W.ValueWidget]):
        self.controls = controls
        self.image = W.Image(format="png", layout=W.Layout(width="auto", max_width="100%"))
        self.message = W.HTML()
        self.result = None
        self.error: RankError | None = None
        self.seconds = 0.0
        for w in controls.values():
            w.observe(self._on_change, names="value")
        self.box = W.VBox([W.HBox(list(controls.values()), layout=W.Layout(flex_flow="row wrap")),
                           self.image, self.message])

    @property
    def group(self):
        """The :class:`~reducelab.LocalGroup` this explorer runs on: the one it was given,
        or, once that one is closed, the kernel's newest open group (the learner ran the
        setup cell again)."""
        g = getattr(self, "_group", None)
        if g is not None and g.state == "closed":
            newer = current_group()
            if newer is not None:
                self._group = g = newer
        return g

    @group.setter
    def group(self, group) -> None:
        self._group = group

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
            self._refuse(str(err))
        except RankError as err:
            self.result, self.error = None, err
            self._refuse(self.explain_error(values, err))
        else:
            self.result, self.error = result, None
            self.image.value = self.draw(result)
            self.message.value = html.escape(self.describe(result))
        self.seconds = time.perf_counter() - t0

    def _refuse(self, sentence: str) -> None:
        """Show ``sentence`` as the message, and a plain note instead of the old figure."""
        self.message.value = f'<span style="color:{WRONG}">⛔ {html.escape(sentence)}</span>'
        self.image.value = message_png("No figure for these settings: see the message below.")

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
        if self.image.value:  # the picture a frontend without widgets shows
            data["image/png"] = base64.b64encode(self.image.value).decode("ascii")
        return data
