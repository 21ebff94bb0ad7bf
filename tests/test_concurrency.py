"""Nothing torn, nothing left behind: the checkout lock, the kill-at-every-rename transaction,
re-runs before a commit, and what killed runs leave (worktrees, scratch folders, ref locks).

Every writer here is a real ``patchkit`` process on the small header fixture of
``support_git`` (the real 0.32.1 ``quantized.h`` and a one-edit template), in a
checkout that is a git repository, as a user's is.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support_git import COPY_J2, QH

from patchkit.carry import check, pin, source, transaction
from patchkit.util import git, staging

pytest_plugins = ("support_git",)
DATE = "2026-08-20T00:00:00+00:00"
CLI = [sys.executable, "-c", "from patchkit.cli import main; main()"]


def snapshot(root: Path) -> dict[str, bytes]:
    """pin.toml and patches/ as bytes (the outputs a transaction writes)."""
    files = {p for p in (root / "patches").rglob("*") if p.is_file()}
    files |= {root / "pin.toml"} if (root / "pin.toml").is_file() else set()
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files}


def patchkit(
    root: Path, *args: str, env: dict | None = None, check_rc: bool = True
) -> subprocess.CompletedProcess:
    cmd = [*CLI, *args, "--root", str(root), "--templates", str(root / "templates")]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if check_rc:
        assert proc.returncode == 0, proc.stderr
    return proc


def edit_template(root: Path, text: str) -> None:
    snippet = root / "templates" / QH / "copy.j2"
    snippet.write_text(COPY_J2.replace("patchkit test payload", text))


@pytest.fixture
def checkout(env: dict) -> dict:
    """A git checkout holding the templates, applied and committed at the old pin."""
    root = env["root"]
    shutil.copytree(env["templates"], root / "templates")
    (root / "pyproject.toml").write_text("[project]\nname = 'fixture'\n")
    git.init(root)
    patchkit(root, "apply", "--pin", env["old"], "--release", "0.32.1")
    git.run(root, "add", "--all")
    git.commit(root, "outputs at the pin", date=DATE)
    return env


def commit_all(root: Path, message: str) -> None:
    git.run(root, "add", "--all")
    git.commit(root, message, date=DATE)


def test_concurrent_applies_never_tear_patches(checkout: dict) -> None:
    """The issue's probe: 3 applies at once after a committed template change, 4 rounds."""
    root = checkout["root"]
    for rnd in range(4):
        edit_template(root, f"round {rnd} payload")
        commit_all(root, f"template change {rnd}")
        procs = [
            subprocess.Popen(
                [*CLI, "apply", "--root", str(root), "--templates", str(root / "templates")],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        outs = [(p.wait(), *p.communicate()) for p in procs]
        assert [rc for rc, _, _ in outs] == [0, 0, 0], outs
        # One run updated the outputs; the others found them current (a no-op).
        said = [out.splitlines()[-1] for _, out, _ in outs]
        assert sum(s.endswith(" updated") for s in said) == 1, said
        assert sum(s.endswith("unchanged (no-op)") for s in said) == 2, said
        short = checkout["old"][:8]
        names = (root / "patches" / short / "series").read_text().split()
        assert names and all((root / "patches" / short / n).is_file() for n in names)
        overlay = (root / "patches" / short / "overlay" / QH).read_text()
        assert f"round {rnd} payload" in overlay
        assert not (root / "patches" / transaction.TXN_DIR).exists()
        assert patchkit(root, "check").returncode == 0
        commit_all(root, f"outputs {rnd}")


def test_second_writer_waits_or_refuses_in_one_line(checkout: dict) -> None:
    root = checkout["root"]
    with staging.exclusive(transaction.lock_path(root)):
        proc = patchkit(root, "apply", "--no-wait", check_rc=False)
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "another patchkit run is writing" in lines[0], lines
        assert str(root) in lines[0]
        waiting = subprocess.Popen(
            [*CLI, "apply", "--root", str(root), "--templates", str(root / "templates")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=3)  # blocked on the lock, not failing
    _, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0 and "waiting for another patchkit run" in err


def test_rerun_before_commit_is_a_no_op_and_hand_edits_still_refuse(checkout: dict) -> None:
    root = checkout["root"]
    edit_template(root, "uncommitted payload")
    first = patchkit(root, "apply", "--json")
    assert '"patches_changed": true' in first.stdout
    again = patchkit(root, "apply", "--json")  # outputs not committed yet
    assert '"patches_changed": false' in again.stdout and '"pin_changed": false' in again.stdout
    edit_template(root, "second uncommitted payload")  # a second change, still uncommitted
    assert '"patches_changed": true' in patchkit(root, "apply", "--json").stdout
    series = next((root / "patches").glob("*/series"))
    series.write_text("edited by hand\n")
    proc = patchkit(root, "apply", check_rc=False)
    assert proc.returncode == 1 and "patchkit did not write" in proc.stderr
    assert series.read_text() == "edited by hand\n"  # control: a hand edit is never overwritten


def test_kill_at_every_rename_leaves_old_or_new_and_the_next_run_recovers(
    checkout: dict, tmp_path: Path
) -> None:
    """SIGKILL before the N-th rename of a real apply, for every N; status names the state."""
    pristine = checkout["root"]
    edit_template(pristine, "killed payload")
    commit_all(pristine, "template change")
    old_state = snapshot(pristine)
    done = tmp_path / "done"
    shutil.copytree(pristine, done)
    patchkit(done, "apply", "--release", "0.32.2")
    new_state = snapshot(done)
    assert new_state != old_state and pin.load(done / "pin.toml").release == "0.32.2"

    seen: dict[str, int] = {"old": 0, "new": 0}
    n = 0
    while True:
        n += 1
        root = tmp_path / f"kill-{n}"
        shutil.copytree(pristine, root)
        killed = patchkit(
            root, "apply", "--release", "0.32.2", env={staging.KILL_AT_RENAME: str(n)},
            check_rc=False,
        )  # fmt: skip
        if killed.returncode == 0:
            assert snapshot(root) == new_state
            break
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        # Read only, before any recovery: status says which state stands.
        s = check.status(root=root, templates_dir=root / "templates")
        state = s["interrupted"] or ("new" if check.load_pin(root).release == "0.32.2" else "old")
        assert state in ("old", "new"), s
        assert (check.load_pin(root).release == "0.32.2") == (state == "new"), (n, s)
        seen[state] += 1
        if s["interrupted"]:
            assert any("killed apply or rebase" in p for p in s["problems"]), s
        rerun = patchkit(root, "apply", "--release", "0.32.2", "--json")
        assert snapshot(root) == new_state, f"kill before rename {n} was not recovered"
        assert not (root / "patches" / transaction.TXN_DIR).exists()
        assert '"ok": false' not in rerun.stdout
        assert '"patches_changed": false' in patchkit(root, "apply", "--json").stdout
    assert n > 5 and seen["old"] and seen["new"], (n, seen)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_left_behind_state_is_pruned_by_the_next_run(checkout: dict) -> None:
    root = checkout["root"]
    clone = source.clone_dir(str(checkout["path"]))
    dead = _dead_pid()
    # A worktree a killed run left: registered, locked the way `worktree add` locks it.
    parent = source.worktrees_dir(clone)
    stale_wt = parent / f"{checkout['old'][:8]}.{dead}.abc123"
    git.worktree_add(clone, stale_wt, checkout["old"])
    git.run(clone, "worktree", "lock", "--reason", "initializing", str(stale_wt))
    gone_wt = parent / f"{checkout['old'][:8]}.{dead}.def456"  # its folder deleted too
    git.worktree_add(clone, gone_wt, checkout["old"])
    git.run(clone, "worktree", "lock", str(gone_wt))
    shutil.rmtree(gone_wt)
    live_wt = parent / f"{checkout['old'][:8]}.{os.getpid()}.live00"  # a live run's: kept
    git.worktree_add(clone, live_wt, checkout["old"])
    # A temp folder of this test's own: a patchkit run elsewhere on the machine prunes dead
    # owners' scratch in the shared one, and would take this test's planted folder first.
    private_tmp = root.parent / "tmp"
    private_tmp.mkdir(exist_ok=True)
    scratch = private_tmp / f"patchkit-check.{dead}.xyz"
    scratch.mkdir()
    (scratch / "half").write_text("x")
    ref_lock = clone / "refs" / "heads" / "patchkit" / f"{checkout['old'][:8]}.lock"
    ref_lock.parent.mkdir(parents=True, exist_ok=True)
    ref_lock.write_text("")
    assert len(git.worktrees(clone)) == 4

    edit_template(root, "after the kill payload")  # so apply moves the branch (the ref lock)
    proc = patchkit(root, "apply", env={"TMPDIR": str(private_tmp)})
    paths = {wt.path for wt in git.worktrees(clone)}
    assert paths == {clone, live_wt}
    assert not stale_wt.exists() and not scratch.exists() and not ref_lock.exists()
    assert f"removed {ref_lock}" in proc.stderr and f"removed {scratch}" in proc.stderr
    git.worktree_remove(clone, live_wt)


def test_a_git_lock_outside_the_cache_is_one_line(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    git.init(repo)
    (repo / "f").write_text("x\n")
    git.add(repo, ["f"])
    head = git.commit(repo, "one", date=DATE)
    (repo / ".git" / "refs" / "heads" / "side.lock").write_text("")
    from patchkit.errors import GitLockError

    with pytest.raises(GitLockError) as caught:
        git.branch_force(repo, "side", head)
    message = str(caught.value)
    assert "\n" not in message and "side.lock exists" in message and "delete it" in message


def _writer(root: str, ready: object, hold_s: float) -> None:
    """A live apply, as a reader sees it: the checkout's lock held and patches/.txn/ staged
    (uncommitted), both gone when it ends."""
    import time

    txn = Path(root) / "patches" / transaction.TXN_DIR
    with staging.exclusive(transaction.lock_path(Path(root))):
        (txn / "stage").mkdir(parents=True)
        ready.set()  # type: ignore[attr-defined]
        time.sleep(hold_s)
        shutil.rmtree(txn)


def test_check_during_a_live_apply_waits_for_it(checkout: dict) -> None:
    """check run while an apply writes waits for the writer instead of reporting its
    in-flight .txn/ as a killed write; control: the same .txn/ with no live writer is
    reported as pending (exit 4), not as staleness (exit 1)."""
    import multiprocessing

    root = checkout["root"]
    patchkit(root, "apply")  # the lock file exists, as after any apply
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    live = ctx.Process(target=_writer, args=(str(root), ready, 2.0))
    live.start()
    try:
        assert ready.wait(60)
        during = patchkit(root, "check", "--json", check_rc=False)
    finally:
        live.join(60)
    assert during.returncode == 0, during.stdout + during.stderr
    assert "waiting for the patchkit run writing" in during.stderr
    (root / "patches" / transaction.TXN_DIR / "stage").mkdir(parents=True)  # its owner is dead
    dead = patchkit(root, "check", check_rc=False)
    assert dead.returncode == 4 and "killed apply or rebase" in dead.stdout, dead.stdout
    assert "PENDING: " in patchkit(root, "status").stdout
