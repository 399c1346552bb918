"""The ``reducelab`` command: ``reducelab lab [DIR]`` copies the notebooks for a learner
and opens JupyterLab on that copy.

The notebooks a learner runs are a working copy, never the ones the project ships:
JupyterLab saves every notebook it has open, so running the shipped ones would change
them (and the outputs the tests compare). ``reducelab lab`` copies the notebooks and
their ``solutions/`` into ``DIR`` (default ``./reducelab-notebooks``) the first time,
and after that only adds files that are missing: a learner's edited copy is never
overwritten. For a fresh copy of one notebook, delete it (or pass ``--fresh NAME``,
which first keeps the edited one as ``NAME.<time>.ipynb``), then run the command again.

``make lab`` runs ``python -m reducelab lab`` from the repository.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import subprocess
import sys

DEFAULT_DIR = "reducelab-notebooks"
"""Where ``reducelab lab`` puts the learner's working copy, relative to the current folder."""


def shipped_notebooks() -> pathlib.Path:
    """The folder holding the notebooks this installation ships.

    Raises:
        FileNotFoundError: no notebooks were found next to the package (a broken install).
    """
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here / "notebooks", here.parents[1] / "notebooks"):
        if any(candidate.glob("[0-9][0-9]_*.ipynb")):
            return candidate
    raise FileNotFoundError("no Reduce Lab notebooks were found next to the reducelab "
                            "package; reinstall it (pip install reducelab) or run from a "
                            "clone of the repository")


def copy_notebooks(target: pathlib.Path, source: pathlib.Path | None = None,
                   fresh: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Copy the notebooks and ``solutions/*.py`` from ``source`` into ``target``.

    Files missing in ``target`` are copied; files already there are kept as they are.
    A name in ``fresh`` (``"01_all_reduce.ipynb"``) is copied again, after the existing
    copy is renamed to ``01_all_reduce.<YYYYmmdd-HHMMSS>.ipynb``.

    Returns:
        ``{"copied": [...], "kept": [...], "renamed": [...]}``, relative paths.

    Raises:
        ValueError: a name in ``fresh`` is not one of the shipped notebooks (the message
            lists them).
    """
    source = source or shipped_notebooks()
    files = sorted(p.relative_to(source) for p in
                   list(source.glob("[0-9][0-9]_*.ipynb")) + list(source.glob("solutions/*.py")))
    names = {str(f) for f in files}
    unknown = [n for n in fresh if n not in names]
    if unknown:
        notebooks = ", ".join(sorted(n for n in names if n.endswith(".ipynb")))
        raise ValueError(f"--fresh takes notebook names; {', '.join(unknown)} is not one. "
                         f"The notebooks are: {notebooks}")
    report = {"copied": [], "kept": [], "renamed": []}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for rel in files:
        dest = target / rel
        if dest.exists() and str(rel) in fresh:
            old = dest.with_name(f"{dest.stem}.{stamp}{dest.suffix}")
            dest.rename(old)
            report["renamed"].append(str(old.relative_to(target)))
        if dest.exists():
            report["kept"].append(str(rel))
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, dest)
        report["copied"].append(str(rel))
    return report


def _lab(args) -> int:
    target = pathlib.Path(args.dir).resolve()
    try:
        report = copy_notebooks(target, fresh=tuple(args.fresh))
    except (ValueError, FileNotFoundError) as e:
        print(f"reducelab lab: {e}", file=sys.stderr)
        return 2
    for old in report["renamed"]:
        print(f"Kept your edited copy as {old}.")
    if report["copied"]:
        n = len(report["copied"])
        print(f"Copied {n} file{'s' if n != 1 else ''} into {target}.")
    if report["kept"]:
        print(f"Kept your copies of {len(report['kept'])} files already in {target} "
              f"(delete one, or pass --fresh NAME, for a fresh copy).")
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.ip={args.ip}",
           f"--ServerApp.port={args.port}", f"--ServerApp.root_dir={target}"]
    if args.no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    print(f"Starting JupyterLab on http://{args.ip}:{args.port}/ in {target} "
          f"(the URL with its token follows).", flush=True)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    return subprocess.call(cmd)


def main(argv=None) -> int:
    """Entry point of the ``reducelab`` command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="reducelab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lab = sub.add_parser("lab", help="copy the notebooks into DIR and open JupyterLab there")
    lab.add_argument("dir", nargs="?", default=DEFAULT_DIR,
                     help=f"the working copy (default ./{DEFAULT_DIR})")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--ip", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this machine only)")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("--fresh", action="append", default=[], metavar="NAME",
                     help="copy notebook NAME again, keeping the edited one under a new name")
    lab.add_argument("--dry-run", action="store_true",
                     help="copy the notebooks, print the JupyterLab command, do not start it")
    args = parser.parse_args(argv)
    return _lab(args)


if __name__ == "__main__":
    sys.exit(main())
