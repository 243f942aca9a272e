"""Files written so that a reader never sees half of one, and never through a planted link."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from .formatting import spreadsheet_safe

#: Flags of every descriptor attnbench opens on a file it writes: a symbolic link in the last
#: component is refused (``O_NOFOLLOW``), a FIFO or device never blocks the open (``O_NONBLOCK``).
SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFileError(OSError):
    """A path attnbench was to write or lock is a symbolic link or not a regular file."""


def open_regular(path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` without following a symbolic link at ``path`` and only onto a
    regular file (else ``UnsafeFileError`` naming the path); the caller closes the descriptor."""
    try:
        fd = os.open(path, flags | SAFE_FLAGS, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symbolic link; attnbench does not write or lock through a link it did not create") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path} is not a regular file")
    return fd


def read_small(path, most: int, what: str) -> bytes:
    """The bytes of ``path``, a regular file of at most ``most`` bytes: one larger (by its size, ``fstat``,
    before a byte is read), a directory, FIFO or device (never waited on) or an unreadable one is a
    ValueError naming the path and expecting ``what`` (``a histogram file``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror}); expected {what}") from None
    with os.fdopen(fd, "rb") as file:
        facts = os.fstat(fd)
        if not stat.S_ISREG(facts.st_mode):
            kind = "directory" if stat.S_ISDIR(facts.st_mode) else "special file (FIFO, device or socket)"
            raise ValueError(f"{path}: expected {what}, got a {kind}")
        data = file.read(most + 1) if facts.st_size <= most else b""
    if facts.st_size > most or len(data) > most:
        raise ValueError(f"{path}: {max(facts.st_size, len(data))} bytes, more than the {most} {what} may have")
    return data


def umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``, Linux 4.7 and later);
    elsewhere set and restored at once (``os.umask`` offers no read)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o077)
        os.umask(mask)
        return mask


@contextlib.contextmanager
def atomic_file(path):
    """``with atomic_file(path) as file:`` a binary file that becomes ``path`` when the block ends
    (``write_atomic``), with the mode a plain ``open`` would give it (0666 less the umask: 0644 under
    umask 022), never the temporary file's 0600; an exception removes it and leaves ``path`` as it was."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            os.fchmod(file.fileno(), 0o666 & ~umask())
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_atomic(path, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path``: into a temporary file in the same directory,
    flushed to disk (fsync), then renamed over ``path`` (``os.replace``), so ``path`` holds either
    its old content or the whole new one, even if the process dies midway; a link planted at
    ``path`` is replaced, never written through (``atomic_file``)."""
    with atomic_file(path) as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)


def write_csv_atomic(path, frame) -> None:
    """Write the pandas ``frame`` to ``path`` as CSV (``write_atomic``), its headers and cells made
    safe to open in a spreadsheet (``formatting.spreadsheet_safe``), its lines ended by CRLF as RFC 4180
    has them (so that a carriage return within a cell is quoted, never read as the end of a row)."""
    write_atomic(path, frame.rename(columns=spreadsheet_safe).map(spreadsheet_safe).to_csv(index=False, lineterminator="\r\n"))


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` (``write_atomic``)."""
    write_atomic(path, json.dumps(obj, indent=1))


def own_directory(path) -> Path:
    """``path`` made a directory if missing; ``UnsafeFileError`` when a symbolic link stands there
    (what attnbench writes into its output folder stays in it)."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafeFileError(f"{path} is a symbolic link; attnbench writes only into a directory of its own there")
    path.mkdir(exist_ok=True)
    return path
