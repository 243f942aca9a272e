"""git checkouts touch nothing of the user's (issue 46, class 3): ``regress``, ``bisect`` and ``kernels --compare``
copy the working tree into a temporary worktree with its links as links, never written through, and list the
changed files without writing the user's untracked files into the user's object database. Each test takes a second."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from helpers import commit
from helpers import git as _git

from harness.common.checkouts import changed_files, worktrees

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _repository(repo):
    """A one-commit repository at ``repo`` holding one file."""
    repo.mkdir(parents=True)
    (repo / "kept.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    return commit(repo, "first")


def _objects(repo) -> dict:
    """``git count-objects -v`` of ``repo``: loose and packed object counts and sizes."""
    return dict(line.split(": ") for line in _git(repo, "count-objects", "-v").splitlines())


def test_tracked_links_are_copied_as_links_and_nothing_outside_is_written(tmp_path, monkeypatch):
    # The worktree is made at tmp_path/t/u/attnbench-regress-*/head, the repository at tmp_path/a/b/repo: the same
    # relative link leads out of the repository to tmp_path/source.txt and out of the worktree to tmp_path/t/source.txt.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t" / "u"))
    (tmp_path / "t" / "u").mkdir(parents=True)
    victim, source, absolute = tmp_path / "t" / "source.txt", tmp_path / "source.txt", tmp_path / "absolute.txt"
    victim.write_text("someone else's data\n")
    source.write_text("what the link leads to in the user's tree\n")
    absolute.write_text("an absolute link's target\n")
    repo = tmp_path / "a" / "b" / "repo"
    _repository(repo)
    (repo / "out").symlink_to("../../../source.txt")
    (repo / "abs").symlink_to(absolute)
    (repo / "dir").mkdir()
    (repo / "dir" / "inner").symlink_to("../kept.py")
    first = commit(repo, "links")
    (repo / "kept.py").write_text("x = 2\n")  # a dirty working tree: the head is copied
    with worktrees(repo, first, None) as (base, head):
        assert head.root.parent.parent == tmp_path / "t" / "u"
        for name, target in (("out", "../../../source.txt"), ("abs", str(absolute)), ("dir/inner", "../kept.py")):
            assert os.readlink(head.root / name) == target, name
        assert (head.root / "kept.py").read_text() == "x = 2\n" and changed_files(base, head) == ["kept.py"]
    assert victim.read_text() == "someone else's data\n"
    assert sorted(path.name for path in (tmp_path / "t").iterdir()) == ["source.txt", "u"]
    assert absolute.read_text() == "an absolute link's target\n" and source.read_text() == "what the link leads to in the user's tree\n"


def test_a_link_of_head_replaced_by_a_directory_is_not_written_through(tmp_path):
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    repo = tmp_path / "repo"
    _repository(repo)
    (repo / "data").symlink_to(victim)
    commit(repo, "a link to a directory")
    (repo / "data").unlink()
    (repo / "data").mkdir()
    (repo / "data" / "new.py").write_text("y = 1\n")  # untracked, where HEAD has a link
    with worktrees(repo, "HEAD", None) as (base, head):
        assert not (head.root / "data").is_symlink() and (head.root / "data" / "new.py").read_text() == "y = 1\n"
        assert changed_files(base, head) == ["data", "data/new.py"]
    assert list(victim.iterdir()) == []


def test_listing_changed_files_writes_nothing_into_the_users_object_database(tmp_path):
    repo = tmp_path / "repo"
    first = _repository(repo)
    (repo / "kept.py").write_text("x = 3\n")
    (repo / ".env").write_text("TOKEN=not for git\n")
    (repo / "large.bin").write_bytes(os.urandom(1 << 20))
    (repo / "empty.py").write_text("")
    before = _objects(repo)
    with worktrees(repo, first, None) as (base, head):
        assert changed_files(base, head) == [".env", "empty.py", "kept.py", "large.bin"]
        assert head.dirty_files == 4
    assert _objects(repo) == before
