"""ci/macos.yml cannot run here: check its shape (hosted jobs build, the self-hosted one tests).

MLX's own build_and_test.yml is the model: GitHub-hosted macOS runners have no Metal
device, so they build the cpu/metal/jit toolkits, and a ``[self-hosted, macos]``
runner runs the GPU tests from the uploaded artifacts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support_scripts import load_script

from patchkit.carry import pin

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "ci" / "macos.yml"


def load() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def runs(job: dict) -> list[str]:
    return [s["run"] for s in job["steps"] if "run" in s]


def step(job: dict, name_part: str) -> dict:
    (found,) = [s for s in job["steps"] if name_part in s.get("name", "")]
    return found


def test_three_jobs_chained_export_build_gpu() -> None:
    wf = load()
    assert list(wf["jobs"]) == ["export", "build", "gpu"]
    assert wf["jobs"]["build"]["needs"] == "export"
    assert wf["jobs"]["gpu"]["needs"] == "build"
    # PyYAML reads the bare key `on` as True (YAML 1.1); GitHub reads it as "on".
    assert "workflow_dispatch" in wf[True]
    assert wf["permissions"] == {"contents": "read"}


def test_hosted_runners_only_build_and_the_gpu_job_is_self_hosted() -> None:
    jobs = load()["jobs"]
    assert jobs["export"]["runs-on"].startswith("ubuntu-")
    assert jobs["build"]["runs-on"].startswith("macos-")
    assert jobs["gpu"]["runs-on"] == ["self-hosted", "macos"]
    # Nothing that needs a Metal device runs on a hosted runner.
    for name in ("export", "build"):
        for cmd in runs(jobs[name]):
            for gpu_only in ("patchkit parity", "patchkit bench", "unittest", "_bench.py"):
                assert gpu_only not in cmd, (name, cmd)


def test_export_job_makes_the_pr_patch_with_mlx_formatter_pins() -> None:
    job = load()["jobs"]["export"]
    (cmd,) = [c for c in runs(job) if c.startswith("patchkit export-pr")]
    assert "--install-formatters" in cmd and "--out pr" in cmd
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload"))
    assert upload["with"]["name"] == "pr"


def test_build_matrix_is_metal_and_jit_on_mlx_targets_plus_stock_metal() -> None:
    job = load()["jobs"]["build"]
    matrix = job["strategy"]["matrix"]
    assert matrix["toolkit"] == ["metal", "jit"]
    assert matrix["macos-target"] == ["14.0", "15.0", "26.2"]  # MLX's mac_build targets
    assert matrix["include"] == [{"tree": "stock", "toolkit": "metal", "macos-target": "14.0"}]
    assert job["strategy"]["fail-fast"] is False
    cmake = job["env"]["CMAKE_ARGS"]
    assert "-DMLX_BUILD_METAL=ON" in cmake and "-DCMAKE_COMPILE_WARNING_AS_ERROR=ON" in cmake
    # MLX_METAL_JIT only for the jit toolkit (the metal build is the AOT Metal compile).
    assert "matrix.toolkit == 'jit' && '" in cmake and "-DMLX_METAL_JIT=ON" in cmake
    assert cmake.index("matrix.toolkit == 'jit'") < cmake.index("-DMLX_METAL_JIT=ON")


def test_build_applies_the_patch_only_to_the_patched_tree_and_uploads_wheel_and_metallib() -> None:
    job = load()["jobs"]["build"]
    am = step(job, "Apply the PR patch")
    assert am["if"] == "matrix.tree == 'patched'" and "am" in am["run"]
    build = step(job, "Build the wheel")
    assert build["working-directory"] == "mlx" and "python -m build -w" in build["run"]
    size = step(job, "metallib")["run"]
    assert "mlx.metallib" in size and "metallib-bytes.txt" in size
    upload = job["steps"][-1]
    assert upload["uses"].startswith("actions/upload-artifact")
    assert upload["with"]["if-no-files-found"] == "error"
    assert "${{ matrix.tree }}-${{ matrix.toolkit }}" in upload["with"]["name"]


def test_pinned_commit_matches_pin_toml() -> None:
    wf = load()
    assert wf["env"]["PIN"] == pin.load(ROOT / pin.PIN_FILE).commit
    clone = "\n".join(runs(wf["jobs"]["build"]))
    assert 'checkout --detach "$PIN"' in clone


def test_gpu_job_gates_on_patched_rows_and_records_stock() -> None:
    job = load()["jobs"]["gpu"]
    assert job["strategy"]["matrix"]["toolkit"] == ["metal", "jit"]
    downloads = [
        s["with"]["name"] for s in job["steps"] if "download-artifact" in s.get("uses", "")
    ]
    assert downloads == ["mlx-patched-${{ matrix.toolkit }}-macos14.0", "mlx-stock-metal-macos14.0"]
    patched = step(job, "Parity of the patched build")
    assert (
        "continue-on-error" not in patched and "venv-patched/bin/patchkit parity" in patched["run"]
    )
    stock = step(job, "Stock parity")
    assert stock["continue-on-error"] is True and "venv-stock/" in stock["run"]
    tests = step(job, "MLX's test_quantized.py")
    assert "continue-on-error" not in tests and "unittest -v test_quantized" in tests["run"]
    before = step(job, "on the stock wheel")
    assert before["continue-on-error"] is True
    assert "test_qmv_small_batch_matches_single_vector" in before["run"]
    # Benchmarks run even after a failure, and any differing row fails the job.
    for name in ("patchkit bench", "The PR's benchmark", "No differing row"):
        assert step(job, name)["if"] == "always()"
    assert "--json" in step(job, "The PR's benchmark")["run"]
    gate = step(job, "No differing row")["run"]
    assert gate.startswith("python3 ci/no_differing_rows.py") and "pr-bench.json" in gate
    assert (ROOT / "ci" / "no_differing_rows.py").is_file()


def _gate():
    return load_script("ci/no_differing_rows.py")


@pytest.mark.parametrize(
    ("report", "code"),
    [
        ({"rows": [{"streamed": {"2": {"rows_differing": 0, "t": 1.0}}}]}, 0),
        ({"rows": [{"streamed": {"2": {"rows_differing": 3, "t": None}}}]}, 1),
        ({"results": [{"rows_match": True, "stock_rows_match": False}]}, 0),  # stock may differ
        ({"results": [{"rows_match": False, "stock_rows_match": False}]}, 1),
    ],
)
def test_differing_row_gate(tmp_path: Path, report: dict, code: int) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    assert _gate().main([str(path)]) == code
    assert _gate().main([str(tmp_path / "absent.json")]) == 1
