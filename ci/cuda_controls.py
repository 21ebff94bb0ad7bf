"""Controls for the CUDA checks: the patched qmv with a defect switched in, which the checks
must see. On a GPU host, after ``patchkit build --backend cuda`` of this checkout.

  python3 ci/cuda_controls.py --out DIR [BUILD OPTIONS ...]   # e.g. --offline -j 16
  python3 ci/cuda_controls.py --report DIR/cuda-controls.json  # verdicts and page again

A parity or test verdict of 0 differing rows is worth only as much as a defect it would
have caught. This script copies the checkout's tracked files to a temporary folder, applies
``ci/controls/cuda-qmv.diff`` to the kernel template there (a run-time switch,
``PATCHKIT_CONTROL``, off by default), and runs ``patchkit apply`` and ``patchkit build
--backend cuda --no-test`` from that copy: the same cached worktree, so only ``qmv.cu``
recompiles. Then, on that build, ``python -m patchkit.verify.mlx_parity`` (the default route)
and the PR's test ``test_qmv_tensor_cores_match_single_vector`` run once per switch:

- ``none``: the control build as shipped: 0 rows differ, the test passes;
- ``split-launch``: the vectors' two halves in two launches, the second without graph
  dependencies on the inputs or the output (the defect an earlier CUDA PR had): rows must
  differ in the lazy-graph check (parity's plain call differs too where its own slice of
  x and its read of the output are in one graph with the launches: not asserted);
- ``order-by-m``: half the warps over K whenever M > 1, another summation order: rows must
  differ eagerly, and the PR's test must fail.

Then compute-sanitizer (found beside ``nvcc``, on ``PATH``, or ``--sanitizer PATH``)
runs a narrowed parity (:data:`SANITIZER_PARITY`) on the same build under each of its
tools: with no switch, none may report anything in the kernel; with ``no-barrier`` (no
barrier between the warps' partial sums and the reads that add them), racecheck must
report it; with ``uninit-read`` (the kernel reads device memory never written),
initcheck must report it. A run that must report the kernel is stopped once its log
names it (a racy kernel slows racecheck, which logs hazards until its time limit).
memcheck, racecheck and synccheck check that kernel alone (``--kernel-name kns=``), so a
clean run's error summary counts the kernel's reports, printed or not (a tool prints the
first 100). initcheck checks every kernel: a kernel it does not instrument writes memory
it does not see written, so a run filtered to ours reports each operand another kernel
produced (the quantized weights, the vectors' cast) as read uninitialized. It prints
every report (``--print-limit 0``, without host backtraces): its log must hold as many
as its summary counts, and none may name the kernel; MLX's own kernels' reports are
counted, not judged. The tools run at the same time, each in its own process.

``DIR/cuda-controls.{json,md}`` hold the result; the exit status is 0 when every control
came out as it must. Afterwards the checkout's own patch is applied again, and the build
holds the control until ``patchkit build`` runs again (an incremental rebuild).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from patchkit.carry import mlx_build, pin  # noqa: E402
from patchkit.errors import UserError  # noqa: E402
from patchkit.util import proc, split_unittest  # noqa: E402

CONTROL_DIFF = ROOT / "ci" / "controls" / "cuda-qmv.diff"
PR_TEST = "test_quantized.TestQuantized.test_qmv_tensor_cores_match_single_vector"
SWITCHES = ("none", "split-launch", "order-by-m")
# What each switch must show: (eager rows differ, lazy-graph-only rows differ, test fails).
EXPECTED = {
    "none": (False, False, False),
    # Where else a race shows (parity's plain call, the PR's test) is not asserted.
    "split-launch": (None, True, None),
    "order-by-m": (True, None, True),
}
# compute-sanitizer: the tools each switch runs under, and whether the kernel must be
# reported (False: by none of them).
SANITIZER_SWITCHES = {
    "none": (("memcheck", "racecheck", "synccheck", "initcheck"), False),
    "no-barrier": (("racecheck",), True),
    "uninit-read": (("initcheck",), True),
}
# The parity each tool runs: bfloat16 at 4 and 8 bits already launches every shape of the
# kernel (tails in N and K, 8 and 4 warps over K, batched and broadcast weights); more
# dtypes and modes add time under the tools, not code paths.
SANITIZER_PARITY = ("--dtype", "bfloat16", "--bits", "4", "--bits", "8")
KERNEL = "qmv_mma_kernel"
# How each tool is told what to check. memcheck, racecheck and synccheck check that kernel
# alone, found by a substring of its mangled name (a run so filtered has "kernel_only" in
# its result). initcheck checks every kernel, as it must to see who wrote an operand, and
# prints every report with its device frames (a kernel's name is on them where the report
# is in a function it calls) but not its host backtrace.
SANITIZER_FILTER = ("--kernel-name", f"kns={KERNEL}")
SANITIZER_PRINT_ALL = ("--print-limit", "0", "--show-backtrace", "device")
EVERY_KERNEL_TOOLS = ("initcheck",)
# Lines of a log kept in a run's result, for a run not as it must be (its folder goes).
LOG_HEAD_LINES = 40
# How often a run that must report the kernel has its log read.
SEEN_POLL_S = 5.0
# A report's first line ("========= Invalid __global__ read ...", "========= Error: Race
# reported ..."); its details follow, indented. The last line sums them up.
REPORT_START = re.compile(r"^========= (?!COMPUTE-SANITIZER)\S")
SUMMARY = re.compile(r"^========= \w+ SUMMARY: (\d+)")


def control_sha256() -> str:
    """The control diff's id: a page of controls stands only for the diff it switched in."""
    return hashlib.sha256(CONTROL_DIFF.read_bytes()).hexdigest()


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> int:
    print("+", " ".join(argv), flush=True)
    return subprocess.run(argv, cwd=cwd, env=env, check=False).returncode


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked files (as they are on disk) into ``dest``."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            (dest / source.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / source.relative_to(ROOT))


def control_env(copy: Path, switch: str) -> dict[str, str]:
    """The environment of a run on the control build: the checkout's copy importable, the
    default route (no overlay switch), and ``switch`` set unless it is ``none``."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    env.pop("MLX_CUDA_QMV_EXACT", None)
    if switch != "none":
        env["PATCHKIT_CONTROL"] = switch
    return env


def run_test(layout: mlx_build.Layout, env: dict[str, str]) -> split_unittest.MethodRun:
    """The PR's test on the control build, judged by unittest's own summary and failure
    lines as MLX's test runs are (:mod:`patchkit.util.split_unittest`): not by the exit
    code, which MLX's CUDA backend can turn into an abort after the summary, while the
    process tears down (see :func:`patchkit.verify.mlx_parity.exit_without_teardown`)."""
    argv = [str(layout.python), "-m", "unittest", "-f", PR_TEST]
    print("+", " ".join(argv), flush=True)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=layout.worktree / "python" / "tests", env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)  # fmt: skip
    print(done.stdout, end="", flush=True)
    return split_unittest.MethodRun(
        PR_TEST, done.returncode, time.monotonic() - started, done.stdout.splitlines()
    )


def check(layout: mlx_build.Layout, copy: Path, switch: str, work: Path) -> dict[str, Any]:
    """Parity and the PR's test on the control build with one switch."""
    env = control_env(copy, switch)
    report = work / f"parity-{switch}.json"
    started = time.monotonic()
    code = run([str(layout.python), "-m", "patchkit.verify.mlx_parity", "--patched",
                "--out", str(report)], work, env)  # fmt: skip
    parity = json.loads(report.read_text()) if report.exists() else {}
    by_m = [m for r in parity.get("rows", []) for m in r.get("by_m", [])]
    graph_only = sum(m.get("graph_only_differing", 0) for m in by_m)
    test = run_test(layout, env)
    return {
        "switch": switch,
        "parity_exit": code,
        "rows_compared": parity.get("rows_compared"),
        "rows_differing": parity.get("rows_differing"),
        "graph_only_differing": graph_only,
        "eager_differing": (parity.get("rows_differing") or 0) - graph_only,
        "differing_by_path": parity.get("rows_differing_by_path"),
        "pr_test_failed": test.verdict() != "ok",
        "seconds": round(time.monotonic() - started, 1),
    }


def find_sanitizer(given: str | None) -> str | None:
    """compute-sanitizer: ``given``, else beside ``nvcc``, else on ``PATH``."""
    return proc.cuda_tool("compute-sanitizer", given)


def sanitizer_reports(log: str) -> tuple[int, int, int | None]:
    """(reports naming the kernel, other reports, the summary's count or None when the
    log has no summary: the run did not end) of one compute-sanitizer log."""
    blocks: list[list[str]] = []
    summary = None
    for line in log.splitlines():
        if m := SUMMARY.match(line):
            summary = int(m.group(1))
        elif REPORT_START.match(line):
            blocks.append([line])
        elif blocks and line.startswith("========="):
            blocks[-1].append(line)
    ours = sum(any(KERNEL in ln for ln in b) for b in blocks)
    return ours, len(blocks) - ours, summary


def sanitize(layout: mlx_build.Layout, copy: Path, switch: str, tool: str, work: Path,
             sanitizer: str, timeout: float) -> dict[str, Any]:  # fmt: skip
    """The narrowed parity under one compute-sanitizer tool with one switch."""
    env = control_env(copy, switch)
    log = work / f"sanitizer-{switch}-{tool}.log"
    every_kernel = tool in EVERY_KERNEL_TOOLS
    scope = SANITIZER_PRINT_ALL if every_kernel else SANITIZER_FILTER
    argv = [sanitizer, "--tool", tool, *scope, "--log-file", str(log),
            str(layout.python), "-m", "patchkit.verify.mlx_parity", "--patched", "--out",
            str(work / f"sanitizer-{switch}-{tool}.json"), *SANITIZER_PARITY]  # fmt: skip
    print("+", " ".join(argv), flush=True)
    started = time.monotonic()
    must_see = SANITIZER_SWITCHES[switch][1]
    code, stopped = run_until(argv, work, env, timeout, log if must_see else None)
    text = log.read_text(errors="replace") if log.exists() else ""
    size = log.stat().st_size if log.exists() else 0
    ours, others, summary = sanitizer_reports(text)
    return {"switch": switch, "tool": tool, "exit": code, "summary": summary,
            "kernel_reports": ours, "other_reports": others, "kernel_only": not every_kernel,
            "stopped": stopped, "seconds": round(time.monotonic() - started, 1),
            "log_bytes": size, "log_head": log_head(text)}  # fmt: skip


def run_until(argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
              log: Path | None) -> tuple[int | None, str | None]:  # fmt: skip
    """Run one tool's process (with its own session, so that stopping it stops the
    program under it too) to its end, its time limit, or, where ``log`` is given, the
    first line of that log naming the kernel: a defect the tool must see is shown then,
    and a racy kernel's run otherwise logs hazards until its limit. (exit status or None,
    why it was stopped or None)."""
    child = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return child.wait(timeout=SEEN_POLL_S), None
            except subprocess.TimeoutExpired:
                pass
            seen = log is not None and log.exists() and KERNEL in log.read_text(errors="replace")
            if seen or time.monotonic() >= deadline:
                return None, "kernel reported" if seen else "time limit"
    finally:  # also on Ctrl-C, which its own session does not receive
        if child.returncode is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def log_head(text: str) -> list[str]:
    """The lines of a log worth showing: from the first report naming the kernel where one
    does (a log of every kernel starts with MLX's own), else from the start."""
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if KERNEL in line), None)
    if first is None:
        return lines[:LOG_HEAD_LINES]
    # The report's first line: the nearest report start at or above the kernel's line.
    start = next((i for i in range(first, -1, -1) if REPORT_START.match(lines[i])), first)
    return lines[start : start + LOG_HEAD_LINES]


def sanitizer_verdict(result: dict[str, Any]) -> bool:
    """Whether one tool's run came out as :data:`SANITIZER_SWITCHES` says. A defect the
    tool must see is seen once the log names the kernel (the log is written as the tool
    finds hazards, so a run stopped after that has shown it); a clean run must end, with
    parity holding under the tool and no report naming the kernel among all of them:
    where the tool checked the kernel alone (``kernel_only``), none counted at all,
    printed or not; where it checked every kernel, as many reports in its log as its
    summary counts. A log of the first 100 of more reports rules out nothing."""
    if SANITIZER_SWITCHES[result["switch"]][1]:
        return result["kernel_reports"] > 0
    ended = result["summary"] is not None and result["exit"] is not None
    if result.get("kernel_only"):
        counted = result["summary"] == 0
    else:  # >=: a line such as the target's exit status reads as one more report
        shown = result["kernel_reports"] + result["other_reports"]
        counted = result["summary"] is not None and shown >= result["summary"]
    return ended and result["exit"] == 0 and result["kernel_reports"] == 0 and counted


def judge(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every verdict (each result's and the whole's) taken again from its
    raw counts: the verdicts are a function of what was measured, never stored opinion."""
    for r in record["results"]:
        r["ok"] = verdict(r)
    for r in record.get("sanitizer") or []:
        r["ok"] = sanitizer_verdict(r)
    record["ok"] = all(r["ok"] for r in record["results"] + (record.get("sanitizer") or []))
    return record


def option_values(build_args: list[str], option: str) -> tuple[str, ...]:
    """The values of ``option`` among the build options, in either spelling
    (``--opt=V`` first, then ``--opt V``)."""
    found = [a.split("=", 1)[1] for a in build_args if a.startswith(option + "=")]
    found += [b for a, b in itertools.pairwise(build_args) if a == option]
    return tuple(found)


def cmake_args(build_args: list[str]) -> tuple[str, ...]:
    """The ``--cmake-arg`` values among the build options (they name the build folder)."""
    return option_values(build_args, "--cmake-arg")


def verdict(result: dict[str, Any]) -> bool:
    """Whether one switch came out as :data:`EXPECTED` says."""
    eager, graph, fails = EXPECTED[result["switch"]]
    seen = (result["eager_differing"] > 0, result["graph_only_differing"] > 0,
            result["pr_test_failed"])  # fmt: skip
    return (result["rows_compared"] or 0) > 0 and all(
        want is None or want == got for want, got in zip((eager, graph, fails), seen, strict=True)
    )


def page(record: dict[str, Any]) -> str:
    """The markdown page of one run of this script."""
    words = {True: "yes", False: "no", None: "(not asserted)"}
    lines = [
        "# Controls of the CUDA checks: defects switched into the patched qmv",
        "",
        f"- Patch commit `{record['patch_commit'][:12]}` (series sha256 "
        f"`{record['series_sha256'][:16]}`) with `ci/controls/cuda-qmv.diff` (sha256 "
        f"`{record['control_sha256'][:16]}`), MLX {record['mlx_version']}",
        f"- Machine: {record['machine']}",
        f"- Every control as it must be: **{'yes' if record['ok'] else 'NO'}**",
        *([f"- {record['note']}"] if record.get("note") else []),
        "",
        "| switch | rows compared | differ in the plain call | differ only in the lazy graph "
        "| PR test fails | as it must |",
        "|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        want = EXPECTED[r["switch"]]
        lines.append(
            f"| `{r['switch']}` | {r['rows_compared']} | {r['eager_differing']} (must: "
            f"{words[want[0]]}) | {r['graph_only_differing']} (must: {words[want[1]]}) | "
            f"{words[r['pr_test_failed']]} (must: {words[want[2]]}) | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    lines += ["", *sanitizer_table(record.get("sanitizer") or [])]
    lines += [
        "",
        f"Command: `{record['command']}`. Raw: [cuda-controls.json](cuda-controls.json).",
        "",
    ]
    return "\n".join(lines)


def sanitizer_table(results: list[dict[str, Any]]) -> list[str]:
    """The page's compute-sanitizer section: one row per switch and tool."""
    if not results:
        return ["compute-sanitizer: not run."]
    lines = [
        f"compute-sanitizer on `python -m patchkit.verify.mlx_parity --patched "
        f"{' '.join(SANITIZER_PARITY)}` (every M up to 16 on the kernel), per switch and tool:",
        "",
        "| switch | tool | kernels checked | reports in the kernel | other reports | parity exit "
        "| as it must |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        must = "some" if SANITIZER_SWITCHES[r["switch"]][1] else "none"
        ended = r["exit"]
        if r["summary"] is None or r["exit"] is None:
            seen = r.get("stopped") == "kernel reported"
            why = "once the kernel was reported" if seen else "its time limit"
            ended = f"stopped at {r['seconds']:g} s, {why}"
        lines.append(
            f"| `{r['switch']}` | {r['tool']} | {scope_of(r)} | {r['kernel_reports']} (must: "
            f"{must}) | {r['other_reports']} | {ended} | {'yes' if r['ok'] else 'NO'} |"
        )
    return lines


def scope_of(result: dict[str, Any]) -> str:
    """Which kernels one tool's run checked, and for every kernel, how many of the reports
    its summary counts its log holds."""
    if result.get("kernel_only"):
        return f"`{KERNEL}` alone"
    shown = result["kernel_reports"] + result["other_reports"]
    counted = "no summary" if result["summary"] is None else f"of {result['summary']}"
    return f"every kernel; {shown} reports in the log ({counted})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write cuda-controls.{json,md} here")
    ap.add_argument("--report", type=Path, help="judge a JSON's counts again; its page")
    ap.add_argument("--sanitizer", help="compute-sanitizer (default: beside nvcc, or on PATH)")
    ap.add_argument("--sanitizer-timeout", type=float, default=900.0,
                    help="seconds for each tool's run (default 900)")  # fmt: skip
    args, build_args = ap.parse_known_args(argv)
    if args.report:
        record = judge(json.loads(args.report.read_text()))
        args.report.write_text(json.dumps(record, indent=1) + "\n")
        args.report.with_suffix(".md").write_text(page(record))
        return 0 if record["ok"] else 1
    if args.out is None:
        ap.error("--out DIR is required (or --report JSON)")
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("cuda_controls: compute-sanitizer not found (beside nvcc or on PATH): "
              "pass --sanitizer PATH", file=sys.stderr)  # fmt: skip
        return 2
    short = pin.load(ROOT / pin.PIN_FILE).short
    try:  # the checkout's own patch must be the one applied (and built) now
        base = mlx_build.plan(ROOT, backend="cuda", run_tests=False,
                              cmake_args=cmake_args(build_args))  # fmt: skip
    except UserError as exc:
        print(f"cuda_controls: {exc}", file=sys.stderr)
        return 2
    base_patch = mlx_build.patch_ids(ROOT, short, "cuda")
    py = sys.executable
    restore = [py, "-m", "patchkit", "apply", "--pin", short]
    try:
        with tempfile.TemporaryDirectory(prefix="cuda-controls-") as tmp:
            copy, work = Path(tmp) / "checkout", Path(tmp) / "work"
            copy.mkdir()
            work.mkdir()
            copy_checkout(copy)
            steps = [
                # --directory-less apply in a folder of its own: no enclosing work tree
                (["git", "init", "-q"], copy),
                (["git", "apply", str(CONTROL_DIFF)], copy),
                ([py, "-m", "patchkit", "apply", "--pin", short], copy),
                ([py, "-m", "patchkit", "build", "--backend", "cuda", "--no-test",
                  "--record-dir", str(work), *build_args], copy),
            ]  # fmt: skip
            for step, cwd in steps:
                if run(step, cwd) != 0:
                    print(f"cuda_controls: `{' '.join(step)}` failed", file=sys.stderr)
                    return 2
            build = json.loads((work / "build-cuda.json").read_text())
            layout = base.layout  # the build just made: same pin, backend and CMake args
            results = [check(layout, copy, s, work) for s in SWITCHES]
            # All at once: each its own process on the one GPU, so the stage takes the
            # slowest tool's time, not the sum (each writes only its own log and report).
            runs = [(s, t) for s, (tools, _) in SANITIZER_SWITCHES.items() for t in tools]
            with ThreadPoolExecutor(max_workers=len(runs)) as pool:
                sanitized = list(pool.map(
                    lambda st: sanitize(layout, copy, *st, work, sanitizer,
                                        args.sanitizer_timeout),
                    runs))  # fmt: skip
    finally:  # the checkout's own patch, applied again whatever happened above
        restored = run(restore, ROOT) == 0
        if not restored:
            print("cuda_controls: re-applying this checkout's patch failed; run "
                  f"`patchkit apply --pin {short}`", file=sys.stderr)  # fmt: skip
    if not restored:
        return 2
    for r in sanitized:
        r["ok"] = sanitizer_verdict(r)
        head = r.pop("log_head")  # the run's folder goes away: what the tool said, if wrong
        if not r["ok"]:
            print(f"cuda_controls: {r['switch']} under {r['tool']}, its first lines:\n"
                  + "\n".join(head))  # fmt: skip
    record = {
        "patch_commit": base.patch_commit,
        **base_patch,
        "control_sha256": control_sha256(),
        "mlx_version": build.get("mlx_version"),
        "machine": machine(build),
        "command": "python3 ci/cuda_controls.py --out DIR " + " ".join(build_args),
        "results": results,
        "sanitizer": sanitized,
    }
    judge(record)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda-controls.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "cuda-controls.md").write_text(page(record))
    print(page(record))
    return 0 if record["ok"] else 1


def machine(build: dict[str, Any]) -> str:
    """The build record's machine, in words."""
    m = build.get("machine") or {}
    cpus = f"{m['cpus']} CPUs" if m.get("cpus") else ""
    words = [m.get("system") or platform.system(), m.get("machine") or platform.machine()]
    return ", ".join(filter(None, [" ".join(filter(None, words)), cpus, m.get("gpu")]))


if __name__ == "__main__":
    sys.exit(main())
