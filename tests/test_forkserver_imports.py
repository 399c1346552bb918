"""The forkserver's later imports (reducelab/forkserver_imports.py): the first group
starts before the server imports what DDP, DTensor and FSDP need; every later group
inherits those modules, even one started right after the first. Each case runs in a
fresh process, since the forkserver lives as long as the process that started it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CASE = """
import json, sys, time
from reducelab import LocalGroup

def state():
    import signal, sys
    return {{"modules": [m in sys.modules for m in ("torch.distributed.tensor", "torch._dynamo",
                                                      "torch.distributed.fsdp",
                                                      "torch.distributed.checkpoint", "fsspec")],
             "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL}}

g = LocalGroup(world_size=2, timeout=60)
first = g.run(state)[0]
time.sleep({pause})
g.resize(3)
later = g.run(state)[0]
g.close()
print("RESULT", json.dumps({{"first": first, "later": later}}))
"""


def run_case(pause: float, preload: str = "full") -> dict:
    env = {**__import__("os").environ, "REDUCELAB_PRELOAD": preload}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CASE.format(pause=pause))],
                         capture_output=True, text=True, timeout=240, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[-1][7:])


def test_a_resize_right_after_the_first_group_gets_the_later_imports():
    """The second group asks the server to import now and waits for it: its ranks hold
    DTensor, dynamo and FSDP when they start; the first group's did not (the setup cell
    did not wait for them). No rank keeps the server's SIGUSR1 handler."""
    r = run_case(pause=0.0)
    assert r["first"]["modules"] == [False] * 5
    assert r["later"]["modules"] == [True] * 5
    assert r["first"]["sigusr1_default"] and r["later"]["sigusr1_default"]


def test_eager_preload_imports_everything_before_the_first_group():
    r = run_case(pause=0.0, preload="eager")
    assert r["first"]["modules"] == [True] * 5
