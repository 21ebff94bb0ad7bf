"""Nsight Compute (ncu) readings of MLX's quantized matmul kernels, one ncu process a case.

  python3 bench/mlx_ncu.py run --arm pr=PYTHON[:SITE] [--arm stock=PYTHON[:SITE]] \
      --json OUT.json [--ncu ncu] [--quick] [--dtype bfloat16] [--group-size 64]
  python3 bench/mlx_ncu.py run --lib pr=.device/qmv/patched.so --lib stock=.device/qmv/stock.so \
      --json OUT.json ...   # the libraries of bench/cuda_qmv.py build, called through torch
  python3 bench/mlx_ncu.py page RUN.json --out docs/results/cuda-ncu \
      [--build-record BUILD/build-cuda.json]   # .json, .md
  python3 bench/mlx_ncu.py worker --case JSON   # internal: the profiled call

Each arm is an interpreter that imports its own MLX (``SITE``, when given, goes first on its
``PYTHONPATH``), as in ``bench/mlx_qmv.py``. The worker quantizes and warms up outside the
profiled range (``--profile-from-start off``), so ncu sees only the kernels of one call:
their time, DRAM traffic, registers, launch shape and occupancy. ``bench/mlx_qmv.py`` times;
this file says why a time is what it is.

``--lib`` arms profile the libraries ``bench/cuda_qmv.py build`` compiles (one qmv.cu with
MLX's nvcc flags, called from torch): the same kernels without MLX's build, for iterating
on a GPU host where no MLX build is at hand; ``--arm`` is what a user of MLX runs.

A page made with ``--build-record`` (the ``pr`` arm's ``patchkit build`` record) is a
record of that build's inputs, as the speed page is (decision 0008): it refuses a run
with a failed case, or whose ``pr`` arm is another MLX. ncu is ``--ncu``, else the one
beside ``nvcc``, else on ``PATH``.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_qmv  # the arms' convention and the host's description (it puts patchkit on the path)

from patchkit.util import proc
from patchkit.verify.harness import cuda  # a layer's bytes (torch only when called)

METRICS = [
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
    "launch__block_size",
    "launch__grid_size",
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy
    "sm__maximum_warps_per_active_cycle_pct",  # theoretical occupancy
    "launch__occupancy_limit_registers",
]
SHAPES = mlx_qmv.SHAPES  # (K, N): the speed page's layers
QUICK_SHAPES = [(4096, 14336)]
MS, QUICK_MS = (1, 16, 8), (1, 16)
BITS, QUICK_BITS = (4, 8), (4,)


def cases(quick: bool, dtype: str = "bfloat16", group: int = 64) -> list[dict[str, Any]]:
    """One profiled call each: a layer (K, N), its weights' bits, and M vectors."""
    return [
        {"K": K, "N": N, "bits": bits, "M": M, "dtype": dtype, "group": group}
        for (K, N) in (QUICK_SHAPES if quick else SHAPES)
        for bits in (QUICK_BITS if quick else BITS)
        for M in (QUICK_MS if quick else MS)
    ]


def read_bytes(case: dict[str, Any]) -> int:
    """What the call must read: the harness's weights, scales and biases, and x (2-byte
    elements: bfloat16 or float16)."""
    cfg = cuda.Config(case["K"], case["N"], case["bits"], case["group"], case["dtype"])
    return cuda.weight_bytes(cfg) + case["M"] * case["K"] * 2


def parse_csv(text: str) -> list[dict[str, Any]]:
    """ncu's ``--csv --page raw`` output: one dict a kernel, its metrics as floats.

    ncu prints its own lines (``==PROF==``, ``==WARNING==``) and the program's before the
    table, and a units row after the header; neither is a kernel.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels = []
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not (row.get("ID") or "").strip().isdigit():
            continue
        kernel: dict[str, Any] = {"name": row.get("Kernel Name", "")}
        for metric in METRICS:
            value = (row.get(metric) or "").replace(",", "").strip()
            try:
                kernel[metric] = float(value)
            except ValueError:
                kernel[metric] = None
        kernels.append(kernel)
    return kernels


def derived(case: dict[str, Any], kernels: list[dict[str, Any]]) -> dict[str, Any]:
    """Total time, the bytes the call must read, and the main kernel's read bandwidth."""
    time = "gpu__time_duration.sum"  # ns
    main = max(kernels, key=lambda k: k[time] or 0.0)
    ns, read = main[time], main["dram__bytes_read.sum"]
    return {
        "duration_us": sum(k[time] or 0.0 for k in kernels) / 1e3,
        "bytes": read_bytes(case),
        "main_kernel": main["name"],
        "read_gb_s": read / ns if ns and read is not None else None,  # bytes/ns = GB/s
        # Over 1: weights read more than once (a launch per vector, say); under 1: from L2.
        "read_over_needed": sum(k["dram__bytes_read.sum"] or 0.0 for k in kernels)
        / read_bytes(case),
    }


# One ncu process: a hung profiler must not hold the whole run; a qmm call outside the range
# may first compile its kernel with NVRTC (tens of seconds) where no JIT cache has it.
CASE_TIMEOUT_S = 300


def ncu_case(
    ncu: str, python: str, site: str, lib: str | None, case: dict[str, Any]
) -> dict[str, Any]:
    """One ncu process over one case's call; a failure is kept as the row's error."""
    env = mlx_qmv.arm_env(site, dict(os.environ))
    cmd = [ncu, "--clock-control", "none", "--cache-control", "all",
           "--profile-from-start", "off", "--csv", "--page", "raw",
           "--metrics", ",".join(METRICS),
           python, __file__, "worker", "--case", json.dumps(case),
           *(["--lib", lib] if lib else [])]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CASE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"case": case, "error": f"{ncu}: {e}"}
    out = done.stdout + done.stderr
    kernels = parse_csv(done.stdout) if done.returncode == 0 else []
    if not kernels:
        return {"case": case, "error": "\n".join(out.strip().splitlines()[-5:])}
    return {"case": case, "kernels": kernels, **derived(case, kernels)}


def find_ncu(given: str | None) -> str:
    """ncu: ``given``, else beside ``nvcc`` (the toolkit MLX was built with), else on
    ``PATH``; a one-line exit where there is none."""
    found = proc.cuda_tool("ncu", given)
    if not found:
        sys.exit(f"mlx_ncu: no Nsight Compute ({given or 'ncu beside nvcc or on PATH'}): "
                 "pass --ncu PATH")  # fmt: skip
    return found


def ncu_version(ncu: str) -> str:
    try:
        done = subprocess.run([ncu, "--version"], capture_output=True, text=True)
    except OSError as e:
        return f"unavailable: {e}"
    return (done.stdout.strip().splitlines() or ["unknown"])[-1]


def run(a: argparse.Namespace) -> None:
    arms: dict[str, tuple[str, str, str | None]] = {}
    for spec in a.arm or []:
        name, _, where = spec.partition("=")
        python, site = proc.interpreter(where)
        arms[name] = (python, site, None)
    for spec in a.lib or []:
        name, _, path = spec.partition("=")
        arms[name] = (sys.executable, "", str(Path(path).resolve()))
    if not arms:
        sys.exit("mlx_ncu: give at least one --arm NAME=PYTHON[:SITE] or --lib NAME=PATH.so")
    a.ncu = find_ncu(a.ncu)
    report: dict[str, Any] = {
        "command": generic_command("python3 bench/mlx_ncu.py run " + shlex.join(sys.argv[2:])),
        "hardware": mlx_qmv.hardware(),
        "mlx": {
            name: _library(Path(lib)) if lib else _mlx_or_error(python, site)
            for name, (python, site, lib) in arms.items()
        },
        "ncu_version": ncu_version(a.ncu),
        "rows": [],
    }
    # Case by case, every arm in turn, the file rewritten after each row: a run cut short
    # keeps whole comparisons of the cases it reached.
    for case in cases(a.quick, a.dtype, a.group_size):
        for name, (python, site, lib) in arms.items():
            row = {"arm": name, **ncu_case(a.ncu, python, site, lib, case)}
            report["rows"].append(row)
            Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
            what = row.get("error", "").splitlines()[-1:] or [f"{row['duration_us']:.1f} us"]
            print(f"{name} {case}: {what[0]}", file=sys.stderr, flush=True)


# What an option's value becomes in a command a page shows: one host's paths as placeholders.
PLACEHOLDERS = {"--json": "ncu.json", "--ncu": "NCU"}


def _placeholder_arm(option: str, value: str) -> str:
    name = value.partition("=")[0]
    if option == "--lib":
        return f"{name}=LIBS/{name}.so"
    if name == "pr":
        return "pr=<cache>/builds/cuda-<pin>/venv/bin/python"
    return f"{name}={name.upper()}_PYTHON[:SITE]"


def generic_command(command: str) -> str:
    """``command`` with each arm's interpreter or library, the JSON and ncu as placeholders
    (they are one host's), every option that changes what is measured kept as given."""
    words = shlex.split(command)
    for i, word in enumerate(words[:-1]):
        if word in ("--arm", "--lib"):
            words[i + 1] = _placeholder_arm(word, words[i + 1])
        elif word in PLACEHOLDERS:
            words[i + 1] = PLACEHOLDERS[word]
    return " ".join(words)


def _library(lib: Path) -> str:
    """A harness library by its name and what its build compiled (the ``build.json``
    ``bench/cuda_qmv.py build`` leaves beside it), not by this host's path."""
    meta = lib.parent / "build.json"
    built = json.loads(meta.read_text()) if meta.is_file() else {}
    inputs = built.get("build_inputs_sha256", "unknown")[:16]
    return f"{lib.name} of bench/cuda_qmv.py build (build inputs {inputs}, {built.get('nvcc', '')})"


def _mlx_or_error(python: str, site: str) -> str:
    try:
        return mlx_qmv.mlx_of(python, site)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"unknown: {e}"


def _profiled(call: Any, sync: Any) -> None:
    """``call`` once to warm up (JIT compilation and lazy module loading stay out of the
    range), then once inside the profiled range."""
    call()
    sync()
    _profiler(True)
    call()
    sync()
    _profiler(False)


def _profiler(start: bool) -> None:
    """cudaProfilerStart/Stop in the loaded libcudart, else cuProfilerStart/Stop."""
    with open("/proc/self/maps") as maps:
        paths = [ln.split()[-1] for ln in maps if "libcudart.so" in ln]
    if paths:
        lib = ctypes.CDLL(paths[0])
        getattr(lib, "cudaProfilerStart" if start else "cudaProfilerStop")()
    else:
        lib = ctypes.CDLL("libcuda.so.1")
        getattr(lib, "cuProfilerStart" if start else "cuProfilerStop")()


def worker(case: dict[str, Any], lib: str | None) -> None:
    """One quantized matmul inside the profiled range, through MLX or, with ``lib``, one
    of the harness's libraries; the inputs are made outside it."""
    if lib:
        import torch

        cfg = cuda.Config(case["K"], case["N"], case["bits"], case["group"], case["dtype"])
        inp = cuda.make_inputs(cfg, case["M"], copies=1, seed=0)
        out = torch.empty(case["M"], case["N"], device="cuda", dtype=getattr(torch, case["dtype"]))
        library = cuda.Lib(Path(lib))
        _profiled(lambda: cuda.call(library, cfg, inp, inp["x"], out), torch.cuda.synchronize)
        return
    import mlx.core as mx

    dtype = getattr(mx, case["dtype"])
    group, bits = case["group"], case["bits"]
    x = mx.random.normal((case["M"], case["K"])).astype(dtype)
    w = mx.random.normal((case["N"], case["K"])).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    mx.eval(x, wq, scales, biases)

    def call() -> None:
        y = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)
        mx.eval(y)

    _profiled(call, mx.synchronize)


def short(name: str) -> str:
    """A kernel's name up to its template or parameter list, at most 40 characters."""
    return name.split("<")[0].split("(")[0].strip()[:40]


def _num(value: Any, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| shape (KxN) | bits | M | kernel | µs | DRAM read GB/s | DRAM % peak "
            "| call's DRAM read / bytes needed | regs | block | grid | occupancy theor. % "
            "| achieved % | error |")  # fmt: skip
    lines = [head, "|" + "---|" * 14]
    for row in rows:
        c = row["case"]
        lead = f"| {c['K']}x{c['N']} | {c['bits']} | {c['M']} "
        if "error" in row:
            error = " ".join(row["error"].split()).replace("|", "\\|")
            lines.append(lead + "|" + " |" * 10 + f" {error} |")
            continue
        for i, k in enumerate(row["kernels"]):
            ns, read = k["gpu__time_duration.sum"], k["dram__bytes_read.sum"]
            cells = [
                short(k["name"]),
                _num(ns / 1e3 if ns is not None else None, ".1f"),
                _num(read / ns if ns and read is not None else None, ".0f"),
                _num(k["dram__throughput.avg.pct_of_peak_sustained_elapsed"], ".1f"),
                _num(row.get("read_over_needed") if i == 0 else None, ".2f"),
                _num(k["launch__registers_per_thread"], ".0f"),
                _num(k["launch__block_size"], ".0f"),
                _num(k["launch__grid_size"], ".0f"),
                _num(k["sm__maximum_warps_per_active_cycle_pct"], ".1f"),
                _num(k["sm__warps_active.avg.pct_of_peak_sustained_active"], ".1f"),
                "",
            ]
            lines.append(lead + "| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profiled_build(report: dict[str, Any], build_record: dict[str, Any]) -> dict[str, str]:
    """What a page of this run is a record of: the ``pr`` arm's build (its wheel and build
    inputs, :func:`mlx_qmv.timed_build`), for a run whose every case has its readings."""
    if "pr" not in (report.get("mlx") or {}):
        raise SystemExit("--build-record: the run has no arm named pr")
    if failed := [row for row in report["rows"] if "error" in row]:
        first = " ".join(failed[0]["error"].split())[:200]
        raise SystemExit(f"--build-record: {len(failed)} of {len(report['rows'])} cases have "
                         f"no readings (first: {first}); no record of a partial run")  # fmt: skip
    return mlx_qmv.timed_build([report], build_record)


def page(report: dict[str, Any], out: Path, build: dict[str, str] | None = None) -> None:
    """OUT.json (the run, and with ``build`` the build it is a record of) and OUT.md (a
    table per arm)."""
    from patchkit.carry import mlx_build  # here: the workers run this file too

    record = {**report, "command": generic_command(report.get("command", ""))}
    if build:
        record["build"] = build
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    hardware = report.get("hardware", {})
    valid = (
        [mlx_build.valid_while(build["backend"], build["build_inputs_sha256"]) + "."]
        if build
        else []
    )
    page_command = (
        "; then `python3 bench/mlx_ncu.py page ncu.json --out docs/results/cuda-ncu "
        "--build-record build-cuda.json`"
        if build
        else ""
    )
    # The dtypes and group sizes the cases ran (one pair per run of `run`).
    inputs = sorted({f"{r['case']['dtype']} group {r['case']['group']}" for r in report["rows"]})
    md = [
        "# Quantized matmul kernels under Nsight Compute",
        "",
        f"- Command: `{record['command']}`" + page_command,
        *valid,
        f"- Hardware: {hardware.get('gpu', json.dumps(hardware))}; ncu "
        f"{report.get('ncu_version', '')}",
        f"- Inputs: affine quantization, {', '.join(inputs)}; random weights and x.",
        "- One ncu process a case, caches flushed before the profiled call (a cold call), "
        "clocks as the GPU sets them; every kernel the call launched is a row. DRAM % peak "
        "is of the memory's peak bandwidth as ncu knows it; occupancy in warps.",
    ]
    arms = list(dict.fromkeys(row["arm"] for row in report["rows"]))
    for arm in arms:
        mlx = (report.get("mlx") or {}).get(arm)
        md += ["", f"## {arm}" + (f" (MLX {mlx})" if mlx else ""), ""]
        md.append(table([row for row in report["rows"] if row["arm"] == arm]))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile each arm's calls, one ncu process a case")
    r.add_argument("--arm", action="append", help="NAME=PYTHON[:SITE]: an MLX to call")
    r.add_argument("--lib", action="append", help="NAME=PATH.so: a bench/cuda_qmv.py library")
    r.add_argument("--json", required=True)
    r.add_argument("--ncu", help="Nsight Compute (default: beside nvcc, else on PATH)")
    r.add_argument("--quick", action="store_true", help="one layer, 4-bit, M = 1 and 16")
    r.add_argument("--dtype", choices=mlx_qmv.DTYPES, default="bfloat16")
    r.add_argument("--group-size", type=int, choices=mlx_qmv.GROUPS, default=64)
    pg = sub.add_parser("page", help="the results page of a run: OUT.json/.md")
    pg.add_argument("run", type=Path)
    pg.add_argument("--out", required=True, type=Path, help="e.g. docs/results/cuda-ncu")
    pg.add_argument("--build-record", type=Path,
                    help="the pr arm's build-cuda.json: the page becomes its record")  # fmt: skip
    w = sub.add_parser("worker", help="internal: one profiled call")
    w.add_argument("--case", required=True)
    w.add_argument("--lib", help="a bench/cuda_qmv.py library, called through torch")
    a = ap.parse_args()
    if a.cmd == "worker":
        worker(json.loads(a.case), a.lib)
    elif a.cmd == "run":
        run(a)
    else:
        report = json.loads(a.run.read_text())
        build = (profiled_build(report, json.loads(a.build_record.read_text()))
                 if a.build_record else None)  # fmt: skip
        page(report, a.out, build)


if __name__ == "__main__":
    main()
