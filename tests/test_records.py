"""The committed build records describe the patch as ``patchkit apply`` writes it now.

A record (``docs/results/build-<backend>.json``) names the patch series it was built from
by its sha256; when the templates change and ``patches/`` with them, the record is of
another patch and must be rebuilt (``patchkit build --backend <backend>``), not kept.
Control: a series with one byte changed has another id.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from patchkit.carry import mlx_build, pin

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
# Build records, and the side-by-side run of MLX's tests on a build (bench/mlx_tests.py).
RECORDS = sorted([*RESULTS.glob("build-*.json"), *RESULTS.glob("*-tests.json")])


@pytest.mark.parametrize("record", RECORDS, ids=[r.stem for r in RECORDS])
def test_record_is_of_the_current_patch_series(record: Path) -> None:
    rec = json.loads(record.read_text())
    short = pin.load(ROOT / pin.PIN_FILE).short
    assert rec["patch"]["series"] == f"patches/{short}"
    assert rec["patch"]["series_sha256"] == mlx_build.series_id(ROOT, short), (
        f"{record.name} is of another patch: rebuild it with "
        f"`patchkit build --backend {rec['backend']}`"
    )
    # and the tests it ran (a build's, or both arms' of bench/mlx_tests.py) are the PR's
    # tests as they render now
    if rec.get("tests") is not None or rec.get("arms") is not None:
        assert rec["patch"].get("pr_files_sha256") == mlx_build.pr_files_id(ROOT), (
            f"{record.name} ran other PR tests than templates/ renders now: rebuild it with "
            f"`patchkit build --backend {rec['backend']}`"
        )


def test_a_changed_series_has_another_id(tmp_path: Path) -> None:
    short = pin.load(ROOT / pin.PIN_FILE).short
    copy = tmp_path / "patches" / short
    shutil.copytree(ROOT / "patches" / short, copy)
    before = mlx_build.series_id(tmp_path, short)
    first = sorted(copy.glob("*.patch"))[0]
    first.write_bytes(first.read_bytes() + b" ")
    assert mlx_build.series_id(tmp_path, short) != before


def test_a_changed_pr_test_has_another_id(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    before = mlx_build.pr_files_id(tmp_path)
    assert before == mlx_build.pr_files_id(ROOT)  # control: a copy has the same id
    test = next((tmp_path / "templates" / "python").rglob("*.j2"))
    test.write_text(test.read_text() + "\n")
    assert mlx_build.pr_files_id(tmp_path) != before


def test_speed_page_is_of_the_recorded_cuda_build() -> None:
    """``docs/results/cuda.json`` (bench/mlx_qmv.py page) timed the MLX the CUDA build
    record names, in every run: a rebuilt record leaves the old speeds stale."""
    speed, build = RESULTS / "cuda.json", RESULTS / "build-cuda.json"
    if not speed.exists() or not build.exists():
        pytest.skip("no CUDA speed page or build record committed")
    wheel = json.loads(build.read_text())["wheel_version"]
    runs = json.loads(speed.read_text())["runs"]
    assert runs and {r["mlx"]["pr"] for r in runs} == {wheel}, (
        f"cuda.json timed another build than {wheel}: rerun bench/mlx_qmv.py on it"
    )


def test_controls_page_is_of_the_recorded_cuda_build_and_control() -> None:
    """``docs/results/cuda-controls.json`` (ci/cuda_controls.py) switched its defects into
    the patch the CUDA build record is of, with the control diff as it is now, and every
    control came out as it must."""
    controls, build = RESULTS / "cuda-controls.json", RESULTS / "build-cuda.json"
    if not controls.exists() or not build.exists():
        pytest.skip("no CUDA controls page or build record committed")
    rec, built = json.loads(controls.read_text()), json.loads(build.read_text())
    assert (
        rec["series_sha256"]
        == built["patch"]["series_sha256"]
        == mlx_build.series_id(ROOT, pin.load(ROOT / pin.PIN_FILE).short)
    ), "cuda-controls.json is of another patch: rerun ci/cuda_controls.py"
    assert rec["patch_commit"].startswith(built["patch"]["commit"][:12])
    diff = ROOT / "ci" / "controls" / "cuda-qmv.diff"
    assert rec["control_sha256"] == hashlib.sha256(diff.read_bytes()).hexdigest(), (
        "the control diff changed since cuda-controls.json: rerun ci/cuda_controls.py"
    )
    assert rec["ok"] and {r["switch"] for r in rec["results"]} == {
        "none", "split-launch", "order-by-m",
    }  # fmt: skip
