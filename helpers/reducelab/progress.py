"""The status line shown while a group's ranks start (notebook 01's setup cell).

In a notebook cell, ``LocalGroup(...)`` shows one line that is updated in place as each
rank joins the process group, ``●●○○ Starting 4 gloo ranks: 2/4 up``, and ends as
``●●●● 4 gloo ranks up`` (or as a sentence saying how many joined before the start
failed). Nothing is shown from widget callbacks (their output would land in
JupyterLab's log console), for resizes, or outside a Jupyter kernel, unless a callback
is given.

nbval compares a display's first version with the stored last one (updates are not
replayed), so ``tests/nbval_sanitize.cfg`` maps both forms of the line to one token.
"""
from __future__ import annotations

import html


def current_kernel():
    """The Jupyter kernel this code runs in (ipykernel's ``Kernel``), or ``None`` in a
    script or a plain test process."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    return getattr(ip, "kernel", None) if ip is not None else None


def _in_cell() -> bool:
    """True inside a Jupyter kernel while it executes a cell (not a widget callback)."""
    kernel = current_kernel()
    if kernel is None:
        return False
    try:
        parent = kernel.get_parent("shell")
    except TypeError:  # older ipykernel: get_parent() takes no channel
        parent = kernel.get_parent()
    except Exception:
        return False
    return (parent or {}).get("header", {}).get("msg_type") == "execute_request"


class StartProgress:
    """Show ``up/world_size`` ranks while a group starts.

    Args:
        world_size: ranks being started.
        backend: the backend name, for the text.
        callback: ``None`` (a status line when run from a notebook cell, else nothing),
            ``False`` (nothing), or a callable ``callback(up: int, world_size: int)``
            called at 0 and after each rank joins.
    """

    def __init__(self, world_size: int, backend: str, callback=None):
        self.world_size, self.backend = world_size, backend
        self.callback = callback
        self.handle = None
        if callback is None and _in_cell():
            from IPython.display import display
            self.handle = display(self._bundle(0), raw=True, display_id=True)
        self.update(0)

    def _bundle(self, up: int, final: str | None = None) -> dict:
        n = self.world_size
        s = "s" if n > 1 else ""
        if final is not None:
            text = final
        elif up == n:
            text = f"{n} {self.backend} rank{s} up"
        else:
            text = f"Starting {n} {self.backend} rank{s}: {up}/{n} up"
        bar = "".join("●" if i < up else "○" for i in range(n))
        return {"text/plain": f"{bar} {text}",
                "text/html": f'<div class="reducelab-start" style="font-family:monospace">'
                             f'{bar} {html.escape(text)}</div>'}

    def update(self, up: int) -> None:
        """Record that ``up`` ranks have joined."""
        if callable(self.callback):
            self.callback(up, self.world_size)
        if self.handle is not None and up < self.world_size:
            self.handle.update(self._bundle(up), raw=True)

    def done(self, up: int, ok: bool) -> None:
        """End the line: all ranks up, or a sentence saying the start failed."""
        if self.handle is None:
            return
        if ok:
            self.handle.update(self._bundle(up), raw=True)
        else:
            final = f"{up}/{self.world_size} ranks joined before the start failed"
            self.handle.update(self._bundle(up, final), raw=True)
