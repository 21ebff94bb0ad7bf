"""export-pr onto MLX's main, per backend, on a real clone: the metal commit applies with
``git am`` on the pin and on main, each backend's commit stays inside its backend.

Needs a full MLX clone holding the pin 9a795735 and main 846d17622 (set
PATCHKIT_MLX_REPO=/path/to/mlx) and upstream's formatter pins; skips saying which is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support_git import PIN_SHA, mlx_clone
from test_export_pr import PINNED_FORMATTERS

from patchkit.carry import export_pr
from patchkit.util import git

ROOT = Path(__file__).resolve().parent.parent
MAIN_SHA = "846d176227a0ac13d2667e58d2bb68b322109ab0"
SPEC = mlx_clone()


def _missing() -> str | None:
    if SPEC is None:
        return "needs a full MLX clone with 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx"
    if git.try_rev_parse(Path(SPEC), MAIN_SHA) is None:
        return f"needs MLX main {MAIN_SHA[:9]} in the clone at {SPEC}"
    bad = [t for t, v in PINNED_FORMATTERS.items() if export_pr.installed_version(t) != v]
    if bad:
        return f"needs upstream's formatter pins ({bad}): pip install clang-format==21.1.8 ..."
    return None


pytestmark = [pytest.mark.clone, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, export_pr.PrResult]:
    out = tmp_path_factory.mktemp("prs")
    return {
        backend: export_pr.export_pr(
            root=ROOT,
            backend=backend,
            onto=MAIN_SHA,
            branch=f"patchkit-test/{backend}",
            force=True,
            out_dir=out / backend,
            mlx_repo=SPEC,
            author=f"Test Author <{backend}@example.com>",
        )
        for backend in export_pr.BACKENDS
    }


@pytest.mark.parametrize("onto", [PIN_SHA, MAIN_SHA], ids=["pin", "main"])
def test_metal_export_applies_with_git_am_on_the_pin_and_on_main(
    exports: dict[str, export_pr.PrResult], onto: str, tmp_path: Path
) -> None:
    pr = exports["metal"]
    work = tmp_path / "mlx"
    git.run(None, "clone", "--quiet", "--no-checkout", str(pr.repository), str(work))
    git.run(work, "checkout", "--quiet", "--detach", onto)
    head = git.am(work, [pr.patch], committer=("t", "t@example.com"))
    assert git.out(work, "diff", "--name-only", onto, head).splitlines() == pr.files


def test_each_backend_is_one_commit_inside_its_backend(
    exports: dict[str, export_pr.PrResult],
) -> None:
    for backend, pr in exports.items():
        clone = pr.repository
        assert pr.base == MAIN_SHA and git.out(clone, "rev-parse", f"{pr.commit}^") == MAIN_SHA
        foreign = "mlx/backend/cuda/" if backend == "metal" else "mlx/backend/metal/"
        assert not [f for f in pr.files if f.startswith(foreign)], backend
        assert any(f.startswith(f"mlx/backend/{backend}/") for f in pr.files), backend
        author = git.out(clone, "log", "-1", "--format=%an <%ae>|%cn <%ce>", pr.commit)
        # Author and committer are the submitter, dated now (not upstream's date).
        assert author == f"Test Author <{backend}@example.com>|Test Author <{backend}@example.com>"
        assert git.out(clone, "log", "-1", "--format=%cI", pr.commit) != git.commit_date(
            clone, MAIN_SHA
        )
        message = git.out(clone, "log", "-1", "--format=%B", pr.commit)
        assert message.count("\n\n") >= 1 and len(message.splitlines()[0]) <= 72


def test_body_follows_mains_template(exports: dict[str, export_pr.PrResult]) -> None:
    template = git.show_file(exports["metal"].repository, MAIN_SHA, export_pr.PR_TEMPLATE)
    assert "AI usage disclosure:" in template
    for pr in exports.values():
        body = pr.body.read_text()
        assert template in body
        assert "generation 15 or later" in body
        assert sorted(p.name for p in pr.patch.parent.iterdir()) == sorted(
            [pr.patch.name, export_pr.BODY_FILE]
        )


def test_a_second_export_refuses_to_move_the_branch(
    exports: dict[str, export_pr.PrResult], tmp_path: Path
) -> None:
    pr = exports["metal"]
    with pytest.raises(export_pr.UserError, match="already exists"):
        export_pr.export_pr(
            root=ROOT,
            onto=MAIN_SHA,
            branch=pr.branch,
            out_dir=tmp_path / "again",
            mlx_repo=SPEC,
            author="A <a@example.com>",
        )
    assert (
        git.rev_parse(pr.repository, pr.branch) == pr.commit and not (tmp_path / "again").exists()
    )
