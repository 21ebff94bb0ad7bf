"""MLX's own ``test_quantized.py`` on stock MLX and on the MLX ``patchkit build`` made, side
by side: which methods pass, which subtests fail on each, and whether the patched build's
failures are stock's own.

  python3 bench/mlx_tests.py run --stock PYTHON[:SITE] --patched PYTHON[:SITE] \\
      --tests MLX_TREE/python/tests --json mlx_tests.json [--md PAGE.md] [--jobs N] \\
      [--deadline-s S] [--shards N] [--only METHOD ...] [--only-failed-in BUILD.json] \\
      [--patched-log BUILD_LOG | --patched-record BUILD.json]
  python3 bench/mlx_tests.py compare --stock STOCK.log --patched PATCHED.log \\
      --stock-mlx VERSION --patched-mlx VERSION --json mlx_tests.json
  python3 bench/mlx_tests.py report mlx_tests.json
  python3 bench/mlx_tests.py pr-tests --out DIR [--mlx-repo PATH]   # after patchkit apply

Both arms run the same file (the PR's worktree's, so the PR's new tests run on stock too:
MLX asks that new tests be shown failing on main) through ``patchkit.util.split_unittest``,
one process per method, at the same time, each with its own JIT cache. With
``--patched-log``, the PR's arm is not run again: its output is the build's own run of the
file (``patchkit build``'s log), and only stock runs, so the step needs half the compiles
and leaves the build alone (``ci/cuda_records.py`` runs it while another step rebuilds).
``--patched-record`` takes that arm from the build's record alone (the verdict of each
method and the headers of its failing subtests, which the record keeps): a record already
committed is compared with stock without building and running the file again; ``pr-tests``
writes the file's folder from the branch ``patchkit apply`` left, so that needs no build.
``compare`` reads two outputs of that module made another way. Not a timed benchmark: the
seconds are what each method took with whatever ran beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # patchkit, from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_qmv import hardware, mlx_of

from patchkit.util import proc
from patchkit.util.split_unittest import compare_arms, parse_output

MODULE = "test_quantized"
# A command's host-specific values, as its page shows them: interpreters and folders
# become placeholders, files their names (what the page's JSON and its siblings are).
PLACEHOLDERS = {"--stock": "STOCK_PYTHON[:SITE]", "--patched": "PATCHED_PYTHON[:SITE]",
                "--patched-log": "BUILD/build.log", "--tests": "MLX/python/tests"}  # fmt: skip
FILE_OPTIONS = ("--json", "--md", "--only-failed-in", "--patched-record")
# A build record's verdicts (patchkit.carry.mlx_build.method_results) as parse_output's.
RECORDED_VERDICTS = {
    "passed": "ok", "skipped": "ok", "failed": "FAILED", "unfinished": "UNFINISHED",
}  # fmt: skip


def run_arms(
    specs: dict[str, str],
    tests: Path,
    jobs: int,
    deadline: float | None,
    shards: int = 1,
    only: Sequence[str] = (),
) -> dict:
    """Both arms at once, ``jobs`` processes each (a method with subtests as ``shards``
    of them; ``only`` those methods, when named); their outputs as lists of lines."""
    root = Path(__file__).resolve().parent.parent
    procs = {}
    with tempfile.TemporaryDirectory(prefix="mlx-tests-") as caches:  # per-arm JIT caches
        for name, spec in specs.items():
            python, site = proc.interpreter(spec)
            if os.sep in python:  # the arms run in the tests' folder: a relative path would move
                python = os.path.abspath(python)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, str(root)]))}
            argv = [python, "-m", "patchkit.util.split_unittest", MODULE, "--jobs", str(jobs),
                    "--cache-root", os.path.join(caches, name)]  # fmt: skip
            if deadline:
                argv += ["--deadline-s", str(deadline)]
            if shards > 1:
                argv += ["--shards", str(shards)]
            argv += [arg for m in only for arg in ("--only", m)]
            procs[name] = subprocess.Popen(argv, cwd=tests, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)  # fmt: skip
        return {name: p.communicate()[0].splitlines() for name, p in procs.items()}


def side_by_side(
    outputs: dict[str, list[str]], methods: list[str], parsed: dict[str, dict] | None = None
) -> dict[str, Any]:
    """Per arm and method: verdict, seconds, failing subtests; and the comparison. A method
    of ``methods`` an output does not end is ``UNFINISHED`` there (its run was cut off).
    ``parsed`` holds arms already in that form (a build record's, :func:`recorded_arm`)."""
    every = {name: parse_output(lines) for name, lines in outputs.items()} | (parsed or {})
    arms = {name: {m: r for m, r in got.items() if m in methods} for name, got in every.items()}
    for ran in arms.values():
        for m in methods:
            ran.setdefault(m, {"verdict": "UNFINISHED", "seconds": None, "problems": []})
    return {"arms": arms, **compare_arms(arms)}


def generic_command(args: list[str]) -> str:
    """``args`` (after the script's name) as the page shows them: no host's paths. For
    ``compare``, whose --stock and --patched are output files, those keep their names."""
    as_files = FILE_OPTIONS + (("--stock", "--patched") if args[:1] == ["compare"] else ())

    def shown(option: str, value: str) -> str | None:
        if option in as_files:
            return shlex.quote(Path(value).name)
        return PLACEHOLDERS.get(option)

    out = []
    for i, arg in enumerate(args):
        option, eq, value = arg.partition("=")
        if eq and (new := shown(option, value)) is not None:
            out.append(f"{option}={new}")
        elif i and (new := shown(args[i - 1], arg)) is not None:
            out.append(new)
        else:
            out.append(shlex.quote(arg))
    return " ".join(["python3 bench/mlx_tests.py", *out])


def methods_of(test_file: Path) -> list[str]:
    """The test methods a file defines (its class's ``def test_*(self`` lines)."""
    return re.findall(r"^    def (test_\w+)\(self", test_file.read_text(), re.M)


def series() -> dict[str, str] | None:
    """The patch series the checkout holds and the id of the PR tests it renders (what the
    patched arm must have been built from, and the test file both arms must have run)."""
    try:
        from patchkit.carry import mlx_build, pin
    except ImportError:
        return None
    root = Path(__file__).resolve().parent.parent
    return mlx_build.patch_ids(root, pin.load(root / pin.PIN_FILE).short, "cuda")


def write(report: dict[str, Any], path: str, md: Path | None = None) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    text = page(report)
    if md is not None:
        md.write_text(text + "\n")
    print(text)


def logged_arm(log: Path, record: Path | None, data: dict[str, Any]) -> tuple[list[str], str]:
    """The PR's arm from a ``patchkit build`` log (its lines) and that build's record
    ``record`` (read as ``data``; the MLX it built): the log must hold the run of the test
    file the record counted, so that a log of another build, or of one made with
    ``--no-test``, never passes for it."""
    if record is None:
        raise SystemExit("--patched-log needs --only-failed-in: the record of the same build")
    if not log.is_file():
        raise SystemExit(f"--patched-log: no file {log}")
    lines = log.read_text(errors="replace").splitlines()
    ran = parse_output(lines)
    if not ran:
        raise SystemExit(f"--patched-log: {log} holds no run of {MODULE}.py (--no-test?)")
    failed = sorted(m for m, r in ran.items() if r["verdict"] == "FAILED")
    if failed != (counted := sorted(failed_in(data))):
        raise SystemExit(f"--patched-log: {log} failed {failed or 'nothing'}, but {record} "
                         f"says {counted or 'nothing'}: not one build's")  # fmt: skip
    return lines, data.get("mlx_version") or "unknown"


def recorded_arm(record: Path, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The PR's arm from a ``patchkit build`` record ``record`` (read as ``data``): each
    method's verdict and the headers of its failing subtests, as the build's own run of the
    file left them, which must be of the patch this checkout holds (its build inputs and PR
    tests). The record keeps no times. A method with a shard a deadline cut off is listed in
    its ``cut_off``; a record without that list says nothing of it, so its failed methods
    are taken as cut off (their subtests not compared) rather than as run to the end."""
    tests = data.get("tests")
    verdicts = tests.get("per_test") if isinstance(tests, dict) else None
    if not verdicts or not isinstance(verdicts, dict):
        raise SystemExit(f"--patched-record: {record} holds no run of {MODULE}.py (--no-test?)")
    if unknown := sorted(set(map(str, verdicts.values())) - set(RECORDED_VERDICTS)):
        raise SystemExit(f"--patched-record: {record} has verdicts {', '.join(unknown)}")
    have, want = data.get("patch") or {}, series()
    for key in ("build_inputs_sha256", "pr_files_sha256") if want else ():
        if have.get(key) != want[key]:
            raise SystemExit(f"--patched-record: {record} is of another patch than this "
                             f"checkout's ({key} {str(have.get(key))[:16]}, "
                             f"not {want[key][:16]})")  # fmt: skip
    subtests = tests.get("failing_subtests") or {}
    cut = tests.get("cut_off")
    arm = {}
    for method, verdict in verdicts.items():
        arm[method] = {"verdict": RECORDED_VERDICTS[verdict], "seconds": None,
                       "problems": list(subtests.get(method, [])), "sections": 1,
                       "skipped_sections": int(verdict == "skipped")}  # fmt: skip
        if verdict == "unfinished" or (method in cut if cut is not None else verdict == "failed"):
            arm[method]["cut_off"] = True
    return arm


def build_record(path: Path, option: str) -> dict[str, Any]:
    """A ``patchkit build`` record, read once; missing, not JSON or not a record (an
    object) is a one-line exit naming ``option``, the one that gave it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{option}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{option}: {path} is not a patchkit build record")
    return data


def failed_in(record: dict[str, Any]) -> list[str]:
    """The test methods a ``patchkit build`` record's run of the file failed, in its order:
    what to run again beside stock, to tell the PR's failures from stock's own."""
    tests = record.get("tests") or {}
    return [m for m, verdict in (tests.get("per_test") or {}).items() if verdict == "failed"]


def methods_why(report: dict[str, Any]) -> str:
    """Why the compared methods were chosen: those the build's own run failed, and any
    named with ``--only`` beside them (an older record lists only the failed ones)."""
    if not report.get("only_failed_in_build"):
        return ""
    failed = report.get("failed_in_build")
    if failed is None or set(failed) == set(report.get("only") or []):
        return " (those the build's own run of the file failed)"
    return (f" (failed in the build's own run of the file: {', '.join(failed) or 'none'};"
            " the others named to run)")  # fmt: skip


def page(report: dict[str, Any]) -> str:
    """The results page: what ran where, the verdict in a few lines, the table."""
    counts = {}
    for name, methods in report["arms"].items():
        verdicts = [m["verdict"] for m in methods.values()]
        counts[name] = (verdicts.count("ok"), verdicts.count("FAILED"),
                        sum(len(m["problems"]) for m in methods.values()),
                        verdicts.count("UNFINISHED"))  # fmt: skip
    only = report["pr_failing_only_on_pr"]
    hw = report["hardware"]
    not_rerun = report.get("patched_log") or report.get("patched_record")  # the PR's arm
    lines = [
        f"# MLX's `{report['module']}.py`: the PR's build beside stock MLX",
        "",
        f"- Command: `{report['command']}`",
        f"- Hardware: GPU {hw.get('gpu', 'unknown')}"
        + (f", {hw['cpus']} CPUs" if hw.get("cpus") else ""),
        f"- PR: {report['mlx']['pr']}; stock: {report['mlx']['stock']}",
        "- The same test file on both (the PR's, so its new tests run on stock too), one "
        "process per method, both arms at the same time"
        + (f"; but {report['how']}." if not_rerun else
           f": {report['how']}" if report.get("how") else "."),
        *([f"- Methods compared: {', '.join(report['only']) or 'none'}"
           + methods_why(report) + "; the others not run or left out"]
          if report.get("only") or report.get("only_failed_in_build") else []),
        "",
        *(f"- {name}: {ok} methods passed or skipped, {bad} failed ({sub} failing subtests), "
          f"{left} not run to the end"
          for name, (ok, bad, sub, left) in (("PR", counts["pr"]), ("stock", counts["stock"]))),
        f"- Failing subtests of the PR's build that fail on stock too: "
        f"{report['pr_failing_also_on_stock']}; failing only on the PR's build: {len(only)}"
        + ("" if not only else " (" + "; ".join(only) + ")")
        + (f"; not compared, their method not run to the end on stock: {unseen}"
           if (unseen := report.get("pr_failing_not_compared")) else ""),
        f"- Failing only on stock: {report['stock_failing_only_on_stock']}"
        + (f"; not compared, their method not run to the end on the PR's build: {unseen}"
           if (unseen := report.get("stock_failing_not_compared")) else ""),
        "",
        table(report),
    ]  # fmt: skip
    return "\n".join(lines)


def table(report: dict[str, Any]) -> str:
    """One row per method: verdicts and failing-subtest counts, PR beside stock."""
    arms = report["arms"]
    lines = [
        "| method | PR | failing subtests (PR) | stock | failing subtests (stock) |",
        "|---|---|---|---|---|",
    ]
    for m in sorted(set(arms["pr"]) | set(arms["stock"])):
        cells = []
        for name in ("pr", "stock"):
            r = arms[name].get(m)
            verdict = (
                "not run to the end"
                if r is None or r["verdict"] == "UNFINISHED"
                else ("passed" if r["verdict"] == "ok" else "failed")
            )
            cells += [verdict, str(len(r["problems"])) if r and r["problems"] else ""]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_pr_tests(out: Path, mlx_repo: str | None) -> None:
    """``pr-tests``: the test folder both arms run, without building the PR: with
    ``--patched-record`` only stock runs, so a committed record needs no build at all."""
    from patchkit.carry import mlx_build
    from patchkit.errors import UserError

    try:
        mlx_build.write_pr_tests(Path(__file__).resolve().parent.parent, out, mlx_repo)
    except UserError as exc:
        raise SystemExit(f"pr-tests: {exc}") from None
    print(f"the PR's python/tests: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--stock", required=True, help="PYTHON[:SITE] importing stock MLX")
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument("--patched", help="PYTHON[:SITE] importing the patched MLX")
    which.add_argument("--patched-log", type=Path, metavar="BUILD_LOG",
                       help="the PR's arm: this patchkit build log's test run, not a rerun "
                       "(with --only-failed-in that build's record)")  # fmt: skip
    which.add_argument("--patched-record", type=Path, metavar="BUILD_JSON",
                       help="the PR's arm: the verdicts this patchkit build record keeps of "
                       "its test run, not a rerun (its failed methods run on stock)")  # fmt: skip
    r.add_argument("--tests", required=True, type=Path, help="MLX's python/tests, PR's")
    r.add_argument("--json", required=True)
    r.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    r.add_argument("--deadline-s", type=float)
    r.add_argument("--shards", type=int, default=1,
                   help="a method with subtests as this many processes")  # fmt: skip
    r.add_argument("--only-failed-in", type=Path, metavar="BUILD_JSON",
                   help="also --only each method that record's test run failed")  # fmt: skip
    for cmd in (r, c := sub.add_parser("compare")):
        cmd.add_argument("--only", action="append", default=[], metavar="METHOD",
                         help="these methods only (repeatable; default: every one)")  # fmt: skip
        cmd.add_argument("--md", type=Path, help="also write the page there")
    c.add_argument("--stock", required=True, type=Path, help="split_unittest's output, stock")
    c.add_argument("--patched", required=True, type=Path, help="the same, patched build")
    c.add_argument("--stock-mlx", required=True, help="what the stock arm imported")
    c.add_argument("--patched-mlx", required=True, help="what the patched arm imported")
    c.add_argument("--hardware", required=True, help="the host both ran on, in words")
    c.add_argument("--test-file", required=True, type=Path, help="the file both arms ran")
    c.add_argument("--how", required=True, help="how the two outputs were made, in words")
    c.add_argument("--json", required=True)
    t = sub.add_parser("pr-tests", help="MLX's python/tests with the PR's tests, from the "
                       "branch `patchkit apply` left (no build): run's --tests")  # fmt: skip
    t.add_argument("--out", required=True, type=Path, help="a new or empty folder")
    t.add_argument("--mlx-repo", help="the MLX source `patchkit apply` cloned (default: its)")
    rep = sub.add_parser("report", help="the page of a run's JSON, its comparison re-derived")
    rep.add_argument("json")
    rep.add_argument("--md", type=Path, help="write the page there and the JSON back in place")
    a = parser.parse_args()
    if a.cmd == "pr-tests":
        write_pr_tests(a.out, a.mlx_repo)
        return
    command = generic_command(sys.argv[1:])
    parsed: dict[str, dict] = {}  # arms given whole, not as a run's output
    named = list(a.only) if a.cmd != "report" else []  # --only's own, before the failed
    if a.cmd == "report":  # the comparison re-derived from the per-method verdicts kept
        data = json.loads(Path(a.json).read_text())
        data.update(compare_arms(data["arms"]))
        data["command"] = generic_command(shlex.split(data["command"])[2:])
        if a.md is None:
            print(page(data))
        else:
            write(data, a.json, a.md)
        return
    if a.cmd == "run":
        if a.patched_record is not None:  # the record is also the one its failures come from
            if a.only_failed_in not in (None, a.patched_record):
                raise SystemExit("--patched-record: its record is the --only-failed-in one")
            a.only_failed_in = a.patched_record
        rerun = a.patched_log is None and a.patched_record is None
        arms = {"stock": a.stock, "pr": a.patched} if rerun else {"stock": a.stock}
        mlx = {name: mlx_of(*proc.interpreter(spec)) for name, spec in arms.items()}
        hw: dict[str, Any] | None = hardware()
        tests, how, logged = a.tests / f"{MODULE}.py", None, None
        given = "--patched-record" if a.patched_record is not None else "--only-failed-in"
        record = {} if a.only_failed_in is None else build_record(a.only_failed_in, given)
        if a.patched_record is not None:
            parsed["pr"] = recorded_arm(a.patched_record, record)
            mlx["pr"] = record.get("mlx_version") or "unknown"
            where = (record.get("machine") or {}).get("gpu") or "a host it does not name"
            how = (f"the PR's arm is its build's own run of the whole file, as its record "
                   f"({a.patched_record.name}, on {where}) keeps it, not run again; "
                   "stock's ran here")  # fmt: skip
        if a.patched_log is not None:
            logged, mlx["pr"] = logged_arm(a.patched_log, a.only_failed_in, record)
            how = (f"the PR's arm is its build's own run of the whole file ({a.patched_log.name}"
                   "), not run again; stock's ran here after it")  # fmt: skip
        failed = failed_in(record) if a.only_failed_in is not None else []
        a.only = list(dict.fromkeys([*a.only, *failed]))  # named first, then the failed
        if a.only_failed_in is not None and not a.only:  # nothing failed: nothing to rerun
            outputs: dict[str, list[str]] = {name: [] for name in arms}
        else:
            outputs = run_arms(arms, a.tests, a.jobs, a.deadline_s, a.shards, a.only)
        if logged is not None:
            outputs["pr"] = logged
    else:
        outputs = {
            "stock": a.stock.read_text(errors="replace").splitlines(),
            "pr": a.patched.read_text(errors="replace").splitlines(),
        }
        mlx, hw = {"stock": a.stock_mlx, "pr": a.patched_mlx}, {"gpu": a.hardware}
        tests, how = a.test_file, a.how
    methods = methods_of(tests)
    if unknown := sorted(set(a.only) - set(methods)):
        if not set(unknown) <= set(named):  # the record's failures: another file's build
            raise SystemExit(f"{a.only_failed_in} failed {', '.join(unknown)}, which {tests} "
                             "does not define: not the build of this test file")  # fmt: skip
        raise SystemExit(f"--only: {tests} has no test method {', '.join(unknown)}")
    from_build = getattr(a, "only_failed_in", None) is not None
    selected = a.only or ([] if from_build else methods)
    report = {"command": command, "module": MODULE, "how": how, "mlx": mlx, "hardware": hw,
              "patch": series(), "backend": "cuda", "only": a.only,
              "only_failed_in_build": from_build,
              **({"failed_in_build": failed} if from_build else {}),
              "patched_log": getattr(a, "patched_log", None) is not None,
              "patched_record": getattr(a, "patched_record", None) is not None}  # fmt: skip
    write({**report, **side_by_side(outputs, selected, parsed)}, a.json, a.md)


if __name__ == "__main__":
    main()
