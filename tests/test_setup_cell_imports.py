"""What a notebook's setup cell imports, and what it leaves for later (issue 23: a setup
cell within 1.3 times a bare ``import torch``). matplotlib costs about 0.3 s of CPU after
torch; the plot and explorer modules import it at the first figure
(``reducelab.plots.agg``), not when the setup cell imports them. Each case runs in a fresh
process, since this one has imported matplotlib long ago."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def setup_imports(path: Path) -> str:
    """The import statements of ``path``'s first code cell (also those inside its ``try``),
    one per line, without the rest of the cell (its groups and runs)."""
    cell = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    tree = ast.parse("".join(cell["source"]))
    return "\n".join(ast.unparse(node) for node in ast.walk(tree)
                     if isinstance(node, (ast.Import, ast.ImportFrom)))


def fresh(code: str) -> dict:
    """Run ``code`` in a fresh Python process (no forkserver started early) and return what
    it printed after ``RESULT``, as JSON."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=240,
                         env={**__import__("os").environ, "REDUCELAB_PREWARM": "0"})
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[-1][7:])


def test_no_setup_cell_imports_matplotlib():
    """Every notebook's setup-cell imports leave matplotlib unimported, and so does every
    plot, explorer and check module a later cell may import (all but ``plots.agg``)."""
    assert len(NOTEBOOKS) >= 18
    code = "import json, sys\n"
    for path in NOTEBOOKS:
        code += setup_imports(path) + "\n"
    code += textwrap.dedent("""
        import importlib, pkgutil, reducelab
        for m in pkgutil.walk_packages(reducelab.__path__, "reducelab."):
            if m.name.split(".")[1] in ("plots", "widgets", "checks") and m.name != "reducelab.plots.agg":
                importlib.import_module(m.name)
        """)
    code += ("print('RESULT', json.dumps(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('matplotlib', 'PIL'))))\n")
    assert "reducelab.plots" in code and "reducelab.widgets" in code
    assert fresh(code) == []


def test_the_first_figure_imports_matplotlib_with_the_project_s_style():
    """The first figure imports matplotlib, the Agg canvas and the project's settings:
    ``plots.STYLE`` in ``rcParams`` (so a learner's own plot after it follows the same
    palette), and the remembered text layout on the canvas."""
    result = fresh("""
        import json, sys
        from reducelab import plots
        before = "matplotlib" in sys.modules
        fig = plots.new_figure(2, 2)
        import matplotlib
        from matplotlib.text import Text
        from reducelab.plots import agg
        print("RESULT", json.dumps({
            "before": before,
            "canvas": type(fig.canvas) is agg.Canvas,
            "style": all(matplotlib.rcParams[k] == v for k, v in plots.STYLE.items()),
            "backend": matplotlib.get_backend().lower(),
            "layout": Text._get_layout is agg._remembered_layout}))
    """)
    assert result == {"before": False, "canvas": True, "style": True, "backend": "agg",
                      "layout": True}


def test_a_kernel_imports_matplotlib_while_the_learner_reads():
    """In a Jupyter kernel the setup cell ends without matplotlib; once the kernel has been
    idle for ``plots.IDLE_IMPORT_DELAY`` seconds it has imported it (on its own thread,
    from its event loop), so the first figure does not wait for it either."""
    import time

    from jupyter_client.manager import start_new_kernel

    from reducelab import plots
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        def run(code: str) -> str:
            out: list[str] = []
            kc.execute_interactive(code, timeout=120, output_hook=lambda m: out.append(
                m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
            return "".join(out).strip()
        assert run("from reducelab.plots import show\nfrom reducelab.widgets.loss import "
                   "LossExplorer\nimport sys\nprint('matplotlib' in sys.modules)") == "False"
        deadline = time.monotonic() + 30
        while run("print('reducelab.plots.agg' in sys.modules)") != "True":
            assert time.monotonic() < deadline, "the idle kernel never imported matplotlib"
            time.sleep(plots.IDLE_IMPORT_DELAY)
        assert float(run("import matplotlib\nprint(matplotlib.rcParams['font.size'])")) == \
            plots.STYLE["font.size"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _kernel_runner():
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3")

    def run(code: str) -> str:
        out: list[str] = []
        kc.execute_interactive(code, timeout=180, output_hook=lambda m: out.append(
            m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
        return "".join(out).strip()
    return km, kc, run


RANKS_HAVE = ("print(g.run(lambda: [m in __import__('sys').modules for m in "
              "('torch.distributed.tensor', 'torch.distributed.fsdp')]))")


def test_a_kernel_imports_what_the_setup_cell_names_while_the_learner_reads():
    """``import_while_reading`` (issue 23: DTensor and FSDP cost about 0.6 s each after
    torch, so a setup cell that imported them took 2 times a bare ``import torch``): the
    setup cell ends without them; once the kernel has been idle they are imported, and
    the setup cell's group, whose ranks have run nothing, is started again from the
    forkserver with them, so a rank's first DTensor or FSDP call imports nothing."""
    import time

    from reducelab import processes
    km, kc, run = _kernel_runner()
    try:
        assert run("import sys\nfrom reducelab import LocalGroup, import_while_reading\n"
                   "print(import_while_reading('torch.distributed.tensor', "
                   "'torch.distributed.fsdp'))\ng = LocalGroup(2, timeout=60)\n"
                   "print([m in sys.modules for m in ('torch.distributed.tensor', "
                   "'torch.distributed.fsdp')])") == "True\n[False, False]"
        deadline = time.monotonic() + 60
        while run("print('torch.distributed.fsdp' in sys.modules)") != "True":
            assert time.monotonic() < deadline, "the idle kernel never imported them"
            time.sleep(processes.READING_DELAY)
        assert run(RANKS_HAVE) == "[[True, True], [True, True]]"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_run_before_the_kernel_was_idle_makes_the_imports_first():
    """Run All: the cell after the setup cell runs on the ranks at once. The first run
    makes the imports ``import_while_reading`` was given and starts the group's ranks
    again with them, as a setup cell that imported them itself got."""
    km, kc, run = _kernel_runner()
    try:
        assert run("import sys\nfrom reducelab import LocalGroup, import_while_reading\n"
                   "import_while_reading('torch.distributed.tensor', 'torch.distributed.fsdp')\n"
                   "g = LocalGroup(2, timeout=60)\n" + RANKS_HAVE) == "[[True, True], [True, True]]"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_import_while_reading_names_a_module_it_cannot_find_and_schedules_nothing():
    result = fresh("""
        import json, sys
        from reducelab import import_while_reading, processes
        try:
            import_while_reading("torch.distributed.tensor", "torch.distributed.tensr")
        except ModuleNotFoundError as e:
            error = str(e)
        print("RESULT", json.dumps({"error": error, "pending": processes._reading,
                                    "imported": "torch.distributed.tensor" in sys.modules,
                                    "now": import_while_reading("torch.distributed.fsdp"),
                                    "fsdp": "torch.distributed.fsdp" in sys.modules}))
    """)
    assert result["error"].startswith("import_while_reading(): no module named "
                                      "'torch.distributed.tensr' is installed")
    assert result["pending"] == [] and not result["imported"]
    assert result["now"] is False and result["fsdp"]     # outside a kernel: at once
