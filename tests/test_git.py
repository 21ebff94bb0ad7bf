"""git.py against real repositories: determinism, stable export, errors carrying output."""

from __future__ import annotations

import io
import itertools
import tarfile
from pathlib import Path

import pytest

from patchkit.carry import wheels
from patchkit.errors import ToolError, UserError
from patchkit.util import git

QH = "mlx/backend/metal/kernels/quantized.h"
PIN_QH_BLOB = "f628c0561227b709e455d91dc0a0f5885368f26a"
DATE = "2026-08-17T00:00:00+00:00"


def _repo(tmp: Path, text: str = "a\n") -> Path:
    repo = tmp / "r"
    git.init(repo)
    (repo / "f.txt").write_text(text)
    git.add(repo, ["f.txt"])
    git.commit(repo, "base", date=DATE)
    return repo


def test_hash_object_matches_pinned_blob_of_real_header() -> None:
    # The 0.32.1 wheel's quantized.h is byte-identical to the pin: same blob id.
    text = wheels.read_header("0.32.1", QH)
    assert git.hash_object(None, text) == PIN_QH_BLOB
    # Control: the 0.32.4 header is a different blob.
    assert git.hash_object(None, wheels.read_header("0.32.4", QH)) != PIN_QH_BLOB


@pytest.mark.parametrize(
    ("same_date", "same_message"),
    # axis 1: commit date; axis 2: message. Only both equal gives the same id.
    list(itertools.product([True, False], [True, False])),
    ids=lambda v: "same" if v else "differs",
)
def test_commit_ids_are_a_function_of_inputs(
    tmp_path: Path, same_date: bool, same_message: bool
) -> None:
    ids = []
    for i in range(2):
        repo = _repo(tmp_path / str(i))
        (repo / "f.txt").write_text("b\n")
        git.add(repo, ["f.txt"])
        date = DATE if (same_date or i == 0) else "2026-08-18T00:00:00+00:00"
        msg = "change" if (same_message or i == 0) else "other"
        ids.append(git.commit(repo, msg, date=date))
    assert (ids[0] == ids[1]) == (same_date and same_message)


def test_format_patch_reexport_is_byte_identical(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    base = git.rev_parse(repo, "HEAD")
    (repo / "f.txt").write_text("a\nb\n")
    git.add(repo, ["f.txt"])
    head = git.commit(repo, "add b", date=DATE)
    one = git.format_patch(repo, base, head, tmp_path / "one")
    two = git.format_patch(repo, base, head, tmp_path / "two")
    assert [p.read_bytes() for p in one] == [p.read_bytes() for p in two]
    text = one[0].read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")  # --zero-commit
    assert "\n-- \n" not in text  # --no-signature
    assert " 1 file changed" not in text  # --no-stat
    blob = git.blob_id(repo, base, "f.txt")
    assert f"index {blob}.." in text  # --full-index


def test_tool_error_carries_command_and_output(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    with pytest.raises(ToolError) as info:
        git.rev_parse(repo, "no-such-rev")
    assert info.value.cmd[:3] == ["git", "-C", str(repo)]
    assert info.value.returncode != 0
    with pytest.raises(ToolError) as info:
        git.run(repo, "no-such-verb")
    assert "no-such-verb" in info.value.stderr and info.value.returncode == 1
    assert git.try_rev_parse(repo, "no-such-rev") is None
    with pytest.raises(ToolError) as info:
        git.show_file(repo, "HEAD", "missing.txt")
    assert "missing.txt" in info.value.stderr


def test_show_file_is_byte_exact_with_crlf(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    git.init(repo)
    (repo / "f.txt").write_bytes(b"a\r\nb\n")
    git.add(repo, ["f.txt"])
    git.commit(repo, "crlf", date=DATE)
    text = git.show_file(repo, "HEAD", "f.txt")
    assert text == "a\r\nb\n"
    assert git.hash_object(None, text) == git.blob_id(repo, "HEAD", "f.txt")


@pytest.mark.parametrize(
    "data",
    # Trailing newlines are where a command wrapper strips: none, one, two.
    [b"no newline", b"one\n", b"two\n\n", b"\n"],
    ids=["none", "one", "two", "only"],
)
def test_show_file_keeps_trailing_newlines(tmp_path: Path, data: bytes) -> None:
    repo = tmp_path / "r"
    git.init(repo)
    (repo / "f.txt").write_bytes(data)
    git.add(repo, ["f.txt"])
    git.commit(repo, "text", date=DATE)
    text = git.show_file(repo, "HEAD", "f.txt")
    assert text.encode() == data
    assert git.hash_object(None, text) == git.blob_id(repo, "HEAD", "f.txt")


def test_archive_and_ls_tree_read_the_commit_not_the_worktree(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "a\r\n")
    (repo / "sub dir").mkdir()
    (repo / "sub dir" / "g.txt").write_bytes(b"g")
    git.add(repo, ["sub dir/g.txt"])
    head = git.commit(repo, "two files", date=DATE)
    (repo / "f.txt").write_text("edited, not committed\n")
    with tarfile.open(fileobj=io.BytesIO(git.archive(repo, head))) as tar:
        assert tar.extractfile("f.txt").read() == b"a\r\n"  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(git.archive(repo, head, ["sub dir"]))) as tar:
        assert [m.name for m in tar.getmembers() if m.isfile()] == ["sub dir/g.txt"]
    entries = git.ls_tree(repo, head)
    assert [(e.type, e.path) for e in entries] == [("blob", "f.txt"), ("tree", "sub dir")]
    assert entries[0].id == git.blob_id(repo, head, "f.txt")
    assert [e.path for e in git.ls_tree(repo, head, ["sub dir/g.txt"])] == ["sub dir/g.txt"]
    assert git.ls_tree(repo, head, ["absent"]) == []
    with pytest.raises(ToolError) as info:
        git.archive(repo, "no-such-rev")
    assert info.value.cmd[:4] == ["git", "-C", str(repo), "archive"] and info.value.stderr


def test_am_replays_a_format_patch_to_the_same_tree(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    base = git.rev_parse(repo, "HEAD")
    (repo / "f.txt").write_text("a\nb\n")
    git.add(repo, ["f.txt"])
    head = git.commit(repo, "add b", date=DATE)
    series = git.format_patch(repo, base, head, tmp_path / "series")
    wt = tmp_path / "wt"
    git.worktree_add(repo, wt, base)
    got = git.am(wt, series)
    assert got != base and git.tree_id(wt, got) == git.tree_id(repo, head)
    assert git.status_porcelain(wt) == ""


def test_a_series_is_checked_in_order_without_touching_the_checkout(tmp_path: Path) -> None:
    """The second patch edits the line the first one wrote: each alone does not apply to
    HEAD, the series does; the worktree and index stay as they were. Control: the series
    in the other order is refused."""
    repo = _repo(tmp_path)
    base = git.rev_parse(repo, "HEAD")
    for text in ("a\nb\n", "a\nc\n"):
        (repo / "f.txt").write_text(text)
        git.add(repo, ["f.txt"])
        head = git.commit(repo, text.replace("\n", " "), date=DATE)
    series = git.format_patch(repo, base, head, tmp_path / "series")
    git.run(repo, "reset", "--quiet", "--hard", base)
    with pytest.raises(ToolError):
        git.apply_check(repo, series[1])
    git.apply_check_series(repo, series)
    assert git.status_porcelain(repo) == "" and (repo / "f.txt").read_text() == "a\n"
    with pytest.raises(ToolError):
        git.apply_check_series(repo, series[::-1])


def test_status_porcelain_limited_to_paths(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "f.txt").write_text("changed\n")
    (repo / "new.txt").write_text("new\n")
    assert git.status_porcelain(repo).splitlines() == [" M f.txt", "?? new.txt"]
    assert git.status_porcelain(repo, ["new.txt"]) == "?? new.txt\n"
    assert git.status_porcelain(repo, ["absent"]) == ""


def test_user_config_reads_what_the_isolated_verbs_hide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = _repo(tmp_path)
    home = tmp_path / "global"
    home.write_text("[user]\n\tname = Global Name\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    assert git.user_config(repo, "user.name") == "Global Name"
    assert git.user_config(repo, "user.email") is None
    # Control: every other verb ignores the global config.
    assert git.run(repo, "config", "--get", "user.name", ok_codes=(0, 1)).returncode == 1


@pytest.mark.parametrize(
    ("theirs", "conflicts"),
    [
        # Lines 1 and 5 are far apart (git treats adjacent edits as one conflict).
        ("A\nb\nc\nd\ne\n", 0),  # other side edits line 1, ours line 5: clean
        ("a\nb\nc\nd\nE\n", 1),  # both sides edit line 5: one conflict
    ],
)
def test_merge_file_counts_conflicts(tmp_path: Path, theirs: str, conflicts: int) -> None:
    base, ours, other = (tmp_path / n for n in ("base", "ours", "other"))
    base.write_text("a\nb\nc\nd\ne\n")
    ours.write_text("a\nb\nc\nd\ne-ours\n")
    other.write_text(theirs)
    assert git.merge_file(None, ours, base, other) == conflicts
    assert ("<<<<<<< overlay" in ours.read_text()) == bool(conflicts)


def test_worktree_add_detached_and_removed(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    wt = tmp_path / "wt"
    git.worktree_add(repo, wt, "HEAD")
    assert git.out(wt, "rev-parse", "--abbrev-ref", "HEAD") == "HEAD"  # detached
    assert wt in git.list_worktrees(repo)
    git.worktree_remove(repo, wt)
    assert not wt.exists() and git.list_worktrees(repo) == [repo]


def test_no_git_on_path_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without git, every verb says so in one line (no GitPython traceback); reads also take
    no index.lock, so a killed one leaves none behind."""
    monkeypatch.setattr(git.shutil, "which", lambda _name: None)
    with pytest.raises(UserError, match="git is not on PATH") as err:
        git.run(tmp_path, "status")
    assert "\n" not in str(err.value)
    assert git._BASE_ENV["GIT_OPTIONAL_LOCKS"] == "0"


def test_reads_leave_the_index_alone_so_a_kill_leaves_no_lock(tmp_path: Path) -> None:
    """`git status` refreshes a stale index under .git/index.lock, so a kill in that moment
    leaves the lock behind and the user's next commit fails. patchkit's reads take no lock:
    the index is not rewritten. Control: a plain `git status` rewrites it."""
    import os
    import subprocess
    import time

    repo = tmp_path / "r"
    git.init(repo)
    (repo / "a.txt").write_text("a\n")
    git.add(repo, ["a.txt"])
    git.commit(repo, "one\n", date="2026-01-01T00:00:00+00:00")
    index = repo / ".git" / "index"
    later = time.time() + 5
    os.utime(repo / "a.txt", (later, later))  # same content, stat info stale in the index
    before = index.read_bytes()
    git.run(repo, "status")
    assert index.read_bytes() == before
    env = {k: v for k, v in os.environ.items() if k != "GIT_OPTIONAL_LOCKS"}
    subprocess.run(["git", "status"], cwd=repo, env=env, capture_output=True, check=True)
    assert index.read_bytes() != before  # control: git's own status refreshed (and locked) it


def _tree_with_link(tmp: Path, link: str) -> tuple[Path, str]:
    """A repo whose tree has ``d/f`` and ``d/l``, a symlink to ``link``."""
    repo = tmp / "links"
    repo.mkdir(parents=True)
    git.init(repo)
    (repo / "d").mkdir()
    (repo / "d" / "f").write_text("file\n")
    (repo / "d" / "l").symlink_to(link)
    git.add(repo, ["d/f", "d/l"])
    return repo, git.commit(repo, "c", date="2026-08-17T00:00:00+00:00")


@pytest.mark.parametrize("filters", [True, False])  # Python 3.11.4 on, and Debian 12's 3.11.2
def test_export_writes_the_tree_and_refuses_a_link_out_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, filters: bool
) -> None:
    if not filters:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    repo, rev = _tree_with_link(tmp_path, "f")
    git.export(repo, rev, tmp_path / "out", ["d"])
    assert (tmp_path / "out" / "d" / "f").read_text() == "file\n"
    assert (tmp_path / "out" / "d" / "l").readlink() == Path("f")
    # A link that leaves the folder: refused before anything is written.
    outside, rev = _tree_with_link(tmp_path / "o", "../../../escaped")
    with pytest.raises(UserError, match="'d/l' would be written outside"):
        git.export(outside, rev, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
