"""The ``reducelab`` command: ``reducelab lab [DIR]`` copies the notebooks for a learner
and opens JupyterLab on that copy; ``reducelab doctor`` checks that they can run here;
``reducelab workshop serve`` starts an instructor's workshop server
(:mod:`reducelab.workshop`).

The notebooks a learner runs are a working copy, never the ones the project ships:
JupyterLab saves every notebook it has open, so running the shipped ones would change
them (and the outputs the tests compare). ``reducelab lab`` copies the notebooks and
their ``solutions/`` into ``DIR`` (default ``./reducelab-notebooks``) the first time,
and after that only adds files that are missing: a learner's edited copy is never
overwritten. For a fresh copy of one notebook, delete it (or pass ``--fresh NAME``,
which first keeps the edited one as ``NAME.<time>.ipynb``), then run the command again.

In workshop mode (``--workshop JOIN_ADDRESS``, or ``REDUCELAB_WORKSHOP`` set), the copy
has no ``solutions/``: the def cells' ``%load`` lines fetch each solution from the
instructor's server once it is opened there. JupyterLab's kernels then join the
workshop by themselves.

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
import sysconfig

DEFAULT_DIR = "reducelab-notebooks"
"""Where ``reducelab lab`` puts the learner's working copy, relative to the current folder."""


def shipped_notebooks() -> pathlib.Path:
    """The folder holding the notebooks this installation ships.

    Raises:
        FileNotFoundError: no notebooks were found next to the package (a broken install).
    """
    here = pathlib.Path(__file__).resolve().parent
    installed = pathlib.Path(sysconfig.get_path("data")) / "share" / "reducelab" / "notebooks"
    user = pathlib.Path(sysconfig.get_path("data", f"{os.name}_user")) / "share" / \
        "reducelab" / "notebooks"
    for candidate in (here.parents[1] / "notebooks", installed, user):
        if any(candidate.glob("[0-9][0-9]_*.ipynb")):
            return candidate
    raise FileNotFoundError("no Reduce Lab notebooks were found next to the reducelab "
                            "package; reinstall it from its wheel (pip install --force-reinstall "
                            "reducelab-<version>-py3-none-any.whl, built by make wheel) or run "
                            "from a clone of the repository")


def copy_notebooks(target: pathlib.Path, source: pathlib.Path | None = None,
                   fresh: tuple[str, ...] = (), solutions: bool = True) -> dict[str, list[str]]:
    """Copy the notebooks and ``solutions/*.py`` from ``source`` into ``target``
    (the solutions only with ``solutions``; a workshop copy goes without them).

    Files missing in ``target`` are copied; files already there are kept as they are.
    A name in ``fresh`` (``"01_all_reduce.ipynb"``) is copied again, after the existing
    copy is renamed to ``01_all_reduce.<YYYYmmdd-HHMMSS>.ipynb`` (``...-2.ipynb`` and so on
    if that name is taken: a kept copy is never replaced).

    Returns:
        ``{"copied": [...], "kept": [...], "renamed": [...]}``, relative paths.

    Raises:
        ValueError: a name in ``fresh`` is not one of the shipped notebooks (the message
            lists them).
    """
    source = source or shipped_notebooks()
    files = sorted(p.relative_to(source) for p in
                   list(source.glob("[0-9][0-9]_*.ipynb")) +
                   (list(source.glob("solutions/*.py")) if solutions else []))
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
            k = 1
            while old.exists():  # a --fresh within the same second: never replace a kept copy
                k += 1
                old = dest.with_name(f"{dest.stem}.{stamp}-{k}{dest.suffix}")
            dest.rename(old)
            report["renamed"].append(str(old.relative_to(target)))
        if dest.exists():
            report["kept"].append(str(rel))
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, dest)
        report["copied"].append(str(rel))
    return report


NOTEBOOK_WORLD_SIZE = 4
"""The world size most notebook cells use (explorers go up to 8)."""
MEMORY_PER_LEARNER = 1.0
"""GiB a learner needs free for a kernel with a group of 4 ranks, with room to spare
(see the README's sizing rule)."""


def _check(ok: bool | None, what: str, fix: str = "") -> dict:
    return {"ok": ok, "what": what, "fix": fix}


def doctor_checks(smoke: bool = True) -> list[dict]:
    """Check that Reduce Lab can run here. Each check is ``{"ok": True | False | None,
    "what": str, "fix": str}``; ``None`` is a warning that does not stop the notebooks.

    Checks: Python and torch versions, torch's build (CPU or CUDA), gloo, the start
    method ranks will use, the loopback interface, cores against the world sizes the
    notebooks use, free memory, whether this environment's JupyterLab has the ipywidgets
    extension, and (with ``smoke``) a real all_reduce on a group of 2 ranks.
    """
    checks = []
    py = sys.version_info
    checks.append(_check(py >= (3, 11), f"Python {py.major}.{py.minor}",
                         "Reduce Lab needs Python 3.11 or newer."))
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        checks.append(_check(False, f"torch is not importable ({e})",
                             "pip install torch --index-url https://download.pytorch.org/whl/cpu"))
        return checks
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    checks.append(_check(version >= (2, 13), f"torch {torch.__version__}",
                         "the notebooks call dist.reduce_scatter_single and all_gather_single, "
                         "new in torch 2.13: pip install -U torch "
                         "--index-url https://download.pytorch.org/whl/cpu"))
    if torch.version.cuda:
        checks.append(_check(None, f"torch is a CUDA build ({torch.version.cuda}); the "
                                   f"notebooks use the CPU only",
                             "it works; a CPU build is about ten times smaller: pip install "
                             "torch --index-url https://download.pytorch.org/whl/cpu"))
    else:
        checks.append(_check(True, "torch is a CPU build"))
    gloo = dist.is_available() and dist.is_gloo_available()
    checks.append(_check(gloo, "gloo backend available" if gloo else "no gloo backend",
                         "install an official torch wheel; this build lacks torch.distributed"))
    import multiprocessing as mp

    from .processes import context
    method = context().get_start_method()
    checks.append(_check(True, f"ranks start with {method}" + (
        "" if method == "forkserver" else
        " (no forkserver on this platform: each group start imports torch in every rank, "
        "a few seconds)")))
    if "forkserver" not in mp.get_all_start_methods():
        checks[-1]["ok"] = None
    from .group import loopback_interface
    try:
        checks.append(_check(True, f"loopback interface {loopback_interface()} "
                                   f"(gloo stays on 127.0.0.1)"))
    except RuntimeError as e:
        checks.append(_check(False, str(e), "bring up the loopback interface (lo) with "
                                            "127.0.0.1; gloo would otherwise listen on the "
                                            "network"))
    import psutil
    cores = psutil.cpu_count(logical=True) or 1
    checks.append(_check(True if cores >= NOTEBOOK_WORLD_SIZE else None,
                         f"{cores} cores for world sizes of {NOTEBOOK_WORLD_SIZE} (up to 8)",
                         "ranks outnumber cores: results stay right, but small collectives "
                         "take milliseconds instead of microseconds, and timings show it"))
    free = psutil.virtual_memory().available / 2**30
    checks.append(_check(free >= MEMORY_PER_LEARNER, f"{free:.1f} GiB of memory free",
                         f"a kernel with 4 ranks needs about {MEMORY_PER_LEARNER:g} GiB: "
                         f"close other kernels (Kernel > Shut Down All Kernels)"))
    import importlib.util
    widgets = importlib.util.find_spec("ipywidgets") is not None
    manager = importlib.util.find_spec("jupyterlab_widgets") is not None
    checks.append(_check(widgets and manager,
                         "ipywidgets and its JupyterLab extension are installed here"
                         if widgets and manager else "ipywidgets or jupyterlab_widgets missing",
                         "pip install ipywidgets jupyterlab_widgets in the environment that "
                         "runs JupyterLab, then restart JupyterLab"))
    if manager:
        try:
            out = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"],
                                 capture_output=True, text=True, timeout=60)
            listed = "@jupyter-widgets/jupyterlab-manager" in out.stdout + out.stderr
            checks.append(_check(listed or None, "JupyterLab here lists the widget manager"
                                 if listed else "JupyterLab here does not list the widget manager",
                                 "if your JupyterLab runs in another environment (a hub), "
                                 "install jupyterlab_widgets there"))
        except (OSError, subprocess.TimeoutExpired):
            checks.append(_check(None, "no JupyterLab in this environment",
                                 "pip install jupyterlab, or use the hub's JupyterLab with "
                                 "jupyterlab_widgets installed"))
    if smoke and gloo:
        import time

        from . import LocalGroup
        t0 = time.monotonic()
        try:
            with LocalGroup(world_size=2, timeout=60, progress=False) as g:
                out = g.run(_smoke)
            ok = out == [3.0, 3.0]
            checks.append(_check(ok, f"a group of 2 ranks started and ran all_reduce in "
                                     f"{time.monotonic() - t0:.1f} s" if ok else
                                     f"all_reduce gave {out}, expected [3.0, 3.0]",
                                 "report this, with the output of `reducelab doctor`"))
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            checks.append(_check(False, f"a group of 2 ranks failed: {type(e).__name__}: "
                                        f"{str(e).splitlines()[0]}",
                                 "report this, with the output of `reducelab doctor`"))
    return checks


def _smoke() -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


def _doctor(args) -> int:
    checks = doctor_checks(smoke=not args.quick)
    for c in checks:
        mark = {True: "ok  ", False: "FAIL", None: "note"}[c["ok"]]
        print(f"{mark} {c['what']}")
        if c["ok"] is not True and c["fix"]:
            print(f"     -> {c['fix']}")
    failed = [c for c in checks if c["ok"] is False]
    print("Reduce Lab can run here." if not failed else
          f"{len(failed)} check{'s' if len(failed) > 1 else ''} failed: see the fixes above.")
    return 1 if failed else 0


def _lab(args) -> int:
    target = pathlib.Path(args.dir).resolve()
    env = dict(os.environ)
    workshop = args.workshop or env.get("REDUCELAB_WORKSHOP", "").strip()
    if workshop:
        from .workshop.client import parse_address
        try:
            parse_address(workshop)
        except ValueError as e:
            print(f"reducelab lab: {e}", file=sys.stderr)
            return 2
        env["REDUCELAB_WORKSHOP"] = workshop
        if args.name:
            env["REDUCELAB_WORKSHOP_NAME"] = args.name
    try:
        report = copy_notebooks(target, fresh=tuple(args.fresh), solutions=not workshop)
    except (ValueError, FileNotFoundError) as e:
        print(f"reducelab lab: {e}", file=sys.stderr)
        return 2
    if workshop:
        print(f"Workshop mode: the notebooks come without their solutions (your instructor "
              f"opens each one when the class is ready); the kernels report to "
              f"{workshop.split('/join/')[0]}.")
        if (target / "solutions").is_dir():
            print(f"Note: {target / 'solutions'} is from an earlier copy; %load reads those "
                  f"files first.")
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
    return subprocess.call(cmd, env=env)


def _workshop(args) -> int:
    from .workshop.server import serve
    try:
        serve(args.host, args.port, args.data)
    except OSError as e:
        print(f"reducelab workshop serve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


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
    lab.add_argument("--workshop", metavar="JOIN_ADDRESS", default="",
                     help="workshop mode: copy the notebooks without their solutions and "
                          "have every kernel join the workshop at JOIN_ADDRESS (default: "
                          "$REDUCELAB_WORKSHOP, if set)")
    lab.add_argument("--name", default="",
                     help="your name on the instructor's dashboard (default: $REDUCELAB_WORKSHOP_NAME, "
                          "else the hub's user name, else your login name)")
    doctor = sub.add_parser("doctor", help="check that Reduce Lab can run here")
    doctor.add_argument("--quick", action="store_true", help="skip starting a real group")
    workshop = sub.add_parser("workshop", help="run a workshop: the instructor's server")
    wsub = workshop.add_subparsers(dest="action", required=True)
    serve = wsub.add_parser(
        "serve", help="start the workshop server; it prints the join address for the "
                      "learners and the dashboard address for you",
        description="Start the instructor's workshop server. It prints two addresses: the "
                    "join address (with the join code) to hand out to learners, and the "
                    "dashboard address (with your secret token) to keep to yourself. "
                    "Stop it with Ctrl-C; started again with the same --data, it has lost "
                    "nothing.")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; "
                            "0.0.0.0 for learners on the room's network)")
    serve.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    serve.add_argument("--data", default="reducelab-workshop", metavar="DIR",
                       help="folder of the server's state, a SQLite file (default "
                            "./reducelab-workshop)")
    args = parser.parse_args(argv)
    if args.command == "workshop":
        return _workshop(args)
    return _doctor(args) if args.command == "doctor" else _lab(args)


if __name__ == "__main__":
    sys.exit(main())
