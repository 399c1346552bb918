"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages."""
from __future__ import annotations

import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
# pip name -> conda-forge name, where they differ (conda-forge's `playwright` is the Node
# command line; `playwright-python` is the Python module the browser test imports)
CONDA_NAMES = {"torch": "pytorch-cpu", "playwright": "playwright-python"}
PIP_ONLY = {"cosmic-ray"}  # the mutation tool (make mutation): in environment.yml's pip section


def _split(req: str) -> tuple[str, str]:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", req)
    return m.group(1).lower(), m.group(2).replace(" ", "")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        pip_reqs += extra
    wanted = dict(_split(r) for r in pip_reqs)
    wanted = {CONDA_NAMES.get(k, k): v for k, v in wanted.items()}
    wanted["python"] = project["requires-python"]

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = dict(_split(d) for d in env["dependencies"] if isinstance(d, str))
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))

    assert conda.pop("pip") == ""
    from_pip = dict(_split(line.split("#")[0]) for line in pip_section if not line.startswith("-"))
    assert from_pip == {k: v for k, v in wanted.items() if k in PIP_ONLY}
    assert conda == {k: v for k, v in wanted.items() if k not in PIP_ONLY}
    assert env["channels"] == ["conda-forge", "nodefaults"]  # pytorch's channel ended at 2.5
    assert any(line.endswith("-e .") for line in pip_section)


def test_constraints_pin_every_dependency_and_the_cpu_torch():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for e in project["optional-dependencies"].values()
                                             for r in e]
    for req in reqs:
        name = _split(req)[0].replace("_", "-")
        assert name in pins, f"{name} is not pinned in constraints.txt"
    assert pins["torch"] == "2.13.0"


def test_a_wheel_carries_the_notebooks_and_the_reducelab_command(tmp_path):
    """Build a wheel, install it (without a clone) into a fresh virtual environment,
    run `reducelab doctor`, copy the notebooks with `reducelab lab`, and execute
    notebook 01 from the copy with that environment's kernel.

    The fresh environment reuses the dependencies of the test environment through a
    .pth line (so nothing is downloaded); its reducelab is the wheel's alone, since
    the test environment's editable install is not on that path."""
    import json
    import os
    import subprocess
    import sys
    import sysconfig
    import venv

    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(ROOT)], check=True, capture_output=True)
    wheel = next(dist.glob("reducelab-*.whl"))
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (pathlib.Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True)
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    run_env["PATH"] = f"{env_dir / 'bin'}:{run_env['PATH']}"

    where = subprocess.run([str(python), "-c", "import reducelab; print(reducelab.__file__)"],
                           capture_output=True, text=True, check=True, env=run_env, cwd=tmp_path)
    assert where.stdout.startswith(site), where.stdout       # the wheel's copy, not the clone

    doctor = subprocess.run([str(env_dir / "bin" / "reducelab"), "doctor"], capture_output=True,
                            text=True, env=run_env, cwd=tmp_path, timeout=300)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "Reduce Lab can run here." in doctor.stdout

    # the workshop server and its dashboard page travel in the wheel (issue 24)
    serve = subprocess.run([str(env_dir / "bin" / "reducelab"), "workshop", "serve", "--help"],
                           capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=60)
    assert serve.returncode == 0 and "--data DIR" in serve.stdout, serve.stderr
    static = pathlib.Path(site) / "reducelab" / "workshop" / "static"
    assert sorted(p.name for p in static.iterdir()) == \
        ["dashboard.css", "dashboard.html", "dashboard.js"]

    lab = subprocess.run([str(env_dir / "bin" / "reducelab"), "lab", "--no-browser", "--dry-run"],
                         capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=60)
    assert lab.returncode == 0, lab.stderr
    copy = tmp_path / "reducelab-notebooks"
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(p.name for p in copy.glob("*.ipynb")) == shipped
    assert sorted(p.name for p in (copy / "solutions").glob("*.py")) == \
        sorted(p.name for p in (ROOT / "notebooks" / "solutions").glob("*.py"))
    shipped_01 = (copy / "01_all_reduce.ipynb").read_bytes()
    edited = b'{"cells": [], "note": "the learner edited this"}\n'
    (copy / "02_reduce_and_aliasing.ipynb").write_bytes(edited)
    again = subprocess.run([str(env_dir / "bin" / "reducelab"), "lab", "--dry-run"],
                           capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=60)
    assert "Kept your copies" in again.stdout                 # a second run copies nothing,
    assert (copy / "02_reduce_and_aliasing.ipynb").read_bytes() == edited   # and keeps the edit
    assert (copy / "01_all_reduce.ipynb").read_bytes() == shipped_01

    executed = subprocess.run(
        [str(python), "-m", "nbconvert", "--to", "notebook", "--execute",
         "--ExecutePreprocessor.timeout=300", "--output", "executed.ipynb",
         str(copy / "01_all_reduce.ipynb")],
        capture_output=True, text=True, env=run_env, cwd=copy, timeout=600)
    assert executed.returncode == 0, executed.stderr[-3000:]
    cells = json.loads((copy / "executed.ipynb").read_text())["cells"]
    outputs = [o for c in cells if c["cell_type"] == "code" for o in c["outputs"]]
    assert outputs and not [o for o in outputs if o["output_type"] == "error"]
