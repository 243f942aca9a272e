"""Warnings never break the progress bar's line (issue 53, item 7): while ``attnbench run``'s bar is shown, a Python
warning, a line the runner prints and a line a worker process writes to the stderr it inherits each come on a line
of their own above the bar (harness.running.progress). The streams are read back as a terminal shows them."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import LocalTestExecutor

from harness.running.executors import unmeasured
from harness.running.progress import progress_bar

#: A bar shown on a real stderr (a pipe, as under nox) with a Python warning and a child process's line while it is
#: shown, and a line after it.
SCRIPT = """
import subprocess, sys, warnings
from harness.running.progress import progress_bar
with progress_bar(2) as bar:
    bar.set_description("first cell")
    bar.update()
    warnings.warn("a warning while the bar is shown")
    subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('a worker writes this\\\\n')"], check=True)
    bar.update()
print("after the bar", file=sys.stderr)
"""

CHILD = [sys.executable, "-c", "import sys; sys.stderr.write('a worker writes this\\n')"]


def shown(stream: str) -> list[str]:
    """The lines a terminal shows of ``stream``: within a line, each carriage return writes over it from its start."""
    lines = []
    for line in stream.split("\n"):
        text = ""
        for part in line.split("\r"):
            text = part + text[len(part) :]
        lines.append(text.rstrip())
    return lines


def test_a_warning_and_a_child_processs_line_come_on_lines_of_their_own_above_the_bar():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, timeout=60)  # bytes: text would read each \r as \n
    assert done.returncode == 0, done.stderr
    lines = shown(done.stderr.decode())
    assert "<string>:7: UserWarning: a warning while the bar is shown" in lines, lines
    assert "a worker writes this" in lines, lines
    assert lines[-3:-1] == ["first cell: 100%|██████████| 2/2 [" + lines[-3].split("[", 1)[1], "after the bar"], lines
    assert lines.index("a worker writes this") < len(lines) - 3, "the worker's line comes above the bar's last state"


def test_stderr_and_its_file_descriptor_are_restored_after_the_bar_however_it_ends(capfd):
    before = (sys.stderr, os.fstat(2).st_ino)
    try:
        with progress_bar(1):
            assert sys.stderr is not before[0] and os.fstat(2).st_ino != before[1]
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert (sys.stderr, os.fstat(2).st_ino) == before
    with progress_bar(1, shown=False):
        assert (sys.stderr, os.fstat(2).st_ino) == before, "no bar shown: stderr left as it is"


class _Talkative(LocalTestExecutor):
    """An executor that measures nothing: before it skips each cell, it prints a line on stderr, as the runner's warnings
    do, and a child process writes one, as a worker does."""

    def measure(self, todo, starting):
        for cell in todo:
            starting(cell)
            print("warning: the runner says this", file=sys.stderr)
            subprocess.run(CHILD, check=True)
            yield cell, {**unmeasured("skipped", "not measured here"), "machine": self.machine, "node_id": None}

    def run_fields(self, node_id):
        return {}

    def close(self):
        pass


def test_the_runs_bar_takes_the_lines_of_the_runner_and_its_workers_above_it(tmp_path, capfd):
    from harness.running import runner
    from harness.scenarios.scenario import load_scenario

    (tmp_path / "two.yaml").write_text("name: two\nvariants: {linear: {}}\naxes: {seq_len: [16, 32], batch: 1, heads: 1, d_key: 8}\n")
    runner.run(load_scenario(str(tmp_path / "two.yaml")), tmp_path / "out", progress=True, executor=_Talkative())
    err = capfd.readouterr().err
    lines = shown(err)
    assert lines.count("warning: the runner says this") == 2 and lines.count("a worker writes this") == 2, lines
    assert "\r" in err and "2/2" in lines[-2], "the bar was drawn, its last state the last line"
