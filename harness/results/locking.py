"""Who else is measuring: one run per results directory, and a note of every run on the machine.

``ResultsDirectoryLock`` holds an exclusive ``flock`` on ``<out>/.attnbench.lock`` for the whole
run, so a second run into the same directory is refused (saying which process holds it)
instead of interleaving its lines and timing against the first. ``MachineRuns`` does the same
per process in a runs directory of the user's own (private, ``machine_runs_dir``), so every run
can tell which of the user's other attnbench runs are measuring beside it. Lock files are
opened without following links, and probes of other runs' locks open them read-only. The kernel drops a ``flock`` when its process dies, however it dies,
so a stale lock file never blocks anything.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path

from ..common.files import UnsafeFileError, open_regular

LOCK_NAME = ".attnbench.lock"


class LockedError(RuntimeError):
    """Another attnbench run holds the lock (the message names it), or the directory cannot be written."""


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')}, scenario {holder.get('scenario')!r}, started {holder.get('started_at')}, out {holder.get('out')}"


#: The most of a lock file read for its holder (a holder is a few hundred bytes).
HOLDER_BYTES = 65536


def _holder_of(fd: int) -> dict | None:
    """The holder a lock file's descriptor says, ``{}`` when it is empty, None when it holds
    anything else (it is not an attnbench lock file)."""
    data = os.pread(fd, HOLDER_BYTES, 0)
    if not data:
        return {}
    try:
        holder = json.loads(data.decode("utf-8"))
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _read_holder(path: Path) -> dict:
    """Who holds the lock ``path`` (``{}`` when that cannot be read), read without following a link."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _holder_of(fd) or {}
    finally:
        os.close(fd)


class _FileLock:
    """An exclusive, non-blocking ``flock`` on ``path`` whose file says who holds it. The file is
    opened without following a symbolic link, and only an empty file or one that holds a holder
    (an earlier attnbench lock) is overwritten."""

    def __init__(self, path: Path, holder: dict):
        self.path, self.holder, self.fd = path, holder, None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        if _holder_of(fd) is None:
            os.close(fd)
            raise UnsafeFileError(f"{self.path} exists and is not an attnbench lock file; attnbench does not overwrite it (move it away)")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self.holder).encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _probe(path: Path) -> dict | None:
    """The holder of the lock file ``path`` if a live process holds it, else None (a free lock
    file is removed). Opened read-only and without following a link: a probe never writes."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_of(fd)
        return holder if holder is not None else None
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)
    return None


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
    """Where runs announce themselves: ``$ATTNBENCH_RUNS_DIR``, else this user's own folder in
    the system's temporary directory (``attnbench-runs-<uid>``, private: mode 0700), so no other
    user can plant or read a file there; created here if missing. ``UnsafeFileError`` when the
    default folder is a link, not a directory, someone else's or open to others."""
    chosen = os.environ.get("ATTNBENCH_RUNS_DIR")
    directory = Path(chosen or Path(tempfile.gettempdir()) / f"attnbench-runs-{os.geteuid()}")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFileError(f"the runs directory {directory} is not a directory")
    if not chosen and (info.st_uid != os.geteuid() or info.st_mode & 0o077):
        raise UnsafeFileError(f"the runs directory {directory} is not this user's private directory (mode 0700)")
    return directory


class MachineRuns:
    """``with MachineRuns(holder) as runs:`` announce this run; ``runs.others()`` are the other
    attnbench runs measuring on this machine now (each a holder dict)."""

    def __init__(self, holder: dict):
        self.holder, self.directory, self.lock = holder, None, None

    def __enter__(self):
        try:
            self.directory = machine_runs_dir()
            lock = _FileLock(self.directory / f"{os.getpid()}.lock", self.holder)
            if lock.acquire():
                self.lock = lock
        except OSError:  # an unusable runs directory: this run cannot announce itself, but it still measures
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock.path.unlink(missing_ok=True)

    def others(self) -> list[dict]:
        """Holders of the other locks in the directory that are still held (their process lives)."""
        if self.directory is None:
            return []
        own = self.lock.path if self.lock is not None else None
        holders = (_probe(path) for path in sorted(self.directory.glob("*.lock")) if path != own)
        return [holder for holder in holders if holder is not None]


def describe_runs(runs: list[dict]) -> str:
    return "; ".join(_describe(holder) for holder in runs)
