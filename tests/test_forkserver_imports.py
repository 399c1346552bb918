"""The forkserver's later imports (reducelab/forkserver_imports.py): a first group whose
kernel has imported nothing of DDP, DTensor, FSDP or DCP starts before the server imports
anything they need; once the notebook uses one of them (a rank imported it, or the kernel
did, even before the first group), every group started from then on inherits it; a
notebook that never uses them never pays for them. Each case runs in a fresh process, since the forkserver lives as long as the
process that started it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CASE = """
import json, sys, time
{kernel_imports}
from reducelab import LocalGroup

def state():
    import signal, sys
    return {{"modules": [m in sys.modules for m in ("torch.distributed.tensor", "torch._dynamo",
                                                      "torch.distributed.fsdp",
                                                      "torch.distributed.checkpoint", "fsspec")],
             "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
             "checks": "reducelab.checks.sharded" in sys.modules,
             "hooks": "torch.distributed.algorithms.ddp_comm_hooks" in sys.modules,
             "serialization": "torch.utils.serialization" in sys.modules,
             "rng": __import__("torch").random.get_rng_state().tolist()}}

def use():
    {rank_imports}

g = LocalGroup(world_size=2, timeout=60)
first = g.run(state)[0]
g.run(use)
g.resize(3)
later = g.run(state)[0]
g.close()
print("RESULT", json.dumps({{"first": first, "later": later}}))
"""


def run_in_fresh_process(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh Python process with ``env`` added to the environment (the
    forkserver lives as long as the process that started it); return what it printed
    after ``RESULT``, as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, env={**__import__("os").environ, **env})
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[-1][7:])


def run_case(kernel_imports: str = "", rank_imports: str = "pass",
             preload: str = "full") -> dict:
    code = textwrap.dedent(CASE).format(kernel_imports=kernel_imports, rank_imports=rank_imports)
    return run_in_fresh_process(code, REDUCELAB_PRELOAD=preload)


def test_a_notebook_that_never_uses_them_never_imports_them():
    """Notebook 01's case: about 80 MB of PSS the forkserver family does not hold."""
    r = run_case()
    assert r["first"]["modules"] == [False] * 5
    assert r["later"]["modules"] == [False] * 5
    assert not r["later"]["hooks"] and not r["later"]["checks"]
    # every rank, of the first group too, starts with what unpickling a tensor imports
    # (torch.utils.serialization, 10 ms per fresh rank): rank_loop, preloaded, imports it
    assert r["first"]["serialization"] and r["later"]["serialization"]


def test_a_setup_cell_that_imports_torch_waits_for_nothing_more():
    """Every notebook's setup cell imports torch, and ``import torch`` imports DDP's module
    by itself (WITH_TORCH): that says nothing about the notebook, so the first group's
    ranks start without dynamo, and the resize after them too. (From fbcc9a3 to this
    test, every first group waited for dynamo: the setup cell took 2.4 times a bare
    ``import torch``, and one learner held 0.51 GiB instead of 0.44.)"""
    r = run_case(kernel_imports="import torch\nimport torch.distributed as dist")
    assert r["first"]["modules"] == [False] * 5
    assert r["later"]["modules"] == [False] * 5


def test_import_torch_brings_exactly_the_later_modules_the_kernel_discounts():
    """WITH_TORCH is what a fresh ``import torch`` puts of LATER in sys.modules: a torch
    that imports more (or less) by itself fails here, not in a slow setup cell."""
    from reducelab.forkserver_imports import LATER, WITH_TORCH
    code = ("import sys, torch\n"
            f"print([m for m in {list(LATER)!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == repr(list(WITH_TORCH)), out.stderr[-2000:]


def test_what_a_rank_imported_reaches_the_group_started_right_after():
    """The run reports DTensor; the resize waits for the server's import, so its ranks
    start with DTensor, and with nothing that was not asked for (DCP, FSDP). No rank
    keeps the server's SIGUSR1 handler."""
    r = run_case(rank_imports="import torch.distributed.tensor")
    assert r["first"]["modules"] == [False] * 5
    assert r["later"]["modules"] == [True, False, False, False, False]
    assert r["first"]["sigusr1_default"] and r["later"]["sigusr1_default"]


def test_what_the_kernel_imported_before_the_first_group_reaches_its_ranks():
    """A setup cell that imports DCP (say) says its ranks will use it: the first group
    waits for the server to import it, so that the ranks' first call does not import it
    under the group's timeout."""
    r = run_case(kernel_imports="import torch.distributed.checkpoint")
    assert r["first"]["modules"][3]                    # DCP, and what it imports with it
    assert r["first"]["modules"][0] and r["first"]["modules"][2]
    assert r["later"]["modules"] == r["first"]["modules"]


def test_a_kernel_that_imported_ddp_gets_ranks_with_what_ddp_imports_when_built():
    """Notebook 13's setup cell: DDP imported in the kernel. Building DDP imports dynamo
    on a rank (FIRST_USE); the first group's ranks have it, so the first DDP(model) does
    not import it under the group's 3 s timeout. DCP, not asked for, does not come."""
    r = run_case(kernel_imports="from torch.nn.parallel import DistributedDataParallel")
    assert r["first"]["modules"][1] and not r["first"]["modules"][3]


def test_eager_preload_imports_everything_before_the_first_group():
    r = run_case(preload="eager")
    assert r["first"]["modules"] == [True] * 5


def test_the_checks_the_kernel_imported_reach_the_next_group_not_the_first():
    """Notebook 08's setup cell imports reducelab.checks.sharded, whose helpers its rank
    functions call: a fresh rank that unpickles such a function imports it (47 to 64 ms
    per rank at 8 ranks, measured). The first group starts without waiting for it (the
    setup cell waits for torch alone); the group after a resize inherits it from the
    server, and a rank that draws without seeding draws what the first group's ranks
    drew."""
    r = run_case(kernel_imports="import reducelab.checks.sharded")
    assert not r["first"]["checks"]
    assert r["later"]["checks"]
    assert r["later"]["modules"] == [False] * 5      # it imports no DTensor, FSDP or DCP
    assert r["later"]["rng"] == r["first"]["rng"]


def test_the_checks_a_rank_imported_reach_the_group_started_right_after():
    r = run_case(rank_imports="import reducelab.checks.sharded")
    assert not r["first"]["checks"] and r["later"]["checks"]
    assert r["later"]["rng"] == r["first"]["rng"]


def test_the_server_imports_only_what_may_be_asked_for(tmp_path, monkeypatch):
    """Of the names in the kernel's file, the server takes LATER's (in LATER's order) and
    reducelab's rank-side modules (sorted); a kernel-only module (a widget, matplotlib)
    or any other name is never imported into the server that forks every rank."""
    from reducelab import forkserver_imports as fi
    path = tmp_path / "later"
    path.write_text("reducelab.data\nos\nreducelab.widgets.sharded\nmatplotlib\n"
                    "torch.distributed.fsdp\nreducelab.checks.sharded\n"
                    "torch.distributed.tensor\nreducelab.checksum\n", encoding="utf-8")
    monkeypatch.setenv(fi.FILE_ENV, str(path))
    assert fi.wanted() == ["torch.distributed.tensor", "torch.distributed.fsdp",
                           "reducelab.checks.sharded", "reducelab.data"]


def test_what_a_module_does_at_import_in_the_server_leaves_a_rank_as_it_was(tmp_path,
                                                                          monkeypatch):
    """A module that seeds torch's global generator at import, and runs torch ops there,
    changes neither the random state the server's ranks inherit nor its thread count, and
    its ops run on one thread (no OpenMP pool in a process that forks ranks)."""
    import torch

    from reducelab import forkserver_imports as fi
    (tmp_path / "seeds_at_import.py").write_text(
        "import torch\nTHREADS = torch.get_num_threads()\ntorch.manual_seed(123)\n"
        "DRAWN = torch.randn(64, 64).sum().item()\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    state, threads = torch.random.get_rng_state().clone(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fi._import(["seeds_at_import", "no_such_module_here"])   # the second: skipped
        import seeds_at_import
        assert seeds_at_import.THREADS == 1
        assert torch.get_num_threads() == 2
        assert torch.equal(torch.random.get_rng_state(), state)
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop("seeds_at_import", None)


def test_import_torch_alone_does_not_bring_what_a_first_tensor_imports():
    """What rank_loop imports for a rank's first unpickled tensor is not already there."""
    out = subprocess.run([sys.executable, "-c", "import sys, torch; "
                          "print('torch.utils.serialization' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_kernel_that_imported_ddp_comm_hooks_gets_ranks_with_them():
    """Notebook 16's setup cell imports DDP's communication hooks; its rank function
    imports them again on each fresh rank (14 ms per rank) unless the server has."""
    r = run_case(kernel_imports="import torch.distributed.algorithms.ddp_comm_hooks")
    assert r["later"]["hooks"]


def test_what_a_process_reports_follows_its_imports():
    """``imported()`` (what a rank reports after each job) is read again once a module
    comes in: a check imported after a first report is in the next one."""
    code = ("import sys, torch\nfrom reducelab.forkserver_imports import imported\n"
            "a = imported()\nimport reducelab.checks.loss\nb = imported()\n"
            "print(a == [m for m in a if not m.startswith('reducelab.')], "
            "'reducelab.checks.loss' in b, 'reducelab.checks' in b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr[-2000:]


EARLY = """
import json, time
from reducelab import LocalGroup            # first, as in every setup cell: the pre-warm
from reducelab import processes
{kernel_imports}

def asked():
    return sorted(set().union(*processes._later_asked.values()))

deadline = time.monotonic() + {wait}
while time.monotonic() < deadline and not asked():
    time.sleep(0.05)
before_group = asked()
g = LocalGroup(world_size=2, timeout=60)
have = g.run(lambda: "torch.distributed.checkpoint" in __import__("sys").modules)[0]
g.close()
print("RESULT", json.dumps({{"before_group": before_group, "first_has_dcp": have}}))
"""


def run_early(kernel_imports: str, wait: float) -> dict:
    code = textwrap.dedent(EARLY).format(kernel_imports=kernel_imports, wait=wait)
    return run_in_fresh_process(code, REDUCELAB_PREWARM="1", REDUCELAB_PRELOAD="full")


def test_what_the_setup_cell_imports_is_asked_for_before_the_first_group_starts():
    """Notebook 14's setup cell imports DCP first and starts its group seconds later
    (after plotting, the data and a reference run): the pre-warm asks the server for DCP
    as soon as the kernel has it, so the server imports it meanwhile, and the first
    group's ranks still start with it."""
    r = run_early("import torch.distributed.checkpoint", wait=60)
    assert "torch.distributed.checkpoint" in r["before_group"], r
    assert r["first_has_dcp"]


def test_a_setup_cell_of_torch_alone_is_asked_for_nothing_early():
    """Notebook 01's case with the pre-warm: ``import torch`` asks the server for nothing,
    before the first group or with it, and its ranks never hold DCP."""
    r = run_early("import torch\nimport torch.distributed as dist", wait=5)
    assert r == {"before_group": [], "first_has_dcp": False}


KERNEL = """
import json, os
os.environ["REDUCELAB_PREWARM"] = "1"          # the pre-warm, as in a Jupyter kernel
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
cells = {cells!r}
seen = []
for cell in cells:
    result = shell.run_cell(cell)
    assert result.success, result.error_in_exec
    seen.append(shell.user_ns.pop("seen", None))
shell.run_cell("group.close()")
print("RESULT", json.dumps(seen))
"""

SETUP = """
from reducelab import LocalGroup, processes
import torch
{imports}
group = LocalGroup(world_size=2, timeout=60)
{more}
seen = {{"released_in_cell": processes.released_later(), "held": processes.forked_in_hold()}}
"""

STATE = """
def state():
    import sys
    return "torch._dynamo" in sys.modules
dynamo = group.run(state)
seen = {"released": processes.released_later(), "dynamo": dynamo, "restarts": group.restarts}
"""


def run_kernel_cells(*cells: str, preload: str = "full") -> list:
    """Run ``cells`` one after the other in an IPython shell in a fresh process (its
    ``post_run_cell`` event fires after each, as in a Jupyter kernel); return what each
    left in ``seen``."""
    code = textwrap.dedent(KERNEL).format(cells=[textwrap.dedent(c) for c in cells])
    return run_in_fresh_process(code, REDUCELAB_PRELOAD=preload)


def test_a_setup_cell_that_imports_ddp_starts_its_group_at_once_and_its_first_run_has_dynamo():
    """Notebook 03's setup cell imports DDP. The server forks nothing while it imports, and
    building DDP imports dynamo (about 1.3 s of CPU): the setup cell used to wait for it
    (2.0 s against 0.75 s for a bare ``import torch``). The request now waits for the end
    of the cell; then the server imports while the learner reads, and the group, which
    has run nothing yet, is started again from it before its first run: that run's ranks
    have dynamo, so the first ``DDP(model)`` does not import it under the group's timeout."""
    setup, first = run_kernel_cells(
        SETUP.format(imports="from torch.nn.parallel import DistributedDataParallel as DDP",
                     more=""), STATE)
    assert setup == {"released_in_cell": False, "held": True}
    assert first == {"released": True, "dynamo": [True, True], "restarts": 2}


def test_a_run_in_the_setup_cell_itself_gets_ranks_with_dynamo():
    """The hold ends at a group's first run too: a cell that starts a group and runs DDP
    at once gets ranks with dynamo, as before the hold."""
    seen = run_kernel_cells(
        SETUP.format(imports="from torch.nn.parallel import DistributedDataParallel as DDP",
                     more="") + STATE)
    assert seen == [{"released": True, "dynamo": [True, True], "restarts": 2}]


def test_a_setup_cell_that_imports_torch_alone_is_not_started_twice():
    """Notebook 01's case in a kernel: nothing of DDP, DTensor, FSDP or DCP is asked for,
    so the group's first run runs on the ranks the setup cell started."""
    setup, first = run_kernel_cells(SETUP.format(imports="", more=""), STATE)
    assert setup == {"released_in_cell": False, "held": True}
    assert first == {"released": False, "dynamo": [False, False], "restarts": 1}


def test_a_second_group_in_the_setup_cell_does_not_wait_either():
    """Notebook 13's setup cell starts two groups: the second one's ranks would have
    waited for the server's import of dynamo. Both start at once, and each gets dynamo
    before its first run."""
    setup, first, other = run_kernel_cells(
        SETUP.format(imports="from torch.nn.parallel import DistributedDataParallel as DDP",
                     more="other = LocalGroup(world_size=2, timeout=60)"),
        STATE,
        'seen = {"dynamo": other.run(state), "restarts": other.restarts}\nother.close()')
    assert setup == {"released_in_cell": False, "held": True}
    assert first == {"released": True, "dynamo": [True, True], "restarts": 2}
    assert other == {"dynamo": [True, True], "restarts": 2}


def test_an_eager_server_s_first_group_is_not_started_twice():
    """``REDUCELAB_PRELOAD=eager`` imported dynamo before it served the setup cell's ranks:
    their first run needs no new ones."""
    setup, first = run_kernel_cells(
        SETUP.format(imports="from torch.nn.parallel import DistributedDataParallel as DDP",
                     more=""), STATE, preload="eager")
    assert first == {"released": False, "dynamo": [True, True], "restarts": 1}
