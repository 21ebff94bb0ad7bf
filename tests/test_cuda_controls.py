"""ci/cuda_controls.py: the defects it switches into the CUDA kernel, and how it judges them.

The controls run on a GPU host; here, that the control diff still applies to the kernel
template (and only there: the shipped template has no switch), and that the verdict
rejects a control the checks did not see.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support_procs import ends_within, running
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
    switches = [*controls.SWITCHES, *controls.SANITIZER_SWITCHES]
    assert all(f'"{s}"' in diff for s in switches if s != "none")
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
    assert "compute-sanitizer: not run." in text
    tools = [{**_tool("none", 0), "ok": True}, {**_tool("no-barrier", 0), "ok": False}]
    text = controls.page({**record, "sanitizer": tools})
    row = "| `no-barrier` | racecheck | every kernel; 0 reports in the log (of 0) |"
    assert row + " 0 (must: some) | 0 | 0 | NO |" in text
    assert "Every control as it must be: **NO**" in text
    assert "| `split-launch` | 100 | 0 (must: (not asserted)) | 0 (must: yes) |" in text


def test_the_build_folder_follows_the_cmake_args_given() -> None:
    args = ["--offline", "--cmake-arg=-DA=1", "-j", "16", "--cmake-arg", "-DB=2"]
    assert _controls().cmake_args(args) == ("-DA=1", "-DB=2")
    assert _controls().cmake_args(["--offline"]) == ()


MEMCHECK_LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at void qmv_mma_kernel<1, 8, 4, 2, 64, true>(const T1 *)+0x1b0 in qmv.cu:190
=========     by thread (3,0,0) in block (7,0,0)
=========
========= Program hit cudaErrorInvalidValue (error 1) on CUDA API call to cudaFree.
=========     Host Frame: [0x1234] in libmlx.so
=========
========= ERROR SUMMARY: 2 errors
"""
RACECHECK_LOG = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at void qmv_mma_kernel<1, 8>(...)+0x9a0
=========     and Read access at void qmv_mma_kernel<1, 8>(...)+0xa40 [2048 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_sanitizer_logs_are_read_per_report_and_kernel() -> None:
    controls = _controls()
    assert controls.sanitizer_reports(MEMCHECK_LOG) == (1, 1, 2)
    assert controls.sanitizer_reports(RACECHECK_LOG) == (1, 0, 1)
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    assert controls.sanitizer_reports(clean) == (0, 0, 0)  # the banner is no report
    assert controls.sanitizer_reports("========= COMPUTE-SANITIZER\n")[2] is None  # cut off


def _tool(switch: str, ours: int, summary: int | None = 0, code: int | None = 0) -> dict:
    return {"switch": switch, "tool": "racecheck", "exit": code, "summary": summary,
            "kernel_reports": ours, "other_reports": 0}  # fmt: skip


@pytest.mark.parametrize(
    ("result", "ok"),
    [
        (_tool("none", 0), True),
        (_tool("none", 2, 2), False),  # the kernel reported with no switch
        (_tool("none", 0, None), False),  # no summary: the run did not end
        (_tool("none", 0, 0, None), False),  # timed out
        (_tool("none", 0, 0, 1), False),  # rows differed under the tool
        (_tool("no-barrier", 3, 3, 1), True),  # the race seen (its rows may differ)
        (_tool("no-barrier", 3, None, None), True),  # seen, then cut at the time limit
        (_tool("no-barrier", 0, 0), False),  # a race racecheck missed
        (_tool("no-barrier", 0, None, None), False),  # cut before it saw anything
        # The tool checked the kernel alone: its summary counts the kernel's reports, the
        # printed ones (the first 100) and the rest, so a count with none printed fails.
        ({**_tool("none", 0, 5000), "kernel_only": True}, False),
        ({**_tool("none", 0, 0), "kernel_only": True}, True),
        # Every kernel checked: none of the reports may name the kernel, and all of them
        # must be in the log, not the first 100 of 106013.
        ({**_tool("none", 0, 106013), "other_reports": 100}, False),
        ({**_tool("none", 0, 106013), "other_reports": 106013}, True),
        ({**_tool("none", 1, 106013), "other_reports": 106012}, False),
        # A read of memory never written: initcheck must name the kernel.
        ({**_tool("uninit-read", 40, 90), "tool": "initcheck", "other_reports": 50}, True),
        ({**_tool("uninit-read", 0, 50), "tool": "initcheck", "other_reports": 50}, False),
    ],
)
def test_a_sanitizer_run_that_missed_or_reported_wrongly_is_not_ok(result: dict, ok: bool) -> None:
    assert _controls().sanitizer_verdict(result) is ok


def test_report_judges_the_stored_counts_again(tmp_path) -> None:
    """``--report`` takes every verdict from the raw counts, whatever the file says."""
    controls = _controls()
    result = {"switch": "order-by-m", "rows_compared": 10, "eager_differing": 3,
              "graph_only_differing": 0, "pr_test_failed": True, "ok": False}  # fmt: skip
    record = {"patch_commit": "0" * 40, "series_sha256": "1" * 64, "control_sha256": "2" * 64,
              "mlx_version": "0.0", "machine": "m", "command": "c", "results": [result],
              "sanitizer": [{**_tool("no-barrier", 100, None, None), "seconds": 900.0,
                             "ok": False}], "ok": False}  # fmt: skip
    path = tmp_path / "cuda-controls.json"
    path.write_text(json.dumps(record))
    assert controls.main(["--report", str(path)]) == 0
    judged = json.loads(path.read_text())
    assert judged["ok"] and judged["results"][0]["ok"] and judged["sanitizer"][0]["ok"]
    assert "stopped at 900 s, its time limit" in path.with_suffix(".md").read_text()
    record["sanitizer"][0]["kernel_reports"] = 0  # control: the same file, the race unseen
    path.write_text(json.dumps({**record, "ok": True}))
    assert controls.main(["--report", str(path)]) == 1
    assert not json.loads(path.read_text())["ok"]


def test_no_sanitizer_is_a_one_line_error(monkeypatch, capsys) -> None:
    controls = _controls()
    monkeypatch.setattr(controls.proc.shutil, "which", lambda name: None)
    assert controls.find_sanitizer(None) is None
    assert controls.main(["--out", "x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_each_sanitizer_run_checks_what_its_summary_can_vouch_for(tmp_path: Path) -> None:
    """memcheck is told to check the new kernel alone, so the summary it ends with counts
    that kernel's reports (control: a summary of reports none printed fails it). initcheck
    checks every kernel (filtered, it reports operands other kernels wrote as read
    uninitialized) and prints every report, so a report naming the kernel shows in its log
    (controls: one that does fails it, and so does a log with fewer reports than its
    summary counts)."""
    controls = _controls()
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(
        "#!/bin/sh\n"
        'printf "%s\\n" "$@" > "$(dirname "$0")/argv"\n'
        'while [ "$1" != "--log-file" ]; do shift; done\n'
        '{ echo "========= COMPUTE-SANITIZER"; cat "$(dirname "$0")/reports"\n'
        '  printf "========= ERROR SUMMARY: %s errors\\n" "$(cat "$(dirname "$0")/count")"\n'
        '} > "$2"\n'
    )
    fake.chmod(0o755)

    class Layout:
        python = Path("python3")

    def run(tool: str, reports: str, count: str) -> tuple[list[str], dict]:
        (tmp_path / "reports").write_text(reports)
        (tmp_path / "count").write_text(count)
        result = controls.sanitize(Layout(), tmp_path, "none", tool, tmp_path, str(fake), 60)
        return (tmp_path / "argv").read_text().split(), result

    for count, ok in (("0", True), ("7", False)):
        argv, result = run("memcheck", "", count)
        assert argv[argv.index("--kernel-name") + 1] == "kns=qmv_mma_kernel"
        assert result["kernel_only"] and result["summary"] == int(count)
        assert controls.sanitizer_verdict(result) is ok

    head = "========= Uninitialized __global__ memory read of size 2 bytes\n=========     at "
    other, ours = head + "copy_v\n", head + "qmv_mma_kernel<1>\n"
    for reports, count, ok in ((other * 3, "3", True), (other * 2 + ours, "3", False),
                               (other * 2, "3", False)):  # fmt: skip
        argv, result = run("initcheck", reports, count)
        assert "--kernel-name" not in argv
        assert argv[argv.index("--print-limit") + 1] == "0"
        assert not result["kernel_only"] and result["log_bytes"] > 0
        assert controls.sanitizer_verdict(result) is ok
        # What a failed run shows starts at the kernel's report, past MLX's own.
        want = ours.splitlines() if ours in reports else ["========= COMPUTE-SANITIZER"]
        assert result["log_head"][: len(want)] == want


def test_a_run_that_must_report_the_kernel_stops_once_it_has(tmp_path: Path) -> None:
    """A racy kernel's racecheck logs hazards until its time limit, so a run that must
    report the kernel is stopped, with the program under it, once its log names it
    (control: a clean run's log naming nothing runs on to its limit)."""
    controls = _controls()
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(
        "#!/bin/sh\n"
        'while [ "$1" != "--log-file" ]; do shift; done\n'
        'cat "$(dirname "$0")/reports" > "$2"\n'
        'sleep 600 & echo $! > "$(dirname "$0")/pid"; wait\n'
    )
    fake.chmod(0o755)

    class Layout:
        python = Path("python3")

    report = (
        "========= Error: Race reported between Write access\n=========     at qmv_mma_kernel\n"
    )
    for switch, reports, stopped in (("no-barrier", report, "kernel reported"),
                                     ("none", "", "time limit")):  # fmt: skip
        (tmp_path / "reports").write_text(reports)
        result = controls.sanitize(Layout(), tmp_path, switch, "racecheck", tmp_path,
                                   str(fake), 3)  # fmt: skip
        assert result["stopped"] == stopped and result["exit"] is None
        assert controls.sanitizer_verdict(result) is (switch == "no-barrier")
        # SIGKILL to its group is delivered, not awaited: the sleeper ends promptly.
        assert ends_within(int((tmp_path / "pid").read_text()))
    assert result["seconds"] >= 3
    result["ok"] = False
    assert "its time limit" in "\n".join(controls.sanitizer_table([result]))


def test_an_interrupted_run_leaves_no_tool_running(tmp_path: Path, monkeypatch) -> None:
    """A tool runs in its own session, which Ctrl-C at the terminal does not reach: an
    interrupted wait stops it and the program under it (control: the sleeper it started
    was running when the interrupt came)."""
    controls = _controls()
    monkeypatch.setattr(controls, "SEEN_POLL_S", 0.2)
    tool = tmp_path / "tool"
    tool.write_text('#!/bin/sh\nsleep 600 & echo $! > "$(dirname "$0")/pid"; wait\n')
    tool.chmod(0o755)
    pid = tmp_path / "pid"

    class Interrupting(type(tmp_path)):  # the first read of the log is interrupted
        def exists(self, *args, **kwargs) -> bool:
            while not pid.exists() or not pid.read_text().strip():
                time.sleep(0.05)
            assert running(int(pid.read_text()))
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        controls.run_until([str(tool)], tmp_path, dict(os.environ), 60, Interrupting(tmp_path))
    assert ends_within(int(pid.read_text()))


_PR_TEST_FILE = """
import atexit, os, unittest

class TestQuantized(unittest.TestCase):
    def test_qmv_tensor_cores_match_single_vector(self):
        self.assertEqual({value}, 1)

atexit.register(os.abort)  # a teardown that aborts after unittest's summary
"""


@pytest.mark.parametrize(("value", "failed"), [(1, False), (2, True)])
def test_the_pr_test_is_judged_by_its_summary_not_an_abort_at_teardown(
    tmp_path: Path, value: int, failed: bool
) -> None:
    """MLX's CUDA backend can abort while a process tears down, after unittest's summary:
    a passing PR test must still read as passing, and a failing one as failing."""
    import sys
    from types import SimpleNamespace

    tests = tmp_path / "python" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_quantized.py").write_text(_PR_TEST_FILE.format(value=value))
    layout = SimpleNamespace(python=Path(sys.executable), worktree=tmp_path)
    run = _controls().run_test(layout, {"PATH": "/usr/bin:/bin"})
    assert run.returncode < 0  # the abort: an exit-code verdict would call both failed
    assert (run.verdict() != "ok") is failed
