"""The README's path for a newcomer, end to end on a real MLX clone, through the CLI.

apply without repeating the pin -> status -> vendor the series into one checkout of their own
and the overlay into another -> export-pr. Skips with a reason without a clone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from support_git import PIN_SHA, mlx_clone

from patchkit.cli import main
from patchkit.util import git

ROOT = Path(__file__).resolve().parents[1]
SPEC = mlx_clone()
pytestmark = [
    pytest.mark.clone,
    pytest.mark.skipif(
        SPEC is None,
        reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
    ),
]


def _cli(*args: str) -> dict:
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_newcomer_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "patchkit"
    for name in ("templates", "patches"):
        shutil.copytree(ROOT / name, project / name)
    for name in ("pin.toml", "pyproject.toml"):
        shutil.copy(ROOT / name, project / name)
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATCHKIT_MLX_REPO", SPEC)
    # A newcomer's own cache: nothing (branches, worktrees) from earlier runs.
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))

    applied = _cli("apply")  # what pin.toml pins; the README never repeats the sha
    assert applied["upstream_commit"] == PIN_SHA and not applied["patches_changed"]
    status = _cli("status")
    assert status["patches_current"] and status["clone"] == applied["clone"]

    mine = {}
    for flavour in ("series", "overlay"):
        user = tmp_path / f"my-mlx-{flavour}"
        git.run(None, "clone", "--quiet", "--no-checkout", SPEC, str(user))
        git.run(user, "checkout", "--quiet", "--detach", PIN_SHA)
        assert _cli("vendor", str(user), "--flavour", flavour, "--dry-run")["head"] == PIN_SHA
        mine[flavour] = _cli("vendor", str(user), "--flavour", flavour)
    series, overlay = mine["series"], mine["overlay"]
    assert series["head"] != PIN_SHA and overlay["head"] == PIN_SHA
    # The same one-body kernels either way; the overlay adds its downstream switches.
    header = "mlx/backend/metal/kernels/quantized.h"
    for text in (
        git.show_file(Path(series["checkout"]), series["head"], header),
        (Path(overlay["checkout"]) / header).read_text(),
    ):
        assert "int vecs_per_tg = 1>" in text
    host = "mlx/backend/metal/quantized.cpp"
    assert "MLX_QMV_STREAMED" not in git.show_file(Path(series["checkout"]), series["head"], host)
    assert "MLX_QMV_STREAMED" in (Path(overlay["checkout"]) / host).read_text()

    out = tmp_path / "pr"
    pr = CliRunner().invoke(main, ["export-pr", "--out", str(out), "--json"])
    if pr.exit_code != 0 and "formatters" in pr.output:
        pytest.skip("export-pr needs MLX's pinned formatters: --install-formatters")
    assert pr.exit_code == 0, pr.output
    assert (out / "PR_BODY.draft.md").is_file()
