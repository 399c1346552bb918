"""The workshop dashboard in headless Chromium: it shows a new report without a reload,
highlights who is stuck, opens a solution, and shows every name as text.

The server is the real one (``reducelab workshop serve`` on loopback, see
``tests/workshop_server.py``); Chromium is the system one, as in ``test_lab.py``. A
screenshot goes to ``artifacts/browser/dashboard.png``.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys

import pytest
from playwright.sync_api import expect

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from workshop_server import call, report, start  # noqa: E402

ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
HOSTILE = '<img src=x onerror="window.__injected = 1">'
"""A name the join API refuses (it has < and >); put straight into the database to show
that the page would print it as text anyway."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from reducelab.workshop.catalog import read_catalog
    from reducelab.workshop.server import Store
    data = tmp_path_factory.mktemp("dashboard")
    store = Store(data, read_catalog(ROOT / "notebooks"))
    store.join(HOSTILE, None)
    store.close()
    s = start(data)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def page(server):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"The browser test needs Chromium at {CHROMIUM}: run `make browser` "
                    f"(installs the Debian package 'chromium') or set CHROMIUM=/path.")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            yield page
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            browser.close()


def cell(page, learner: int, column: str):
    return page.locator(f'tr[data-learner="{learner}"] td[data-column="{column}"]')


def test_without_the_token_the_page_is_refused(server, page):
    assert page.goto(server.base + "/dashboard").status == 401
    assert page.goto(server.base + "/dashboard?token=wrong").status == 403


def test_the_dashboard_shows_a_new_report_without_a_reload(server, page):
    ada = call("POST", server.join, {"name": "Ada"})[1]
    eve = call("POST", server.join, {"name": 'Eve & "Mo"'})[1]
    call("POST", server.base + "/api/report", report("answer_1", "passed"), token=ada["secret"])
    page.goto(server.dashboard)
    page.wait_for_selector("#connection[data-state=live]", timeout=15_000)
    names = page.locator("td.name").all_inner_texts()
    assert "Ada" in names and 'Eve & "Mo"' in names and HOSTILE in names
    assert page.locator("td.name img").count() == 0
    assert page.evaluate("window.__injected") is None
    assert cell(page, ada["learner"], "05:answer_1").inner_text() == "✓"
    assert cell(page, ada["learner"], "05:check_mesh_sync").inner_text() == ""

    page.evaluate("window.__same_page = true")
    for _ in range(2):
        call("POST", server.base + "/api/report", report("check_mesh_sync", "failed",
                                                         mistake="divided twice"),
             token=ada["secret"])
    failing = cell(page, ada["learner"], "05:check_mesh_sync")
    expect(failing).to_have_text(re.compile(r"^✗ 2 · 0 min$"), timeout=10_000)
    assert "divided twice" in failing.get_attribute("title")
    assert "failing" in failing.get_attribute("class")
    assert page.evaluate("window.__same_page") is True          # the same page, not reloaded

    # a group call that timed out flags the learner at once; a failed check, after N minutes
    call("POST", server.base + "/api/report", report("timeout", "timeout", notebook="11"),
         token=eve["secret"])
    eve_row = page.locator(f'tr[data-learner="{eve["learner"]}"]')
    expect(eve_row).to_have_class(re.compile(r"\bflagged\b"), timeout=10_000)
    assert "⚠ group call timed out 0 min ago" in eve_row.inner_text()
    ada_row = page.locator(f'tr[data-learner="{ada["learner"]}"]')
    assert "flagged" not in (ada_row.get_attribute("class") or "")   # failed, but just now
    assert "stuck" not in ada_row.inner_text()
    page.fill("#stuck-minutes", "0")
    expect(ada_row).to_have_class(re.compile(r"\bflagged\b"))
    assert "⚠ stuck 0 min" in ada_row.inner_text()
    # answering a question does not clear it; passing the exercise does
    call("POST", server.base + "/api/report", report("answer_2", "failed"), token=ada["secret"])
    expect(cell(page, ada["learner"], "05:answer_2")).to_have_text(re.compile("^✗ 1"))
    assert "⚠ stuck" in ada_row.inner_text()
    call("POST", server.base + "/api/report", report("check_mesh_sync", "passed"),
         token=ada["secret"])
    expect(failing).to_have_text("✓")
    assert "stuck" not in ada_row.inner_text()
    assert "flagged" not in (ada_row.get_attribute("class") or "")
    page.fill("#stuck-minutes", "5")
    assert page.evaluate("window.__same_page") is True


def test_the_instructor_opens_a_solution_from_the_page(server, page):
    lin = call("POST", server.join, {"name": "Lin"})[1]
    url = server.base + "/api/solutions/05_token_weighted_sync.py"
    assert call("GET", url, token=lin["secret"])[0] == 403
    button = page.locator('button.unlock[data-solution="05_token_weighted_sync.py"]')
    assert button.get_attribute("data-open") == "false"
    button.click()
    page.wait_for_selector('button.unlock[data-solution="05_token_weighted_sync.py"][data-open="true"]',
                           timeout=10_000)
    status, text, _ = call("GET", url, token=lin["secret"])
    assert status == 200 and "def sync_grads" in text
