"""Run importable rank functions under real ``torchrun``, from a notebook cell.

Introduced in notebook 07 ("From notebook to cluster"). :func:`run_torchrun` writes a
tiny launcher script (:func:`launcher_source`) to a private (0700) temporary directory
and starts ``python -m torch.distributed.run`` on it as a subprocess, with the
interpreter of the kernel (``sys.executable``), so the venv's torch is the one used.
Each rank joins the default process group with ``init_process_group("gloo")`` (the
``env://`` init method: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
come from the environment torchrun sets), calls the functions by module and name, and
prints one marker line per function with its return value as JSON. The kernel parses
those lines back into Python values, by global rank.

Every wait is bounded: the whole launch by ``timeout`` seconds (then the launcher's
process group is killed), and each collective on the ranks by the process group's
``timeout``. Volatile text (ports, run ids, temporary paths, process ids) is replaced
by placeholders before anything is returned, so notebook outputs stay deterministic.

What it exposes on the network, measured on torch 2.13 (see notebook 07): gloo is
pinned to the loopback interface with ``GLOO_SOCKET_IFNAME``, but the rendezvous
``TCPStore`` that the torchrun agent hosts listens on the wildcard address ``::``
(all interfaces, IPv4 too on a dual-stack host) whatever host name it is given, on a
random port. It is still listening after every rank has joined, and at the end of the
ranks' work, after their last collective: the ranks' own ``init_process_group``
connects to it (``TORCHELASTIC_USE_AGENT_STORE=True``). It is unauthenticated.

Sources: torchrun, https://pytorch.org/docs/stable/elastic/run.html; environment
variable initialization and ``TCPStore``,
https://pytorch.org/docs/stable/distributed.html#environment-variable-initialization
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field

from .group import loopback_interface

MARKER = "@@reducelab-result "
"""Prefix of the lines on which a rank reports a function's return value (JSON)."""

MAX_NPROC_PER_NODE = 8
MAX_NNODES = 4

TORCHRUN_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                     "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                     "OMP_NUM_THREADS")
"""The environment variables torchrun sets on each rank that notebook 07 shows (set in
``LocalElasticAgent._start_workers``, ``torch/distributed/elastic/agent/server/
local_elastic_agent.py``)."""

_LAUNCHER = '''\
"""What torchrun runs on every rank: join the process group, call the functions, report."""
import contextlib, importlib, io, json, os, sys
from datetime import timedelta

import torch
import torch.distributed as dist

MARKER = {marker!r}


def plain(x):
    """Tensors -> lists, tuples -> lists: what JSON can carry back to the kernel."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {{str(k): plain(v) for k, v in x.items()}}
    return x


def main(specs, timeout):
    # env:// init: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from torchrun.
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    try:
        for spec in specs:
            module, name = spec.split(":")
            fn = getattr(importlib.import_module(module), name)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                result = fn()
            line = json.dumps({{"rank": rank, "fn": spec, "result": plain(result),
                               "printed": out.getvalue()}})
            sys.stdout.flush()
            # one write() per record: the ranks share torchrun's stdout
            os.write(sys.stdout.fileno(), (MARKER + line + "\\n").encode())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), float(sys.argv[2]))
'''


class TorchrunError(RuntimeError):
    """torchrun failed, timed out, or a rank did not report a result.

    Raised in the kernel by :func:`run_torchrun`. ``str(err)`` is one headline plus the
    sanitized tail of torchrun's output.

    Attributes:
        headline: one sentence, e.g. ``"torchrun did not finish within 5 s; ..."``.
        log: torchrun's output (stdout and stderr), sanitized.
        returncode: torchrun's exit status, or ``None`` when it was killed on timeout.
    """

    def __init__(self, headline: str, log: str = "", returncode: int | None = None):
        self.headline = headline
        self.log = log
        self.returncode = returncode
        tail = "\n".join(log.strip().splitlines()[-15:])
        super().__init__(headline + (f"\n--- last lines of torchrun's output ---\n{tail}"
                                     if tail else ""))


@dataclass
class TorchrunResult:
    """What :func:`run_torchrun` brings back.

    Attributes:
        command: the command line of one node, for display (``python`` for the
            interpreter, ``<port>`` for a random port, ``<launcher>`` for the script).
        results: ``{"module:function": [value on rank 0, value on rank 1, ...]}``, in
            global rank order; values are what JSON carries (tensors become lists).
        printed: ``{"module:function": [text rank 0 printed, ...]}``, sanitized.
        world_size: number of ranks (``nnodes * nproc_per_node``).
        log: torchrun's own output (everything but the marker lines), sanitized.
    """

    command: list[str]
    results: dict[str, list]
    printed: dict[str, list[str]]
    world_size: int
    log: str = ""
    commands: list[list[str]] = field(default_factory=list)

    def __getitem__(self, fn) -> list:
        """``result[fn]`` (a function or ``"module:function"``): its values by rank."""
        return self.results[fn if isinstance(fn, str) else function_spec(fn)]

    def command_line(self) -> str:
        """The command as one shell line, e.g. ``python -m torch.distributed.run ...``."""
        return " ".join(self.command)


# --- sanitizing -----------------------------------------------------------------------
_VOLATILE = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<run id>"),
    (re.compile(r"(?:/private)?/(?:tmp|var/folders)/[\w./-]+"), "<tmp>"),
    (re.compile(r"\b(pid|PID|process)([ =:]+)\d+"), r"\1\2<pid>"),
    (re.compile(r"\b(localhost|\d+\.\d+\.\d+\.\d+|[A-Za-z][\w-]*(?:\.[\w-]+)+):\d{2,5}\b"),
     r"\1:<port>"),
    (re.compile(r"(\[[0-9a-fA-F:]*\]):\d{2,5}\b"), r"\1:<port>"),
    (re.compile(r"(MASTER_PORT['\"]?[=:, ]+['\"]?)\d+"), r"\1<port>"),
    (re.compile(r"\d+\.\d+ ?(?:s|ms|seconds)\b"), "<time>"),
]


def sanitize(text: str) -> str:
    """Replace volatile parts of torchrun output with placeholders.

    Ports become ``<port>``, run ids (UUIDs) ``<run id>``, temporary paths ``<tmp>``,
    process ids ``<pid>`` and durations ``<time>``. ``text`` is a ``str``; returns a
    ``str``. Used on everything :func:`run_torchrun` returns.
    """
    if not isinstance(text, str):
        raise TypeError(f"sanitize() needs a str, got {type(text).__name__}")
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text


def root_cause(log: str) -> str:
    """torchrun's "Root Cause (first observed failure)" block from its output ``log``
    (``str``, as :attr:`TorchrunError.log` or a ``subprocess`` run's stderr keeps it), in
    torchrun's words: the rank that failed first, its exit code, and the traceback its
    entry point left when decorated with ``@record``
    (``torch.distributed.elastic.multiprocessing.errors``). Dropped, since they differ
    from machine to machine and run to run: the ``time``, ``host`` and ``error_file``
    lines and the traceback's frames inside torch; paths keep their file name only; the
    rest goes through :func:`sanitize`. Returns ``""`` when ``log`` holds no such block
    (the launch did not fail). Source: ``ChildFailedError.format_msg`` in
    ``torch/distributed/elastic/multiprocessing/errors/__init__.py``.
    """
    if not isinstance(log, str):
        raise TypeError(f"root_cause() needs a str, got {type(log).__name__}")
    start = log.find("Root Cause (first observed failure):")
    if start < 0:
        return ""
    lines, skip_code = [], False
    for line in log[start:].splitlines():
        if line.startswith("====="):
            break
        field_name = line.strip().split(":", 1)[0].strip()
        if field_name in ("time", "host", "error_file"):
            continue
        frame = re.match(r'(\s*)File "([^"]+)", (line \d+, in .*)', line)
        if frame:
            skip_code = f"{os.sep}torch{os.sep}" in frame.group(2)
            if not skip_code:
                lines.append(f'{frame.group(1)}File "{os.path.basename(frame.group(2))}", '
                             f"{frame.group(3)}")
            continue
        if skip_code and line.startswith("      "):   # a dropped frame's code and carets
            continue
        skip_code = False
        lines.append(line.rstrip())
    return sanitize("\n".join(lines).rstrip())


def sanitize_env(env: dict) -> dict:
    """A copy of a rank's environment dict with volatile values replaced.

    ``MASTER_PORT`` -> ``"<port>"`` (torchrun ``--standalone`` picks a free port),
    ``TORCHELASTIC_RUN_ID`` -> ``"<run id>"`` (a fresh UUID per launch), and
    ``MASTER_ADDR`` -> ``"<fqdn>"`` where it is this machine's name as
    ``socket.getfqdn()`` gives it, which ``--standalone`` uses (the node's address,
    ``local_addr or socket.getfqdn()`` in
    ``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``) and which differs
    from machine to machine; another address, such as the ``127.0.0.1`` of a static
    rendezvous, is kept. Other values go through :func:`sanitize`. Values that are not
    ``str`` (``None`` for a variable that is not set, ints) are kept as they are.
    """
    out = {}
    for k, v in env.items():
        if not isinstance(v, str):
            out[k] = v
        elif k == "MASTER_PORT":
            out[k] = "<port>"
        elif k == "MASTER_ADDR" and v == socket.getfqdn():
            out[k] = "<fqdn>"
        elif k == "TORCHELASTIC_RUN_ID":
            out[k] = "<run id>"
        else:
            out[k] = sanitize(v)
    return out


# --- launching ------------------------------------------------------------------------
def function_spec(fn) -> str:
    """``"module:function"`` for a module-level function that a fresh process can import.

    torchrun starts new Python processes; they find a function by importing its module
    and looking up its name, as a training script does. A function defined in a
    notebook cell (module ``__main__``), a lambda, a closure or a method cannot be found
    that way.

    Raises:
        TypeError: ``fn`` is not a plain function, or a fresh process could not import
            it; the message says how to make it importable.
    """
    if isinstance(fn, str):
        module, _, name = fn.partition(":")
        if not module or not name:
            raise TypeError(f"a function spec is 'module:function', got {fn!r}")
        fn = getattr(importlib.import_module(module), name, None)
        if fn is None:
            raise TypeError(f"module {module!r} has no function {name!r}")
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"run_torchrun() needs plain functions, got {fn!r} "
                        f"({type(fn).__name__})")
    module, name = fn.__module__, fn.__qualname__
    why = None
    if module in (None, "__main__") or module.startswith("__"):
        why = (f"it is defined in a notebook cell or script (module {module!r}); "
               f"torchrun's fresh processes cannot import it")
    elif "<" in name or "." in name:
        why = f"{name!r} is a lambda, a nested function or a method, not a module-level name"
    else:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except Exception as e:  # noqa: BLE001 - report any import failure the same way
            found, why = None, f"importing {module!r} fails: {type(e).__name__}: {e}"
        if why is None and found is not fn:
            why = f"{module}.{name} is not this function"
    if why:
        raise TypeError(f"cannot run {getattr(fn, '__name__', fn)!r} under torchrun: {why}. "
                        f"Put it at the top level of a .py file on the Python path (as in "
                        f"reducelab/lessons.py) and import it from there.")
    return f"{module}:{name}"


def launcher_source() -> str:
    """The launcher script torchrun runs on every rank, as Python source text.

    It is what a minimal training script looks like: ``init_process_group("gloo")``
    with the ``env://`` defaults, then ordinary ``torch.distributed`` code, then
    ``destroy_process_group()``.
    """
    return _LAUNCHER.format(marker=MARKER)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for a simulated head node)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _validate(nproc_per_node, nnodes, timeout) -> None:
    for name, value, top in (("nproc_per_node", nproc_per_node, MAX_NPROC_PER_NODE),
                             ("nnodes", nnodes, MAX_NNODES)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int from 1 to {top}, got {value!r}")
        if not 1 <= value <= top:
            raise ValueError(f"{name} must be from 1 to {top}, got {value}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")


def torchrun_command(script: str, specs: list[str], *, nproc_per_node: int, nnodes: int = 1,
                     node_rank: int = 0, master_port: int | None = None,
                     collective_timeout: float = 30.0) -> list[str]:
    """The argv of one torchrun launch (one "node").

    ``nnodes == 1``: ``--standalone`` (a c10d rendezvous on a free local port).
    ``nnodes > 1``: static rendezvous, ``--nnodes N --node-rank K --master-addr
    127.0.0.1 --master-port P``: every node runs on this machine, so it is a simulation
    of a cluster, with the same environment variables a real one gives the ranks.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    cmd += ["--nproc-per-node", str(nproc_per_node), "--max-restarts", "0",
            script, json.dumps(specs), f"{collective_timeout:g}"]
    return cmd


def _display(cmd: list[str], script: str) -> list[str]:
    shown = ["python" if c == sys.executable else "<launcher>.py" if c == script else c
             for c in cmd]
    if "--master-port" in shown:
        shown[shown.index("--master-port") + 1] = "<port>"
    return shown


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill each launcher's process group (torchrun and its ranks), then reap."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session we created for it
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_torchrun(*fns, nproc_per_node: int = 2, nnodes: int = 1, timeout: float = 120.0,
                 collective_timeout: float = 30.0) -> TorchrunResult:
    """Run importable rank functions under real torchrun and return their values by rank.

    Example (notebook 07)::

        from reducelab.lessons import all_reduce_lesson
        out = run_torchrun(all_reduce_lesson, nproc_per_node=2)
        out[all_reduce_lesson]       # == group.run(all_reduce_lesson) on a 2-rank LocalGroup

    Args:
        *fns: one or more module-level functions (or ``"module:function"`` strings)
            taking no arguments; each runs on every rank inside the default process
            group, in order, in one launch (torchrun's start-up costs seconds).
        nproc_per_node: ranks per node, ``int`` 1 to 8 (torchrun ``--nproc-per-node``).
        nnodes: ``1`` uses ``--standalone``; ``2`` to ``4`` start that many torchrun
            agents on this machine with a static rendezvous on 127.0.0.1, one per
            simulated node (``--nnodes``, ``--node-rank``, ``--master-addr/-port``).
        timeout: seconds the whole launch may take; then every process it started is
            killed and :class:`TorchrunError` is raised.
        collective_timeout: seconds, the process group's timeout on the ranks.

    Returns:
        :class:`TorchrunResult`; ``result[fn]`` is a list of length
        ``nnodes * nproc_per_node``, the value of ``fn`` on each global rank.

    Raises:
        TypeError: a function a fresh process cannot import (see :func:`function_spec`),
            or a bad argument type.
        ValueError: ``nproc_per_node``, ``nnodes`` or ``timeout`` out of range.
        TorchrunError: torchrun exited with an error, timed out, or a rank did not report.

    The ranks get ``GLOO_SOCKET_IFNAME`` = the loopback interface, ``OMP_NUM_THREADS=1``
    and ``PYTHONPATH`` that starts with the kernel's working directory.
    """
    if not fns:
        raise TypeError("run_torchrun() needs at least one function to run on the ranks")
    specs = [function_spec(f) for f in fns]
    _validate(nproc_per_node, nnodes, timeout)
    world_size = nproc_per_node * nnodes
    tmpdir = tempfile.mkdtemp(prefix="reducelab-torchrun-")  # mode 0700
    procs: list[subprocess.Popen] = []
    try:
        script = os.path.join(tmpdir, "launch_lessons.py")
        with open(script, "w") as f:
            f.write(launcher_source())
        env = dict(os.environ)
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        for k in [k for k in env if k.startswith("PET_")]:
            del env[k]  # torchrun reads PET_* as defaults for its options
        port = free_port() if nnodes > 1 else None
        cmds = [torchrun_command(script, specs, nproc_per_node=nproc_per_node, nnodes=nnodes,
                                 node_rank=k, master_port=port,
                                 collective_timeout=collective_timeout)
                for k in range(nnodes)]
        logs = []
        for k, cmd in enumerate(cmds):
            logs.append(open(os.path.join(tmpdir, f"node{k}.log"), "w+"))
            procs.append(subprocess.Popen(cmd, cwd=tmpdir, env=env, stdin=subprocess.DEVNULL,
                                          stdout=logs[-1], stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        timed_out = any(p.poll() is None for p in procs)
        if timed_out:
            _kill(procs)
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read())
            f.close()
        results, printed, log = _parse(texts, specs, world_size)
        if timed_out:
            raise TorchrunError(f"torchrun did not finish within {timeout:g} s; its processes "
                                f"were killed", log)
        codes = [p.returncode for p in procs]
        if any(codes):
            raise TorchrunError(f"torchrun exited with code {max(codes, key=abs)}", log,
                                max(codes, key=abs))
        missing = [(s, r) for s in specs for r in range(world_size) if r not in results[s]]
        if missing:
            raise TorchrunError(f"rank {missing[0][1]} did not report a result for "
                                f"{missing[0][0]}", log, 0)
        return TorchrunResult(
            command=_display(cmds[0], script),
            results={s: [results[s][r] for r in range(world_size)] for s in specs},
            printed={s: [printed[s].get(r, "") for r in range(world_size)] for s in specs},
            world_size=world_size, log=log, commands=[_display(c, script) for c in cmds])
    finally:
        _kill(procs)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _parse(texts: list[str], specs: list[str], world_size: int):
    """Split torchrun's output into result records (by spec and rank) and the rest."""
    results: dict[str, dict[int, object]] = {s: {} for s in specs}
    printed: dict[str, dict[int, str]] = {s: {} for s in specs}
    other = []
    decoder = json.JSONDecoder()
    for text in texts:
        chunks = text.split(MARKER)
        other.append(chunks[0])
        for chunk in chunks[1:]:  # each starts with one JSON record, whatever follows it
            try:
                rec, end = decoder.raw_decode(chunk)
                results[rec["fn"]][rec["rank"]] = rec["result"]
                printed[rec["fn"]][rec["rank"]] = sanitize(rec["printed"])
                other.append(chunk[end:])
            except (ValueError, KeyError, TypeError):
                other.append(MARKER + chunk)
    log = "\n".join(line for line in "".join(other).splitlines() if line.strip())
    return results, printed, sanitize(log)
