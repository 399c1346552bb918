"""Workshop mode (issue 24): the instructor's server, the learner's kernel, and what
goes between them.

The server is the real one, ``reducelab workshop serve`` on loopback in a subprocess
(:mod:`workshop_server`); the learner side is the real :mod:`reducelab.workshop` in
this process, with real checks and, once, a real group call that times out.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import io
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest

import reducelab.workshop as workshop
from reducelab import checks
from reducelab.workshop import client as wclient
from reducelab.workshop.catalog import read_catalog
from workshop_server import call, report, start

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start(tmp_path_factory.mktemp("workshop"))
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def learner_state(tmp_path, monkeypatch):
    """Each test keeps the learners' secrets in its own file, and leaves no client behind."""
    monkeypatch.setenv("REDUCELAB_WORKSHOP_STATE", str(tmp_path / "secrets.json"))
    monkeypatch.delenv("REDUCELAB_WORKSHOP", raising=False)
    yield
    workshop.leave()
    assert checks._observer is None


_names = iter(range(10**6))


def join(server, name=None) -> str:
    """A new learner's secret."""
    status, answer, _ = call("POST", server.join, {"name": name or f"learner {next(_names)}"})
    assert status == 200, answer
    return answer["secret"]


def progress(server) -> dict:
    status, answer, _ = call("GET", server.base + "/api/progress", token=server.token)
    assert status == 200, answer
    return answer


def row(server, name) -> dict:
    return next(l for l in progress(server)["learners"] if l["name"] == name)


# --- the columns ------------------------------------------------------------------------
def test_columns_are_every_question_and_exercise_of_the_notebooks():
    catalog = read_catalog(ROOT / "notebooks")
    notebooks = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(catalog.notebooks) == notebooks
    solutions = sorted(p.name for p in (ROOT / "notebooks" / "solutions").glob("*.py"))
    exercises = [i for i in catalog.items if i.kind == "exercise"]
    assert sorted(i.solution for i in exercises) == solutions      # one column per exercise
    assert catalog.find(None, "check_mesh_sync").notebook == "05"
    assert catalog.find("07", "check_node_command").solution == "07_node2_command.py"
    for nb in notebooks:                       # every notebook asks at least two questions
        questions = [i.key for i in catalog.items if i.notebook == nb and i.kind == "question"]
        assert len(questions) >= 2 and questions[0] == "answer_1", (nb, questions)
    assert catalog.find("05", "answer_9") is None


def test_serve_says_when_its_port_is_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "reducelab", "workshop", "serve",
                              "--port", str(port), "--data", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr


def test_serve_help_documents_its_options():
    out = subprocess.run([sys.executable, "-m", "reducelab", "workshop", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for option in ("--host", "--port", "--data", "127.0.0.1", "8765", "reducelab-workshop"):
        assert option in out


# --- who may do what --------------------------------------------------------------------
def test_the_dashboard_and_its_api_need_the_instructors_token(server):
    secret = join(server)
    for path in ("/dashboard", "/api/progress", "/api/events"):
        assert call("GET", server.base + path)[0] == 401
        assert call("GET", server.base + path, token="not-the-token")[0] == 403
        assert call("GET", server.base + path, token=secret)[0] == 403   # a learner's secret
        assert call("GET", server.base + path + "?token=" + secret)[0] == 403
    unlock = {"solution": "05_token_weighted_sync.py", "open": True}
    assert call("POST", server.base + "/api/unlock", unlock)[0] == 401
    assert call("POST", server.base + "/api/unlock", unlock, token=secret)[0] == 403
    status, page, headers = call("GET", server.dashboard)
    assert status == 200 and "<table" in page
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["Referrer-Policy"] == "no-referrer"      # its address holds the token


def test_learners_post_only_their_own_progress(server):
    ada, bob = join(server, "Ada T"), join(server, "Bob T")
    assert call("POST", server.base + "/api/report", report())[0] == 401
    assert call("POST", server.base + "/api/report", report(), token="forged")[0] == 403
    assert call("POST", server.base + "/api/report", report(), token=server.token)[0] == 403
    status, answer, _ = call("POST", server.base + "/api/report", report(), token=ada)
    assert status == 200 and answer["accepted"]
    assert row(server, "Ada T")["reports"] == 1
    assert row(server, "Bob T")["reports"] == 0
    # a second join under Ada's name, without her secret, is refused: Bob cannot be Ada
    status, answer, _ = call("POST", server.join, {"name": "ada t"})
    assert status == 409 and "taken" in answer["error"]
    status, answer, _ = call("POST", server.join, {"name": "Ada T", "secret": bob})
    assert status == 409
    # with her own secret, Ada's next kernel comes back as the same row
    status, answer, _ = call("POST", server.join, {"name": "Ada T", "secret": ada})
    assert status == 200 and answer["secret"] == ada
    assert [l["name"] for l in progress(server)["learners"]].count("Ada T") == 1


def test_solutions_open_on_the_instructors_word(server):
    secret = join(server)
    url = server.base + "/api/solutions/04_ddp_loss.py"
    assert call("GET", url)[0] == 401
    status, answer, _ = call("GET", url, token=secret)
    assert status == 403 and "not open yet" in answer["error"]
    assert answer["error"].count(".") == 1                          # one sentence
    status, _, _ = call("POST", server.base + "/api/unlock",
                        {"solution": "04_ddp_loss.py", "open": True}, token=server.token)
    assert status == 200
    status, text, _ = call("GET", url, token=secret)
    assert status == 200 and text == (ROOT / "notebooks/solutions/04_ddp_loss.py").read_text()
    assert call("GET", server.base + "/api/solutions/03_backward_and_log.py", token=secret)[0] == 403
    assert call("GET", server.base + "/api/solutions/..%2F..%2Fsecret.py", token=secret)[0] == 404
    assert "04_ddp_loss.py" in progress(server)["unlocked"]
    call("POST", server.base + "/api/unlock", {"solution": "04_ddp_loss.py", "open": False},
         token=server.token)
    assert call("GET", url, token=secret)[0] == 403


# --- bad input: a clear error, and nothing else changes ---------------------------------
def test_bad_input_gets_a_clear_error_and_changes_nothing(server):
    secret = join(server, "Careful Carl")
    before = progress(server)
    url = server.base + "/api/report"
    cases = [
        (call("POST", url, raw=b"{" * 100_000, token=secret), 413, "bytes"),
        (call("POST", url, raw=b"x" * 5000, token=secret,
              headers={"Transfer-Encoding": "chunked"}), 413, "bytes"),
        (call("POST", url, raw=b"not json", token=secret), 422, "not JSON"),
        (call("POST", url, [1, 2], token=secret), 422, "JSON object"),
        (call("POST", url, {**report(), "code": "print(1)"}, token=secret), 422, "unknown field"),
        (call("POST", url, report(outcome="great"), token=secret), 422, "outcome must be"),
        (call("POST", url, report(notebook="5"), token=secret), 422, "two-digit"),
        (call("POST", url, report(item="check_nothing"), token=secret), 422, "no question or exercise"),
        (call("POST", url, report(mistake="x" * 500), token=secret), 422, "120"),
        (call("POST", url, {**report(), "time": "soon"}, token=secret), 422, "time must be"),
        (call("POST", server.join, {"name": "<script>alert(1)</script>"}), 422, "no HTML"),
        (call("POST", server.join, {"name": ""}), 422, "1 to 40"),
        (call("POST", server.join, {"name": "a" * 41}), 422, "1 to 40"),
        (call("POST", server.join, {"name": "bell\x07"}), 422, "control"),
        (call("POST", server.base + "/join/WRONGCODE", {"name": "Mallory"}), 404, "wrong join code"),
    ]
    for (status, answer, _), want_status, words in cases:
        assert status == want_status, (answer, want_status)
        assert words in answer["error"], answer
    after = progress(server)
    assert after["accepted"] == before["accepted"]
    assert [l["name"] for l in after["learners"]] == [l["name"] for l in before["learners"]]
    assert row(server, "Careful Carl")["reports"] == 0


def test_a_name_with_ampersands_and_quotes_is_kept_as_text(server):
    join(server, 'Eve & "Mo"')
    assert 'Eve & "Mo"' in [l["name"] for l in progress(server)["learners"]]


def test_wrong_join_codes_from_one_address_are_slowed_down(server):
    statuses = [call("POST", server.base + "/join/GUESS1234", {"name": "Mallory"})[0]
                for _ in range(15)]
    assert statuses[0] == 404 and statuses[-1] == 429
    status, answer, headers = call("POST", server.base + "/join/GUESS1234", {"name": "M"})
    assert status == 429 and "wait" in answer["error"] and int(headers["Retry-After"]) >= 1


def test_a_thousand_reports_a_second_from_one_learner_are_rate_limited(server):
    """One learner fires 1,000 reports as fast as 8 connections go: the server takes a
    burst, refuses the rest with 429 and a clear error, and every report it accepted is
    on the dashboard; another learner is not slowed down."""
    flood, calm = join(server, "Flood Fred"), join(server, "Calm Cleo")
    url = server.base + "/api/report"
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: call("POST", url, report(), token=flood), range(1000)))
    elapsed = time.monotonic() - t0
    accepted = sum(1 for s, _, _ in results if s == 200)
    refused = [a for s, a, _ in results if s == 429]
    assert accepted + len(refused) == 1000
    assert refused and "too many reports" in refused[0]["error"]
    from reducelab.workshop.server import REPORT_BURST, REPORT_RATE
    assert accepted <= REPORT_BURST + REPORT_RATE * elapsed + 1
    assert row(server, "Flood Fred")["reports"] == accepted
    assert call("POST", url, report(), token=calm)[0] == 200


# --- many learners at once, and a restart ------------------------------------------------
def test_fifty_learners_posting_at_once_lose_nothing(server):
    """K = 50 learners, each on its own thread, post reports concurrently for a bounded
    time (3 s); every report the server accepted is on the dashboard, counted once."""
    K, seconds = 50, 3.0
    secrets = [join(server, f"class of 50 #{k:02d}") for k in range(K)]
    start_line = threading.Barrier(K)
    items = ["answer_1", "answer_2", "answer_3", "check_mesh_sync"]

    def learner(k: int) -> dict:
        start_line.wait()
        end, sent, passed = time.monotonic() + seconds, 0, set()
        while time.monotonic() < end:
            item = items[sent % 4]
            outcome = "passed" if (sent + k) % 3 == 0 else "failed"
            status, answer, _ = call("POST", server.base + "/api/report",
                                     report(item=item, outcome=outcome), token=secrets[k])
            assert status == 200, answer
            sent += 1
            if outcome == "passed":
                passed.add(item)
            time.sleep(0.05)
        return {"sent": sent, "passed": passed}

    with concurrent.futures.ThreadPoolExecutor(K) as pool:
        results = list(pool.map(learner, range(K)))
    rows = {l["name"]: l for l in progress(server)["learners"]}
    for k, result in enumerate(results):
        got = rows[f"class of 50 #{k:02d}"]
        assert result["sent"] >= 3
        assert got["reports"] == result["sent"]
        assert {key.split(":")[1] for key, c in got["cells"].items()
                if c["state"] == "passed"} == result["passed"]


def test_a_restart_in_the_middle_loses_nothing(tmp_path, monkeypatch):
    """Learners' kernels (the real client) keep reporting while the server is killed
    (SIGKILL) and started again on the same --data: every report reaches the dashboard
    exactly once, and the join code, the token and each learner's row survive."""
    monkeypatch.setattr(wclient, "RETRY", (0.1, 0.5))
    first = start(tmp_path / "data")
    clients = [wclient.Client(first.join, f"kernel {k}", out=io.StringIO()).start()
               for k in range(5)]
    assert all(c.wait_joined(10) and c.state == "joined" for c in clients)
    per_client, stop = [0] * 5, threading.Event()

    def keep_reporting(k: int) -> None:
        while not stop.is_set():
            clients[k].submit("05", "answer_2", "failed", "wrong")
            per_client[k] += 1
            time.sleep(0.02)

    threads = [threading.Thread(target=keep_reporting, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    first.stop(kill=True)
    time.sleep(0.5)                           # reports pile up in the kernels meanwhile
    second = start(tmp_path / "data", port=first.port)
    try:
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 20
        while any(c.pending for c in clients) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (second.code, second.token) == (first.code, first.token)
        rows = {l["name"]: l for l in progress(second)["learners"]}
        assert len(rows) == 5
        for k, c in enumerate(clients):
            assert c.pending == 0 and c.dropped == 0
            assert rows[f"kernel {k}"]["reports"] == per_client[k]
            assert rows[f"kernel {k}"]["cells"]["05:answer_2"]["tries"] == per_client[k]
    finally:
        for c in clients:
            c.stop()
        second.stop()


# --- the learner's kernel ----------------------------------------------------------------
def _cell(source: str, name: str, namespace: dict):
    """Run ``source`` as a notebook cell does: compiled under a file name that
    ``linecache`` knows (IPython registers each cell the same way)."""
    import linecache
    filename = f"<ipython-input-{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def test_checks_and_questions_report_their_outcome_when_shown(server, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "work/07_notebook_to_cluster.ipynb")
    workshop.join(server.join, name="Grace H")
    from reducelab.checks import reveal
    from reducelab.checks.cluster import check_node_command
    ns = {"reveal": reveal, "check_node_command": check_node_command}
    wrong = check_node_command("torchrun --nnodes=3 train.py")
    assert not wrong
    _cell("answer_1 = None\nv1 = reveal(answer_1, True,\n           'why')\n", "1", ns)
    _cell("answer_2 = 5\nv2 = reveal(\n    answer_2, 5, 'why')\n", "2", ns)
    time.sleep(0.3)
    assert workshop.status()["sent"] == 0                 # nothing until shown
    for v in (wrong, ns["v1"], ns["v2"]):
        v._repr_html_()
        repr(v)                                           # a display calls both: one report
    end = time.monotonic() + 10
    while workshop.status()["sent"] < 3 and time.monotonic() < end:
        time.sleep(0.05)
    assert workshop.status()["sent"] == 3
    cells = row(server, "Grace H")["cells"]
    assert cells["07:check_node_command"]["state"] == "failing"
    assert cells["07:check_node_command"]["mistake"] == "wrong"   # the check named none
    assert cells["07:answer_1"]["state"] == "seen"                 # no prediction yet
    assert cells["07:answer_2"]["state"] == "passed"
    # a verdict built by hand (a test's) is not reported
    repr(checks.passed("by hand"))
    time.sleep(0.2)
    assert workshop.status()["sent"] == 3


def test_a_report_holds_the_outcome_and_nothing_else(server, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "11_when_ranks_disagree.ipynb")
    client = wclient.Client(server.join, "Quiet Quinn")     # not started: its queue stays
    checks._observer = observer = wclient.Observer(client)
    try:
        from reducelab.checks.cluster import check_node_command
        repr(check_node_command("torchrun --nnodes=2 --node-rank=1 secret_script.py"))
        observer.event("timeout", seconds=1.0)
    finally:
        checks._observer = None
    sent = list(client._queue)
    assert [sorted(r) for r in sent] == [["id", "item", "mistake", "notebook", "outcome", "time"]] * 2
    assert [(r["notebook"], r["item"], r["outcome"]) for r in sent] == \
        [("11", "check_node_command", "failed"), ("11", "timeout", "timeout")]
    assert "secret_script" not in repr(sent)
    # a question outside a notebook JupyterLab names is not sent (its column is unknown)
    monkeypatch.delenv("JPY_SESSION_NAME")
    checks._observer = observer
    try:
        from reducelab.checks import reveal
        ns = {"reveal": reveal}
        _cell("answer_1 = 3\nv = reveal(answer_1, 3, 'why')\n", "q", ns)
        repr(ns["v"])
    finally:
        checks._observer = None
    assert len(client._queue) == 2


def test_a_group_call_that_timed_out_is_reported(server, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "11_when_ranks_disagree.ipynb")
    workshop.join(server.join, name="Hung Hana")
    from reducelab import LocalGroup, RankError
    with LocalGroup(world_size=2, timeout=1.0, progress=False) as g:
        with pytest.raises(RankError, match="did not finish within"):
            g.run(time.sleep, 30)
    end = time.monotonic() + 10
    while row(server, "Hung Hana")["timeouts"] == 0 and time.monotonic() < end:
        time.sleep(0.05)
    last = row(server, "Hung Hana")["last"]
    assert last["outcome"] == "timeout" and last["notebook"] == "11"


def test_a_hub_kernel_joins_from_the_environment(server, monkeypatch, tmp_path):
    """REDUCELAB_WORKSHOP and the hub's user name: a kernel joins at `import reducelab`."""
    script = ("import ipykernel, time, reducelab, reducelab.workshop as w\n"
              "end = time.monotonic() + 30\n"
              "while w.status()['state'] != 'joined' and time.monotonic() < end:\n"
              "    time.sleep(0.05)\n"
              "print(w.status()['state'], w.status()['name'])\n")
    env = {"REDUCELAB_WORKSHOP": server.join, "JUPYTERHUB_USER": "hub-user-7",
           "REDUCELAB_WORKSHOP_STATE": str(tmp_path / "s.json"), "PATH": "/usr/bin:/bin",
           "REDUCELAB_PREWARM": "0"}                  # no forkserver: this kernel runs no ranks
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.stdout.split() == ["joined", "hub-user-7"], out.stdout + out.stderr
    assert "hub-user-7" in [l["name"] for l in progress(server)["learners"]]


def test_a_wrong_join_code_is_a_clear_error(server):
    with pytest.raises(workshop.WorkshopError, match="wrong join code"):
        workshop.join(server.base + "/join/NOTTHECODE", name="Lost Lou")
    with pytest.raises(ValueError, match="looks like http://HOST:PORT/join/CODE"):
        workshop.join("localhost:8765", name="Lost Lou")
    assert workshop.status() == {"state": "off"}


@pytest.mark.parametrize("down", ["refused", "silent"])
def test_with_the_server_down_a_check_costs_at_most_the_bound(down, monkeypatch):
    """No server (the port refuses), or one that never answers (it accepts connections and
    says nothing): join() returns within its wait, each check within the bound (it only
    queues), and the learner sees one line, once."""
    # the line goes to the sys.stderr of join() from the client's thread, even while a
    # check redirects sys.stderr (check_node_command does while it parses)
    told = io.StringIO()
    monkeypatch.setattr(sys, "stderr", told)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if down == "silent":
            listener.listen(64)
        else:
            listener.close()
        t0 = time.monotonic()
        workshop.join(f"http://127.0.0.1:{port}/join/ABCD2345", name="Offline Otto", wait=0.5)
        assert time.monotonic() - t0 <= 0.5 + 0.5
        from reducelab.checks.cluster import check_node_command
        costs = []
        # sys.stderr redirected, as a check does while it parses: the silent server's line
        # comes about BOUND seconds after the join, in here, and still reaches join's stream
        with contextlib.redirect_stderr(io.StringIO()):
            for _ in range(20):
                t = time.monotonic()
                repr(check_node_command("torchrun --nnodes=3 train.py"))
                costs.append(time.monotonic() - t)
            end = time.monotonic() + 3 * wclient.BOUND + 2
            while "not reachable" not in told.getvalue() and time.monotonic() < end:
                time.sleep(0.1)                        # let the thread fail a send or two
        assert max(costs) <= wclient.BOUND
        time.sleep(wclient.BOUND + 0.5)               # and fail more: still one line
        assert told.getvalue().count("not reachable") == 1, told.getvalue()
        assert workshop.status()["pending"] == 20
        t = time.monotonic()
        workshop.leave()
        assert time.monotonic() - t <= wclient.BOUND + 2.5


# --- %load of a solution in a workshop copy ----------------------------------------------
def test_load_fetches_a_solution_once_it_is_open(server, tmp_path, monkeypatch, capsys):
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    try:
        monkeypatch.chdir(tmp_path)                 # a workshop copy: no solutions/ here
        filled = []
        monkeypatch.setattr(shell, "set_next_input",
                            lambda text, replace=False: filled.append((text, replace)))
        workshop.join(server.join, name="Loading Lin")
        capsys.readouterr()
        shell.run_line_magic("load", "solutions/02_reduce_to_owners.py")
        out = capsys.readouterr().out
        assert "not open yet" in out and out.strip().count(".") == 1 and filled == []
        call("POST", server.base + "/api/unlock",
             {"solution": "02_reduce_to_owners.py", "open": True}, token=server.token)
        shell.run_line_magic("load", "solutions/02_reduce_to_owners.py")
        solution = (ROOT / "notebooks/solutions/02_reduce_to_owners.py").read_text()
        assert filled == [(f"# %load solutions/02_reduce_to_owners.py\n{solution}", True)]
        # anything else is IPython's own %load
        (tmp_path / "mine.py").write_text("x = 1\n")
        shell.run_line_magic("load", "mine.py")
        assert filled[-1] == ("# %load mine.py\nx = 1\n", True)
    finally:
        InteractiveShell.clear_instance()


# --- reducelab lab in workshop mode ------------------------------------------------------
def test_lab_in_workshop_mode_copies_the_notebooks_without_solutions(tmp_path):
    address = "http://127.0.0.1:9/join/ABCD2345"
    out = subprocess.run([sys.executable, "-m", "reducelab", "lab", str(tmp_path / "copy"),
                          "--workshop", address, "--name", "Ada", "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "without their solutions" in out.stdout
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(p.name for p in (tmp_path / "copy").glob("*.ipynb")) == shipped
    assert not (tmp_path / "copy" / "solutions").exists()
    bad = subprocess.run([sys.executable, "-m", "reducelab", "lab", str(tmp_path / "c2"),
                          "--workshop", "not-an-address", "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "join address looks like" in bad.stderr
    plain = subprocess.run([sys.executable, "-m", "reducelab", "lab", str(tmp_path / "c3"),
                            "--dry-run"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in __import__("os").environ.items()
                                if k != "REDUCELAB_WORKSHOP"})
    assert plain.returncode == 0 and (tmp_path / "c3" / "solutions").is_dir()


def test_the_kind_of_mistake_travels_with_the_verdict():
    from reducelab import RankError, RankReport
    hung = RankError("f did not finish within 1 s on rank 1", [RankReport(1, "stuck", "in barrier")])
    raised = RankError("rank 0 raised ValueError in f", [RankReport(0, "raised", "ValueError: x")])
    assert checks.raised_on_ranks("With world_size=2", hung).mistake == "hung past the timeout"
    assert checks.raised_on_ranks("With world_size=2", raised).mistake == "raised on the ranks"
    assert checks.failed("off by a factor of 4", mistake="divided twice").mistake == "divided twice"
    assert checks.failed("plain").mistake is None          # reported as "wrong"


def test_reporting_never_breaks_a_check(monkeypatch):
    """An observer that fails inside (here: finding a verdict's origin raises) changes
    nothing a learner sees."""
    client = wclient.Client("http://127.0.0.1:9/join/ABCD2345", "Robust Rae")
    checks._observer = wclient.Observer(client)
    try:
        monkeypatch.setattr(wclient, "origin", lambda v: 1 / 0)
        from reducelab.checks.cluster import check_node_command
        verdict = check_node_command("torchrun --nnodes=3 train.py")
        assert not verdict and repr(verdict).startswith("❌ Not yet.")
        monkeypatch.setattr(client, "submit", lambda *a, **k: 1 / 0)
        verdict._workshop_origin = {"item": "check_node_command"}
        assert "Not yet" in verdict._repr_html_()
    finally:
        checks._observer = None
