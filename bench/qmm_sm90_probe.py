"""Probe stock MLX's `qmm_sm90` on an H100/H200: which calls come out wrong, and how.

    python3 bench/qmm_sm90_probe.py run [--full] > ARM.txt   # with the MLX to probe importable
    python3 bench/qmm_sm90_probe.py page STOCK.txt BUILD.txt --out docs/results/qmm-sm90-probe

MLX's own `test_qmm`, `test_qmv` and `test_qmv_wide` fail on sm90 exactly in the subtests
that reach `qmm_sm90`; its support test takes only K == group size there (K of 64 or 128),
so the tests hold no case of that kernel with K over the group size (`docs/cuda.md`).
Each case here runs `mx.quantized_matmul` three times into buffers first filled with NaN
and freed, against float32 math on the CPU (and the same with TF32-rounded operands,
which sm90 uses for float32), and prints one line: the largest error over the reference's
standard deviation, the rows and columns that are off, whether the three runs agree,
whether any output was never written, and which JIT modules the case compiled (which
kernel it reached, where it compiled one). The K = 2 * group case is the control that
does not reach `qmm_sm90`.
It patches nothing: run it with stock wheels or any build. ``page`` puts runs' printed
output side by side (each arm a column: stock's wheels, then a build with the series' change
that keeps `qmm_sm90` off), with the command and the hardware.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

# (dtype, M, N, K, group, bits, batch, batched weights)
CASES = [
    ("float16", 8, 128, 128, 128, 4, 0, False),  # test_qmm's shape, M = 8
    ("float16", 32, 128, 128, 128, 4, 0, False),  # ... M = 32 (a failing subtest)
    ("float16", 300, 128, 128, 128, 4, 0, False),  # three row tiles
    ("float16", 16, 128, 128, 128, 4, 3, False),  # a batch over one weight matrix
    ("float16", 16, 128, 128, 128, 4, 3, True),  # batched weights
    ("float16", 32, 256, 128, 128, 4, 0, False),  # a 256-wide tile
    ("float16", 512, 8192, 128, 128, 4, 0, False),  # large x, weights and output
    ("float16", 32, 128, 256, 128, 4, 0, False),  # control: K = 2 * group, another kernel
    ("float32", 32, 128, 128, 128, 4, 0, False),  # float32 (TF32 on sm90)
    ("float32", 1, 128, 128, 128, 4, 3, False),  # test_qmv's batched M = 1
    ("float32", 1, 128, 128, 128, 4, 3, True),
]
MORE = [
    ("float16", 512, 65536, 128, 128, 4, 0, False),  # every operand over 128 KiB
    ("float16", 32, 128, 128, 128, 8, 0, False),
    ("bfloat16", 32, 128, 128, 128, 4, 0, False),
    ("float16", 32, 16, 128, 128, 4, 0, False),  # the narrowest tile
    ("float16", 32, 128, 64, 64, 4, 0, False),
    ("float32", 1, 256, 64, 64, 4, 3, False),
    ("float32", 4, 256, 128, 128, 4, 0, False),
    ("float32", 32, 128, 256, 128, 4, 0, False),  # control in float32
]
OFF = 0.25  # a value off by more than this many standard deviations is wrong, not rounded


def tf32(mx, a):
    """``a`` (float32) rounded to TF32's 10-bit mantissa, to nearest."""
    return mx.view((mx.view(a, mx.uint32) + 0x1000) & 0xFFFFE000, mx.float32)


FIELDS = ("dtype", "M", "N", "K", "group", "bits", "batch", "batched_w")


def measure(mx, cache: str, case: tuple) -> dict:
    """One case's findings: the case's fields, then what the call gave."""
    dtype, m, n, k, group, bits, batch, batched_w = case
    dt = getattr(mx, dtype)
    kx, kw = mx.random.split(mx.random.key(1))
    lead = (batch,) if batch else ()
    x = mx.random.normal((*lead, m, k), key=kx).astype(dt)
    w = mx.random.normal((*(lead if batched_w else ()), n, k), key=kw).astype(dt)
    wq, scales, biases = mx.quantize(w, group, bits)
    mx.eval(x, wq, scales, biases)
    seen = set(os.listdir(cache))
    poison = [mx.full((*x.shape[:-1], n), float("nan"), dt) for _ in range(3)]
    mx.eval(poison)
    del poison  # freed: the allocator hands these buffers out next
    ys = [mx.quantized_matmul(x, wq, scales, biases, True, group, bits) for _ in range(3)]
    mx.eval(ys)
    compiled = sorted(f[:-4] for f in set(os.listdir(cache)) - seen if f.endswith(".ptx"))
    with mx.stream(mx.cpu):
        xf = x.astype(mx.float32)
        wf = mx.dequantize(wq, scales, biases, group, bits).astype(mx.float32)
        ref = xf @ mx.swapaxes(wf, -1, -2)
        ref_tf32 = tf32(mx, xf) @ mx.swapaxes(tf32(mx, wf), -1, -2)
        y = ys[0].astype(mx.float32)
        sd = ref.std().item()
        err = (y - ref).abs().reshape(-1, m, n)
        row_off = (err.max(axis=(0, 2)) > OFF * sd).tolist()
        col_off = (err.max(axis=(0, 1)) > OFF * sd).tolist()
        return {
            **dict(zip(FIELDS, case, strict=True)),
            "err_over_std": err.max().item() / sd,
            "tf32_err_over_std": (y - ref_tf32).abs().max().item() / sd,
            "rows_off": [i for i, off in enumerate(row_off) if off],
            "cols_off": [j for j, off in enumerate(col_off) if off],
            "runs_disagree": max((ys[0] - t).abs().max().item() for t in ys[1:]),
            "unwritten": bool(mx.isnan(y).any().item()),
            "jit": compiled,
        }


def line(found: dict) -> str:
    """One case's line, as ``run`` prints it."""
    rows, cols = found["rows_off"], found["cols_off"]
    return (
        f"{found['dtype']:>8} M={found['M']:<3} N={found['N']:<5} K={found['K']:<3} "
        f"group={found['group']:<3} bits={found['bits']} B={found['batch']} "
        f"batched_w={int(found['batched_w'])} err/std={found['err_over_std']:.1e} "
        f"vs_tf32={found['tf32_err_over_std']:.1e} rows_off={len(rows)}{rows[:3]} "
        f"cols_off={len(cols)}{cols[:3]} runs_disagree={found['runs_disagree']:.0e} "
        f"unwritten={int(found['unwritten'])} jit={found['jit'] or '-'}"
    )


def hardware() -> str:
    """The GPU as nvidia-smi names it, its driver and memory ("unknown" without one)."""
    query = "--query-gpu=name,driver_version,memory.total"
    try:
        done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        return done.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="probe the importable MLX; one line per case")
    r.add_argument("--full", action="store_true",
                   help="also 8-bit, bfloat16, more shapes (minutes on a CPU)")  # fmt: skip
    pg = sub.add_parser("page", help="runs' printed output side by side, as .md and .json")
    pg.add_argument("runs", type=Path, nargs="+", help="what `run` printed, one file per arm")
    pg.add_argument("--out", type=Path, required=True, help="path without extension")
    pg.add_argument("--hardware", help="the GPU, where a run's header does not name it")
    args = ap.parse_args()
    if args.cmd == "page":
        try:
            runs = [parse_run(f.read_text()) for f in args.runs]
        except (OSError, ValueError) as e:
            raise SystemExit(f"page: {e}") from None
        page(runs, args.out, args.hardware)
        return
    # A JIT cache of its own (removed after the run, unless MLX_PTX_CACHE_DIR names one),
    # so that "jit=" names what each case compiled.
    with tempfile.TemporaryDirectory(prefix="qmm-probe-") as own:
        cache = os.environ.setdefault("MLX_PTX_CACHE_DIR", own)
        os.makedirs(cache, exist_ok=True)
        run(args.full, cache)


def run(full: bool, cache: str) -> None:
    """Print the header and one line per case, with ``cache`` as MLX's JIT cache. The
    printed lines are the record (``page`` reads them): a run cut off keeps its cases."""
    import mlx.core as mx

    packages = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("mlx")
    )
    print(f"MLX {mx.__version__} on {mx.default_device()}; packages: {', '.join(packages)}; "
          f"GPU: {hardware()}", flush=True)  # fmt: skip
    for case in CASES + (MORE if full else []):
        print(line(measure(mx, cache, case)), flush=True)


HEADER = re.compile(r"MLX (?P<mlx>\S+) on (?P<device>.+?); packages: (?P<packages>.*?)"
                    r"(?:; GPU: (?P<gpu>.*))?$")  # fmt: skip
LINE = re.compile(
    r"\s*(?P<dtype>\w+) M=(?P<M>\d+)\s+N=(?P<N>\d+)\s+K=(?P<K>\d+)\s+group=(?P<group>\d+)\s+"
    r"bits=(?P<bits>\d+) B=(?P<batch>\d+) batched_w=(?P<batched_w>[01]) "
    r"err/std=(?P<err_over_std>\S+) vs_tf32=(?P<tf32_err_over_std>\S+) "
    r"rows_off=(?P<rows_off>\d+)\[.*?\] cols_off=(?P<cols_off>\d+)\[.*?\] "
    r"runs_disagree=(?P<runs_disagree>\S+) unwritten=(?P<unwritten>[01]) jit=(?P<jit>.*)$"
)


def parse_run(text: str) -> dict:
    """A run's printed output as data: its header, then per case the fields of ``line``
    (rows and columns off as counts). Lines of anything else are refused."""
    lines = text.splitlines()
    head = HEADER.match(lines[0]) if lines else None
    if not head:
        raise ValueError("not the output of `bench/qmm_sm90_probe.py run` (no header line)")
    cases = []
    for text_line in lines[1:]:
        m = LINE.match(text_line)
        if not m:
            raise ValueError(f"not a case line of the probe: {text_line[:80]!r}")
        g = m.groupdict()
        case = (g["dtype"], *(int(g[f]) for f in FIELDS[1:7]), g["batched_w"] == "1")
        if case not in CASES + MORE:
            raise ValueError(f"a case this probe does not have: {case}")
        cases.append({
            **dict(zip(FIELDS, case, strict=True)),
            **{f: _number(g[f]) for f in ("err_over_std", "tf32_err_over_std", "runs_disagree")},
            "rows_off": int(g["rows_off"]), "cols_off": int(g["cols_off"]),
            "unwritten": g["unwritten"] == "1",
            "jit": [] if g["jit"] == "-" else ast.literal_eval(g["jit"]),
        })  # fmt: skip
    return {**head.groupdict(), "cases": cases}


def _number(text: str) -> float | None:
    """A printed number; None for nan (a NaN in an output: no error to give)."""
    value = float(text)
    return None if math.isnan(value) else value


def _e(value: float | None) -> str:
    return "nan" if value is None else f"{value:.1e}"


def _arm_name(run: dict) -> str:
    """What an arm is, from its MLX version: patchkit's builds carry ``+patchkit.``."""
    return "a patchkit build" if "+patchkit." in run["mlx"] else "stock MLX"


def _rows(c: dict) -> str:
    """Rows off, of M; none to count where the output holds a NaN (a NaN compares false)."""
    return "n/a" if c["err_over_std"] is None else f"{c['rows_off']} of {c['M']}"


def compiled_sm90(found: dict) -> bool:
    """Whether the case compiled a `qmm_sm90` module (MLX names its JIT modules after the
    kernel). A case that reuses a module an earlier case compiled compiles none."""
    return any(name.startswith("qmm_sm90") for name in found["jit"])


def wrong(found: dict) -> bool:
    """Off by more than ``OFF`` standard deviations somewhere, or never written."""
    return found["rows_off"] > 0 or found["unwritten"]


def _cell(c: dict | None) -> str:
    if c is None:
        return "not run"
    return (
        f"{_e(c['err_over_std'])}, {_e(c['tf32_err_over_std'])}, {_rows(c)}, "
        f"{'yes' if c['unwritten'] else 'no'}, {_e(c['runs_disagree'])}, "
        f"{'yes' if compiled_sm90(c) else 'no'}" + (" **wrong**" if wrong(c) else "")
    )


def page(runs: list[dict], out: Path, hardware_given: str | None = None) -> None:
    """``out``.md and .json: each arm's finding per case, side by side, in the probe's
    order; a case an arm's run did not reach (cut off) reads "not run"."""
    gpus = {run["gpu"] or hardware_given or "not recorded" for run in runs}
    everything = CASES + MORE
    found = [{tuple(c[f] for f in FIELDS): c for c in run["cases"]} for run in runs]
    shown = [case for case in everything if any(case in arm for arm in found)]
    lines = [
        "# `qmm_sm90` probed through MLX: which calls come out wrong",
        "",
        f"- Hardware: {'; '.join(sorted(gpus))}.",
        *(
            f"- Arm {i + 1}, {_arm_name(run)}: MLX {run['mlx']} "
            f"({run['packages'] or 'no mlx package'}), on "
            f"{run['device']}: {len(run['cases'])} of the {len(everything)} cases of `--full`"
            + ("" if len(run["cases"]) == len(everything) else " (the run was cut off)")
            + "."
            for i, run in enumerate(runs)
        ),
        f"- A value off by more than {OFF} standard deviations of the float32 reference "
        "(CPU) is wrong, not rounded. `vs TF32`: the error against the reference with "
        "operands rounded to TF32, which sm90 uses for float32. `unwritten`: the first "
        "call's output kept a NaN of the buffers filled before, so part of it was never "
        "written (its error then reads nan, its rows off n/a). `runs differ`: the largest "
        "difference between the three calls' outputs (nan where one holds a NaN). `sm90`: "
        "the case compiled a `qmm_sm90` module (MLX's JIT names its modules after the "
        "kernel; a case that reuses one an earlier case compiled shows none, so `no` is "
        "not proof of another kernel). K = 2 x group is the control that does not reach "
        "`qmm_sm90`.",
        "- Commands: `python3 bench/qmm_sm90_probe.py run --full > ARM.txt` with each arm's "
        "MLX importable, then `python3 bench/qmm_sm90_probe.py page "
        + " ".join(f"ARM{i + 1}.txt" for i in range(len(runs)))
        + f" --out docs/results/{out.name}"
        + (
            " --hardware GPU` (the GPU the runs ran on, which a run's header did not name)."
            if any(not run["gpu"] for run in runs)
            else "`."
        ),
        "",
    ]
    for i, run in enumerate(runs):
        bad = [c for c in run["cases"] if wrong(c)]
        lines.append(
            f"- Arm {i + 1} (MLX {run['mlx']}): {len(bad)} of the {len(run['cases'])} cases "
            f"run wrong ({sum(c['unwritten'] for c in bad)} with the first call's output partly "
            "unwritten); "
            f"{sum(map(compiled_sm90, run['cases']))} cases compiled a `qmm_sm90` module, "
            f"{sum(map(compiled_sm90, bad))} of them wrong."
        )
    heads = " | ".join(f"arm {i + 1}: err/std, vs TF32, rows off, unwritten, runs differ, sm90"
                       for i in range(len(runs)))  # fmt: skip
    lines += ["", f"| dtype | M | N | K | group | bits | B | batched w | {heads} |",
              "|" + "---|" * (8 + len(runs))]  # fmt: skip
    for case in shown:
        dtype, m, n, k, group, bits, batch, batched_w = case
        cells = " | ".join(_cell(arm.get(case)) for arm in found)
        lines.append(f"| {dtype} | {m} | {n} | {k} | {group} | {bits} | {batch} | "
                     f"{'yes' if batched_w else 'no'} | {cells} |")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    record = {"hardware": sorted(gpus), "off": OFF, "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
