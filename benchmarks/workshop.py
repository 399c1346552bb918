"""Reduce Lab benchmark for a workshop: the first start, and a class of K learners.

Both run real Jupyter kernels (ipykernel through jupyter_client), as JupyterLab does.

* **First start.** In a fresh kernel, the notebooks' setup cell (imports and the first
  ``LocalGroup(world_size=4)``) against a bare ``import torch`` in another fresh kernel
  of the same kind; and a warm start (a second group in the same kernel). The
  forkserver is started in the background when ``reducelab`` is imported, so the
  kernel's torch import and the forkserver's overlap. Then each notebook's own setup
  cell (its first code cell: its imports, data and groups), ``--notebooks-repeat``
  times, in a fresh kernel started in ``notebooks/``, each after a bare ``import torch``
  in another fresh kernel.
* **A class of K learners.** K kernels at once, each running a heavy notebook up to its
  explorer (02, 08 and 10 in turn: learner i gets ``HEAVY[i % 3]``) and then moving
  that explorer's controls through their options as the browser sends the changes
  (``explorer_moves``), with ``--think`` seconds between a figure and the next move,
  for K = 1, 2, 4 and 8. Measured: PSS per learner (proportional set size, so pages
  shared by the forkserver and its ranks are counted once: the kernel, its forkserver,
  its ranks and its reaper, ipykernel and ipywidgets included), and the median and 95th
  percentile of the wait per move, from the change to the first figure for the new
  value (an interim figure of a long measurement counts) and to the complete figure.
  Also one learner
  alone with notebook 01 (the lightest setup), for its memory.

Usage: ``python benchmarks/workshop.py [--classes 1 2 4 8] [--think 0.5] [--rounds 2]
[--notebooks-repeat 3] [--first-start-only]``.
Results go to ``benchmarks/results/workshop.json`` and ``workshop.md``. Nothing here
asserts a time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import threading
import time

import psutil
from jupyter_client.manager import start_new_kernel

OUT = pathlib.Path(__file__).resolve().parent / "results"

SETUP = """
from reducelab import LocalGroup, setup
import torch
import torch.distributed as dist
setup(0)
group = LocalGroup(world_size=4)
"""
FIRST_CALLS = {
    "DDP": ("from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "def first_call():\n"
            "    model = DDP(torch.nn.Linear(8, 2))\n"
            "    model(torch.ones(4, 8)).sum().backward()\n"),
    "DTensor": ("from torch.distributed.device_mesh import init_device_mesh\n"
                "from torch.distributed.tensor import Shard, distribute_tensor\n"
                "def first_call():\n"
                "    mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
                "    (distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)]) * 2).full_tensor()\n"),
    "FSDP2": ("from torch.distributed.device_mesh import init_device_mesh\n"
              "from torch.distributed.fsdp import fully_shard\n"
              "def first_call():\n"
              "    mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
              "    model = fully_shard(torch.nn.Linear(8, 2), mesh=mesh)\n"
              "    model(torch.ones(4, 8)).sum().backward()\n"),
}
"""For each kind of call the issue names, a cell a learner would run after the setup
cell: its imports and a rank function that makes its first such call."""
TIME_FIRST_CALL = """
import json as _json, time as _time
_t0 = _time.perf_counter(); group.resize({n}); _t1 = _time.perf_counter()
group.run(first_call); _t2 = _time.perf_counter()
group.run(first_call); _t3 = _time.perf_counter()
print("FIRST " + _json.dumps([_t1 - _t0, _t2 - _t1, _t3 - _t2]))
"""
"""Resize to ``n`` fresh ranks, then the first call on them and a second one: seconds."""


def execute(kc, code: str, timeout: float = 600) -> tuple[float, str]:
    """Run ``code`` in the kernel; return (wall seconds from request to idle, stdout)."""
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            raise RuntimeError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return time.perf_counter() - t0, "".join(out)


def in_fresh_kernel(*cells: str, cwd: str | None = None, outputs: bool = False) -> list:
    """Run ``cells`` one after another in a fresh kernel (started in ``cwd``), then shut
    it down; return each cell's seconds from the request to the kernel's idle (with
    ``outputs``: ``(seconds, stdout)`` per cell)."""
    km, kc = start_new_kernel(kernel_name="python3", **({"cwd": cwd} if cwd else {}))
    try:
        return [execute(kc, code) if outputs else execute(kc, code)[0] for code in cells]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def first_start(repeat: int, preload: str = "full") -> dict:
    """With ``REDUCELAB_PRELOAD=preload``, ``repeat`` times: a bare ``import torch`` in a
    fresh kernel, then :data:`SETUP` in another, a warm start of another group of 4, and
    for each of :data:`FIRST_CALLS` in turn, its cell and a resize to fresh ranks (3, 4,
    3: each a new world size) with the first call on them and a second one (what a
    preload that lightens the setup cell could move onto that first call). Medians."""
    import os
    os.environ["REDUCELAB_PRELOAD"] = preload  # the kernels inherit it
    bare, setup, warm = [], [], []
    first: dict[str, list] = {kind: [] for kind in FIRST_CALLS}
    for _ in range(repeat):
        bare += in_fresh_kernel("import torch")
        cells = [SETUP, "LocalGroup(world_size=4).close()"]
        for kind, n in zip(FIRST_CALLS, (3, 4, 3)):
            cells += [FIRST_CALLS[kind], TIME_FIRST_CALL.format(n=n)]
        out = in_fresh_kernel(*cells, outputs=True)
        setup.append(out[0][0])
        warm.append(out[1][0])
        for kind, (_, printed) in zip(FIRST_CALLS, out[3::2]):
            first[kind].append(json.loads(printed.split("FIRST ", 1)[1]))
    os.environ.pop("REDUCELAB_PRELOAD")
    b, s = statistics.median(bare), statistics.median(setup)
    return {"preload": preload, "bare_import_torch_s": b, "setup_cell_s": s, "ratio": s / b,
            "warm_start_s": statistics.median(warm),
            "first_calls": {kind: {"resize_s": statistics.median(t[0] for t in ts),
                                   "first_s": statistics.median(t[1] for t in ts),
                                   "second_s": statistics.median(t[2] for t in ts)}
                            for kind, ts in first.items()}}


NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def setup_cell(notebook: pathlib.Path) -> str:
    """The first code cell of ``notebook``: its setup cell (imports, data, first group)."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


def notebooks_first_start(repeat: int) -> dict:
    """Each notebook's own setup cell in a fresh kernel started in ``notebooks/`` (as
    JupyterLab starts it), ``repeat`` times in rounds over the notebooks, each round
    after a bare ``import torch`` in another fresh kernel. Seconds from the request to
    the kernel's idle; medians, and the range."""
    cells = {p.stem: setup_cell(p) for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))}
    bare: list[float] = []
    setup: dict[str, list[float]] = {name: [] for name in cells}
    for _ in range(repeat):
        for name, code in cells.items():
            bare += in_fresh_kernel("import torch", cwd=str(NOTEBOOKS))
            setup[name] += in_fresh_kernel(code, cwd=str(NOTEBOOKS))
            print(f"  {name}: {setup[name][-1]:.2f} s (bare import torch {bare[-1]:.2f} s)",
                  flush=True)
    b = statistics.median(bare)
    return {"repeat": repeat, "bare_import_torch_s": b, "bare_min_s": min(bare),
            "bare_max_s": max(bare),
            "notebooks": {name: {"setup_cell_s": statistics.median(t), "min_s": min(t),
                                 "max_s": max(t), "ratio": statistics.median(t) / b}
                          for name, t in setup.items()}}


def pss_of_tree(pid: int) -> float:
    """PSS in bytes of a process and all its descendants, and of the reaper it started
    (in a session of its own, but still its child)."""
    total = 0
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def p95(times: list[float]) -> float:
    """The 95th percentile of ``times`` (the nearest rank at or above it)."""
    times = sorted(times)
    return times[min(len(times) - 1, int(0.95 * len(times)))]


def _busy(times) -> float:
    """CPU seconds of every core spent running something: user (guest time is part of
    it on Linux), nice, system and interrupts; not idle, I/O wait or time another
    virtual machine took (steal)."""
    return sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))


HEAVY = ("02", "08", "10")
"""The notebooks whose explorers the class moves: the heaviest figures and runs."""


def classroom(k: int, think: float, rounds: int, notebooks=HEAVY) -> dict:
    """K learners at once, each on one of ``notebooks`` (in turn), each moving every
    control through its options ``rounds`` times, ``think`` seconds after each new
    figure. Returns the waits per move, PSS per learner, and how busy the machine's
    cores were while the class moved: ``cores_busy``, the CPU seconds the whole machine
    spent running something (``psutil.cpu_times()``, every core: :func:`_busy`) per second of
    the moves, at most the machine's cores, where the class asked for more than the
    machine has and moves queue. Meant for a machine that runs nothing else: this
    process's own share (the learners' threads) counts too. Per-process meters
    (``explorer_moves.CpuMeter``, one per learner) were tried first and cost the class
    more than they measured: each scans every process of the machine 20 times a second."""
    from explorer_moves import Learner
    learners = []
    try:
        for i in range(k):   # one after another, as a class arrives
            learner = Learner(notebooks[i % len(notebooks)])
            learners.append(learner)
            learner.setup()
        results: list[list[tuple]] = [[] for _ in range(k)]   # (control, value, first, complete)
        errors: list[str] = []

        def learner_moves(i: int) -> None:
            try:
                for _ in range(rounds):
                    results[i] += list(learners[i].sweep(think=think))
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(f"{learners[i].name}: {err}")
        threads = [threading.Thread(target=learner_moves, args=(i,)) for i in range(k)]
        before = psutil.cpu_times()
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(2.0)
        pss = [pss_of_tree(learner.km.provisioner.process.pid) for learner in learners]
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        cpu = _busy(psutil.cpu_times()) - _busy(before)
        times = sorted(m[2] for r in results for m in r)
        complete = sorted(m[3] for r in results for m in r)
        by_notebook = {}
        for learner, moves in zip(learners, results):
            by_notebook.setdefault(learner.name, []).extend(moves)
        return {"learners": k, "notebooks": [x.name for x in learners], "think_s": think,
                "moves": len(times), "pss_per_learner_gib": statistics.mean(pss) / 2**30,
                "wait_median_s": statistics.median(times), "wait_p95_s": p95(times),
                "complete_median_s": statistics.median(complete),
                "complete_p95_s": p95(complete),
                "cpu_s": cpu, "wall_s": wall, "cores_busy": cpu / wall,
                "by_notebook": {name: {"moves": len(moves),
                                       "wait_median_s": statistics.median(m[2] for m in moves),
                                       "wait_p95_s": p95([m[2] for m in moves]),
                                       "complete_p95_s": p95([m[3] for m in moves]),
                                       "slowest": [f"{c}={v}: {t * 1e3:.0f} ms" for c, v, t, *_ in
                                                   sorted(moves, key=lambda m: -m[2])[:3]]}
                                for name, moves in by_notebook.items() if moves},
                "errors": errors}
    finally:
        for learner in learners:
            learner.close()


def alone(notebook: str = "01") -> dict:
    """One learner, one notebook up to its explorer: PSS 5 s after its setup (the
    forkserver has made its later imports), and again after moving every control."""
    from explorer_moves import Learner
    learner = Learner(notebook)
    try:
        learner.setup()
        time.sleep(5.0)
        pid = learner.km.provisioner.process.pid
        before = pss_of_tree(pid) / 2**30
        waits = [m[2] for m in learner.sweep()]
        return {"notebook": learner.name, "pss_gib": before,
                "pss_after_moves_gib": pss_of_tree(pid) / 2**30,
                "wait_median_s": statistics.median(waits), "wait_max_s": max(waits)}
    finally:
        learner.close()


def report(r: dict) -> str:
    lines = [f"Workshop benchmark of {r['when']} on {r['machine']}, torch {r['torch']}.", "",
             "| forkserver preload (`REDUCELAB_PRELOAD`) | bare `import torch` | setup cell: "
             "imports and `LocalGroup(world_size=4)` | ratio | warm start of another group of 4 |"
             + "".join(f" first {k} call after a resize: resize, first call (second) |"
                       for k in FIRST_CALLS),
             "|---|---|---|---|---|" + "---|" * len(FIRST_CALLS)]
    for f in r["first_start"]:
        calls = f.get("first_calls", {})
        lines.append(f"| {f['preload']} | {f['bare_import_torch_s']:.2f} s | "
                     f"{f['setup_cell_s']:.2f} s | {f['ratio']:.2f}x | "
                     f"{f['warm_start_s'] * 1e3:.0f} ms |"
                     + "".join(f" {calls[k]['resize_s']:.2f} s, {calls[k]['first_s']:.2f} s "
                               f"({calls[k]['second_s'] * 1e3:.0f} ms) |" if k in calls else " n/a |"
                               for k in FIRST_CALLS))
    n = r.get("notebooks_first_start")
    if n:
        lines += ["", f"Each notebook's own setup cell (its first code cell) in a fresh kernel, "
                      f"median of {n['repeat']} (range), against a bare `import torch` in "
                      f"another fresh kernel before each: median {n['bare_import_torch_s']:.2f} s "
                      f"({n['bare_min_s']:.2f} to {n['bare_max_s']:.2f} s).", "",
                  "| notebook | setup cell | ratio to bare `import torch` |", "|---|---|---|"]
        for name, x in n["notebooks"].items():
            lines.append(f"| {name} | {x['setup_cell_s']:.2f} s ({x['min_s']:.2f} to "
                         f"{x['max_s']:.2f}) | {x['ratio']:.2f}x |")
    measured = r.get("classroom_when", r["when"])
    if measured != r["when"]:
        lines += ["", f"Measured {measured}, with the code of then (`--first-start-only` "
                      f"keeps these rows):"]
    a = r.get("alone")
    if a:
        lines += ["", f"One learner alone, {a['notebook']} up to its explorer: {a['pss_gib']:.2f} GiB "
                      f"PSS ({a.get('pss_after_moves_gib', float('nan')):.2f} GiB after moving "
                      f"every control through its options, every world size included); wait "
                      f"per move median {a['wait_median_s'] * 1e3:.0f} ms, longest "
                      f"{a['wait_max_s'] * 1e3:.0f} ms."]
    load = r.get("classroom_load")
    lines += ["", f"A class: each learner runs one of notebooks {', '.join(HEAVY)} (in turn) up "
                  f"to its explorer, then moves every control through its options, "
                  f"{r['classroom'][0]['think_s'] if r['classroom'] else '?'} s after each new "
                  f"figure (load average before: "
                  f"{', '.join(f'{x:.1f}' for x in load) if load else 'n/a'}).", "",
              "| learners (kernels at once) | moves | PSS per learner | wait median | wait p95 | "
              "complete figure: median, p95 | machine's cores busy while moving (CPU per move) |",
              "|---|---|---|---|---|---|---|"]
    for c in r["classroom"]:
        lines.append(f"| {c['learners']} | {c['moves']} | {c['pss_per_learner_gib']:.2f} GiB | "
                     f"{c['wait_median_s'] * 1e3:.0f} ms | {c['wait_p95_s'] * 1e3:.0f} ms | "
                     f"{c.get('complete_median_s', c['wait_median_s']) * 1e3:.0f} ms, "
                     f"{c.get('complete_p95_s', c['wait_p95_s']) * 1e3:.0f} ms | "
                     + (f"{c['cores_busy']:.2f} of {psutil.cpu_count()} ({c['cpu_s'] / c['moves']:.2f} s) |"
                        if "cores_busy" in c else "n/a |")
                     + (f" errors: {'; '.join(c['errors'])}" if c.get("errors") else ""))
    largest = max(r["classroom"], key=lambda c: c["learners"], default=None)
    if largest and largest.get("by_notebook"):
        lines += ["", f"The class of {largest['learners']}, by notebook:", "",
                  "| notebook | moves | wait median | wait p95 | complete figure p95 | "
                  "slowest moves |",
                  "|---|---|---|---|---|---|"]
        for name, b in sorted(largest["by_notebook"].items()):
            lines.append(f"| {name} | {b['moves']} | {b['wait_median_s'] * 1e3:.0f} ms | "
                         f"{b['wait_p95_s'] * 1e3:.0f} ms | "
                         f"{b.get('complete_p95_s', b['wait_p95_s']) * 1e3:.0f} ms | "
                         f"{'; '.join(b['slowest'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--think", type=float, default=0.5,
                    help="seconds a learner looks at a new figure before the next move")
    ap.add_argument("--rounds", type=int, default=2, help="sweeps of every control per learner")
    ap.add_argument("--repeat", type=int, default=3, help="fresh kernels per first-start row")
    ap.add_argument("--skip-first-start", action="store_true")
    ap.add_argument("--notebooks-repeat", type=int, default=3,
                    help="fresh kernels per notebook's own setup cell (0 keeps the stored rows)")
    ap.add_argument("--first-start-only", action="store_true",
                    help="measure only the first start (both kinds); keep the stored class rows")
    args = ap.parse_args()
    results = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, "
                          f"{psutil.virtual_memory().total / 2**30:.0f} GiB"}
    import torch
    results["torch"] = torch.__version__
    previous = json.loads((OUT / "workshop.json").read_text()) if (OUT / "workshop.json").exists() \
        else {}
    if args.skip_first_start:
        results["first_start"] = previous.get("first_start", [])
    else:
        print("first start ...", flush=True)
        results["first_start"] = [first_start(args.repeat, p) for p in ("full", "eager", "torch")]
    if args.notebooks_repeat > 0:
        print("each notebook's own setup cell ...", flush=True)
        results["notebooks_first_start"] = notebooks_first_start(args.notebooks_repeat)
    else:
        results["notebooks_first_start"] = previous.get("notebooks_first_start")
    if args.first_start_only:
        for key in ("alone", "classroom", "classroom_load", "classroom_when"):
            if key in previous:
                results[key] = previous[key]
        results["classroom_when"] = previous.get("classroom_when", previous.get("when"))
    else:
        print("one learner alone ...", flush=True)
        results["alone"] = alone()
        results["classroom"] = []
        results["classroom_load"] = os.getloadavg()
        results["classroom_when"] = results["when"]
        for k in args.classes:
            print(f"a class of {k} ...", flush=True)
            results["classroom"].append(classroom(k, args.think, args.rounds))
    OUT.mkdir(exist_ok=True)
    (OUT / "workshop.json").write_text(json.dumps(results, indent=2) + "\n")
    md = report(results)
    (OUT / "workshop.md").write_text(md)
    print(md, flush=True)
    os._exit(0)  # skip jupyter_client's event-loop teardown noise at interpreter exit


if __name__ == "__main__":
    main()
