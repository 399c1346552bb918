"""How a :class:`~reducelab.LocalGroup` shows itself: its ``repr`` and the one line of HTML
that a notebook cell shows for it.

Introduced in notebook 01, whose setup cell ends with the group. Both say the settings
(``world_size``, ``backend``, ``timeout``), how many ranks are alive and the group's
state; the HTML line also draws each rank as ``●`` (alive) or ``✕`` (dead), each with a
tooltip, and colours the state with the palette of :mod:`reducelab.palette`, beside its
name (never colour alone).
"""
from __future__ import annotations

import html

from .palette import RIGHT, TEXT_GREY, WAIT


def group_repr(world_size: int, backend: str, timeout: float, env: dict[str, str],
               state: str, alive: int) -> str:
    """``LocalGroup(world_size=4, backend='gloo', timeout=30, state='idle', alive=4/4)``;
    ``env`` is shown only when the group sets any."""
    env_text = f", env={env!r}" if env else ""
    return (f"LocalGroup(world_size={world_size}, backend={backend!r}, "
            f"timeout={timeout:g}{env_text}, state={state!r}, "
            f"alive={alive}/{world_size})")


def group_html(world_size: int, backend: str, timeout: float, state: str,
               alive_by_rank: list[bool]) -> str:
    """One line of HTML: the settings, ``ranks alive n/world_size``, a mark per rank
    (``–`` when the group has no ranks) and the state."""
    colour = {"idle": RIGHT, "running": WAIT}
    dots = "".join(
        f'<span title="rank {rank}: {"alive" if up else "dead"}">'
        f'{"●" if up else "✕"}</span>'
        for rank, up in enumerate(alive_by_rank)) or "–"
    return (f'<div style="font-family:monospace"><b>LocalGroup</b> '
            f'backend={html.escape(backend)} world_size={world_size} '
            f'timeout={timeout:g}s ranks alive {sum(alive_by_rank)}/{world_size} {dots} '
            f'<span style="color:{colour.get(state, TEXT_GREY)}">{state}</span></div>')
