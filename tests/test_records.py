"""The committed build records describe the patch as ``patchkit apply`` writes it now.

A record (``docs/results/build-<backend>.json``) names what its build compiled of the
patch series by a sha256 (``mlx_build.build_inputs_id``: the series' and the overlay's
files that backend's build compiles) and the PR tests it ran by another. When either
changes, the record is of another patch and must be rebuilt (``patchkit build --backend
<backend>``), not kept; an edit its build never compiles (a Metal kernel, for CUDA)
leaves it valid (decision 0008). Controls: one byte changed in a compiled file's diff or
in an overlay file gives another id; a Metal edit changes Metal's id and not CUDA's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from support_scripts import load_script

from patchkit.carry import mlx_build, pin

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
# Build records, and the side-by-side run of MLX's tests on a build (bench/mlx_tests.py).
RECORDS = sorted([*RESULTS.glob("build-*.json"), *RESULTS.glob("*-tests.json")])
SHORT = pin.load(ROOT / pin.PIN_FILE).short


@pytest.mark.parametrize("record", RECORDS, ids=[r.stem for r in RECORDS])
def test_record_is_of_the_current_patch_series(record: Path) -> None:
    rec = json.loads(record.read_text())
    assert rec["patch"]["series"] == f"patches/{SHORT}"
    assert rec["patch"].get("build_inputs_sha256") == mlx_build.build_inputs_id(
        ROOT, SHORT, rec["backend"]
    ), (
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


def test_cuda_tests_page_compares_the_committed_cuda_build() -> None:
    """``cuda-tests.json`` takes its PR arm from a build's own test run (its log or its
    record): that build is the one ``build-cuda.json`` records, not an earlier one."""
    tests, build = RESULTS / "cuda-tests.json", RESULTS / "build-cuda.json"
    if not tests.exists() or not build.exists():
        pytest.skip("no CUDA tests page or build record committed")
    rec, built = json.loads(tests.read_text()), json.loads(build.read_text())
    if not (rec.get("patched_log") or rec.get("patched_record")):
        pytest.skip("cuda-tests.json ran the PR's arm itself")
    assert rec["mlx"]["pr"] == built["mlx_version"], (
        "cuda-tests.json compared another build than build-cuda.json records: rerun "
        "ci/cuda_records.py (--only tests for the committed build record)"
    )


def _copy_patches(tmp_path: Path) -> Path:
    copy = tmp_path / "patches" / SHORT
    shutil.copytree(ROOT / "patches" / SHORT, copy)
    return copy


def _ids(root: Path) -> dict[str, str]:
    return {b: mlx_build.build_inputs_id(root, SHORT, b) for b in mlx_build.BACKENDS}


def _edit_line(patch: Path, path_prefix: str) -> None:
    """Change one added line of the first file diff under ``path_prefix`` in ``patch``."""
    lines = patch.read_text().splitlines(keepends=True)
    start = next(i for i, s in enumerate(lines) if s.startswith(f"diff --git a/{path_prefix}"))
    added = next(i for i in range(start, len(lines)) if lines[i].startswith("+ "))
    lines[added] = lines[added].rstrip("\n") + " \n"
    patch.write_text("".join(lines))


def test_build_inputs_change_with_what_each_backend_compiles(tmp_path: Path) -> None:
    copy = _copy_patches(tmp_path)
    before = _ids(tmp_path)
    assert before == _ids(ROOT)  # control: a copy has the same ids
    assert len(set(before.values())) == 3
    patches = sorted(copy.glob("*.patch"))
    metal = next(p for p in patches if "diff --git a/mlx/backend/metal/" in p.read_text())
    _edit_line(metal, "mlx/backend/metal/")
    metal_edit = _ids(tmp_path)
    assert metal_edit["metal"] != before["metal"]
    assert metal_edit["cuda"] == before["cuda"] and metal_edit["cpu"] == before["cpu"]
    cuda = next(p for p in patches if "diff --git a/mlx/backend/cuda/" in p.read_text())
    _edit_line(cuda, "mlx/backend/cuda/")
    cuda_edit = _ids(tmp_path)
    assert cuda_edit["cuda"] != metal_edit["cuda"] and cuda_edit["metal"] == metal_edit["metal"]
    # a commit message is not compiled
    first = patches[0]
    first.write_text(first.read_text().replace("Subject: ", "Subject: x", 1))
    assert _ids(tmp_path) == cuda_edit
    # the overlay's files are built as well
    overlay = next(p for p in (copy / "overlay").rglob("*") if p.is_file() and "cuda" in p.parts)
    overlay.write_bytes(overlay.read_bytes() + b" ")
    assert _ids(tmp_path)["cuda"] != cuda_edit["cuda"]


def test_a_changed_pr_test_has_another_id(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    before = mlx_build.pr_files_id(tmp_path)
    assert before == mlx_build.pr_files_id(ROOT)  # control: a copy has the same id
    test = next((tmp_path / "templates" / "python").rglob("*.j2"))
    test.write_text(test.read_text() + "\n")
    assert mlx_build.pr_files_id(tmp_path) != before


def page_and_current_cuda_build(name: str) -> tuple[dict, dict]:
    """A committed CUDA results page (``docs/results/<name>.json``) and the CUDA build
    record, which must be of what a CUDA build compiles of ``patches/`` now; skips where
    either is not committed. Each page's test then holds the page to that build."""
    page, build = RESULTS / f"{name}.json", RESULTS / "build-cuda.json"
    if not page.exists() or not build.exists():
        pytest.skip(f"no {page.name} or CUDA build record committed")
    built = json.loads(build.read_text())
    assert built["patch"]["build_inputs_sha256"] == mlx_build.build_inputs_id(
        ROOT, SHORT, "cuda"
    ), "build-cuda.json is of other CUDA inputs: rebuild with `patchkit build --backend cuda`"
    return json.loads(page.read_text()), built


@pytest.mark.parametrize(
    ("name", "calls"), [("cuda", "chained"), ("cuda-independent", "independent")]
)
def test_speed_page_is_of_what_the_cuda_build_compiles_now(name: str, calls: str) -> None:
    """``docs/results/cuda.json`` and ``cuda-independent.json`` (bench/mlx_qmv.py page,
    each call waiting for the one before and calls MLX's graph may overlap) timed, in every
    run, a build of what a CUDA build compiles of ``patches/`` now, the same inputs as the
    CUDA build record's: a CUDA edit leaves the old speeds stale, a Metal one does not
    (decision 0008)."""
    page, built = page_and_current_cuda_build(name)
    timed = page["build"]
    assert page["runs"] and {r["mlx"]["pr"] for r in page["runs"]} == {timed["wheel_version"]}
    assert {r.get("calls") for r in page["runs"]} == {calls}
    assert timed["build_inputs_sha256"] == built["patch"]["build_inputs_sha256"], (
        "cuda.json timed a build of other CUDA inputs: rerun bench/mlx_qmv.py on a new build"
    )


def test_ncu_page_is_of_what_the_cuda_build_compiles_now() -> None:
    """``docs/results/cuda-ncu.json`` (bench/mlx_ncu.py page) profiled a build of what a
    CUDA build compiles of ``patches/`` now, as the speed page timed one."""
    page, built = page_and_current_cuda_build("cuda-ncu")
    assert page["mlx"]["pr"] == page["build"]["wheel_version"]
    assert not [row for row in page["rows"] if "error" in row]
    assert page["build"]["build_inputs_sha256"] == built["patch"]["build_inputs_sha256"], (
        "cuda-ncu.json profiled a build of other CUDA inputs: rerun bench/mlx_ncu.py"
    )


def test_kernel_stock_page_is_of_what_the_cuda_build_compiles_now() -> None:
    """``docs/results/cuda-kernel-stock.json`` (bench/cuda_qmv.py run, the kernel alone
    beside stock's) is where ``docs/cuda.md`` takes M = 1's error against float32 from, so
    its libraries must be of what a CUDA build compiles of ``patches/`` now."""
    page = json.loads((RESULTS / "cuda-kernel-stock.json").read_text())
    assert page["results"] and "stopped_at" not in page
    assert page["build"]["build_inputs_sha256"] == mlx_build.build_inputs_id(ROOT, SHORT, "cuda"), (
        "cuda-kernel-stock.json ran libraries of other CUDA inputs: rerun bench/cuda_qmv.py run"
    )


def test_controls_page_is_of_the_recorded_cuda_build_and_control() -> None:
    """``docs/results/cuda-controls.json`` (ci/cuda_controls.py) switched its defects into
    the patch the CUDA build record is of, with the control diff as it is now, and every
    control came out as it must."""
    rec, built = page_and_current_cuda_build("cuda-controls")
    assert rec.get("build_inputs_sha256") == built["patch"]["build_inputs_sha256"], (
        "cuda-controls.json is of another patch: rerun ci/cuda_controls.py"
    )
    diff = ROOT / "ci" / "controls" / "cuda-qmv.diff"
    assert rec["control_sha256"] == hashlib.sha256(diff.read_bytes()).hexdigest(), (
        "the control diff changed since cuda-controls.json: rerun ci/cuda_controls.py"
    )
    # The page's verdicts, and those the script's rules give its counts today (judge
    # rewrites verdicts in place, so it gets a copy).
    judged = load_script("ci/cuda_controls.py").judge(copy.deepcopy(rec))
    assert rec["ok"] and judged["ok"], "cuda-controls.json: not every control as it must be"
    assert {r["switch"] for r in rec["results"]} == {
        "none", "split-launch", "order-by-m",
    }  # fmt: skip
    # compute-sanitizer's tools ran clean with no switch, racecheck saw the race and
    # initcheck the read of memory never written.
    assert {(r["switch"], r["tool"]) for r in rec.get("sanitizer") or []} == {
        ("none", "memcheck"), ("none", "racecheck"), ("none", "synccheck"),
        ("none", "initcheck"), ("no-barrier", "racecheck"), ("uninit-read", "initcheck"),
    }, "cuda-controls.json has no compute-sanitizer runs: rerun ci/cuda_controls.py"  # fmt: skip


def test_qmm_sm90_probe_page_probed_the_committed_cuda_build() -> None:
    """``docs/results/qmm-sm90-probe.json`` (bench/qmm_sm90_probe.py page) puts stock's
    wheels beside a build of the series: that build is the one ``build-cuda.json``
    records, so a CUDA edit leaves the page's build arm stale, as it does every CUDA page."""
    probe, built = page_and_current_cuda_build("qmm-sm90-probe")
    versions = [run["mlx"] for run in probe["runs"]]
    assert [v for v in versions if "+patchkit." in v] == [built["wheel_version"]], (
        "qmm-sm90-probe.json probed another build than build-cuda.json records: rerun "
        "bench/qmm_sm90_probe.py on the new build"
    )
    assert [v for v in versions if "+" not in v], "qmm-sm90-probe.json has no stock arm"


def test_sanitizer_tests_page_ran_the_committed_cuda_build() -> None:
    """``docs/results/cuda-sanitizer-runs.json`` (bench/sanitizer_logs.py) names in each
    run's label the MLX it imported: a build's must be the one ``build-cuda.json`` records,
    so a CUDA edit leaves the page stale, as it does every CUDA page."""
    page, built = page_and_current_cuda_build("cuda-sanitizer-runs")
    labels = [run["label"] for run in page["runs"]]
    named = {v for label in labels for v in re.findall(r"\d[\w.]*\+patchkit\.\w+", label)}
    assert named == {built["wheel_version"]}, (
        "cuda-sanitizer-runs.json ran another build than build-cuda.json records: rerun "
        "its commands on the new build"
    )
    # made by `bench/sanitizer_logs.py run`, it names the PR's tests it ran
    if "pr_files_sha256" in page:
        assert page["pr_files_sha256"] == mlx_build.pr_files_id(ROOT), (
            "cuda-sanitizer-runs.json ran other PR tests than templates/ renders now: rerun "
            "ci/cuda_records.py --only sanitizer"
        )
