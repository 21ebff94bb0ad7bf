"""Every CUDA record of this checkout's patch, made on one GPU host by one command.

  python3 ci/cuda_records.py --stock PYTHON[:SITE] [--out DIR] [BUILD OPTIONS ...]
  python3 ci/cuda_records.py --plan --stock PYTHON[:SITE] [BUILD OPTIONS ...]  # commands only
  python3 ci/cuda_records.py --skip speed ...  # keep a page already of these build inputs
  python3 ci/cuda_records.py --only speed --only independent ...  # those pages alone
  python3 ci/cuda_records.py --only controls ...  # the controls alone: no stock MLX needed

The CUDA pages in ``docs/results`` belong to what a CUDA build compiles of one patch
series (``tests/test_records.py`` fails when they do not; decision 0008), so any change
to the CUDA templates needs all of them again, made in this order on one machine:

0. ``patchkit apply``: the pinned clone's patch branch, which the build checks out (a
   no-op where it is already there; on a fresh host, the clone is made);
1. ``patchkit build --backend cuda``: the build, parity on both routes and MLX's test file
   (``build-cuda``);
2. ``bench/mlx_qmv.py run`` on that build beside a stock MLX (``--stock``, its interpreter
   and optionally an unpacked wheel's folder), once per (dtype, group size) of the speed
   page, then the page (``cuda``: each call waiting for the one before); the same with
   calls MLX's graph may overlap (``cuda-independent``); then ``bench/mlx_ncu.py`` on the
   same two arms, one Nsight Compute process a call (``cuda-ncu``: registers, occupancy,
   DRAM bytes and bandwidth of each kernel); then ``bench/sanitizer_logs.py run`` on the
   same two arms (``cuda-sanitizer-runs``: compute-sanitizer's memcheck and racecheck over
   the series' new tests and MLX's ``test_qmm``, on a copy of the applied branch's tests);
3. ``bench/mlx_tests.py run --only-failed-in`` the build's record: the methods its test
   run failed, those of MLX's the series fixes (``export_pr.FIXED_TESTS``) and the series'
   new ones (``render.pr_test_methods``), on stock, beside the build's own run of them
   (its log, kept by step 1) (``cuda-tests``).
   Nothing is timed from here on, so it runs alongside step 4 and costs the run no time
   of its own: it never imports the build the controls replace;
4. ``ci/cuda_controls.py`` last: it leaves its control build in patchkit's build folder
   until the next ``patchkit build``, so nothing may time the build after it.

BUILD OPTIONS (``--offline``, ``-j 16``, ``--test-timeout 600`` ...) go to ``patchkit
build`` and the controls' build alike. The stock MLX must import and run on the GPU (the
``mlx`` wheel with ``mlx-cuda``), which is checked before the first step. Each step's
files land in ``--out`` (default: a new folder under the temporary directory; a given one
must be new or empty, so that no earlier run's record passes for this one's). A step
that produced no record stops the run and nothing is copied; otherwise the records are
copied into ``docs/results`` together at the end, also when a step recorded failures
(failed MLX tests, differing rows, a control not as it must), which the exit status (1)
and the last lines report.

``--skip speed``, ``--skip independent``, ``--skip ncu``, ``--skip sanitizer`` or
``--skip controls``
(repeatable) leaves out the steps of a page that is already of this checkout's build
inputs (a run cut off after it, say): the page stays as it is, and the run refuses (2)
where it is missing or of other inputs. The build and the tests beside stock always run:
every other page is held to the build they record.

``--only KIND`` (repeatable) is the other half of such a split: the build without MLX's
tests (its record is the pages' ``--build-record`` and is not copied: ``build-cuda`` comes
with its tests), then only those pages' steps, whose pages alone are copied. So the pages
of one patch can be made in two runs on hosts lent for a bounded time, e.g. ``--only speed
--only independent --only ncu``, then ``--skip speed --skip independent --skip ncu``.
``--only tests`` runs the tests beside stock with the PR's arm taken from the committed
``build-cuda`` record (``bench/mlx_tests.py --patched-record``), which must be of this
checkout's build inputs and PR tests and hold its run of MLX's test file: so once the
``build-cuda`` record of a run cut off after it is copied from that run's folder into
``docs/results``, ``--only controls --only tests`` makes the two pages it left, without
MLX's test file run on a build again. The tests beside stock then need no build of this
run (their folder is the applied branch's, ``bench/mlx_tests.py pr-tests``), so ``--only
tests`` alone builds nothing.

``--patched PYTHON[:SITE]`` with ``--only speed``, ``independent``, ``ncu`` or
``sanitizer`` runs a build made by an earlier run instead of building again: the wheel of
the committed ``build-cuda`` record (its ``wheel`` field, in patchkit's cache on the host
that built it), installed beside the stock MLX on a host whose GPU has the architecture it
was compiled for (``nvcc`` builds MLX for the build host's GPU alone). The record must be
of this checkout's build inputs, and that MLX must be its ``wheel_version`` and run on the
GPU; the pages then name that record. So once one host has made every record, a host
with less time to give than a build takes times that build again.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ci import cuda_controls  # noqa: E402
from patchkit.carry import export_pr, mlx_build, pin, render, transaction  # noqa: E402
from patchkit.util import proc, staging  # noqa: E402

RESULTS = ROOT / "docs" / "results"
TXN_DIR = ".txn"  # under docs/results: an in-flight copy of the records
# The speed page's runs, (dtype, group size), as docs/results/cuda.md shows them: both
# types the grid names at each group size MLX's affine modes take.
SPEED_RUNS = tuple((dtype, group) for dtype in ("bfloat16", "float16") for group in (64, 32, 128))
# Processes per method with subtests when the failed methods run on stock (each compiles
# only the JIT kernels of its share of the subtests).
STOCK_SHARDS = 8
# Steps a run may leave out (by the first word of their names), each with the page that
# must then already be of this checkout's build inputs.
SKIPPABLE = {"speed": "cuda.json", "independent": "cuda-independent.json",
             "ncu": "cuda-ncu.json", "sanitizer": "cuda-sanitizer-runs.json",
             "controls": "cuda-controls.json"}  # fmt: skip
# The speed pages: their steps' kind, how their timed calls relate (bench/mlx_qmv.py
# --calls) and their page. Chained calls time what a layer that needs the one before
# waits; independent ones what MLX's graph makes of calls it may overlap (a layer's q, k
# and v projections), where a kernel that leaves SMs idle gains most.
SPEED_PAGES = (("speed", "chained", "cuda"), ("independent", "independent", "cuda-independent"))
# What --only may name: those, and the tests beside stock against the committed build record.
ONLY = (*SKIPPABLE, "tests")
# The steps that may time a build made by an earlier run (--patched): the pages of a build.
PREBUILT = ("speed", "independent", "ncu", "sanitizer")
BUILD_RECORD = "build-cuda.json"


class Step(NamedTuple):
    """One command of the run, and the files that show it produced its record."""

    name: str
    argv: list[str]
    produces: tuple[Path, ...]
    # Exit statuses that still leave a whole record (the record says what failed).
    recorded_failure: tuple[int, ...] = ()
    # Files copied into the run's folder once the step ended (a later step rewrites them).
    keep: tuple[tuple[Path, Path], ...] = ()
    # Started, then the next steps run while it does; waited for before any record is copied.
    alongside: bool = False


def steps(
    stock: str,
    out: Path,
    build_args: list[str],
    python: str,
    pr_record: Path | None = None,
    patched: str | None = None,
    rounds: int | None = None,
) -> list[Step]:
    """The run's commands, in order, for a stock interpreter spec and an output folder.
    With ``pr_record`` (a committed build record), the tests beside stock take the PR's
    arm from it, not from this run's build; with ``patched`` too (PYTHON[:SITE] of that
    record's wheel), so do the speed and ncu pages. ``rounds``: each arm's rounds in the
    speed runs (None: the bench's own count), which the pages state."""
    short = pin.load(ROOT / pin.PIN_FILE).short
    layout = mlx_build.layout("cuda", short, cmake_args=cuda_controls.cmake_args(build_args))
    build, bench, pages, controls = (out / d for d in ("build", "bench", "pages", "controls"))
    arm, timed = str(layout.python), build / BUILD_RECORD  # the PR's MLX and its record
    if patched is not None and pr_record is not None:
        arm, timed = patched, pr_record
    build_argv = [python, "-m", "patchkit", "build", "--backend", "cuda"]
    build_argv += ["--record-dir", str(build), *build_args]
    plan = [Step("apply", [python, "-m", "patchkit", "apply", "--pin", short], ())]
    # patchkit build exits 1 after writing its record when tests fail or rows differ.
    # Kept for "tests beside stock", which runs while the controls rebuild in that folder:
    # the log's run of MLX's test file is its PR arm, and stock runs the same file.
    build_log, test_dir = build / "build.log", build / "tests"
    keep = ((layout.log, build_log), (layout.worktree / "python" / "tests", test_dir))
    if pr_record is not None:  # the test folder from the applied branch: no build needed
        keep = ()
        pr_tests = [python, "bench/mlx_tests.py", "pr-tests", "--out", str(test_dir)]
        plan.append(Step("pr tests", pr_tests, (test_dir / f"{mlx_build.TEST_FILE}.py",)))
    plan.append(Step("build", build_argv, (build / BUILD_RECORD, build / "build-cuda.md"),
                     (1,), keep=keep))  # fmt: skip
    for kind, calls, name in SPEED_PAGES:
        runs = []
        for dtype, group in SPEED_RUNS:
            run = bench / f"{name}-{dtype}-{group}.json"
            argv = [python, "bench/mlx_qmv.py", "run", "--stock", stock]
            argv += ["--patched", arm, "--json", str(run)]
            argv += ["--dtype", dtype, "--group-size", str(group)]
            argv += ["--rounds", str(rounds)] if rounds is not None else []
            argv += ["--calls", calls]
            plan.append(Step(f"{kind} {dtype} group {group}", argv, (run,)))
            runs.append(run)
        page_argv = [python, "bench/mlx_qmv.py", "page", *map(str, runs), "--out",
                     str(pages / name), "--build-record", str(timed)]  # fmt: skip
        page = tuple(pages / f"{name}.{ext}" for ext in ("json", "md", "png"))
        plan.append(Step(f"{kind} page", page_argv, page))
    # Nsight Compute on the same two arms: registers, occupancy, DRAM traffic per kernel
    # (bench/mlx_ncu.py); its page is the build's record, as the speed page is.
    ncu_run = bench / "ncu.json"
    ncu_argv = [python, "bench/mlx_ncu.py", "run", "--arm", f"pr={arm}",
                "--arm", f"stock={stock}", "--json", str(ncu_run)]  # fmt: skip
    plan.append(Step("ncu", ncu_argv, (ncu_run,)))
    ncu_page = [python, "bench/mlx_ncu.py", "page", str(ncu_run), "--out", str(pages / "cuda-ncu"),
                "--build-record", str(timed)]  # fmt: skip
    plan.append(Step("ncu page", ncu_page, (pages / "cuda-ncu.json", pages / "cuda-ncu.md")))
    # compute-sanitizer on MLX's tests, the same two arms (bench/sanitizer_logs.py): after the
    # timed steps, which it would slow, and before the controls, which replace the build it
    # runs. Its own copy of the PR's tests folder, from the applied branch.
    san_tests = bench / "sanitizer-tests"
    pr_tests_argv = [python, "bench/mlx_tests.py", "pr-tests", "--out", str(san_tests)]
    plan.append(Step("sanitizer tests", pr_tests_argv, (san_tests / f"{mlx_build.TEST_FILE}.py",)))
    san_argv = [python, "bench/sanitizer_logs.py", "run", "--arm", f"pr={arm}",
                "--arm", f"stock={stock}", "--tests", str(san_tests),
                "--logs", str(bench / "sanitizer"), "--out", str(pages / "cuda-sanitizer-runs"),
                "--build-record", str(timed)]  # fmt: skip
    san_page = (pages / "cuda-sanitizer-runs.json", pages / "cuda-sanitizer-runs.md")
    # Exit 1: a run of the build reported something or did not end; the page says which.
    plan.append(Step("sanitizer", san_argv, san_page, (1,)))
    # The methods the build's own test run failed, on stock, beside that run's output:
    # whose failures they are (none failed: the page says nothing ran). Stock starts with
    # no JIT kernels compiled and only a few methods run, so each gets more processes
    # (every core: nothing is timed by then) to end within the deadline.
    pr_arm = (["--patched-log", str(build_log), "--only-failed-in", str(build / BUILD_RECORD)]
              if pr_record is None else ["--patched-record", str(pr_record)])  # fmt: skip
    tests_argv = [python, "bench/mlx_tests.py", "run", "--stock", stock, *pr_arm,
                  "--tests", str(test_dir),
                  "--json", str(pages / "cuda-tests.json"), "--md", str(pages / "cuda-tests.md"),
                  "--shards", str(STOCK_SHARDS), "--jobs", str(os.cpu_count() or 1)]  # fmt: skip
    # MLX's own methods the series fixes run too, failed or not, and the series' new ones:
    # stock failing them and the build passing them is the fix shown, and each new test
    # shown failing on main's code (MLX asks both of a PR).
    named = [*export_pr.FIXED_TESTS["qmm-sm90"], *render.pr_test_methods(ROOT / "templates")]
    tests_argv += [a for t in dict.fromkeys(named) for a in ("--only", t)]
    # The build's --test-timeout bounds them too.
    limit = cuda_controls.option_values(build_args, "--test-timeout")
    tests_argv += ["--deadline-s", limit[0]] if limit else []
    tests = (pages / "cuda-tests.json", pages / "cuda-tests.md")
    # After the build even where its folder comes from the applied branch: beside the
    # build both would contend for the host's cores, beside the controls (a GPU step after
    # a one-file rebuild) they cost the run no time.
    plan.append(Step("tests beside stock", tests_argv, tests, alongside=True))
    # Exit 1: a control came out otherwise than it must; the page says which.
    controls_argv = [python, "ci/cuda_controls.py", "--out", str(controls), *build_args]
    record = (controls / "cuda-controls.json", controls / "cuda-controls.md")
    plan.append(Step("controls", controls_argv, record, (1,)))
    return plan


def committed(file: str) -> tuple[str, dict[str, Any], str | None]:
    """A committed record in ``docs/results``: its name as messages give it, its JSON, and
    why it cannot be read (``None`` when it can)."""
    page = RESULTS / file
    name = os.path.relpath(page, ROOT)
    if not page.is_file():
        return name, {}, f"{name} does not exist"
    try:
        rec = json.loads(page.read_text())
    except ValueError:
        return name, {}, f"{name} is not JSON"
    return (name, rec, None) if isinstance(rec, dict) else (name, {}, f"{name} is not a record")


def other_inputs(name: str, have: dict[str, Any]) -> str | None:
    """Why a record whose patch facts are ``have`` is of another CUDA build than this
    checkout's (``None`` when it is of this one)."""
    want = mlx_build.build_inputs_id(ROOT, pin.load(ROOT / pin.PIN_FILE).short, "cuda")
    if (got := have.get("build_inputs_sha256")) != want:
        return f"{name} is of build inputs {str(got)[:16]}, this checkout's are {want[:16]}"
    return None


def not_current(kind: str) -> str | None:
    """Why the committed page of the skippable steps ``kind`` cannot stand beside a new
    build of this checkout; ``None`` when it can (the checks of ``tests/test_records.py``)."""
    name, rec, why = committed(SKIPPABLE[kind])
    if why or (why := other_inputs(name, rec if kind == "controls" else rec.get("build") or {})):
        return why
    if kind == "sanitizer" and rec.get("pr_files_sha256") != mlx_build.pr_files_id(ROOT):
        return f"{name} ran other PR tests than templates/ renders now"
    if kind == "controls":
        if rec.get("control_sha256") != cuda_controls.control_sha256():
            return f"{name} switched in another control diff"
        if not rec.get("ok"):
            return f"{name} has a control that did not come out as it must"
    return None


def committed_build() -> tuple[str, dict[str, Any], str | None]:
    """The committed build record (its name, its JSON) and why it is not of this checkout's
    build inputs (``None`` when it is): what every step taking the PR's arm from it needs."""
    name, rec, why = committed(BUILD_RECORD)
    return name, rec, why or other_inputs(name, rec.get("patch") or {})


def record_not_current() -> str | None:
    """Why the committed build record cannot be the PR's arm of the tests beside stock
    (``--only tests``); ``None`` when it can: of this checkout's build inputs and PR tests
    (the checks of ``tests/test_records.py``), with its run of MLX's test file."""
    name, rec, why = committed_build()
    if why:
        return why
    if rec["patch"].get("pr_files_sha256") != mlx_build.pr_files_id(ROOT):
        return f"{name} ran other PR tests than templates/ renders now"
    if not (rec.get("tests") or {}).get("per_test"):
        return f"{name} holds no run of MLX's test file"
    return None


def record_wheel() -> tuple[str | None, str | None]:
    """The committed build record's wheel version, which ``--patched`` must run, and why
    the record cannot name it (``None`` when it can): of this checkout's build inputs."""
    name, rec, why = committed_build()
    version = rec.get("wheel_version")
    return version, why or (None if version else f"{name} names no wheel_version")


def ended(step: Step, code: int, out: Path, failures: list[str]) -> bool:
    """Whether ``step`` left its record (its ``keep`` files then copied into the run's
    folder); says why not. A failure the record holds is added to ``failures``."""
    missing = [p for p in step.produces if not p.is_file()]
    missing += [src for src, _ in step.keep if not src.exists()]
    if (code and code not in step.recorded_failure) or missing:
        print(f"cuda_records: {step.name} failed (exit {code}"
              + (f"; missing {', '.join(p.name for p in missing)}" if missing else "")
              + f"); nothing copied; its files: {out}", file=sys.stderr)  # fmt: skip
        return False
    for src, dst in step.keep:
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, dst)
    if code:
        failures.append(f"{step.name} (exit {code})")
    return True


def publish(files: list[Path], dest: Path) -> None:
    """Install ``files`` into ``dest`` as one transaction (``patchkit.util.staging``, as
    ``patches/`` is written): a kill at any moment leaves the old records or the new ones,
    and the checkout's lock keeps a second writer out meanwhile."""
    with staging.exclusive(transaction.lock_path(ROOT)):
        txn = staging.Transaction.begin(dest, dest / TXN_DIR, tuple(f.name for f in files))
        try:
            for f in files:
                shutil.copyfile(f, txn.stage / f.name)
                txn.install(txn.stage / f.name, dest / f.name)
        except BaseException:
            txn.abort()
            raise
        txn.commit()


def mlx_not_on_gpu(spec: str, version: str | None = None) -> str | None:
    """Why the MLX of ``spec`` (``PYTHON[:SITE]``) cannot be an arm of the pages: it does
    not import, is not ``version`` (where given), or its default device is not the GPU;
    ``None`` when it can."""
    python, site = proc.interpreter(spec)
    env = {**os.environ, **({"PYTHONPATH": site} if site else {})}
    probe = "import mlx.core as mx; print(mx.__version__, mx.default_device())"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env,
                              check=False, timeout=120)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python}: {exc}"
    # Its line, not its exit status: MLX's CUDA backend can abort while the probe tears
    # down (see patchkit.verify.mlx_parity.exit_without_teardown), after printing it.
    if version is not None and done.stdout.split()[:1] != [version] and "Device(" in done.stdout:
        return f"MLX {done.stdout.split()[0]} is not the build record's {version}"
    if "Device(gpu" in done.stdout:
        return None
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"does not import mlx.core ({last})"
    return f"MLX {done.stdout.strip()} does not run on the GPU (is mlx-cuda installed?)"


def run_step(argv: list[str]) -> int:
    """One step in the run's own process group (Ctrl-C reaches it too), waited for. When the
    run is stopped (SIGTERM, Ctrl-C) the step gets SIGTERM and time to end through its own
    cleanup (the sanitizer's runs, in groups of their own), SIGKILL only after 60 s."""
    child = subprocess.Popen(argv, cwd=ROOT)
    try:
        return child.wait()
    except BaseException:
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stock", help="stock MLX: PYTHON[:SITE], as bench/mlx_qmv.py (for the "
                    "speed, ncu, sanitizer and tests steps; --only controls runs "
                    "without)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="the steps' files (default: a new temporary folder)")
    ap.add_argument("--plan", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--skip", action="append", default=[], choices=sorted(SKIPPABLE),
                    help="leave out the steps of a page already of these build inputs")  # fmt: skip
    ap.add_argument("--only", action="append", default=[], choices=sorted(ONLY),
                    help="the build without tests, then only these pages' steps")  # fmt: skip
    ap.add_argument("--patched", metavar="PYTHON[:SITE]",
                    help="with --only speed/independent/ncu/sanitizer: the committed build "
                    "record's wheel, run instead of a new build")  # fmt: skip
    ap.add_argument("--rounds", type=int, metavar="N",
                    help="the speed runs' rounds of each arm (bench/mlx_qmv.py --rounds; "
                    "default its own): fewer for a host lent for less time")  # fmt: skip
    args, build_args = ap.parse_known_args(argv)
    if args.only and args.skip:
        print("cuda_records: --only and --skip do not go together", file=sys.stderr)
        return 2
    if args.rounds is not None and args.rounds < 1:
        print(f"cuda_records: --rounds {args.rounds}: give 1 or more", file=sys.stderr)
        return 2
    for kind in dict.fromkeys(args.skip):
        if why := not_current(kind):
            print(f"cuda_records: --skip {kind}: {why}; run its steps", file=sys.stderr)
            return 2
    patched_version = None
    if args.patched:
        if not args.only or set(args.only) - set(PREBUILT):
            print("cuda_records: --patched goes with --only " + ", ".join(PREBUILT)
                  + " alone: the other steps need this run's build", file=sys.stderr)  # fmt: skip
            return 2
        patched_version, why = record_wheel()
        if why:
            print(f"cuda_records: --patched: {why}", file=sys.stderr)
            return 2
    if "tests" in args.only and (why := record_not_current()):
        print(f"cuda_records: --only tests: {why}; run without --only", file=sys.stderr)
        return 2
    if args.out:
        out = args.out.resolve()
        # A record left by an earlier run must not pass for this run's.
        if not args.plan and out.exists() and any(out.iterdir()):
            print(f"cuda_records: --out {args.out} is not empty; give a new folder",
                  file=sys.stderr)  # fmt: skip
            return 2
    elif args.plan:  # nothing is written
        out = Path(tempfile.gettempdir()) / "cuda-records-XXXX"
    else:
        out = Path(tempfile.mkdtemp(prefix="cuda-records-"))
    pr_record = RESULTS / BUILD_RECORD if "tests" in args.only or args.patched else None
    plan = [s for s in steps(args.stock or "", out, build_args, sys.executable, pr_record,
                             args.patched, args.rounds)
            if s.name.split()[0] not in args.skip]  # fmt: skip
    if args.only:  # the build's record only names what the pages timed: not copied
        # The tests and a build made elsewhere need none here (a committed record).
        built = set(args.only) != {"tests"} and not args.patched
        # the branch a build or the PR tests read
        applied = built or bool({"tests", "sanitizer"} & set(args.only))
        # The PR's test folder for the tests beside stock ("pr tests") only where they run;
        # the sanitizer's is its own step's, from the branch apply leaves.
        plan = [s._replace(argv=[*s.argv, "--no-test"], keep=()) if s.name == "build" else s
                for s in plan if (s.name == "apply" and applied)
                or (s.name == "pr tests" and "tests" in args.only)
                or s.name.split()[0] in args.only or (s.name == "build" and built)]  # fmt: skip
    records = [p for s in plan for p in s.produces if out / "bench" not in p.parents
               and s.name != "pr tests" and not (args.only and s.name == "build")]  # fmt: skip
    # Found before the build, not after it and the speed runs: a missing profiler, and a
    # stock that does not run on the GPU (the mlx wheel without mlx-cuda), whose pages
    # would compare the PR's CUDA build with MLX on the CPU.
    stocked = any(s.name.split()[0] in (*PREBUILT, "tests") for s in plan)
    why = None
    if stocked and not args.stock:
        why = ("--stock PYTHON[:SITE] is needed for the speed, independent, ncu, sanitizer "
               "and tests steps")  # fmt: skip
    elif not args.plan and any(s.name == "ncu" for s in plan) and not proc.cuda_tool("ncu"):
        why = ("no Nsight Compute (ncu beside nvcc or on PATH) for the ncu step: put the "
               "CUDA toolkit's ncu on PATH")  # fmt: skip
    elif (not args.plan and any(s.name == "sanitizer" for s in plan)
          and not proc.cuda_tool("compute-sanitizer")):  # fmt: skip
        why = ("no compute-sanitizer (beside nvcc or on PATH) for the sanitizer step: put "
               "the CUDA toolkit's on PATH")  # fmt: skip
    elif not args.plan and stocked and (stock_why := mlx_not_on_gpu(args.stock)):
        why = f"--stock {args.stock}: {stock_why}"
    elif (
        not args.plan
        and args.patched
        and (patched_why := mlx_not_on_gpu(args.patched, patched_version))
    ):
        why = f"--patched {args.patched}: {patched_why}"
    if why:
        print(f"cuda_records: {why}", file=sys.stderr)
        if not args.out and not args.plan:  # the temporary folder made for it, still empty
            out.rmdir()
        return 2
    if args.plan:
        for kind in dict.fromkeys(args.skip):
            print(
                f"# skipped: {kind} ({os.path.relpath(RESULTS / SKIPPABLE[kind], ROOT)} is current)"
            )
        for s in plan:
            print(f"# {s.name}" + (" (beside the steps after it)" if s.alongside else ""))
            print(shlex.join(s.argv))
            for src, dst in s.keep:
                print(f"# then keep: {src} -> {dst}")
        names = ", ".join(p.name for p in records)
        print(f"# then: copy {names} into {os.path.relpath(RESULTS, ROOT)}")
        return 0
    for d in ("build", "bench", "pages", "controls"):
        (out / d).mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    beside: list[tuple[Step, subprocess.Popen]] = []
    # SIGTERM and SIGHUP (a time limit, a closed terminal) end the run through `finally`,
    # as Ctrl-C does: the steps beside, in process groups of their own, are stopped too.
    previous = {
        sig: signal.signal(sig, proc.exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        for s in plan:
            print(f"cuda_records: {s.name}: {shlex.join(s.argv)}", flush=True)
            if s.alongside:
                log = out / (s.name.replace(" ", "-") + ".log")
                with log.open("w") as output:
                    # Its own process group, so that stopping it reaches its children.
                    beside.append((s, subprocess.Popen(s.argv, cwd=ROOT, stdout=output,
                                                       stderr=subprocess.STDOUT,
                                                       start_new_session=True)))  # fmt: skip
                print(f"cuda_records: {s.name} runs beside the steps after it; output: {log}")
                continue
            started = time.monotonic()
            code = run_step(s.argv)
            # Each step's wall time, for planning how long a run takes on a GPU host.
            print(f"cuda_records: {s.name} took {time.monotonic() - started:.0f} s", flush=True)
            if not ended(s, code, out, failures):
                return 2
        for s, child in beside:
            if not ended(s, child.wait(), out, failures):
                return 2
    finally:  # a run that stops leaves nothing of its own running
        for _, child in beside:
            if child.poll() is None:
                proc.stop_group(child, grace=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    publish(records, RESULTS)
    print(f"cuda_records: records copied into {os.path.relpath(RESULTS, ROOT)}; runs kept in {out}")
    if failures:
        print(f"cuda_records: recorded failures: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
