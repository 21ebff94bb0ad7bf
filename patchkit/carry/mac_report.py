"""A Mac owner's one command: what MLX's CONTRIBUTING and a reviewer ask of the Metal PR.

``patchkit mac-report`` (macOS, Apple silicon, Xcode) runs, in order: the GPU's name and
generation; stock MLX at the pin's release in a venv of its own (main); the PR's branch
built twice with ``patchkit build`` (as shipped, and with ``-DMLX_METAL_JIT=ON``), each
running MLX's ``test_quantized.py`` and parity through ``mx.quantized_matmul`` on the GPU;
the branch's test file on main (the PR's new tests must fail there on generation 15+);
the PR's bundled benchmark on main and on the branch. Then one report, Markdown and JSON,
to paste: every number read from those steps' own files, each section saying which file.

What it does not do, and the report says so: build main (so no main JIT run and no main
kernel compile time; main is the release wheel). ``--dry-run`` prints the plan anywhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchkit.carry import mlx_build, pin
from patchkit.errors import UserError

TEST_FILE = "test_quantized"
BENCH = "qmv_small_batch_bench.py"
JIT_ARG = "-DMLX_METAL_JIT=ON"
# The PR's own tests (templates/python/tests/test_quantized.py): must fail on main (gen 15+).
PR_TESTS = (
    "test_qmv_small_batch_matches_single_vector",
    "test_fp_qmv_small_batch_matches_single_vector",
)
DEVICE_PROBE = (
    "import json, sys, mlx.core as mx; info = mx.metal.device_info();"
    " json.dump({k: (v if isinstance(v, (int, float, str)) else str(v))"
    " for k, v in info.items()}, open(sys.argv[1], 'w'), indent=1)"
)


@dataclass(frozen=True)
class Paths:
    """Where one report's inputs and outputs live (``out``) and the builds it reads."""

    out: Path
    aot: mlx_build.Layout
    jit: mlx_build.Layout

    @property
    def stock_python(self) -> Path:
        return self.out / "stock-venv" / "bin" / "python"

    def log(self, stage: str) -> Path:
        return self.out / f"{stage}.log"


def paths(root: Path, out: Path | None = None) -> Paths:
    """The report folder (default: beside the builds in patchkit's cache, never in the
    checkout) and the two builds' folders for the checkout's pin."""
    p = pin.load(root / pin.PIN_FILE)
    aot = mlx_build.layout("metal", p.short)
    return Paths(out or aot.base.parent / f"mac-report-{p.short}", aot,
                 mlx_build.layout("metal", p.short, cmake_args=(JIT_ARG,)))  # fmt: skip


def plan(root: Path, where: Paths, python: str = sys.executable, jit: bool = True
         ) -> list[mlx_build.Step]:  # fmt: skip
    """The commands, in order; reads pin.toml, runs nothing."""
    p = pin.load(root / pin.PIN_FILE)
    out = where.out
    if not p.release:
        raise UserError(
            "pin.toml names no release twin of the pin, so no stock wheel stands for main;"
            " pin a commit that has one (`patchkit apply --release`)"
        )
    stock, me = str(where.stock_python), [python, "-m", "patchkit"]
    tests, bench = (
        where.aot.worktree / "python" / "tests",
        where.aot.worktree / "benchmarks" / "python",
    )
    step = mlx_build.Step
    steps = [
        step("stock", "main: a venv of its own with the release wheel of the pin",
             [python, "-m", "venv", str(out / "stock-venv")], out),
        step("stock", f"mlx=={p.release} from PyPI",
             [stock, "-m", "pip", "install", "--quiet", f"mlx=={p.release}"], out),
        step("device", "the GPU's name and generation",
             [stock, "-c", DEVICE_PROBE, str(out / "device.json")], out),
        step("build", "the branch as shipped: MLX's tests and parity on the GPU",
             [*me, "build", "--backend", "metal", "--record-dir", str(out / "aot")], root,
             ok_codes=(0, 1)),
    ]  # fmt: skip
    if jit:
        steps.append(step(
            "build-jit", "the branch with MLX_METAL_JIT=ON: the same tests and parity",
            [*me, "build", "--backend", "metal", f"--cmake-arg={JIT_ARG}",
             "--record-dir", str(out / "jit")], root, ok_codes=(0, 1)))  # fmt: skip
    steps += [
        step("main-tests", "the branch's test file on main: the PR's tests must fail on gen 15+",
             [stock, "-m", "unittest", "-v", TEST_FILE], tests, ok_codes=(0, 1)),
        step("bench-main", "the PR's benchmark on main",
             [stock, BENCH, "--json", str(out / "bench-main.json")], bench),
        step("bench-pr", "the PR's benchmark on the branch",
             [str(where.aot.python), BENCH, "--json", str(out / "bench-pr.json")], bench),
    ]  # fmt: skip
    return steps


def run(steps: list[mlx_build.Step], out: Path, progress: Any) -> dict[str, int]:
    """Run every step (a failed one does not stop the rest: the report says what is
    missing), each one's output in ``out/<stage>.log``; returns each stage's exit code."""
    out.mkdir(parents=True, exist_ok=True)
    codes: dict[str, int] = {}
    for s in steps:
        progress(f"[{s.stage}] {s.why}")
        with (out / f"{s.stage}.log").open("a") as log:
            log.write(f"$ {s.shell()}\n")
            log.flush()
            proc = subprocess.run(s.argv, cwd=s.cwd, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **s.env}, check=False)  # fmt: skip
        codes[s.stage] = proc.returncode if proc.returncode not in s.ok_codes else 0
        if proc.returncode not in s.ok_codes:
            progress(f"[{s.stage}] exit {proc.returncode}; see {out / f'{s.stage}.log'}")
    (out / "steps.json").write_text(json.dumps(codes, indent=1))
    return codes


# --- the report: every number read from a step's own file ----------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main_tests(log: str) -> dict[str, Any]:
    """unittest's counts on main, and which of the PR's tests failed there."""
    lines = log.splitlines()
    problems = mlx_build.unittest_problems(lines)
    return {
        "counts": mlx_build.unittest_counts(lines),
        "pr_tests_failing": [t for t in PR_TESTS if any(t in p for p in problems)],
        "pr_tests_run": [t for t in PR_TESTS if re.search(rf"^{t} \(", log, re.M)],
    }


def bench_rows(main: dict[str, Any], pr: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark's cases side by side (the same cases in the same order, by key)."""
    key = ("mode", "bits", "K", "N", "M")
    rows = []
    for a, b in zip(main["results"], pr["results"], strict=True):
        if [a[k] for k in key] != [b[k] for k in key]:
            raise UserError("the two benchmark files hold different cases; rerun both")
        rows.append({**{k: a[k] for k in key}, "main_ms": a["batched"], "pr_ms": b["batched"],
                     "ratio": b["batched"] / a["batched"],
                     "rows_match": [a["rows_match"], b["rows_match"]]})  # fmt: skip
    return rows


def kernel_compile_ms(ninja_log: str) -> dict[str, int]:
    """Per Metal kernel target (``.air``, ``.metallib``), the milliseconds ninja logged."""
    found: dict[str, int] = {}
    for line in ninja_log.splitlines():
        parts = line.split("\t")
        if len(parts) == 5 and parts[3].endswith((".air", ".metallib")):
            found[parts[3]] = int(parts[1]) - int(parts[0])  # the last build of each wins
    return found


def _metallib(venv: Path) -> int | None:
    libs = sorted(venv.glob("lib/python*/site-packages/mlx/lib/mlx.metallib"))
    return libs[0].stat().st_size if libs else None


def report(where: Paths) -> tuple[dict[str, Any], str]:
    """The report's JSON and Markdown from the files the steps wrote; a missing file is a
    section that says so, never a number."""
    out = where.out
    data: dict[str, Any] = {"device": _read_json(out / "device.json"),
                            "steps": _read_json(out / "steps.json")}  # fmt: skip
    for name, folder in (("aot", "aot"), ("jit", "jit")):
        data[name] = _read_json(out / folder / "build-metal.json")
    log = out / "main-tests.log"
    data["main_tests"] = main_tests(log.read_text()) if log.is_file() else None
    main, pr = _read_json(out / "bench-main.json"), _read_json(out / "bench-pr.json")
    data["bench"] = bench_rows(main, pr) if main and pr else None
    data["metallib_bytes"] = {
        "main": _metallib(out / "stock-venv"),
        "pr": _metallib(where.aot.venv),
    }
    ninja = sorted(where.aot.worktree.glob("build/**/.ninja_log"))
    data["pr_kernel_compile_ms"] = kernel_compile_ms(ninja[0].read_text()) if ninja else None
    return data, markdown(data)


def _build_line(rec: dict[str, Any] | None, what: str) -> str:
    if rec is None:
        return f"- {what}: no record (the step failed or was skipped; see its log)"
    t, p = rec.get("tests"), rec.get("parity", {})
    tests = mlx_build.tests_line(t).removeprefix("- ")
    return (f"- {what}: {tests}; parity {p.get('rows_differing')} of {p.get('rows')} rows differ"
            f" (kernel paths {', '.join(p.get('kernel_paths', []))})")  # fmt: skip


def markdown(d: dict[str, Any]) -> str:
    """The report to paste into the PR, facts only; the submitter writes the prose."""
    dev = d.get("device") or {}
    lines = ["## Measured on a Mac (`patchkit mac-report`)", "",
             f"- GPU: {dev.get('device_name', 'unknown')}, {dev.get('architecture', 'unknown')}",
             _build_line(d.get("aot"), "branch, AOT build"),
             _build_line(d.get("jit"), "branch, `MLX_METAL_JIT=ON`")]  # fmt: skip
    mt = d.get("main_tests")
    if mt is None:
        lines.append("- main (release wheel): the branch's test file did not run")
    else:
        failing = ", ".join(mt["pr_tests_failing"]) or "none"
        lines.append(f"- main (release wheel), the branch's test file: {mt['counts']}; the PR's"
                     f" tests failing there: {failing}")  # fmt: skip
    sizes = d.get("metallib_bytes") or {}
    lines.append(f"- mlx.metallib: main {sizes.get('main')} bytes, branch {sizes.get('pr')} bytes")
    compile_ms = d.get("pr_kernel_compile_ms")
    if compile_ms:
        q = {t: ms for t, ms in compile_ms.items() if "quantized" in t}
        lines.append(
            f"- branch, ninja's time for the quantized kernels: {sum(q.values())} ms"
            f" ({len(q)} targets); main's is not measured (main is not built)"
        )
    lines += ["", "Not covered: main under `MLX_METAL_JIT=ON` (main is not built here).", ""]
    rows = d.get("bench")
    if rows:
        lines += [
            "| mode | bits | K | N | M | main ms | PR ms | PR / main | rows = M = 1 (main, PR) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [f"| {r['mode']} | {r['bits'] or '-'} | {r['K']} | {r['N']} | {r['M']} |"
                  f" {r['main_ms']:.4f} | {r['pr_ms']:.4f} | {r['ratio']:.2f} |"
                  f" {r['rows_match'][0]}, {r['rows_match'][1]} |" for r in rows]  # fmt: skip
    else:
        lines.append("Benchmark: not produced (see bench-main.log, bench-pr.log).")
    return "\n".join(lines) + "\n"
