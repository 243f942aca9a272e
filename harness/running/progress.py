"""The run's progress bar, with whatever is written to stderr while it is shown on lines of its own above it.

A warning (the runner's, Python's ``warnings``, a library's log line) and whatever a worker process writes to the stderr
it inherits (a warning as it imports, the traceback of a worker that died) would otherwise land in the middle of the
bar's line. While the bar is shown, ``sys.stderr`` writes each line through ``tqdm.write`` (``DummyTqdmFile``), and file
descriptor 2, which the workers inherit and C code writes to, is a pipe whose lines a thread hands to ``tqdm.write``;
the bar itself draws on the stderr the run was started with.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile

#: Seconds the end of the bar waits at most for the lines still in the pipe to be written.
DRAIN_S = 5.0


@contextlib.contextmanager
def progress_bar(total: int, *, initial: int = 0, shown: bool = True) -> Iterator[tqdm]:
    """A bar over ``total`` cells (``initial`` of them done already) on stderr, none unless ``shown``; while it is
    shown, every line written to stderr, by this process or by those it starts, goes above it."""
    if not shown:
        with tqdm(total=total, initial=initial, disable=True) as bar:
            yield bar
        return
    with _terminal() as terminal:
        bar = tqdm(total=total, initial=initial, unit="cell", dynamic_ncols=True, file=terminal)
        try:
            with lines_above_bars(terminal):
                yield bar
        finally:
            bar.close()


@contextlib.contextmanager
def _terminal() -> Iterator[TextIO]:
    """Where the bar draws: a copy of file descriptor 2 where ``sys.stderr`` writes to it (it becomes a pipe
    meanwhile), else ``sys.stderr`` itself (a stream of its own, as pytest's capture)."""
    try:
        descriptor = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        descriptor = None
    if descriptor != 2:
        yield sys.stderr
        return
    sys.stderr.flush()
    with os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors) as terminal:
        yield terminal


@contextlib.contextmanager
def lines_above_bars(terminal: TextIO) -> Iterator[None]:
    """Within: each line written to ``sys.stderr`` or to file descriptor 2 is written by ``tqdm.write`` on ``terminal``,
    above the bars drawn there; both are restored after, the lines still in the pipe written first."""
    sys.stderr.flush()
    saved_stderr, saved_fd = sys.stderr, os.dup(2)
    reading, writing = os.pipe()
    forward = _Forward(reading, terminal)
    forward.start()
    os.dup2(writing, 2)
    sys.stderr = DummyTqdmFile(terminal)
    try:
        yield
    finally:
        sys.stderr = saved_stderr
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.write(writing, forward.end)  # after every line written to the pipe so far
        os.close(writing)
        forward.ended.wait(DRAIN_S)
        forward.hand_over(saved_stderr)


class _Forward(threading.Thread):
    """Hands each line read from the pipe ``reading`` to ``tqdm.write`` on ``file`` until every writer closed it;
    sets ``ended`` when it reads the line ``end``."""

    def __init__(self, reading: int, file: TextIO):
        super().__init__(name="stderr above the progress bar", daemon=True)
        self.reading, self.file = reading, file
        self.end, self.ended = f"\0end of the progress bar {secrets.token_hex(8)}\n".encode(), threading.Event()

    def run(self) -> None:
        with open(self.reading, "rb") as pipe:
            for line in pipe:
                if line == self.end:
                    self.ended.set()
                    continue
                with tqdm.get_lock():
                    tqdm.write(line.decode(errors="replace").rstrip("\n"), file=self.file, nolock=True)

    def hand_over(self, file: TextIO) -> None:
        """Write the lines of the processes that still hold the pipe (the resource tracker multiprocessing starts with the
        first worker lives as long as this process) to ``file`` from now on."""
        with tqdm.get_lock():
            self.file = file
