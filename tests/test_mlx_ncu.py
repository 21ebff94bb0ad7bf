"""bench/mlx_ncu.py without a GPU: ncu's CSV, the page of a synthetic run, the cases."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from support_scripts import load_script

NCU = load_script("bench/mlx_ncu.py")
MLX_QMV = load_script("bench/mlx_qmv.py")

SAMPLE = "\n".join(
    [
        "==PROF== Connected to process 1234 (/usr/bin/python3)",
        "==WARNING== Profiling is disabled at start.",
        '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum",'
        '"launch__block_size","launch__grid_size"',
        '"","","nsecond","byte","",""',
        '"0","void qmv_kernel<4, 64>(const unsigned char*)","12,345","1,048,576","256","1,792"',
        "==PROF== Disconnected from process 1234",
    ]
)


def test_parse_csv_skips_ncu_lines_and_units_and_strips_separators() -> None:
    kernels = NCU.parse_csv(SAMPLE)
    assert len(kernels) == 1
    k = kernels[0]
    assert k["name"] == "void qmv_kernel<4, 64>(const unsigned char*)"
    assert k["gpu__time_duration.sum"] == 12345.0
    assert k["dram__bytes_read.sum"] == 1048576.0
    assert k["launch__block_size"] == 256.0
    assert k["launch__grid_size"] == 1792.0
    assert k["launch__registers_per_thread"] is None  # not in the sample


def test_parse_csv_without_table_is_empty() -> None:
    assert NCU.parse_csv("==PROF== nothing profiled\n") == []


def _kernel(name: str, ns: float, read: float) -> dict:
    k = dict.fromkeys(NCU.METRICS, 1.0)
    k.update({"name": name, "gpu__time_duration.sum": ns, "dram__bytes_read.sum": read})
    k.update({"launch__registers_per_thread": 40.0, "launch__block_size": 128.0})
    k.update({"launch__grid_size": 3584.0, "sm__maximum_warps_per_active_cycle_pct": 75.0})
    k["sm__warps_active.avg.pct_of_peak_sustained_active"] = 61.5
    k["dram__throughput.avg.pct_of_peak_sustained_elapsed"] = 88.2
    return k


def test_page_writes_a_table_row_per_kernel_and_errors(tmp_path: Path) -> None:
    case = {"K": 4096, "N": 14336, "bits": 4, "M": 1, "dtype": "bfloat16", "group": 64}
    kernels = [_kernel("void mlx::core::cu::qmv_fast<bf16, 4>(int)", 20_000.0, 60_000_000.0)]
    rows = [
        {"arm": "pr", "case": case, "kernels": kernels, **NCU.derived(case, kernels)},
        {"arm": "stock", "case": {**case, "M": 16}, "error": "==ERROR== boom\nfailed"},
    ]
    run = {"command": "python3 bench/mlx_ncu.py run --quick", "hardware": {"gpu": "H100"},
           "ncu_version": "Version 2025.1", "rows": rows}  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    NCU.page(json.loads(path.read_text()), tmp_path / "out" / "cuda-ncu")
    md = (tmp_path / "out" / "cuda-ncu.md").read_text()
    assert json.loads((tmp_path / "out" / "cuda-ncu.json").read_text()) == run
    assert "## pr" in md and "## stock" in md and "Version 2025.1" in md
    assert "- Inputs: affine quantization, bfloat16 group 64;" in md  # what every case ran
    row = "| 4096x14336 | 4 | 1 | void mlx::core::cu::qmv_fast | 20.0 | 3000 | 88.2 | 1.82 | 40 | 128 | 3584 | 75.0 | 61.5 |  |"  # noqa: E501
    assert row in md
    assert "| 4096x14336 | 4 | 16 |" in md and "==ERROR== boom failed |" in md
    assert rows[0]["read_gb_s"] == 3000.0
    assert rows[0]["read_over_needed"] == 60_000_000.0 / rows[0]["bytes"]
    assert rows[0]["bytes"] == 4096 * 14336 // 2 + 2 * 4096 * 14336 // 64 * 2 + 4096 * 2


def test_cases_have_the_documented_sizes() -> None:
    quick = NCU.cases(quick=True)
    assert len(quick) == 2
    assert {(c["K"], c["N"], c["bits"], c["M"]) for c in quick} == {
        (4096, 14336, 4, 1),
        (4096, 14336, 4, 16),
    }
    full = NCU.cases(quick=False)
    assert len(full) == len(MLX_QMV.SHAPES) * 2 * 3
    # the speed page's layers, so a cell the speed page names can be looked at here
    assert {(c["K"], c["N"]) for c in full} == set(MLX_QMV.SHAPES)
    assert {c["M"] for c in full} == {1, 8, 16} and {c["bits"] for c in full} == {4, 8}
    assert all(c["dtype"] == "bfloat16" and c["group"] == 64 for c in full)


def test_ncu_case_profiles_one_call_of_the_named_library(tmp_path: Path) -> None:
    """The ncu command line a case gets (a stand-in ncu records it and prints a table),
    and a failing ncu kept as the row's error, not the run's end."""
    args = tmp_path / "args"
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args}\ncat <<'X'\n{SAMPLE}\nX\n")
    fake.chmod(0o755)
    case = {"K": 4096, "N": 14336, "bits": 4, "M": 1, "dtype": "bfloat16", "group": 64}
    row = NCU.ncu_case(str(fake), "python3", "", "/libs/patched.so", case)
    assert row["kernels"][0]["gpu__time_duration.sum"] == 12345.0
    assert row["main_kernel"].startswith("void qmv_kernel")
    argv = args.read_text().split()
    assert argv[argv.index("--profile-from-start") + 1] == "off"
    assert argv[argv.index("--lib") + 1] == "/libs/patched.so"
    assert "worker" in argv and "--cache-control" in argv
    fake.write_text("#!/bin/sh\necho '==ERROR== no device' >&2\nexit 3\n")
    failed = NCU.ncu_case(str(fake), "python3", "", None, case)
    assert "kernels" not in failed and "no device" in failed["error"]


def _build_record(wheel: str = "0.32.1+patchkit.abc") -> dict:
    return {"backend": "cuda", "wheel_version": wheel,
            "patch": {"build_inputs_sha256": "c" * 64}}  # fmt: skip


def _run(rows: list[dict], pr: str = "0.32.1+patchkit.abc") -> dict:
    return {"command": "python3 bench/mlx_ncu.py run", "hardware": {"gpu": "H100"},
            "ncu_version": "Version 2025.3", "mlx": {"pr": pr, "stock": "0.32.1"},
            "rows": rows}  # fmt: skip


def test_a_page_with_its_build_record_holds_for_those_build_inputs(tmp_path: Path) -> None:
    case = {"K": 4096, "N": 4096, "bits": 8, "M": 8, "dtype": "bfloat16", "group": 64}
    kernels = [_kernel("void qmv_mma_kernel<1>(int)", 10_000.0, 18_000_000.0)]
    run = _run([{"arm": "pr", "case": case, "kernels": kernels, **NCU.derived(case, kernels)}])
    build = NCU.profiled_build(run, _build_record())
    assert build == {"backend": "cuda", "wheel_version": "0.32.1+patchkit.abc",
                     "build_inputs_sha256": "c" * 64}  # fmt: skip
    NCU.page(run, tmp_path / "cuda-ncu", build)
    assert json.loads((tmp_path / "cuda-ncu.json").read_text())["build"] == build
    md = (tmp_path / "cuda-ncu.md").read_text()
    assert "build inputs sha256 `cccccccccccccccc`" in md and "H100; ncu Version 2025.3" in md


def test_a_page_shows_one_hosts_paths_as_placeholders(tmp_path: Path) -> None:
    run = {**_run([]), "command": "python3 bench/mlx_ncu.py run --arm pr=/root/v/bin/python "
           "--arm stock=python3:/tmp/stock --lib old=/x/old.so --json /tmp/r/ncu.json "
           "--ncu /usr/local/cuda/bin/ncu --quick --dtype float16"}  # fmt: skip
    NCU.page(run, tmp_path / "cuda-ncu")
    shown = (
        "python3 bench/mlx_ncu.py run --arm pr=<cache>/builds/cuda-<pin>/venv/bin/python "
        "--arm stock=STOCK_PYTHON[:SITE] --lib old=LIBS/old.so --json ncu.json --ncu NCU --quick "
        "--dtype float16"
    )
    assert f"- Command: `{shown}`" in (tmp_path / "cuda-ncu.md").read_text()
    assert json.loads((tmp_path / "cuda-ncu.json").read_text())["command"] == shown
    assert NCU.generic_command(shown) == shown  # a page made again shows the same
    assert NCU.generic_command(run["command"]) != run["command"]  # control: paths replaced


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (_run([], pr="0.32.1+patchkit.other"), "the runs timed 0.32.1+patchkit.other"),
        (
            _run([{"arm": "stock", "case": {}, "error": "==ERROR== no kernel\n"}]),
            "1 of 1 cases have no readings (first: ==ERROR== no kernel)",
        ),
        ({**_run([]), "mlx": {"stock": "0.32.1"}}, "the run has no arm named pr"),
    ],
)
def test_a_page_refuses_a_build_record_its_run_does_not_match(run: dict, message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        NCU.profiled_build(run, _build_record())


def test_ncu_is_found_beside_nvcc_first(tmp_path: Path, monkeypatch) -> None:
    toolkit, elsewhere = tmp_path / "cuda" / "bin", tmp_path / "bin"
    for folder, names in ((toolkit, ("nvcc", "ncu")), (elsewhere, ("ncu",))):
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_text("#!/bin/sh\n")
            (folder / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{elsewhere}{os.pathsep}{toolkit}")
    assert NCU.find_ncu(None) == str(toolkit / "ncu")
    (toolkit / "ncu").unlink()  # control: none beside nvcc, the one on PATH
    assert NCU.find_ncu(None) == str(elsewhere / "ncu")
    with pytest.raises(SystemExit, match=r"no Nsight Compute .*: pass --ncu PATH"):
        NCU.find_ncu(str(tmp_path / "missing-ncu"))
