"""MLX's tests run one process per test on the GPU host, summed into the build record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support_scripts import load_script

from patchkit.carry import mlx_build


def _module():
    return load_script("scripts/cuda_tests_record.py")


def _log(path: Path, body: list[str]) -> None:
    path.write_text("\n".join(body) + "\n")


def test_logs_become_the_records_tests(tmp_path: Path) -> None:
    """Per test, the last batch that ran it to the end counts; a stopped one does not; a test
    with 12 failing subtests is one failed test; the markdown names what did not finish."""
    tr = _module()
    name = "test_quantized.TestQuantized.{}".format
    names = tmp_path / "names"
    names.write_text("\n".join(name(t) for t in ("test_a", "test_b", "test_c", "test_d")))
    _log(tmp_path / f"test-first-{name('test_a')}.log", ["test_a ... ok", "Ran 1 test in 1s", "OK"])
    _log(tmp_path / f"test-first-{name('test_b')}.log", ["test_b ... "])  # stopped
    _log(
        tmp_path / f"test-again-{name('test_b')}.log",
        [*(f"FAIL: test_b ({name('test_b')}) (i={i})" for i in range(12)),
         "Ran 1 test in 9s", "FAILED (failures=12)"],
    )  # fmt: skip
    _log(  # never finished, two subtests failed on the way
        tmp_path / f"test-again-{name('test_c')}.log",
        ["test_c (x) (k=1) ... ok", "test_c (x) (k=2) ... FAIL", "test_c (x) (k=3) ... FAIL"],
    )
    record = tmp_path / "cuda-x.json"
    rec = {
        "backend": "cuda", "date": "x", "mlx_commit": "0" * 40, "mlx_version": "v",
        "patch": {"commit": "1" * 40, "series": "patches/0", "series_sha256": "2" * 64},
        "compiled": "c", "tests": None, "wall_s": {}, "command": "c",
        "machine": {"system": "L", "machine": "m", "cpus": 1, "python": "3"},
        "parity": {"rows": 1, "rows_differing": 0, "configs": 1, "kernel_paths": ["qmv"]},
    }  # fmt: skip
    record.write_text(json.dumps(rec))
    assert tr.main([str(record), str(names), str(tmp_path)]) == 0
    t = json.loads(record.read_text())["tests"]
    assert (t["ran"], t["passed"], t["failed"], t["errors"]) == (2, 1, 1, 0)
    assert t["failures_reported"] == 12
    assert t["per_test"] == {"test_a": "passed", "test_b": "failed"}
    assert t["unfinished"] == ["test_c", "test_d"]
    assert t["unfinished_failing"] == {
        "test_c": ["test_c (x) (k=2) ... FAIL", "test_c (x) (k=3) ... FAIL"]
    }
    md = record.with_suffix(".md").read_text()
    assert (
        "1 passed, 1 failed, 0 errors, 0 skipped (of 2); 2 not run to the end: "
        "test_c (2 subtests failing before it stopped), test_d." in md
    )
    assert mlx_build.tests_line(None).endswith("not run (`--no-test`).")


def test_bad_arguments_are_one_line() -> None:
    tr = _module()
    with pytest.raises(SystemExit, match=r"^usage: "):
        tr.main([])
    with pytest.raises(SystemExit, match=r"no build record at /nonexistent\.json$"):
        tr.main(["/nonexistent.json", "names", "."])


def test_a_failure_is_read_against_the_same_test_on_stock(tmp_path: Path) -> None:
    """A test that also ran on the stock wheel gets stock's verdict and whether stock failed
    the very same subtests; a different failing subtest on stock is not called the same."""
    tr = _module()
    name = "test_quantized.TestQuantized.{}".format

    def failing(test: str, params: list[str]) -> list[str]:
        return [*(f"FAIL: {test} ({name(test)}) ({p})" for p in params),
                "Ran 1 test in 1s", f"FAILED (failures={len(params)})"]  # fmt: skip

    for test, patched, stock in (
        ("test_same", ["k=64", "k=128"], ["k=128", "k=64"]),
        ("test_other", ["k=64"], ["k=256"]),  # the control
    ):
        _log(tmp_path / f"test-first-{name(test)}.log", failing(test, patched))
        _log(tmp_path / f"test-stock-{name(test)}.log", failing(test, stock))
    _log(tmp_path / f"test-first-{name('test_ok')}.log", ["Ran 1 test in 1s", "OK"])
    _log(tmp_path / f"test-stock-{name('test_ok')}.log", ["test_ok ... "])  # stopped on stock
    per = tr.on_stock([name(t) for t in ("test_same", "test_other", "test_ok")], tmp_path,
                      ["first", "again"])["per_test"]  # fmt: skip
    assert set(per) == {"test_same", "test_other"}
    assert per["test_same"] == {
        "stock": "failed", "patched": "failed", "failing_subtests_stock": 2,
        "failing_subtests_patched": 2, "same_failing_subtests": True,
    }  # fmt: skip
    assert per["test_other"]["same_failing_subtests"] is False
    line = mlx_build.tests_line({
        "file": "f", "passed": 0, "failed": 2, "errors": 0, "skipped": 0, "ran": 2,
        "on_stock": {"per_test": per},
    })  # fmt: skip
    assert "test_same failed, 2 failing subtests, the same as the patched build's" in line
    assert "test_other failed, 1 failing subtests (patched: failed, 1 failing subtests)" in line
