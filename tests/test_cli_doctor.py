"""``reducelab doctor`` (README, "Running a workshop"): it checks the torch version and
build, the start method, the loopback interface, cores against world size 4, free
memory, the widget manager and a real group of 2 ranks; each failed check prints its
fix, and the exit status says whether the notebooks can run. And the ``reducelab lab``
command line: JupyterLab on 127.0.0.1 only.

The machine's answers are replaced where a check must be seen failing (few cores, no
memory, no loopback, a CUDA build); ``test_packaging.py`` runs the installed command.
"""
from __future__ import annotations

import subprocess
import types

import pytest

from reducelab import cli


class _Done:
    def __init__(self, stdout: str, captured: bool = True):
        self.stdout, self.stderr = (stdout, "") if captured else (None, None)


@pytest.fixture()
def lab_lists_the_manager(monkeypatch):
    """``jupyter labextension list`` answers at once, with the widget manager in it."""
    calls = []

    def run(cmd, **kwargs):                 # what subprocess.run gives: text only if captured
        calls.append(cmd)
        return _Done("@jupyter-widgets/jupyterlab-manager v5.0.15 enabled OK",
                     kwargs.get("capture_output", False) and kwargs.get("text", False))
    monkeypatch.setattr(cli.subprocess, "run", run)
    return calls


def by_what(checks, words):
    hits = [c for c in checks if words in c["what"]]
    assert len(hits) == 1, (words, [c["what"] for c in checks])
    return hits[0]


def test_every_check_passes_here_and_says_what_it_checked(lab_lists_the_manager):
    checks = cli.doctor_checks(smoke=False)
    assert all(set(c) == {"ok", "what", "fix"} for c in checks)
    import torch
    assert by_what(checks, "Python 3.")["ok"] is True
    assert by_what(checks, f"torch {torch.__version__}")["ok"] is True
    assert by_what(checks, "torch is a CPU build")["ok"] is True
    assert by_what(checks, "gloo backend available")["ok"] is True
    assert by_what(checks, "ranks start with forkserver")["ok"] is True
    assert by_what(checks, "loopback interface lo (gloo stays on 127.0.0.1)")["ok"] is True
    assert by_what(checks, "GiB of memory free")["ok"] is True
    assert by_what(checks, "ipywidgets and its JupyterLab extension are installed here")["ok"] is True
    assert by_what(checks, "JupyterLab here lists the widget manager")["ok"] is True
    assert lab_lists_the_manager and lab_lists_the_manager[0][-3:] == ["jupyter", "labextension", "list"]


def test_few_cores_is_a_note_and_little_memory_a_failure_with_its_fix(lab_lists_the_manager, monkeypatch):
    import psutil
    monkeypatch.setattr(psutil, "cpu_count", lambda logical: 2 if logical else 1)   # logical cores
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=0.5 * 2**30))
    checks = cli.doctor_checks(smoke=False)
    cores = by_what(checks, "2 cores for world sizes of 4 (up to 8)")
    assert cores["ok"] is None and "ranks outnumber cores" in cores["fix"]
    memory = by_what(checks, "0.5 GiB of memory free")
    assert memory["ok"] is False and "needs about 1 GiB" in memory["fix"]
    monkeypatch.setattr(psutil, "cpu_count", lambda logical: 4 if logical else 2)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1.0 * 2**30))
    checks = cli.doctor_checks(smoke=False)
    assert by_what(checks, "4 cores for world sizes")["ok"] is True
    assert by_what(checks, "1.0 GiB of memory free")["ok"] is True
    monkeypatch.setattr(psutil, "cpu_count", lambda logical: None)          # unknown
    assert by_what(cli.doctor_checks(smoke=False), "1 cores for world sizes")["ok"] is None


def test_no_loopback_a_cuda_build_spawn_and_an_unlisted_manager(lab_lists_the_manager, monkeypatch):
    import torch

    import reducelab.launch
    monkeypatch.setattr(reducelab.launch.psutil, "net_if_addrs", lambda: {})
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("REDUCELAB_START_METHOD", "spawn")
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: _Done("no extensions"))
    checks = cli.doctor_checks(smoke=False)
    loop = by_what(checks, "no network interface holds 127.0.0.1")
    assert loop["ok"] is False and "bring up the loopback interface" in loop["fix"]
    cuda = by_what(checks, "torch is a CUDA build (12.8)")
    assert cuda["ok"] is None and "CPU build is about ten times smaller" in cuda["fix"]
    method = by_what(checks, "ranks start with spawn")
    assert method["ok"] is True and "each group start imports torch in every rank" in method["what"]
    manager = by_what(checks, "JupyterLab here does not list the widget manager")
    assert manager["ok"] is None and "install jupyterlab_widgets there" in manager["fix"]


@pytest.mark.parametrize("missing", ["ipywidgets", "jupyterlab_widgets"])
def test_either_widget_package_missing_fails_with_its_fix(lab_lists_the_manager, monkeypatch, missing):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))
    check = by_what(cli.doctor_checks(smoke=False), "ipywidgets or jupyterlab_widgets missing")
    assert check["ok"] is False and "then restart JupyterLab" in check["fix"]


def test_no_jupyterlab_is_a_note(monkeypatch):
    def missing(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, 60)
    monkeypatch.setattr(cli.subprocess, "run", missing)
    check = by_what(cli.doctor_checks(smoke=False), "no JupyterLab in this environment")
    assert check["ok"] is None


def test_the_report_prints_each_check_its_fix_and_the_verdict(monkeypatch, capsys):
    monkeypatch.setattr(cli, "doctor_checks", lambda smoke: [
        cli._check(True, "fine", "never shown"), cli._check(None, "a note", "do this"),
        cli._check(False, "broken", "fix that")])
    assert cli.main(["doctor", "--quick"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "ok   fine", "note a note", "     -> do this", "FAIL broken", "     -> fix that",
        "1 check failed: see the fixes above."]
    monkeypatch.setattr(cli, "doctor_checks", lambda smoke: [cli._check(False, "a", "x")] * 2)
    assert cli.main(["doctor"]) == 1
    assert capsys.readouterr().out.endswith("2 checks failed: see the fixes above.\n")
    asked = []
    monkeypatch.setattr(cli, "doctor_checks", lambda smoke: asked.append(smoke) or [cli._check(None, "n")])
    assert cli.main(["doctor"]) == 0 and cli.main(["doctor", "--quick"]) == 0
    assert asked == [True, False]
    assert capsys.readouterr().out.endswith("Reduce Lab can run here.\n")


def test_the_smoke_check_runs_a_real_group_of_two(lab_lists_the_manager):
    smoke = by_what(cli.doctor_checks(smoke=True), "a group of 2 ranks started and ran all_reduce in")
    assert smoke["ok"] is True
    assert cli._smoke.__module__ == "reducelab.cli"


def test_a_failing_group_is_a_failed_check_with_its_error(lab_lists_the_manager, monkeypatch):
    import reducelab

    class Broken:
        def __init__(self, **kwargs):
            raise RuntimeError("could not start\nsecond line")
    monkeypatch.setattr(reducelab, "LocalGroup", Broken)
    check = by_what(cli.doctor_checks(smoke=True), "a group of 2 ranks failed")
    assert check["ok"] is False
    assert check["what"] == "a group of 2 ranks failed: RuntimeError: could not start"


def test_lab_starts_jupyterlab_on_loopback_in_the_copy(tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, **kwargs: started.append(cmd) or 0)
    monkeypatch.setattr(cli.os, "geteuid", lambda: 1000)
    assert cli.main(["lab", str(tmp_path / "copy")]) == 0
    cmd = started[0]
    assert cmd[1:3] == ["-m", "jupyterlab"]
    assert "--ServerApp.ip=127.0.0.1" in cmd and "--ServerApp.port=8888" in cmd
    assert f"--ServerApp.root_dir={tmp_path / 'copy'}" in cmd
    assert "--no-browser" not in cmd and "--allow-root" not in cmd
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    cli.main(["lab", str(tmp_path / "copy"), "--no-browser", "--port", "9999"])
    assert "--no-browser" in started[1] and "--allow-root" in started[1]
    assert "--ServerApp.port=9999" in started[1]
    out = capsys.readouterr().out
    assert f"Starting JupyterLab on http://127.0.0.1:8888/ in {tmp_path / 'copy'}" in out


def test_the_oldest_python_and_torch_pass_and_older_fail(lab_lists_the_manager, monkeypatch):
    import torch

    class Version(tuple):
        major, minor = property(lambda self: self[0]), property(lambda self: self[1])
    monkeypatch.setattr(cli.sys, "version_info", Version((3, 11, 0)))
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    checks = cli.doctor_checks(smoke=False)
    assert by_what(checks, "Python 3.11")["ok"] is True
    assert by_what(checks, "torch 2.13.0+cpu")["ok"] is True
    monkeypatch.setattr(cli.sys, "version_info", Version((3, 10, 13)))
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    checks = cli.doctor_checks(smoke=False)
    assert by_what(checks, "Python 3.10")["ok"] is False
    torch_check = by_what(checks, "torch 2.12.1")
    assert torch_check["ok"] is False and "new in torch 2.13" in torch_check["fix"]


def test_doctor_checks_run_a_real_group_unless_told_not_to(lab_lists_the_manager, monkeypatch):
    import reducelab
    started = []

    class Fake:
        def __init__(self, **kwargs):
            started.append(kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def run(self, fn):
            return [3.0, 3.0]
    monkeypatch.setattr(reducelab, "LocalGroup", Fake)
    assert by_what(cli.doctor_checks(), "a group of 2 ranks started")["ok"] is True
    assert started == [{"world_size": 2, "timeout": 60, "progress": False}]
    assert not [c for c in cli.doctor_checks(smoke=False) if "group of 2" in c["what"]]


def test_the_help_says_what_the_command_does(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "The ``reducelab`` command: ``reducelab lab [DIR]`` copies" in capsys.readouterr().out


def test_no_gloo_fails_and_no_forkserver_is_a_note(lab_lists_the_manager, monkeypatch):
    import multiprocessing

    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    checks = cli.doctor_checks(smoke=False)
    gloo = by_what(checks, "no gloo backend")
    assert gloo["ok"] is False and "this build lacks torch.distributed" in gloo["fix"]
    method = by_what(checks, "ranks start with spawn (no forkserver on this platform")
    assert method["ok"] is None                       # a note: it works, only slower


def test_without_torch_doctor_says_how_to_install_it_and_stops(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)              # import torch fails
    checks = cli.doctor_checks(smoke=True)
    assert [c["ok"] for c in checks] == [True, False]
    assert checks[1]["what"].startswith("torch is not importable")
    assert "download.pytorch.org/whl/cpu" in checks[1]["fix"]


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2 and "required: command" in capsys.readouterr().err
