"""bench/sanitizer_logs.py: compute-sanitizer logs of MLX's tests made into a page, and the
committed page (docs/results/cuda-sanitizer-runs) as its JSON renders it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results" / "cuda-sanitizer-runs"
logs = load_script("bench/sanitizer_logs.py")

KERNEL = "mlx::core::cu::qmm_sm80_kernel<(int)128, cutlass::half_t>"
# compute-sanitizer's memcheck log: a report's first line, then its indented details.
MEMCHECK = f"""\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at void {KERNEL}(const T2 *, int, bool)+0x2b60
=========     by thread (120,0,0) in block (0,0,0)
=========     Access to 0x2a9a152600 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x2a9a150600 of size 8,192 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cudaGraphLaunch [0x27ff821] in libmlx.so
=========
========= Invalid __global__ read of size 16 bytes
=========     at void {KERNEL}(const T2 *, int, bool)+0x2b60
=========     by thread (121,0,0) in block (0,0,0)
=========     and is 113 bytes after the nearest allocation at 0x2a9a150600 of size 8,192 bytes
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaEventRecord.
=========     Saved host backtrace up to driver entry point at error
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaEventRecord.
=========
========= Error: process didn't terminate successfully
========= Target application returned an error
========= ERROR SUMMARY: 1722 errors
========= ERROR SUMMARY: 1672 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""  # noqa: E501
CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: process didn't terminate successfully
========= Target application returned an error
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""


def test_a_memcheck_log_with_reads_past_an_allocation() -> None:
    got = logs.parse_log(MEMCHECK)
    assert got["summary"] == {"errors": 1722} and got["ended"] is False
    (invalid,) = got["invalid"]
    assert invalid["kernel"] == KERNEL and invalid["count"] == 2
    assert invalid["bytes_past"] == [1, 113] and invalid["allocation_bytes"] == [8192]
    assert got["api_errors"] == {"cudaErrorLaunchFailure on cudaEventRecord": 2}
    # control: a clean run ends on its own with nothing reported
    clean = logs.parse_log(CLEAN)
    assert clean == {"summary": {"errors": 0}, "ended": True, "invalid": [], "api_errors": {}}


def test_racecheck_and_a_run_stopped_from_outside() -> None:
    race = logs.parse_log(RACECHECK)
    assert race["summary"] == {"hazards": 0, "errors": 0, "warnings": 0}
    assert race["ended"] is False  # the program did not end on its own
    stopped = logs.parse_log("========= COMPUTE-SANITIZER\n")
    assert stopped["summary"] is None and stopped["ended"] is False


def test_the_test_commands_output() -> None:
    out = "....\n----\nRan 2 tests in 61.501s\n\nOK\nrc 0 64 s\n"
    assert logs.parse_output(out) == {"ran": 2, "seconds": 61.501, "verdict": "OK", "rc": 0}
    failed = "Ran 1 test in 268.393s\n\nFAILED (errors=244)\nterminate called\nrc 6 269 s\n"
    assert logs.parse_output(failed)["verdict"] == "FAILED (errors=244)"
    assert logs.parse_output(failed)["rc"] == 6
    # a run's rc line appended to a line the test left unfinished
    assert logs.parse_output("test_x (T.test_x) ... rc 9 104 s\n")["rc"] == 9
    assert logs.parse_output("FFFrc 124 390 s\n")["rc"] == 124


def test_page_and_refusals(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text(MEMCHECK)
    (tmp_path / "a.out").write_text("Ran 1 test in 2.0s\n\nFAILED (errors=3)\nrc 6 3 s\n")
    (tmp_path / "b.log").write_text(CLEAN)
    runs = [["memcheck, A", str(tmp_path / "a.log"), str(tmp_path / "a.out")],
            ["memcheck, B", str(tmp_path / "b.log")]]  # fmt: skip
    data = logs.record("T", "GPU X", runs, "python3 bench/sanitizer_logs.py page ...", ["cmd"])
    text = logs.page(data)
    assert "| memcheck, A | 1722 errors | 2 x Invalid __global__ read of size 16 bytes in " in text
    assert "1-113 bytes after an allocation of 8,192 bytes | 2 | no | 1 in 2.0 s, FAILED" in text
    assert "| memcheck, B | 0 errors | none | 0 | yes | not kept |" in text
    assert "  - `cmd`" in text
    (tmp_path / "c.log").write_text("Traceback (most recent call last):\n")
    with pytest.raises(SystemExit, match="not a compute-sanitizer log"):
        logs.record("T", "G", [["x", str(tmp_path / "c.log")]], "c", [])
    with pytest.raises(SystemExit, match=r"missing\.log"):
        logs.record("T", "G", [["x", str(tmp_path / "missing.log")]], "c", [])


def test_committed_page_is_its_json() -> None:
    """The page is what ``page`` makes of its JSON; an edited record renders otherwise."""
    if not PAGE.with_suffix(".json").exists():
        pytest.skip("no sanitizer page committed")
    data = json.loads(PAGE.with_suffix(".json").read_text())
    text = PAGE.with_suffix(".md").read_text()
    assert logs.page(data) == text
    data["runs"][0]["summary"] = {"errors": 5}
    assert logs.page(data) != text  # control
