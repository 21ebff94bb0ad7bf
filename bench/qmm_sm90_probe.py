"""Probe stock MLX's `qmm_sm90` on an H100/H200: which calls come out wrong, and how.

    python3 bench/qmm_sm90_probe.py run [--full] [--json ARM.json]  # the MLX to probe importable
    python3 bench/qmm_sm90_probe.py page STOCK.json BUILD.json --out docs/results/qmm-sm90-probe

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
It patches nothing: run it with stock wheels or any build. ``page`` puts the runs' JSON
side by side (each arm a column: stock's wheels, then a build with the series' change
that keeps `qmm_sm90` off), with the command and the hardware.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
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


def probe(mx, cache: str, case: tuple) -> str:
    """One case's line."""
    return line(measure(mx, cache, case))


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
    r.add_argument("--json", type=Path, help="also write the findings here")
    pg = sub.add_parser("page", help="the runs' JSON side by side, as .md and .json")
    pg.add_argument("runs", type=Path, nargs="+", help="run --json files, one per arm")
    pg.add_argument("--out", type=Path, required=True, help="path without extension")
    args = ap.parse_args()
    if args.cmd == "page":
        try:
            reports = [json.loads(f.read_text()) for f in args.runs]
        except (OSError, ValueError) as e:
            raise SystemExit(f"page: cannot read a run: {e}") from None
        page(reports, args.out)
        return
    # A JIT cache of its own (removed after the run, unless MLX_PTX_CACHE_DIR names one),
    # so that "jit=" names what each case compiled.
    with tempfile.TemporaryDirectory(prefix="qmm-probe-") as own:
        cache = os.environ.setdefault("MLX_PTX_CACHE_DIR", own)
        os.makedirs(cache, exist_ok=True)
        report = run(args.full, cache)
    if args.json:
        report["command"] = "python3 bench/qmm_sm90_probe.py " + shlex.join(sys.argv[1:])
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def run(full: bool, cache: str) -> dict:
    """Print the header and one line per case, with ``cache`` as MLX's JIT cache; return
    the findings with the MLX and the hardware they came from."""
    import mlx.core as mx

    packages = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("mlx")
    )
    print(f"MLX {mx.__version__} on {mx.default_device()}; packages: {', '.join(packages)}")
    found = []
    for case in CASES + (MORE if full else []):
        found.append(measure(mx, cache, case))
        print(line(found[-1]), flush=True)
    return {"mlx": mx.__version__, "device": str(mx.default_device()), "packages": packages,
            "gpu": hardware(), "cpu": platform.machine(), "off": OFF, "cases": found}  # fmt: skip


def compiled_sm90(found: dict) -> bool:
    """Whether the case compiled a `qmm_sm90` module (MLX names its JIT modules after the
    kernel). A case that reuses a module an earlier case compiled compiles none."""
    return any(name.startswith("qmm_sm90") for name in found["jit"])


def wrong(found: dict) -> bool:
    """Off by more than ``OFF`` standard deviations somewhere, or never written."""
    return bool(found["rows_off"]) or found["unwritten"]


def page(reports: list[dict], out: Path) -> None:
    """``out``.md and .json: each arm's finding per case, side by side."""
    keys = [tuple(c[f] for f in FIELDS) for c in reports[0]["cases"]]
    for rep in reports[1:]:
        if [tuple(c[f] for f in FIELDS) for c in rep["cases"]] != keys:
            raise SystemExit("page: the runs probed other cases (run each with the same --full)")
    gpus = sorted({rep["gpu"] for rep in reports})
    lines = [
        "# `qmm_sm90` probed through MLX: which calls come out wrong",
        "",
        f"- Hardware: {'; '.join(gpus)}.",
        *(
            f"- Arm {i + 1}: MLX {rep['mlx']} ({', '.join(rep['packages']) or 'no mlx package'}),"
            f" on {rep['device']}: `{rep.get('command', 'python3 bench/qmm_sm90_probe.py run')}`"
            for i, rep in enumerate(reports)
        ),
        f"- A value off by more than {reports[0]['off']} standard deviations of the float32 "
        "reference (CPU) is wrong, not rounded; `unwritten`: the output kept a NaN of the "
        "buffers filled before; `sm90`: the case compiled a `qmm_sm90` module (MLX's JIT "
        "names its modules after the kernel; a case that reuses one an earlier case "
        "compiled shows none, so `no` is not proof of another kernel). `vs TF32`: the "
        "error against the reference with operands rounded to TF32, which sm90 uses for "
        "float32. K = 2 x group is the control that does not reach `qmm_sm90`.",
        "- Page: `python3 bench/qmm_sm90_probe.py page "
        + " ".join(f"ARM{i + 1}.json" for i in range(len(reports)))
        + f" --out docs/results/{out.name}`.",
        "",
    ]
    for i, rep in enumerate(reports):
        bad = [c for c in rep["cases"] if wrong(c)]
        lines.append(
            f"Arm {i + 1} (MLX {rep['mlx']}): {len(bad)} of {len(rep['cases'])} cases wrong, "
            f"{sum(map(compiled_sm90, bad))} of them compiling a `qmm_sm90` module; "
            f"{sum(map(compiled_sm90, rep['cases']))} cases compile one in all."
        )
    lines += [
        "",
        "| dtype | M | N | K | group | bits | B | batched w | "
        + " | ".join(
            f"arm {i + 1}: err/std, vs TF32, rows off, unwritten, sm90" for i in range(len(reports))
        )
        + " |",
        "|" + "---|" * (8 + len(reports)),
    ]
    for n, key in enumerate(keys):
        cells = []
        for rep in reports:
            c = rep["cases"][n]
            cells.append(
                f"{c['err_over_std']:.1e}, {c['tf32_err_over_std']:.1e}, "
                f"{len(c['rows_off'])} of {c['M']}, {'yes' if c['unwritten'] else 'no'}, "
                f"{'yes' if compiled_sm90(c) else 'no'}" + (" **wrong**" if wrong(c) else "")
            )
        dtype, m, nn, k, group, bits, batch, batched_w = key
        lines.append(f"| {dtype} | {m} | {nn} | {k} | {group} | {bits} | {batch} | "
                     f"{'yes' if batched_w else 'no'} | " + " | ".join(cells) + " |")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"runs": reports}, indent=1) + "\n")


if __name__ == "__main__":
    main()
