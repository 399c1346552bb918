"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages."""
from __future__ import annotations

import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONDA_NAMES = {"torch": "pytorch"}  # pip name -> conda name, where they differ


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

    assert conda.pop("cpuonly") == "" and conda.pop("pip") == ""
    assert conda == wanted
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
