"""A real workshop server for the tests: ``reducelab workshop serve`` in a subprocess on
loopback, with its state in a temporary folder, and a small HTTP helper."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass
class Server:
    proc: subprocess.Popen
    data: pathlib.Path
    base: str
    join: str
    dashboard: str
    token: str
    code: str
    port: int

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(data: pathlib.Path, port: int = 0, timeout: float = 30.0) -> Server:
    """Start ``reducelab workshop serve --host 127.0.0.1 --port PORT --data DATA`` and
    wait for the addresses it prints."""
    proc = subprocess.Popen([sys.executable, "-m", "reducelab", "workshop", "serve",
                             "--host", "127.0.0.1", "--port", str(port), "--data", str(data)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("Dashboard"):
            break
    text = "".join(lines)
    join = re.search(r"(http://127\.0\.0\.1:(\d+))/join/(\w+)", text)
    board = re.search(r"http://\S+/dashboard\?token=(\S+)", text)
    if not (join and board):
        proc.kill()
        raise RuntimeError(f"the server did not start:\n{text}")
    server = Server(proc, data, join.group(1), join.group(0), board.group(0), board.group(1),
                    join.group(3), int(join.group(2)))
    # drain its output so that it never blocks on a full pipe
    import threading
    threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
    wait_up(server.base)
    return server


def wait_up(base: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(base + "/", timeout=1).read()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{base} did not answer within {timeout} s")


def call(method: str, url: str, body=None, token: str | None = None, raw: bytes | None = None,
         headers: dict | None = None, timeout: float = 10.0):
    """``(status, JSON or text, headers)`` of one request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = dict(headers or {})
    if data is not None:
        h.setdefault("Content-Type", "application/json")
    if token:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, payload, hdrs = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, payload, hdrs = e.code, e.read(), e.headers
    try:
        return status, json.loads(payload), hdrs
    except ValueError:
        return status, payload.decode(errors="replace"), hdrs


def report(item="check_mesh_sync", outcome="failed", notebook="05", mistake=None, rid=None):
    """A well-formed report."""
    import secrets
    return {"id": rid or secrets.token_urlsafe(12), "notebook": notebook, "item": item,
            "outcome": outcome, "mistake": mistake, "time": time.time()}
