"""Workshop mode: the instructor sees who is stuck, and opens solutions when the class is
ready (issue 24; the instructor's guide is ``docs/instructors.md``).

The instructor runs ``reducelab workshop serve`` (:mod:`reducelab.workshop.server`),
which prints a **join address** for the learners and a **dashboard address** for the
instructor. A learner's kernel joins with one line::

    import reducelab.workshop
    reducelab.workshop.join("http://10.0.0.5:8765/join/K7QX2MPA", name="Ada")

or by itself at ``import reducelab`` when ``REDUCELAB_WORKSHOP`` holds the join
address (a hub sets it for everyone; the name is then ``REDUCELAB_WORKSHOP_NAME``,
else the hub's user name, else the login name; ``reducelab lab --workshop ADDRESS``
sets ``REDUCELAB_WORKSHOP`` for the kernels it starts, and ``REDUCELAB_WORKSHOP_NAME``
when given ``--name``).

From then on every check's and question's verdict, and every group call that timed
out, is reported (:mod:`reducelab.workshop.client` says exactly what a report holds),
in the background: a notebook never waits for the server, and without it goes on as
if there were no workshop. The def cells' ``%load solutions/NN_name.py`` line fetches
the solution from the server once the instructor has opened it (a workshop copy of
the notebooks has no ``solutions/`` folder), and before that says so in one sentence.
Outside a workshop nothing of this runs.
"""
from __future__ import annotations

import os
import re

from .client import BOUND, Client, WorkshopError, default_name, parse_address

__all__ = ["join", "leave", "status", "WorkshopError", "ENV"]

ENV = "REDUCELAB_WORKSHOP"
"""The environment variable holding a join address; a kernel with it joins at import."""

_client: Client | None = None
_LOAD = re.compile(r"\s*solutions/(\d\d_\w+\.py)\s*")


def join(address: str, name: str | None = None, wait: float = BOUND) -> Client:
    """Join the workshop at ``address`` as ``name``; report from now on.

    Args:
        address: the join address ``reducelab workshop serve`` printed,
            ``http://HOST:PORT/join/CODE``.
        name: the name the dashboard shows (1 to 40 characters, no ``<`` or ``>``);
            default :func:`reducelab.workshop.client.default_name`. The same name from
            the same user account comes back as the same row (the secret the server
            gave is kept in :func:`reducelab.workshop.client.state_file`).
        wait: seconds to wait for the server's answer (:data:`~reducelab.workshop.client.BOUND`);
            with no answer by then, this prints one line and keeps trying in the
            background.

    Returns:
        The :class:`~reducelab.workshop.client.Client` (``status()`` describes it).

    Raises:
        ValueError: ``address`` is not a join address, or ``name`` is not given and
            there is no login name.
        WorkshopError: the server refused: a wrong join code, or the name is taken or
            not allowed (the message is the server's).
    """
    global _client
    name = default_name() if name is None else name
    client = Client(address, name)
    leave()
    _client = _install(client.start())
    if client.wait_joined(wait):
        if client.state == "refused":
            leave()
            raise WorkshopError(f"the workshop server refused to let this kernel join: "
                                f"{client.error}")
        print(f"Joined the workshop at {client.base} as {client.name!r}: your checks and "
              f"answers are reported to the instructor (outcomes only: no code, no outputs).")
    return client


def leave() -> None:
    """Stop reporting (reports still queued are sent within a second, if they can be)."""
    global _client
    client, _client = _client, None
    if client is None:
        return
    from .. import checks, errors
    if checks._observer is not None and checks._observer.client is client:
        checks._observer = None
    errors.listeners[:] = [l for l in errors.listeners
                           if getattr(l, "__self__", None) is None
                           or getattr(l.__self__, "client", None) is not client]
    client.stop(flush=1.0)


def status() -> dict:
    """Where this kernel stands: ``{"state", "server", "name", "sent", "pending",
    "dropped", "error"}``; ``{"state": "off"}`` outside a workshop."""
    c = _client
    if c is None:
        return {"state": "off"}
    return {"state": c.state, "server": c.base, "name": c.name, "sent": c.sent,
            "pending": c.pending, "dropped": c.dropped, "error": c.error}


def start_from_env() -> Client | None:
    """Join the workshop named by ``REDUCELAB_WORKSHOP``, in the background (called at
    ``import reducelab`` in a Jupyter kernel). A bad address or a refusal prints one
    line; nothing here raises or waits."""
    global _client
    address = os.environ.get(ENV, "").strip()
    if not address or _client is not None:
        return _client
    import sys
    try:
        client = Client(address, default_name())
    except ValueError as e:
        print(f"Workshop: {ENV} is set, but {e}", file=sys.stderr)
        return None
    _client = _install(client.start())
    return client


def _install(client: Client) -> Client:
    from .. import checks, errors
    from .client import Observer
    observer = Observer(client)
    checks._observer = observer
    errors.listeners.append(observer.event)
    _register_load_magic()
    return client


_original_load = None


def load_magic(line: str):
    """``%load`` in a workshop: ``%load solutions/NN_name.py``, when that file is not
    here, fetches the solution from the workshop server once the instructor has opened
    it and fills the cell with it, as IPython's own ``%load`` does; before that it prints
    one sentence and leaves the cell as it is. Anything else goes to IPython's ``%load``."""
    m = _LOAD.fullmatch(line)
    if m and _client is not None and not os.path.exists(line.strip()):
        text, why = _client.fetch_solution(m.group(1))
        if text is None:
            print(why)
            return None
        from IPython import get_ipython
        get_ipython().set_next_input(f"# %load {line.strip()}\n{text}", replace=True)
        return None
    return _original_load(line)


def _register_load_magic() -> None:
    global _original_load
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    current = ip.find_line_magic("load")
    if current is not None and getattr(current, "__func__", current) is not load_magic:
        _original_load = current
    ip.register_magic_function(load_magic, "line", "load")
