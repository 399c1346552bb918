"""The core modules' promises, called in this process (no ranks): what their docstrings
and the README's "How it works" say of output capture, verdicts and predictions,
failure reports, and the helpers that LocalGroup and the ranks are built from.

Written for issue 20 ("every promise has a test that fails when it breaks") and kept
fast, so that ``make mutation`` can run them for every mutant first; the behaviour on
real ranks is tested in ``test_group.py`` and ``tests/faults/``.
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import threading
import traceback

import psutil
import pytest

from reducelab import GroupBusyError, GroupClosedError, RankError, RankReport, capture
from reducelab.checks import (PROMPT, Verdict, failed, passed, raised_on_ranks, restoring_world_size,
                              reveal)


# --- capture: each rank's output ---------------------------------------------------------------

def test_a_stream_keeps_max_chars_then_notes_how_much_was_cut():
    out = capture.RankOutput()
    assert out.stdout.write("a" * (capture.MAX_CHARS - 2)) == capture.MAX_CHARS - 2
    assert out.stdout.write("bcde") == 4                      # what print() is told
    out.stdout.write("more")
    text, err = out.texts()
    assert err == ""
    assert text == "a" * (capture.MAX_CHARS - 2) + "bc\n" + \
        f"[output cut at {capture.MAX_CHARS:,} characters: 6 more were dropped]\n"


def test_the_last_character_that_fits_is_kept():
    out = capture.RankOutput()
    out.stdout.write("a" * (capture.MAX_CHARS - 1))
    out.stdout.write("xyz")
    assert out.texts()[0] == "a" * (capture.MAX_CHARS - 1) + "x\n" + \
        "[output cut at 100,000 characters: 2 more were dropped]\n"


def test_a_stream_that_fits_is_returned_whole_without_a_note():
    out = capture.RankOutput()
    out.stderr.write("x" * capture.MAX_CHARS)
    assert out.texts() == ("", "x" * capture.MAX_CHARS)


def test_the_cut_note_starts_on_a_line_of_its_own_after_a_full_line():
    out = capture.RankOutput()
    out.stdout.write("y" * (capture.MAX_CHARS - 1) + "\n" + "z")
    assert out.texts()[0].endswith("\n[output cut at 100,000 characters: 1 more were dropped]\n")
    assert "\n\n" not in out.texts()[0]


def test_prefix_lines_prefixes_every_line_and_keeps_empty_text_empty():
    assert capture.prefix_lines(3, "") == ""
    assert capture.prefix_lines(2, "a\nb") == "[rank 2] a\n[rank 2] b\n"
    assert capture.prefix_lines(0, "a\n\nb\n") == "[rank 0] a\n[rank 0] \n[rank 0] b\n"


def test_outputs_print_stdout_then_stderr_each_in_rank_order():
    out, err = io.StringIO(), io.StringIO()
    capture.print_rank_outputs({2: ("two\n", "e2\n"), 0: ("zero\n", ""), 1: ("", "e1\n")},
                               stdout=out, stderr=err)
    assert out.getvalue() == "[rank 0] zero\n[rank 2] two\n"
    assert err.getvalue() == "[rank 1] e1\n[rank 2] e2\n"


def test_nothing_printed_writes_nothing(capsys):
    capture.print_rank_outputs({0: ("", ""), 1: ("", "")})
    assert capsys.readouterr() == ("", "")
    capture.print_rank_outputs({1: ("late\n", "")})             # the kernel's own sys.stdout
    assert capsys.readouterr().out == "[rank 1] late\n"


class _Fallback(io.StringIO):
    def fileno(self):
        return 42


@pytest.fixture()
def rank_streams(monkeypatch):
    """This process's sys.stdout/stderr as a rank's lasting streams, restored afterwards."""
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(capture, "_STREAMS", [])
    fallback = _Fallback()
    monkeypatch.setattr(sys, "__stdout__", fallback)
    monkeypatch.setattr(sys, "__stderr__", fallback)
    yield fallback               # each test calls capture.install(): pytest's own capture
                                 # sets sys.stdout again between a fixture and its test


def test_a_call_captures_print_and_a_handler_kept_from_an_earlier_call(rank_streams):
    capture.install()
    kept = sys.stderr                                   # as logging.basicConfig() keeps it
    with capture.capture() as first:
        print("one")
    with capture.capture() as second:
        print("two")
        kept.write("via the kept handler\n")
        sys.stdout.buffer.write("bytes ✓\n".encode())
    assert first.texts() == ("one\n", "")
    assert second.texts() == ("two\nbytes ✓\n", "via the kept handler\n")
    print("between calls")                              # to the stream the rank started with
    sys.stderr.write("and its stderr\n")
    assert rank_streams.getvalue() == "between calls\nand its stderr\n"


def test_a_stream_closed_in_a_call_is_open_again_in_the_next(rank_streams):
    capture.install()
    with capture.capture() as out:
        sys.stdout.close()
        assert sys.stdout.closed
        with pytest.raises(ValueError, match="closed file"):
            print("x")
        with pytest.raises(ValueError, match="closed file"):
            sys.stdout.flush()
        sys.stdout = None                               # replaced, too
    assert not sys.stdout.closed and sys.stdout is capture._STREAMS[0]
    with capture.capture() as again:
        print("back")
    assert out.texts() == ("", "") and again.texts() == ("back\n", "")


def test_a_rank_stream_looks_like_a_text_stream(rank_streams):
    capture.install()
    stream = sys.stdout
    assert stream.writable() and not stream.isatty()
    assert stream.encoding == "utf-8" and stream.name == "<rank stdout>"
    assert stream.fileno() == 42                        # the descriptor it started with
    with pytest.raises(TypeError, match="must be str, not bytes"):
        stream.write(b"x")


def test_a_process_forked_from_a_rank_writes_to_the_terminal_not_into_the_call(rank_streams,
                                                                              monkeypatch):
    capture.install()
    with capture.capture() as out:
        monkeypatch.setattr(capture.os, "getpid", lambda: -1)   # as in a forked child
        print("child")
        monkeypatch.undo()
    assert out.texts() == ("", "") and rank_streams.getvalue() == "child\n"


@pytest.mark.parametrize("error", [OSError, ValueError, AttributeError])
def test_a_terminal_that_is_gone_does_not_break_a_print_between_calls(monkeypatch, error):
    """Between calls a rank writes to the terminal it started with; when that is closed
    (JupyterLab's terminal gone: EPIPE, a closed file, None), print() still returns."""
    class Gone:
        def write(self, text):
            raise error("the terminal is gone")
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    stream = capture.RankStream("stdout", Gone())
    assert stream.write("lost\n") == 5


def test_capture_installs_the_streams_when_none_are(monkeypatch):
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(capture, "_STREAMS", [])
    with capture.capture() as out:
        print("first call")
    assert out.texts() == ("first call\n", "")
    assert isinstance(sys.stdout, capture.RankStream)


# --- checks: verdicts and predictions -----------------------------------------------------------

def test_a_verdict_is_truthy_when_right_and_says_so():
    right, wrong = passed("because."), failed("not this.")
    assert right and not wrong
    assert (right.state, wrong.state) == ("right", "wrong")
    assert repr(right) == "✅ Correct. because." and repr(wrong) == "❌ Not yet. not this."
    assert 'data-state="right"' in right._repr_html_() and "✅ Correct. because." in right._repr_html_()
    assert 'data-state="wrong"' in wrong._repr_html_()
    from reducelab.palette import RIGHT, WRONG     # the colour says it too, never alone
    assert f"solid {RIGHT}" in right._repr_html_() and f"solid {WRONG}" in wrong._repr_html_()


def test_an_unanswered_question_shows_the_prompt_and_folds_the_result():
    v = reveal(None, 36, "because of <sums>.", evidence="rank 0: 36")
    assert not v and not v.answered and v.state == "unanswered"
    assert repr(v) == f"🤔 {PROMPT}"
    assert "36" not in repr(v)
    html = v._repr_html_()
    head, _, folded = html.partition("<details>")
    assert "36" not in head and "&lt;sums&gt;" in folded and "rank 0: 36<br>" in folded
    assert v.message == "rank 0: 36\nThe real run gives 36. because of <sums>."


def test_reveal_compares_and_explains_either_way():
    right = reveal(36, 36, "why.")
    wrong = reveal(35, 36, "why.", evidence="ev\n")
    assert right and right.message == "You predicted 36, and the real run gives 36. why."
    assert not wrong and wrong.message == "ev\nYou predicted 35, but the real run gives 36. why."
    assert reveal([1.0, 2.0], [1.0000001, 2.0], "w")          # a float tolerance of 1e-6
    assert reveal(0.0, 5e-7, "w") and not reveal(0.0, 2e-6, "w")   # absolute below 1
    assert reveal(0.0, 1e-6, "w")                                   # the bound itself
    assert not reveal("ab", ["a", "b"], "w") and not reveal(1.0, "1.0", "w")   # no coercion
    assert not reveal([1.0, 2.0], [1.0, 2.0, 3.0], "w")
    assert not reveal(1.0, 1.00001, "w")
    assert reveal(1e9, 1e9 + 100, "w")                       # relative for large numbers
    assert not reveal(1e9, 1e9 + 10000, "w")
    assert reveal("a", "a", "w") and not reveal("a", "b", "w")
    assert reveal(3, 7, "w", same=lambda p, a: p < a)
    assert not reveal(object(), 1, "w")
    import numpy as np
    assert not reveal(np.ones(2), np.ones(3), "w")     # == raises: a wrong answer, not a crash


def test_a_prediction_typed_as_text_is_read_as_the_value_it_spells():
    v = reveal("36", 36, "why.")
    assert v and "You wrote the text '36'; it was read as 36. Next time write it without quotes." \
        in v.message
    assert reveal("False", False, "w") and reveal(" [0, 1] ", [0, 1], "w")
    assert reveal("x", "x", "w").message.endswith("w")       # text expected: left as text
    for actual, kind in [(True, "True or False"), (4, "a number such as 4"),
                         ([0], "a list such as [0, 1]"), ((1,), "a tuple such as (True, False)"),
                         ({1}, "a set")]:
        v = reveal("maybe", actual, "w")
        assert not v and f"this question expects {kind}, written without quotes." in v.message


def test_raised_on_ranks_quotes_the_headline_and_the_first_ranks_own_error():
    err = RankError("rank 1 raised ValueError in f",
                    [RankReport(0, "returned", "f returned"),
                     RankReport(1, "raised", "ValueError: bad", "Traceback ...")])
    v = raised_on_ranks("With world_size=4", err)
    assert not v and v.message == ("With world_size=4 your function raised on the ranks: rank 1 "
                                   "raised ValueError in f. ValueError: bad")


def test_raised_on_ranks_says_where_each_rank_was_when_none_raised_and_some_hung():
    """A hang is not called raising, and its headline is not said twice (it was, as the
    first rank's "own error", until a review of notebook 08's check ran a hang)."""
    headline = "f did not finish within 2 s on ranks 0, 2: the ranks are not in the same collective"
    err = RankError(headline, [RankReport(0, "stuck", "was waiting in broadcast, called from f line 6"),
                               RankReport(1, "returned", "f returned"),
                               RankReport(2, "stuck", "was waiting in all_reduce, called from f line 6")])
    v = raised_on_ranks("With world_size=3,", err)
    assert not v and v.mistake == "hung past the timeout"
    assert v.message == (f"With world_size=3, your function did not finish on the ranks: {headline}. "
                         "Rank 0 was waiting in broadcast, called from f line 6; rank 1 returned; "
                         "rank 2 was waiting in all_reduce, called from f line 6.")


def test_restoring_world_size_puts_the_size_back_also_after_an_error():
    class Group:
        world_size = 4

        def resize(self, n):
            self.world_size = n
    g = Group()
    with pytest.raises(KeyError):
        with restoring_world_size(g) as same:
            assert same is g
            g.resize(2)
            raise KeyError("check bug")
    assert g.world_size == 4


# --- errors: what a learner reads --------------------------------------------------------------

def test_a_rank_error_names_the_ranks_and_carries_each_traceback_once():
    err = RankError("ranks 0, 2 raised ValueError in f", [
        RankReport(2, "raised", "ValueError: b", "TB same"),
        RankReport(0, "raised", "ValueError: a", "TB same"),
        RankReport(1, "returned", "f returned"),
        RankReport(3, "stuck", "was waiting in all_reduce", "stack 3", "all_reduce")], "hint.")
    assert isinstance(err, RuntimeError)
    assert err.ranks == [0, 2, 3] and [r.rank for r in err.reports] == [0, 1, 2, 3]
    assert err.first_summary == "ValueError: a"
    assert err.tracebacks == {0: "TB same", 2: "TB same", 3: "stack 3"}
    assert str(err) == ("ranks 0, 2 raised ValueError in f\n  rank 0: ValueError: a\n"
                        "  rank 1: f returned\n  rank 2: ValueError: b\n"
                        "  rank 3: was waiting in all_reduce\nhint.\n\n"
                        "--- rank 0, traceback ---\nTB same\n\n"
                        "--- rank 3, where it was stopped ---\nstack 3")
    assert err._render_traceback_() == [f"RankError: {err}"]
    assert RankError("h", [RankReport(0, "died", "died: killed by SIGKILL")]).first_summary == "h"
    assert issubclass(GroupClosedError, RuntimeError) and issubclass(GroupBusyError, RuntimeError)


# --- group.py's helpers ----------------------------------------------------------------------------

def test_how_a_rank_ended_is_said_in_words():
    from reducelab.reports import describe_exit as _describe_exit
    from reducelab.reports import describe_start_death as _describe_start_death
    from reducelab.reports import error_kind as _error_kind
    assert _describe_exit(None) == "died"
    assert _describe_exit(-9) == "died: killed by SIGKILL"
    assert _describe_exit(-200) == "died: killed by signal 200"
    assert _describe_exit(0) == "died: exited with code 0 without returning"
    assert _describe_exit(7) == "died: exited with code 7 without returning"
    assert _describe_start_death(-9, True) == "died: killed by SIGKILL while joining the process group"
    assert _describe_start_death(1, False).startswith("died: exited with code 1 without returning "
                                                      "before its imports were done")
    assert _error_kind("ValueError: bad") == "ValueError"
    assert _error_kind("torch.distributed.DistBackendError: x") == "torch.distributed.DistBackendError"
    assert _error_kind("could not join a fresh default process group: x") == "an error"


def test_env_is_checked_before_anything_starts():
    from reducelab.launch import RESERVED_ENV as _RESERVED_ENV, validate_env as _validate_env
    assert _validate_env(None) == {}
    given = {"A": "1"}
    assert _validate_env(given) == given and _validate_env(given) is not given
    for name in _RESERVED_ENV:
        with pytest.raises(ValueError, match=f"env cannot set {name}"):
            _validate_env({name: "1", "B": "2"})
    for bad in ({"A": 1}, {1: "A"}, [("A", "1")]):
        with pytest.raises(TypeError, match="dict of str to str"):
            _validate_env(bad)


@pytest.mark.parametrize("args, error, words", [
    ((1, "gloo", 0.001), None, None), ((64, "gloo", 30), None, None),
    ((0, "gloo", 30), ValueError, "from 1 to 64, got 0"), ((65, "gloo", 30), ValueError, "got 65"),
    ((True, "gloo", 30), TypeError, "an int from 1 to 64"),
    ((2, "nccl", 30), ValueError, "one of 'gloo' (CPU only), got 'nccl'"),
    ((2, "gloo", True), TypeError, "positive number of seconds"),
    ((2, "gloo", 0), ValueError, "positive, finite"), ((2, "gloo", -1), ValueError, "positive"),
    ((2, "gloo", float("nan")), ValueError, "finite"), ((2, "gloo", float("inf")), ValueError, "finite"),
])
def test_world_size_backend_and_timeout_are_checked_with_the_valid_choices(args, error, words):
    from reducelab.launch import validate as _validate
    if error is None:
        assert _validate(*args) is None
    else:
        with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
            _validate(*args)


def test_the_loopback_interface_is_the_one_holding_127_0_0_1(monkeypatch):
    from types import SimpleNamespace

    from reducelab.group import loopback_interface
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "eth0": [SimpleNamespace(address="10.0.0.5")],
        "lo": [SimpleNamespace(address="::1"), SimpleNamespace(address="127.0.0.1")]})
    assert loopback_interface() == "lo"
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {"eth0": [SimpleNamespace(address="10.0.0.5")]})
    with pytest.raises(RuntimeError, match="no network interface holds 127.0.0.1"):
        loopback_interface()


# --- processes.py's helpers ------------------------------------------------------------------------

def test_a_process_is_told_from_a_later_one_with_its_pid_by_its_start_time():
    from reducelab.processes import create_time, same_process
    me = os.getpid()
    started = create_time(me)
    assert started == psutil.Process(me).create_time()
    assert same_process(me, started) is True
    assert same_process(me, started + 0.009) is True             # psutil's rounding
    assert same_process(me, started + 0.02) is False             # another process, same pid
    assert same_process(me, None) is False
    dead = psutil.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert create_time(dead.pid) is None and same_process(dead.pid, started) is None


def test_descendants_finds_children_and_grandchildren_from_one_scan():
    import subprocess

    from reducelab.processes import descendants
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(30)']); print(c.pid, flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        found = {p.pid for p in descendants([child.pid])}
        assert found == {grandchild}
        assert {child.pid, grandchild} <= {p.pid for p in descendants([os.getpid()])}
        assert descendants([]) == []
    finally:
        for pid in (grandchild, child.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        child.wait()


def test_stopping_nothing_reads_no_process_table(monkeypatch, group):
    """A resize stops its unused spares, and keeping spares stops the extra ones: most
    often none. Scanning every process's /proc entry for them cost 08's explorer 40 to
    70 ms of wall time per scan on a busy 2-core machine, two or three scans per
    resize: nothing to stop must mean no scan. A resize scans at most once, for what its
    old ranks started (none if they left when told to)."""
    from reducelab import processes
    scans = []
    real = psutil.process_iter
    monkeypatch.setattr(processes.psutil, "process_iter",
                        lambda *a, **k: scans.append(1) or real(*a, **k))
    processes.stop([], None)
    processes.kill_trees([])
    assert processes.descendants(iter(())) == [] and scans == []
    group.keep_spares(2)
    group.resize(3)        # takes the 2 spares, forks 1, stops the old ranks
    assert len(scans) <= 1 and group.run(lambda: 1) == [1, 1, 1]
    group.resize(2)


@pytest.fixture()
def python_sigint():
    """Python's own SIGINT handler, as in a kernel (a shell's background job starts with
    SIGINT ignored, and an ignored SIGINT stays ignored through a deferred block)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_inside_a_deferred_block_is_raised_at_its_end(python_sigint):
    from reducelab.processes import interrupts_deferred
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block went on")
    assert done == ["the block went on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_deferred():                   # no interrupt: nothing raised
        pass


def test_a_deferred_interrupt_goes_to_a_custom_handler_and_a_thread_defers_nothing(python_sigint):
    from reducelab.processes import interrupts_deferred
    seen = []
    previous = signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    try:
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
    handlers = []

    def in_a_thread():
        with interrupts_deferred():
            handlers.append(signal.getsignal(signal.SIGINT))
    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert handlers == [signal.default_int_handler]


def test_the_start_method_is_forkserver_unless_spawn_is_asked_for(monkeypatch):
    from reducelab import processes
    monkeypatch.delenv("REDUCELAB_START_METHOD", raising=False)
    assert processes.context().get_start_method() == "forkserver"
    monkeypatch.setenv("REDUCELAB_START_METHOD", "spawn")
    assert processes.context().get_start_method() == "spawn"
    assert processes.warm(processes.context()) == 0.0             # nothing to warm with spawn
    assert processes.PRELOAD["torch"] == ["reducelab.rank_loop"]
    assert set(processes.PRELOAD["torch"]) < set(processes.PRELOAD["full"])


def test_ranks_do_not_import_the_kernels_main():
    import multiprocessing.spawn as spawn

    from reducelab.processes import PROCESS_PREFIX
    assert hasattr(spawn.get_preparation_data, "reducelab_original")
    mine = spawn.get_preparation_data(f"{PROCESS_PREFIX}rank-0")
    assert "init_main_from_path" not in mine and "init_main_from_name" not in mine
    assert "sys_path" in mine


# --- rank_loop.py's helpers (run in this process) -------------------------------------------------

def test_where_names_the_collective_and_the_learners_line():
    from reducelab import rank_reports as rank_loop  # where() lives in rank_reports since the split
    dist_file = os.path.join(rank_loop._DIST_DIR, "distributed_c10d.py")
    frames = [traceback.FrameSummary("/tmp/cell.py", 4, "my_fn"),
              traceback.FrameSummary(dist_file, 10, "all_reduce"),
              traceback.FrameSummary(dist_file, 20, "_inner")]
    assert rank_loop.where(frames) == ("all_reduce", "was waiting in all_reduce, called from my_fn line 4")
    assert rank_loop.where(frames[:1]) == (None, "was still running, at my_fn line 4")
    assert rank_loop.where([]) == (None, "was still running, at fn")


def test_a_long_text_keeps_its_head_and_tail_and_says_how_much_was_cut():
    from reducelab.rank_reports import cut as _cut
    assert _cut("abc", 3) == "abc"
    assert _cut("abcdefghij", 4) == "ab\n[... 6 characters cut ...]\nij"


def test_safe_str_survives_a_str_that_raises():
    from reducelab.rank_reports import safe_str

    class Bad:
        def __str__(self):
            raise RuntimeError("no")
    assert safe_str(3) == "3"
    assert safe_str(Bad()) == "<str() of this Bad raised RuntimeError>"


def test_describe_exception_gives_a_bounded_summary_the_chain_and_where_it_was():
    from reducelab.rank_reports import MAX_SUMMARY, MAX_TRACEBACK, describe_exception

    def inner():
        raise KeyError("low")
    try:
        try:
            inner()
        except KeyError as e:
            raise ValueError("high\nsecond line") from e
    except ValueError as e:
        summary, text, in_dist = describe_exception(e)
    assert summary == "ValueError: high" and in_dist is False
    assert "KeyError: 'low'" in text and "direct cause" in text and "ValueError: high" in text
    try:
        raise ValueError("x" * (10 * MAX_SUMMARY) + "\n" + "y" * (2 * MAX_TRACEBACK))
    except ValueError as e:
        summary, text, _ = describe_exception(e)
    assert len(summary) < MAX_SUMMARY + 100 and "characters cut" in summary
    assert len(text) < MAX_TRACEBACK + 100 and "characters cut" in text
    try:
        raise RuntimeError()
    except RuntimeError as e:
        assert describe_exception(e)[0] == "RuntimeError"


def test_classes_defined_in_main_are_found_inside_containers_and_no_deeper():
    from reducelab.rank_env import _main_classes
    Cell = type("Cell", (), {"__module__": "__main__"})
    Deep = type("Deep", (), {"__module__": "__main__"})
    Nested = type("Outer.Nested", (), {"__module__": "__main__", "__qualname__": "Outer.Nested"})
    found = _main_classes([Cell(), {"k": [1, (2, {Cell})]}, [[[[Deep()]]]], Nested(), 3], {})
    assert found == {"Cell": Cell}
    assert _main_classes([[Deep()]], {}) == {"Deep": Deep}
    assert _main_classes([[[[Deep()]]]], {}) == {"Deep": Deep}          # three containers deep
    assert _main_classes([[[[[Deep()]]]]], {}) == {}                    # four: not looked at
    assert _main_classes([{"k": {"k": {"k": Deep()}}}], {}) == {"Deep": Deep}
    assert _main_classes([Cell] * 1000 + [Deep()], {}) == {"Cell": Cell}   # 1000 looked at
    assert _main_classes([Cell] * 999 + [Deep()], {}) == {"Cell": Cell, "Deep": Deep}


def test_a_large_return_value_is_sent_in_chunks_as_it_is_pickled():
    from reducelab.rank_loop import CHUNK, _ChunkWriter
    assert CHUNK == 16 * 2**20                    # README: "sent in 16 MB chunks"

    class Rank:
        sending = 0

        def __init__(self):
            self.sent = []

        def send(self, msg):
            self.sent.append(msg)
    rank = Rank()
    writer = _ChunkWriter(rank)
    assert writer.write(b"a" * (CHUNK - 1)) == CHUNK - 1 and rank.sent == []
    writer.write(b"bc")
    assert [m["kind"] for m in rank.sent] == ["chunk"] and len(rank.sent[0]["data"]) == CHUNK
    assert rank.sent[0]["data"] == b"a" * (CHUNK - 1) + b"b"
    assert bytes(writer.pending) == b"c" and rank.sending == CHUNK
    writer.write(b"d" * (2 * CHUNK))
    assert len(rank.sent) == 3 and rank.sending == 3 * CHUNK and bytes(writer.pending) == b"d"
    assert rank.sent[1]["data"] == b"c" + b"d" * (CHUNK - 1)


def test_the_launcher_frames_are_cut_from_a_traceback():
    from reducelab import rank_reports as rank_loop
    here = rank_loop._LOOP_FILE
    magic = os.path.join(os.path.dirname(here), "magic.py")
    frames = [traceback.FrameSummary(here, 1, "serve"), traceback.FrameSummary(here, 2, "run_job"),
              traceback.FrameSummary(magic, 3, "exec_on_rank"),
              traceback.FrameSummary("/tmp/cell.py", 4, "my_fn"),
              traceback.FrameSummary(magic, 5, "exec_on_rank")]
    assert [f.name for f in rank_loop._after_launcher(frames)] == ["my_fn", "exec_on_rank"]
    assert rank_loop._after_launcher(frames[3:4]) == frames[3:4]


def test_messages_are_plain_pickles_of_dicts():
    from reducelab.group import _Proc

    class Conn:
        def send_bytes(self, data):
            self.data = data

        def recv_bytes(self):
            return self.data

    class Process:
        pid = os.getpid()
        exitcode = None
    p = _Proc(3, Process(), Conn())
    p.send({"kind": "run", "payload": b"x"})
    assert pickle.loads(p.conn.data) == {"kind": "run", "payload": b"x"} == p.recv()
    assert p.rank == 3 and p.exitcode() is None and p.created == psutil.Process().create_time()


# --- group.py: the headline of a failed run (README, "Faults tried") ------------------------------

def _failure(name, replies, died, pending, stacks, world_size=3, timeout=3.0, returned=None):
    """The error a LocalGroup with these replies would raise, built in this process, and
    whether its ranks would restart (``reports.run_failure``)."""
    from reducelab.reports import run_failure
    return run_failure(name, world_size, timeout, replies, died, pending, stacks, returned or {})


def _error(summary, in_distributed=False, pg=True, collectives=None):
    return {"kind": "error", "summary": summary, "traceback": "tb", "in_distributed": in_distributed,
            "pg": pg, "collectives": collectives}


def _refused(collectives=5, summary="RuntimeError: Cannot use ReduceOp.BAND", pg=True):
    return _error(summary, in_distributed=True, pg=pg, collectives=collectives)


def _stack(collective):
    summary = f"was waiting in {collective}, called from f line 3" if collective else \
        "was still running, at f line 3"
    return {"kind": "stack", "summary": summary, "traceback": "st", "collective": collective}


DONE = {"kind": "done"}
RESTART = "The ranks were stopped; 3 fresh ranks start at the next run()."


@pytest.mark.parametrize("replies, died, pending, stacks, headline, restart", [
    ({0: DONE, 2: DONE}, {}, {1}, {1: _stack(None)}, "f did not finish within 3 s on rank 1", True),
    ({}, {}, {0, 1, 2}, {0: _stack("all_reduce"), 1: _stack("all_reduce"), 2: _stack("all_reduce")},
     "f did not finish within 3 s on ranks 0, 1, 2", True),
    ({2: DONE}, {}, {0, 1}, {0: _stack("all_reduce"), 1: _stack("all_reduce")},
     "f did not finish within 3 s on ranks 0, 1: the ranks are not in the same collective", True),
    ({}, {}, {0, 1, 2}, {0: _stack("all_reduce"), 1: _stack("broadcast"), 2: _stack("all_reduce")},
     "f did not finish within 3 s on ranks 0, 1, 2: the ranks are not in the same collective", True),
    ({0: DONE}, {2: -9}, {1}, {}, "rank 2 died: killed by SIGKILL during f", True),
    ({}, {1: 3, 2: -9}, {0}, {}, "rank 1 died: exited with code 3 without returning during f", True),
    ({0: _error("ValueError: a"), 1: DONE, 2: DONE}, {}, set(), {}, "rank 0 raised ValueError in f", False),
    ({0: _error("ValueError: a"), 1: _error("KeyError: 'b'"), 2: _error("ValueError: c")}, {}, set(), {},
     "ranks 0, 1, 2 raised KeyError / ValueError in f", False),
    ({0: _error("its return value could not be pickled (lock): x"), 1: DONE, 2: DONE}, {}, set(), {},
     "rank 0 failed in f", False),
    ({0: _error("RuntimeError: gloo", in_distributed=True), 1: DONE, 2: DONE}, {}, set(), {},
     "rank 0 raised RuntimeError in f", True),
    ({0: _error("ValueError: a", pg=False), 1: DONE, 2: DONE}, {}, set(), {},
     "rank 0 raised ValueError in f", True),
    # the same refusal on every rank, each after the same number of collectives: kept
    ({0: _refused(), 1: _refused(), 2: _refused()}, {}, set(), {},
     "ranks 0, 1, 2 raised RuntimeError in f", False),
    ({0: _refused(6), 1: _refused(), 2: _refused()}, {}, set(), {},       # rank 0 is ahead
     "ranks 0, 1, 2 raised RuntimeError in f", True),
    ({0: _refused(None), 1: _refused(None), 2: _refused(None)}, {}, set(), {},   # not counted
     "ranks 0, 1, 2 raised RuntimeError in f", True),
    ({0: _refused(summary="RuntimeError: other"), 1: _refused(), 2: _refused()}, {}, set(), {},
     "ranks 0, 1, 2 raised RuntimeError in f", True),
    ({0: _refused(pg=False), 1: _refused(pg=False), 2: _refused(pg=False)}, {}, set(), {},
     "ranks 0, 1, 2 raised RuntimeError in f", True),
    ({0: _refused(), 1: _refused()}, {}, {2}, {2: _stack("all_reduce")},   # one still waits
     "ranks 0, 1 raised RuntimeError in f", True),
])
def test_a_failed_run_is_headlined_by_what_happened_and_says_whether_ranks_restart(
        replies, died, pending, stacks, headline, restart):
    err, restarts = _failure("f", replies, died, pending, stacks)
    assert err.headline == headline
    assert (RESTART in str(err)) is restart
    assert restarts is restart
    states = {r.rank: r.state for r in err.reports}
    assert all(states[r] == "stuck" for r in pending) and all(states[r] == "died" for r in died)
    assert err.ranks == sorted(set(pending) | set(died) | {r for r, m in replies.items()
                                                           if m["kind"] == "error"})


def test_a_rank_whose_value_was_still_on_its_way_is_said_so():
    err, _ = _failure("f", {0: DONE}, {}, {1}, {}, world_size=2, returned={1: 0.0})
    assert "rank 1: f returned; its return value was still being pickled or sent" in str(err)
    assert "rank 0: f returned" in str(err)
    err, _ = _failure("f", {0: DONE}, {}, {1}, {}, world_size=2)
    assert "rank 1: was still running" in str(err)
