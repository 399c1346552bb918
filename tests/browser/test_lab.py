"""Real-browser test: every notebook in JupyterLab, in headless Chromium, as a learner uses it.

It starts JupyterLab on 127.0.0.1 with temporary config, data, runtime and workspace
directories and a copy of the notebooks with their outputs cleared (so nothing in the
repository is saved over, and every output seen comes from this run). For each notebook:

1. Restart the kernel and run all cells; no cell may show an error.
2. Move every control of every explorer at least once. After each move the explorer's
   figure must change, and no explorer may say its group is closed or show a traceback:
   the explorers must be live after Run All. Where a move starts a long measurement
   (notebook 10), the page must show its interim figure and "⏳" message while the
   kernel is still measuring, and then the complete one.
3. Answer one predict-then-run question wrongly, through the page (typing in the answer
   cell), run it and its question cell, and check that the verdict says "Not yet".

In notebook 02, between steps 2 and 3, one drag: a slider dragged across its range with
the mouse; the figure that stays must be the one for where it stopped, and the changes
must not queue (in 02's own test, so that it costs no second Run All).

On a failure a screenshot is saved under ``artifacts/browser/``; the Run All times are
written to ``artifacts/browser/run_times.json``. Chromium comes from the Debian package
(``make browser``); no browser is downloaded. Where it is missing the test fails and
says so: it never skips.
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@dataclass
class Plan:
    """What the test does in one notebook beyond Run All.

    Attributes:
        answer: the answer cell's first line as committed, and a wrong answer to type
            in its place.
        text_inputs: for explorers with text boxes, a valid value to type in each,
            by the box's description (a dropdown, slider or toggle needs none).
        interim: a move starts a measurement of seconds, which shows an interim
            figure and a message starting "⏳" before the complete one (notebook 10's
            first sweep of a collective or world size): the page must show it. The
            test's kernels show it after 0.02 s, not 0.3 (:data:`INTERIM_SOON`), so that
            it does not depend on this machine being slow.
        drag: the label of a slider of the first explorer to drag across its range
            with the mouse (:func:`drag_across`), after every control was moved.
    """

    answer: tuple[str, str]
    text_inputs: dict[str, str] = field(default_factory=dict)
    interim: bool = False
    drag: str | None = None


PLANS = {
    "01_all_reduce.ipynb": Plan(("answer_1 = None", "answer_1 = 20.0")),
    # the drag: notebook 02's tensor size, 1 to 32 elements, which follows the hand
    # (continuous updates) and runs a real reduce for every value
    "02_reduce_and_aliasing.ipynb": Plan(("answer_1 = None", "answer_1 = [0]"),
                                         drag="elements"),
    "03_loss_aggregation.ipynb": Plan(("answer_1 = None", "answer_1 = 0.5"),
                                      {"local batch sizes": "2,6,4"}),
    "04_ddp_gradients.ipynb": Plan(("answer_1 = None", "answer_1 = 3.0")),
    "05_device_mesh_sync.ipynb": Plan(("answer_1 = None", "answer_1 = [0, 1]")),
    "06_ring_all_reduce.ipynb": Plan(("answer_1 = None", "answer_1 = 0")),
    "07_notebook_to_cluster.ipynb": Plan(("answer_1 = None", 'answer_1 = "gloo"')),
    "08_sharded_data_parallel.ipynb": Plan(("answer_1 = None", "answer_1 = False")),
    "09_tensor_parallel.ipynb": Plan(("answer_1 = None", 'answer_1 = ["y"]')),
    "10_cost_and_precision.ipynb": Plan(("answer_2 = None", "answer_2 = 2"), interim=True),
    "11_when_ranks_disagree.ipynb": Plan(("answer_1 = None", "answer_1 = True")),
    "12_uneven_gathers_and_exact_metrics.ipynb": Plan(("answer_1 = None", "answer_1 = [1]")),
    "13_what_ddp_expects_of_a_model.ipynb": Plan(("answer_1 = None", "answer_1 = (True, False, False)")),
    "14_clipping_and_checkpoints_across_shards.ipynb": Plan(("answer_1 = None", "answer_1 = 1")),
    "15_fsdp2.ipynb": Plan(("answer_1 = None", "answer_1 = 2")),
    "16_ddp_buckets_and_hooks.ipynb": Plan(("answer_1 = None", "answer_1 = 1")),
    "17_randomness_across_ranks.ipynb": Plan(("answer_1 = None", "answer_1 = (True, True)")),
    "18_transformer_layer.ipynb": Plan(("answer_1 = None", 'answer_1 = ["q.weight"]')),
}
"""One entry per notebook; a notebook without an entry fails the test."""


INTERIM_SOON = """\
def _register():
    import sys

    def interim_soon(*_):
        cost = sys.modules.get("reducelab.widgets.cost")
        if cost is not None:
            cost.INTERIM_AFTER = 0.02

    get_ipython().events.register("pre_run_cell", interim_soon)


_register()
del _register
"""
"""An IPython startup file for the test's kernels: once a cell has imported
``reducelab.widgets.cost``, every later cell run sets its ``INTERIM_AFTER`` to 0.02 s.
It leaves no name in the learner's namespace."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clear_outputs(path: pathlib.Path) -> None:
    """Strip stored outputs, so that every prompt number seen comes from this run."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def lab():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"The browser test needs Chromium at {CHROMIUM}: run `make browser` "
                    f"(installs the Debian package 'chromium') or set CHROMIUM=/path.")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="reducelab-lab-"))
    shutil.copytree(ROOT / "notebooks", tmp / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name in NOTEBOOKS:
        clear_outputs(tmp / "notebooks" / name)
    settings = tmp / "settings"
    # Render every cell (no windowing: off-screen cells would have no text to read),
    # do not ask about news (the machine has no internet), and never autosave.
    for name, value in {"notebook-extension/tracker": {"windowingMode": "none"},
                        "apputils-extension/notification": {"fetchNews": "false"},
                        "docmanager-extension/plugin": {"autosave": False}}.items():
        path = settings / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    # Notebook 10's sweeps show an interim figure once they run past INTERIM_AFTER
    # (0.3 s): on this 2-core machine the move below runs 0.9 to 1.2 s, but a machine
    # three times as fast could finish it first, rightly with no interim figure. Here the
    # question is whether the page shows one, so every kernel lowers the mark to 0.02 s,
    # which the 64 MiB size alone passes on any machine (tests/test_nb10_cost.py tests
    # the rule at the real mark).
    startup = tmp / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-interim-soon.py").write_text(INTERIM_SOON)
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_DATA_DIR=str(tmp / "data"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               IPYTHONDIR=str(tmp / "ipython"))
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={tmp / 'notebooks'}",
           f"--LabApp.workspaces_dir={tmp / 'workspaces'}", "--LabApp.news_url=None",
           "--ServerApp.port_retries=0"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp / "lab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("JupyterLab did not start:\n" + (tmp / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Failure(AssertionError):
    pass


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise Failure(f"timed out after {timeout:.0f} s waiting for {what}")


def run_all(page) -> float:
    """Restart the kernel and run every cell; return the seconds Run All took."""
    page.locator(".lm-MenuBar-item", has_text="Kernel").first.click()
    page.locator(".lm-Menu-item", has_text="Restart Kernel and Run All Cells").first.click()
    page.locator(".jp-Dialog button.jp-mod-accept").first.click()
    t0 = time.monotonic()

    def finished() -> bool:
        prompts = [t.strip() for t in
                   page.locator(".jp-CodeCell .jp-InputArea-prompt").all_text_contents()]
        return bool(prompts) and all(t not in ("[*]:", "[ ]:", "") for t in prompts)
    wait_until(lambda: "[*]:" in "".join(page.locator(".jp-InputArea-prompt")
                                          .all_text_contents()) or finished(), 60,
               "Run All to start")
    try:
        wait_until(finished, 240, "all cells to run")
    except Failure:
        # Run All stops at a cell that raised: say which, and what it raised
        prompts = [t.strip() for t in
                   page.locator(".jp-CodeCell .jp-InputArea-prompt").all_text_contents()]
        stuck = [(i, t) for i, t in enumerate(prompts) if t in ("[*]:", "[ ]:", "")]
        errors = page.locator(".jp-OutputArea-output[data-mime-type="
                              "'application/vnd.jupyter.stderr']").all_text_contents()
        raise Failure(f"Run All did not finish in 240 s; code cells not run or running: "
                      f"{stuck[:5]}; error outputs: {[e[-1500:] for e in errors[-2:]]}")
    return time.monotonic() - t0


def assert_no_errors(page) -> None:
    errors = page.locator(".jp-OutputArea-output[data-mime-type="
                          "'application/vnd.jupyter.stderr']")
    bad = [t for t in errors.all_text_contents() if "Traceback" in t or "Error" in t]
    assert not bad, f"cells show errors: {[b[:300] for b in bad[:3]]}"
    # an exception's traceback renders as stderr; what a cell prints on purpose (07 prints
    # torchrun's failure summary, whose "traceback :" line is torch's words) is stdout
    assert page.locator(".jp-OutputArea-output:not([data-mime-type="
                        "'application/vnd.jupyter.stdout'])", has_text="Traceback").count() == 0


def explorer_boxes(page):
    """The explorers on the page: widget boxes holding controls, an image and a message."""
    return page.locator(".widget-vbox:has(> .widget-image):has(> .widget-html)")


def move(control, plan: Plan) -> str:
    """Move one control to another value; return a description of what was done."""
    kind = control.get_attribute("class") or ""
    label = control.locator(".widget-label").first.text_content() if \
        control.locator(".widget-label").count() else "?"
    if "widget-dropdown" in kind:
        select = control.locator("select")
        options = select.locator("option").all_text_contents()
        current = select.input_value()
        values = [o for o in select.locator("option").evaluate_all(
            "els => els.map(e => e.value)")]
        target = next(v for v in values if v != current)
        select.select_option(target)
        return f"{label} -> {options[values.index(target)]}"
    if "widget-toggle-buttons" in kind:
        buttons = control.locator("button:not(.mod-active)")
        text = buttons.first.text_content()
        buttons.first.click()
        return f"{label} -> {text.strip()}"
    if "widget-slider" in kind or "widget-hslider" in kind:
        handle = control.locator(".noUi-handle").first
        before = control.locator(".widget-readout").first.text_content()
        handle.focus()
        handle.press("ArrowRight")
        handle.press("Enter")
        after = control.locator(".widget-readout").first.text_content()
        if after == before:
            handle.press("ArrowLeft")
            handle.press("ArrowLeft")
        return f"{label} -> {control.locator('.widget-readout').first.text_content()}"
    if "widget-text" in kind or "widget-inline-hbox" in kind:
        box = control.locator("input").first
        value = plan.text_inputs.get(label.strip())
        if value is None:
            raise Failure(f"no value to type in the text box {label!r}: add it to the plan")
        box.fill(value)
        box.press("Enter")
        return f"{label} -> {value}"
    if "widget-checkbox" in kind:
        control.locator("input").first.click()
        return f"{label} toggled"
    raise Failure(f"do not know how to move a control of class {kind!r}")


def play_with_explorers(page, plan: Plan) -> list[str]:
    """Move every control of every explorer once; return what was moved."""
    moved, interims = [], []
    boxes = explorer_boxes(page)
    assert boxes.count() > 0, "the notebook shows an explorer"
    for b in range(boxes.count()):
        box = boxes.nth(b)
        box.scroll_into_view_if_needed()
        controls = box.locator("> .widget-hbox > .lm-Widget")
        message_box = box.locator("> .widget-html").first
        # every message the page shows, however briefly (an interim one lasts a second);
        # from the mutation records, not the element's text when the observer runs: two
        # updates handled in one task (JupyterLab chains kernel messages as promises)
        # reach the observer together, and the element then holds only the second
        message_box.evaluate("""el => { window.__messages = [];
            new MutationObserver(records => {
                for (const r of records) {
                    for (const n of r.addedNodes) window.__messages.push(n.textContent);
                    if (r.type === "characterData") window.__messages.push(r.target.data);
                }
            }).observe(el, {childList: true, subtree: true, characterData: true}); }""")
        for k in range(controls.count()):
            image = box.locator("> .widget-image").first
            before = image.get_attribute("src")
            what = move(controls.nth(k), plan)
            wait_until(lambda: image.get_attribute("src") != before, 60,
                       f"the figure to change after {what}")
            # an interim figure: wait for the complete one before the next move
            wait_until(lambda: not (message_box.text_content() or "").startswith("⏳"), 120,
                       f"the complete figure after {what}")
            message = message_box.text_content() or ""
            assert "closed" not in message, f"after {what} the explorer says: {message}"
            assert "Traceback" not in message and box.locator(".jp-OutputArea-output",
                                                               has_text="Traceback").count() == 0
            moved.append(f"explorer {b + 1}: {what}")
        interims += [m for m in page.evaluate("window.__messages") if m.startswith("⏳")]
    if plan.interim:
        assert interims, "no move showed an interim figure while the kernel measured"
    return moved


def answer_wrongly(page, plan: Plan) -> None:
    first_line, wrong = plan.answer
    cells = page.locator(".jp-Notebook .jp-Cell")
    texts = [t.strip() for t in cells.locator(".jp-InputArea-editor").all_text_contents()]
    index = next((i for i, t in enumerate(texts) if t.startswith(first_line)), None)
    if index is None:
        raise Failure(f"no cell starts with {first_line!r}: update the plan")
    cell = cells.nth(index)
    question = cells.nth(index + 1)
    cell.scroll_into_view_if_needed()
    cell.locator(".cm-content").click()
    page.keyboard.press("Control+a")
    page.keyboard.type(wrong)
    page.keyboard.press("Shift+Enter")      # runs the answer cell, selects the question cell
    page.keyboard.press("Shift+Enter")      # runs the question cell
    verdict = question.locator('.reducelab-verdict[data-state="wrong"]')
    wait_until(lambda: verdict.count() > 0, 60, "the wrong answer's verdict")
    assert "Not yet" in verdict.first.text_content()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_as_a_learner_uses_it(lab, browser, name):
    base, token = lab
    assert name in PLANS, f"add a Plan for {name} to PLANS"
    plan = PLANS[name]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, base, token, name)
        seconds = run_all(page)
        assert_no_errors(page)
        moved = play_with_explorers(page, plan)
        if plan.drag:
            drag_across(page, plan.drag)
        answer_wrongly(page, plan)
        assert_no_errors(page)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        times = ARTIFACTS / "run_times.json"
        record = json.loads(times.read_text()) if times.exists() else {}
        record[name] = {"run_all_s": round(seconds, 1), "moved": moved}
        times.write_text(json.dumps(record, indent=1, sort_keys=True))
        page.screenshot(path=str(ARTIFACTS / f"{name.split('_')[0]}_after.png"))
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{name.split('_')[0]}_failure.png"),
                        full_page=True)
        raise
    finally:
        page.close()
        shut_down_kernels(base, token)


def open_notebook(page, base: str, token: str, name: str) -> None:
    """Open ``name`` in a workspace of its own (only this notebook is open) and wait
    until its kernel is idle."""
    page.goto(f"{base}/lab/workspaces/{name.split('_')[0]}/tree/{name}?reset&token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    select = page.locator(".jp-Dialog button", has_text="Select")
    # JupyterLab may ask which kernel to start. Then wait for the status bar's kernel
    # status to say Idle, not the toolbar's execution indicator: that one says idle
    # while the status bar still says "No Kernel | Initializing", and a Restart and
    # Run All sent then never ran (a fixed 5 s wait for the question hid this)
    status = page.locator(".jp-StatusBar-Widget").first

    def idle() -> bool:
        return "| Idle" in (status.text_content() or "")
    wait_until(lambda: select.count() > 0 or idle(), 90, "the notebook's kernel to be idle")
    if select.count():
        select.first.click()
    wait_until(idle, 90, "the notebook's kernel to be idle")


def settled(image, quiet: float = 3.0, timeout: float = 120) -> str:
    """The figure's ``src`` once it has not changed for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = image.get_attribute("src"), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = image.get_attribute("src")
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return last
    raise Failure(f"the figure kept changing for {timeout:.0f} s")


def figure_digest(image) -> str:
    """SHA-256 of the PNG bytes the figure shows (its ``src`` is a new blob URL on every
    update, even for the same bytes)."""
    return image.evaluate("""async img => {
        const bytes = await (await fetch(img.src)).arrayBuffer();
        const digest = await crypto.subtle.digest("SHA-256", bytes);
        return Array.from(new Uint8Array(digest), b => b.toString(16).padStart(2, "0")).join("");
    }""")


def drag_across(page, label: str) -> None:
    """Drag the first explorer's slider ``label`` across its whole range with the mouse,
    as a learner does (a change for every step it passes). The explorer must not queue
    one refresh per step: fewer figures are shown than steps passed. And the figure and
    message that stay are those of where the slider stopped: the message names that
    size, and the figure is the very one that value shows when picked again (one step
    left, then back with the keyboard)."""
    box = explorer_boxes(page).first
    box.scroll_into_view_if_needed()
    slider = box.locator("> .widget-hbox > .lm-Widget", has_text=label).first
    image = box.locator("> .widget-image").first
    message = box.locator("> .widget-html").first
    settled(image)
    # count the figures the page shows from here on
    image.evaluate("""img => { window.__figures = 0;
        new MutationObserver(() => window.__figures++).observe(img,
            {attributes: true, attributeFilter: ["src"]}); }""")
    track = slider.locator(".noUi-target, .noUi-base").first.bounding_box()
    handle = slider.locator(".noUi-handle").first
    hb = handle.bounding_box()
    y = hb["y"] + hb["height"] / 2
    page.mouse.move(hb["x"] + hb["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(track["x"] - 20, y, steps=10)                  # to the lowest value
    page.mouse.move(track["x"] + track["width"] + 20, y, steps=60)  # across the range
    page.mouse.up()
    readout = slider.locator(".widget-readout").first
    stopped_at = readout.text_content().strip()
    assert stopped_at == "32", f"the drag ended at {stopped_at}, not at the slider's end"
    dragged = settled(image)
    dragged_digest = figure_digest(image)
    shown = page.evaluate("window.__figures")
    # a refresh that ends before the next step may show its figure; one in flight
    # collapses the steps that arrive meanwhile: fewer figures than steps, however
    # fast the figures are (21 of 31 with 02's redraw at 61 ms, 26 Nov)
    assert 1 <= shown < 31, f"{shown} figures were shown for a drag over 31 steps"
    assert "32 elements" in message.text_content(), message.text_content()
    handle.focus()
    handle.press("ArrowLeft")
    wait_until(lambda: image.get_attribute("src") != dragged, 60, "the figure for 31")
    handle.press("ArrowRight")
    wait_until(lambda: readout.text_content().strip() == "32", 10, "the readout to say 32")
    settled(image)
    assert figure_digest(image) == dragged_digest, \
        "the figure after the drag is not the one for 32"


def shut_down_kernels(base: str, token: str) -> None:
    """Stop every kernel of the server, so the next notebook has the cores to itself."""
    headers = {"Authorization": f"token {token}"}
    with urllib.request.urlopen(urllib.request.Request(f"{base}/api/kernels",
                                                       headers=headers), timeout=10) as r:
        kernels = json.loads(r.read())
    for k in kernels:
        req = urllib.request.Request(f"{base}/api/kernels/{k['id']}", method="DELETE",
                                     headers=headers)
        try:
            urllib.request.urlopen(req, timeout=30).close()
        except OSError:
            pass
