"""ci/cuda_controls.py: the defects it switches into the CUDA kernel, and how it judges them.

The controls run on a GPU host; here, that the control diff still applies to the kernel
template (and only there: the shipped template has no switch), and that the verdict
rejects a control the checks did not see.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support_scripts import ROOT, load_script

TEMPLATE = ROOT / "templates/mlx/backend/cuda/quantized/qmm/qmv.cu/qmv_mma.cu.j2"


def _controls():
    return load_script("ci/cuda_controls.py")


def test_the_control_diff_applies_to_the_kernel_template_and_is_not_shipped() -> None:
    controls = _controls()
    done = subprocess.run(
        ["git", "apply", "--check", "--verbose", str(controls.CONTROL_DIFF)], cwd=ROOT,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "qmv_mma.cu.j2" in done.stderr
    diff = controls.CONTROL_DIFF.read_text()
    assert all(f'"{s}"' in diff for s in controls.SWITCHES if s != "none")
    shipped = "\n".join(p.read_text() for p in (ROOT / "templates").rglob("*") if p.is_file())
    assert "PATCHKIT_CONTROL" not in shipped


def _result(switch: str, eager: int, graph: int, failed: bool) -> dict:
    return {"switch": switch, "rows_compared": 100, "eager_differing": eager,
            "graph_only_differing": graph, "pr_test_failed": failed}  # fmt: skip


@pytest.mark.parametrize(
    ("result", "ok"),
    [
        (_result("none", 0, 0, False), True),
        (_result("none", 0, 3, False), False),  # the shipped switch-off build must be exact
        (_result("split-launch", 0, 12, False), True),
        (_result("split-launch", 0, 12, True), True),  # the test's verdict is not asserted
        (_result("split-launch", 0, 0, False), False),  # a race the lazy check missed
        (_result("split-launch", 5, 12, False), True),  # the plain call may see it too
        (_result("split-launch", 5, 0, True), False),  # not in the lazy graph: not seen there
        (_result("order-by-m", 40, 0, True), True),
        (_result("order-by-m", 40, 0, False), False),  # the PR's test missed the order
        (_result("order-by-m", 0, 0, True), False),  # parity missed it
    ],
)
def test_a_control_the_checks_did_not_see_is_not_ok(result: dict, ok: bool) -> None:
    assert _controls().verdict(result) is ok


def test_a_control_run_without_rows_is_not_ok() -> None:
    assert not _controls().verdict({**_result("none", 0, 0, False), "rows_compared": None})


def test_the_page_says_whether_every_control_held(tmp_path: Path) -> None:
    controls = _controls()
    results = [_result("none", 0, 0, False), _result("split-launch", 0, 0, False)]
    for r in results:
        r["ok"] = controls.verdict(r)
    record = {"patch_commit": "a" * 40, "series_sha256": "b" * 64, "control_sha256": "c" * 64,
              "mlx_version": "0.32.1+patchkit.aaaa", "machine": "Linux x86_64, GPU",
              "command": "python3 ci/cuda_controls.py --out DIR", "results": results,
              "ok": all(r["ok"] for r in results)}  # fmt: skip
    text = controls.page(record)
    assert "Every control as it must be: **NO**" in text
    assert "| `split-launch` | 100 | 0 (must: (not asserted)) | 0 (must: yes) |" in text


def test_the_build_folder_follows_the_cmake_args_given() -> None:
    args = ["--offline", "--cmake-arg=-DA=1", "-j", "16", "--cmake-arg", "-DB=2"]
    assert _controls().cmake_args(args) == ("-DA=1", "-DB=2")
    assert _controls().cmake_args(["--offline"]) == ()
