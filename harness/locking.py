"""Who else is measuring: one run per results directory, and a note of every run on the machine.

``ResultsDirectoryLock`` holds an exclusive ``flock`` on ``<out>/.attnbench.lock`` for the whole
run, so a second run into the same directory is refused (saying which process holds it)
instead of interleaving its lines and timing against the first. ``MachineRuns`` does the same
per process in a machine-wide directory, so every run can tell which other attnbench runs
are measuring beside it. The kernel drops a ``flock`` when its process dies, however it dies,
so a stale lock file never blocks anything.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path

LOCK_NAME = ".attnbench.lock"


class LockedError(RuntimeError):
    """Another attnbench run holds the lock (the message names it), or the directory cannot be written."""


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')}, scenario {holder.get('scenario')!r}, started {holder.get('started_at')}, out {holder.get('out')}"


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class _FileLock:
    """An exclusive, non-blocking ``flock`` on ``path`` whose file says who holds it."""

    def __init__(self, path: Path, holder: dict):
        self.path, self.holder, self.fd = path, holder, None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self.holder).encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ResultsDirectoryLock:
    """``with ResultsDirectoryLock(out, holder):`` one run at a time writes into ``out``."""

    def __init__(self, out_dir, holder: dict):
        self.lock = _FileLock(Path(out_dir) / LOCK_NAME, holder)

    def __enter__(self):
        try:
            acquired = self.lock.acquire()
        except OSError as exc:
            raise LockedError(f"cannot write results into {self.lock.path.parent} ({exc.strerror or exc}); choose a writable --out") from None
        if not acquired:
            holder = _read_holder(self.lock.path)
            raise LockedError(
                f"{self.lock.path.parent} is in use by another attnbench run ({_describe(holder)}); two runs into one "
                "directory would interleave their results and time against each other: wait for it, or use another --out"
            )
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


def machine_runs_dir() -> Path:
    """Where runs announce themselves: ``$ATTNBENCH_RUNS_DIR``, else a folder in the system's
    temporary directory (shared by every user's runs on this machine)."""
    return Path(os.environ.get("ATTNBENCH_RUNS_DIR") or Path(tempfile.gettempdir()) / "attnbench-runs")


class MachineRuns:
    """``with MachineRuns(holder) as runs:`` announce this run; ``runs.others()`` are the other
    attnbench runs measuring on this machine now (each a holder dict)."""

    def __init__(self, holder: dict):
        self.directory = machine_runs_dir()
        self.lock = _FileLock(self.directory / f"{os.getpid()}.lock", holder)

    def __enter__(self):
        try:
            self.lock.acquire()
        except OSError:  # an unwritable temporary directory: this run cannot announce itself, but it still measures
            pass
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()
        self.lock.path.unlink(missing_ok=True)

    def others(self) -> list[dict]:
        """Holders of the other locks in the directory that are still held (their process lives)."""
        found = []
        for path in sorted(self.directory.glob("*.lock")) if self.directory.is_dir() else []:
            if path == self.lock.path:
                continue
            probe = _FileLock(path, {})
            try:
                free = probe.acquire()
            except OSError:
                continue
            if free:
                probe.release()
                path.unlink(missing_ok=True)
            else:
                found.append(_read_holder(path))
        return found


def describe_runs(runs: list[dict]) -> str:
    return "; ".join(_describe(holder) for holder in runs)
