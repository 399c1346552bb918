"""Mutation testing of the core modules with Cosmic Ray (``make mutation``).

For each module of ``benchmarks/mutation.toml`` this runs Cosmic Ray's own commands
(``cosmic-ray init``, ``cr-filter-operators``, ``cosmic-ray exec``, ``cosmic-ray dump``)
with that module's tests, and writes what survived to ``benchmarks/results/``:
``mutation.json`` (every module's counts and surviving mutants, with their diffs) and
``mutation-latest.md`` (the same as tables). ``mutation.md`` beside them is written by
hand: each survivor killed by a test, or explained.

It works in a copy of the repository (the files git knows, under ``--work``), and the
copy's ``helpers/`` comes first on ``PYTHONPATH``, so the kernel and its ranks import the
mutated copy while this checkout stays as it is. A mutant is one edit of one module, its
tests one pytest run (Cosmic Ray restores the file after each).

Usage::

    python benchmarks/mutation.py                      # every module (hours on 2 cores)
    python benchmarks/mutation.py capture cli          # some modules
    python benchmarks/mutation.py group --sample 4     # every 4th mutant of group.py

Not part of ``make test``: a test run per mutant takes seconds to a minute.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "benchmarks" / "mutation.toml"
RESULTS = ROOT / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent


def copy_repository(work: pathlib.Path) -> pathlib.Path:
    """The files git knows (tracked, and new ones it does not ignore), copied to ``work``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    if work.exists():
        shutil.rmtree(work)
    for rel in filter(None, listed):
        source = ROOT / rel
        if source.is_file():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, work / rel)
    return work


def environment(work: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "helpers"),
                                                      env.get("PYTHONPATH", "")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"   # a mutant's module is never read from a stale .pyc
    env.setdefault("REDUCELAB_PRELOAD", "torch")   # a forkserver per mutant: the lighter one
    return env


def test_command(tests: str) -> str:
    return (f"{shlex.quote(sys.executable)} -m pytest -x -q -p no:cacheprovider "
            f"--timeout=300 {tests}")


def cosmic(*args: str, work: pathlib.Path, env: dict, capture: bool = False) -> str:
    tool = BIN / args[0]
    done = subprocess.run([str(tool), *args[1:]], cwd=work, env=env, text=True,
                          capture_output=capture, check=True)
    return done.stdout if capture else ""


def sample_out(session: pathlib.Path, every: int) -> int:
    """Mark all but every ``every``-th pending mutant (in file order) as skipped; return
    how many were left out. Uses Cosmic Ray's own session database."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
    with use_db(str(session), WorkDB.Mode.open) as db:
        items = sorted(db.pending_work_items, key=lambda w: (
            w.mutations[0].start_pos, w.mutations[0].operator_name, w.mutations[0].occurrence))
        left = [w for i, w in enumerate(items) if i % every]
        for w in left:
            db.set_result(w.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                               output=f"not in this sample (every {every})"))
    return len(left)


def run_module(entry: dict, settings: dict, work: pathlib.Path, env: dict, every: int) -> dict:
    path, tests = entry["path"], entry["tests"]
    name = pathlib.Path(path).with_suffix("").as_posix().split("reducelab/")[-1]
    print(f"== {path}: the unmutated tests first", flush=True)
    t0 = time.monotonic()
    baseline = subprocess.run(shlex.split(test_command(tests)), cwd=work, env=env,
                              capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if baseline.returncode != 0:
        raise SystemExit(f"the tests of {path} fail without any mutant:\n{baseline.stdout[-3000:]}")
    timeout = settings.get("timeout-factor", 3.0) * seconds + 30
    slug = name.replace("/", "_")
    config = work / f"mutation-{slug}.toml"
    session = work / f"mutation-{slug}.sqlite"
    session.unlink(missing_ok=True)
    lines = ["[cosmic-ray]", f"module-path = {json.dumps(path)}", f"timeout = {timeout:.0f}",
             "excluded-modules = []", f"test-command = {json.dumps(test_command(tests))}",
             "", "[cosmic-ray.distributor]", 'name = "local"', "",
             "[cosmic-ray.filters.operators-filter]",
             f"exclude-operators = {json.dumps(settings.get('exclude-operators', []))}"]
    config.write_text("\n".join(lines) + "\n")
    cosmic("cosmic-ray", "init", config.name, session.name, work=work, env=env)
    cosmic("cr-filter-operators", session.name, config.name, work=work, env=env)
    sampled_out = sample_out(session, every) if every > 1 else 0
    print(f"   tests take {seconds:.0f} s unmutated; a mutant's run is stopped after "
          f"{timeout:.0f} s", flush=True)
    t0 = time.monotonic()
    cosmic("cosmic-ray", "exec", config.name, session.name, work=work, env=env)
    return summarize(path, tests, every, session, work, env, time.monotonic() - t0, seconds)


def summarize(path: str, tests: str, every: int, session: pathlib.Path, work: pathlib.Path,
              env: dict, took: float, seconds: float) -> dict:
    """Counts and survivors of a session, also of one stopped before its end (``--collect``):
    mutants not run yet are counted as such."""
    counts = {"generated": 0, "operators left out": 0, "sampled out": 0, "killed": 0,
              "killed by timeout": 0, "survived": 0, "incompetent": 0, "not run": 0}
    survivors = []
    for line in cosmic("cosmic-ray", "dump", session.name, work=work, env=env,
                       capture=True).splitlines():
        item, result = json.loads(line)
        counts["generated"] += 1
        m = item["mutations"][0]
        if result is None:
            counts["not run"] += 1
            continue
        if result["worker_outcome"] == "skipped":
            key = "sampled out" if "sample" in (result.get("output") or "") else "operators left out"
            counts[key] += 1
        elif result["test_outcome"] == "killed":
            counts["killed by timeout" if result.get("output") == "timeout" else "killed"] += 1
        elif result["test_outcome"] == "survived":
            counts["survived"] += 1
            survivors.append({"line": m["start_pos"][0], "function": m.get("definition_name"),
                              "operator": m["operator_name"], "occurrence": m["occurrence"],
                              "diff": "".join(result.get("diff") or "")})
        else:
            counts["incompetent"] += 1
    survivors.sort(key=lambda s: (s["line"], s["operator"]))
    print(f"   {counts}", flush=True)
    return {"path": path, "tests": test_command(tests).split(" -m pytest ", 1)[1],
            "sample": every, "seconds": round(took),
            "test_seconds": round(seconds, 1) if seconds == seconds else None,
            "counts": counts, "survivors": survivors}


def write_results(results: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mutation.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    lines = ["# Mutation testing: the latest run (written by benchmarks/mutation.py)", "",
             "| module | tests | mutants | left out (operators) | sampled out | killed "
             "| killed by timeout | survived | not run | run time |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["modules"].values():
        c = r["counts"]
        lines.append(f"| `{r['path']}` | `{r['tests']}` | {c['generated']} | "
                     f"{c['operators left out']} | {c['sampled out']} | {c['killed']} | "
                     f"{c['killed by timeout']} | {c['survived']} | {c.get('not run', 0)} | "
                     f"{r['seconds'] // 60} min |")
    for r in results["modules"].values():
        if r["survivors"]:
            lines += ["", f"## Survivors in `{r['path']}`", ""]
            for s in r["survivors"]:
                lines += [f"- line {s['line']}, `{s['function']}`, {s['operator']}:", "",
                          "```diff", s["diff"].rstrip(), "```"]
    (RESULTS / "mutation-latest.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help="module names (capture, group, checks/__init__, ...)")
    parser.add_argument("--sample", type=int, default=1, metavar="N",
                        help="run every N-th mutant only (default: all)")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "reducelab-mutation"),
                        help="where the copy of the repository goes")
    parser.add_argument("--collect", action="store_true",
                        help="write the results of the sessions already in --work (a run that "
                             "was stopped), without running anything")
    args = parser.parse_args(argv)
    settings = tomllib.loads(CONFIG.read_text())["mutation"]
    entries = settings["module"]
    if args.modules:
        wanted = {m.removesuffix(".py") for m in args.modules}
        entries = [e for e in entries if e["path"].removesuffix(".py").split("reducelab/")[-1] in wanted]
        if not entries:
            known = ", ".join(e["path"].split("reducelab/")[-1] for e in settings["module"])
            parser.error(f"no such module in {CONFIG.name}; the modules are: {known}")
    out = RESULTS / "mutation.json"
    if args.collect:
        work = pathlib.Path(args.work)
        env = environment(work)
        for entry in entries:
            slug = entry["path"].removesuffix(".py").split("reducelab/")[-1].replace("/", "_")
            session = work / f"mutation-{slug}.sqlite"
            if not session.exists():
                continue
            results = json.loads(out.read_text()) if out.exists() else {"modules": {}}
            before = results["modules"].get(entry["path"], {})
            results["modules"][entry["path"]] = summarize(
                entry["path"], entry["tests"], before.get("sample", args.sample), session, work,
                env, before.get("seconds", time.time() - session.stat().st_ctime),
                before.get("test_seconds") or float("nan"))
            write_results(results)
        return 0
    work = copy_repository(pathlib.Path(args.work))
    env = environment(work)
    version = subprocess.run([str(BIN / "cosmic-ray"), "--version"], capture_output=True,
                             text=True).stdout.strip()
    for entry in entries:
        result = run_module(entry, settings, work, env, args.sample)
        # read the file again: another run (of other modules) may have written it meanwhile
        results = json.loads(out.read_text()) if out.exists() else {"modules": {}}
        results["modules"][entry["path"]] = result
        results["cosmic-ray"] = version
        write_results(results)
    results = json.loads(out.read_text()) if out.exists() else {"modules": {}}
    total = sum(r["counts"]["survived"] for r in results["modules"].values())
    print(f"{total} surviving mutants: see {RESULTS / 'mutation-latest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
