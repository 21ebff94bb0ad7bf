"""One unittest module, one process per test method, several at a time; one summary.

``python -m patchkit.util.split_unittest MODULE --jobs N [--cache-root DIR] [--deadline-s S]``

Why: on CUDA, MLX compiles each ``qmm`` kernel with NVRTC at first use, serially and
20 to 50 s apiece, so its ``test_quantized.py`` spends most of a serial run compiling.
Separate processes compile side by side on the host's cores. Each method gets its own
``MLX_PTX_CACHE_DIR`` under ``--cache-root`` (a rerun starts warm, and no two processes
write one cache file). A method whose process dies (a signal, no summary) is an
``ERROR`` naming how it ended, where a single process would have taken the whole
run's summary down with it. With ``--cache-root``, each method's wall time (or that it was
stopped unfinished) is kept there in ``durations.json``, and the next run starts the
methods longest first (unfinished and unknown ones before all others): the slow JIT
compilers start at once instead of queueing behind quick methods. With ``--deadline-s``,
a method still running then is stopped and one not yet started is not started: both are
``UNFINISHED`` lines, not counted as run, and the run is not OK (a host lent for a fixed
time still gets a verdict on every method that ended).

The output ends in unittest's own form: the ``FAIL:``/``ERROR:`` headers of every
method, one ``Ran N tests`` line and one ``OK``/``FAILED (...)`` tail summing the
methods' tails, so it is parsed as one run. Each method's own output comes first,
indented, under a line naming it. Exit 0 when every method passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import unittest
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RAN = re.compile(r"^Ran (\d+) tests? in")
TAIL = re.compile(r"^(OK|FAILED)(?: \((.*)\))?$")
# One per failing test or subtest: "FAIL: test_qmv (test_quantized.TestQuantized.test_qmv) ..."
PROBLEM = re.compile(r"^(FAIL|ERROR): \w+ \(([\w.]+)\)")
UNFINISHED = re.compile(r"^UNFINISHED: (\w+) \(([\w.]+)\)")
HEADER = re.compile(r"^== ([\w.]+): (\w+) in ([\d.]+)s$")
TAIL_KEYS = ("failures", "errors", "skipped", "expected failures", "unexpected successes")
DURATIONS = "durations.json"  # under --cache-root: {method: seconds, or null if unfinished}


def tail_counts(tail: re.Match[str]) -> dict[str, int]:
    """The ``key=N`` counts of a :data:`TAIL` match (``{}`` for a bare ``OK``)."""
    parts = (part.strip().partition("=") for part in (tail.group(2) or "").split(","))
    return {key: int(value) for key, sep, value in parts if sep}


@dataclass(frozen=True)
class MethodRun:
    """One test method's process: its id, exit code, wall seconds and output lines."""

    test_id: str
    returncode: int | None  # None: stopped at the deadline, or never started
    seconds: float
    lines: list[str]

    @property
    def method(self) -> str:
        return self.test_id.rsplit(".", 1)[-1]

    def verdict(self) -> str:
        """``ok``, ``FAILED`` or ``UNFINISHED``: the word on the method's ``==`` line."""
        if self.returncode is None:
            return "UNFINISHED"
        return "ok" if self.tail() is not None and not self.problems() else "FAILED"

    def tail(self) -> dict[str, int] | None:
        """unittest's closing counts (``{}`` for a bare ``OK``); None if it printed none."""
        if not any(RAN.match(ln) for ln in self.lines):
            return None
        for ln in reversed(self.lines):
            if m := TAIL.match(ln.strip()):
                return tail_counts(m)
        return None

    def problems(self) -> list[str]:
        """The run's FAIL/ERROR headers, or one ERROR saying how a process without a
        summary ended."""
        found = [ln.strip() for ln in self.lines if PROBLEM.match(ln)]
        if self.tail() is None and self.returncode is not None:
            how = f"signal {-self.returncode}" if self.returncode < 0 else f"exit {self.returncode}"
            found.append(f"ERROR: {self.method} ({self.test_id}) (no unittest summary: {how})")
        return found


def test_ids(module: str) -> list[str]:
    """Every test method of ``module``, in unittest's order (importing the module)."""

    def flat(suite: Iterable[unittest.TestCase | unittest.TestSuite]) -> Iterator[str]:
        for item in suite:
            if isinstance(item, unittest.TestSuite):
                yield from flat(item)
            else:
                yield item.id()

    return list(flat(unittest.defaultTestLoader.loadTestsFromName(module)))


def read_durations(cache_root: Path | None) -> dict[str, float | None]:
    """The wall times kept under ``cache_root`` ({} when none, or a torn or foreign file)."""
    try:
        known = json.loads((cache_root / DURATIONS).read_text()) if cache_root else {}
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def longest_first(ids: list[str], cache_root: Path | None) -> list[str]:
    """``ids`` ordered by the last run's wall time under ``cache_root``, longest first;
    methods stopped unfinished or never timed come first, in unittest's order."""
    known = read_durations(cache_root)

    def seconds(test_id: str) -> float:
        value = known.get(test_id.rsplit(".", 1)[-1])
        return float(value) if isinstance(value, (int, float)) else math.inf

    return sorted(ids, key=lambda i: -seconds(i))


def keep_durations(runs: list[MethodRun], cache_root: Path) -> None:
    """Write each method's wall time (null: stopped unfinished) for the next run's order;
    methods this run did not reach keep what an earlier run measured."""
    path = cache_root / DURATIONS
    known = read_durations(cache_root)
    for run in runs:
        if run.returncode is not None:
            known[run.method] = round(run.seconds, 1)
        elif run.seconds > 0:  # started and stopped: at least that long, order it first
            known[run.method] = None
    cache_root.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{DURATIONS}.{os.getpid()}")
    part.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    part.replace(path)  # atomic: a concurrent reader sees the old or the new file


def run_method(test_id: str, cache_root: Path | None, deadline: float | None) -> MethodRun:
    """``python -m unittest -v TEST_ID`` in the current folder, with its own JIT cache,
    stopped (with its children) at ``deadline`` (a ``time.monotonic()`` value)."""
    env = dict(os.environ)
    if cache_root is not None:
        env["MLX_PTX_CACHE_DIR"] = str(cache_root / test_id.rsplit(".", 1)[-1])
    start = time.monotonic()
    if deadline is not None and start >= deadline:
        return MethodRun(test_id, None, 0.0, [])
    with subprocess.Popen(
        [sys.executable, "-m", "unittest", "-v", test_id], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    ) as child:  # fmt: skip
        try:
            out, _ = child.communicate(timeout=None if deadline is None else deadline - start)
            code: int | None = child.returncode
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, _ = child.communicate()
            code = None
    return MethodRun(test_id, code, time.monotonic() - start, out.splitlines())


def summary(runs: list[MethodRun], seconds: float) -> list[str]:
    """unittest's closing lines for all runs as one: problems, ``Ran``, the tail."""
    totals = dict.fromkeys(TAIL_KEYS, 0)
    problems: list[str] = []
    ran = 0
    for run in runs:
        if run.returncode is None:
            problems.append(f"UNFINISHED: {run.method} ({run.test_id}) (the deadline came first)")
            continue
        problems += run.problems()
        tail = run.tail()
        ran += next((int(m.group(1)) for ln in run.lines if (m := RAN.match(ln))), 1)
        for key, value in ({"errors": 1} if tail is None else tail).items():
            totals[key] = totals.get(key, 0) + value
    unfinished = sum(run.returncode is None for run in runs)
    ok = not problems and totals["failures"] == totals["errors"] == 0
    counts = ", ".join(f"{k}={v}" for k, v in {**totals, "unfinished": unfinished}.items() if v)
    tail = ("OK" if ok else "FAILED") + (f" ({counts})" if counts else "")
    return ["-" * 70, *problems, f"Ran {ran} tests in {seconds:.1f}s", "", tail]


def parse_output(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Per method, from this module's own output: verdict, seconds and the headers of its
    failing subtests. What a record keeps, and how two runs' logs are compared."""
    methods: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for ln in lines:
        if m := HEADER.match(ln):
            current = {"verdict": m.group(2), "seconds": float(m.group(3)), "problems": []}
            methods[m.group(1).rsplit(".", 1)[-1]] = current
        elif ln.startswith("    ") and current is not None and PROBLEM.match(ln[4:]):
            current["problems"].append(ln[4:].strip())
        elif m := UNFINISHED.match(ln):
            methods[m.group(1)] = {"verdict": "UNFINISHED", "seconds": None, "problems": []}
        elif not ln.startswith("    "):
            current = None
    return methods


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="split_unittest", description=__doc__.split("\n")[0])
    parser.add_argument("module", help="a test module importable from the current folder")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache-root", type=Path, help="one MLX_PTX_CACHE_DIR per method here")
    parser.add_argument("--deadline-s", type=float, help="stop what still runs after this long")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    ids = test_ids(args.module)
    order = longest_first(ids, args.cache_root)
    print(f"{len(ids)} test methods of {args.module}, {args.jobs} at a time", flush=True)
    start = time.monotonic()
    deadline = None if args.deadline_s is None else start + args.deadline_s
    runs: list[MethodRun] = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_method, i, args.cache_root, deadline) for i in order]
        for future in as_completed(futures):
            run = future.result()
            runs.append(run)
            if run.returncode is not None:
                print(f"== {run.test_id}: {run.verdict()} in {run.seconds:.1f}s", flush=True)
                print("\n".join("    " + ln for ln in run.lines), flush=True)
    runs.sort(key=lambda r: ids.index(r.test_id))
    if args.cache_root is not None:
        keep_durations(runs, args.cache_root)
    lines = summary(runs, time.monotonic() - start)
    print("\n".join(lines), flush=True)
    return 0 if lines[-1].startswith("OK") else 1


if __name__ == "__main__":
    sys.exit(main())
