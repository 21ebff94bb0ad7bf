"""`patchkit build --dry-run`: the exact commands MLX's documented build needs, and nothing run."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchkit.carry import mlx_build as build
from patchkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("system", "nvcc", "backend"),
    [("Darwin", False, "metal"), ("Darwin", True, "metal"), ("Linux", True, "cuda"),
     ("Linux", False, "cpu")],
)  # fmt: skip
def test_backend_detection(system: str, nvcc: bool, backend: str) -> None:
    assert build.detect_backend(system, nvcc) == backend


@pytest.mark.parametrize(
    ("backend", "flag"),
    [("metal", "-DMLX_BUILD_METAL=ON"), ("cuda", "-DMLX_BUILD_CUDA=ON"),
     ("cpu", "-DMLX_BUILD_METAL=OFF")],
)  # fmt: skip
def test_dry_run_prints_pip_install_with_cmake_args(
    tmp_path: Path, backend: str, flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "mlx"
    monkeypatch.chdir(ROOT)
    args = ["build", "--dry-run", "--worktree", str(tree), "--backend", backend]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and plan["backend"] == backend
    install = next(s for s in plan["steps"] if s["argv"][1:4] == ["-m", "pip", "install"])
    assert install["argv"] == [sys.executable, "-m", "pip", "install", "-v", "."]
    assert install["cwd"] == str(tree) and install["env"]["CMAKE_ARGS"] == flag
    assert plan["log"] == str(tree / ".patchkit-build" / "build.log")
    parity = plan["steps"][-1]
    assert parity["argv"][-4:] == [
        "parity",
        "--quick",
        "--out",
        str(tree / ".patchkit-build" / "parity.json"),
    ]
    assert not tree.exists(), "a dry run must not create anything"
    human = CliRunner().invoke(main, args)
    # the printed lines are the same commands, copy-pasteable
    assert f"CMAKE_ARGS={flag}" in human.stdout
    assert shlex.join(install["argv"]) in human.stdout


def test_dry_run_without_worktree_checks_out_the_applied_branch(tmp_path: Path) -> None:
    (tmp_path / "clone").mkdir()  # a local source path; only its cache location is computed
    plan = build.plan(ROOT, backend="cpu", mlx_repo=str(tmp_path / "clone"))
    git = plan.steps[0]
    assert git.argv[:2] == ["git", "-C"] and git.argv[3:6] == ["worktree", "add", "--detach"]
    assert git.argv[-1].startswith("patchkit/") and Path(git.argv[-2]) == plan.worktree
    assert plan.worktree.parent == ROOT / "build"  # git-ignored in this repo
    assert not plan.worktree.exists()


def test_unknown_backend_is_a_user_error() -> None:
    with pytest.raises(build.UserError):
        build.plan(ROOT, worktree=Path("/nonexistent"), backend="rocm")
