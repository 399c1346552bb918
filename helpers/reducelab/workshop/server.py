"""The instructor's workshop server: learners' kernels report their checks to it, the
instructor watches the room on its dashboard and opens solutions from there.

Started by ``reducelab workshop serve`` (see :func:`serve`). A Starlette application,
served by uvicorn, with its state in one SQLite file under ``--data``, so a restart
loses nothing: the join code, the instructor's token, every learner, every accepted
report and every opened solution come back as they were.

Who may do what:

* a **learner** joins with the join code (``POST /join/<code>``) and gets a secret of
  their own; with it they can post their own reports (``POST /api/report``) and fetch
  the solutions the instructor has opened (``GET /api/solutions/<NN_name.py>``), and
  nothing else;
* the **instructor** holds a token, printed once at start: the dashboard
  (``GET /dashboard``), its JSON (``GET /api/progress``), its live updates
  (``GET /api/events``, server-sent events) and opening a solution
  (``POST /api/unlock``). Without the token they answer 401; with a wrong one (a
  learner's secret included), 403.

Bad input gets a JSON ``{"error": "..."}`` that says what was wrong and changes nothing:
a body over :data:`MAX_BODY` bytes (413), malformed JSON or fields (422), a name with
``<`` or ``>`` in it (422), a wrong join code (404), more than :data:`REPORT_RATE`
reports a second from one learner, or repeated wrong join codes from one address (429,
with ``Retry-After``).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import pathlib
import re
import secrets
import sqlite3
import threading
import time
import unicodedata
from dataclasses import dataclass, field

from .catalog import Catalog, read_catalog

MAX_BODY = 4096
"""Bytes a request body may have; a report is about 200."""
REPORT_RATE = 20.0
"""Reports a second one learner may send, on average (a Run All sends a few a second)."""
REPORT_BURST = 60
"""Reports one learner may send at once before :data:`REPORT_RATE` applies."""
JOIN_FAILURES = 10
"""Wrong join codes one address may send in a row before it must wait (one more every
6 s): the code cannot be guessed by trying."""
NAME_MAX = 40
"""Characters a learner's name may have."""
OUTCOMES = ("passed", "failed", "unanswered", "timeout")
"""What a report may say: a check or question ``passed`` or ``failed``, a question
``unanswered`` (no prediction yet), or a group call that hit its ``timeout``."""
CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
"""Join codes use letters and digits that are hard to mistake for one another."""
DB_NAME = "workshop.sqlite3"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS learners (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, name_key TEXT NOT NULL UNIQUE,
    secret_hash TEXT NOT NULL UNIQUE, joined REAL NOT NULL);
CREATE TABLE IF NOT EXISTS reports (
    id INTEGER PRIMARY KEY, learner INTEGER NOT NULL REFERENCES learners(id),
    report_id TEXT NOT NULL, notebook TEXT, item TEXT NOT NULL, outcome TEXT NOT NULL,
    mistake TEXT, client_time REAL, received REAL NOT NULL,
    UNIQUE (learner, report_id));
CREATE TABLE IF NOT EXISTS unlocked (solution TEXT PRIMARY KEY, at REAL NOT NULL);
"""


class BadRequest(Exception):
    """A request the server refuses: ``status`` and a message for the client."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_name(name) -> str:
    """A learner's name, stripped; raises :class:`BadRequest` (422) unless it has 1 to
    :data:`NAME_MAX` characters, no ``<`` or ``>`` (no HTML) and no control characters."""
    if not isinstance(name, str):
        raise BadRequest(422, "name must be text, such as \"Ada\"")
    name = unicodedata.normalize("NFC", name.strip())
    if not 1 <= len(name) <= NAME_MAX:
        raise BadRequest(422, f"a name has 1 to {NAME_MAX} characters; {len(name)} given")
    if "<" in name or ">" in name:
        raise BadRequest(422, "a name may not contain < or > (no HTML): choose a plain name")
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise BadRequest(422, "a name may not contain control characters")
    return name


@dataclass
class Cell:
    """One learner's state on one dashboard column."""

    tries: int = 0          # failed attempts
    since: float | None = None   # first failure (server time, s since the epoch)
    last: float | None = None    # last report on this column
    passed: float | None = None  # first pass
    mistake: str | None = None   # the last failure's kind of mistake
    seen: bool = False           # an unanswered question was reached

    def as_json(self) -> dict:
        state = "passed" if self.passed is not None else "failing" if self.tries else "seen"
        return {"state": state, "tries": self.tries, "since": self.since, "last": self.last,
                "passed": self.passed, "mistake": self.mistake}


@dataclass
class Learner:
    id: int
    name: str
    joined: float
    cells: dict[str, Cell] = field(default_factory=dict)
    last: dict | None = None         # the latest report: at, notebook, item, outcome
    last_check: dict | None = None   # the latest exercise check's report, the same keys
    timeouts: int = 0
    reports: int = 0

    def as_json(self) -> dict:
        return {"id": self.id, "name": self.name, "joined": self.joined, "last": self.last,
                "last_check": self.last_check, "timeouts": self.timeouts, "reports": self.reports,
                "cells": {k: c.as_json() for k, c in self.cells.items()}}


class Store:
    """The workshop's state: SQLite on disk (the truth) and a summary in memory (what
    the dashboard shows), rebuilt from the database at start.

    Thread-safe: one lock around the connection. Writes commit before they return, in
    WAL mode, so an accepted report survives the server process being killed.
    """

    def __init__(self, folder: pathlib.Path, catalog: Catalog):
        folder.mkdir(parents=True, exist_ok=True)
        self.catalog = catalog
        self.path = folder / DB_NAME
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self.join_code = self._meta("join_code", lambda: "".join(
            secrets.choice(CODE_ALPHABET) for _ in range(8)))
        self.token = self._meta("instructor_token", lambda: secrets.token_urlsafe(24))
        self.learners: dict[int, Learner] = {}
        self.unlocked: dict[str, float] = {}
        self.accepted = 0
        self.version = 0
        self._load()

    def _meta(self, key: str, make) -> str:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        if row:
            return row[0]
        value = make()
        self._db.execute("INSERT INTO meta VALUES (?, ?)", (key, value))
        return value

    def _load(self) -> None:
        for lid, name, joined in self._db.execute("SELECT id, name, joined FROM learners"):
            self.learners[lid] = Learner(lid, name, joined)
        for row in self._db.execute("SELECT learner, notebook, item, outcome, mistake, "
                                    "received FROM reports ORDER BY id"):
            self._apply(*row)
        self.unlocked = dict(self._db.execute("SELECT solution, at FROM unlocked"))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- learners -----------------------------------------------------------------
    def join(self, name: str, secret: str | None) -> tuple[Learner, str]:
        """Add a learner, or let one back in with the secret they were given.

        Raises:
            BadRequest: 409 when the name is taken and ``secret`` is not its secret.
        """
        key = name.casefold()
        with self._lock:
            row = self._db.execute("SELECT id, secret_hash FROM learners WHERE name_key=?",
                                   (key,)).fetchone()
            if row:
                if isinstance(secret, str) and secrets.compare_digest(row[1], _hash(secret)):
                    return self.learners[row[0]], secret
                raise BadRequest(409, f"the name {name!r} is taken in this workshop: "
                                      f"choose another (add an initial, for example)")
            secret = secrets.token_urlsafe(24)
            now = time.time()
            cur = self._db.execute("INSERT INTO learners (name, name_key, secret_hash, joined) "
                                   "VALUES (?, ?, ?, ?)", (name, key, _hash(secret), now))
            learner = Learner(cur.lastrowid, name, now)
            self.learners[learner.id] = learner
            self.version += 1
            return learner, secret

    def learner_for(self, secret: str) -> Learner | None:
        with self._lock:
            row = self._db.execute("SELECT id FROM learners WHERE secret_hash=?",
                                   (_hash(secret),)).fetchone()
        return self.learners.get(row[0]) if row else None

    # --- reports ------------------------------------------------------------------
    def add_report(self, learner: Learner, report: dict) -> bool:
        """Store one validated report (see :func:`check_report`); ``False`` when the
        same report id was already stored (a retry), which changes nothing."""
        now = time.time()
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO reports (learner, report_id, notebook, item, outcome, "
                "mistake, client_time, received) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (learner.id, report["id"], report["notebook"], report["item"],
                 report["outcome"], report["mistake"], report["time"], now))
            if cur.rowcount == 0:
                return False
            self._apply(learner.id, report["notebook"], report["item"], report["outcome"],
                        report["mistake"], now)
            self.version += 1
            return True

    def _apply(self, lid, notebook, item, outcome, mistake, at) -> None:
        learner = self.learners[lid]
        learner.reports += 1
        self.accepted += 1
        learner.last = {"at": at, "notebook": notebook, "item": item, "outcome": outcome}
        if outcome == "timeout":
            learner.timeouts += 1
            return
        found = self.catalog.find(notebook, item)
        if found is None:
            return
        learner.last["kind"] = found.kind
        learner.last["notebook"] = found.notebook
        if found.kind == "exercise":
            learner.last_check = dict(learner.last)
        cell = learner.cells.setdefault(f"{found.notebook}:{found.key}", Cell())
        cell.last = at
        if outcome == "passed":
            cell.passed = cell.passed or at
        elif outcome == "failed":
            cell.tries += 1
            cell.since = cell.since or at
            cell.mistake = mistake
        else:
            cell.seen = True

    # --- solutions ----------------------------------------------------------------
    def set_unlocked(self, solution: str, open_: bool) -> None:
        with self._lock:
            if open_:
                at = time.time()
                self._db.execute("INSERT OR IGNORE INTO unlocked VALUES (?, ?)", (solution, at))
                self.unlocked.setdefault(solution, at)
            else:
                self._db.execute("DELETE FROM unlocked WHERE solution=?", (solution,))
                self.unlocked.pop(solution, None)
            self.version += 1

    def snapshot(self) -> dict:
        """What the dashboard and ``GET /api/progress`` show (see :func:`create_app`)."""
        with self._lock:
            return {"now": time.time(), "accepted": self.accepted,
                    "catalog": self.catalog.as_json(), "unlocked": sorted(self.unlocked),
                    "learners": [l.as_json() for l in sorted(
                        self.learners.values(), key=lambda l: l.name.casefold())]}


def check_report(body) -> dict:
    """A learner's report, validated: ``{"id": str, "notebook": "NN" | None, "item": str,
    "outcome": one of OUTCOMES, "mistake": str | None, "time": float}``. Raises
    :class:`BadRequest` (422) naming the first bad field and what it must be."""
    if not isinstance(body, dict):
        raise BadRequest(422, "a report is a JSON object with id, notebook, item, outcome, "
                              "mistake and time")
    allowed = {"id", "notebook", "item", "outcome", "mistake", "time"}
    extra = sorted(set(body) - allowed)
    if extra:
        raise BadRequest(422, f"unknown field(s) {', '.join(extra)}: a report has only "
                              f"{', '.join(sorted(allowed))}")
    rid = body.get("id")
    if not isinstance(rid, str) or not re.fullmatch(r"[A-Za-z0-9_-]{8,64}", rid):
        raise BadRequest(422, "id must be 8 to 64 letters, digits, - or _ (a random id "
                              "per report, so a retry is not counted twice)")
    notebook = body.get("notebook")
    if notebook is not None and (not isinstance(notebook, str)
                                 or not re.fullmatch(r"\d\d", notebook)):
        raise BadRequest(422, "notebook must be a two-digit number such as \"05\", or null")
    item = body.get("item")
    if not isinstance(item, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", item):
        raise BadRequest(422, "item must be a check's name (check_...), a question's "
                              "answer_K, or \"timeout\"")
    outcome = body.get("outcome")
    if outcome not in OUTCOMES:
        raise BadRequest(422, f"outcome must be one of {', '.join(OUTCOMES)}")
    mistake = body.get("mistake")
    if mistake is not None and (not isinstance(mistake, str) or len(mistake) > 120):
        raise BadRequest(422, "mistake must be a short text (at most 120 characters) or null")
    t = body.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise BadRequest(422, "time must be seconds since the epoch (a number)")
    return {"id": rid, "notebook": notebook, "item": item, "outcome": outcome,
            "mistake": mistake, "time": float(t)}


class Bucket:
    """A token bucket: ``rate`` tokens a second, at most ``burst``."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, time.monotonic()

    def take(self) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there is."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate

    def refund(self) -> None:
        self.tokens = min(self.burst, self.tokens + 1)


def create_app(data: pathlib.Path, notebooks: pathlib.Path | None = None):
    """The Starlette application, with its :class:`Store` in ``data``.

    Args:
        data: the folder holding ``workshop.sqlite3`` (created if missing).
        notebooks: the notebooks whose questions and exercises make the dashboard's
            columns, with their ``solutions/``; default: the installed ones
            (:func:`reducelab.cli.shipped_notebooks`).

    Returns:
        A Starlette app; ``app.state.store`` is its :class:`Store`.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import (HTMLResponse, JSONResponse, PlainTextResponse, Response,
                                     StreamingResponse)
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    if notebooks is None:
        from ..cli import shipped_notebooks
        notebooks = shipped_notebooks()
    store = Store(pathlib.Path(data), read_catalog(pathlib.Path(notebooks)))
    static = pathlib.Path(__file__).resolve().parent / "static"
    report_buckets: dict[int, Bucket] = {}
    join_failures: dict[str, Bucket] = {}
    changed = {"event": None}  # an asyncio.Event, made in the server's loop

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def notify() -> None:
        event = changed["event"]
        if event is not None:
            event.set()

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            raise BadRequest(413, f"the body is over {MAX_BODY} bytes; a report is about 200")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                raise BadRequest(413, f"the body is over {MAX_BODY} bytes; a report is about 200")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest(422, "the body is not JSON") from None

    def bearer(request: Request, query: bool = False) -> str | None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return request.query_params.get("token") if query else None

    def instructor(request: Request, query: bool = False) -> None:
        token = bearer(request, query)
        if not token:
            raise BadRequest(401, "this needs the instructor's token: open the dashboard "
                                  "address that `reducelab workshop serve` printed")
        if not secrets.compare_digest(token.encode(), store.token.encode()):
            raise BadRequest(403, "wrong token: only the instructor's token opens the "
                                  "dashboard and its API")

    def learner(request: Request) -> Learner:
        secret = bearer(request)
        if not secret:
            raise BadRequest(401, "join the workshop first: reducelab.workshop.join(address, "
                                  "name=...)")
        found = store.learner_for(secret)
        if found is None:
            raise BadRequest(403, "unknown learner secret: join the workshop again")
        return found

    def handle(endpoint):
        async def wrapped(request: Request):
            try:
                return await endpoint(request)
            except BadRequest as e:
                return error(e.status, e.message, e.headers)
        return wrapped

    def client_address(request: Request) -> str:
        return request.client.host if request.client else "?"

    async def index(request: Request):
        return PlainTextResponse("Reduce Lab workshop server. Learners: join with the address "
                                 "your instructor gave you; the instructor's dashboard is at "
                                 "the address `reducelab workshop serve` printed.\n")

    def check_code(request: Request) -> None:
        address = client_address(request)
        code = request.path_params["code"]
        if secrets.compare_digest(code.upper().encode(), store.join_code.encode()):
            return
        bucket = join_failures.setdefault(address, Bucket(1 / 6, JOIN_FAILURES))
        wait = bucket.take()
        if wait:
            raise BadRequest(429, f"too many wrong join codes from this address: wait "
                                  f"{math.ceil(wait)} s", {"Retry-After": str(math.ceil(wait))})
        raise BadRequest(404, "wrong join code: copy the join address your instructor gave "
                              "you, exactly")

    async def join_page(request: Request):
        check_code(request)
        import html
        address = html.escape(str(request.url))
        return HTMLResponse(
            f"<!doctype html><meta charset=utf-8><title>Join the Reduce Lab workshop</title>"
            f"<h1>Join the Reduce Lab workshop</h1><p>In a notebook, run:</p>"
            f"<pre>import reducelab.workshop\nreducelab.workshop.join(\"{address}\", "
            f"name=\"your name\")</pre><p>or start JupyterLab with "
            f"<code>reducelab lab --workshop {address} --name \"your name\"</code>.</p>",
            headers={"Referrer-Policy": "no-referrer"})

    async def join(request: Request):
        check_code(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest(422, "send {\"name\": \"your name\"}")
        name = check_name(body.get("name"))
        who, secret = store.join(name, body.get("secret"))
        notify()
        return JSONResponse({"learner": who.id, "name": who.name, "secret": secret})

    async def report(request: Request):
        who = learner(request)
        bucket = report_buckets.setdefault(who.id, Bucket(REPORT_RATE, REPORT_BURST))
        wait = bucket.take()
        if wait:
            raise BadRequest(429, f"too many reports: at most {REPORT_RATE:g} a second from "
                                  f"one learner; send again in {wait:.1f} s",
                             {"Retry-After": str(math.ceil(wait))})
        try:
            item = check_report(await read_json(request))
        except BadRequest:
            bucket.refund()
            raise
        if item["outcome"] != "timeout" and store.catalog.find(item["notebook"], item["item"]) is None:
            raise BadRequest(422, f"no question or exercise {item['item']!r} in notebook "
                                  f"{item['notebook']}: the dashboard has no column for it")
        new = store.add_report(who, item)
        if new:
            notify()
        return JSONResponse({"accepted": True, "new": new})

    async def solution(request: Request):
        learner(request)
        filename = request.path_params["filename"]
        item = store.catalog.solution(filename)
        if item is None:
            raise BadRequest(404, f"there is no solution named {filename!r}")
        if filename not in store.unlocked:
            raise BadRequest(403, f"The solution to the {item.label} exercise is not open yet: "
                                  f"your instructor opens it when the class is ready.")
        path = store.catalog.solutions_dir / filename
        return PlainTextResponse(path.read_text(encoding="utf-8"))

    async def dashboard(request: Request):
        instructor(request, query=True)
        return HTMLResponse((static / "dashboard.html").read_text(encoding="utf-8"),
                            headers=PAGE_HEADERS)

    async def progress(request: Request):
        instructor(request, query=True)
        return JSONResponse(store.snapshot())

    async def unlock(request: Request):
        instructor(request)
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("open"), bool):
            raise BadRequest(422, "send {\"solution\": \"NN_name.py\", \"open\": true or false}")
        filename = body.get("solution")
        if not isinstance(filename, str) or store.catalog.solution(filename) is None:
            names = ", ".join(i.solution for i in store.catalog.items if i.solution)
            raise BadRequest(422, f"solution must be one of: {names}")
        store.set_unlocked(filename, body["open"])
        notify()
        return JSONResponse({"solution": filename, "open": body["open"]})

    async def events(request: Request):
        instructor(request, query=True)
        if changed["event"] is None:
            changed["event"] = asyncio.Event()

        async def stream():
            sent = -1
            while not await request.is_disconnected():
                if store.version != sent:
                    sent = store.version
                    yield f"event: progress\ndata: {json.dumps(store.snapshot())}\n\n"
                    await asyncio.sleep(0.5)  # a burst of reports becomes one update
                    continue
                event = changed["event"]
                event.clear()
                if store.version != sent:
                    continue
                try:
                    await asyncio.wait_for(event.wait(), timeout=15)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", **PAGE_HEADERS})

    routes = [Route("/", index),
              Route("/join/{code}", handle(join_page), methods=["GET"]),
              Route("/join/{code}", handle(join), methods=["POST"]),
              Route("/api/report", handle(report), methods=["POST"]),
              Route("/api/solutions/{filename}", handle(solution)),
              Route("/dashboard", handle(dashboard)),
              Route("/api/progress", handle(progress)),
              Route("/api/events", handle(events)),
              Route("/api/unlock", handle(unlock), methods=["POST"]),
              Mount("/static", StaticFiles(directory=static), name="static")]
    app = Starlette(routes=routes)
    app.state.store = store
    return app


PAGE_HEADERS = {
    # The page runs only its own script, sends no Referer (its address holds the token),
    # and cannot be framed.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


def addresses(store: Store, host: str, port: int) -> tuple[str, str]:
    """The join address (for learners) and the dashboard address (for the instructor,
    with the token), for a server listening on ``host:port``. A wildcard host
    (``0.0.0.0``, ``::``) is replaced by this machine's address on its network."""
    shown = host
    if host in ("0.0.0.0", "::", ""):
        import socket
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing interface
                shown = s.getsockname()[0]
        except OSError:
            shown = socket.gethostname()
    if ":" in shown:
        shown = f"[{shown}]"
    base = f"http://{shown}:{port}"
    return f"{base}/join/{store.join_code}", f"{base}/dashboard?token={store.token}"


def serve(host: str = "127.0.0.1", port: int = 8765, data: str | pathlib.Path = "reducelab-workshop",
          notebooks: pathlib.Path | None = None, announce=print) -> None:
    """Run the workshop server until interrupted (Ctrl-C).

    Binds ``host:port`` first (``port`` 0 picks a free one), then ``announce``\\ s the
    join address and the dashboard address, then serves.

    Raises:
        OSError: the address cannot be bound (the port is in use, say).
    """
    import socket

    import uvicorn

    app = create_app(pathlib.Path(data), notebooks)
    store: Store = app.state.store
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; pass another "
                      f"--port") from None
    sock.listen(128)
    port = sock.getsockname()[1]
    join, board = addresses(store, host, port)
    n = len(store.learners)
    announce(f"Reduce Lab workshop server, state in {pathlib.Path(data).resolve() / DB_NAME} "
             f"({n} learner{'s' if n != 1 else ''} so far).")
    announce(f"Join address, for the learners:   {join}")
    announce(f"Dashboard, for you alone (it holds your token): {board}")
    announce("Stop with Ctrl-C; start it again with the same --data and nothing is lost.")
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1,
                            access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        store.close()
