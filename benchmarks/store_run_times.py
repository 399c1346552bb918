"""Append one browser run's notebook times to ``benchmarks/results/browser_run_times.json``.

The browser test (``tests/browser/test_lab.py``, ``make lab``) writes
``artifacts/browser/run_times.json``: for each notebook, the wall time in seconds of
Restart Kernel and Run All Cells in JupyterLab (``run_all_s``). Each notebook's header
states its run time from the runs stored here (the rule is
:func:`stated_run_time`), and ``tests/test_notebooks.py`` re-derives every header from
this file.

Usage, from the repository root after ``make lab`` on a clean clone of a commit:
    python benchmarks/store_run_times.py CLONE/artifacts/browser/run_times.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import subprocess

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "browser_run_times.json"
ROOM = 1.2
"""The stated run time leaves 20 % above the slowest stored run, for a loaded machine."""


def stated_run_time(seconds: list[float]) -> int:
    """The run time a notebook's header states, in whole seconds: the slowest of its
    stored runs (``seconds``, wall seconds each) times :data:`ROOM`, rounded up to a
    multiple of 5 s."""
    return 5 * math.ceil(round(max(seconds) * ROOM, 6) / 5)


def load() -> dict:
    """``{"runs": [{"commit", "date", "run_all_s": {notebook: seconds}}]}``: one entry per
    clean-clone run of the browser test, ``date`` when it wrote its times (UTC)."""
    return json.loads(RESULTS.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_times", type=pathlib.Path,
                        help="artifacts/browser/run_times.json of a clean clone's make lab")
    parser.add_argument("--commit", help="the commit the clone ran (default: the clone's HEAD)")
    args = parser.parse_args()
    record = json.loads(args.run_times.read_text())
    clone = args.run_times.resolve().parents[2]
    commit = args.commit or subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"],
                                           capture_output=True, text=True, check=True).stdout.strip()
    when = datetime.datetime.fromtimestamp(args.run_times.stat().st_mtime, datetime.timezone.utc)
    stored = load() if RESULTS.exists() else {"runs": []}
    stored["runs"].append({
        "commit": commit,
        "date": when.strftime("%Y-%m-%dT%H:%MZ"),
        "run_all_s": {name: entry["run_all_s"] for name, entry in sorted(record.items())},
    })
    RESULTS.write_text(json.dumps(stored, indent=1) + "\n")
    for name in sorted(record):
        times = [run["run_all_s"][name] for run in stored["runs"] if name in run["run_all_s"]]
        print(f"{name}: slowest {max(times):.1f} s -> header 'about {stated_run_time(times)} s'")


if __name__ == "__main__":
    main()
