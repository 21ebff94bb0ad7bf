"""export-pr onto MLX's main and as a stack, on a real clone: every PR applies with
``git am`` alone on the pin and on main, the stack (JIT fix, qmm_sm90 fix, Metal, CUDA) in
order, Metal and CUDA in either order; no file or test twice; each PR inside its backend.

Needs a full MLX clone holding the pin 9a795735 and main 846d17622 (set
PATCHKIT_MLX_REPO=/path/to/mlx) and upstream's formatter pins; skips saying which is missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support_git import PIN_SHA, mlx_clone
from test_export_pr import PINNED_FORMATTERS

from patchkit.carry import export_pr
from patchkit.util import git

ROOT = Path(__file__).resolve().parent.parent
MAIN_SHA = "846d176227a0ac13d2667e58d2bb68b322109ab0"
TEST_FILE = "python/tests/test_quantized.py"
BENCH_FILE = "benchmarks/python/qmv_small_batch_bench.py"
SPEC = mlx_clone()
# The documented order of the stack: each PR exported --stacked onto the one before it.
STACK = ("jit-fix", "qmm-sm90-stacked", "metal-stacked", "cuda-stacked")


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
    """Each PR alone on main, then the stack: the JIT fix, the qmm_sm90 fix on it, Metal on
    both, CUDA on Metal."""
    out = tmp_path_factory.mktemp("prs")

    def export(backend: str, name: str, onto: str, stacked: bool) -> export_pr.PrResult:
        return export_pr.export_pr(
            root=ROOT, backend=backend, onto=onto, stacked=stacked,
            branch=f"patchkit-test/{name}", force=True, out_dir=out / name, mlx_repo=SPEC,
            author=f"Test Author <{backend}@example.com>",
        )  # fmt: skip

    prs = {b: export(b, b, MAIN_SHA, False) for b in export_pr.BACKENDS}
    prs["qmm-sm90-stacked"] = export("qmm-sm90", "qmm-sm90-stacked", prs["jit-fix"].branch, True)
    prs["metal-stacked"] = export("metal", "metal-stacked", prs["qmm-sm90-stacked"].branch, True)
    prs["cuda-stacked"] = export("cuda", "cuda-stacked", prs["metal-stacked"].branch, True)
    return prs


def _am(pr: export_pr.PrResult, work: Path) -> str:
    return git.am(work, list(pr.patches), committer=("t", "t@example.com"))


def _checkout(pr: export_pr.PrResult, onto: str, tmp_path: Path) -> Path:
    work = tmp_path / "mlx"
    git.run(None, "clone", "--quiet", "--no-checkout", str(pr.repository), str(work))
    git.run(work, "checkout", "--quiet", "--detach", onto)
    return work


@pytest.mark.parametrize("onto", [PIN_SHA, MAIN_SHA], ids=["pin", "main"])
@pytest.mark.parametrize("backend", export_pr.BACKENDS)
def test_each_pr_applies_with_git_am_on_the_pin_and_on_main(
    exports: dict[str, export_pr.PrResult], backend: str, onto: str, tmp_path: Path
) -> None:
    pr = exports[backend]
    work = _checkout(pr, onto, tmp_path)
    head = _am(pr, work)
    assert git.tree_id(work, head) == git.tree_id(pr.repository, pr.commit) or onto != MAIN_SHA
    own = git.out(work, "diff", "--name-only", f"{head}^", head).splitlines()
    assert own == pr.files


def test_the_stack_applies_in_order_and_metal_and_cuda_in_either(
    exports: dict[str, export_pr.PrResult], tmp_path: Path
) -> None:
    """The documented order (the two fixes, Metal, CUDA) with git am; and the standalone
    Metal and CUDA PRs in both orders: their tests sit at their own anchors and do not
    collide."""
    stack = [exports[n] for n in STACK]
    work = _checkout(stack[0], MAIN_SHA, tmp_path / "stack")
    for pr in stack:
        head = _am(pr, work)
    assert git.tree_id(work, head) == git.tree_id(stack[-1].repository, stack[-1].commit)
    for first, second in (("metal", "cuda"), ("cuda", "metal")):
        work = _checkout(exports[first], MAIN_SHA, tmp_path / first)
        _am(exports[first], work)
        head = _am(exports[second], work)
        methods = re.findall(r"^    def (test_\w+)\(", git.show_file(work, head, TEST_FILE), re.M)
        assert len(methods) == len(set(methods)), (first, second)


def test_the_stack_adds_no_file_or_test_twice(exports: dict[str, export_pr.PrResult]) -> None:
    stack = [exports[n] for n in STACK]
    assert [pr.changes for pr in stack] == [["jit-fix"], ["qmm-sm90"], ["metal"], ["cuda"]]
    assert exports["metal"].changes == ["jit-fix", "metal"]  # alone on main: carries the fix
    added = [export_pr.diff_facts(pr.repository, pr.base, pr.commit) for pr in stack]
    tests = [t for facts in added for t in facts["tests"]]
    assert len(tests) == len(set(tests)) and tests
    benches = [b for facts in added for b in facts["benchmarks"]]
    assert benches == [BENCH_FILE]  # the Metal PR's, once
    assert exports["jit-fix"].files == ["mlx/backend/metal/quantized.cpp"]
    assert exports["qmm-sm90"].files == ["mlx/backend/cuda/quantized/qmm/qmm.cu"]
    for pr in (exports["cuda"], exports["cuda-stacked"]):
        assert not [f for f in pr.files if f.startswith("mlx/backend/metal/")]
    for name, pr in exports.items():
        author = git.out(pr.repository, "log", "-1", "--format=%an <%ae>|%cn <%ce>", pr.commit)
        who = f"Test Author <{pr.backend}@example.com>"
        assert author == f"{who}|{who}", name
        # No message of the tool's own (MLX's AGENTS.md): a placeholder subject, no body.
        message = git.out(pr.repository, "log", "-1", "--format=%B", pr.commit).strip()
        assert message == export_pr.commit_message(None, pr.backend).strip(), name


def test_a_stacked_body_names_the_prs_under_it(exports: dict[str, export_pr.PrResult]) -> None:
    """Stacked, a body names the earlier PRs' commits its branch is on, and which of them
    its change depends on; a PR on main names none, and the Metal PR alone says it carries
    the fix instead."""
    lines = {name: [ln for ln in pr.body.read_text().splitlines()
                    if ln.startswith(("This branch is on top of", "This branch carries"))]
             for name, pr in exports.items()}  # fmt: skip
    assert lines["jit-fix"] == [] and lines["qmm-sm90"] == [] and lines["cuda"] == []
    assert lines["metal"][0].startswith("This branch carries")
    metal = exports["metal-stacked"]
    fix = git.rev_parse(metal.repository, f"{metal.commit}~2")
    sm90 = git.rev_parse(metal.repository, f"{metal.commit}~1")
    (on_fixes,) = lines["metal-stacked"]
    assert fix[:8] in on_fixes and sm90[:8] in on_fixes
    (on_all,) = lines["cuda-stacked"]
    assert on_all.index(fix[:8]) < on_all.index(sm90[:8]) < on_all.index(metal.commit[:8])
    # Which of them a change depends on: Metal on the JIT fix alone; qmm_sm90 and CUDA
    # on none (CUDA takes only the benchmark script from Metal).
    assert "builds on the jit-fix PR" in on_fixes
    assert "depends on none of them (only the benchmark script" in on_all
    (on_jit,) = lines["qmm-sm90-stacked"]
    assert fix[:8] in on_jit and "depends on none of them:" in on_jit


def test_stacking_onto_a_base_without_the_fix_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(export_pr.UserError, match="lacks the jit-fix PR") as err:
        export_pr.export_pr(
            root=ROOT, backend="metal", onto=MAIN_SHA, stacked=True, out_dir=tmp_path / "x",
            branch="patchkit-test/never", mlx_repo=SPEC, author="A <a@example.com>",
        )  # fmt: skip
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()


def test_bodies_follow_mains_template_and_cite_only_mlx(
    exports: dict[str, export_pr.PrResult],
) -> None:
    template = git.show_file(exports["metal"].repository, MAIN_SHA, export_pr.PR_TEMPLATE)
    assert "AI usage disclosure:" in template
    for name, pr in exports.items():
        body = pr.body.read_text()
        assert template in body
        shown = body.split("-->", 1)[1]  # what a reviewer reads: after the draft notice
        for cited in ("patchkit parity", "patchkit emulate", "patchkit build", "docs/results"):
            assert cited not in shown, (name, cited)
        assert sorted(p.name for p in pr.patch.parent.iterdir()) == sorted(
            [*(p.name for p in pr.patches), export_pr.BODY_FILE]
        )
    assert "generation 15 or later" in exports["metal"].body.read_text()
    assert "MLX_METAL_JIT=ON" in exports["jit-fix"].body.read_text()
    assert "CUDA 13" in exports["qmm-sm90"].body.read_text()
    assert "This branch carries" in exports["metal"].body.read_text()
    assert "This branch carries" not in exports["metal-stacked"].body.read_text()


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
