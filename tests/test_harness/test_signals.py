"""One way to stop (harness.common.signals): SIGINT, SIGTERM and SIGHUP end a command as Ctrl-C does, exit code 128 + the
signal's number, without a traceback. Slow: each sent, as ``timeout`` and a terminal send them (to the whole process group),
to a real ``attnbench run --commits`` while a commit's worker measures, leaves no worktree registered in the repository, no
temporary directory, no process, and whole results files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import commit, git

from harness.common.signals import STOP_SIGNALS, Stopped, deferred, stopping
from harness.results import read_records

ROOT = Path(__file__).parents[2]
TINY = "variants: {softmax: {}}\naxes: {seq_len: 16, batch: 1, heads: 2, d_key: 8}\nmodes: [forward]\nmeasure: {warmup: 1, repeats: 5}\n"
#: A commit's own worker loop whose cell hangs: it says it is ready, writes its pid where the test waits for it, and
#: answers no cell (it cannot even unpickle one: this commit has no harness.scenarios) until it is told to stop.
HANGING_WORKER = """import os, pickle
from pathlib import Path


def serve(conn, plugins):
    conn.send("ready")
    Path(os.environ["SIGNALS_TEST_WORKER"]).write_text(str(os.getpid()))
    while True:
        try:
            if pickle.loads(conn.recv_bytes()) is None:
                return
        except ImportError:
            continue
"""


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda signum: signal.Signals(signum).name)
def test_each_stop_signal_raises_once_and_sets_the_exit_code(signum):
    with stopping() as stop:
        with pytest.raises(Stopped) as raised:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # not reached: the handler raises at once
        assert isinstance(raised.value, KeyboardInterrupt) and raised.value.signum == signum
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not cut the ending short
    assert stop.exit_code(130) == 128 + signum and stop.signum == signum
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.getsignal(signal.SIGINT) == signal.default_int_handler


def test_a_signal_ignored_at_the_start_stays_ignored():
    """``nohup attnbench ...``: SIGHUP was ignored when the command started."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stopping() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
        assert stop.signum is None and stop.exit_code(0) == 0
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_deferred_step_finishes_before_the_signal_acts():
    finished = False
    with stopping(), pytest.raises(Stopped):
        with deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            finished = True
    assert finished


@pytest.fixture(scope="module")
def hanging_range(tmp_path_factory) -> tuple[Path, Path]:
    """A repository of three commits (the range: the last two) of a code of their own: one whose variants do not import,
    then one whose worker hangs in its cell; and the tiny scenario they measure."""
    root = tmp_path_factory.mktemp("signals")
    repo = root / "repo"
    (repo / "harness" / "running").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "README").write_text("a project of its own\n")
    commit(repo, "first")
    (repo / "harness" / "__init__.py").write_text("")
    (repo / "harness" / "running" / "__init__.py").write_text("")
    (repo / "harness" / "running" / "worker.py").write_text(HANGING_WORKER)
    (repo / "variants").mkdir()
    (repo / "variants" / "__init__.py").write_text('raise ImportError("broken on purpose")\n')
    commit(repo, "variants do not import")
    (repo / "variants" / "__init__.py").write_text("")
    commit(repo, "a cell that hangs")
    scenario = root / "tiny-signals.yaml"
    scenario.write_text(TINY)
    return repo, scenario


def as_a_terminal_starts_it() -> None:
    """The stop signals at their defaults in the run (a suite started in the background or under nohup ignores some)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda signum: signal.Signals(signum).name)
def test_a_signal_mid_range_ends_the_run_cleanly(tmp_path, hanging_range, signum):
    repo, scenario = hanging_range
    out, temporary, ready = tmp_path / "out", tmp_path / "tmp", tmp_path / "worker.pid"
    temporary.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temporary), "SIGNALS_TEST_WORKER": str(ready)}
    command = [sys.executable, "-m", "harness.cli", "run", str(scenario), "--commits", "HEAD~2..HEAD", "--repo", str(repo), "--out", str(out), "--no-progress"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, preexec_fn=as_a_terminal_starts_it
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the hanging commit's worker never started: " + ("".join(process.communicate()) if process.poll() is not None else "")
        os.killpg(process.pid, signum)  # as a terminal (Ctrl-C, a hang-up) and `timeout` send it: to the process group
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 128 + signum, stdout + stderr
    assert "Traceback" not in stderr and "interrupted: every finished cell is in its commit's results file" in stderr, stderr
    assert git(repo, "worktree", "list").count("\n") == 0  # only the repository itself
    assert not list(temporary.iterdir())
    with pytest.raises(ProcessLookupError):  # no worker or other process of the run outlived it
        os.killpg(process.pid, 0)
    files = sorted(out.glob("tiny-signals-*.jsonl"))
    assert len(files) == 2, stdout
    statuses = sorted(record.get("status") for path in files for record in read_records(path) if record["kind"] == "cell")
    assert statuses == ["error"]  # the broken commit's; the hanging commit's file has its run line, its cell left for the next run
