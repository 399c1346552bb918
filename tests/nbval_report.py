"""A pytest plugin for the nbval runs (``-p tests.nbval_report`` in the Makefile): when a
notebook cell fails, its report also shows the stream text the cell printed this run.

nbval names an unexpected output field ("Unexpected output fields from running code:
{'stderr'}") but not its text, and a rare one cannot be found again by re-running. The
text is what tells where it came from: a rank, the forkserver, the kernel or torch.
"""
from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    outputs = getattr(item, "test_outputs", None)
    if report.when != "call" or not report.failed or not outputs:
        return
    streams = {}
    for out in outputs:
        if out.get("output_type") == "stream":
            streams[out["name"]] = streams.get(out["name"], "") + out["text"]
    for name, text in streams.items():
        report.sections.append((f"this run's {name} of the cell", text))
