"""Two revisions of a git repository checked out side by side, for ``attnbench regress``, ``bisect`` and
``kernels --compare``: each in a temporary git worktree (the head may be the working tree, uncommitted
changes included), removed afterwards, each with the environment of its own processes (``Revision.env``:
its own Triton cache)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .signals import deferred

SIDES = ("base", "head")
WORKING_TREE = "working tree"


class RegressError(RuntimeError):
    """The revisions cannot be checked out or run; the message says why."""


@dataclass
class Revision:
    """One side of the comparison, checked out at ``root``."""

    side: str  #: "base" or "head"
    label: str  #: what the user named ("HEAD~1", "main") or "working tree"
    commit: str
    root: Path
    dirty_files: int = 0  #: uncommitted changes copied into the worktree (working tree only)
    threads: int | None = None  #: OMP_NUM_THREADS of its processes (None: PyTorch's default)
    plugins: tuple[str, ...] = ()  #: the plugins its processes import (``--plugin``: absolute paths or module names)

    def describe(self) -> str:
        if self.label != WORKING_TREE:
            return f"{self.label} ({self.commit[:10]})"
        state = f"dirty: {self.dirty_files} files changed" if self.dirty_files else "clean"
        return f"working tree ({state}) on {self.commit[:10]}"

    @property
    def env(self) -> dict:
        """The environment of this revision's processes: its own Triton cache, without a GPU
        Triton's interpreter, the number of CPU threads and the plugins (``ATTNBENCH_PLUGINS``)."""
        env = {"TRITON_CACHE_DIR": str(self.root.parent / f"triton-cache-{self.side}")}
        if not _has_cuda():
            env["TRITON_INTERPRET"] = "1"
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.plugins:
            env["ATTNBENCH_PLUGINS"] = ",".join(self.plugins)
        return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def git(repo, *args: str) -> str:
    """The output of ``git -C repo ARGS``; RegressError with git's message when it fails."""
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RegressError(f"git {' '.join(args)}: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done.stdout.strip()


def commit_of(repo, spec: str, option: str | None = None) -> str:
    """The full hash of the commit revision ``spec`` names in ``repo`` (a tag or branch: its commit): the one door by which a
    user's revision reaches git. RegressError, naming ``option`` (the command line's, such as ``--base``) and ``spec``, when
    it names no commit; one beginning with ``-`` names none (git would read it as an option)."""
    done = None
    if not spec.startswith("-"):
        done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"], capture_output=True, text=True)
    if done is None or done.returncode != 0:
        raise RegressError(f"{option + ': ' if option else ''}{spec!r} is not a revision of the repository at {repo}")
    return done.stdout.strip()


def repository(path) -> Path:
    """The top directory of the git repository holding ``path``."""
    return Path(git(path, "rev-parse", "--show-toplevel")).resolve()


def _copy_working_tree(repo: Path, root: Path) -> int:
    """Make ``root`` (a worktree at HEAD) a copy of ``repo``'s working tree: every tracked and
    untracked, not ignored file as it is now (deleted ones deleted), symbolic links copied as links,
    never followed, nothing written outside ``root``. Returns how many files differ from HEAD."""
    for path in git(repo, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0"):
        if not path:
            continue
        source = repo / path
        present = not _beyond_link(repo, path) and (source.is_symlink() or source.is_file())
        target = _real_directory(root, Path(path).parent) / Path(path).name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir() and present:
            shutil.rmtree(target)
        if present and source.is_symlink():
            os.symlink(os.readlink(source), target)
        elif present:
            shutil.copy2(source, target, follow_symlinks=False)
    return len(git(repo, "status", "--porcelain", "--untracked-files=all").splitlines())


def _beyond_link(top: Path, path: str) -> bool:
    """Whether a directory of ``path`` under ``top`` is a symbolic link (git sees no file beyond one)."""
    return any((top / parent).is_symlink() for parent in Path(path).parents if parent != Path("."))


def _real_directory(root: Path, relative: Path) -> Path:
    """``root/relative`` as a real directory: a link or file standing at any part of it (HEAD's,
    replaced by a directory in the working tree) removed first, so no write follows it out of ``root``."""
    directory = root
    for part in relative.parts:
        directory = directory / part
        if directory.is_symlink() or directory.is_file():
            directory.unlink()
        directory.mkdir(exist_ok=True)
    return directory


@contextmanager
def scratch_directory() -> Iterator[Path]:
    """A temporary directory for worktrees and their Triton caches, removed on exit (a stop signal, ``common.signals``,
    included: made and removed with the signals held)."""
    scratch = None
    try:
        with deferred():
            scratch = Path(tempfile.mkdtemp(prefix="attnbench-regress-")).resolve()
        yield scratch
    finally:
        with deferred():
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def worktree(repo: Path, spec: str | None, side: str, scratch: Path) -> Iterator[Revision]:
    """Revision ``spec`` (None: the working tree) in a temporary worktree ``scratch/side``, removed on
    exit, also after an error or a stop signal (``common.signals``: Ctrl-C, SIGTERM, SIGHUP), which is held while the
    worktree is added and removed, so that neither is cut in half and left registered in ``repo``."""
    root = scratch / side
    commit = commit_of(repo, spec or "HEAD", f"--{side}")
    try:
        with deferred():
            git(repo, "worktree", "add", "--detach", str(root), commit)
        dirty = _copy_working_tree(repo, root) if spec is None else 0
        yield Revision(side, spec or WORKING_TREE, commit, root, dirty)
    finally:
        with deferred():
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(root)], capture_output=True)
            subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


@contextmanager
def worktrees(repo: Path, base: str, head: str | None) -> Iterator[tuple[Revision, Revision]]:
    """Both revisions in temporary worktrees of one scratch directory (``head=None``: the working
    tree), removed on exit, also after an error or Ctrl-C."""
    with scratch_directory() as scratch, worktree(repo, base, SIDES[0], scratch) as old, worktree(repo, head, SIDES[1], scratch) as new:
        yield old, new


def changed_files(base: Revision, head: Revision) -> list[str]:
    """The files that differ between the two checkouts (the head with its uncommitted changes): the
    tracked ones git compares with the base commit, and the untracked ones. Nothing is added to an
    index: the worktree shares the user's object database, which stays as it was."""
    tracked = git(head.root, "diff", "--name-only", "--no-renames", "-z", base.commit, "--").split("\0")
    untracked = git(head.root, "ls-files", "--others", "--exclude-standard", "-z").split("\0")
    return sorted({path for path in tracked + untracked if path})
