"""Two revisions of a git repository checked out side by side, for ``attnbench regress``, ``bisect`` and
``kernels --compare``: each in a temporary git worktree (the head may be the working tree, uncommitted
changes included), removed afterwards, each with the environment of its own processes (``Revision.env``:
its own Triton cache)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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

    def describe(self) -> str:
        if self.label != WORKING_TREE:
            return f"{self.label} ({self.commit[:10]})"
        state = f"dirty: {self.dirty_files} files changed" if self.dirty_files else "clean"
        return f"working tree ({state}) on {self.commit[:10]}"

    @property
    def env(self) -> dict:
        """The environment of this revision's processes: its own Triton cache, without a GPU
        Triton's interpreter, and the number of CPU threads."""
        env = {"TRITON_CACHE_DIR": str(self.root.parent / f"triton-cache-{self.side}")}
        if not _has_cuda():
            env["TRITON_INTERPRET"] = "1"
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
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


def repository(path) -> Path:
    """The top directory of the git repository holding ``path``."""
    return Path(git(path, "rev-parse", "--show-toplevel")).resolve()


def _copy_working_tree(repo: Path, root: Path) -> int:
    """Make ``root`` (a worktree at HEAD) a copy of ``repo``'s working tree: every tracked and
    untracked, not ignored file as it is now (deleted ones deleted). Returns how many files
    differ from HEAD."""
    for path in git(repo, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0"):
        source, target = repo / path, root / path
        if not path:
            continue
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        elif target.is_file():
            target.unlink()
    return len(git(repo, "status", "--porcelain", "--untracked-files=all").splitlines())


@contextmanager
def worktrees(repo: Path, base: str, head: str | None) -> Iterator[tuple[Revision, Revision]]:
    """Both revisions in temporary worktrees (``head=None``: the working tree), removed on exit,
    also after an error or Ctrl-C."""
    scratch = Path(tempfile.mkdtemp(prefix="attnbench-regress-")).resolve()
    added = []
    try:
        revisions = []
        for side, spec in zip(SIDES, (base, head)):
            commit = git(repo, "rev-parse", "--verify", f"{spec or 'HEAD'}^{{commit}}")
            root = scratch / side
            git(repo, "worktree", "add", "--detach", str(root), commit)
            added.append(root)
            dirty = _copy_working_tree(repo, root) if spec is None else 0
            revisions.append(Revision(side, spec or WORKING_TREE, commit, root, dirty))
        yield revisions[0], revisions[1]
    finally:
        for root in added:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(root)], capture_output=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def changed_files(base: Revision, head: Revision) -> list[str]:
    """The files that differ between the two checkouts (the head with its uncommitted changes)."""
    git(head.root, "add", "--all")  # the head worktree's own index; the user's is untouched
    return git(head.root, "diff", "--cached", "--name-only", "--no-renames", base.commit).splitlines()
