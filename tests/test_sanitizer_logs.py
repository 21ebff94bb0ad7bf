"""bench/sanitizer_logs.py: compute-sanitizer logs of MLX's tests made into a page, and the
committed page (docs/results/cuda-sanitizer-runs) as its JSON renders it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support_procs import running
from support_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results" / "cuda-sanitizer-runs"
RACE_PAGE = ROOT / "docs" / "results" / "cuda-qmm-sm80-race"
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
    assert clean == {"summary": {"errors": 0}, "ended": True, "invalid": [], "api_errors": {},
                     "races": []}  # fmt: skip


def test_racecheck_and_a_run_stopped_from_outside() -> None:
    race = logs.parse_log(RACECHECK)
    assert race["summary"] == {"hazards": 0, "errors": 0, "warnings": 0}
    assert race["ended"] is False  # the program did not end on its own
    stopped = logs.parse_log("========= COMPUTE-SANITIZER\n")
    assert stopped["summary"] is None and stopped["ended"] is False


# racecheck's log: a report's first access, then each access it races with.
RACES = f"""\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at void {KERNEL}(const T2 *, int, bool)+0x3200
=========     and Write access at void {KERNEL}(const T2 *, int, bool)+0x55b0 [19968 hazards]
=========     and Write access at void {KERNEL}(const T2 *, int, bool)+0x5630 [19968 hazards]
=========
========= Error: Race reported between Write access at void {KERNEL}(const T2 *, int, bool)+0x3200
=========     and Write access at void {KERNEL}(const T2 *, int, bool)+0x55b0 [16384 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""


def test_races_by_their_two_accesses() -> None:
    got = logs.parse_log(RACES)
    assert got["summary"] == {"hazards": 2, "errors": 2, "warnings": 0} and got["ended"]
    first = {"severity": "Error", "kernel": KERNEL, "access": "Write at +0x3200"}
    assert got["races"] == [
        {**first, "with": "Write at +0x55b0", "reports": 2, "hazards": 19968 + 16384},
        {**first, "with": "Write at +0x5630", "reports": 1, "hazards": 19968},
    ]
    cell = logs._races_cell(got)
    assert cell == (
        f"`{KERNEL}`: Error: Write at +0x3200, in 2 reports, with Write at +0x55b0 (36,352 "
        "hazards) and Write at +0x5630 (19,968 hazards, in 1 of them)"
    )
    # controls: a clean racecheck says none; a memcheck run has no races column of its own
    assert logs.parse_log(RACECHECK)["races"] == []
    assert logs._races_cell(logs.parse_log(RACECHECK)) == "none"
    assert logs._races_cell(logs.parse_log(MEMCHECK)) == "-"
    # a line that is not an access of the open report closes it: no access after it counts
    stray = f"=========     and Write access at void {KERNEL}(int)+0x9999 [5 hazards]\n"
    closed = logs.parse_log(RACES + "========= Target application returned an error\n" + stray)
    assert [r["with"] for r in closed["races"]] == ["Write at +0x55b0", "Write at +0x5630"]
    opened = logs.parse_log(RACES.replace("=========\n", stray, 1))  # control: inside, it counts
    assert "Write at +0x9999" in [r["with"] for r in opened["races"]]


def test_the_test_commands_output() -> None:
    out = "....\n----\nRan 2 tests in 61.501s\n\nOK\nrc 0 64 s\n"
    assert logs.parse_output(out) == {"ran": 2, "seconds": 61.501, "verdict": "OK", "rc": 0}
    failed = "Ran 1 test in 268.393s\n\nFAILED (errors=244)\nterminate called\nrc 6 269 s\n"
    assert logs.parse_output(failed)["verdict"] == "FAILED (errors=244)"
    assert logs.parse_output(failed)["rc"] == 6
    # a run's rc line appended to a line the test left unfinished
    assert logs.parse_output("test_x (T.test_x) ... rc 9 104 s\n")["rc"] == 9
    assert logs.parse_output("FFFrc 124 390 s\n")["rc"] == 124
    # a process ended by a signal, as Popen reports it
    assert logs.parse_output("Ran 1 test\nrc -9 104 s\n")["rc"] == -9
    # an rc line alone, without the run's seconds; not one inside other words
    assert logs.parse_output("Ran 1 test in 3.0s\n\nOK\nrc 0\n")["rc"] == 0
    assert logs.parse_output("Ran 1 test in 3.0s\nsrc 5\n")["rc"] is None


def test_page_and_refusals(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text(MEMCHECK)
    (tmp_path / "a.out").write_text("Ran 1 test in 2.0s\n\nFAILED (errors=3)\nrc 6 3 s\n")
    (tmp_path / "b.log").write_text(CLEAN)
    runs = [["memcheck, A", str(tmp_path / "a.log"), str(tmp_path / "a.out")],
            ["memcheck, B", str(tmp_path / "b.log")]]  # fmt: skip
    data = logs.record("T", "GPU X", runs, "python3 bench/sanitizer_logs.py page ...", ["cmd"])
    text = logs.page(data)
    assert "| memcheck, A | 1722 errors | 2 x Invalid __global__ read of size 16 bytes in " in text
    assert "1-113 bytes after an allocation of 8,192 bytes | - | 2 | no | 1 in 2.0 s, FAI" in text
    assert "| memcheck, B | 0 errors | none | - | 0 | yes | not kept |" in text
    assert "  - `cmd`" in text
    (tmp_path / "c.log").write_text("Traceback (most recent call last):\n")
    with pytest.raises(SystemExit, match="not a compute-sanitizer log"):
        logs.record("T", "G", [["x", str(tmp_path / "c.log")]], "c", [])
    with pytest.raises(SystemExit, match=r"missing\.log"):
        logs.record("T", "G", [["x", str(tmp_path / "missing.log")]], "c", [])


@pytest.mark.parametrize("page", [PAGE, RACE_PAGE], ids=lambda p: p.name)
def test_committed_page_is_its_json(page: Path) -> None:
    """The page is what ``page`` makes of its JSON; an edited record renders otherwise."""
    if not page.with_suffix(".json").exists():
        pytest.skip(f"no {page.name} page committed")
    data = json.loads(page.with_suffix(".json").read_text())
    text = page.with_suffix(".md").read_text()
    assert logs.page(data) == text
    data["runs"][0]["summary"] = {"errors": 5}
    assert logs.page(data) != text  # control


def test_committed_race_page_is_its_log() -> None:
    """The stock racecheck page's run is what its committed log parses to."""
    raw = RACE_PAGE.with_name(RACE_PAGE.name + ".raw.txt")
    if not raw.exists():
        pytest.skip("no stock racecheck log committed")
    (run,) = json.loads(RACE_PAGE.with_suffix(".json").read_text())["runs"]
    parsed = logs.parse_log(raw.read_text())
    assert {k: run[k] for k in parsed} == parsed
    # each report the summary counts as displayed names its first access once
    assert run["races"] and max(r["reports"] for r in run["races"]) <= run["summary"]["hazards"]


# A stand-in for compute-sanitizer: writes the log a run's tool and arm call for
# (FAKE_REPORT names "TOOL:ARM" pairs that report, FAKE_NOLOG pairs that stop before
# writing one, FAKE_SLEEP a Python that hangs, FAKE_PIDS a folder where each Python
# leaves its pid), then runs the test command under it, as the tool does.
FAKE_SANITIZER = """\
#!/usr/bin/env python3
import os, subprocess, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Copyright stand-in\\nVersion 0.0.0"); sys.exit(0)
opts = dict(zip(args[0:8:2], args[1:8:2]))
command = args[8:]
arm = "pr" if command[0].endswith("pr-python") else "stock"
report = f"{opts['--tool']}:{arm}" in os.environ.get("FAKE_REPORT", "").split(",")
if f"{opts['--tool']}:{arm}" in os.environ.get("FAKE_NOLOG", "").split(","):
    print("stand-in: stopped before its log"); sys.exit(3)
with open(opts["--log-file"], "w") as log:
    log.write("========= COMPUTE-SANITIZER\\n")
    if report and opts["--tool"] == "memcheck":
        log.write("========= Invalid __global__ read of size 16 bytes\\n"
                  "=========     at void k<1>(int)+0x10\\n"
                  "=========     and is 1 bytes after the nearest allocation at 0x1 "
                  "of size 64 bytes\\n========= ERROR SUMMARY: 1 error\\n")
    elif opts["--tool"] == "memcheck":
        log.write("========= ERROR SUMMARY: 0 errors\\n")
    else:
        n = 1 if report else 0
        log.write(f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)\\n")
sys.exit(subprocess.run(command).returncode)
"""
FAKE_PYTHON = """\
#!/bin/sh
if [ "$1" = -c ]; then echo "{version}"; exit 0; fi
[ -n "$FAKE_PIDS" ] && echo $$ > "$FAKE_PIDS/$$"
case ",$FAKE_SLEEP," in *,{arm},*) sleep 60;; esac
echo "Ran 2 tests in 0.100s"; echo; echo OK
"""


def _fake_host(tmp_path: Path) -> dict[str, Path]:
    """Executables standing in for the tool and both arms' Pythons, and a tests folder."""
    made = {"sanitizer": tmp_path / "compute-sanitizer", "tests": tmp_path / "tests"}
    made["sanitizer"].write_text(FAKE_SANITIZER)
    for arm, version in (("pr", "0.32.1+patchkit.0123456789ab"), ("stock", "0.32.1")):
        made[arm] = tmp_path / f"{arm}-python"
        made[arm].write_text(FAKE_PYTHON.format(version=version, arm=arm))
    for exe in (made["sanitizer"], made["pr"], made["stock"]):
        exe.chmod(0o755)
    made["tests"].mkdir()
    (made["tests"] / "test_quantized.py").write_text("")
    return made


def _run(
    tmp_path: Path, fake: dict[str, Path], env: dict[str, str], *extra: str
) -> subprocess.CompletedProcess[str]:
    """``run`` with the stand-ins, its page at ``tmp_path``/page and its logs beside it."""
    argv = [sys.executable, str(ROOT / "bench" / "sanitizer_logs.py"), "run",
            "--arm", f"pr={fake['pr']}", "--arm", f"stock={fake['stock']}",
            "--tests", str(fake["tests"]), "--logs", str(tmp_path / "logs"),
            "--out", str(tmp_path / "page"), "--sanitizer", str(fake["sanitizer"]),
            *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env})


def test_run_checks_every_run_and_passes_only_a_clean_build(tmp_path: Path) -> None:
    """``run`` starts each of RUNS under the tool and makes the page of their logs; stock's
    reports are findings (exit 0), the build's make the exit 1 and are named."""
    fake = _fake_host(tmp_path)
    done = _run(tmp_path, fake, {"FAKE_REPORT": "memcheck:stock,racecheck:stock"})
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "page.json").read_text())
    assert [r["label"].split(",")[0] for r in data["runs"]] == [r.tool for r in logs.RUNS]
    by_arm = {"pr": "this build (0.32.1+patchkit.0123456789ab)", "stock": "stock MLX (0.32.1)"}
    for run, got in zip(logs.RUNS, data["runs"], strict=True):
        assert got["label"].endswith(by_arm[run.arm]) and run.kernels in got["label"]
        assert got["output"] == {"ran": 2, "seconds": 0.1, "verdict": "OK", "rc": 0}
        reported = run.arm == "stock"
        assert bool(got["invalid"] or (got["summary"].get("hazards"))) == reported, run
    # the commands as the page shows them: the tool's options, no host's paths
    assert all(str(tmp_path) not in c and c.startswith("compute-sanitizer --tool ")
               for c in data["ran"])  # fmt: skip
    assert any("kns=qmm_sm80" in c and c.endswith("TestQuantized.test_qmm") for c in data["ran"])
    new = [f"TestQuantized.{m}" for m in logs.render.pr_test_methods()]
    assert any(c.endswith(" ".join(new)) and "kns=qmv_mma_kernel" in c for c in data["ran"])
    assert (tmp_path / "page.md").read_text() == logs.page(data)
    # control: the build's racecheck reporting a hazard fails the run, by name
    again = tmp_path / "again"
    again.mkdir()
    bad = _run(again, fake, {"FAKE_REPORT": "racecheck:pr"})
    assert bad.returncode == 1 and "racecheck-new, racecheck-qmm-pr" in bad.stderr


def test_run_stops_a_run_at_its_limit_and_refuses_bad_input(tmp_path: Path) -> None:
    fake = _fake_host(tmp_path)
    done = _run(tmp_path, fake, {"FAKE_SLEEP": "pr"}, "--limit-s", "3")
    assert done.returncode == 1
    data = json.loads((tmp_path / "page.json").read_text())
    for run, got in zip(logs.RUNS, data["runs"], strict=True):
        assert (got["output"]["rc"] == logs.STOPPED) == (run.arm == "pr"), run
    # a folder of logs already used, and an arm missing: one line each, exit 1
    again = _run(tmp_path, fake, {})
    assert again.returncode == 1 and "is not empty" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    one_arm = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sanitizer_logs.py"), "run", "--arm",
         f"pr={fake['pr']}", "--tests", str(fake["tests"]), "--logs", str(tmp_path / "l2"),
         "--out", str(tmp_path / "p2")], capture_output=True, text=True)  # fmt: skip
    assert one_arm.returncode == 1 and "--arm stock=" in one_arm.stderr


def test_run_takes_paths_relative_to_where_it_starts(tmp_path: Path) -> None:
    """The runs start in the tests' folder; an arm, its site, the tests and the logs given
    relative to the caller's folder still name the same files there."""
    _fake_host(tmp_path)
    (tmp_path / "site").mkdir()
    argv = [sys.executable, str(ROOT / "bench" / "sanitizer_logs.py"), "run",
            "--arm", "pr=./pr-python:site", "--arm", "stock=./stock-python",
            "--tests", "tests", "--logs", "logs", "--out", "page",
            "--sanitizer", "./compute-sanitizer"]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == sorted(
        f"{r.name}.log" for r in logs.RUNS
    )
    data = json.loads((tmp_path / "page.json").read_text())
    assert all(r["output"]["rc"] == 0 for r in data["runs"])


def test_run_names_the_build_record_it_ran_and_refuses_another_first(tmp_path: Path) -> None:
    """``--build-record``: the page names the build the PR's arm ran (as every CUDA page
    does); a record of another wheel is refused before any run starts."""
    fake = _fake_host(tmp_path)
    record = tmp_path / "build-cuda.json"
    inputs = {"build_inputs_sha256": "ab" * 32}
    record.write_text(json.dumps({"wheel_version": "0.32.1+patchkit.0123456789ab",
                                  "backend": "cuda", "patch": inputs}))  # fmt: skip
    done = _run(tmp_path, fake, {}, "--build-record", str(record))
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "page.json").read_text())
    assert data["build"] == {"backend": "cuda", "wheel_version": "0.32.1+patchkit.0123456789ab",
                             **inputs}  # fmt: skip
    assert str(tmp_path) not in data["command"] and "--out docs/results/page" in data["command"]
    assert "- The build: MLX 0.32.1+patchkit.0123456789ab" in logs.page(data)
    # control: a record of another build stops the run before it starts
    record.write_text(json.dumps({"wheel_version": "0.32.1+patchkit.other", "patch": inputs}))
    again = tmp_path / "again"
    again.mkdir()
    refused = _run(again, fake, {}, "--build-record", str(record))
    assert refused.returncode == 1 and "--build-record is of MLX 0.32.1+patchkit.other" in (
        refused.stderr
    )
    assert not any((again / "logs").iterdir()) and not (again / "page.json").exists()


def test_jobs_bounds_the_runs_at_once_and_each_limit_counts_from_its_start(
    tmp_path: Path,
) -> None:
    """``--jobs 1``: one run after another, each stopped its own limit after it starts, so
    four runs that hang take four limits; every run still gets its row."""
    fake = _fake_host(tmp_path)
    started = time.monotonic()
    done = _run(tmp_path, fake, {"FAKE_SLEEP": "pr"}, "--limit-s", "1", "--jobs", "1")
    took = time.monotonic() - started
    assert done.returncode == 1
    hung = sum(r.arm == "pr" for r in logs.RUNS)
    assert took >= hung * 1.0
    data = json.loads((tmp_path / "page.json").read_text())
    assert [r["output"]["rc"] == logs.STOPPED for r in data["runs"]] == [
        r.arm == "pr" for r in logs.RUNS
    ]
    bad = _run(tmp_path / "l", fake, {}, "--jobs", "0")
    assert bad.returncode == 1 and bad.stderr.strip() == "run: --jobs 0: give 1 or more"


def test_a_run_without_a_log_gets_its_row_and_fails_the_build(tmp_path: Path) -> None:
    """A tool that stops before writing its log (a refused option, a crash) leaves the
    page whole: its row says so, and the build's run of it fails the run."""
    fake = _fake_host(tmp_path)
    done = _run(tmp_path, fake, {"FAKE_NOLOG": "racecheck:pr,memcheck:stock"})
    assert done.returncode == 1 and "racecheck-new, racecheck-qmm-pr" in done.stderr
    data = json.loads((tmp_path / "page.json").read_text())
    no_log = [r.name for r, got in zip(logs.RUNS, data["runs"], strict=True) if got.get("no_log")]
    assert no_log == ["racecheck-new", "memcheck-qmm-stock", "racecheck-qmm-pr"]
    assert "no log (the tool stopped before writing one)" in logs.page(data)
    # `page`, given logs made elsewhere, still refuses a missing one
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "sanitizer_logs.py"), "page",
                          "--out", str(tmp_path / "p"), "--title", "t", "--hardware", "h",
                          "--run", "x", str(tmp_path / "none.log")],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and "none.log" in bad.stderr


def test_sigterm_ends_run_and_every_run_it_started(tmp_path: Path) -> None:
    """A time limit or a closed terminal (SIGTERM, SIGHUP) ends ``run`` through its
    ``finally``: no tool and no test process outlives it."""
    fake = _fake_host(tmp_path)
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = [sys.executable, str(ROOT / "bench" / "sanitizer_logs.py"), "run",
            "--arm", f"pr={fake['pr']}", "--arm", f"stock={fake['stock']}",
            "--tests", str(fake["tests"]), "--logs", str(tmp_path / "logs"),
            "--out", str(tmp_path / "page"), "--sanitizer", str(fake["sanitizer"])]  # fmt: skip
    env = {**os.environ, "FAKE_SLEEP": "pr,stock", "FAKE_PIDS": str(pids)}
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while len(list(pids.iterdir())) < len(logs.RUNS) and time.monotonic() < deadline:
        time.sleep(0.1)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == len(logs.RUNS)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) != 0

    deadline = time.monotonic() + 15
    while any(map(running, started)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in started if running(pid)]
    for pid in left:  # a failing test leaves nothing running
        os.kill(pid, signal.SIGKILL)
    assert not left
