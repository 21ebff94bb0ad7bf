"""`patchkit vendor`: the exported patch into a user's own checkout, either flavour, refusing
a checkout that is not at the pin or not clean, and touching nothing on a dry run."""

from __future__ import annotations

from pathlib import Path

import pytest
from support_git import QH

from patchkit.carry import apply, vendor
from patchkit.errors import UserError
from patchkit.util import git

pytest_plugins = ("support_git",)


@pytest.fixture
def checkout(env: dict, tmp_path: Path) -> Path:
    """The pin applied in the project, and a user's clone of upstream at the pin."""
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    user = tmp_path / "user-mlx"
    git.run(None, "clone", "--quiet", str(env["path"]), str(user))
    git.run(user, "checkout", "--quiet", "--detach", env["old"])
    return user


def test_series_adds_the_commits(env: dict, checkout: Path) -> None:
    dry = vendor.vendor(env["root"], checkout, "series", dry_run=True)
    assert dry.head == env["old"] and dry.files and git.rev_parse(checkout, "HEAD") == env["old"]
    r = vendor.vendor(env["root"], checkout, "series")
    assert r.head != env["old"] and git.status_porcelain(checkout) == ""
    assert "// patchkit test payload (upstream)" in (checkout / QH).read_text()
    with pytest.raises(UserError, match="the patch is for"):  # no longer at the pin
        vendor.vendor(env["root"], checkout, "series")


def test_overlay_copies_whole_files_uncommitted(env: dict, checkout: Path) -> None:
    overlay = env["root"] / "patches" / env["old"][:8] / "overlay" / QH
    r = vendor.vendor(env["root"], checkout, "overlay")
    assert r.files == [QH] and r.head == env["old"]
    assert (checkout / QH).read_bytes() == overlay.read_bytes()
    assert git.status_porcelain(checkout).strip() == f"M {QH}"


def test_dirty_checkout_is_refused_untouched(env: dict, checkout: Path) -> None:
    (checkout / "scratch.txt").write_text("mine\n")
    before = (checkout / QH).read_bytes()
    with pytest.raises(UserError, match="uncommitted changes"):
        vendor.vendor(env["root"], checkout, "overlay")
    assert (checkout / QH).read_bytes() == before
