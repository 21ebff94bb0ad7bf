"""A kill at any filesystem step of a write leaves the old outputs or the new ones.

A rebase writes three things: the new ``patches/<new>/``, the removal of
``patches/<old>/`` and a new ``pin.toml``. The test counts every rename and
deletion a clean rebase makes, then, for each of them, kills a fresh copy of the
project exactly there (an exception no cleanup handler sees, as with SIGKILL),
runs the recovery the next command would run, and requires the tree to be
byte-identical to the state before or after, never a mix. The next rebase then
proceeds normally.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from patchkit.carry import apply, pin, rebase, transaction
from patchkit.util import git, staging

pytest_plugins = ("support_git",)
DATE = "2026-08-20T00:00:00+00:00"


class Killed(BaseException):
    """Stands for SIGKILL: nothing after the injection point runs."""


class Ok:
    def __call__(self, *headers: str) -> rebase.Parity:
        return rebase.Parity(True, "stub", ())


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _untouched_commit(e: dict) -> str:
    repo = e["path"]
    git.run(repo, "checkout", "--quiet", "-B", "later", e["old"])
    (repo / "NOTES.md").write_text("unrelated\n")
    git.add(repo, ["NOTES.md"])
    return git.commit(repo, "upstream: later", date=DATE, author=("MLX", "mlx@example.com"))


def _rebase(e: dict, root: Path, rev: str) -> None:
    rebase.rebase(rev, root=root, templates_dir=e["templates"], parity_check=Ok())


class Faults:
    """Counts (or fails at the n-th of) the filesystem steps a transaction takes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None):
        self.calls, self.fail_at = 0, fail_at
        real_replace, real_rmtree, real_unlink = os.replace, shutil.rmtree, Path.unlink

        def step(real):
            def wrapped(*args, **kwargs):
                self.calls += 1
                if self.calls == self.fail_at:
                    raise Killed
                return real(*args, **kwargs)

            return wrapped

        monkeypatch.setattr(staging.os, "replace", step(real_replace))
        monkeypatch.setattr(staging.shutil, "rmtree", step(real_rmtree))
        monkeypatch.setattr(staging.Path, "unlink", step(real_unlink))
        # A killed process runs no cleanup: abort is what SIGKILL skips.
        monkeypatch.setattr(staging.Transaction, "abort", lambda self: None)


def test_kill_at_every_write_step_leaves_old_or_new(
    env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One date for every run below: a run after midnight UTC writes another pin history.
    monkeypatch.setattr(pin, "today", lambda: "2026-01-01")
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"], release="0.32.1")
    new = _untouched_commit(env)
    pristine = tmp_path / "pristine"
    shutil.copytree(env["root"], pristine)
    old_state = snapshot(pristine)

    clean = tmp_path / "clean"
    shutil.copytree(pristine, clean)
    with monkeypatch.context() as m:
        counter = Faults(m, None)
        _rebase(env, clean, new)
    new_state = snapshot(clean)
    assert new_state != old_state and counter.calls >= 5

    seen = {"old": 0, "new": 0}
    for k in range(1, counter.calls + 1):
        root = tmp_path / f"kill-{k}"
        shutil.copytree(pristine, root)
        with monkeypatch.context() as m:
            Faults(m, k)
            with pytest.raises(Killed):
                _rebase(env, root, new)
        transaction.recover_outputs(root)  # what the next apply or rebase runs first
        state = snapshot(root)
        assert state in (old_state, new_state), f"kill at step {k} left a mix"
        seen["old" if state == old_state else "new"] += 1
        if state == old_state:  # the next run proceeds and completes the move
            _rebase(env, root, new)
            assert snapshot(root) == new_state
        assert pin.load(root / "pin.toml").release == "0.32.1"
    assert seen["old"] and seen["new"], seen  # kills landed on both sides of the commit point


def test_leftover_uncommitted_transaction_does_not_block_apply(env: dict) -> None:
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    before = snapshot(env["root"])
    junk = env["root"] / "patches" / transaction.TXN_DIR / "stage" / "half"
    junk.mkdir(parents=True)
    (junk / "file.patch").write_text("half written")
    r = apply.apply(None, root=env["root"], templates_dir=env["templates"])
    assert not r.patches_changed and snapshot(env["root"]) == before
