"""compute-sanitizer logs of MLX's own tests, made into one results page.

    python3 bench/sanitizer_logs.py page --out docs/results/cuda-sanitizer-runs \
        --hardware GPU --run LABEL LOG [TEST_OUTPUT] --run ...

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
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

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
RC = re.compile(r"rc (\d+) \d+ s$")  # the run's own last line, "rc EXIT SECONDS s"


def parse_log(text: str) -> dict[str, Any]:
    """One compute-sanitizer log: its summary, invalid accesses by kernel, API errors."""
    reports: list[dict[str, Any]] = []
    summary: dict[str, int] | None = None
    for line in text.splitlines():
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
            out["rc"] = int(m[1])
    return out


def _summary_cell(run: dict[str, Any]) -> str:
    s = run["summary"]
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
        "wrote it. Invalid accesses are the reports the tool printed (`--print-limit`); the "
        "summary counts all. After memcheck stops a kernel the CUDA context is lost, so every "
        "later CUDA call fails: those API errors follow the first report, they are not more "
        "defects.",
        f"- Page: `{data['command']}`",
        *(
            ["- Commands run (in MLX's `python/tests`, each log given to `--log-file`):"]
            + [f"  - `{c}`" for c in data["ran"]]
            if data["ran"]
            else []
        ),
        "",
        "| run | tool's summary | invalid accesses | API errors after | program ended on its "
        "own | tests |",
        "|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        api = sum(run["api_errors"].values())
        lines.append(
            f"| {run['label']} | {_summary_cell(run)} | {_invalid_cell(run)} | {api} "
            f"| {'yes' if run['ended'] else 'no'} | {_output_cell(run['output'])} |"
        )
    return "\n".join(lines) + "\n"


def record(
    title: str, hardware: str, runs: list[list[str]], command: str, ran: list[str]
) -> dict[str, Any]:
    """The page's JSON from ``runs`` ([LABEL, LOG, TEST_OUTPUT?], files read here) and the
    commands that made them (``ran``)."""
    parsed = []
    for label, log, *output in runs:
        text = _read(Path(log))
        if "COMPUTE-SANITIZER" not in text:
            raise SystemExit(f"{log}: not a compute-sanitizer log (no COMPUTE-SANITIZER line)")
        out = parse_output(_read(Path(output[0]))) if output else None
        parsed.append({"label": label, **parse_log(text), "output": out})
    return {"title": title, "hardware": hardware, "command": command, "ran": ran,
            "runs": parsed}  # fmt: skip


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as err:
        raise SystemExit(f"{path}: {err.strerror}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("page")
    p.add_argument("--out", type=Path, required=True, help="path without extension")
    p.add_argument("--title", required=True)
    p.add_argument("--hardware", required=True, help="the GPU, driver and compute-sanitizer")
    p.add_argument("--run", nargs="+", action="append", required=True,
                   metavar="LABEL LOG [TEST_OUTPUT]")  # fmt: skip
    p.add_argument("--ran", action="append", default=[], metavar="COMMAND",
                   help="a command the runs ran, for the page (repeat)")  # fmt: skip
    args = ap.parse_args()
    if bad := [r for r in args.run if len(r) not in (2, 3)]:
        raise SystemExit(f"--run takes LABEL LOG [TEST_OUTPUT], not {bad[0]}")
    command = "python3 bench/sanitizer_logs.py page --out " + args.out.as_posix() + " ..."
    data = record(args.title, args.hardware, args.run, command, args.ran)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(page(data))
    sys.stdout.write(page(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
