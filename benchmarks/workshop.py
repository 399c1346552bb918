"""Reduce Lab benchmark for a workshop: the first start, and a class of K learners.

Both run real Jupyter kernels (ipykernel through jupyter_client), as JupyterLab does.

* **First start.** In a fresh kernel, the notebooks' setup cell (imports and the first
  ``LocalGroup(world_size=4)``) against a bare ``import torch`` in another fresh kernel
  of the same kind; and a warm start (a second group in the same kernel). The
  forkserver is started in the background when ``reducelab`` is imported, so the
  kernel's torch import and the forkserver's overlap.
* **A class of K learners.** K kernels at once, each holding a ``LocalGroup(world_size=4)``
  and refreshing notebook 01's explorer in a loop (one control change each time), for
  K = 1, 2, 4 and 8. Measured: PSS per learner (proportional set size, so pages shared
  by the forkserver and its ranks are counted once: the kernel, its forkserver, its
  ranks and its reaper, ipykernel and ipywidgets included), and the median and 95th
  percentile of one refresh.

Usage: ``python benchmarks/workshop.py [--classes 1 2 4 8] [--refreshes 40]``. Results go
to ``benchmarks/results/workshop.json`` and ``workshop.md``. Nothing here asserts a time.
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
EXPLORER = """
from reducelab.widgets.all_reduce import AllReduceExplorer
def demo(op, pattern, dtype, n):
    x = torch.full((n,), dist.get_rank() + 1.0).to(getattr(torch, dtype))
    before = x.clone()
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return before, x
explorer = AllReduceExplorer(group, demo)
"""
LOOP = """
import time as _time
_times = []
for _i in range({n}):
    explorer.controls["op"].value = ("MAX", "SUM")[_i % 2]
    _times.append(explorer.seconds)
print("TIMES", _times)
"""


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


def fresh_kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    return km, kc


def first_start(repeat: int, preload: str = "full") -> dict:
    import os
    os.environ["REDUCELAB_PRELOAD"] = preload  # the kernels inherit it
    bare, setup, warm = [], [], []
    for _ in range(repeat):
        km, kc = fresh_kernel()
        try:
            bare.append(execute(kc, "import torch")[0])
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        km, kc = fresh_kernel()
        try:
            setup.append(execute(kc, SETUP)[0])
            warm.append(execute(kc, "LocalGroup(world_size=4).close()")[0])
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    os.environ.pop("REDUCELAB_PRELOAD")
    b, s = statistics.median(bare), statistics.median(setup)
    return {"preload": preload, "bare_import_torch_s": b, "setup_cell_s": s, "ratio": s / b,
            "warm_start_s": statistics.median(warm)}


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


def classroom(k: int, refreshes: int) -> dict:
    kernels = [fresh_kernel() for _ in range(k)]
    try:
        for km, kc in kernels:
            execute(kc, SETUP)
            execute(kc, EXPLORER)
        results: list[list[float]] = [[] for _ in range(k)]

        def learner(i: int) -> None:
            _, out = execute(kernels[i][1], LOOP.format(n=refreshes))
            results[i] = json.loads(out.split("TIMES", 1)[1].strip().replace("'", '"'))
        threads = [threading.Thread(target=learner, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        pss = [pss_of_tree(km.provisioner.process.pid) for km, _ in kernels]
        for t in threads:
            t.join()
        times = sorted(t for r in results for t in r[1:])   # the first refresh draws anew
        p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
        return {"learners": k, "pss_per_learner_gib": statistics.mean(pss) / 2**30,
                "refresh_median_s": statistics.median(times), "refresh_p95_s": p95}
    finally:
        for km, kc in kernels:
            kc.stop_channels()
            km.shutdown_kernel(now=True)


def report(r: dict) -> str:
    lines = [f"Workshop benchmark of {r['when']} on {r['machine']}, torch {r['torch']}.", "",
             "| forkserver preload (`REDUCELAB_PRELOAD`) | bare `import torch` | setup cell: "
             "imports and `LocalGroup(world_size=4)` | ratio | warm start of another group of 4 |",
             "|---|---|---|---|---|"]
    for f in r["first_start"]:
        lines.append(f"| {f['preload']} | {f['bare_import_torch_s']:.2f} s | "
                     f"{f['setup_cell_s']:.2f} s | {f['ratio']:.2f}x | "
                     f"{f['warm_start_s'] * 1e3:.0f} ms |")
    lines += ["", "| learners (kernels at once) | PSS per learner | refresh median | refresh p95 |",
              "|---|---|---|---|"]
    for c in r["classroom"]:
        lines.append(f"| {c['learners']} | {c['pss_per_learner_gib']:.2f} GiB | "
                     f"{c['refresh_median_s'] * 1e3:.0f} ms | {c['refresh_p95_s'] * 1e3:.0f} ms |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--refreshes", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3, help="fresh kernels per first-start row")
    args = ap.parse_args()
    results = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, "
                          f"{psutil.virtual_memory().total / 2**30:.0f} GiB"}
    import torch
    results["torch"] = torch.__version__
    print("first start ...", flush=True)
    results["first_start"] = [first_start(args.repeat, p) for p in ("full", "torch")]
    results["classroom"] = []
    for k in args.classes:
        print(f"a class of {k} ...", flush=True)
        results["classroom"].append(classroom(k, args.refreshes))
    OUT.mkdir(exist_ok=True)
    (OUT / "workshop.json").write_text(json.dumps(results, indent=2) + "\n")
    md = report(results)
    (OUT / "workshop.md").write_text(md)
    print(md, flush=True)
    os._exit(0)  # skip jupyter_client's event-loop teardown noise at interpreter exit


if __name__ == "__main__":
    main()
