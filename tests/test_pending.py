"""Changes waiting in ``ci/pending`` for their GPU records still apply to this checkout.

Each mailbox is applied with ``git am`` to a clone of the committed tree, so a change on
main that conflicts with a waiting one fails here, not on the GPU host. Control: a
mailbox with one context line changed does not apply.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

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
