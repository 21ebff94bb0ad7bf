"""bench/cuda_compile_cost.py and patchkit.verify.harness.cuda_compile: what the patched
``qmv.cu`` adds to MLX's library (device code per architecture) and build time, and its
page in docs/results."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from support_git import mlx_clone
from support_scripts import load_script

from patchkit.carry import mlx_build, pin
from patchkit.verify.harness import cuda_compile

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results" / "cuda-compile-cost"

# readelf -S -W's layout: [Nr] Name Type Address Off Size ES Flg Lk Inf Al.
READELF = """\
There are 5 section headers, starting at offset 0x1f0:

Section Headers:
  [Nr] Name              Type            Address          Off    Size   ES Flg Lk Inf Al
  [ 0]                   NULL            0000000000000000 000000 000000 00      0   0  0
  [ 1] .text             PROGBITS        0000000000000000 000040 0001a0 00  AX  0   0 16
  [ 2] .nv_fatbin        PROGBITS        0000000000000000 000200 01b650 00   A  0   0  8
  [ 3] .nvFatBinSegment  PROGBITS        0000000000000000 01b850 000018 00  WA  0   0  8
"""


def _arm(seconds: float, fatbin: int | None) -> dict:
    return {"seconds": seconds, "object_bytes": (fatbin or 0) + 4096, "fatbin_bytes": fatbin}


def _record(rows: list[dict]) -> dict:
    meta = {"command": "python3 bench/cuda_compile_cost.py run --out X", "name": "X",
            "mlx_commit": "9a795735ad9a42664e08f42361b405ed570bcf1a",
            "build_inputs_sha256": "ab" * 32, "shipped_archs": [r["arch"] for r in rows],
            "host": {"cpu": "Some CPU", "cpus": 2, "nvcc": "Build cuda_13.0"}}  # fmt: skip
    return cuda_compile.record(rows, meta)


def test_section_bytes_reads_readelf() -> None:
    assert cuda_compile.section_bytes(READELF) == 0x1B650
    assert cuda_compile.section_bytes(READELF, ".text") == 0x1A0
    # control: an object without device code has no such section
    assert cuda_compile.section_bytes(READELF.replace(".nv_fatbin", ".data")) is None


def test_wheel_archs_and_the_object_command() -> None:
    setup = '    cuda_archs = [\n        "75-real",\n        "120-virtual",\n    ]\n' + (
        '    cuda_archs += ["90a-real"]\n    args += [f"-DMLX_CUDA_ARCHITECTURES={x}"]\n'
    )
    assert cuda_compile.wheel_archs(setup) == ["75-real", "120-virtual", "90a-real"]
    cmd = cuda_compile.object_command(["-DX"], Path("q.cu"), "120-virtual", Path("q.o"))
    assert cmd == ["nvcc", "-DX", "-gencode", "arch=compute_120,code=sm_120", "-c", "q.cu",
                   "-o", "q.o"]  # fmt: skip


def test_compile_pair_runs_both_arms_at_once_and_keeps_a_failure() -> None:
    """Both arms start before either is waited on (their times overlap), and a failing
    compile's return code and log come back for the caller to stop on."""
    py = sys.executable
    ran = cuda_compile.compile_pair({
        "stock": [py, "-c", "import time; time.sleep(0.6)"],
        "patched": [py, "-c", "import sys, time; time.sleep(0.6); print('bad'); sys.exit(3)"],
    })  # fmt: skip
    assert ran["stock"]["returncode"] == 0 and ran["patched"]["returncode"] == 3
    assert "bad" in ran["patched"]["log"]
    assert ran["patched"]["seconds"] < 1.1  # sequential would take 1.2 s and more


def test_page_from_a_synthetic_record() -> None:
    rows = [
        {"arch": "75-real", "stock": _arm(50.0, 100 * 1024), "patched": _arm(55.0, 110 * 1024)},
        {"arch": "90a-real", "stock": _arm(40.0, 2 << 20), "patched": _arm(80.0, 6 << 20)},
        {"arch": "120-virtual", "stock": _arm(30.0, None), "patched": _arm(30.0, None)},
    ]
    data = _record(rows)
    assert data["totals"]["stock"]["seconds"] == 120.0
    assert data["totals"]["patched"]["fatbin_bytes"] == 110 * 1024 + (6 << 20)
    text = cuda_compile.page(data)
    assert "| 90a-real | 2.00 | 6.00 | 3.00x | 40.0 | 80.0 | 2.00x |" in text
    assert "| 75-real | 0.10 | 0.11 | 1.10x | 50.0 | 55.0 | 1.10x |" in text
    assert "| 120-virtual | n/a | n/a | n/a | 30.0 | 30.0 | 1.00x |" in text
    assert "| all 3 |" in text and "takes 45.0 s more" in text
    assert "build inputs sha256 `abababababababab`" in text
    assert "Some CPU, 2 CPUs; Build cuda_13.0" in text


def test_committed_page_is_its_json_of_what_the_cuda_build_compiles_now() -> None:
    """The page is what ``page`` makes of its JSON (an edited page fails), and it measured
    the patch as a cuda build compiles it now (a CUDA edit makes it stale, as every CUDA
    page); it compiled every architecture MLX's wheels ship."""
    if not PAGE.with_suffix(".json").exists():
        pytest.skip("no compile-cost page committed")
    data = json.loads(PAGE.with_suffix(".json").read_text())
    text = PAGE.with_suffix(".md").read_text()
    assert cuda_compile.page(data) == text
    edited = json.loads(json.dumps(data))
    edited["rows"][0]["patched"]["seconds"] += 1
    assert cuda_compile.page(edited) != text  # control
    short = pin.load(ROOT / pin.PIN_FILE).short
    assert data["build_inputs_sha256"] == mlx_build.build_inputs_id(ROOT, short, "cuda"), (
        "cuda-compile-cost.json measured another patch: rerun bench/cuda_compile_cost.py run"
    )
    assert [r["arch"] for r in data["rows"]] == data["shipped_archs"]


def test_page_command_prints_the_page_and_refuses_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = load_script("bench/cuda_compile_cost.py")
    path = tmp_path / "x.json"
    path.write_text(json.dumps(_record([{"arch": "75-real", "stock": _arm(1.0, 10),
                                         "patched": _arm(2.0, 20)}])))  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["cuda_compile_cost.py", "page", str(path)])
    assert script.main() == 0
    assert "| 75-real |" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setattr(sys, "argv", ["cuda_compile_cost.py", "page", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit, match=r"bad\.json"):
        script.main()


@pytest.mark.wide
@pytest.mark.clone
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.skipif(mlx_clone() is None, reason="needs an MLX clone: set PATCHKIT_MLX_REPO")
def test_run_for_one_architecture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run --arch 75-real`` end to end: both arms compile, the patched file carries device
    code of its own, and the page and JSON are written where asked."""
    monkeypatch.setenv("PATCHKIT_MLX_REPO", str(mlx_clone()))
    script = load_script("bench/cuda_compile_cost.py")
    script.run(tmp_path / "cost", ["75-real"], Path(os.environ["PATCHKIT_TEST_USER_DEPS"]))
    data = json.loads((tmp_path / "cost.json").read_text())
    (row,) = data["rows"]
    assert row["stock"]["fatbin_bytes"] and row["patched"]["fatbin_bytes"]
    assert row["patched"]["fatbin_bytes"] != row["stock"]["fatbin_bytes"]
    assert (tmp_path / "cost.md").read_text() == cuda_compile.page(data)
