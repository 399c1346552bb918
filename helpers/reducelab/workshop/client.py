"""The learner's side of a workshop: what a kernel sends to the instructor's server.

Once a kernel has joined (:func:`reducelab.workshop.join`, or ``REDUCELAB_WORKSHOP``
in its environment), each check's and each predict-then-run question's verdict is
reported when it is shown in the notebook, and so is a group call that timed out.
A report holds the notebook's number, the exercise (the check's name) or question
(``answer_K``), the outcome, the kind of mistake the check named, and the time.
Nothing else: no code, no outputs, no file names.

Reporting never slows or breaks the notebook: a verdict is put on a queue (a few
microseconds) and a background thread sends it, each request bounded by
:data:`BOUND` seconds. When the server cannot be reached the learner sees one line,
once; the reports wait in the queue (at most :data:`QUEUE_MAX`) and go when the
server is back, each with an id so that a retry is never counted twice.
"""
from __future__ import annotations

import collections
import getpass
import http.client
import json
import os
import pathlib
import re
import secrets
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

BOUND = 2.0
"""Seconds one request to the server may take (connect, send and answer each)."""
QUEUE_MAX = 1000
"""Reports kept while the server is unreachable; older ones are dropped past this."""
RETRY = (1.0, 30.0)
"""Seconds between tries while the server is unreachable: the first, and the longest."""
ADDRESS = re.compile(r"(https?://[^/?#\s]+)/join/([A-Za-z0-9]{4,32})/?")
"""A join address: ``http://HOST:PORT/join/CODE``, as ``reducelab workshop serve`` prints."""
NOTEBOOK = re.compile(r"(?:^|/)(\d\d)_[^/]*\.ipynb$")


class WorkshopError(ValueError):
    """The server refused to let this kernel join (a wrong join code, a name that is
    taken or not allowed); the message is the server's."""


def parse_address(address: str) -> tuple[str, str]:
    """``(base URL, join code)`` of a join address.

    Raises:
        ValueError: ``address`` is not of the form ``http://HOST:PORT/join/CODE``.
    """
    m = ADDRESS.fullmatch(address.strip()) if isinstance(address, str) else None
    if not m:
        raise ValueError(f"a join address looks like http://HOST:PORT/join/CODE, as "
                         f"`reducelab workshop serve` prints it; got {address!r}")
    return m.group(1), m.group(2).upper()


def default_name() -> str:
    """The learner's name when none is given: ``REDUCELAB_WORKSHOP_NAME``, else the hub's
    user name (``JUPYTERHUB_USER``), else the login name."""
    for var in ("REDUCELAB_WORKSHOP_NAME", "JUPYTERHUB_USER"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name (a container): ask for one
        raise ValueError("no name given and no login name found: pass name=\"...\"") from None


def state_file() -> pathlib.Path:
    """Where a kernel keeps the secrets it was given, so that the next kernel of the same
    learner comes back as the same row of the dashboard: ``REDUCELAB_WORKSHOP_STATE``,
    else ``$XDG_STATE_HOME/reducelab/workshop.json`` (``~/.local/state/...``)."""
    if os.environ.get("REDUCELAB_WORKSHOP_STATE"):
        return pathlib.Path(os.environ["REDUCELAB_WORKSHOP_STATE"])
    base = os.environ.get("XDG_STATE_HOME") or pathlib.Path.home() / ".local" / "state"
    return pathlib.Path(base) / "reducelab" / "workshop.json"


def _load_secret(key: str) -> str | None:
    try:
        return json.loads(state_file().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _save_secret(key: str, secret: str) -> None:
    path = state_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        known[key] = secret
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
    except OSError:
        pass  # a read-only home: the next kernel joins under the same name and is refused


class Client:
    """One kernel's link to the workshop server (see the module docstring).

    Args:
        address: the join address.
        name: the learner's name, as the dashboard shows it.
        bound: seconds one request may take (:data:`BOUND`).
        out: where the one line about an unreachable server goes (default: the
            ``sys.stderr`` of the moment the client is made, so that a cell that
            redirects ``sys.stderr`` for a while, as ``check_node_command`` does while it
            parses, cannot swallow the line the background thread prints).

    Attributes:
        state: ``"joining"``, ``"joined"``, ``"refused"`` (the server said no; nothing is
            sent) or ``"stopped"``.
        sent: reports the server accepted.
        dropped: reports the server refused as malformed (none, unless the notebooks and
            the server disagree), or pushed out of a full queue.
    """

    def __init__(self, address: str, name: str, bound: float = BOUND, out=None):
        self.base, self.code = parse_address(address)
        self.name = name
        self.bound = bound
        self.out = out if out is not None else sys.stderr
        self.state = "joining"
        self.error: str | None = None
        self.secret: str | None = None
        self.sent = 0
        self.dropped = 0
        self._key = f"{self.base}|{self.code}|{name.casefold()}"
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._joined = threading.Event()
        self._told = False
        self._thread = threading.Thread(target=self._loop, name="reducelab-workshop", daemon=True)

    def start(self) -> "Client":
        self._thread.start()
        return self

    def stop(self, flush: float = 0.0) -> None:
        """Stop sending; with ``flush`` > 0, first wait up to that many seconds for the
        queue to empty."""
        end = time.monotonic() + flush
        while flush and self._queue and self.state == "joined" and time.monotonic() < end:
            time.sleep(0.02)
        self.state = "stopped"
        self._wake.set()
        self._thread.join(timeout=self.bound + 1)

    def wait_joined(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the join to be answered (yes or no)."""
        return self._joined.wait(timeout)

    def submit(self, notebook: str | None, item: str, outcome: str,
               mistake: str | None = None) -> None:
        """Queue one report; returns at once."""
        if self.state in ("refused", "stopped"):
            return
        if len(self._queue) >= QUEUE_MAX:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append({"id": secrets.token_urlsafe(12), "notebook": notebook,
                            "item": item, "outcome": outcome,
                            "mistake": mistake[:120] if mistake else mistake,
                            "time": time.time()})
        self._wake.set()

    @property
    def pending(self) -> int:
        """Reports queued and not yet accepted."""
        return len(self._queue)

    # --- the background thread ----------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None):
        """``(status, parsed JSON or text)``; raises ``OSError`` when there is no answer."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data else {}
        if self.secret:
            headers["Authorization"] = f"Bearer {self.secret}"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.bound) as r:
                status, raw, kind = r.status, r.read(), r.headers.get_content_type()
        except urllib.error.HTTPError as e:
            status, raw, kind = e.code, e.read(), e.headers.get_content_type()
        except (OSError, http.client.HTTPException) as e:  # no answer, or a garbled one
            raise OSError(str(getattr(e, "reason", e))) from None
        if kind == "application/json":
            try:
                return status, json.loads(raw)
            except ValueError:
                return status, {"error": raw.decode(errors="replace")[:200]}
        return status, raw.decode(errors="replace")

    def _say_once(self, line: str) -> None:
        if not self._told:
            self._told = True
            print(line, file=self.out, flush=True)

    def _unreachable(self) -> None:
        self._say_once(f"Workshop: the server at {self.base} is not reachable; the notebook "
                       f"goes on as usual, and your progress is sent when the server is back.")

    def _join(self) -> bool:
        status, answer = self._request("POST", f"/join/{self.code}",
                                       {"name": self.name, "secret": _load_secret(self._key)})
        if status == 200 and isinstance(answer, dict) and "secret" in answer:
            self.secret = answer["secret"]
            _save_secret(self._key, self.secret)
            self.state = "joined"
            self._joined.set()
            return True
        if status in (429, 500, 502, 503, 504):
            raise OSError(f"HTTP {status}")
        self.error = answer.get("error", str(answer)) if isinstance(answer, dict) else str(answer)
        self.state = "refused"
        self._joined.set()
        self._say_once(f"Workshop: the server refused to let this kernel join: {self.error}")
        return False

    def _send_one(self) -> None:
        report = self._queue[0]
        status, answer = self._request("POST", "/api/report", report)
        if status == 200:
            self.sent += 1
        elif status == 429:
            raise _Later()
        elif status in (401, 403):
            self.secret = None       # the server forgot us (a new --data): join again
            self.state = "joining"
            raise _Later()
        elif status >= 500:
            raise OSError(f"HTTP {status}")
        else:
            self.dropped += 1        # malformed: sending it again cannot help
        if self._queue and self._queue[0] is report:
            self._queue.popleft()

    def _loop(self) -> None:
        delay = RETRY[0]
        while self.state != "stopped":
            try:
                if self.state == "joining" and not self._join():
                    return
                while self._queue and self.state == "joined":
                    self._send_one()
                delay = RETRY[0]
                timeout = None
            except _Later:
                timeout = 1.0
            except OSError:
                self._unreachable()
                timeout, delay = delay, min(delay * 2, RETRY[1])
            self._wake.wait(timeout)
            self._wake.clear()

    def fetch_solution(self, filename: str) -> tuple[str | None, str]:
        """``(text, "")`` for an opened solution, else ``(None, one sentence saying why)``.
        Takes at most :attr:`bound` seconds (it runs in the learner's cell)."""
        if self.state != "joined" or not self.secret:
            return None, (f"The solution cannot be fetched yet: this kernel has not joined the "
                          f"workshop at {self.base} (see reducelab.workshop.status()).")
        try:
            status, answer = self._request("GET", f"/api/solutions/{urllib.parse.quote(filename)}")
        except OSError:
            return None, (f"The workshop server at {self.base} is not reachable, so the "
                          f"solution cannot be fetched now: try again in a minute.")
        if status == 200 and isinstance(answer, str):
            return answer, ""
        message = answer.get("error") if isinstance(answer, dict) else str(answer)
        return None, message


class _Later(Exception):
    """Try again in a second (the server asked to slow down, or we must join again)."""


# --- what the checks and the group tell us -------------------------------------------
def notebook_number() -> str | None:
    """The two-digit number of the notebook this kernel runs, from the path JupyterLab
    gives the kernel (``JPY_SESSION_NAME``; VS Code's ``__vsc_ipynb_file__``), or ``None``."""
    path = os.environ.get("JPY_SESSION_NAME", "")
    if not path:
        main = sys.modules.get("__main__")
        path = str(getattr(main, "__vsc_ipynb_file__", "") or "")
    m = NOTEBOOK.search(path.replace("\\", "/"))
    return m.group(1) if m else None


_ANSWER = re.compile(r"\breveal\(\s*(?:prediction\s*=\s*)?(answer_\w+)")


def origin(verdict) -> dict | None:
    """Which check or question made ``verdict``: called as it is created.

    The outermost ``check_*`` function of :mod:`reducelab.checks` on the stack names an
    exercise; else ``reveal`` names a question, by the ``answer_K`` variable its caller
    passes. ``None`` for a verdict made by neither (a test building one by hand)."""
    frame = sys._getframe(1)
    found = None
    while frame is not None:
        code = frame.f_code
        if frame.f_globals.get("__name__", "").startswith("reducelab.checks") and (
                code.co_name.startswith("check_") or code.co_name == "reveal"):
            found = (code.co_name, frame.f_back)
        frame = frame.f_back
    if found is None:
        return None
    name, caller = found
    if name.startswith("check_"):
        return {"item": name}
    if caller is None:
        return None
    import linecache
    lines = linecache.getlines(caller.f_code.co_filename)
    line = caller.f_lineno
    for i in range(min(line, len(lines)) - 1, max(-1, line - 12), -1):
        if "reveal(" in lines[i]:       # the call's first line: at or above the current one
            m = _ANSWER.search("".join(lines[i:i + 6]))
            return {"item": m.group(1)} if m else None
    return None


class Observer:
    """Connects :mod:`reducelab.checks` and :mod:`reducelab.errors` to a :class:`Client`."""

    def __init__(self, client: Client):
        self.client = client

    # Each method swallows its own errors: reporting never breaks a check or its display.
    def created(self, verdict) -> None:
        try:
            verdict._workshop_origin = origin(verdict)
        except Exception:  # noqa: BLE001
            pass

    def shown(self, verdict) -> None:
        try:
            where = getattr(verdict, "_workshop_origin", None)
            if where is None or getattr(verdict, "_workshop_reported", False):
                return
            verdict._workshop_reported = True
            outcome = ("unanswered" if not verdict.answered else
                       "passed" if verdict.passed else "failed")
            mistake = None if outcome != "failed" else (verdict.mistake or "wrong")
            notebook = notebook_number()
            if notebook is None and where["item"].startswith("answer_"):
                return  # a question is known by its notebook; this frontend does not say
            self.client.submit(notebook, where["item"], outcome, mistake)
        except Exception:  # noqa: BLE001
            pass

    def event(self, kind: str, **fields) -> None:
        if kind == "timeout":
            self.client.submit(notebook_number(), "timeout", "timeout")
