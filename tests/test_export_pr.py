"""export-pr: Python anchors, PR-only templates, formatter pins, and the real branch on a clone.

The clone tests need a full MLX clone holding the pin 9a795735 (set
PATCHKIT_MLX_REPO=/path/to/mlx) and the formatters upstream's pre-commit pins
(`pip install clang-format==21.1.8 black==26.1.0 isort==7.0.0`); without them they
skip, saying which is missing.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support_git import PIN_SHA, mlx_clone
from unidiff import PatchSet

from patchkit.carry import export_pr, pyedit, render, source
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

    def test_qmv_small_non_multiples(self):
        pass

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
    assert _methods(out, "TestQuantized") == [
        "test_a",
        "test_qmv_small_non_multiples",
        "test_b",
        "test_new",
    ]
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


# patch_method's diff in these tests: test_b's comment line replaced.
PATCH_B = """--- a/TestQuantized.test_b
+++ b/TestQuantized.test_b
@@ -1,4 +1,4 @@
     def test_b(self):
         x = 1
-        # trailing comment inside the method
+        # the PR's comment
         self.assertEqual(x, 1)
"""


def test_patch_method_edits_the_named_method_only() -> None:
    upstream = UPSTREAM_TEST.replace(
        "    def test_c(self):\n        pass\n",
        "    def test_c(self):\n        x = 1\n        # trailing comment inside the method\n"
        "        self.assertEqual(x, 1)\n",
    )
    # a hunk of lines both methods hold: the anchor alone says which copy changes
    body_only = "--- a/m\n+++ b/m\n" + PATCH_B[PATCH_B.index("@@") :].replace(
        "@@ -1,4 +1,4 @@\n     def test_b(self):\n", "@@ -2,3 +2,3 @@\n"
    )
    in_b = pyedit.apply_edit(upstream, "patch_method", "TestQuantized.test_b", body_only)
    in_c = pyedit.apply_edit(upstream, "patch_method", "TestOther.test_c", body_only)
    assert in_b.index("# the PR's comment") < in_b.index("class TestOther")
    assert in_c.index("# the PR's comment") > in_c.index("class TestOther")
    for out in (in_b, in_c):
        assert out.count("# the PR's comment") == 1
        assert out.replace("# the PR's comment", "# trailing comment inside the method") == upstream


def test_patch_method_counts_from_the_first_decorator() -> None:
    upstream = UPSTREAM_TEST.replace(
        "    def test_b(self):", '    @unittest.skipIf(True, "why")\n    def test_b(self):'
    )
    decorated = '@@ -1,5 +1,5 @@\n     @unittest.skipIf(True, "why")\n'
    diff = PATCH_B.replace("@@ -1,4 +1,4 @@\n", decorated)
    out = pyedit.patch_method(upstream, "TestQuantized.test_b", diff)
    assert '    @unittest.skipIf(True, "why")\n    def test_b(self):\n        x = 1\n' in out
    assert "# the PR's comment" in out


def test_patch_method_errors_name_the_method() -> None:
    stale = PATCH_B.replace("# trailing comment inside", "# another comment inside")
    with pytest.raises(AnchorError, match=r"TestQuantized\.test_b, hunk 1: its upstream lines"):
        pyedit.patch_method(UPSTREAM_TEST, "TestQuantized.test_b", stale)
    with pytest.raises(AnchorError, match="has 0 methods 'test_z', not one"):
        pyedit.patch_method(UPSTREAM_TEST, "TestQuantized.test_z", PATCH_B)
    with pytest.raises(AnchorError, match="does not exist upstream"):
        pyedit.apply_edit(None, "patch_method", "TestQuantized.test_b", PATCH_B)


def test_patch_method_renders_from_edits_toml(tmp_path: Path) -> None:
    """Through render: the diff template's hunk counts are recounted from what rendered,
    and a PR whose backends leave the template empty leaves the method as it is."""
    folder = tmp_path / "templates" / "python" / "tests" / "test_quantized.py"
    folder.mkdir(parents=True)
    body = PATCH_B.replace("@@ -1,4 +1,4 @@", "@@ -1,9 +1,9 @@")  # wrong counts
    (folder / "b.diff.j2").write_text('{% if "metal" in backends %}\n' + body + "{% endif %}\n")
    (folder / "edits.toml").write_text(
        'backend = "pr"\n\n[[edit]]\nop = "patch_method"\n'
        'anchor = "TestQuantized.test_b"\ntemplate = "b.diff.j2"\n'
    )
    (plan,) = render.pr_plans(tmp_path / "templates")
    metal = render.render_pr_file(plan, UPSTREAM_TEST, render.RenderOptions(("metal",)))
    assert "# the PR's comment" in metal and "# trailing comment inside" not in metal
    cuda = render.render_pr_file(plan, UPSTREAM_TEST, render.RenderOptions(("cuda",)))
    assert cuda == UPSTREAM_TEST


def test_pr_test_methods_are_the_members_the_pr_adds(tmp_path: Path) -> None:
    """The methods a PR's snippets add (appended or placed after a method), in plan order;
    an edit of upstream's own method adds none (the control)."""
    folder = tmp_path / "templates" / "python" / "tests" / "test_quantized.py"
    folder.mkdir(parents=True)
    (folder / "new.py.j2").write_text("    def test_new_one(self):\n        pass\n")
    (folder / "after.py.j2").write_text("    def test_after_b(self):\n        pass\n")
    (folder / "b.diff.j2").write_text(PATCH_B)
    (folder / "edits.toml").write_text(
        'backend = "pr"\n\n[[edit]]\nop = "append_to_class"\nanchor = "TestQuantized"\n'
        'template = "new.py.j2"\n\n[[edit]]\nop = "patch_method"\n'
        'anchor = "TestQuantized.test_b"\ntemplate = "b.diff.j2"\n\n[[edit]]\n'
        'op = "after_method"\nanchor = "TestQuantized.test_b"\ntemplate = "after.py.j2"\n'
    )
    assert render.pr_test_methods(tmp_path / "templates") == ["test_new_one", "test_after_b"]
    # This checkout's: the Metal PR's two and the CUDA PR's two, none of upstream's.
    assert render.pr_test_methods() == [
        "test_qmv_small_batch_matches_single_vector",
        "test_fp_qmv_small_batch_matches_single_vector",
        "test_qmv_tensor_cores_match_single_vector",
        "test_qqmm_tensor_cores_match_single_vector",
    ]


def test_pr_plans_are_invisible_to_apply_and_overlay() -> None:
    plans = render.pr_plans(TEMPLATES)
    assert sorted(p.path for p in plans) == [BENCH_PATH, TEST_PATH]
    for options in (render.RenderOptions(), render.RenderOptions(("metal",))):
        paths = [p.path for p in render.selected_plans(options, TEMPLATES)]
        assert TEST_PATH not in paths and BENCH_PATH not in paths


def _with_patched_methods(text: str) -> str:
    """``text`` with the upstream methods the PR edits in place (``patch_method``) added,
    made of their diff templates' own old side: no upstream code is copied here."""
    (plan,) = [p for p in render.pr_plans(TEMPLATES) if p.path == TEST_PATH]
    context = render.pr_context(render.RenderOptions(render.BACKENDS))
    for edit in (e for e in plan.edits if e.op == "patch_method"):
        (hunk,) = PatchSet(render.edit_snippet(plan, edit, context))[0]
        assert hunk.source_start == 1, "the fixture needs the hunk to start at the def"
        old = "".join(line.value for line in hunk if not line.is_added)
        text = pyedit.append_to_class(text, edit.anchor.partition(".")[0], old + "        pass\n")
    return text


def _render_test(backends: tuple[str, ...]) -> str:
    (plan,) = [p for p in render.pr_plans(TEMPLATES) if p.path == TEST_PATH]
    upstream = _with_patched_methods(UPSTREAM_TEST)
    return render.render_pr_file(plan, upstream, render.RenderOptions(backends))


def test_only_the_metal_pr_renames_qmv_wide_in_upstreams_test() -> None:
    """The Metal PR removes qmv_wide, so test_qmv_wide's comment stops naming it there;
    the CUDA PR, which keeps that kernel, leaves the comment (the control)."""
    metal = _render_test(("metal",))
    cuda = _render_test(("cuda",))
    assert "routes to qmv_wide" not in metal and "routes to batched qmv" in metal
    assert "routes to qmv_wide" in cuda and "routes to batched qmv" not in cuda


def test_rendered_test_sweeps_small_m_in_mlx_style() -> None:
    metal = _render_test(("metal",))
    added = _methods(metal, "TestQuantized")[-2:]
    assert added == [
        "test_qmv_small_batch_matches_single_vector",
        "test_fp_qmv_small_batch_matches_single_vector",
    ]
    assert "mx.quantize(w, mode=mode, global_scale=global_scale_w)" in metal
    assert f"Ms = [2, 3, 5, 7, {render.TEST_MAX_M}]" in metal
    assert "with self.subTest(" in metal
    assert "mx.array_equal(y, mx.concatenate(rows[:M], -2))" in metal
    # Every grid axis carries its comment, as the file's own product() grids do.
    for axis in ("# group_size", "# bits", "# (N, K, B)", "# dtype", "# mode", "# op"):
        assert axis in metal, axis
    # Metal-only PR: both tests skip on CUDA through the file's decorator.
    assert metal.count("@unittest.skipIf(") == 2 and "Metal only" not in metal
    # The qqmm cases (with and without a global scale) run only on the GPU, as
    # test_qqmv gates them.
    assert "if mx.default_device() == mx.gpu:" in metal
    both = _render_test(("metal", "cuda"))
    # With CUDA: the affine test runs there for the M * B CUDA streams by default (< 8);
    # the fp test still skips there.
    affine = both[both.index("def test_qmv_small_batch") : both.index("def test_fp_qmv_small")]
    assert "if mx.cuda.is_available() and M * B >= 8:" in affine
    assert both.count("@unittest.skipIf(") == 1


# (N, K, B) -> which M = 1 path it covers, as the issue lists them.
PATH_CASES = {
    (64, 512, 1): "fast",
    (64, 384, 1): "ragged K, N % 8 == 0",
    (67, 512, 1): "N % 8 != 0",
    (5, 512, 1): "N < 8",
    (64, 512, 3): "B > 1",
}


def test_rendered_test_covers_each_m1_path() -> None:
    metal = _render_test(("metal",))
    for shape, why in PATH_CASES.items():
        assert f"            {shape},  #" in metal, why
    assert '("nvfp4", (4096, 1024, 1), "quantized_matmul")' in metal  # _r_2: N >= 4096, fast
    assert 'product(["nvfp4", "mxfp8"], shapes[:4], ["qqmm"])' in metal  # the batched qmv
    assert 'product(["nvfp4"], shapes[:4], ["qqmm_global_scale"])' in metal  # 2-D only


def test_rendered_benchmark_is_a_new_python_script() -> None:
    (plan,) = [p for p in render.pr_plans(TEMPLATES) if p.path == BENCH_PATH]
    text = render.render_pr_file(plan, None, render.RenderOptions(("metal",)))
    tree = ast.parse(text)
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"time_case", "run", "compare"} <= names
    assert "from time_utils import measure_runtime" in text
    # Main against the PR: two builds, one result file each; the PR reads no switch.
    assert "--compare" in text and "MLX_" not in text
    sizes = ",".join(f"{k}x{n}" for k, n in render.BENCH_SIZES)
    assert f'default="{sizes}"' in text
    with pytest.raises(AnchorError):
        render.render_pr_file(plan, "# upstream now has it\n", render.RenderOptions())


def test_formatter_versions_come_from_the_pre_commit_config() -> None:
    assert export_pr.formatter_versions(PRECOMMIT_AT_PIN) == PINNED_FORMATTERS


def test_wrong_formatter_version_is_refused_with_the_install_command() -> None:
    with pytest.raises(UserError, match=r"black==0\.0\.1.*--install-formatters"):
        export_pr.ensure_formatters({"black": "0.0.1"}, install=False)


PIN_TEMPLATE = (
    "## Proposed changes\n\nPlease include a description.\n\n"
    "## Checklist\n\n- [ ] I have read CONTRIBUTING\n"
)
# The shape of main's template (#4331): a statement and an empty disclosure line.
MAIN_TEMPLATE = (
    "- I understand it is prohibited to use AI to write PR description\n- AI usage disclosure: \n"
)
FACTS = {
    "numstat": {TEST_PATH: (118, 0), "mlx/backend/metal/kernels/quantized.h": (95, 200)},
    "tests": ["test_qmv_small_batch_matches_single_vector"],
    "test_file": TEST_PATH,
    "benchmarks": [BENCH_PATH],
    "env_vars": [],
}
RESULT = {"title": "Rows on the CPU", "lines": ["0 of 12 rows differ"], "source": "docs/x.json"}


def _body(template: str = MAIN_TEMPLATE, backend: str = "metal", **over: object) -> str:
    context = export_pr.body_context(backend, PIN_SHA, "b", template, FACTS, [RESULT])
    return export_pr.render_body(TEMPLATES, {**context, **over})


def test_body_follows_mains_template_and_leaves_the_disclosure_empty() -> None:
    body = _body()
    # Upstream's lines verbatim; the disclosure line ends where upstream's ends: empty.
    assert MAIN_TEMPLATE in body
    assert "\n- AI usage disclosure: \n" in body
    # Before the template only a comment: no prose in the submitter's place.
    before = body[: body.index(MAIN_TEMPLATE)]
    assert re.sub(r"<!--.*?-->", "", before, flags=re.S).strip() == ""
    assert "Your description of the change, in your own words." in before


def test_body_on_the_pins_template_keeps_its_own_description_section() -> None:
    body = _body(PIN_TEMPLATE)
    assert PIN_TEMPLATE in body and "Your description" not in body
    assert body.index("## Proposed changes") < body.index("## Tests")
    # Its heading on a line of its own: after a comment's "-->" it would not render.
    assert "-->\n## Proposed changes" in body


def test_body_gives_commands_results_and_what_is_owed_on_a_mac() -> None:
    body = _body()
    cmd = f"python {TEST_PATH} TestQuantized.test_qmv_small_batch_matches_single_vector"
    assert cmd in body
    assert "generation 15 or later" in body and "qmv_wide" in body
    assert f"python {BENCH_PATH} --json pr.json" in body
    # A result's lines, without naming the file they came from (a reviewer has only MLX).
    assert "- 0 of 12 rows differ" in body and "docs/x.json" not in body
    owed = body[body.index("## Still to measure on an Apple GPU") : body.index("## Files")]
    for item in ("bundled benchmark", "`mlx.metallib` size", "Compile time", "GPU itself"):
        assert item in owed, item
    assert owed.count("- [ ]") == 6 and "- [x]" not in body
    assert "| `mlx/backend/metal/kernels/quantized.h` | 95 | 200 |" in body


def test_cuda_body_says_where_its_test_fails_on_main() -> None:
    body = _body(backend="cuda")
    flat = " ".join(body.split())
    assert "is expected to fail on an sm90 GPU from M * B = 8 on" in flat
    assert "`test_qqmm_tensor_cores_match_single_vector` is expected to pass on main" in flat
    assert "not yet run on main" in flat  # no record shows it there
    assert "change in their last bits against main" in flat
    assert "Apple GPU" not in body.split("## Still")[1]
    # The benchmark script is the Metal PR's: the body takes it from that branch, to its own
    # place in the tree, where it finds the time_utils it imports (not to /tmp: there,
    # `import time_utils` fails).
    body = _body(backend="cuda", benchmarks=[])
    bench = export_pr.BENCH_FILE
    commands = _bench_commands(body)
    assert f"git show {export_pr.DEFAULT_BRANCHES['metal']}:{bench} > {bench}\n" in commands
    runs = re.findall(r"python (\S+)", commands)
    assert len(runs) == 3 and set(runs) == {bench} and "/tmp" not in commands
    # Both checkouts are built for CUDA (MLX builds the CPU backend alone by default).
    assert commands.count('CMAKE_ARGS="-DMLX_BUILD_CUDA=ON" pip install .') == 2
    assert "&& pip install" not in commands


def _bench_commands(body: str) -> str:
    """The shell lines of a body's Benchmark section."""
    return body.split("## Benchmark")[1].split("```sh\n")[1].split("```")[0]


def _run_bench_commands(body: str, repo: Path) -> None:
    """The body's benchmark lines, run in ``repo`` as a user would, with the build and the
    script's work stood in for (``pip install`` a no-op; ``python SCRIPT ...`` fails unless
    SCRIPT is there, and writes its --json file)."""
    commands = _bench_commands(body)
    stand_in = repo.parent / "bin"
    stand_in.mkdir(exist_ok=True)
    (stand_in / "pip").write_text("#!/bin/sh\nexit 0\n")
    (stand_in / "python").write_text(
        '#!/bin/sh\ntest -f "$1" || { echo "no $1" >&2; exit 2; }\n'
        '[ "$2" = --json ] && touch "$3"\nexit 0\n'
    )
    for tool in ("pip", "python"):
        (stand_in / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_in}{os.pathsep}{os.environ['PATH']}"}
    for line in commands.splitlines():
        done = subprocess.run(["bash", "-ec", line], cwd=repo, env=env, capture_output=True,
                              text=True)  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stderr}"


@pytest.mark.parametrize("stacked", [False, True])
def test_the_cuda_bodys_benchmark_commands_run_on_its_branch(tmp_path: Path,
                                                             stacked: bool) -> None:  # fmt: skip
    """Standalone, the CUDA branch lacks the script (the Metal PR adds it); stacked, it
    tracks it. From the CUDA branch checked out, the body's lines run to the end either way
    and leave the tree clean; the other way's lines fail there (the control)."""
    bench, metal, cuda = export_pr.BENCH_FILE, export_pr.DEFAULT_BRANCHES["metal"], "cuda-pr"
    repo = tmp_path / "mlx"
    git.init(repo)
    (repo / Path(bench).parent).mkdir(parents=True)
    (repo / Path(bench).parent / "time_utils.py").write_text("")
    ident = ["-c", "user.name=t", "-c", "user.email=t@t.invalid"]

    def commit(msg: str) -> None:
        subprocess.run(["git", *ident, "add", "-A"], cwd=repo, check=True)
        subprocess.run(["git", *ident, "commit", "-qm", msg], cwd=repo, check=True)

    commit("main")
    main = git.rev_parse(repo, "HEAD")
    subprocess.run(["git", "checkout", "-qb", metal], cwd=repo, check=True)
    (repo / bench).write_text("")
    commit("metal")
    subprocess.run(["git", "checkout", "-qb", cuda, metal if stacked else main], cwd=repo,
                   check=True)  # fmt: skip
    (repo / "cuda.txt").write_text("")
    commit("cuda")

    def body(on_branch: bool) -> str:
        return _body(backend="cuda", benchmarks=[], branch=cuda, upstream_base=main,
                     bench_on_branch=on_branch)  # fmt: skip

    _run_bench_commands(body(stacked), repo)
    assert git.status_porcelain(repo).split() in ([], ["??", "main.json", "??", "pr.json"])
    subprocess.run(["git", "checkout", "-q", cuda], cwd=repo, check=True)
    for f in ("main.json", "pr.json"):
        (repo / f).unlink(missing_ok=True)
    with pytest.raises(AssertionError):
        _run_bench_commands(body(not stacked), repo)


def test_each_body_names_the_upstream_work_on_its_problem() -> None:
    """The submitter must answer prior work: the other fix of #4350, and the opt-in
    batch-invariant mode (#4279) the Metal PR's approach differs from."""
    related = {b: " ".join(_body(backend=b).split("## Related upstream work")[1].split())
               for b in export_pr.BACKENDS}  # fmt: skip
    assert "#4372 fixes #4350 too" in related["jit-fix"] and "#4279" not in related["jit-fix"]
    assert "#4279" in related["metal"] and "ml-explore/mlx-c#124" in related["metal"]
    assert "needs a rebase if it lands first" in related["metal"]
    assert "#4" not in related["cuda"].split("## Files")[0]
    assert "#3706" in related["qmm-sm90"] and "v4.7.0" in related["qmm-sm90"]


def test_commit_messages_are_the_submitters() -> None:
    """MLX's AGENTS.md: no tool writes a commit message for the user. Without --title the
    subject is a placeholder that says so, with no body; the facts a message would state
    go to the body's draft, under a heading that asks for the submitter's own words."""
    for backend in export_pr.BACKENDS:
        msg = export_pr.commit_message(None, backend)
        assert msg.count("\n") == 1 and "write this commit message yourself" in msg, backend
        assert len(msg.strip()) <= 72 and f"[{backend}]" in msg
        facts = export_pr.change_facts(TEMPLATES, backend)
        assert 3 <= len(facts.splitlines()) <= 20 and facts.splitlines()[0] not in msg
    assert export_pr.commit_message("Fix it", "metal") == "Fix it\n"
    body = _body(backend="metal", change_facts=export_pr.change_facts(TEMPLATES, "metal"))
    assert "## What the change does (facts to check and put in your own words)" in body


def test_author_defaults_to_the_git_identity(tmp_path: Path) -> None:
    git.run(None, "init", "--quiet", str(tmp_path))
    assert export_pr.resolve_author([tmp_path], ("A", "a@x")) == ("A", "a@x")
    git.run(tmp_path, "config", "user.name", "Ada")
    git.run(tmp_path, "config", "user.email", "ada@x")
    assert export_pr.resolve_author([tmp_path / "absent", tmp_path], None) == ("Ada", "ada@x")


def test_no_git_identity_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git.run(None, "init", "--quiet", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "none"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    with pytest.raises(UserError, match=r"user\.name.*--author") as err:
        export_pr.resolve_author([tmp_path], None)
    assert "\n" not in str(err.value)


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
        root=ROOT,
        onto=PIN_SHA,
        branch="patchkit-test/export-pr",
        force=True,
        out_dir=out / "pin",
        mlx_repo=SPEC,
        author=("Test Author", "test@example.com"),
    )


@needs_clone
def test_export_pr_makes_formatted_commits_on_the_pin(pr: export_pr.PrResult) -> None:
    """On the pin the Metal PR carries the JIT fix it builds on as its first commit."""
    clone = pr.repository
    assert pr.changes == ["jit-fix", "metal"] and len(pr.patches) == 2
    assert pr.base == PIN_SHA and git.out(clone, "rev-parse", f"{pr.commit}~2") == PIN_SHA
    subject = export_pr.commit_message(None, "metal").splitlines()[0]
    assert git.subject(clone, pr.commit) == subject
    fix = export_pr.commit_message(None, "jit-fix").splitlines()[0]
    assert git.subject(clone, f"{pr.commit}^") == fix
    fix_files = git.out(clone, "diff", "--name-only", PIN_SHA, f"{pr.commit}^").splitlines()
    assert fix_files == ["mlx/backend/metal/quantized.cpp"]
    # The submitter's date (now), not upstream's.
    assert git.out(clone, "log", "-1", "--format=%aI", pr.commit) != git.commit_date(clone, PIN_SHA)
    assert git.rev_parse(clone, pr.branch) == pr.commit
    assert git.out(clone, "diff", "--name-only", PIN_SHA, pr.commit).splitlines() == sorted(
        [*KERNEL_FILES, "mlx/backend/metal/quantized.cpp", TEST_PATH, BENCH_PATH]
    )
    assert pr.reformatted == []  # templates render exactly what clang-format/black produce
    with source.worktree(clone, pr.commit, base_ref="refs/patchkit/test-pr") as wt:
        export_pr.run_formatters(wt, pr.files, check=True)  # raises if anything would change
    body = pr.body.read_text()
    assert git.out(clone, "log", "-1", "--format=%an <%ae>", pr.commit) == pr.to_json()["author"]
    # The pin's own PR template, verbatim.
    assert git.show_file(clone, PIN_SHA, export_pr.PR_TEMPLATE) in body


@needs_clone
def test_patch_applies_to_the_pin_with_git_am(pr: export_pr.PrResult, tmp_path: Path) -> None:
    work = tmp_path / "mlx"
    git.run(None, "clone", "--quiet", "--no-checkout", str(pr.repository), str(work))
    git.run(work, "checkout", "--quiet", "--detach", PIN_SHA)
    ident = {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    git.run(work, "am", "--quiet", *map(str, pr.patches), env=ident)
    assert git.out(work, "rev-parse", "HEAD^{tree}") == git.out(
        pr.repository, "rev-parse", f"{pr.commit}^{{tree}}"
    )
    assert "+    def test_qmv_small_batch_matches_single_vector(self):" in pr.patch.read_text()


@needs_clone
def test_kernel_text_is_the_pr_flavour_render(pr: export_pr.PrResult) -> None:
    # The PR's kernel files are the templates rendered onto its base in the PR
    # flavour (the overlay adds downstream switches on top of the same edits).
    options = render.RenderOptions(("metal",))
    for path in KERNEL_FILES:
        plan = next(p for p in render.selected_plans(options) if p.path == path)
        fresh = render.render_file(plan, git.show_file(pr.repository, PIN_SHA, path), options)
        assert git.show_file(pr.repository, pr.commit, path) == fresh, path


@needs_clone
def test_the_benchmark_runs_from_its_place_beside_time_utils(
    pr: export_pr.PrResult, tmp_path: Path
) -> None:
    """The bodies run the script as ``python benchmarks/python/...``: from there it imports
    upstream's ``time_utils``; copied elsewhere (the control), it cannot."""
    pytest.importorskip("mlx.core")
    here = tmp_path / Path(BENCH_PATH).parent
    here.mkdir(parents=True)
    for path in (BENCH_PATH, "benchmarks/python/time_utils.py"):
        (tmp_path / path).write_text(git.show_file(pr.repository, pr.commit, path))
    alone = tmp_path / "elsewhere" / Path(BENCH_PATH).name
    alone.parent.mkdir()
    shutil.copy(tmp_path / BENCH_PATH, alone)
    for script, ok in ((BENCH_PATH, True), (str(alone), False)):
        proc = subprocess.run([sys.executable, script, "--help"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert (proc.returncode == 0) == ok, proc.stderr[-2000:]
        assert ("No module named 'time_utils'" in proc.stderr) != ok


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
        [sys.executable, "test_quantized.py", *names],  # the interpreter that has mlx
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Ran 2 tests" in proc.stderr


def test_formatters_found_beside_the_interpreter_when_not_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A venv that is not on PATH: its tools sit beside sys.executable.
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake = venv_bin / "black"
    fake.write_text("#!/bin/sh\necho 'black, 26.1.0 (compiled: yes)'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(export_pr.sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    assert export_pr.ensure_formatters({"black": "26.1.0"}, install=False) == {"black": str(fake)}
    with pytest.raises(UserError, match="your environment is not touched"):
        export_pr.ensure_formatters({"black": "26.1.1"}, install=False)


def test_push_needs_a_url_or_path_not_a_remote_name(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="give a URL or the path of a git repository"):
        export_pr.push_target("myfork")
    assert export_pr.push_target("git@github.com:me/mlx.git") == "git@github.com:me/mlx.git"
    with pytest.raises(UserError, match="not a git repository"):
        export_pr.push_target(str(tmp_path))
    git.run(None, "init", "--quiet", "--bare", str(tmp_path / "fork.git"))
    assert export_pr.push_target(str(tmp_path / "fork.git")) == str(tmp_path / "fork.git")


def test_a_build_record_without_tests_is_left_out_of_the_body(tmp_path: Path) -> None:
    """A `--no-test` build is no fact a reviewer can rerun: no empty section, a warning;
    control: the same record with its tests is cited."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "MLX built with this change for CUDA, its tests"\n'
        'file = "build-cuda.json"\nkind = "build"\n'
    )
    record = {"mlx_commit": "9a795735ad9a", "backend": "cuda", "date": "2026-12-03",
              "machine": {"gpu": "NVIDIA H200"}, "tests": None}  # fmt: skip
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found == [] and "left out of the body" in notes[0]
    record["tests"] = {"file": "python/tests/test_quantized.py", "passed": 40, "failed": 0,
                       "skipped": 2}  # fmt: skip
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert notes == [] and "40 passed, 0 failed, 2 skipped" in found[0]["lines"][1]


def test_a_build_record_names_this_prs_tests_and_only_counts_the_rest(tmp_path: Path) -> None:
    """The build holds every PR of the series, so its test file has other PRs' tests: the
    body names this PR's own methods with their verdicts and only counts the unfinished
    ones; it says the new tests pass only when the record shows each of them passing
    (control: one unfinished)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "MLX built with this change for CUDA, its tests"\n'
        'file = "build-cuda.json"\nkind = "build"\n'
    )
    per_test = {"test_own": "passed", "test_own_too": "passed", "test_other_pr": "unfinished",
                "test_old": "unfinished"}  # fmt: skip
    tests = {"file": "python/tests/test_quantized.py", "passed": 2, "failed": 0, "skipped": 0,
             "per_test": per_test, "unfinished": ["test_other_pr", "test_old"]}  # fmt: skip
    record = {"mlx_commit": "9a795735ad9a", "backend": "cuda", "date": "2026-12-04",
              "machine": {"gpu": "NVIDIA H200"}, "tests": tests}  # fmt: skip
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    own = ["test_own", "test_own_too"]

    def body_facts() -> tuple[list[str], bool]:
        found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda", own)
        assert notes == []
        facts = {"numstat": {}, "tests": own, "test_file": "python/tests/test_quantized.py",
                 "benchmarks": [], "env_vars": []}  # fmt: skip
        context = export_pr.body_context("cuda", "base", "branch", "", facts, found)
        return found[0]["lines"], context["tests_shown_passing"]

    lines, shown = body_facts()
    assert f"with this change and {export_pr.SERIES_BUILT}," in lines[0]
    # The series' branches are named once, above the records (the body's own test).
    assert not any(f"`{b}`" in lines[0] for b in export_pr.DEFAULT_BRANCHES.values())
    assert lines[1].endswith("; 2 methods not run to the end in the time given")
    assert "test_other_pr" not in " ".join(lines)
    assert lines[2] == "this PR's tests there: `test_own` passed, `test_own_too` passed"
    assert shown
    per_test["test_own_too"] = "unfinished"
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    lines, shown = body_facts()
    assert lines[2].endswith("`test_own_too` unfinished") and not shown


def test_the_qmm_sm90_body_says_the_tests_it_fixes_pass_only_where_a_build_shows_it(
    tmp_path: Path,
) -> None:
    """The qmm_sm90 PR adds no test: it fixes MLX's own. The body names their verdicts in
    the build of the series and says they pass only when each of them passed there
    (control: one failed)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[qmm-sm90.result]]\ntitle = "MLX built with this change for CUDA, its tests"\n'
        'file = "build-cuda.json"\nkind = "build"\n'
    )
    per_test = {"test_qmm": "passed", "test_qmv": "passed", "test_qmv_wide": "passed"}
    tests = {"file": "python/tests/test_quantized.py", "passed": 3, "failed": 0, "skipped": 0,
             "per_test": per_test}  # fmt: skip
    record = {"mlx_commit": "9a795735ad9a", "backend": "cuda", "date": "2026-12-05",
              "machine": {"gpu": "NVIDIA H200"}, "tests": tests}  # fmt: skip

    def body() -> tuple[list[str], str]:
        (tmp_path / "build-cuda.json").write_text(json.dumps(record))
        found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "qmm-sm90")
        assert notes == []
        facts = {**FACTS, "tests": [], "numstat": {}}
        context = export_pr.body_context("qmm-sm90", PIN_SHA, "b", MAIN_TEMPLATE, facts, found)
        return found[0]["lines"], export_pr.render_body(TEMPLATES, context)

    lines, text = body()
    assert lines[-1] == (
        "the tests this PR fixes there: `test_qmm` passed, `test_qmv` passed, "
        "`test_qmv_wide` passed"
    )
    assert "pass on a CUDA 13 build of the series" in text and "meant to pass" not in text
    per_test["test_qmv_wide"] = "failed"
    lines, text = body()
    assert lines[-1].endswith("`test_qmv_wide` failed")
    assert "meant to pass" in text and "pass on a CUDA 13 build" not in text


def test_the_cuda_body_quotes_mlxs_tests_beside_stock_from_the_page(tmp_path: Path) -> None:
    """Every number of the tests fact is the page's own (counted here from its arms), the
    methods failing on stock and passing here are named, and no patchkit file or command
    is."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "MLX\'s test file"\nfile = "t.json"\nkind = "tests"\n'
    )
    fail = "FAIL: test_old (test_quantized.TestQuantized.test_old) (k=64)"
    new = "FAIL: test_new (test_quantized.TestQuantized.test_new) (M=8)"
    arms = {
        "pr": {"test_old": {"verdict": "FAILED", "problems": [fail]},
               "test_new": {"verdict": "ok", "problems": []},
               "test_slow": {"verdict": "UNFINISHED", "problems": []}},
        "stock": {"test_old": {"verdict": "FAILED", "problems": [fail]},
                  "test_new": {"verdict": "FAILED", "problems": [new]},
                  "test_slow": {"verdict": "ok", "problems": []}},
    }  # fmt: skip
    page = {"module": "test_quantized", "hardware": {"gpu": "NVIDIA H200"},
            "mlx": {"stock": "mlx 0.32.1"}, "arms": arms, "pr_failing_also_on_stock": 1,
            "pr_failing_only_on_pr": [], "stock_failing_only_on_stock": 1}  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps(page))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    lines = found[0]["lines"]
    assert notes == []
    assert "with this branch methods: 1 passed or skipped, 1 failed, 1 not run" in lines[0]
    assert (
        lines[1]
        == "subtests failing with this branch: 1 (test_old (1)), of which 1 fail on stock too"
    )
    assert "not run to the end with this branch: test_slow" in lines
    assert lines[-1] == "failing on stock, passing with this branch: test_new"
    assert not any("patchkit" in line or "bench/" in line for line in lines)
    assert "one process per test method: with" in lines[0]  # control: every method ran
    # Failures in a method stock did not end are counted, and said to be not compared.
    page.update(pr_failing_not_compared=2)
    (tmp_path / "t.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found[0]["lines"][1] == (
        "subtests failing with this branch: 3 (test_old (1)), of which 1 fail on stock too; "
        "not compared, their method not run to the end on stock: 2"
    )
    del page["pr_failing_not_compared"]
    # A page of the methods the build's own run failed says which ran.
    page.update(only=["test_old"], only_failed_in_build=True)
    (tmp_path / "t.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert (
        "(methods run: test_old, those that failed in the build's own run of the file)"
        in (found[0]["lines"][0])
    )
    # ... and when methods were named beside them, which were which.
    page.update(only=["test_fixed", "test_old"], failed_in_build=["test_old"])
    (tmp_path / "t.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert (
        "(methods run: test_fixed, test_old; failed in the build's own run of the file: "
        "test_old, the others named to run)" in found[0]["lines"][0]
    )
    # A PR's own tests among the page's: only those are quoted, counted from their arms.
    found, notes = export_pr.measured_results(
        tmp_path, tmp_path / "templates", "cuda", ("test_new",)
    )
    own = found[0]["lines"]
    assert ", quoted here: test_new: with this branch methods: 1 passed" in own[0]
    assert "with stock MLX (mlx 0.32.1) methods: 0 passed or skipped, 1 failed" in own[0]
    # Each of the PR's own methods with its verdict in both arms, on a line of its own.
    assert own[1] == "each, with this branch / with stock: test_new ok / failed"
    assert own[2] == "subtests failing with this branch: none"  # no "0, of which 0"
    assert "each, with this branch" not in " ".join(lines)  # control: the whole page
    assert own[-1] == "failing on stock, passing with this branch: test_new"
    assert found[0]["own_fail_on_stock"] == ["test_new"]
    assert found[0]["own_pass_on_stock"] == []
    assert "test_old" not in own[2] and "test_slow" not in " ".join(own)
    # Control: a PR none of whose tests the page ran is left out, and said so.
    found, notes = export_pr.measured_results(
        tmp_path, tmp_path / "templates", "cuda", ("test_elsewhere",)
    )
    assert found == [] and notes == ["t.json: runs none of this PR's tests or of MLX's it "
                                     "fixes; left out of the body"]  # fmt: skip


def test_the_cuda_body_quotes_the_speed_page_per_band_of_m(tmp_path: Path) -> None:
    """The speed fact's ratios are the page's own rows (PR over stock), M = 1 per bits, then
    2..7 and 8..16 over every run; the page's notes follow; no patchkit file is named."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )

    def row(M: int, stock: float, pr: float) -> dict:
        return {"K": 4096, "N": 4096, "bits": 4, "M": M, "stock_us": stock, "pr_us": pr}

    run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"},
           "hardware": {"gpu": "NVIDIA H200, 580.159.04"},
           "rows": [row(1, 40.0, 20.0), row(2, 40.0, 10.0), row(7, 80.0, 8.0),
                    row(8, 10.0, 15.0)]}  # fmt: skip
    run.update(mlx={"stock": "0.32.1", "pr": "0.32.1+patchkit.abc"}, repeats=200, rounds=3)
    run["rows"].append({**row(1, 10.0, 12.0), "bits": 8})
    page = {"runs": [run], "notes": ["first case slow"]}
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    lines = found[0]["lines"]
    assert notes == [] and "NVIDIA H200: stock MLX 0.32.1" in lines[0]
    assert "4- and 8-bit" in lines[0] and "1 layers (K x N: 4096x4096) of 16,777,216" in lines[0]
    assert lines[1].startswith("timing: 200 calls evaluated together") and "3 rounds" in lines[1]
    assert lines[1].endswith(export_pr.SPEED_CALLS["independent"])  # a run that does not say
    assert lines[2] == (
        "time with this change over stock's (below 1: this change is faster): M = 1, 4-bit: "
        "0.50x; M = 1, 8-bit: 1.20x; "
        "M = 2, 7: 0.10-0.25x; M = 8: 1.50x (stock runs `qmm` from M = 8)"
    )
    # The one cell at M = 1..7 slower than stock's qmv is counted by layer and bits; a
    # page of one round a cell says nothing of a spread.
    assert lines[3] == (
        "slower than stock in 1 of 4 cells at M = 1..7; by layer and bits: 4096x4096 8-bit "
        "1; each in the first table below"
    )
    # The one cell at M = 8..16 slower than stock's qmm is named: the route's cost.
    assert lines[4] == (
        "slower than stock's `qmm` in 1 of 1 cells at M = 8, at most 1.50x (4-bit "
        "4096x4096, bfloat16 group 64, M = 8)"
    )
    assert lines[5] == (
        "those cells by layer and bits: 4096x4096 4-bit 1; each in the second table below"
    )
    assert lines[6] == "note: first case slow"
    assert not any("patchkit" in line or "bench/" in line for line in lines)
    run["rows"][3]["pr_us"] = 9.0  # control: faster everywhere, no cell named
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found[0]["lines"][4] == "no slower than stock's `qmm` in any of 1 cells at M = 8"
    run["rows"][3]["pr_us"] = 10.5  # 1.05x: slower, by under a tenth
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert (
        "in 1 of 1 cells at M = 8, 1 of them at 1.10x or less, at most 1.05x"
        in found[0]["lines"][4]
    )
    run["rows"][3]["pr_us"] = 10.996  # shown as 1.10x: counted as the cells show it
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert (
        "1 of 1 cells at M = 8, 1 of them at 1.10x or less, at most 1.10x" in found[0]["lines"][4]
    )
    run["rows"][3]["pr_us"] = 11.06  # control: shown as 1.11x, not counted
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert "1 of 1 cells at M = 8, at most 1.11x" in found[0]["lines"][4]
    run["link_us"] = {"stock": 13.4, "pr": 19.6}  # independent calls: no link to give
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found[0]["lines"][1].endswith(export_pr.SPEED_CALLS["independent"])
    run["calls"] = "chained"  # chained calls: the link's own time, part of every time
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found[0]["lines"][1].endswith(
        export_pr.SPEED_CALLS["chained"] + "; the link alone takes 13-20 µs a call in both "
        "arms (timed in the same runs), part of every time below, which it pulls toward 1x "
        "on the smaller layers"
    )
    del run["link_us"]  # a run that did not time it: nothing said
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found[0]["lines"][1].endswith(export_pr.SPEED_CALLS["chained"])
    run["rows"] = [r for r in run["rows"] if r["M"] == 1]  # a run of M = 1 alone
    (tmp_path / "cuda.json").write_text(json.dumps(page))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert "M = 2..7: not timed; M = 8..16: not timed" in found[0]["lines"][2]
    assert found[0]["lines"][3].startswith("slower than stock in 1 of 2 cells at M = 1..7")
    assert found[0]["lines"][4] == "note: first case slow"  # no cell at M = 8..16 to name


def test_the_cuda_body_quotes_compute_sanitizer_only_when_every_tool_came_out_right(
    tmp_path: Path,
) -> None:
    """The sanitizer fact says what each tool reported in the kernel, the control that
    makes "no report" worth something, and the command that reruns it on the PR's test;
    a record with any run not as it must is quoted not at all."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Sanitizer"\nfile = "c.json"\nkind = "sanitizer"\n'
    )
    runs = [{"switch": "none", "tool": t, "ok": True} for t in ("memcheck", "racecheck")]
    runs.append({"switch": "no-barrier", "tool": "racecheck", "ok": True})
    record = {"machine": "Linux x86_64, NVIDIA H100", "sanitizer": runs}
    (tmp_path / "c.json").write_text(json.dumps(record))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    lines = found[0]["lines"]
    assert notes == [] and lines[0].startswith("compute-sanitizer (memcheck, racecheck) over")
    assert "no printed report names `qmv_mma_kernel`, and" in lines[0]
    assert "NVIDIA H100" in lines[0]
    assert lines[1].startswith("control: with the barrier") and "racecheck reports" in lines[1]
    assert lines[2].startswith("to rerun on this PR's test: `compute-sanitizer")
    assert not any("patchkit" in line or "ci/" in line for line in lines)
    # A tool that counted more reports than it printed: the body says how many it printed.
    runs[0].update(summary=5000, kernel_reports=0, other_reports=100)
    (tmp_path / "c.json").write_text(json.dumps(record))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert "(memcheck counts 5,000 reports, the first 100 printed)" in found[0]["lines"][0]
    runs[0].update(summary=100)  # control: every report it counted was printed
    (tmp_path / "c.json").write_text(json.dumps(record))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert (
        "(memcheck counts 100 reports, all printed, each in another kernel)" in found[0]["lines"][0]
    )
    # Runs of tools that checked the kernel alone: their summaries are the claim.
    for r in runs[:2]:
        r.update(summary=0, kernel_only=True)
    (tmp_path / "c.json").write_text(json.dumps(record))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert "each tool checked `qmv_mma_kernel` alone and counted no report" in found[0]["lines"][0]
    assert not any("initcheck reports" in line for line in found[0]["lines"])  # no such run
    runs.append({"switch": "uninit-read", "tool": "initcheck", "ok": True, "kernel_reports": 78})
    (tmp_path / "c.json").write_text(json.dumps(record))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found[0]["lines"][2] == (
        "control: with a read of memory never written put in, initcheck reports `qmv_mma_kernel`"
    )
    runs.pop()
    runs[2]["ok"] = False  # the race unseen: no fact
    (tmp_path / "c.json").write_text(json.dumps(record))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found == [] and "holds no fact" in notes[0]


def test_results_of_another_patch_series_are_left_out_of_the_body(tmp_path: Path) -> None:
    """A build record built from another series than ``patches/`` holds (of what its
    backend compiles), and a speed page that timed a build of another series or names none,
    are another kernel's numbers: left out with a warning. Controls: the same files are
    quoted while the series is the one they name, and after an edit the CUDA build does not
    compile (Metal)."""
    short = "9a795735"
    shutil.copy(ROOT / "pin.toml", tmp_path / "pin.toml")
    series_dir = tmp_path / "patches" / short
    series_dir.mkdir(parents=True)
    diff = ("diff --git a/mlx/backend/cuda/x.cu b/mlx/backend/cuda/x.cu\n"
            "--- a/mlx/backend/cuda/x.cu\n+++ b/mlx/backend/cuda/x.cu\n"
            "@@ -1,1 +1,1 @@\n-int a;\n+int b;\n")  # fmt: skip
    (series_dir / "series").write_text("0001-a.patch\n")
    (series_dir / "0001-a.patch").write_text(diff)
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Build"\nfile = "build-cuda.json"\nkind = "build"\n'
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )
    from patchkit.carry import mlx_build

    wheel = "0.32.1+patchkit.abc"
    tests = {"file": "python/tests/test_quantized.py", "passed": 40, "failed": 0, "skipped": 0}
    record = {"mlx_commit": "9a795735ad9a", "backend": "cuda", "date": "2026-12-04",
              "machine": {"gpu": "NVIDIA H200"}, "tests": tests, "wheel_version": wheel,
              "patch": {"build_inputs_sha256": mlx_build.build_inputs_id(tmp_path, short, "cuda"),
                        "pr_files_sha256": mlx_build.pr_files_id(tmp_path)}}  # fmt: skip
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    rows = [{"K": 4096, "N": 4096, "bits": 4, "M": m, "stock_us": 40.0, "pr_us": 20.0}
            for m in (1, 2, 8)]  # fmt: skip
    run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1", "pr": wheel},
           "hardware": {"gpu": "NVIDIA H200"}, "rows": rows, "repeats": 200,
           "rounds": 3}  # fmt: skip
    timed = {"backend": "cuda", "wheel_version": wheel,
             "build_inputs_sha256": record["patch"]["build_inputs_sha256"]}  # fmt: skip
    (tmp_path / "cuda.json").write_text(json.dumps({"runs": [run], "notes": []}))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert [f["source"] for f in found] == ["build-cuda.json"]  # control: no build named
    assert "cuda.json: names no build it timed" in notes[0]
    (tmp_path / "cuda.json").write_text(json.dumps({"build": timed, "runs": [run], "notes": []}))

    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert notes == [] and [f["source"] for f in found] == ["build-cuda.json", "cuda.json"]
    # a build whose test run ran other PR tests than templates/ renders now
    other = {**record, "patch": {**record["patch"], "pr_files_sha256": "0" * 64}}
    (tmp_path / "build-cuda.json").write_text(json.dumps(other))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert [f["source"] for f in found] == ["cuda.json"]
    assert "build-cuda.json: ran other PR tests than templates/ renders now" in notes[0]
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    # a Metal edit is not what the CUDA build compiled; a CUDA one is
    (series_dir / "0001-a.patch").write_text(diff + diff.replace("cuda/x.cu", "metal/x.metal"))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert notes == [] and len(found) == 2
    (series_dir / "0001-a.patch").write_text(diff.replace("int b;", "int c;"))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert found == []
    assert "build-cuda.json: built from another patch series" in notes[0]
    assert "cuda.json: timed a build of another patch series" in notes[1]


def test_the_metal_body_names_the_work_its_kernels_meet() -> None:
    """The Metal PR replaces #3764's qmv_wide and edits the kernels #4516 edits."""
    related = " ".join(_body(backend="metal").split("## Related upstream work")[1].split())
    assert "#3764" in related and "#4516" in related


def test_the_cuda_speed_tables_give_every_cell_where_qmm_is_faster(tmp_path: Path) -> None:
    """A route that kept `qmm` where it is faster needs the cells, not the worst alone: the
    lines count the slower cells by layer and bits, and a table gives each, grouped by layer
    and bits, with both arms' rounds; a cell where this change is faster is in neither (the
    control)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )

    def run(dtype: str, cells: list[tuple[int, int, int, float]]) -> dict:
        rows = [{"K": k, "N": n, "bits": 8, "M": m, "stock_us": 10.0, "pr_us": 10.0 * r}
                for k, n, m, r in cells]  # fmt: skip
        return {"dtype": dtype, "group_size": 64, "mlx": {"stock": "0.32.1"}, "rounds": 3,
                "hardware": {"gpu": "NVIDIA H100"}, "repeats": 200, "rows": rows,
                "calls": "independent"}  # fmt: skip

    runs = [run("bfloat16", [(14336, 4096, 16, 1.24), (4096, 4096, 12, 1.1), (4096, 4096, 8, 0.9)]),
            run("float16", [(4096, 14336, 16, 0.5), (14336, 4096, 8, 1.01)])]  # fmt: skip

    def result() -> dict:
        (tmp_path / "cuda.json").write_text(json.dumps({"runs": runs}))
        found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
        return found[0]

    # A page that kept one round a cell: no word of a spread, no column for it.
    listed = next(ln for ln in result()["lines"] if ln.startswith("those cells"))
    assert listed == ("those cells by layer and bits: 4096x4096 8-bit 1, 14336x4096 8-bit 2; "
                      "each in the table below")  # fmt: skip
    assert "in 3 of 5 cells" in result()["lines"][3]
    (table,) = result()["tables"]
    # HTML in a summary: GitHub renders no Markdown there.
    assert table["summary"] == ("The 3 cells at M = 8..16 where this change is slower than "
                                "stock's <code>qmm</code>, with calls MLX's CUDA graph may "
                                "overlap")  # fmt: skip
    assert table["header"][-1] == "`qmm`'s rounds, µs"
    assert table["rows"] == [
        ["4096x4096", "8", "bfloat16", "64", "12", "1.10x", "11.0", "10.0"],
        ["14336x4096", "8", "bfloat16", "64", "16", "1.24x", "12.4", "10.0"],
        ["14336x4096", "8", "float16", "64", "8", "1.01x", "10.1", "10.0"],
    ]
    # With rounds: a cell whose rounds overlap `qmm`'s (its fastest no slower than `qmm`'s
    # slowest) is within the spread; the control, rounds apart, beyond it. Those beyond it
    # lead the table, each arm's rounds sorted (the middle of three is the median).
    runs[1]["rows"][1].update(pr_rounds_us=[10.0, 10.1, 12.0], stock_rounds_us=[9.9, 10.0, 10.5])
    runs[0]["rows"][0].update(pr_rounds_us=[12.3, 12.4, 13.0], stock_rounds_us=[9.9, 10.0, 10.5])
    listed = next(ln for ln in result()["lines"] if ln.startswith("those cells"))
    assert listed == (
        "those cells by layer and bits, 2 of them beyond the rounds' spread (this change's "
        "fastest round slower than `qmm`'s slowest): 4096x4096 8-bit 1 (1 beyond the "
        "spread), 14336x4096 8-bit 2 (1 beyond the spread); each in the table below"
    )
    (table,) = result()["tables"]
    assert table["header"][-1] == "beyond the rounds' spread"
    assert [(row[0], row[4], row[-3], row[-1]) for row in table["rows"]] == [
        ("4096x4096", "12", "11.0", "yes"),
        ("14336x4096", "16", "12.3, 12.4, 13.0", "yes"),
        ("14336x4096", "8", "10.0, 10.1, 12.0", "no"),
    ]
    runs[0]["rows"][1].update(pr_rounds_us=[10.9, 11.0, 13.0], stock_rounds_us=[9.0, 10.0, 11.5])
    (table,) = result()["tables"]  # now within the spread: after the one beyond it
    assert [(row[0], row[4], row[-1]) for row in table["rows"]] == [
        ("14336x4096", "16", "yes"),
        ("4096x4096", "12", "no"),
        ("14336x4096", "8", "no"),
    ]
    # The worst cell is noise there: the line says so, and gives the worst beyond it.
    worst = next(ln for ln in result()["lines"] if ln.startswith("slower than stock's"))
    assert worst.endswith("at most 1.24x (8-bit 14336x4096, bfloat16 group 64, M = 16, "
                          "beyond the rounds' spread)")  # fmt: skip
    runs[0]["rows"][0]["pr_rounds_us"] = [10.0, 12.4, 13.0]  # control: the worst overlaps
    worst = next(ln for ln in result()["lines"] if ln.startswith("slower than stock's"))
    assert worst.endswith("at most 1.24x (8-bit 14336x4096, bfloat16 group 64, M = 16, "
                          "within the rounds' spread)")  # fmt: skip
    runs[0]["rows"][1].update(pr_rounds_us=[11.0], stock_rounds_us=[10.0])  # beyond again
    worst = next(ln for ln in result()["lines"] if ln.startswith("slower than stock's"))
    assert worst.endswith("within the rounds' spread); beyond it at most 1.10x (8-bit "
                          "4096x4096, bfloat16 group 64, M = 12)")  # fmt: skip
    runs[0]["rows"][0]["pr_rounds_us"] = [12.3, 12.4, 13.0]
    # The route section's line for the page counts them.
    assert export_pr.route_line({"runs": runs}) == (
        "with calls MLX's CUDA graph may overlap: slower than `qmm` in 3 of the 5 cells at "
        "M = 8, 12, 16, 2 of them beyond the rounds' spread (this change's fastest round "
        "slower than `qmm`'s slowest): 4096x4096 8-bit 1, 14336x4096 8-bit 1"
    )


def test_the_cuda_speed_tables_give_cells_slower_than_stocks_qmv(tmp_path: Path) -> None:
    """A cell at M < 8 where this change is slower than stock's `qmv` is counted with the
    spread of its rounds and given in a table with them, so the reviewer can tell a cost
    from noise; a page whose cells there are all faster gets neither (the control)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )

    def page(ratio_at_2: float, stock_rounds: list[float] | None = None) -> dict:
        rows = [{"K": 4096, "N": 1024, "bits": 8, "M": m, "stock_us": 20.0,
                 "pr_us": 20.0 * r, "pr_rounds_us": [20.0 * r, 21.7, 28.7],
                 **({"stock_rounds_us": stock_rounds} if stock_rounds else {})}
                for m, r in ((1, 0.9), (2, ratio_at_2), (8, 0.3))]  # fmt: skip
        run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"},
               "rounds": 3, "hardware": {"gpu": "NVIDIA H100"}, "repeats": 200,
               "calls": "chained", "rows": rows}  # fmt: skip
        (tmp_path / "cuda.json").write_text(json.dumps({"runs": [run]}))
        found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
        return found[0]

    def slower(result: dict) -> list[str]:
        return [ln for ln in result["lines"] if ln.startswith("slower than stock in")]

    assert slower(page(1.04)) == [
        "slower than stock in 1 of 2 cells at M = 1..7, all beyond the rounds' spread (this "
        "change's fastest round slower than stock's slowest); by layer and bits: 4096x1024 "
        "8-bit 1 (1 beyond the spread); each in the table below"
    ]
    (table,) = page(1.04)["tables"]
    assert table["summary"] == ("The 1 cells at M = 1..7 where this change is slower than "
                                "stock, with each call waiting for the one before")  # fmt: skip
    assert table["rows"] == [["4096x1024", "8", "bfloat16", "64", "2", "1.04x",
                              "20.8, 21.7, 28.7", "20.0", "yes"]]  # fmt: skip
    # Stock's slowest round (23 us) above this change's fastest (20.8 us): the cell rests on
    # rounds that overlap; above, with stock's rounds all at 20 us, it does not (the control).
    overlapping = page(1.04, [19.0, 20.0, 23.0])
    assert slower(overlapping) == [
        "slower than stock in 1 of 2 cells at M = 1..7, all within the rounds' spread (this "
        "change's fastest round no slower than stock's slowest); by layer and bits: "
        "4096x1024 8-bit 1; each in the table below"
    ]
    assert overlapping["tables"][0]["rows"][0][-2:] == ["19.0, 20.0, 23.0", "no"]
    assert slower(page(0.9)) == [] and page(0.9)["tables"] == []
    # A cell slower by under half a percent reads with three decimals, not as 1.00x.
    assert page(1.003)["tables"][0]["rows"][0][5] == "1.003x"


def test_the_body_folds_each_speed_table_under_its_summary() -> None:
    """The body renders a result's tables after its lines, each a Markdown table folded
    under its summary, one row a cell; a result without tables renders none (the
    control)."""
    table = {"summary": "The 1 cells", "header": ["K x N", "M"], "rows": [["4096x1024", "2"]]}
    result = {"title": "Speed", "lines": ["a line"], "tables": [table]}
    body = _body(backend="cuda", results=[result])
    assert ("- a line\n\n<details>\n<summary>The 1 cells</summary>\n\n| K x N | M |\n"
            "|---|---|\n| 4096x1024 | 2 |\n\n</details>\n") in body  # fmt: skip
    assert "<details>" not in _body(backend="cuda", results=[{**result, "tables": []}])


def test_the_cuda_speed_fact_gives_m1_error_beside_stocks(tmp_path: Path) -> None:
    """Where the speed page measured M = 1's error against float32, the body gives this
    change's over stock's per bits, after the times; a page without it gives no such line."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )

    def row(bits: int, M: int, **errors: float) -> dict:
        return {"K": 4096, "N": 4096, "bits": bits, "M": M, "stock_us": 10.0, "pr_us": 5.0,
                **errors}  # fmt: skip

    rows = [row(4, 1, stock_m1_error=4e-3, pr_m1_error=2e-3), row(4, 2),
            row(8, 1, stock_m1_error=1e-3, pr_m1_error=1e-3)]  # fmt: skip
    runs = [{"dtype": d, "group_size": 64, "mlx": {"stock": "0.32.1"}, "rounds": 3,
             "hardware": {"gpu": "NVIDIA H200"}, "repeats": 200, "calls": "chained",
             "rows": [dict(r) for r in rows]} for d in ("bfloat16", "float16")]  # fmt: skip
    runs[1]["rows"][0]["pr_m1_error"] = 5e-3
    (tmp_path / "cuda.json").write_text(json.dumps({"runs": runs}))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    lines = found[0]["lines"]
    assert lines[2].startswith("time with this change over stock's")
    assert lines[3].startswith("M = 1's largest error against a float32 reference")
    assert lines[3].endswith("4-bit 0.50-1.25x; 8-bit 1.00x")
    for run in runs:  # control: runs that did not measure it
        for r in run["rows"]:
            r.pop("pr_m1_error", None)
    (tmp_path / "cuda.json").write_text(json.dumps({"runs": runs}))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert not any("float32 reference" in line for line in found[0]["lines"])


def test_a_second_speed_page_with_the_same_m1_error_says_as_above(tmp_path: Path) -> None:
    """Two speed pages (chained and independent calls) draw the same weights and vectors,
    so their M = 1 error lines read alike: the second says "as above", and so does its line
    of GPU, arms and layers; pages whose errors or GPUs differ each keep their own line
    (the controls)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Chained"\nfile = "a.json"\nkind = "speed"\n'
        '[[cuda.result]]\ntitle = "Independent"\nfile = "b.json"\nkind = "speed"\n'
    )

    def page(name: str, calls: str, pr_error: float, gpu: str = "NVIDIA H100") -> None:
        row = {"K": 4096, "N": 4096, "bits": 4, "M": 1, "stock_us": 10.0, "pr_us": 5.0,
               "stock_m1_error": 4e-3, "pr_m1_error": pr_error}  # fmt: skip
        run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"},
               "rounds": 3, "hardware": {"gpu": gpu}, "repeats": 200,
               "calls": calls, "rows": [row]}  # fmt: skip
        (tmp_path / name).write_text(json.dumps({"runs": [run]}))

    def error_lines() -> list[str]:
        found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
        return [ln for f in found for ln in f["lines"] if ln.startswith("M = 1's")]

    page("a.json", "chained", 2e-3)
    page("b.json", "independent", 2e-3)
    first, second = error_lines()
    assert first.endswith("4-bit 0.50x")
    assert second == "M = 1's error against a float32 reference: as above"
    page("b.json", "independent", 3e-3)
    first, second = error_lines()
    assert first.endswith("4-bit 0.50x") and second.endswith("4-bit 0.75x")

    def setup_lines() -> list[str]:
        found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
        return [f["lines"][0] for f in found]

    first, second = setup_lines()
    assert first.startswith("`mx.quantized_matmul` on NVIDIA H100: stock MLX 0.32.1")
    assert second == "the GPU, the two arms, the layers, bits, dtypes and groups: as above"
    page("b.json", "independent", 3e-3, gpu="NVIDIA H200")
    first, second = setup_lines()
    assert second.startswith("`mx.quantized_matmul` on NVIDIA H200: stock MLX 0.32.1")


@pytest.mark.parametrize("calls", [None, "independent", "chained"])
def test_the_cuda_body_owes_dependent_calls_while_its_speed_timed_independent_ones(
    tmp_path: Path, calls: str | None
) -> None:
    """A speed page of independent calls (a run that does not say is one) leaves the
    speed of dependent calls owed; a page of chained calls settles it (the control)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )
    rows = [{"K": 4096, "N": 4096, "bits": 4, "M": m, "stock_us": 20.0, "pr_us": 10.0}
            for m in (1, 2, 8)]  # fmt: skip
    run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"}, "rounds": 3,
           "hardware": {"gpu": "NVIDIA H200"}, "repeats": 200, "rows": rows}  # fmt: skip
    if calls:
        run["calls"] = calls
    (tmp_path / "cuda.json").write_text(json.dumps({"runs": [run]}))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert notes == [] and found[0]["title"] == "Speed"
    context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, FACTS, found)
    owed = export_pr.render_body(TEMPLATES, context).split("## Still to measure")[1]
    owed = " ".join(owed.split())
    assert ("the calls timed above were independent" in owed) == (calls != "chained")


@pytest.mark.parametrize("pages", [("chained",), ("independent",), ("chained", "independent")])
def test_the_cuda_body_owes_the_calls_no_quoted_speed_page_timed(
    tmp_path: Path, pages: tuple[str, ...]
) -> None:
    """Each way of timing the calls is owed until a quoted speed page timed it: a page of
    chained calls owes the throughput of independent ones and the reverse; with both
    quoted, neither is owed (the one-page cases are the controls)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text("".join(
        f'[[cuda.result]]\ntitle = "Speed {c}"\nfile = "{c}.json"\nkind = "speed"\n'
        for c in pages))  # fmt: skip
    rows = [{"K": 4096, "N": 4096, "bits": 4, "M": m, "stock_us": 20.0, "pr_us": 10.0}
            for m in range(1, 17)]  # fmt: skip
    for calls in pages:
        run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"}, "rounds": 3,
               "hardware": {"gpu": "NVIDIA H200"}, "repeats": 200, "rows": rows,
               "calls": calls}  # fmt: skip
        (tmp_path / f"{calls}.json").write_text(json.dumps({"runs": [run]}))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert notes == [] and len(found) == len(pages)
    context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, FACTS, found)
    owed = export_pr.render_body(TEMPLATES, context).split("## Still to measure")[1]
    owed = " ".join(owed.split("## Related")[0].split())
    assert ("The throughput of calls that do not wait" in owed) == (pages == ("chained",))
    assert ("the calls timed above were independent" in owed) == (pages == ("independent",))


@pytest.mark.parametrize("quoted", [True, False])
def test_the_cuda_benchmark_section_says_whose_harness_timed_the_speed(
    tmp_path: Path, quoted: bool
) -> None:
    """MLX asks for a PR's benchmark script with its numbers: where a speed page is quoted,
    the Benchmark section says those numbers are another harness's, not the script's, and
    owes main against the branch with the script (control: no page quoted, no such line)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    toml = 'title = "Speed"\nfile = "speed.json"\nkind = "speed"\n'
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        "[[cuda.result]]\n" + toml if quoted else ""
    )
    rows = [{"K": 4096, "N": 4096, "bits": 4, "M": 1, "stock_us": 20.0, "pr_us": 10.0}]
    run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"}, "rounds": 3,
           "hardware": {"gpu": "NVIDIA H200"}, "repeats": 200, "rows": rows,
           "calls": "chained"}  # fmt: skip
    (tmp_path / "speed.json").write_text(json.dumps({"runs": [run]}))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    facts = {**FACTS, "benchmarks": []}  # the CUDA PR's: the script is the Metal PR's
    context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, facts, found)
    bench = export_pr.render_body(TEMPLATES, context).split("## Benchmark")[1]
    bench = " ".join(bench.split("\n## ")[0].split())
    assert ('The speed under "Measured so far" was not taken with this script' in bench) is quoted


@pytest.mark.parametrize("ms", [(1, 2, 8, 12, 16), tuple(range(1, 17))])
def test_the_cuda_body_owes_what_a_chained_speed_page_leaves_untimed(
    tmp_path: Path, ms: tuple[int, ...]
) -> None:
    """A chained speed page leaves owed the Ms up to 16 it did not time (control: a page
    of every M owes none), the throughput of independent calls, and other sm90 GPUs."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )
    rows = [{"K": 4096, "N": 4096, "bits": 4, "M": m, "stock_us": 20.0, "pr_us": 10.0}
            for m in ms]  # fmt: skip
    run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"}, "rounds": 3,
           "hardware": {"gpu": "NVIDIA H200"}, "repeats": 200, "rows": rows,
           "calls": "chained"}  # fmt: skip
    (tmp_path / "cuda.json").write_text(json.dumps({"runs": [run]}))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, FACTS, found)
    owed = export_pr.render_body(TEMPLATES, context).split("## Still to measure")[1]
    owed = " ".join(owed.split("## Related")[0].split())
    untimed = "The speed at M = 3, 4, 5, 6, 7, 9, 10, 11, 13, 14, 15, which the runs"
    assert (untimed in owed) == (len(ms) == 5)
    assert ("The speed at M =" in owed) == (len(ms) == 5)
    assert "The throughput of calls that do not wait for each other" in owed
    assert "on sm90 GPUs other than the one above" in owed


def test_the_cuda_body_owes_the_kinds_of_layer_no_speed_page_timed(tmp_path: Path) -> None:
    """Layers of few rows and layers of one group a row are owed while every quoted speed
    page leaves them untimed; a page that times one (the control) takes it off the list."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text("".join(
        f'[[cuda.result]]\ntitle = "Speed {c}"\nfile = "{c}.json"\nkind = "speed"\n'
        for c in ("chained", "independent")))  # fmt: skip

    def owed(layers: dict[str, list[tuple[int, int]]]) -> str:
        for calls, kn in layers.items():
            rows = [{"K": k, "N": n, "bits": 4, "M": m, "stock_us": 20.0, "pr_us": 10.0}
                    for k, n in kn for m in range(1, 17)]  # fmt: skip
            run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"},
                   "rounds": 3, "hardware": {"gpu": "NVIDIA H200"}, "repeats": 200,
                   "rows": rows, "calls": calls}  # fmt: skip
            (tmp_path / f"{calls}.json").write_text(json.dumps({"runs": [run]}))
        found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
        context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, FACTS, found)
        text = export_pr.render_body(TEMPLATES, context).split("## Still to measure")[1]
        return " ".join(text.split("## Related")[0].split())

    few_rows = "The speed on layers of fewer than 4096 rows (N)"
    one_group = "The speed on layers of one group a row (K <= group size)"
    text = owed({"chained": [(4096, 4096)], "independent": [(14336, 4096)]})
    assert few_rows in text and one_group in text
    text = owed({"chained": [(4096, 4096), (4096, 1024)], "independent": [(64, 4096)]})
    assert few_rows not in text and one_group not in text


@pytest.mark.parametrize("qmm_us", [None, 20.0, 5.0])
def test_the_cuda_route_section_follows_where_the_speed_page_has_qmm_faster(
    tmp_path: Path, qmm_us: float | None
) -> None:
    """The route section offers keeping `qmm` "where it is faster" while a speed page shows
    such cells (or none is quoted); on a page where it is faster nowhere, it says so and
    leaves the alternative for where `qmm` proves faster (control: one cell slower)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Speed"\nfile = "cuda.json"\nkind = "speed"\n'
    )
    found: list[dict] = []
    if qmm_us is not None:
        rows = [{"K": 4096, "N": 4096, "bits": 4, "M": m, "stock_us": s, "pr_us": 10.0}
                for m, s in ((1, 20.0), (8, qmm_us))]  # fmt: skip
        run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"},
               "rounds": 3, "hardware": {"gpu": "NVIDIA H200"}, "repeats": 200,
               "rows": rows, "calls": "chained"}  # fmt: skip
        (tmp_path / "cuda.json").write_text(json.dumps({"runs": [run]}))
        found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
        assert notes == [] and found[0]["qmm_faster"] == int(qmm_us < 10.0)
    context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, FACTS, found)
    route = export_pr.render_body(TEMPLATES, context).split("## The route")[1]
    route = " ".join(route.split("## Measured so far")[0].split())
    faster_nowhere = qmm_us == 20.0
    assert ("`qmm` is faster in none" in route) == faster_nowhere
    assert ("The alternative: keep `qmm` for the shapes" in route) == (not faster_nowhere)
    assert "Which of the two MLX wants is the reviewers' call." in route
    # The page's own line leads the section, with its cells; no page, no line.
    lead = 'In the cells measured ("Measured so far" gives the GPU and the layers):'
    assert (lead in route) == (qmm_us is not None)
    if qmm_us == 20.0:
        assert ("- with each call waiting for the one before: no slower than `qmm` in any of "
                "the 1 cells at M = 8 (0.50x `qmm`'s time)") in route  # fmt: skip
    if qmm_us == 5.0:  # one round a cell: no word of a spread
        assert ("- with each call waiting for the one before: slower than `qmm` in 1 of the 1 "
                "cells at M = 8 \"Measured so far\" names those cells") in route  # fmt: skip


@pytest.mark.parametrize("unfinished", [[], ["test_qmm"]])
def test_the_cuda_body_owes_main_alone_once_a_build_ran_the_whole_file(
    tmp_path: Path, unfinished: list[str]
) -> None:
    """The body's first CUDA item asks for the whole test file on this branch only while
    no build record took every method to its end (control: one method unfinished)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Build"\nfile = "build-cuda.json"\nkind = "build"\n'
    )
    tests = {"file": "python/tests/test_quantized.py", "ran": 40, "passed": 38, "failed": 0,
             "skipped": 2, "unfinished": unfinished}  # fmt: skip
    record = {"mlx_commit": "9a795735ad9a", "backend": "cuda", "date": "2026-12-05",
              "machine": {"gpu": "NVIDIA H100"}, "tests": tests}  # fmt: skip
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    found, _ = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, FACTS, found)
    owed = export_pr.render_body(TEMPLATES, context).split("## Still to measure")[1]
    whole = "run to the end on main on a CUDA\n  GPU (sm_90), beside this branch"
    assert (whole in owed) == (not unfinished)
    assert ("run to the end on this branch and\n  on main" in owed) == bool(unfinished)


@pytest.mark.parametrize("stock_left", [None, "only", "unfinished", "cut_off"])
def test_the_cuda_body_owes_nothing_of_the_test_file_once_main_ran_it_whole(
    tmp_path: Path, stock_left: str | None
) -> None:
    """With a build record that ran every method to its end, the item for the test file
    goes once a tests page ran every method on stock too; a page of picked methods, or one
    whose stock arm left a method unfinished or cut off, keeps it (the controls)."""
    (tmp_path / "templates" / "pr").mkdir(parents=True)
    (tmp_path / "templates" / "pr" / "results.toml").write_text(
        '[[cuda.result]]\ntitle = "Build"\nfile = "build-cuda.json"\nkind = "build"\n'
        '[[cuda.result]]\ntitle = "Tests"\nfile = "t.json"\nkind = "tests"\n'
    )
    tests = {"file": "python/tests/test_quantized.py", "ran": 2, "passed": 2, "failed": 0,
             "skipped": 0, "unfinished": []}  # fmt: skip
    record = {"mlx_commit": "9a795735ad9a", "backend": "cuda", "date": "2026-12-05",
              "machine": {"gpu": "NVIDIA H100"}, "tests": tests}  # fmt: skip
    (tmp_path / "build-cuda.json").write_text(json.dumps(record))
    ok = {"verdict": "ok", "problems": []}
    arms = {"pr": {"test_a": dict(ok), "test_b": dict(ok)},
            "stock": {"test_a": dict(ok), "test_b": dict(ok)}}  # fmt: skip
    page = {"module": "test_quantized", "hardware": {"gpu": "NVIDIA H100"},
            "mlx": {"stock": "mlx 0.32.1"}, "arms": arms, "pr_failing_also_on_stock": 0,
            "pr_failing_only_on_pr": [], "stock_failing_only_on_stock": 0}  # fmt: skip
    if stock_left == "only":
        page["only"] = ["test_a", "test_b"]
    elif stock_left == "unfinished":
        arms["stock"]["test_b"]["verdict"] = "UNFINISHED"
    elif stock_left == "cut_off":
        arms["stock"]["test_b"]["cut_off"] = True
    (tmp_path / "t.json").write_text(json.dumps(page))
    found, notes = export_pr.measured_results(tmp_path, tmp_path / "templates", "cuda")
    assert notes == [] and len(found) == 2
    context = export_pr.body_context("cuda", PIN_SHA, "b", MAIN_TEMPLATE, FACTS, found)
    owed = export_pr.render_body(TEMPLATES, context).split("## Still to measure")[1]
    assert ("`python/tests/test_quantized.py` run to the end" in owed) == bool(stock_left)
    assert "Main against this branch with the benchmark above" in owed


def test_body_says_the_builds_are_the_overlay_and_where_they_were_built() -> None:
    """The builds quoted are patchkit's overlay of the series (switches at their
    defaults); a base other than the records' commit (a PR onto main) is said, the
    records' own base is not (the sentence would say nothing there)."""
    at_pin = export_pr.body_context("cuda", PIN_SHA, "b", PIN_TEMPLATE, FACTS, [RESULT],
                                    records_commit=PIN_SHA)  # fmt: skip
    body = export_pr.render_body(TEMPLATES, at_pin)
    assert "built as\npatchkit's overlay" in body and "left at their defaults" in body
    # The series' branches, named once: this PR's as exported (--branch "b").
    assert "`order-preserving-qmv`, `b`." in body and "order-preserving-qmv-cuda" not in body
    assert "not at this PR's base" not in body
    on_main = export_pr.body_context("cuda", "f" * 40, "b", PIN_TEMPLATE, FACTS, [RESULT],
                                     records_commit=PIN_SHA)  # fmt: skip
    assert (
        f"They were built at {PIN_SHA[:8]}, not at this PR's base,\n{'f' * 8}"
        in export_pr.render_body(TEMPLATES, on_main)
    )
    # No results quoted: neither sentence.
    bare = export_pr.body_context("cuda", PIN_SHA, "b", PIN_TEMPLATE, FACTS, [])
    assert "overlay" not in export_pr.render_body(TEMPLATES, bare)


def test_the_cuda_body_says_its_test_fails_on_stock_only_once_a_page_shows_it() -> None:
    """The new test failing on main's code is owed until a tests page shows it failing on
    stock and passing on the build; then the body points there."""
    test = "test_qmv_tensor_cores_match_single_vector"
    owed = _body(backend="cuda", own_shown_failing_on_stock=[])
    assert "a run of it on\nmain is owed" in owed and "shown on stock's wheels" not in owed
    shown = _body(backend="cuda", own_shown_failing_on_stock=[test])
    assert "shown on stock's wheels beside this branch's build" in shown
    assert "on main is owed" not in shown


def test_the_cuda_body_says_its_qqmm_test_passes_on_stock_only_once_a_page_shows_it() -> None:
    """The nvfp4 test is expected to pass on main; the body says it does only once a tests
    page shows it passing on stock and on the build (control: without such a page the body
    says it has not run there; ``pass_on_both`` below leaves out a test failing on stock)."""
    test = "test_qqmm_tensor_cores_match_single_vector"
    unrun = " ".join(_body(backend="cuda", own_shown_passing_on_stock=[]).split())
    assert "not yet run on main" in unrun and "it passes on stock's wheels" not in unrun
    shown = " ".join(_body(backend="cuda", own_shown_passing_on_stock=[test]).split())
    assert "it passes on stock's wheels beside this branch's build" in shown
    assert "not yet run on main" not in shown


def test_pass_on_both_needs_both_arms_to_pass() -> None:
    page = {"arms": {
        "pr": {"a": {"verdict": "ok"}, "b": {"verdict": "ok"}, "c": {"verdict": "FAILED"}},
        "stock": {"a": {"verdict": "ok"}, "b": {"verdict": "FAILED"}, "c": {"verdict": "ok"}},
    }}  # fmt: skip
    assert export_pr.pass_on_both(page, ["a", "b", "c", "d"]) == ["a"]


def test_the_cuda_benchmark_command_times_the_quoted_speed_pages_layers() -> None:
    """Main against this PR with the bundled script, on the layers the quoted speed pages
    timed (their bfloat16 runs), so the two can be read side by side; without a speed
    page, the script's own layers."""
    body = _body(backend="cuda", speed_layers=["4096x1024", "8192x28672"])
    assert "--min-m 1 --max-m 16 --dtype bfloat16 --sizes 4096x1024,8192x28672 --json" in body
    assert "--sizes" not in _body(backend="cuda", speed_layers=[])
    page = {"runs": [{"rows": [{"K": 4096, "N": 1024}, {"K": 8192, "N": 28672},
                               {"K": 4096, "N": 1024}]}]}  # fmt: skip
    assert export_pr.speed_layers(page) == ["4096x1024", "8192x28672"]


def test_the_speed_fact_says_stocks_release_holds_the_pins_touched_files() -> None:
    """Stock's arm is a release, not the pin: where ``pin.toml`` names that release as the
    one whose touched files are the pin's, the setup line says so; a stock of another
    version (the control) and a pin naming no release get no such words."""
    row = {"K": 4096, "N": 4096, "bits": 4, "M": 1, "stock_us": 10.0, "pr_us": 5.0}
    run = {"dtype": "bfloat16", "group_size": 64, "mlx": {"stock": "0.32.1"}, "rounds": 3,
           "hardware": {"gpu": "NVIDIA H100"}, "repeats": 200, "rows": [row]}  # fmt: skip
    fact = "0.32.1's copies of the files this change touches are the pinned commit's"
    assert fact in export_pr.speed_fact({"runs": [run]}, "0.32.1")[0]
    assert "copies of the files" not in export_pr.speed_fact({"runs": [run]}, "0.32.2")[0]
    assert "copies of the files" not in export_pr.speed_fact({"runs": [run]})[0]
