"""The status line shown while ranks start: how many ranks are up (notebook 01's setup cell).

In an IPython kernel the line is one display that is updated in place as each rank
joins the process group, and is emptied once all have joined (the group's own repr
says how many ranks are up). It starts and ends empty because nbval compares a
display's first version with the stored last one: updates are not replayed. If the
start fails, the line ends as a sentence saying how many ranks joined. Elsewhere
nothing is shown unless a callback is given.
"""
from __future__ import annotations

import html


_EMPTY = {"text/plain": ""}


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class StartProgress:
    """Show ``up/world_size`` ranks while a group starts.

    Args:
        world_size: ranks being started.
        backend: the backend name, for the text.
        callback: ``None`` (a display in IPython kernels, else nothing), ``False``
            (nothing), or a callable ``callback(up: int, world_size: int)`` called at 0
            and after each rank joins.
    """

    def __init__(self, world_size: int, backend: str, callback=None):
        self.world_size, self.backend = world_size, backend
        self.callback = callback
        self.handle = None
        if callback is None and _in_kernel():
            from IPython.display import display
            self.handle = display(_EMPTY, raw=True, display_id=True)
        self.update(0)

    def _bundle(self, up: int, final: str | None = None) -> dict:
        n = self.world_size
        if final is not None:
            text = final
        else:
            text = f"Starting {n} {self.backend} rank{'s' if n > 1 else ''}: {up}/{n} up"
        bar = "".join("●" if i < up else "○" for i in range(n))
        colour = "#2a7" if final is not None and up == n else "#888"
        return {"text/plain": text,
                "text/html": f'<div style="font-family:monospace;color:{colour}">'
                             f'{bar} {html.escape(text)}</div>'}

    def update(self, up: int) -> None:
        """Record that ``up`` ranks have joined."""
        if callable(self.callback):
            self.callback(up, self.world_size)
        if self.handle is not None:
            self.handle.update(self._bundle(up), raw=True)

    def done(self, up: int, ok: bool) -> None:
        """Empty the line (all joined) or leave a sentence saying the start failed."""
        if self.handle is None:
            return
        if ok:
            self.handle.update(_EMPTY, raw=True)
        else:
            final = f"{up}/{self.world_size} ranks joined before the start failed"
            self.handle.update(self._bundle(up, final), raw=True)
