"""Widgets that run real collectives when the learner changes a control.

Shared machinery; each notebook's explorer lives in a module of this package named
for its topic (``widgets/all_reduce.py`` for notebook 01, ...).

An :class:`Explorer` owns a row of controls, a figure (an ``ipywidgets.Image`` that
holds PNG bytes, so a redraw replaces bytes rather than re-creating output) and a
message line. Every control change runs :meth:`Explorer.compute` on the group's ranks
and then :meth:`Explorer.draw`. Tests drive an explorer without a browser: set a
control's ``.value`` and read ``.result``, ``.message.value`` and ``.image.value``
(a change made from Python refreshes at once).

What every explorer does, whatever its topic:

* **It stays live.** It runs on the kernel's current group: when its own group was
  closed and the learner ran the setup cell again, it follows the new group by itself.
* **It never contradicts itself.** A refused combination replaces the figure with a
  plain note, so no stale picture sits under the error message.
* **It keeps up with the hand.** A change that comes from the browser (the learner
  drags a slider, which sends a change for every step it passes) is not refreshed in
  the comm handler: the refresh runs from the kernel's event loop once no further
  change has arrived for :data:`QUIET` seconds. Changes that arrive while a refresh
  runs wait in the kernel's queue; they are all applied, then one refresh runs for the
  latest values. So a drag never queues one refresh per step, and the figure that stays
  is the one for where the slider stopped.
* **It draws a state once.** The run on the ranks is real on every change, but a
  result equal to one drawn before, with the same control values (the learner went
  back to earlier settings), reuses that figure's PNG bytes instead of drawing it again
  (:data:`PNG_CACHE` states). The values are part of the key because a control may
  change only the view of an equal result (notebook 14's parameter).
* **It draws while the ranks run.** An explorer whose figure is rebuilt for a new shape
  (a world size it has not shown recently) builds that figure in a thread while
  :meth:`Explorer.compute` waits for the ranks (:meth:`Explorer.preparation`). A
  world-size move then waits for the longer of the two, not their sum: the new ranks
  start in other processes, and the kernel would only wait for them.
* **A resize need not fork.** After a move that resized the group, the explorer has the
  group keep spare processes (one more than its world size, forked in the background;
  :meth:`reducelab.LocalGroup.keep_spares`), so that the learner's next world size
  starts on processes that already exist.
* **No long collection pauses.** In a Jupyter kernel, making an explorer collects
  garbage once and then moves every object that exists (torch, matplotlib, the
  notebook's own) out of the garbage collector's scans (``gc.freeze``). A full
  collection of a kernel with torch imported scans about 300,000 objects (about 130 ms
  on a 2-core machine), and a refresh's new figures trigger one now and then; after the
  freeze it scans only what came later. In notebook 08's explorer the slowest tenth of
  control moves fell from about 590 to 550 ms and the longest from 820 to 650 ms (two
  runs each, idle 2-core machine). Objects that exist then and later become cyclic
  garbage are not freed, a few MB at most in a notebook's life.
* **It shows a long measurement as it goes.** A refresh whose run on the ranks takes
  seconds (notebook 10's first sweep of a world size: 1.5 to 3 s at 5 to 8 ranks on
  2 cores) shows what it has measured so far (:meth:`Explorer.show_interim`): a figure
  of the sizes done, and a message that says what is still being measured. The
  learner sees the answer grow instead of a frozen figure; the refresh's last figure is
  the complete one. The widget sends the figure at once, while the kernel goes on.
* **It reads without a kernel.** Its display carries, beside the live widget, an
  ``image/png`` of the figure it first drew and a ``text/plain`` of its settings and
  result, so GitHub, nbviewer and nbval see the same state as the widget.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import gc
import hashlib
import html
import io
import pickle
import sys
import time

import ipywidgets as W

from ..errors import GroupClosedError, RankError
from ..group import current_group
from ..palette import WRONG
from ..plots import message_png
from ..progress import current_kernel

QUIET = 0.004
"""Seconds without a further change from the browser before a deferred refresh runs:
long enough for the kernel to apply every change already waiting in its queue (each
takes well under a millisecond), far below what a learner notices."""
PNG_CACHE = 32
"""How many drawn results each explorer remembers (PNG bytes, a few tens of kB each)."""


def _tensor_contents(*fields):
    """Stands for a tensor in :func:`state_key`'s pickle; never called."""
    return fields


class _ContentsPickler(pickle.Pickler):
    """A pickler that writes a plain tensor as its contents. torch pickles a tensor's
    storage with its legacy format (``TypedStorage.__reduce__`` in ``torch/storage.py``),
    whose ``persistent_id`` names each storage by ``str(storage._cdata)``, an address
    in memory (``_legacy_save`` in ``torch/serialization.py``): two equal tensors in
    different memory pickle to different bytes, so an equal result never matched."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter) \
                or obj.layout != torch.strided or obj.is_quantized:
            return NotImplemented
        t = obj.detach().cpu().contiguous().reshape(-1)
        return _tensor_contents, (str(t.dtype), tuple(obj.shape), obj.requires_grad,
                                  t.view(torch.uint8).numpy().tobytes())


def state_key(values: dict, result) -> bytes:
    """A 16-byte digest of ``(values, result)`` that is equal for equal states: their
    pickled bytes, with every dense tensor (a ``torch.Tensor`` or ``nn.Parameter``, not
    a subclass such as ``DTensor``) written as its dtype, shape, ``requires_grad`` and
    bytes; others pickle as torch pickles them, so they never match. Raises what
    pickling raises for a result that cannot be pickled."""
    buffer = io.BytesIO()
    _ContentsPickler(buffer, protocol=5).dump((values, result))
    return hashlib.blake2b(buffer.getvalue(), digest_size=16).digest()


def in_kernel() -> bool:
    """True inside a Jupyter kernel, False in a script or a plain test process."""
    return current_kernel() is not None


_PREPARER: concurrent.futures.ThreadPoolExecutor | None = None
"""The one thread that runs preparations, made at the first: one thread for the kernel's
life, because matplotlib caches its fonts per thread."""


SPARES = 8
"""At most this many spare processes per group (:func:`_keep_spares`): 3 MB each, the
world sizes of the explorers' sliders."""


def _keep_spares(group) -> None:
    """After a move that started ranks anew (a resize), have ``group`` keep spares for
    the next one, in the preparer thread, so the learner's next resize need not fork
    (:meth:`reducelab.LocalGroup.keep_spares`): one more than its world size, enough for
    a step of the slider either way. A failure only means the next resize forks."""
    n = min(SPARES, group.world_size + 1)

    def keep():
        try:
            group.keep_spares(n)
        except Exception:  # noqa: BLE001 - closed, out of processes: the resize forks
            pass
    _Preparation(keep)


class _Preparation:
    """Runs an explorer's :meth:`~Explorer.preparation` in the preparer thread;
    :meth:`wait` waits for it and raises what it raised (a bug in the figure code is not
    hidden)."""

    def __init__(self, work):
        global _PREPARER
        self.future = None
        if work is not None:
            if _PREPARER is None:
                _PREPARER = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="reducelab-prepare")
            self.future = _PREPARER.submit(work)

    def wait(self, quiet: bool = False) -> None:
        """Wait for the work; then raise its error, unless ``quiet``."""
        if self.future is None:
            return
        future, self.future = self.future, None
        concurrent.futures.wait([future])
        if future.exception() is not None and not quiet:
            raise future.exception()


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
        refreshes: how many refreshes have run (an int; a drag of many steps adds far
            fewer than one per step).
        interims: how many interim figures :meth:`show_interim` has shown.
    """

    def __init__(self, controls: dict[str, W.ValueWidget]):
        if in_kernel():
            gc.collect()
            gc.freeze()  # see "No long collection pauses" above
        self.controls = controls
        self.image = W.Image(format="png", layout=W.Layout(width="auto", max_width="100%"))
        self.message = W.HTML()
        self.result = None
        self.error: RankError | None = None
        self.seconds = 0.0
        self.refreshes = 0
        self.interims = 0
        self._prepared: _Preparation | None = None   # the running refresh's preparation
        self._pngs: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._deferred = False       # a refresh is scheduled on the kernel's event loop
        self._last_change = 0.0      # time.monotonic() of the latest change from the browser
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

    def preparation(self, **values):
        """What :meth:`draw` will need for ``values`` whatever the ranks return, as a
        callable of no arguments, or ``None`` (the default) if nothing needs making.

        :meth:`refresh` calls it in a thread of its own while :meth:`compute` runs, and
        waits for it before drawing: typically it builds the figure of a new shape
        (:meth:`reducelab.plots.BuiltFigures._use`). It must touch only the explorer's
        figure objects, never the group or the widgets, and must leave them as
        :meth:`draw` would (a draw for another shape simply builds its own)."""
        return None

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
        self.request_refresh(change)

    def request_refresh(self, change: dict | None = None) -> None:
        """Refresh for a control change: at once for a change made from Python (a test,
        a cell), or, for one that came from the browser, deferred and collapsed (see
        the module docstring). Subclasses that override ``_on_change`` call this."""
        owner = (change or {}).get("owner")
        # ipywidgets holds _property_lock only while it applies a state the frontend sent
        if not getattr(owner, "_property_lock", None):
            self.refresh()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop runs here (a plain script)
            self.refresh()
            return
        self._last_change = time.monotonic()
        if not self._deferred:
            self._deferred = True
            loop.call_later(QUIET, self._deferred_refresh, loop)

    def _deferred_refresh(self, loop) -> None:
        quiet_for = time.monotonic() - self._last_change
        if quiet_for < QUIET:  # more changes came in: wait until they stop
            loop.call_later(QUIET - quiet_for, self._deferred_refresh, loop)
            return
        self._deferred = False
        self.refresh()

    def refresh(self) -> None:
        """Run :meth:`compute` with the current values and redraw, now.

        A :class:`~reducelab.RankError` or a closed group becomes a sentence in
        :attr:`message`, never an exception; other errors (a bug in a subclass, a
        ``ValueError`` from ``resize``) propagate.
        """
        t0 = time.perf_counter()
        values = self.values
        group = self.group
        starts = getattr(group, "restarts", None)
        prepared = self._prepared = _Preparation(self.preparation(**values))
        try:
            try:
                result = self.compute(**values)
            except BaseException:
                prepared.wait(quiet=True)   # the ranks' error is the one to tell
                raise
            prepared.wait()
        except GroupClosedError as err:
            self.result, self.error = None, None
            self._refuse(str(err))
        except RankError as err:
            self.result, self.error = None, err
            self._refuse(self.explain_error(values, err))
        else:
            self.result, self.error = result, None
            self.image.value = self._png(result)
            self.message.value = html.escape(self.describe(result))
        self.refreshes += 1
        self.seconds = time.perf_counter() - t0
        if starts is not None and group.restarts != starts:
            _keep_spares(group)

    def show_interim(self, partial, note: str) -> None:
        """Show ``partial`` (what :meth:`compute` has so far, of the type it returns) with
        ``note`` (one plain sentence: what is still being measured) while :meth:`compute`
        goes on. Called from :meth:`compute` only; the widget sends the new figure and
        message to the browser at once. Interim figures are not cached. Waits for the
        refresh's :meth:`preparation` first (it may be building the figure)."""
        if self._prepared is not None:
            self._prepared.wait()
        self.image.value = self.draw(partial)
        self.message.value = f"⏳ {html.escape(note)}"
        self.interims += 1

    def _png(self, result) -> bytes:
        """:meth:`draw`'s PNG bytes for ``result``, from the cache when an equal result
        was drawn before with the same control values (compared by
        :func:`state_key`)."""
        try:
            key = state_key(self.values, result)
        except Exception:  # noqa: BLE001 - a result that cannot be pickled is drawn anew
            return self.draw(result)
        cached = self._pngs.get(key)
        if cached is not None:
            self._pngs.move_to_end(key)
            return cached
        data = self.draw(result)
        self._pngs[key] = data
        while len(self._pngs) > PNG_CACHE:
            self._pngs.popitem(last=False)
        return data

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
