"""Move an explorer's controls as a browser does, in a real kernel, and time each move.

Shared by ``bench.py`` (every notebook's explorer, one learner) and ``workshop.py`` (a
class of learners at once). A kernel is started in ``notebooks/`` and runs a notebook's
code cells up to the one that makes ``explorer`` (``%%ranks`` cells only print, so they
are skipped). Then, for each move, this process sends the kernel the comm message
JupyterLab sends when a learner changes a control (``{"method": "update", "state":
{...}}`` to the control's model), and waits for the figure of the new value: the kernel
reports each finished refresh on a comm of its own. The wait of a move runs from
sending the change to that report: what a learner waits, less the browser's drawing.

Nothing here asserts a time.
"""
from __future__ import annotations

import json
import pathlib
import threading
import time

import nbformat
import psutil
from jupyter_client.manager import start_new_kernel

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"

PROBE = r'''
import json as _json
import ipywidgets as _W
from comm import create_comm as _create_comm

_bench = _create_comm(target_name="reducelab-bench")

def _jsonable(v):
    return v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)

def _world_size():
    return getattr(explorer.group, "world_size", None)

_refresh = explorer.refresh
def _reported_refresh():
    _refresh()
    _bench.send({"refreshes": getattr(explorer, "refreshes", None), "seconds": explorer.seconds,
                 "world_size": _world_size(),
                 "values": {k: _jsonable(v) for k, v in explorer.values.items()}})
explorer.refresh = _reported_refresh

_show_interim = explorer.show_interim
def _reported_interim(partial, note):
    _show_interim(partial, note)
    _bench.send({"interim": True, "seconds": None,
                 "values": {k: _jsonable(v) for k, v in explorer.values.items()}})
explorer.show_interim = _reported_interim

def _moves(w):
    """(state to send, value it means) for each option of control w, in order."""
    if isinstance(w, (_W.Dropdown, _W.ToggleButtons, _W.SelectionSlider, _W.RadioButtons)):
        return [({"index": i}, _jsonable(v)) for i, v in enumerate(w._options_values)]
    if isinstance(w, (_W.IntSlider, _W.FloatSlider)):
        step = w.step or 1
        vals = [w.min + k * step for k in range(int(round((w.max - w.min) / step)) + 1)]
        return [({"value": v}, _jsonable(v)) for v in vals]
    if isinstance(w, _W.Checkbox):
        return [({"value": v}, v) for v in (not w.value, w.value)]
    if isinstance(w, _W.Text):
        return [({"value": v}, v) for v in TEXT_VALUES.get(w.description, [w.value])]
    return []

print("CONTROLS " + _json.dumps({
    "bench_comm": _bench.comm_id, "world_size": _world_size(),
    "controls": {name: {"model_id": w.model_id, "value": _jsonable(w.value),
                        "slider": isinstance(w, (_W.IntSlider, _W.FloatSlider, _W.SelectionSlider)),
                        "moves": _moves(w)}
                 for name, w in explorer.controls.items()}}))
'''
TEXT_VALUES = {"local batch sizes": ["2,6,4", "1,1,1,1", "8,8", "3,5,8,2"]}
"""Values typed into text boxes, by the box's description."""


class CpuMeter:
    """CPU seconds (user + system) spent by a process and every descendant it has while
    the meter runs: the kernel, its forkserver, ranks, spares and reaper. A thread reads
    each process's times every ``interval`` seconds and keeps the last reading of a
    process that has exited (a rank stopped by a resize), so only what such a process
    spent in its last ``interval`` is missed. Other processes on the machine do not count.
    Use as a context manager; :attr:`seconds` is the total once it exits."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.root, self.interval = psutil.Process(pid), interval
        self.start: dict = {}      # (pid, create_time) -> CPU s spent before the meter started
        self.last: dict = {}       # (pid, create_time) -> CPU s at its latest reading
        self.seconds = 0.0
        self._stop = threading.Event()

    def _read(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                key, t = (p.pid, p.create_time()), p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            self.last[key] = t.user + t.system

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._read()

    def __enter__(self) -> "CpuMeter":
        self._read()
        self.start = dict(self.last)   # a process born later started from 0
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._read()
        self.seconds = sum(t - self.start.get(k, 0.0) for k, t in self.last.items())


class Learner:
    """One kernel running one notebook up to its explorer, driven like a browser."""

    def __init__(self, notebook: str, env: dict | None = None):
        path = next(NOTEBOOKS.glob(f"{notebook}*.ipynb"))
        self.name = path.stem
        nb = nbformat.read(path, as_version=4)
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        upto = next(i for i, c in enumerate(code) if "explorer = " in c)
        self.cells = [c for c in code[:upto + 1] if not c.lstrip().startswith("%%ranks")]
        kw = {"env": env} if env is not None else {}
        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=str(NOTEBOOKS), **kw)
        self.controls: dict = {}
        self.bench_comm = None

    def cpu_meter(self) -> CpuMeter:
        """A :class:`CpuMeter` of this learner's kernel and everything it started."""
        return CpuMeter(self.km.provisioner.process.pid)

    def setup(self) -> float:
        """Run the notebook's cells up to its explorer; return the seconds it took."""
        t0 = time.perf_counter()
        for source in self.cells:
            self.execute(source)
        out = self.execute(f"TEXT_VALUES = {TEXT_VALUES!r}\n" + PROBE)
        spec = json.loads(out.split("CONTROLS ", 1)[1])
        self.controls, self.bench_comm = spec["controls"], spec["bench_comm"]
        self.world_size = spec["world_size"]   # the group's, as the last figure found it
        self.values = {k: c["value"] for k, c in self.controls.items()}
        return time.perf_counter() - t0

    def execute(self, code: str, timeout: float = 600) -> str:
        msg_id = self.kc.execute(code)
        out = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                raise RuntimeError(f"{self.name}: " + "\n".join(content["traceback"])[-3000:])
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out)

    def send(self, control: str, state: dict) -> None:
        """The comm message a browser sends when the learner sets ``control``."""
        msg = self.kc.session.msg("comm_msg", {
            "comm_id": self.controls[control]["model_id"],
            "data": {"method": "update", "state": state, "buffer_paths": []}})
        self.kc.shell_channel.send(msg)

    def reports(self, timeout: float):
        """The kernel's refresh reports, as they come, until ``timeout`` seconds pass
        without one."""
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except Exception:  # queue.Empty
                return
            content = msg["content"]
            if msg["msg_type"] == "comm_msg" and content.get("comm_id") == self.bench_comm:
                yield time.perf_counter(), content["data"]

    def move(self, control: str, state: dict, value, timeout: float = 120) -> tuple:
        """Set ``control`` as a browser does; return ``(first, complete)``: the seconds
        until the first figure for ``value`` is drawn (an interim figure of a long
        measurement, :meth:`reducelab.widgets.Explorer.show_interim`, counts) and until
        the refresh's complete figure is. :attr:`world_size` becomes the group's world
        size after the move."""
        t0 = time.perf_counter()
        self.send(control, state)
        first = None
        for t, data in self.reports(timeout):
            if data["values"].get(control) == value:
                first = t - t0 if first is None else first
                if not data.get("interim"):
                    self.values = data["values"]
                    self.world_size = data.get("world_size")
                    return first, t - t0
        raise TimeoutError(f"{self.name}: no figure for {control}={value!r} within {timeout} s")

    def sweep(self, think: float = 0.0):
        """Every control through each of its options, then back to where it was: yields
        ``(control, value, first, complete, world_size_before, world_size_after)`` per
        move (seconds, see :meth:`move`; the group's world size before and after the
        move, equal where the move did not resize it)."""
        for name, spec in self.controls.items():
            start = self.values[name]
            moves = [m for m in spec["moves"]]
            back = next((m for m in moves if m[1] == start), None)
            for state, value in moves + ([back] if back else []):
                if value == self.values.get(name):
                    continue
                before = self.world_size
                yield (name, value, *self.move(name, state, value), before, self.world_size)
                if think:
                    time.sleep(think)

    def drag(self, control: str, step_seconds: float = 1 / 60) -> dict:
        """Drag slider ``control`` from its lowest to its highest value, one change per
        ``step_seconds`` (a hand at 60 changes a second), as a continuous-update slider
        sends them; then wait for the figures to settle. Returns the steps sent, the
        refreshes that ran, the value the last figure is for, and the seconds from the
        last step to that figure."""
        spec = self.controls[control]
        moves = spec["moves"]
        if moves[0][1] == self.values.get(control):   # start from the lowest value
            moves = moves[1:]
        for state, _ in moves:
            self.send(control, state)
            time.sleep(step_seconds)
        last_sent = time.perf_counter() - step_seconds
        refreshes, last = [], None
        for t, data in self.reports(timeout=5.0):
            if data.get("interim"):
                continue
            refreshes.append(data["values"].get(control))
            last = (t, data)
        if last is None:
            raise TimeoutError(f"{self.name}: no figure after dragging {control}")
        self.values = last[1]["values"]
        stopped_at = moves[-1][1]
        return {"control": control, "steps": len(moves), "refreshes": len(refreshes),
                "stopped_at": stopped_at, "last_figure_for": last[1]["values"].get(control),
                "holds": last[1]["values"].get(control) == stopped_at,
                "settle_s": max(0.0, last[0] - last_sent)}

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
