"""Put MLX's tests, run one process per test on the GPU host, into a build record.

The device pipeline builds with ``patchkit build --no-test`` and runs
``python/tests/test_quantized.py`` one test per process (single tests take minutes of one
core there), in batches that a timing may stop and run again. This sums those logs into the
record's ``tests`` entry, in the format ``patchkit build`` writes for a whole-file run
(:func:`patchkit.carry.mlx_build.unittest_counts`, per test), plus what the one-process
form adds: each test's verdict, the tests no batch ran to its end (``unfinished``, not
counted in ``ran``) with the subtests they had failed before they stopped
(``unfinished_failing``), and, where a test also ran on the stock wheel in the same run
(``test-stock-<name>.log``), stock's verdict and whether it failed the very same subtests
(``on_stock``: the base a failure of the patched build is read against). The record's
markdown is written again beside it.

Usage: python scripts/cuda_tests_record.py RECORD.json NAMES LOGDIR [BATCH ...]
  RECORD.json: the build record (its .md is rewritten too)
  NAMES: one unittest name per line (test_quantized.TestQuantized.test_x)
  LOGDIR: where test-<batch>-<name>.log are; BATCH: the batches, later ones win
          (default: first again)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from patchkit.carry import mlx_build
from patchkit.errors import UserError


def verdict(counts: dict[str, int]) -> str:
    """One word per test, from its own log's counts."""
    if counts["errors"]:
        return "error"
    if counts["failed"]:
        return "failed"
    return "skipped" if counts["skipped"] == counts["ran"] else "passed"


def log_lines(logdir: Path, batch: str, name: str) -> list[str] | None:
    """The lines of test ``name``'s log in ``batch`` (None: that batch has no log of it)."""
    try:
        return (logdir / f"test-{batch}-{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return None


def finished_log(
    logdir: Path, name: str, batches: list[str]
) -> tuple[list[str], dict[str, int]] | None:
    """The lines and counts of the last of ``batches`` whose log ran test ``name`` to
    unittest's summary; None if none did (no log, or stopped before the end: an earlier one
    stands)."""
    found = None
    for batch in batches:
        lines = log_lines(logdir, batch, name)
        if lines is None:
            continue
        try:
            found = (lines, mlx_build.unittest_counts(lines))
        except UserError:
            continue  # stopped before unittest's summary: an earlier one stands
    return found


def failing_before_stop(logdir: Path, name: str, batches: list[str]) -> list[str]:
    """The subtests an unfinished test had already failed or errored, from unittest's
    verbose progress lines (``... (k=64) ... FAIL``) of the batch that got furthest: a test
    stopped after minutes still says what it found (the headers with tracebacks come only at
    the end of a run)."""
    best: list[str] = []
    for batch in batches:
        lines = log_lines(logdir, batch, name) or []
        found = [ln.strip() for ln in lines if ln.rstrip().endswith((" ... FAIL", " ... ERROR"))]
        if len(found) > len(best):
            best = found
    return best


def tests_entry(names: list[str], logdir: Path, batches: list[str]) -> dict[str, Any]:
    """The record's ``tests``: counts summed over the tests' last finished logs."""
    total = {k: 0 for k in ("ran", "passed", "failed", "errors", "skipped", "expected_failures",
                            "failures_reported", "errors_reported")}  # fmt: skip
    per_test: dict[str, str] = {}
    unfinished = []
    failing_so_far: dict[str, list[str]] = {}
    for name in names:
        found = finished_log(logdir, name, batches)
        short = name.rsplit(".", 1)[-1]
        if found is None:
            unfinished.append(short)
            if failing := failing_before_stop(logdir, name, batches):
                failing_so_far[short] = failing
            continue
        counts = found[1]
        per_test[short] = verdict(counts)
        for key in total:
            total[key] += counts[key]
    return {
        "file": f"python/tests/{mlx_build.TEST_FILE}.py",
        "how": "one process per test (the device pipeline); unfinished tests are not in ran",
        **total,
        "per_test": per_test,
        "unfinished": unfinished,
        **({"unfinished_failing": failing_so_far} if failing_so_far else {}),
    }


def on_stock(names: list[str], logdir: Path, batches: list[str]) -> dict[str, Any]:
    """Per test that also ran on the stock wheel: both verdicts, and whether stock failed
    exactly the (sub)tests the patched build did (the same headers, parameters included)."""
    per_test: dict[str, dict[str, Any]] = {}
    for name in names:
        stock = finished_log(logdir, name, ["stock"])
        if stock is None:
            continue  # not run on stock to the end (most tests): nothing to compare
        patched = finished_log(logdir, name, batches)
        if patched is None:
            continue
        stock_problems = mlx_build.unittest_problems(stock[0])
        patched_problems = mlx_build.unittest_problems(patched[0])
        per_test[name.rsplit(".", 1)[-1]] = {
            "stock": verdict(stock[1]),
            "patched": verdict(patched[1]),
            "failing_subtests_stock": len(stock_problems),
            "failing_subtests_patched": len(patched_problems),
            "same_failing_subtests": stock_problems == patched_problems,
        }
    return {
        "how": "the same test, one process, on the stock wheel in the same run",
        "per_test": per_test,
    }


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        raise SystemExit("usage: cuda_tests_record.py RECORD.json NAMES LOGDIR [BATCH ...]")
    record_path, names_path, logdir = Path(argv[0]), Path(argv[1]), Path(argv[2])
    for path, what in ((record_path, "build record"), (names_path, "test names file")):
        if not path.is_file():
            raise SystemExit(f"cuda_tests_record.py: no {what} at {path}")
    names = [n.strip() for n in names_path.read_text().splitlines() if n.strip()]
    rec = json.loads(record_path.read_text())
    batches = argv[3:] or ["first", "again"]
    rec["tests"] = tests_entry(names, logdir, batches)
    stock = on_stock(names, logdir, batches)
    if stock["per_test"]:
        rec["tests"]["on_stock"] = stock
    mlx_build.write_record_at(rec, record_path)
    t = rec["tests"]
    print(f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors of {t['ran']}; "
          f"{len(t['unfinished'])} unfinished")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
