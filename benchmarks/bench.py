"""Reduce Lab benchmark: LocalGroup against what learners would pick instead.

One run measures, for the same work (an all_reduce of a one-element tensor, returning
the value) at each world size:

* LocalGroup: cold start (the first group in a fresh kernel: forkserver + torch
  preload), warm start (later groups), time per interaction (``run()`` round trip),
  memory per rank (USS, MB);
* ``torch.multiprocessing.spawn`` per call (start processes, init, work, exit);
* accelerate's ``notebook_launcher`` per call (if accelerate is installed);
* the widget round trip: notebook 01's explorer, one control change (run + redraw);
* every notebook's explorer in a real kernel, its controls moved as the browser moves
  them: the median and worst wait per control move (to the first figure for the new
  value, an interim one of a long measurement included, and to the complete figure),
  and a slider dragged across its
  range (the drag test: how many refreshes ran, and whether the figure that stays is
  the one for where the slider stopped);

and records where the alternatives fail: notebook_launcher returns no values, it hangs
after the kernel has used OpenMP (it forks the kernel), and spawn cannot pickle a
function defined in ``__main__`` (a notebook cell).

Usage: ``python benchmarks/bench.py [--world-sizes 2 4 8 16] [--quick]
[--explorers-only [NN ...]]``. Results go to
``benchmarks/results/latest.json`` and ``latest.md``. Timings are medians of repeated
calls in this one run; compare ratios, not absolute numbers, across machines.

This is a benchmark, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from reducelab import LocalGroup

OUT = pathlib.Path(__file__).resolve().parent / "results"
HANG_LIMIT = 60.0  # seconds before a hung alternative is declared hung


def work():
    """The unit of work every launcher does: one all_reduce, value returned."""
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


def _spawn_entry(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    work()
    dist.destroy_process_group()


def _launcher_entry():
    dist.init_process_group("gloo")
    value = work()
    dist.destroy_process_group()
    return value


def median(xs):
    return statistics.median(xs)


def max_child_uss(stop: threading.Event, out: list) -> None:
    me = psutil.Process()
    peak = 0.0
    while not stop.is_set():
        kids = me.children(recursive=True)
        total, n = 0.0, 0
        for k in kids:
            try:
                total += k.memory_full_info().uss
                n += 1
            except psutil.Error:
                pass
        if n:
            peak = max(peak, total / n)
        time.sleep(0.05)
    out.append(peak / 1e6)


def cold_start(world_size: int) -> float:
    code = textwrap.dedent(f"""
        import time, torch
        import reducelab
        t = time.perf_counter()
        g = reducelab.LocalGroup(world_size={world_size})
        print(time.perf_counter() - t)
        g.close()
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    return float(res.stdout.strip().splitlines()[-1])


def bench_localgroup(world_size: int, repeat: int) -> dict:
    LocalGroup(world_size=1).close()  # the forkserver starts once per kernel: not "warm"
    starts = []
    for _ in range(repeat):
        t = time.perf_counter()
        g = LocalGroup(world_size=world_size)
        starts.append(time.perf_counter() - t)
        g.close()
    with LocalGroup(world_size=world_size) as g:
        for _ in range(5):
            g.run(work)
        rts = []
        for _ in range(50):
            t = time.perf_counter()
            g.run(work)
            rts.append(time.perf_counter() - t)
        uss = [psutil.Process(pid).memory_full_info().uss / 1e6 for pid in g.pids]
    return {"cold_start_s": cold_start(world_size), "warm_start_s": median(starts),
            "round_trip_s": median(rts), "memory_per_rank_mb": statistics.mean(uss)}


def bench_spawn(world_size: int, repeat: int) -> dict:
    times, mem = [], []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            stop, out = threading.Event(), []
            th = threading.Thread(target=max_child_uss, args=(stop, out))
            th.start()
            t = time.perf_counter()
            tmp.spawn(_spawn_entry, args=(world_size, os.path.join(d, "init")),
                      nprocs=world_size)
            times.append(time.perf_counter() - t)
            stop.set()
            th.join()
            mem.append(out[0])
    return {"per_call_s": median(times), "memory_per_rank_mb": max(mem)}


LAUNCHER_CHILD = """
import json, sys, time
import torch.distributed as dist
from accelerate import notebook_launcher
def entry():
    dist.init_process_group("gloo")
    t = __import__("torch").tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()
times, returned = [], None
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    returned = notebook_launcher(entry, num_processes=int(sys.argv[2]), use_port=sys.argv[3])
    times.append(time.perf_counter() - t)
print("RESULT " + json.dumps({"times": times, "returned": repr(returned)}))
"""


def bench_launcher(world_size: int, repeat: int) -> dict:
    """notebook_launcher forks its caller, so it runs in a child process of its own,
    with no other thread in it (a sampling thread there could deadlock the fork), and
    a bounded wait. Memory is sampled from here, over the child's descendants."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return {"skipped": "accelerate is not installed (pip install accelerate)"}
    with socket.socket() as sock:  # a free port, not the default 29500
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER_CHILD, str(repeat), str(world_size),
                             str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    peak, deadline = 0.0, time.monotonic() + HANG_LIMIT * repeat
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        uss = []
        for k in kids:
            try:
                if "torchelastic" not in " ".join(k.cmdline()):
                    uss.append(k.memory_full_info().uss)
            except psutil.Error:
                pass
        if len(uss) >= world_size:
            peak = max(peak, sum(sorted(uss)[-world_size:]) / world_size / 1e6)
        time.sleep(0.05)
    if proc.poll() is None:
        _kill_tree(proc.pid)
        proc.communicate()
        return {"hung": f"no result after {HANG_LIMIT * repeat:.0f} s, killed"}
    out, err = proc.communicate()
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if not line:
        tail = [x for x in err.strip().splitlines() if x.strip()]
        return {"failed": tail[-1] if tail else f"exit {proc.returncode}"}
    data = json.loads(line[-1][7:])
    return {"per_call_s": median(data["times"]), "memory_per_rank_mb": peak,
            "returned": data["returned"]}


def _kill_tree(pid: int) -> None:
    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def bench_widget(world_size: int = 4, repeat: int = 12) -> dict:
    from reducelab.widgets.all_reduce import AllReduceExplorer

    def demo(op, pattern, dtype, n):
        x = torch.full((n,), dist.get_rank() + 1.0).to(getattr(torch, dtype))
        before = x.clone()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        return before, x

    with LocalGroup(world_size=world_size) as g:
        ex = AllReduceExplorer(g, demo)
        totals, computes = [], []
        ops = ["MAX", "MIN", "SUM", "AVG", "PRODUCT"]
        for i in range(repeat):
            ex.controls["op"].value = ops[i % len(ops)]
            totals.append(ex.seconds)
            t = time.perf_counter()
            ex.compute(**ex.values)
            computes.append(time.perf_counter() - t)
    return {"world_size": world_size, "change_to_figure_s": median(totals),
            "run_only_s": median(computes)}


def drag_control(controls: dict) -> str | None:
    """The slider the drag test drags: the last one that does not resize the group (a
    view the learner sweeps), else the world-size slider."""
    sliders = [k for k, c in controls.items() if c["slider"]]
    views = [k for k in sliders if k != "world_size"]
    return (views or sliders or [None])[-1]


def bench_notebook_explorers(notebooks: list[str] | None = None, think: float = 0.5) -> dict:
    """Each notebook's explorer in a real kernel (``explorer_moves``): every control moved
    through each of its options and back, as the browser sends the change, ``think``
    seconds after each new figure (a learner looks at it; 0 sends the next move at
    once); the wait per move until the first figure for the new value is drawn (an
    interim figure of a long measurement counts), and until the complete one, and the CPU
    seconds the kernel and every process it started spent in the sweep, per move
    (``explorer_moves.CpuMeter``: the ranks' runs, resizes, figures, spares). Then the
    drag test: one slider dragged across its range at 60 changes a second. By notebook:
    the median and worst wait, the worst move, the CPU per move and the drag's result;
    and the median wait of the moves that kept the group's world size (the goal of issue
    23 is stated at world size 4: a move of any other control, while a move of the
    world-size slider has the worst-move goal), with that world size."""
    from explorer_moves import NOTEBOOKS, Learner
    out = {}
    names = notebooks or sorted(p.stem[:2] for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    for nb in names:
        path = next(NOTEBOOKS.glob(f"{nb}*.ipynb"))
        if "explorer = " not in path.read_text():
            continue
        print(f"  {path.stem} ...", flush=True)
        learner = Learner(nb)
        try:
            learner.setup()
            with learner.cpu_meter() as cpu:
                moves = list(learner.sweep(think=think))
            slider = drag_control(learner.controls)
            drag = learner.drag(slider) if slider else None
        finally:
            learner.close()
        waits = [m[2] for m in moves]
        kept = [m for m in moves if m[4] == m[5]]
        worst = max(moves, key=lambda m: m[2])
        worst_complete = max(moves, key=lambda m: m[3])
        out[path.stem] = {"moves": len(moves), "median_s": statistics.median(waits),
                          "worst_s": worst[2], "worst_move": f"{worst[0]}={worst[1]}",
                          "complete_median_s": statistics.median(m[3] for m in moves),
                          "complete_worst_s": worst_complete[3],
                          "complete_worst_move": f"{worst_complete[0]}={worst_complete[1]}",
                          "cpu_per_move_s": cpu.seconds / len(moves),
                          "kept_moves": len(kept),
                          "kept_median_s": statistics.median(m[2] for m in kept) if kept else None,
                          "kept_world_sizes": sorted({m[4] for m in kept}),
                          "waits": [list(m) for m in moves], "drag": drag}
    return out


FAILURES = {
    "notebook_launcher_returns": """
        import torch.distributed as dist
        from accelerate import notebook_launcher
        def f():
            dist.init_process_group("gloo"); r = dist.get_rank(); dist.destroy_process_group()
            return r
        print("RESULT", repr(notebook_launcher(f, num_processes=2)))
    """,
    "notebook_launcher_after_openmp": """
        import torch, torch.distributed as dist
        from accelerate import notebook_launcher
        torch.set_num_threads(2)
        a = torch.randn(2000, 2000); a @ a          # the kernel has run an OpenMP op
        def f():
            b = torch.randn(2000, 2000); b @ b      # the forked child's matmul
        notebook_launcher(f, num_processes=2)
        print("RESULT finished")
    """,
    "localgroup_after_openmp": """
        import torch, torch.distributed as dist
        from reducelab import LocalGroup
        torch.set_num_threads(2)
        a = torch.randn(2000, 2000); a @ a
        with LocalGroup(world_size=2) as g:
            print("RESULT", g.run(lambda: float((torch.randn(2000, 2000) @ torch.randn(2000, 2000)).shape[0])))
    """,
    "spawn_cell_function": """
        import torch.multiprocessing as mp
        def f(rank):                                 # defined in __main__, like a cell
            pass
        if __name__ == "__main__":
            mp.spawn(f, nprocs=2)
            print("RESULT finished")
    """,
    "localgroup_cell_function": """
        from reducelab import LocalGroup
        def f():                                     # defined in __main__, like a cell
            import torch.distributed as dist
            return dist.get_rank()
        with LocalGroup(world_size=2) as g:
            print("RESULT", g.run(f))
    """,
}


def run_failure_case(name: str, code: str) -> dict:
    if "accelerate" in code:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            return {"outcome": "skipped (accelerate not installed)"}
    t = time.perf_counter()
    # "-c" code has no file: like a notebook cell, spawn's children cannot re-import it
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_LIMIT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.communicate()
        return {"outcome": f"hung: no result after {HANG_LIMIT:.0f} s, killed"}
    took = time.perf_counter() - t
    result = [line for line in out.splitlines() if line.startswith("RESULT")]
    if proc.returncode == 0 and result:
        return {"outcome": f"{result[-1][7:]} ({took:.1f} s)"}
    lines = [line.strip() for line in err.strip().splitlines() if line.strip()]
    # the root cause, e.g. a child's "Can't get attribute 'f' on <module '__main__'>",
    # rather than the parent's closing ProcessExitedException
    cause = [line for line in lines if "Can't get attribute" in line or "PicklingError" in line]
    last = cause or lines
    return {"outcome": f"failed: {last[-1] if last else 'exit ' + str(proc.returncode)}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no failure cases")
    ap.add_argument("--explorers-only", nargs="*", metavar="NN",
                    help="only the explorers (of these notebooks, e.g. 01 08; all if none "
                         "given), merged into the last results")
    ap.add_argument("--think", type=float, default=0.5,
                    help="seconds between a new figure and the next move in the explorer "
                         "sweep (a learner looks at it; 0: at once)")
    args = ap.parse_args()
    if args.explorers_only is not None:
        results = json.loads((OUT / "latest.json").read_text()) if (OUT / "latest.json").exists() \
            else {}
        print("every notebook's explorer ...", flush=True)
        explorers = bench_notebook_explorers(args.explorers_only or None, args.think)
        results.setdefault("explorers", {})
        results["explorers"] = {k: v for k, v in results["explorers"].items()
                                if "median_s" in v}   # drop the old refresh-only rows
        results["explorers"].update(explorers)
        results["explorers_when"] = _now()
        results["explorers_load"] = os.getloadavg()
        results["explorers_think_s"] = args.think
        OUT.mkdir(exist_ok=True)
        (OUT / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
        md = report(results)
        (OUT / "latest.md").write_text(md)
        print(md)
        os._exit(0)
    rep = 2 if args.quick else 5
    results = {"when": _now(),
               "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, "
                          f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
               "torch": torch.__version__, "python": platform.python_version(),
               "work": "one all_reduce of a 1-element float32 tensor, value returned",
               "by_world_size": {}}
    for ws in args.world_sizes:
        print(f"world_size {ws}: LocalGroup ...", flush=True)
        row = {"localgroup": bench_localgroup(ws, rep)}
        print(f"world_size {ws}: torch.multiprocessing.spawn ...", flush=True)
        row["spawn"] = bench_spawn(ws, 2 if ws >= 8 or args.quick else 3)
        print(f"world_size {ws}: accelerate.notebook_launcher ...", flush=True)
        row["notebook_launcher"] = bench_launcher(ws, 2 if ws >= 8 or args.quick else 3)
        lg = row["localgroup"]
        row["spawn_per_call_over_round_trip"] = row["spawn"]["per_call_s"] / lg["round_trip_s"]
        if "per_call_s" in row["notebook_launcher"]:
            row["launcher_per_call_over_round_trip"] = (row["notebook_launcher"]["per_call_s"]
                                                        / lg["round_trip_s"])
        results["by_world_size"][str(ws)] = row
    print("widget round trip ...", flush=True)
    results["widget"] = bench_widget()
    if not args.quick:
        print("every notebook's explorer ...", flush=True)
        results["explorers"] = bench_notebook_explorers(think=args.think)
        results["explorers_when"] = _now()
        results["explorers_load"] = os.getloadavg()
        results["explorers_think_s"] = args.think
    if not args.quick:
        results["failures"] = {}
        for name, code in FAILURES.items():
            print(f"failure case {name} ...", flush=True)
            results["failures"][name] = run_failure_case(name, code)
    OUT.mkdir(exist_ok=True)
    (OUT / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    md = report(results)
    (OUT / "latest.md").write_text(md)
    print(md)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def report(r: dict) -> str:
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    lines = [f"Benchmark of {r['when']} on {r['machine']}, torch {r['torch']}.",
             f"Work per call: {r['work']}. Medians.", "",
             "| world size | LocalGroup cold start | warm start | run() round trip | "
             "spawn per call | notebook_launcher per call | spawn / round trip | "
             "launcher / round trip | MB per rank: LocalGroup / spawn / launcher |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ws, row in r["by_world_size"].items():
        lg, sp, nl = row["localgroup"], row["spawn"], row["notebook_launcher"]
        nl_t = f"{nl['per_call_s']:.2f} s" if "per_call_s" in nl else \
            next(iter(nl.values()), "n/a")
        nl_r = f"{row['launcher_per_call_over_round_trip']:,.0f}x" if "per_call_s" in nl else "n/a"
        nl_m = f"{nl['memory_per_rank_mb']:.0f}" if "per_call_s" in nl else "n/a"
        lines.append(f"| {ws} | {lg['cold_start_s']:.2f} s | {ms(lg['warm_start_s'])} | "
                     f"{ms(lg['round_trip_s'])} | {sp['per_call_s']:.2f} s | {nl_t} | "
                     f"{row['spawn_per_call_over_round_trip']:,.0f}x | {nl_r} | "
                     f"{lg['memory_per_rank_mb']:.0f} / {sp['memory_per_rank_mb']:.0f} / {nl_m} |")
    w = r["widget"]
    lines += ["", f"Widget round trip (notebook 01 explorer, world size {w['world_size']}, one "
                  f"control change to new figure bytes): {ms(w['change_to_figure_s'])}, of which "
                  f"the run on the ranks is {ms(w['run_only_s'])}."]
    if "explorers" in r:
        load = r.get("explorers_load")
        lines += ["", f"Explorers, {r.get('explorers_when', '')} (load average "
                      f"{', '.join(f'{x:.1f}' for x in load) if load else 'n/a'}): every control "
                      f"moved through its options and back as the browser sends it, "
                      f"{r.get('explorers_think_s', 0):g} s after each new figure; wait per "
                      f"move from the change to the first figure for the new value (where "
                      f"a long measurement shows an interim figure, that one), and to the "
                      f"complete figure where it came later. CPU per move: the seconds of "
                      f"CPU the kernel and every process it started (ranks, forkserver, "
                      f"spares) spent in the sweep, divided by its moves. Same world size: "
                      f"the median wait of the moves that kept the group's world size (every "
                      f"control but the one that resizes it), at that world size. Drag test: "
                      f"one slider dragged across its range at 60 changes per second.", "",
                  "| notebook explorer | moves | median wait | same world size: median wait "
                  "(moves, world size) | worst wait (move) | complete "
                  "figure, where later: median, worst (move) | CPU per move | drag test: "
                  "slider, steps sent, refreshes run, last figure for, settled after |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in sorted(r["explorers"].items()):
            if "median_s" not in v:
                continue
            d = v.get("drag")
            drag = ("none (no slider)" if not d else
                    f"{d['control']}: {d['steps']} steps, {d['refreshes']} refreshes, "
                    f"{d['last_figure_for']} ({'where it stopped' if d['holds'] else 'NOT where it stopped: ' + str(d['stopped_at'])}), "
                    f"{ms(d['settle_s'])}")
            later = v.get("complete_worst_s", v["worst_s"]) > v["worst_s"] or \
                v.get("complete_median_s", v["median_s"]) > v["median_s"]
            complete = (f"{ms(v['complete_median_s'])}, {ms(v['complete_worst_s'])} "
                        f"({v['complete_worst_move']})" if later else "same")
            cpu = f"{v['cpu_per_move_s']:.2f} s" if "cpu_per_move_s" in v else "n/a"
            kept = ("n/a" if "kept_moves" not in v else "none" if not v["kept_moves"] else
                    f"{ms(v['kept_median_s'])} ({v['kept_moves']}, "
                    f"{', '.join(map(str, v['kept_world_sizes']))})")
            lines.append(f"| {k} | {v['moves']} | {ms(v['median_s'])} | {kept} | {ms(v['worst_s'])} "
                         f"({v['worst_move']}) | {complete} | {cpu} | {drag} |")
    if "failures" in r:
        lines += ["", "| case | outcome |", "|---|---|"]
        lines += [f"| {k} | {v['outcome']} |" for k, v in r["failures"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
