"""compute-sanitizer on MLX's own tests, its logs made into one results page.

    python3 bench/sanitizer_logs.py run --arm pr=PYTHON[:SITE] --arm stock=PYTHON[:SITE] \
        --tests DIR --logs DIR --out docs/results/cuda-sanitizer-runs [--limit-s 1200]
    python3 bench/sanitizer_logs.py page --out docs/results/cuda-sanitizer-runs \
        --hardware GPU --run LABEL LOG [TEST_OUTPUT] --run ...

``run`` makes the page's runs (:data:`RUNS`; all at once, or ``--jobs`` at a time), each a
compute-sanitizer process over one unittest command in DIR (MLX's ``python/tests`` with the
PR's tests: ``bench/mlx_tests.py pr-tests``), checking only the kernels the run names
(``--kernel-name``), with its own JIT cache and a time limit; then the page. It exits 1
where a run of the PR's arm reported an error or a hazard or did not end on its own (the
page says which), 0 where none did: stock's arm runs to show what main does, so its reports
are findings, not failures. ``page`` makes the page from logs made otherwise.

Each run is one compute-sanitizer process over a test command, as its ``--log-file``
wrote it (LOG) and, optionally, what the test command printed (TEST_OUTPUT: unittest's
"Ran N tests" line and verdict, and a last ``rc N`` line where the run recorded its exit).
LABEL says what ran: the tool, the kernels it checked (``--kernel-name``), the test and
the MLX it imported. The page counts, per run:

- the tool's summary (``ERROR SUMMARY``, ``RACECHECK SUMMARY``), or none where the process
  was stopped before compute-sanitizer wrote one;
- each invalid access by kernel instance, with how far past its allocation it reached;
- the CUDA API errors that follow a kernel memcheck stopped (the context is lost then, so
  every later call fails: they are the first report's consequence, not more defects);
- whether the program under the tool ended on its own.

A report is counted where compute-sanitizer printed it (``--print-limit``); the summary
counts them all.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # patchkit, from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_qmv import hardware, mlx_of, timed_build

from patchkit.carry import mlx_build, render
from patchkit.util import proc, sanitizer

ROOT = Path(__file__).resolve().parent.parent

HEAD = re.compile(r"^========= (\S.*)$")
KERNEL = re.compile(r"^=========\s+at (?:void )?(\S+?<.*?>)\(")
PAST = re.compile(
    r"and is (\d+) bytes (after|before) the nearest allocation at \S+ of size ([\d,]+) bytes"
)
ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?$")
HAZARDS = re.compile(
    r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)"
)
API = re.compile(r"^Program hit (\w+) .* on CUDA API call to (\w+)\.$")
FAILED = "Error: process didn't terminate successfully"
RAN = re.compile(r"^Ran (\d+) tests? in ([\d.]+)s$")
VERDICT = re.compile(r"^(OK|FAILED)\b.*$")
# The run's own last line, "rc EXIT SECONDS s" (``run``'s), or a line "rc EXIT" alone.
RC = re.compile(r"rc (-?\d+) \d+ s$|^rc (-?\d+)$")
# racecheck's report: one access, then each access it races with and their hazard count.
RACE = re.compile(r"^========= (Error|Warning): Race reported between (\w+) access at "
                  r"(?:void )?(\S+?<.*?>)\(.*\)\+(0x[0-9a-f]+)$")  # fmt: skip
RACE_WITH = re.compile(r"^=========\s+and (\w+) access at (?:void )?(\S+?<.*?>)\(.*\)"
                       r"\+(0x[0-9a-f]+) \[(\d+) hazards?\]$")  # fmt: skip
TEST_FILE = "test_quantized.py"
PRINT_LIMIT = 50  # reports printed per run; the summary counts every one
STOPPED = 124  # a run's exit where its time limit stopped it (as timeout(1) says)


class Run(NamedTuple):
    """One compute-sanitizer process of ``run``: its tool, the kernels it checks (a
    substring of their names), the test methods, the arm, and what they are for."""

    name: str
    tool: str
    kernels: str
    methods: tuple[str, ...]  # empty: the series' new test methods
    arm: str


# The PR's new tests with its new kernel checked: every vector count and mode they cover.
# qmm_sm80 checked: memcheck over test_qmm, whose calls with K under three of its tiles
# main fetches past K; racecheck over test_gather_qmm_sorted (K of 8 tiles) and test_qmm
# (2 tiles), where main's epilogue may overlap the loop's last copy. Stock's arm shows
# main, the PR's arm the qmm_sm90 PR's bound.
RACE_QMM = ("test_gather_qmm_sorted", "test_qmm")
RUNS = (
    Run("memcheck-new", "memcheck", "qmv_mma_kernel", (), "pr"),
    Run("racecheck-new", "racecheck", "qmv_mma_kernel", (), "pr"),
    Run("memcheck-qmm-pr", "memcheck", "qmm_sm80", ("test_qmm",), "pr"),
    Run("memcheck-qmm-stock", "memcheck", "qmm_sm80", ("test_qmm",), "stock"),
    Run("racecheck-qmm-pr", "racecheck", "qmm_sm80", RACE_QMM, "pr"),
    Run("racecheck-qmm-stock", "racecheck", "qmm_sm80", RACE_QMM, "stock"),
)


def parse_log(text: str) -> dict[str, Any]:
    """One compute-sanitizer log: its summary, invalid accesses by kernel, API errors."""
    reports: list[dict[str, Any]] = []
    summary: dict[str, int] | None = None
    races: dict[tuple[str, str, str, str], dict[str, int]] = {}
    race: tuple[str, str, str] | None = None  # (severity, kernel, access) of the open report
    for line in text.splitlines():
        if m := RACE.match(line):
            race = (m[1], m[3], f"{m[2]} at +{m[4]}")
        elif race and (m := RACE_WITH.match(line)):
            cell = races.setdefault((*race, f"{m[1]} at +{m[3]}"), {"reports": 0, "hazards": 0})
            cell["reports"] += 1
            cell["hazards"] += int(m[4])
            continue
        elif not line.startswith("=========  "):
            race = None
        if m := ERRORS.search(line):
            summary = summary or {"errors": int(m[1])}
        elif m := HAZARDS.search(line):
            summary = {"hazards": int(m[1]), "errors": int(m[2]), "warnings": int(m[3])}
        elif (m := HEAD.match(line)) and not line.startswith("=========  "):
            reports.append({"head": m[1], "kernel": None, "past": None})
        elif reports and (m := KERNEL.match(line)):
            reports[-1]["kernel"] = reports[-1]["kernel"] or m[1]
        elif reports and (m := PAST.search(line)):
            reports[-1]["past"] = (int(m[1]), m[2], int(m[3].replace(",", "")))
    access: dict[tuple[str, str], dict[str, Any]] = {}
    api: Counter[str] = Counter()
    for r in reports:
        if r["head"].startswith("Invalid"):
            cell = access.setdefault((r["head"], r["kernel"] or "?"), {"count": 0, "past": []})
            cell["count"] += 1
            if r["past"]:
                cell["past"].append(r["past"])
        elif m := API.match(r["head"]):
            api[f"{m[1]} on {m[2]}"] += 1
    return {
        "summary": summary,
        # ended on its own: compute-sanitizer wrote its summary and the program exited
        # normally; a run stopped from outside leaves no summary
        "ended": summary is not None and not any(r["head"] == FAILED for r in reports),
        "invalid": [
            {
                "report": head,
                "kernel": kernel,
                "count": cell["count"],
                "bytes_past": sorted({p[0] for p in cell["past"]}),
                "side": sorted({p[1] for p in cell["past"]}),
                "allocation_bytes": sorted({p[2] for p in cell["past"]}),
            }
            for (head, kernel), cell in access.items()
        ],
        "api_errors": dict(api),
        # racecheck's reports: each pair of accesses (kernel, offsets in it) and how many
        # hazards the tool counted between them over the reports it printed
        "races": [
            {"severity": sev, "kernel": kernel, "access": access, "with": other, **cell}
            for (sev, kernel, access, other), cell in races.items()
        ],
    }


def parse_output(text: str) -> dict[str, Any]:
    """What the test command printed: tests run, their time, the verdict, the exit."""
    out: dict[str, Any] = {"ran": None, "seconds": None, "verdict": None, "rc": None}
    for line in text.splitlines():
        if m := RAN.match(line):
            out["ran"], out["seconds"] = int(m[1]), float(m[2])
        elif m := VERDICT.match(line):
            out["verdict"] = m[0]
        if m := RC.search(line):
            out["rc"] = int(m[1] if m[1] is not None else m[2])
    return out


def _summary_cell(run: dict[str, Any]) -> str:
    s = run["summary"]
    if run.get("no_log"):
        return "no log (the tool stopped before writing one)"
    if s is None:
        return "none (stopped before it was written)"
    if "hazards" in s:
        return f"{s['hazards']} hazards ({s['errors']} errors, {s['warnings']} warnings)"
    return f"{s['errors']} errors"


def _invalid_cell(run: dict[str, Any]) -> str:
    if not run["invalid"]:
        return "none"
    cells = []
    for i in run["invalid"]:
        past = i["bytes_past"]
        reach = f"{past[0]}-{past[-1]} bytes {'/'.join(i['side'])}" if past else "?"
        sizes = ", ".join(f"{b:,}" for b in i["allocation_bytes"])
        cells.append(f"{i['count']} x {i['report']} in `{i['kernel']}`, {reach} an "
                     f"allocation of {sizes} bytes")  # fmt: skip
    return "; ".join(cells)


def _races_cell(run: dict[str, Any]) -> str:
    if "hazards" not in (run["summary"] or {}):
        return "-"  # not racecheck, or no summary to say it was
    return "; ".join(sanitizer.race_phrases(run.get("races", []))) or "none"


def _output_cell(out: dict[str, Any] | None) -> str:
    if not out:
        return "not kept"
    ran = f"{out['ran']} in {out['seconds']} s, " if out["ran"] is not None else "no end line, "
    rc = f"exit {out['rc']}" if out["rc"] is not None else "exit not kept"
    return f"{ran}{out['verdict'] or 'no verdict'}; {rc}"


def page(data: dict[str, Any]) -> str:
    """The Markdown page of :func:`record`'s JSON."""
    lines = [
        f"# {data['title']}",
        "",
        f"- Hardware: {data['hardware']}.",
        "- Each run: one compute-sanitizer process over one test command; its log as the tool "
        "wrote it. Invalid accesses and races are the reports the tool printed "
        "(`--print-limit`; a race: the two accesses, at offsets into the kernel's machine "
        "code, and the hazards counted between them); the summary counts all. After "
        "memcheck stops a kernel the CUDA context is lost, so every later CUDA call fails: "
        "those API errors follow the first report, they are not more defects.",
        f"- Page: `{data['command']}`",
        *(
            [
                f"- The build: MLX {data['build']['wheel_version']}, build inputs "
                f"`{data['build']['build_inputs_sha256'][:16]}`."
            ]
            if data.get("build")
            else []
        ),
        *(
            ["- Commands run (in MLX's `python/tests`, each log given to `--log-file`):"]
            + [f"  - `{c}`" for c in data["ran"]]
            if data["ran"]
            else []
        ),
        "",
        "| run | tool's summary | invalid accesses | races (racecheck) | API errors after "
        "| program ended on its own | tests |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        api = sum(run["api_errors"].values())
        lines.append(
            f"| {run['label']} | {_summary_cell(run)} | {_invalid_cell(run)} "
            f"| {_races_cell(run)} | {api} "
            f"| {'yes' if run['ended'] else 'no'} | {_output_cell(run['output'])} |"
        )
    return "\n".join(lines) + "\n"


def record(
    title: str,
    hardware: str,
    runs: list[list[str]],
    command: str,
    ran: list[str],
    missing_log_ok: bool = False,
) -> dict[str, Any]:
    """The page's JSON from ``runs`` ([LABEL, LOG, TEST_OUTPUT?], files read here) and the
    commands that made them (``ran``). With ``missing_log_ok`` (``run``'s own runs), a run
    whose tool wrote no log (it stopped first) gets a row saying so."""
    parsed = []
    for label, log, *output in runs:
        if missing_log_ok and not Path(log).is_file():
            out = parse_output(_read(Path(output[0]))) if output else None
            parsed.append({"label": label, "summary": None, "ended": False, "invalid": [],
                           "api_errors": {}, "no_log": True, "output": out})  # fmt: skip
            continue
        text = _read(Path(log))
        if "COMPUTE-SANITIZER" not in text:
            raise SystemExit(f"{log}: not a compute-sanitizer log (no COMPUTE-SANITIZER line)")
        out = parse_output(_read(Path(output[0]))) if output else None
        parsed.append({"label": label, **parse_log(text), "output": out})
    return {"title": title, "hardware": hardware, "command": command, "ran": ran,
            "runs": parsed}  # fmt: skip


def sanitizer_argv(sanitizer: str, run: Run, log: Path, python: str, methods: list[str]
                   ) -> list[str]:  # fmt: skip
    """One run's command, run in the tests' folder: the tool over unittest's methods."""
    return [sanitizer, "--tool", run.tool, "--kernel-name", f"kns={run.kernels}",
            "--print-limit", str(PRINT_LIMIT), "--log-file", str(log),
            python, TEST_FILE, "-v", *(f"TestQuantized.{m}" for m in methods)]  # fmt: skip


def shown(argv: list[str]) -> str:
    """A run's command as the page shows it: no host's paths (the log, the interpreter)."""
    generic = [*argv]
    generic[0] = "compute-sanitizer"
    at = generic.index("--log-file")
    generic[at + 1], generic[at + 2] = "LOG", "python"
    return shlex.join(generic)


def label(run: Run, version: str) -> str:
    """What a run ran, as the page's rows name it: tool, kernels, tests and the MLX."""
    tests = ", ".join(f"MLX's {m}" for m in run.methods) or "the series' new tests"
    mlx = f"this build ({version})" if run.arm == "pr" else f"stock MLX ({version})"
    return f"{run.tool}, {run.kernels} alone, {tests}, {mlx}"


def _end_with_parent() -> None:
    """In a run's process, before it execs the tool: on Linux the kernel sends it SIGTERM
    when this script dies, however it dies, so that no run outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_all(
    arms: dict[str, str],
    tests: Path,
    logs: Path,
    limit_s: float,
    sanitizer: str,
    jobs: int,
    runs: tuple[Run, ...] = RUNS,
) -> list[tuple[Run, list[str], Path, Path]]:
    """The runs, ``jobs`` at a time in order, each stopped ``limit_s`` after it starts; per
    run its command, log and output (the test command's, then ``rc EXIT SECONDS s``)."""
    new = render.pr_test_methods()
    if not new:  # an empty list would run the whole test file under the tool
        raise SystemExit("run: templates/ add no test method for the runs of the new tests")
    if os.sep in sanitizer:
        sanitizer = os.path.abspath(sanitizer)
    planned = []
    for run in runs:
        python, site = proc.interpreter(arms[run.arm])
        # The runs start in the tests' folder: paths given relative to here must not move.
        python = os.path.abspath(python) if os.sep in python else python
        site = os.path.abspath(site) if site else site
        log, out = logs / f"{run.name}.log", logs / f"{run.name}.out"
        argv = sanitizer_argv(sanitizer, run, log, python, list(run.methods) or new)
        # Its own JIT cache: no run reads a kernel another compiled, or one left from before.
        env = {**os.environ, "MLX_PTX_CACHE_DIR": str(logs / f"{run.name}-jit")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH", "")]))
        planned.append((run, argv, log, out, env))
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    ended: set[int] = set()
    try:
        while len(ended) < len(planned):
            for i, (_, argv, _, out, env) in enumerate(planned):
                if len(running) >= jobs:
                    break
                if i not in running and i not in ended:
                    with out.open("w") as output:
                        try:
                            child = subprocess.Popen(argv, cwd=tests, env=env, stdout=output,
                                                     stderr=subprocess.STDOUT,
                                                     start_new_session=True,
                                                     preexec_fn=_end_with_parent)  # fmt: skip
                        except OSError as err:  # its row says so; the other runs go on
                            output.write(f"could not start {argv[0]}: {err.strerror}\nrc 127 0 s\n")
                            ended.add(i)
                            continue
                    running[i] = (child, time.monotonic())
            time.sleep(0.2)
            for i, (child, t0) in list(running.items()):
                code = child.poll()
                if code is None and time.monotonic() - t0 < limit_s:
                    continue
                # stopped at its limit, or ended: either way its whole group ends with it
                proc.stop_group(child, grace=10)
                code = STOPPED if code is None else code
                with planned[i][3].open("a") as output:
                    output.write(f"\nrc {code} {time.monotonic() - t0:.0f} s\n")
                del running[i]
                ended.add(i)
    finally:  # interrupted: nothing of the runs keeps running, leader or not
        for child, _ in running.values():
            proc.stop_group(child, grace=10)
    return [(run, argv, log, out) for run, argv, log, out, _ in planned]


def sanitizer_version(sanitizer: str) -> str:
    """compute-sanitizer's version line, for the page's hardware."""
    got = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, check=False)
    lines = [ln.strip() for ln in got.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else "compute-sanitizer (version not reported)"


def failed_runs(data: dict[str, Any], runs: tuple[Run, ...] = RUNS) -> list[str]:
    """The PR's arm's runs that reported something or did not end on their own."""
    bad = []
    for run, got in zip(runs, data["runs"], strict=True):
        summary = got["summary"] or {}
        rc = (got["output"] or {}).get("rc")
        if run.arm == "pr" and (not got["ended"] or rc != 0 or summary.get("errors")
                                or summary.get("hazards") or got["invalid"]):  # fmt: skip
            bad.append(run.name)
    return bad


def write_page(out: Path, data: dict[str, Any]) -> None:
    """The page's JSON and Markdown, side by side."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(page(data))


def run_command(args: argparse.Namespace) -> int:
    """``run``: the runs, then their page; 1 where the PR's arm reported anything."""
    arms = dict(a.split("=", 1) for a in args.arm)
    if missing := {r.arm for r in RUNS} - set(arms):
        raise SystemExit(f"run: give --arm {' and --arm '.join(sorted(missing))}=PYTHON[:SITE]")
    sanitizer = proc.cuda_tool("compute-sanitizer", args.sanitizer)
    if sanitizer is None:
        raise SystemExit("run: no compute-sanitizer (beside nvcc or on PATH); give --sanitizer")
    args.tests, args.logs = args.tests.resolve(), args.logs.resolve()
    if not (args.tests / TEST_FILE).is_file():
        raise SystemExit(f"run: {args.tests} has no {TEST_FILE} (bench/mlx_tests.py pr-tests)")
    build_record = json.loads(_read(args.build_record)) if args.build_record else None
    args.logs.mkdir(parents=True, exist_ok=True)
    if any(args.logs.iterdir()):
        raise SystemExit(f"run: --logs {args.logs} is not empty; give a new folder")
    versions = {}
    for name, spec in arms.items():
        try:
            versions[name] = mlx_of(*proc.interpreter(spec))
        except (OSError, subprocess.CalledProcessError):
            raise SystemExit(f"run: --arm {name}={spec} does not import mlx") from None
    # the build the PR's arm runs, as the other CUDA pages name it: checked before the runs
    build = timed_build([{"mlx": {"pr": versions["pr"]}}], build_record) if build_record else None
    done = run_all(arms, args.tests, args.logs, args.limit_s, sanitizer, args.jobs)
    # as the page shows it: no host's paths, the page where it is committed
    command = ("python3 bench/sanitizer_logs.py run --arm pr=PR_PYTHON[:SITE] --arm "
               "stock=STOCK_PYTHON[:SITE] --tests MLX/python/tests --logs LOGS --out "
               f"docs/results/{args.out.name} --limit-s {args.limit_s:g}"
               + (" --build-record build-cuda.json" if build else ""))  # fmt: skip
    gpu = hardware()["gpu"]
    data = record(
        "compute-sanitizer on MLX's tests: this build and stock MLX",
        f"{gpu}; {sanitizer_version(sanitizer)}",
        [[label(run, versions[run.arm]), str(log), str(out)] for run, _, log, out in done],
        command,
        list(dict.fromkeys(shown(argv) for _, argv, _, _ in done)),
        missing_log_ok=True,
    )
    # the tests the runs ran, as patchkit names the PR's (``--skip sanitizer`` compares it)
    data["pr_files_sha256"] = mlx_build.pr_files_id(ROOT)
    if build:
        data["build"] = build
    write_page(args.out, data)
    sys.stdout.write(page(data))
    if bad := failed_runs(data):
        print(f"sanitizer_logs: the build's runs that reported something or did not end: "
              f"{', '.join(bad)}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as err:
        raise SystemExit(f"{path}: {err.strerror}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the runs on a GPU host, then the page")
    r.add_argument("--arm", action="append", default=[], metavar="NAME=PYTHON[:SITE]",
                   help="pr=... (the build) and stock=... (stock MLX)")  # fmt: skip
    r.add_argument("--tests", type=Path, required=True, help="MLX's python/tests with the PR's")
    r.add_argument("--logs", type=Path, required=True, help="a new or empty folder for the logs")
    r.add_argument("--out", type=Path, required=True, help="the page, path without extension")
    r.add_argument("--limit-s", type=float, default=1200.0,
                   help="each run's time limit, in seconds, from its start")  # fmt: skip
    r.add_argument("--jobs", type=int, default=len(RUNS),
                   help="runs at once (default: all); fewer on a host short of memory")  # fmt: skip
    r.add_argument("--sanitizer", help="compute-sanitizer (default: beside nvcc, or on PATH)")
    r.add_argument("--build-record", type=Path,
                   help="the pr arm's patchkit build record, named by the page")  # fmt: skip
    p = sub.add_parser("page")
    p.add_argument("--out", type=Path, required=True, help="path without extension")
    p.add_argument("--title", required=True)
    p.add_argument("--hardware", required=True, help="the GPU, driver and compute-sanitizer")
    p.add_argument("--run", nargs="+", action="append", required=True,
                   metavar="LABEL LOG [TEST_OUTPUT]")  # fmt: skip
    p.add_argument("--ran", action="append", default=[], metavar="COMMAND",
                   help="a command the runs ran, for the page (repeat)")  # fmt: skip
    args = ap.parse_args()
    if args.cmd == "run":
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, proc.exit_on_signal)
        if bad := [a for a in args.arm if "=" not in a]:
            raise SystemExit(f"run: --arm {bad[0]}: give NAME=PYTHON[:SITE]")
        if args.jobs < 1:
            raise SystemExit(f"run: --jobs {args.jobs}: give 1 or more")
        return run_command(args)
    if bad := [r for r in args.run if len(r) not in (2, 3)]:
        raise SystemExit(f"--run takes LABEL LOG [TEST_OUTPUT], not {bad[0]}")
    command = "python3 bench/sanitizer_logs.py page --out " + args.out.as_posix() + " ..."
    data = record(args.title, args.hardware, args.run, command, args.ran)
    write_page(args.out, data)
    sys.stdout.write(page(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
