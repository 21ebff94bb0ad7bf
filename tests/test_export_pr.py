"""export-pr: Python anchors, PR-only templates, formatter pins, and the real branch on a clone.

The clone tests need a full MLX clone holding the pin 9a795735 (set
PATCHKIT_MLX_REPO=/path/to/mlx) and the formatters upstream's pre-commit pins
(`pip install clang-format==21.1.8 black==26.1.0 isort==7.0.0`); without them they
skip, saying which is missing.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import export, export_pr, pyedit, render, source
from patchkit.errors import AnchorError, UserError
from patchkit.util import git

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
TEST_PATH = "python/tests/test_quantized.py"
BENCH_PATH = "benchmarks/python/qmv_small_batch_bench.py"
KERNEL_FILES = [
    "mlx/backend/metal/kernels/fp_quantized.h",
    "mlx/backend/metal/kernels/fp_quantized.metal",
    "mlx/backend/metal/kernels/quantized.h",
    "mlx/backend/metal/kernels/quantized.metal",
]
PINNED_FORMATTERS = {"clang-format": "21.1.8", "black": "26.1.0", "isort": "7.0.0"}

UPSTREAM_TEST = """# Copyright

import unittest
from itertools import product

import mlx.core as mx
import mlx_tests


class TestQuantized(mlx_tests.MLXTestCase):
    def test_a(self):
        class Inner:
            pass

        self.assertTrue(True)

    def test_b(self):
        x = 1
        # trailing comment inside the method
        self.assertEqual(x, 1)


class TestOther(mlx_tests.MLXTestCase):
    def test_c(self):
        pass


if __name__ == "__main__":
    mlx_tests.MLXTestRunner()
"""

PRECOMMIT_AT_PIN = """repos:
-   repo: https://github.com/pre-commit/pre-commit-hooks
    rev: v6.0.0
    hooks:
    -   id: check-yaml
-   repo: https://github.com/pre-commit/mirrors-clang-format
    rev: v21.1.8
    hooks:
    -   id: clang-format
-   repo: https://github.com/psf/black-pre-commit-mirror
    rev: 26.1.0
    hooks:
    -   id: black

-   repo: https://github.com/pycqa/isort
    rev: 7.0.0
"""


def _methods(text: str, cls: str) -> list[str]:
    node = pyedit.find_class(text, cls)
    return [n.name for n in node.body if isinstance(n, ast.FunctionDef)]


def test_append_to_class_adds_the_last_method_inside_the_class() -> None:
    snippet = "    def test_new(self):\n        self.assertTrue(True)\n"
    out = pyedit.append_to_class(UPSTREAM_TEST, "TestQuantized", snippet)
    assert _methods(out, "TestQuantized") == ["test_a", "test_b", "test_new"]
    assert _methods(out, "TestOther") == ["test_c"]
    # One blank line before the new method; the rest of the file is untouched.
    assert "        self.assertEqual(x, 1)\n\n    def test_new(self):\n" in out
    assert out.endswith(UPSTREAM_TEST[UPSTREAM_TEST.index("\n\nclass TestOther") :])


def test_python_anchor_errors_name_the_problem() -> None:
    with pytest.raises(AnchorError, match="no top-level class 'Inner'"):
        pyedit.append_to_class(UPSTREAM_TEST, "Inner", "    pass\n")
    with pytest.raises(AnchorError, match="defined 2 times"):
        pyedit.find_class("class A:\n    pass\n\n\nclass A:\n    pass\n", "A")
    with pytest.raises(AnchorError, match="cannot parse"):
        pyedit.find_class("class A(:\n", "A")
    with pytest.raises(AnchorError, match="exists upstream"):
        pyedit.apply_edit("x = 1\n", "new_file", "", "y = 2\n")
    with pytest.raises(AnchorError, match="does not exist upstream"):
        pyedit.apply_edit(None, "append_to_class", "TestQuantized", "    pass\n")
    assert pyedit.apply_edit(None, "new_file", "", "y = 2\n\n\n") == "y = 2\n"


def test_pr_plans_are_invisible_to_apply_and_overlay() -> None:
    plans = export_pr.pr_plans(TEMPLATES)
    assert sorted(p.path for p in plans) == [BENCH_PATH, TEST_PATH]
    for options in (render.RenderOptions(), render.RenderOptions(("metal",))):
        paths = [p.path for p in render.selected_plans(options, TEMPLATES)]
        assert TEST_PATH not in paths and BENCH_PATH not in paths


def _render_test(backends: tuple[str, ...]) -> str:
    (plan,) = [p for p in export_pr.pr_plans(TEMPLATES) if p.path == TEST_PATH]
    return export_pr.render_pr_file(plan, UPSTREAM_TEST, render.RenderOptions(backends))


def test_rendered_test_sweeps_small_m_in_mlx_style() -> None:
    metal = _render_test(("metal",))
    added = _methods(metal, "TestQuantized")[-2:]
    assert added == [
        "test_qmv_small_batch_matches_single_vector",
        "test_fp_qmv_small_batch_matches_single_vector",
    ]
    assert 'modes = ["mxfp4", "nvfp4", "mxfp8"]' in metal and "global_scale_w=" in metal
    assert f"Ms = range(2, {export_pr.TEST_MAX_M + 1})" in metal
    assert "with self.subTest(" in metal and "product(group_sizes, bit_widths, Ns, dtypes)" in metal
    assert "mx.array_equal(y, mx.concatenate(rows))" in metal
    assert "mx.cuda.is_available()" in metal  # Metal-only PR: CUDA skips
    both = _render_test(("metal", "cuda"))
    assert "Metal only" not in both
    # With CUDA: the affine test runs there for the M CUDA streams by default (M < 8);
    # the fp test skips there (CUDA's fp kernels are not what the patch checks).
    affine = both[both.index("def test_qmv_small_batch") : both.index("def test_fp_qmv_small")]
    assert "if mx.cuda.is_available():\n            # CUDA streams" in affine
    assert "            Ms = range(2, 8)\n" in affine
    fp = both[both.index("def test_fp_qmv_small") :]
    assert 'self.skipTest("On CUDA the streamed qmv is checked for affine modes.")' in fp


def test_rendered_benchmark_is_a_new_python_script() -> None:
    (plan,) = [p for p in export_pr.pr_plans(TEMPLATES) if p.path == BENCH_PATH]
    text = export_pr.render_pr_file(plan, None, render.RenderOptions(("metal",)))
    tree = ast.parse(text)
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"time_qmv_small_batch", "rows_match"} <= names
    assert "from time_utils import measure_runtime" in text
    with pytest.raises(AnchorError):
        export_pr.render_pr_file(plan, "# upstream now has it\n", render.RenderOptions())


def test_formatter_versions_come_from_the_pre_commit_config() -> None:
    assert export_pr.formatter_versions(PRECOMMIT_AT_PIN) == PINNED_FORMATTERS


def test_wrong_formatter_version_is_refused_with_the_install_command() -> None:
    with pytest.raises(UserError, match=r"pip install black==0\.0\.1"):
        export_pr.ensure_formatters({"black": "0.0.1"}, install=False)


def test_body_is_a_draft_carrying_the_upstream_template() -> None:
    body = export_pr.render_body(
        TEMPLATES,
        {
            "notice": export_pr.DRAFT_NOTICE,
            "base": PIN_SHA,
            "pin": True,
            "files": [TEST_PATH],
            "backends": ["metal"],
            "routing": "stream",
            "max_m": 12,
            "benchmarks": [],
            "cuda_results": [],
            "pr_template": "## Proposed changes\n\n- [ ] I have read CONTRIBUTING\n",
        },
    )
    assert body.splitlines()[1] == export_pr.DRAFT_NOTICE
    assert "# DRAFT - rewrite before posting" in body
    assert body.endswith("## Proposed changes\n\n- [ ] I have read CONTRIBUTING\n")
    assert "instead of `qmv_wide`" in body and "cannot be checked here" in body


# --- against a real clone -------------------------------------------------------------

SPEC = mlx_clone()


def _formatters_missing() -> str | None:
    bad = {
        t: export_pr.installed_version(t)
        for t, v in PINNED_FORMATTERS.items()
        if export_pr.installed_version(t) != v
    }
    return f"{bad}" if bad else None


_CLONE_MARKS = [
    pytest.mark.clone,
    pytest.mark.skipif(
        SPEC is None,
        reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
    ),
    pytest.mark.skipif(
        _formatters_missing() is not None,
        reason=f"needs upstream's formatter pins (found {_formatters_missing()}): pip install"
        " clang-format==21.1.8 black==26.1.0 isort==7.0.0",
    ),
]


def needs_clone(fn: Callable[..., None]) -> Callable[..., None]:
    """Skip with a how-to unless a clone of the pin and the pinned formatters are present."""
    for mark in _CLONE_MARKS:
        fn = mark(fn)
    return fn


@pytest.fixture(scope="module")
def pr(tmp_path_factory: pytest.TempPathFactory) -> export_pr.PrResult:
    out = tmp_path_factory.mktemp("pr")
    return export_pr.export_pr(
        root=ROOT, branch="patchkit-test/export-pr", out_dir=out, mlx_repo=SPEC
    )


@needs_clone
def test_export_pr_makes_one_formatted_commit_on_the_pin(pr: export_pr.PrResult) -> None:
    clone = pr.repository
    assert pr.base == PIN_SHA and git.out(clone, "rev-parse", f"{pr.commit}^") == PIN_SHA
    assert git.subject(clone, pr.commit) == export_pr.DEFAULT_TITLE
    assert git.rev_parse(clone, pr.branch) == pr.commit
    assert git.out(clone, "diff", "--name-only", PIN_SHA, pr.commit).splitlines() == sorted(
        [*KERNEL_FILES, "mlx/backend/metal/quantized.cpp", TEST_PATH, BENCH_PATH]
    )
    assert pr.reformatted == []  # templates render exactly what clang-format/black produce
    with source.worktree(clone, pr.commit, base_ref="refs/patchkit/test-pr") as wt:
        export_pr.run_formatters(wt, pr.files, check=True)  # raises if anything would change
    assert "DRAFT" in pr.body.read_text()


@needs_clone
def test_patch_applies_to_the_pin_with_git_am(pr: export_pr.PrResult, tmp_path: Path) -> None:
    work = tmp_path / "mlx"
    git.run(None, "clone", "--quiet", "--no-checkout", str(pr.repository), str(work))
    git.run(work, "checkout", "--quiet", "--detach", PIN_SHA)
    ident = {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    git.run(work, "am", "--quiet", str(pr.patch), env=ident)
    assert git.out(work, "rev-parse", "HEAD^{tree}") == git.out(
        pr.repository, "rev-parse", f"{pr.commit}^{{tree}}"
    )
    assert "+    def test_qmv_small_batch_matches_single_vector(self):" in pr.patch.read_text()


@needs_clone
def test_kernel_text_is_identical_in_pr_and_overlay(pr: export_pr.PrResult) -> None:
    for path in KERNEL_FILES:
        overlay = (ROOT / "patches" / PIN_SHA[:8] / "overlay" / path).read_text()
        in_pr = git.show_file(pr.repository, pr.commit, path)
        assert export.strip_header(path, overlay) == in_pr, path


@needs_clone
def test_rendered_test_passes_on_the_installed_cpu_mlx(
    pr: export_pr.PrResult, tmp_path: Path
) -> None:
    """The added test runs as upstream would run it (CPU here: no Metal device)."""
    pytest.importorskip("mlx.core")
    for path in (TEST_PATH, "python/tests/mlx_tests.py"):
        (tmp_path / Path(path).name).write_text(git.show_file(pr.repository, pr.commit, path))
    names = [
        "TestQuantized.test_qmv_small_batch_matches_single_vector",
        "TestQuantized.test_fp_qmv_small_batch_matches_single_vector",
    ]
    proc = subprocess.run(
        [shutil.which("python3") or "python3", "test_quantized.py", *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Ran 2 tests" in proc.stderr
