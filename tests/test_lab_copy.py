"""``reducelab lab`` and the learner's working copy (README, "Your copy of the notebooks"
and "Running a workshop"): the first run copies the notebooks and solutions, a later run
never overwrites a file the learner has, ``--fresh NAME`` keeps the edited copy under a
new name. Each test reads the files' bytes, not the phrase the command prints (issue 20:
a second run could overwrite an edited notebook while still printing that it kept it).

The command runs in this process (``reducelab.cli.main``) with ``--dry-run``, which does
everything but start JupyterLab; the wheel test in ``test_packaging.py`` runs the
installed command.
"""
from __future__ import annotations

import datetime
import pathlib

import pytest

from reducelab import cli

SHIPPED = cli.shipped_notebooks()
FILES = sorted(str(p.relative_to(SHIPPED)) for p in
               list(SHIPPED.glob("[0-9][0-9]_*.ipynb")) + list(SHIPPED.glob("solutions/*.py")))
FIRST = "01_all_reduce.ipynb"
SOLUTION = next(f for f in FILES if f.startswith("solutions/01_"))   # notebook 01's solution
EDITED = b'{"cells": [], "note": "my own work, edited in JupyterLab"}\n'


def lab(target: pathlib.Path, *args: str) -> int:
    return cli.main(["lab", str(target), "--dry-run", *args])


def tree(target: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()}


def test_the_shipped_notebooks_are_the_repositorys():
    assert SHIPPED == pathlib.Path(__file__).resolve().parents[1] / "notebooks"
    assert FIRST in FILES and SOLUTION.endswith(".py")


def test_the_first_run_copies_every_notebook_and_solution_byte_for_byte(tmp_path, capsys):
    target = tmp_path / "copy"
    assert lab(target) == 0
    assert tree(target) == {rel: (SHIPPED / rel).read_bytes() for rel in FILES}
    out = capsys.readouterr().out
    assert f"Copied {len(FILES)} files into {target}." in out
    assert "--ServerApp.ip=127.0.0.1" in out and f"--ServerApp.root_dir={target}" in out


def test_a_copy_folder_whose_parents_do_not_exist_yet_is_made(tmp_path):
    target = tmp_path / "course" / "week 1" / "copy"
    assert lab(target) == 0
    assert tree(target) == {rel: (SHIPPED / rel).read_bytes() for rel in FILES}


def test_a_second_run_keeps_every_edited_file_and_restores_a_deleted_one(tmp_path, capsys):
    target = tmp_path / "copy"
    lab(target)
    (target / FIRST).write_bytes(EDITED)
    (target / SOLUTION).write_bytes(b"# mine\n")
    (target / "02_reduce_and_aliasing.ipynb").unlink()
    (target / "scratch.ipynb").write_bytes(b"{}")              # the learner's own notebook
    capsys.readouterr()
    assert lab(target) == 0
    after = tree(target)
    assert after[FIRST] == EDITED
    assert after[SOLUTION] == b"# mine\n"
    assert after["02_reduce_and_aliasing.ipynb"] == (SHIPPED / "02_reduce_and_aliasing.ipynb").read_bytes()
    assert after["scratch.ipynb"] == b"{}"
    assert set(after) == set(FILES) | {"scratch.ipynb"}
    out = capsys.readouterr().out
    assert "Copied 1 file into" in out
    assert f"Kept your copies of {len(FILES) - 1} files already in {target}" in out


def test_fresh_keeps_the_edited_copy_under_a_new_name_and_copies_the_notebook_again(tmp_path, capsys):
    target = tmp_path / "copy"
    lab(target)
    (target / FIRST).write_bytes(EDITED)
    capsys.readouterr()
    assert lab(target, "--fresh", FIRST) == 0
    kept = [p for p in target.glob("01_all_reduce.*.ipynb")]
    assert len(kept) == 1 and kept[0].read_bytes() == EDITED
    assert (target / FIRST).read_bytes() == (SHIPPED / FIRST).read_bytes()
    assert f"Kept your edited copy as {kept[0].name}." in capsys.readouterr().out


def test_fresh_twice_in_the_same_second_keeps_both_earlier_copies(tmp_path, monkeypatch):
    """The kept copy's name carries the time to the second: a second --fresh within that
    second must not replace the first kept copy (found by this test: it did)."""
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)
    monkeypatch.setattr(cli.datetime, "datetime", Frozen)
    target = tmp_path / "copy"
    lab(target)
    (target / FIRST).write_bytes(EDITED)
    lab(target, "--fresh", FIRST)
    (target / FIRST).write_bytes(EDITED + b"second edit\n")
    lab(target, "--fresh", FIRST)
    kept = {p.name: p.read_bytes() for p in target.glob("01_all_reduce.*.ipynb")}
    assert kept == {"01_all_reduce.20260102-030405.ipynb": EDITED,
                    "01_all_reduce.20260102-030405-2.ipynb": EDITED + b"second edit\n"}
    assert (target / FIRST).read_bytes() == (SHIPPED / FIRST).read_bytes()


def test_fresh_with_a_name_that_is_no_notebook_changes_nothing_and_lists_the_notebooks(tmp_path, capsys):
    target = tmp_path / "copy"
    lab(target)
    (target / FIRST).write_bytes(EDITED)
    before = tree(target)
    capsys.readouterr()
    assert lab(target, "--fresh", "01_all_reduce") == 2
    err = capsys.readouterr().err
    assert "--fresh takes notebook names; 01_all_reduce is not one" in err
    assert FIRST in err and "11_when_ranks_disagree.ipynb" in err
    assert tree(target) == before


def test_no_notebooks_next_to_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "pkg" / "reducelab" / "cli.py"))
    monkeypatch.setattr(cli.sysconfig, "get_path", lambda *a, **k: str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="make wheel"):
        cli.shipped_notebooks()
