"""How a command ends when asked to stop: SIGINT (Ctrl-C), SIGTERM (``timeout``, a CI time limit, Kubernetes) and SIGHUP
(the terminal closed) alike. Inside ``stopping()`` each raises ``Stopped``, a ``KeyboardInterrupt``, so that the one path
Ctrl-C takes ends the command (the run loop records that it was interrupted, worker processes are ended, worktrees and
temporary directories removed, every finished cell kept); the first signal is remembered for the exit code,
``128 + its number`` (130, 143, 129), and later ones do not cut that ending short. A signal ignored when the command
started (``nohup``: SIGHUP) stays ignored. ``deferred()`` holds the signals over a step that must not be cut in half (a
worktree added or removed); worker processes start with them ignored (``ignored_by_children``): ending them is the
command's work."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal, raised where Ctrl-C's ``KeyboardInterrupt`` would be."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Held:
    """The ``deferred()`` blocks this process is in, and the ``Stopped`` to raise once it leaves the last."""

    depth = 0
    pending: Stopped | None = None


class Stop:
    """What ``stopping()`` saw: the first stop signal (None: none)."""

    signum: int | None = None

    def exit_code(self, code: int) -> int:
        """``code``, or ``128 + the signal's number`` once a stop signal has arrived."""
        return code if self.signum is None else 128 + self.signum


@contextmanager
def stopping() -> Iterator[Stop]:
    """Inside, the first stop signal raises ``Stopped`` and is remembered (``Stop.signum``); later ones are only
    remembered. The handlers are this process's again on exit."""
    stop = Stop()

    def handle(signum, frame):
        if stop.signum is None:
            stop.signum = signum
            if not _Held.depth:
                raise Stopped(signum)
            _Held.pending = Stopped(signum)

    defaults = (signal.SIG_DFL, signal.default_int_handler)
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler in defaults:
            signal.signal(signum, handle)
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            if handler in defaults:
                signal.signal(signum, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """The stop signals held inside: one that arrives meanwhile acts once the (outermost) block is over. Blocked for
    this thread and the processes it starts; one that another thread (torch's, tqdm's) takes is raised at the end."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if not _Held.depth and _Held.pending is not None:
            pending, _Held.pending = _Held.pending, None
            raise pending


@contextmanager
def ignored_by_children() -> Iterator[None]:
    """Processes started inside start with the stop signals ignored, and keep them so (Python installs its
    KeyboardInterrupt handler only over the default): a signal sent to the whole process group (Ctrl-C, ``timeout``) is
    the command's to act on. Held meanwhile (``deferred``: Linux keeps a blocked signal pending even while it is
    ignored), so one that arrives while a child starts acts here once the block is over instead of being lost (but one
    that another thread takes in those milliseconds: a thread of this process ignores it too)."""
    with deferred():
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in STOP_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def ignore_stop_signals() -> None:
    """In a child process before it execs (``preexec_fn``): the stop signals ignored, as ``ignored_by_children`` leaves them."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
