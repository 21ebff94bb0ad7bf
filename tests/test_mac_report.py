"""``patchkit mac-report``: its plan on any machine, its report from sample step outputs.

The step outputs below have the formats the steps write (unittest -v, the PR benchmark's
JSON, a build record, ninja's log); their numbers are samples for the parser, not results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchkit.carry import mac_report, mlx_build
from patchkit.cli import main

ROOT = Path(__file__).resolve().parent.parent

MAIN_TESTS = """\
test_qmv (test_quantized.TestQuantized.test_qmv) ... ok
test_qmv_small_batch_matches_single_vector (test_quantized.TestQuantized.test_qmv_small_batch_matches_single_vector) ...
  test_qmv_small_batch_matches_single_vector (test_quantized.TestQuantized.test_qmv_small_batch_matches_single_vector) (M=2) ... FAIL
test_fp_qmv_small_batch_matches_single_vector (test_quantized.TestQuantized.test_fp_qmv_small_batch_matches_single_vector) ... ok

======================================================================
FAIL: test_qmv_small_batch_matches_single_vector (test_quantized.TestQuantized.test_qmv_small_batch_matches_single_vector) (M=2)
----------------------------------------------------------------------
AssertionError: False is not true

----------------------------------------------------------------------
Ran 3 tests in 4.210s

FAILED (failures=1)
"""  # noqa: E501


def _bench(ms: float, match: bool) -> dict:
    return {"device": {"device_name": "Apple M4 Pro"}, "results": [
        {"K": 4096, "N": 4096, "M": 2, "mode": "affine", "bits": 4, "rows_match": match,
         "batched": ms, "singles": 2 * ms},
    ]}  # fmt: skip


def test_the_plan_runs_on_any_machine_and_keeps_the_two_builds_apart() -> None:
    r = CliRunner().invoke(main, ["mac-report", "--dry-run", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    steps = json.loads(r.stdout)["steps"]
    assert [s["stage"] for s in steps] == ["stock", "stock", "device", "build", "build-jit",
                                           "main-tests", "bench-main", "bench-pr"]  # fmt: skip
    jit = next(s["command"] for s in steps if s["stage"] == "build-jit")
    assert "--cmake-arg=-DMLX_METAL_JIT=ON" in jit and "mlx==0.32.1" in steps[1]["command"]
    where = mac_report.paths(ROOT)
    assert where.aot.base != where.jit.base and where.jit.base.name.startswith("metal-")
    assert not str(where.out).startswith(str(ROOT))  # never in the checkout


def test_the_report_reads_every_number_from_the_steps_files(tmp_path: Path) -> None:
    out = tmp_path / "report"
    aot = mlx_build.Layout(tmp_path / "builds" / "metal-9a795735")
    where = mac_report.Paths(out, aot, mlx_build.Layout(tmp_path / "builds" / "metal-jit"))
    (out / "aot").mkdir(parents=True)
    (out / "device.json").write_text(json.dumps({"device_name": "Apple M4 Pro",
                                                 "architecture": "applegpu_g16s"}))  # fmt: skip
    (out / "main-tests.log").write_text(MAIN_TESTS)
    (out / "bench-main.json").write_text(json.dumps(_bench(0.2, False)))
    (out / "bench-pr.json").write_text(json.dumps(_bench(0.1, True)))
    tests = {"file": "python/tests/test_quantized.py", "passed": 40, "failed": 0, "errors": 0,
             "skipped": 1, "ran": 41}  # fmt: skip
    parity = {"rows": 8008, "rows_differing": 0, "kernel_paths": ["qmv", "qmv_fast"]}
    (out / "aot" / "build-metal.json").write_text(json.dumps({"tests": tests, "parity": parity}))
    ninja = aot.worktree / "build" / "temp.macosx-14-arm64-cpython-312"
    ninja.mkdir(parents=True)
    (ninja / ".ninja_log").write_text(
        "# ninja log v6\n100\t2600\t0\tmlx/backend/metal/kernels/quantized.air\tabc\n"
        "2600\t2900\t0\tmlx/backend/metal/kernels/mlx.metallib\tdef\n"
        "0\t50\t0\tmlx/array.cpp.o\t123\n"
    )
    data, text = mac_report.report(where)
    assert data["main_tests"]["pr_tests_failing"] == ["test_qmv_small_batch_matches_single_vector"]
    assert data["bench"][0]["ratio"] == pytest.approx(0.5)
    kernels = "mlx/backend/metal/kernels/"
    assert data["pr_kernel_compile_ms"] == {
        kernels + "quantized.air": 2500,
        kernels + "mlx.metallib": 300,
    }
    assert "Apple M4 Pro, applegpu_g16s" in text and "| 0.2000 | 0.1000 | 0.50 |" in text
    assert "parity 0 of 8008 rows differ" in text and "40 passed, 0 failed" in text
    # a step that wrote nothing is a sentence, never a number
    assert "branch, `MLX_METAL_JIT=ON`: no record" in text and data["metallib_bytes"]["pr"] is None


def test_mismatched_benchmark_files_are_one_line() -> None:
    a, b = _bench(0.2, False), _bench(0.1, True)
    b["results"][0]["M"] = 3
    with pytest.raises(mac_report.UserError, match="different cases"):
        mac_report.bench_rows(a, b)
