"""Changes waiting in ``ci/pending`` for their GPU records still apply to this checkout.

Each mailbox is applied with ``git am`` to a clone of the committed tree, so a change on
main that conflicts with a waiting one fails here, not on the GPU host. Control: a
mailbox with one context line changed does not apply. With an MLX clone, the applied
mailbox's ``patches/`` must also be what its own code renders from its templates
(``patchkit check`` run from that clone), so that a change on main to the renderer does
not leave a waiting one stale.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support_git import mlx_clone

ROOT = Path(__file__).resolve().parent.parent
PENDING = sorted((ROOT / "ci" / "pending").glob("*.mbox"))
IDENTITY = ["-c", "user.name=patchkit tests", "-c", "user.email=tests@patchkit.invalid"]


def git_am(repo: Path, mbox: Path) -> subprocess.CompletedProcess[str]:
    """``git am`` of ``mbox`` in ``repo``, with an identity of its own (CI has none)."""
    return subprocess.run(
        ["git", *IDENTITY, "-C", str(repo), "am", "--quiet", str(mbox)],
        capture_output=True,
        text=True,
    )


@pytest.fixture()
def clone(tmp_path: Path) -> Path:
    """A clone of this checkout's committed HEAD."""
    dest = tmp_path / "repo"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True)
    return dest


@pytest.mark.parametrize("mbox", PENDING, ids=[m.stem for m in PENDING])
def test_pending_change_applies(clone: Path, mbox: Path) -> None:
    """Each mailbox applies to main on its own (they do not stack)."""
    result = git_am(clone, mbox)
    assert result.returncode == 0, f"{mbox.name} no longer applies:\n{result.stdout}{result.stderr}"


@pytest.mark.skipif(not PENDING, reason="no change waits in ci/pending")
def test_control_a_changed_context_line_does_not_apply(clone: Path, tmp_path: Path) -> None:
    """The check can fail: a context line of the first hunk changed, git am refuses."""
    text = PENDING[0].read_text()
    lines = text.splitlines(keepends=True)
    hunk = next(i for i, ln in enumerate(lines) if ln.startswith("@@ "))
    i = next(i for i in range(hunk + 1, len(lines)) if lines[i].startswith(" "))
    lines[i] = " " + "changed: " + lines[i][1:]
    broken = tmp_path / "broken.mbox"
    broken.write_text("".join(lines))
    assert git_am(clone, broken).returncode != 0


def patchkit_check(repo: Path) -> subprocess.CompletedProcess[str]:
    """``patchkit check`` of ``repo`` with ``repo``'s own code (not this checkout's)."""
    code = "from patchkit.cli import main; main()"
    argv = [sys.executable, "-c", code, "check", "--root", str(repo),
            "--templates", str(repo / "templates")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo), "PATCHKIT_MLX_REPO": str(mlx_clone())}
    return subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True)


@pytest.mark.skipif(
    mlx_clone() is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)
@pytest.mark.clone
@pytest.mark.parametrize("mbox", PENDING, ids=[m.stem for m in PENDING])
def test_pending_change_holds_the_patches_its_templates_render(clone: Path, mbox: Path) -> None:
    assert git_am(clone, mbox).returncode == 0
    checked = patchkit_check(clone)
    assert checked.returncode == 0, f"{mbox.name}: {checked.stdout}{checked.stderr}"
    # control: its series edited, the same check fails
    series = next((clone / "patches").glob("*/series"))
    series.write_text(series.read_text() + "edited\n")
    assert patchkit_check(clone).returncode == 1
