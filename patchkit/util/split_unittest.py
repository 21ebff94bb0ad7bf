"""One unittest module, one process per test method, several at a time; one summary.

``python -m patchkit.util.split_unittest MODULE --jobs N [--cache-root DIR] [--deadline-s S]
[--shards N] [--first METHOD ...] [--only METHOD ...]``

Why: on CUDA, MLX compiles each ``qmm`` kernel with NVRTC at first use, serially and 20
to 50 s apiece, so its ``test_quantized.py`` spends most of a serial run compiling.
Separate processes compile side by side on the host's cores. With ``--shards N``, a
method with ``subTest`` blocks runs as N processes, each taking one contiguous Nth of
its subtests (:mod:`patchkit.util.subtest_shard`), so one method's compiles run side by
side too; its shards are summed into one verdict, and shards that disagree on how many
subtests the method has are an ``ERROR``. Each process gets its own
``MLX_PTX_CACHE_DIR`` under ``--cache-root`` (no two processes write one cache file),
seeded with the kernels of every process that ended before it started
(:mod:`patchkit.util.jit_pool`), so a kernel compiles again only in processes that
overlap, and a rerun starts warm. Where more than one CUDA device is visible, the
processes are spread over them (``CUDA_VISIBLE_DEVICES``, round robin). A method whose
process dies (a signal, no summary) is an ``ERROR`` naming how it ended, where a single
process would have taken the whole run's summary down with it. With ``--cache-root``,
each method's wall time (or that it was stopped unfinished) is kept there in
``durations.json``, and the next run starts the methods longest first (unfinished and
unknown ones before all others): the slow JIT compilers start at once instead of
queueing behind quick methods. ``--first`` names methods that start before all of those
(a change's own tests: its record must show them, however short the run's window), and
``--only`` the methods to run, none other (another build's failures, run again beside). With
``--deadline-s``, a method still running then is stopped and one not yet started is not
started: both are ``UNFINISHED`` lines, not counted as run, and the run is not OK (a host
lent for a fixed time still gets a verdict on every method that ended). With
``--cache-root``, fewer than ``--jobs`` run at a time where the host's available memory
holds fewer processes that compile CUDA kernels (``--jit-memory-gib`` each; 0: no limit):
nvcc and NVRTC take several GiB at their peak on a CUTLASS kernel, and a process compiles
many, so a slot per core can exhaust a host with less memory than that per core.

The output ends in unittest's own form: the ``FAIL:``/``ERROR:`` headers of every
method, one ``Ran N tests`` line and one ``OK``/``FAILED (...)`` tail summing the
methods' tails, so it is parsed as one run. Each method's own output comes first,
indented, under a line naming it. Exit 0 when every method passed, 1 otherwise; on
SIGTERM, the running methods are killed (each in its own process group, which a signal
to this one's group does not reach), none other starts, and the summary (those methods
``UNFINISHED``) ends with exit 143.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import unittest
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchkit.util import jit_pool, subtest_shard

RAN = re.compile(r"^Ran (\d+) tests? in")
TAIL = re.compile(r"^(OK|FAILED)(?: \((.*)\))?$")
# One per failing test or subtest: "FAIL: test_qmv (test_quantized.TestQuantized.test_qmv) ..."
PROBLEM = re.compile(r"^(FAIL|ERROR): \w+ \(([\w.]+)\)")
UNFINISHED = re.compile(r"^UNFINISHED: (\w+) \(([\w.]+)\)")
# unittest's verbose line for one test: "name (id) ... ok" / "... skipped 'why'" / "... "
# (a subtest's line says "(k=v)" after the id, so it is not one).
VERBOSE = re.compile(r"^(\w+) \(([\w.]+)\) \.\.\. ?(.*)$")
HEADER = re.compile(r"^== ([\w.]+)(?: \[(\d+)/(\d+)\])?: (\w+) in ([\d.]+)s$")
SHARD = re.compile(
    r"^SHARD (\d+)/(\d+): ran \[(\d+), (\w+)\) of (\d+) counted; (\d+) entered \((\w+)\)"
    r"(; the method skipped)?$"
)
TAIL_KEYS = ("failures", "errors", "skipped", "expected failures", "unexpected successes")
DURATIONS = "durations.json"  # under --cache-root: {method: seconds, or null if unfinished}
# What one process that compiles MLX's CUDA kernels may take at its peak (--jit-memory-gib).
JIT_MEMORY_GIB = 8
POOL = "_shared"  # under --cache-root: the kernels of processes that ended (jit_pool)


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
    shard: tuple[int, int] | None = None  # (K, N): shard K of N of the method's subtests

    @property
    def method(self) -> str:
        return self.test_id.rsplit(".", 1)[-1]

    @property
    def label(self) -> str:
        """The test id, and which shard (``mod.Class.test_x [2/4]``)."""
        return self.test_id + (f" [{self.shard[0]}/{self.shard[1]}]" if self.shard else "")

    def shard_line(self) -> re.Match[str] | None:
        """A shard's closing :data:`SHARD` line (None: not a shard, or it printed none)."""
        return next((m for ln in self.lines if (m := SHARD.match(ln))), None)

    def skipped_whole(self) -> bool:
        """Whether a shard's run skipped the method outside its subtests."""
        return bool((m := self.shard_line()) and m.group(8))

    def entered(self) -> tuple[int, str] | None:
        """How many top-level subtests a shard's run entered, and the digest of their
        parameters in order (None: not a shard, or no line)."""
        return None if (m := self.shard_line()) is None else (int(m.group(6)), m.group(7))

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


def longest_first(ids: list[str], known: dict[str, float | None]) -> list[str]:
    """``ids`` ordered by the last run's wall times (:func:`read_durations`), longest
    first; methods stopped unfinished or never timed come first, in unittest's order."""

    def seconds(test_id: str) -> float:
        value = known.get(test_id.rsplit(".", 1)[-1])
        return float(value) if isinstance(value, (int, float)) else math.inf

    return sorted(ids, key=lambda i: -seconds(i))


def keep_durations(runs: list[MethodRun], cache_root: Path) -> None:
    """Write each method's wall time (its slowest shard; null: stopped unfinished) for the
    next run's order; methods this run did not reach keep what an earlier run measured."""
    path = cache_root / DURATIONS
    known = read_durations(cache_root)
    for group in by_method(runs).values():
        method = group[0].method
        if any(run.returncode is None and run.seconds > 0 for run in group):
            known[method] = None  # started and stopped: at least that long, order it first
        elif all(run.returncode is not None for run in group):
            known[method] = round(max(run.seconds for run in group), 1)
    cache_root.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{DURATIONS}.{os.getpid()}")
    part.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    part.replace(path)  # atomic: a concurrent reader sees the old or the new file


def by_method(runs: Iterable[MethodRun]) -> dict[str, list[MethodRun]]:
    """The runs of each test id (its shards, or its one run), in the order first seen."""
    groups: dict[str, list[MethodRun]] = {}
    for run in runs:
        groups.setdefault(run.test_id, []).append(run)
    return groups


def shardable(test_id: str) -> bool:
    """Whether the (imported) method has ``with self.subTest(...)`` blocks to shard and no
    skip decorator (a skipped method is one skip, not one per shard)."""
    module, cls_name, method = test_id.rsplit(".", 2)
    cls = getattr(sys.modules.get(module), cls_name, None)
    try:
        source = inspect.getsource(getattr(cls, method))
    except (AttributeError, OSError, TypeError):
        return False
    return subtest_shard.has_subtests(textwrap.dedent(source)) and not (
        subtest_shard.skip_marked(cls, method)
    )


def tasks(ids: list[str], shards: int) -> list[tuple[str, tuple[int, int] | None]]:
    """What to start: each method once, or as ``shards`` shards if it has subtests."""
    out: list[tuple[str, tuple[int, int] | None]] = []
    for test_id in ids:
        if shards > 1 and shardable(test_id):
            out += [(test_id, (k, shards)) for k in range(shards)]
        else:
            out.append((test_id, None))
    return out


def visible_gpus() -> list[str]:
    """The CUDA devices test processes can be spread over: ``CUDA_VISIBLE_DEVICES``'s
    entries where it is set, else ``nvidia-smi -L``'s indices ([] without either)."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    count = sum(ln.startswith("GPU ") for ln in out.stdout.splitlines())
    return [str(i) for i in range(count)] if out.returncode == 0 else []


# The method processes running now (each leads its own process group), so that a SIGTERM
# stops them too: they are in other sessions than this one, so only this process can.
_running: set[int] = set()
_running_lock = threading.Lock()
_stopping = False


def stop_running(_signum: int, _frame: object) -> None:
    """SIGTERM's handler: kill every method's process group and start no other. Without it
    a terminated run would leave its methods (and their compilers) running on the host.
    The killed methods end as a deadline's do (their torn JIT caches dropped, not
    published), and the run ends with its summary and exit 143."""
    global _stopping
    with _running_lock:
        _stopping = True
        for pid in _running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def run_method(
    test_id: str,
    shard: tuple[int, int] | None,
    cache_root: Path | None,
    deadline: float | None,
    gpu: str | None = None,
) -> MethodRun:
    """``python -m unittest -v TEST_ID`` (or one shard of its subtests) in the current
    folder, with its own JIT cache (seeded from the pool, published to it after a run
    that ended on its own) and, given ``gpu``, that CUDA device only; stopped (with its
    children) at ``deadline`` (a ``time.monotonic()`` value)."""
    start = time.monotonic()
    if deadline is not None and start >= deadline:
        return MethodRun(test_id, None, 0.0, [], shard)
    env = dict(os.environ)
    folder = None
    if cache_root is not None:
        folder = cache_root / (test_id.rsplit(".", 1)[-1] + (f".{shard[0]}" if shard else ""))
        folder.mkdir(parents=True, exist_ok=True)
        jit_pool.seed(cache_root / POOL, folder)
        env["MLX_PTX_CACHE_DIR"] = str(folder)
    if shard:  # one iteration order of sets and dicts of strings in every shard
        env["PYTHONHASHSEED"] = "0"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    argv = (
        [sys.executable, "-m", "patchkit.util.subtest_shard", test_id, "--shard",
         f"{shard[0]}/{shard[1]}"]
        if shard
        else [sys.executable, "-m", "unittest", "-v", test_id]
    )  # fmt: skip
    with _running_lock:
        if _stopping:
            return MethodRun(test_id, None, 0.0, [], shard)
        child = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        _running.add(child.pid)
    with child:
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            out, _ = child.communicate(timeout=remaining)
            code: int | None = child.returncode
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, _ = child.communicate()
            code = None
        finally:
            with _running_lock:
                _running.discard(child.pid)
    if code is not None and code < 0 and _stopping:  # killed by stop_running: as a deadline
        code = None
    if folder is not None and cache_root is not None:
        if code is not None and code >= 0:
            jit_pool.publish(folder, cache_root / POOL)
        else:  # stopped or crashed, maybe inside a write
            jit_pool.drop_torn(folder)
    return MethodRun(test_id, code, time.monotonic() - start, out.splitlines(), shard)


def shard_problems(group: list[MethodRun]) -> list[str]:
    """An ERROR when a method's finished shards entered different numbers of subtests:
    then which subtests ran is not known."""
    entered = {run.entered() for run in group if run.shard and run.returncode is not None}
    if len(entered) > 1:
        run = group[0]
        counts = sorted({-1 if e is None else e[0] for e in entered})
        what = f"{counts} subtests" if len(counts) > 1 else f"{counts[0]} other subtests"
        return [f"ERROR: {run.method} ({run.test_id}) (shards entered {what})"]
    return []


def summary(runs: list[MethodRun], seconds: float) -> list[str]:
    """unittest's closing lines for all runs as one: problems, ``Ran``, the tail. A sharded
    method counts once: its problems are the distinct ones of its shards, its skipped
    subtests their sum (a method a decorator skips is never sharded)."""
    totals = dict.fromkeys(TAIL_KEYS, 0)
    problems: list[str] = []
    ran = unfinished = 0
    for group in by_method(runs).values():
        run = group[0]
        finished = [r for r in group if r.returncode is not None]
        done = len(finished) == len(group)
        # What finished shards found counts even when another shard did not finish.
        found = [p for r in finished for p in r.problems()]
        if run.shard:  # a problem outside subtests repeats in every shard: once
            found = list(dict.fromkeys(found)) + (shard_problems(group) if done else [])
        problems += found
        if run.shard:  # distinct problems, not shards that repeat one
            totals["failures"] += sum(p.startswith("FAIL:") for p in found)
            totals["errors"] += sum(p.startswith("ERROR:") for p in found)
        if not done:
            unfinished += 1
            why = "stopped by SIGTERM" if _stopping else "the deadline came first"
            problems.append(f"UNFINISHED: {run.method} ({run.test_id}) ({why})")
            continue
        ran += max(next((int(m.group(1)) for ln in r.lines if (m := RAN.match(ln))), 1)
                   for r in finished)  # fmt: skip
        if run.shard:  # skipped subtests: each in one shard; a skipped method: once
            tails = [r.tail() or {} for r in finished]
            for key in TAIL_KEYS[3:]:
                totals[key] += sum(t.get(key, 0) for t in tails)
            whole = any(r.skipped_whole() for r in finished)
            totals["skipped"] += 1 if whole else sum(t.get("skipped", 0) for t in tails)
            continue
        own = run.tail()  # None: no summary (the process died), one error
        for key, value in ({"errors": 1} if own is None else own).items():
            totals[key] = totals.get(key, 0) + value
    ok = not problems and totals["failures"] == totals["errors"] == 0
    counts = ", ".join(f"{k}={v}" for k, v in {**totals, "unfinished": unfinished}.items() if v)
    tail = ("OK" if ok else "FAILED") + (f" ({counts})" if counts else "")
    return ["-" * 70, *problems, f"Ran {ran} tests in {seconds:.1f}s", "", tail]


def parse_output(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Per method, from this module's own output: verdict, seconds, the headers of its
    failing subtests, and how many of its processes ran (``sections``) and skipped it as
    a whole (``skipped_sections``: unittest says ``ok`` for a skipped method too). What a
    record keeps, and how two runs' logs are compared. A sharded method's verdict is its
    worst shard's (FAILED, then UNFINISHED), its time the longest; ``cut_off`` marks one
    with a shard that did not end (a FAILED verdict does not say that all of it ran)."""
    methods: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    rank = {"ok": 0, "UNFINISHED": 1, "FAILED": 2}
    for ln in lines:
        if m := HEADER.match(ln):
            name = m.group(1).rsplit(".", 1)[-1]
            seen = methods.get(name)
            verdict, seconds = m.group(4), float(m.group(5))
            if seen is None:
                current = methods[name] = {"verdict": verdict, "seconds": seconds,
                                           "problems": [], "sections": 0,
                                           "skipped_sections": 0}  # fmt: skip
            else:
                current = seen
                if rank.get(verdict, 2) > rank.get(seen["verdict"], 2):
                    seen["verdict"] = verdict
                seen["seconds"] = max(seen["seconds"] or 0.0, seconds)
            current["sections"] = current.get("sections", 0) + 1
            if verdict == "UNFINISHED":  # a shard cut off: some subtests never ran
                current["cut_off"] = True
        elif (
            ln.startswith("    ")
            and current is not None
            and (m := VERBOSE.match(ln[4:]))
            and m.group(3).startswith("skipped")
        ):
            current["skipped_sections"] = current.get("skipped_sections", 0) + 1
        elif ln.startswith("    ") and current is not None and PROBLEM.match(ln[4:]):
            if ln[4:].strip() not in current["problems"]:
                current["problems"].append(ln[4:].strip())
        elif (m := PROBLEM.match(ln)) and (seen := methods.get(m.group(2).rsplit(".", 1)[-1])):
            # The summary's own problems: also those of no single shard (they disagree).
            seen["verdict"] = "FAILED"
            if ln.strip() not in seen["problems"]:
                seen["problems"].append(ln.strip())
        elif m := UNFINISHED.match(ln):
            blank = {"verdict": "ok", "seconds": None, "problems": []}
            seen = methods.setdefault(m.group(1), blank)
            seen["cut_off"] = True
            if seen["verdict"] != "FAILED":
                seen["verdict"] = "UNFINISHED"
        elif not ln.startswith("    "):
            current = None
    return methods


def ran_to_end(method: dict[str, Any]) -> bool:
    """Whether one method of :func:`parse_output` (or a page or record made from it) ran
    to its end: a verdict other than ``UNFINISHED`` and no shard cut off. Only such a
    method says anything of its subtests: the pages compare failures there, and a stock
    run counts as whole only where every method did."""
    return method.get("verdict") not in (None, "UNFINISHED") and not method.get("cut_off")


def compare_arms(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Which failing subtests each arm (``pr``, ``stock``: methods as :func:`parse_output`
    gives them) shares with the other; a page's comparison, and the same for any subset of
    its methods (export-pr quotes a PR's own). A subtest can be called one
    arm's own only where the other arm ran its method to the end: a method cut off there
    (``UNFINISHED``, or a shard of it: ``cut_off``) says nothing of its subtests, so those
    are ``not compared``."""
    failing = {
        name: {(m, s) for m, r in ran.items() for s in r["problems"]} for name, ran in arms.items()
    }
    ended = {name: {m for m, r in ran.items() if ran_to_end(r)} for name, ran in arms.items()}
    pr_alone = {(m, s) for m, s in failing["pr"] - failing["stock"] if m in ended["stock"]}
    stock_alone = {(m, s) for m, s in failing["stock"] - failing["pr"] if m in ended["pr"]}
    return {
        "pr_failing_also_on_stock": len(failing["pr"] & failing["stock"]),
        "pr_failing_only_on_pr": sorted(f"{m}: {s}" for m, s in pr_alone),
        "pr_failing_not_compared": len(failing["pr"] - failing["stock"] - pr_alone),
        "stock_failing_only_on_stock": len(stock_alone),
        "stock_failing_not_compared": len(failing["stock"] - failing["pr"] - stock_alone),
    }


def memory_available() -> int | None:
    """The host's available memory in bytes (``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def jit_jobs(jobs: int, available: int | None, per_process_gib: float) -> int:
    """``jobs``, or as many processes as ``available`` bytes hold at ``per_process_gib``
    each (at least one; unknown memory or a limit of 0 leaves ``jobs``)."""
    if available is None or per_process_gib <= 0:
        return jobs
    return max(1, min(jobs, int(available // (per_process_gib * (1 << 30)))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="split_unittest", description=__doc__.split("\n")[0])
    parser.add_argument("module", help="a test module importable from the current folder")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache-root", type=Path, help="one MLX_PTX_CACHE_DIR per method here")
    parser.add_argument("--deadline-s", type=float, help="stop what still runs after this long")
    parser.add_argument("--shards", type=int, default=1,
                        help="run each method with subtests as this many processes")  # fmt: skip
    parser.add_argument("--first", action="append", default=[], metavar="METHOD",
                        help="start this test method before all others (repeatable)")  # fmt: skip
    parser.add_argument("--only", action="append", default=[], metavar="METHOD",
                        help="run only the methods named so (repeatable)")  # fmt: skip
    parser.add_argument("--jit-memory-gib", type=float, default=JIT_MEMORY_GIB,
                        help="with --cache-root: GiB a process may take (0: no limit)")  # fmt: skip
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, stop_running)
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    sys.path.insert(0, os.getcwd())
    ids = test_ids(args.module)
    if args.only:
        methods = {i.rsplit(".", 1)[-1] for i in ids}
        if unknown := sorted(set(args.only) - methods):
            parser.error(f"--only: {args.module} has no test method {', '.join(unknown)}")
        ids = [i for i in ids if i.rsplit(".", 1)[-1] in args.only]
    known = read_durations(args.cache_root)
    work = tasks(longest_first(ids, known), args.shards)
    # Not timed yet (a fresh host): the methods split into shards first, the likely slow
    # ones, so quick methods fill the slots they leave instead of queueing behind them.
    work.sort(key=lambda t: (t[0].rsplit(".", 1)[-1] in known, t[1] is None))
    work.sort(key=lambda t: t[0].rsplit(".", 1)[-1] not in args.first)  # stable: first of all
    jobs, why = args.jobs, ""
    if args.cache_root is not None:
        available = memory_available()
        jobs = jit_jobs(args.jobs, available, args.jit_memory_gib)
        if jobs < args.jobs and available is not None:
            why = (
                f" (not {args.jobs}: {available / (1 << 30):.0f} GiB of memory available, "
                f"{args.jit_memory_gib:g} GiB a process that compiles CUDA kernels)"
            )
    print(f"{len(ids)} test methods of {args.module} in {len(work)} processes, "
          f"{jobs} at a time{why}", flush=True)  # fmt: skip
    start = time.monotonic()
    deadline = None if args.deadline_s is None else start + args.deadline_s
    runs: list[MethodRun] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        gpus = visible_gpus()
        futures = [
            pool.submit(run_method, test_id, shard, args.cache_root, deadline,
                        gpus[n % len(gpus)] if len(gpus) > 1 else None)
            for n, (test_id, shard) in enumerate(work)
        ]  # fmt: skip
        for future in as_completed(futures):
            run = future.result()
            runs.append(run)
            if run.returncode is not None:
                print(f"== {run.label}: {run.verdict()} in {run.seconds:.1f}s", flush=True)
                print("\n".join("    " + ln for ln in run.lines), flush=True)
    runs.sort(key=lambda r: (ids.index(r.test_id), r.shard or (0, 1)))
    if args.cache_root is not None:
        keep_durations(runs, args.cache_root)
    lines = summary(runs, time.monotonic() - start)
    print("\n".join(lines), flush=True)
    if _stopping:
        return 128 + signal.SIGTERM
    return 0 if lines[-1].startswith("OK") else 1


if __name__ == "__main__":
    sys.exit(main())
