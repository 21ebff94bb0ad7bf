"""export-pr's promises about what it touches: every argument checked before any work,
no file it did not write deleted or overwritten, no branch moved without --force, and
what a killed run left behind pruned by the next one. Real git repositories in tmp_path.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchkit.carry import export_pr
from patchkit.cli import main
from patchkit.errors import UserError
from patchkit.util import git

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty patchkit cache and a source that was never cloned: any work would show."""
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATCHKIT_MLX_REPO", str(tmp_path / "no-such-mlx"))
    return tmp_path


def _bad(tmp: Path) -> dict[str, list[str]]:
    full = tmp / "full"
    full.mkdir()
    (full / "important.patch").write_text("mine\n")
    plain = tmp / "plain"
    plain.mkdir()
    return {
        "range": ["--branch", "a..b"],
        "empty branch": ["--branch", ""],
        "option-like branch": ["--branch", "-x"],
        "newline title": ["--title", "Fix\n\nSigned-off-by: x"],
        "empty title": ["--title", "  "],
        "author without email": ["--author", "no email"],
        "author without name": ["--author", "<a@b.c>"],
        "push to a non-repo": ["--push", str(plain)],
        "push to a remote name": ["--push", "origin"],
        "non-empty out": ["--out", str(full)],
    }


def test_bad_arguments_fail_in_one_line_before_any_work(isolated: Path) -> None:
    for case, args in _bad(isolated).items():
        argv = ["export-pr", "--root", str(ROOT), "--author", "A <a@b.c>", *args]
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 1, (case, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("patchkit: error:"), (case, lines)
        # Nothing was cloned, fetched or written: the cache does not even exist.
        assert not (isolated / "cache").exists(), case
    assert (isolated / "full" / "important.patch").read_text() == "mine\n"


def test_backend_choice_is_one_of_three_prs_and_the_help_says_metal() -> None:
    result = CliRunner().invoke(main, ["export-pr", "--help"])
    assert "[jit-fix|qmm-sm90|metal|cuda]" in result.output and "[default: metal]" in result.output
    assert export_pr.DEFAULT_BACKEND == "metal"
    assert CliRunner().invoke(main, ["export-pr", "--backend", "cpu"]).exit_code == 2


def test_the_help_names_each_backends_default_branch() -> None:
    """The help lists every backend's default branch, each beside its backend."""
    words = " ".join(CliRunner().invoke(main, ["export-pr", "--help"]).output.split())
    help_text = words.replace("- ", "-")  # click wraps after a hyphen inside a name
    for backend, branch in export_pr.DEFAULT_BRANCHES.items():
        assert f"{backend} {branch}" in help_text, backend


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Ada Lovelace <ada@example.com>", ("Ada Lovelace", "ada@example.com")),
        ("  Ada <ada@x.org>  ", ("Ada", "ada@x.org")),
    ],
)
def test_author_is_name_and_email(text: str, want: tuple[str, str]) -> None:
    assert export_pr.parse_author(text) == want


@pytest.mark.parametrize("text", ["no email", "Ada <>", "Ada <ada>", "<a@b.c>", "A <a@b.c> x"])
def test_author_without_both_is_refused(text: str) -> None:
    with pytest.raises(UserError, match=r"Name <name@example\.com>"):
        export_pr.parse_author(text)


def test_out_is_a_new_or_empty_folder(tmp_path: Path) -> None:
    assert export_pr.check_out_dir(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert export_pr.check_out_dir(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not an empty folder"):
        export_pr.check_out_dir(tmp_path / "file")
    with pytest.raises(UserError, match="parent folder"):
        export_pr.check_out_dir(tmp_path / "absent" / "out")
    # The default folder is fresh: never one that exists.
    (tmp_path / "metal-9a795735").mkdir()
    assert export_pr.fresh_out_dir(tmp_path, "metal-9a795735").name == "metal-9a795735-2"


def test_staging_lands_in_one_rename_and_a_failure_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with export_pr.staging(out) as stage:
        (stage / "0001-x.patch").write_text("patch\n")
    assert sorted(p.name for p in out.iterdir()) == ["0001-x.patch"]
    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError), export_pr.staging(failed) as stage:
        (stage / "0001-x.patch").write_text("patch\n")
        raise RuntimeError("killed")
    assert not failed.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_staging_never_replaces_a_folder_that_filled_up_meanwhile(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(UserError, match="new or empty"), export_pr.staging(out) as stage:
        (stage / "0001-x.patch").write_text("patch\n")
        out.mkdir()
        (out / "important.patch").write_text("mine\n")
    assert [p.name for p in out.iterdir()] == ["important.patch"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _stage(parent: Path, name: str, files: dict[str, str]) -> Path:
    stage = parent / f"{export_pr.STAGE_PREFIX}{name}"
    stage.mkdir()
    for f, text in files.items():
        (stage / f).write_text(text)
    return stage


def test_stale_staging_folders_are_pruned_only_when_wholly_ours(tmp_path: Path) -> None:
    lock = export_pr.LOCK_SUFFIX
    killed = _stage(tmp_path, "killed", {lock: "", "0001-a.patch": "", export_pr.BODY_FILE: ""})
    foreign = _stage(tmp_path, "foreign", {lock: "", "notes.txt": "mine"})
    unlocked = _stage(tmp_path, "creating", {})
    live = _stage(tmp_path, "live", {lock: "", "0001-a.patch": ""})
    with (live / lock).open() as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        assert export_pr.prune_stages(tmp_path) == [killed]
    assert not killed.exists() and foreign.exists() and unlocked.exists() and live.exists()
    assert export_pr.prune_stages(tmp_path) == [live]


def _repo(tmp_path: Path) -> Path:
    """A bare clone with one commit on main, as patchkit's cache holds MLX."""
    work = tmp_path / "work"
    git.init(work)
    (work / "a.txt").write_text("a\n")
    git.add(work, ["a.txt"])
    git.commit(work, "one\n", date="2026-01-01T00:00:00+00:00")
    clone = tmp_path / "clones" / "mlx.git"
    git.clone_bare(str(work), clone)
    return clone


def test_killed_exports_worktrees_are_pruned_and_others_kept(tmp_path: Path) -> None:
    clone = _repo(tmp_path)
    parent = clone.parent / "worktrees"
    parent.mkdir()
    head = git.rev_parse(clone, "HEAD")
    lock = export_pr.LOCK_SUFFIX
    # A killed export: registered, git-locked mid-"add", its lock file left unheld.
    killed = parent / f"{export_pr.WORKTREE_PREFIX}1.dead"
    git.worktree_add(clone, killed, head)
    git.run(clone, "worktree", "lock", "--reason", "initializing", str(killed))
    (parent / f"{killed.name}{lock}").write_text("")
    # A killed export whose folder is gone but whose lock file stayed.
    (parent / f"{export_pr.WORKTREE_PREFIX}2.gone{lock}").write_text("")
    live = parent / f"{export_pr.WORKTREE_PREFIX}3.live"
    git.worktree_add(clone, live, head)
    other = parent / f"{head[:8]}.apply"
    git.worktree_add(clone, other, head)
    with (parent / f"{live.name}{lock}").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        removed = export_pr.prune_worktrees(clone)
    assert [p.name for p in removed] == [killed.name, f"{export_pr.WORKTREE_PREFIX}2.gone"]
    listed = {p.name for p in git.list_worktrees(clone)}
    assert killed.name not in listed and {live.name, other.name} <= listed
    assert not killed.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        [other.name, live.name, f"{live.name}{lock}"]
    )


def test_worktree_is_removed_and_moves_no_ref(tmp_path: Path) -> None:
    clone = _repo(tmp_path)
    refs = git.out(clone, "for-each-ref")
    with export_pr.worktree(clone, "HEAD") as wt:
        assert (wt / "a.txt").is_file()
        assert not export_pr._is_stale(wt.parent / f"{wt.name}{export_pr.LOCK_SUFFIX}")
    assert len(git.list_worktrees(clone)) == 1 and not any((clone.parent / "worktrees").iterdir())
    assert git.out(clone, "for-each-ref") == refs


def _clone_with_two_commits(tmp_path: Path) -> tuple[Path, str, str]:
    """The test clone, its HEAD, and an unreferenced commit on top of it."""
    clone = _repo(tmp_path)
    head = git.rev_parse(clone, "HEAD")
    tree = git.out(clone, "rev-parse", "HEAD^{tree}")
    ident = {"GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@x.org"}
    ident |= {"GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@x.org"}
    return clone, head, git.out(clone, "commit-tree", tree, "-p", head, "-m", "two", env=ident)


def test_existing_branch_moves_only_with_force_and_main_never(tmp_path: Path) -> None:
    clone, head, other = _clone_with_two_commits(tmp_path)
    export_pr.create_branch(clone, "pr", head, force=False)
    with pytest.raises(UserError, match=r"already exists.*--force"):
        export_pr.create_branch(clone, "pr", other, force=False)
    assert git.rev_parse(clone, "pr") == head
    export_pr.create_branch(clone, "pr", other, force=True)
    assert git.rev_parse(clone, "pr") == other
    with pytest.raises(UserError, match="default branch"):
        export_pr.create_branch(clone, "main", other, force=True)
    assert git.rev_parse(clone, "main") == head


def test_main_master_and_apply_branches_never_move_when_head_names_another(
    tmp_path: Path,
) -> None:
    """The clone's HEAD switched to a PR branch: main, master and apply's patchkit/<pin>
    still never move, --force or not (the default branch is no longer what HEAD names)."""
    clone, head, other = _clone_with_two_commits(tmp_path)
    for name in ("master", "patchkit/9a795735", "pr"):
        git.run(clone, "update-ref", f"refs/heads/{name}", head)
    git.run(clone, "symbolic-ref", "HEAD", "refs/heads/pr")
    for name in ("main", "master", "patchkit/9a795735", "pr"):
        with pytest.raises(UserError, match="default branch or one patchkit keeps"):
            export_pr.create_branch(clone, name, other, force=True)
        assert git.rev_parse(clone, name) == head
    # control: any other existing branch moves with --force
    git.run(clone, "update-ref", "refs/heads/topic", head)
    export_pr.create_branch(clone, "topic", other, force=True)
    assert git.rev_parse(clone, "topic") == other


def test_default_base_is_the_clones_default_branch(tmp_path: Path) -> None:
    clone = _repo(tmp_path)
    work = tmp_path / "work"
    (work / "b.txt").write_text("b\n")
    git.add(work, ["b.txt"])
    newest = git.commit(work, "two\n", date="2026-01-02T00:00:00+00:00")
    # MLX's main moved upstream: the default base is the newest, fetched.
    assert export_pr.default_base(clone) == newest


def test_push_failure_is_one_line(tmp_path: Path) -> None:
    clone = _repo(tmp_path)
    target = tmp_path / "fork.git"
    git.init(target, bare=True)
    head = git.rev_parse(clone, "HEAD")
    assert export_pr.push_branch(clone, str(target), "pr", head) == str(target)
    assert git.rev_parse(target, "pr") == head
    with pytest.raises(UserError, match=r"push of pr to .* failed \(") as err:
        export_pr.push_branch(clone, str(tmp_path / "absent.git"), "pr", head)
    assert "\n" not in str(err.value)
