"""Stock MLX and the MLX `patchkit build` made, timed through ``mx.quantized_matmul``.

  python3 bench/mlx_qmv.py run --stock PYTHON[:SITE] --patched PYTHON[:SITE] \
      --json mlx_qmv.json [--quick]
  python3 bench/mlx_qmv.py report mlx_qmv.json [--plot mlx_qmv.png]

Each arm is an interpreter that imports its own MLX (``SITE``, when given, goes first on
its ``PYTHONPATH``: an unpacked stock wheel, say). The arms take turns, round after round,
on the same GPU in one run, and each time is the median over rounds. The floor is the
bytes a call reads over the bandwidth of an elementwise copy measured by the stock arm's
MLX on the same GPU.

Timing: a call's weights are cold (the arm cycles through copies of them that add up to
well over the L2), ``repeats`` calls are evaluated as one graph after a synchronize, and
the wall time per call is what MLX's user sees, launch costs included. Rows are compared
by ``patchkit parity``; this file only times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (K, N): Llama/Qwen-class projections, from 2**23 to 2**28 weights.
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
QUICK_SHAPES = [(4096, 4096), (4096, 14336)]
MS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
BITS = (4, 8)
DTYPE, GROUP = "bfloat16", 64
COLD_BYTES = 1 << 29  # the weight copies one arm cycles through: ten times an H200's L2
ARMS = {"stock": {}, "pr": {}}
COPY_BYTES = 1 << 30  # the elementwise copy the floor's bandwidth is measured with


def worker(cases: list[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    """Time every case in this process's MLX; one entry per case, microseconds per call."""
    import mlx.core as mx

    dtype = getattr(mx, DTYPE)
    src = mx.zeros((COPY_BYTES,), dtype=mx.uint8)
    mx.eval(src, src + 1)
    mx.synchronize()
    start = time.perf_counter()
    mx.eval([src + i for i in range(5)])
    mx.synchronize()
    out: list[dict[str, Any]] = [
        {"copy_bytes_per_s": 2 * 5 * COPY_BYTES / (time.perf_counter() - start)}
    ]
    del src
    for case in cases:
        K, N, bits = case["K"], case["N"], case["bits"]
        w = mx.random.normal((N, K)).astype(dtype)
        q = mx.quantize(w, group_size=GROUP, bits=bits)
        mx.eval(q)
        del w
        size = sum(a.nbytes for a in q)
        copies = [[a + 0 for a in q] for _ in range(max(2, min(32, COLD_BYTES // size)))]
        mx.eval(copies)
        for M in case["Ms"]:
            x = mx.random.normal((M, K)).astype(dtype)
            mx.eval(x)

            mx.eval(_calls(mx, x, copies, bits, len(copies)))  # warm: kernels, graph cache
            mx.synchronize()
            start = time.perf_counter()
            mx.eval(_calls(mx, x, copies, bits, repeats))
            mx.synchronize()
            us = (time.perf_counter() - start) / repeats * 1e6
            out.append({"K": K, "N": N, "bits": bits, "M": M, "us": us, "bytes": size})
        del copies
        mx.clear_cache()
    return out


def _calls(mx: Any, x: Any, copies: list[list[Any]], bits: int, n: int) -> list[Any]:
    """``n`` calls of ``x`` against the weight copies in turn (each read cold)."""
    return [mx.quantized_matmul(x, *copies[i % len(copies)], True, GROUP, bits) for i in range(n)]


def cases(quick: bool) -> list[dict[str, Any]]:
    return [
        {"K": K, "N": N, "bits": bits, "Ms": MS}
        for (K, N) in (QUICK_SHAPES if quick else SHAPES)
        for bits in BITS
    ]


def run_arm(python: str, site: str, env: dict[str, str], todo: list[dict[str, Any]],
            repeats: int) -> list[dict[str, Any]]:  # fmt: skip
    """One round of one arm: a fresh interpreter with its own MLX."""
    full = {**os.environ, **env}
    if site:
        full["PYTHONPATH"] = os.pathsep.join([site, full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    payload = json.dumps({"cases": todo, "repeats": repeats})
    done = subprocess.run(
        [python, __file__, "worker"], input=payload, capture_output=True, text=True, env=full
    )
    if done.returncode:
        raise SystemExit(f"{python} (arm) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def mlx_of(python: str, site: str) -> str:
    """The MLX version an arm imports."""
    env = {**os.environ, **({"PYTHONPATH": site} if site else {})}
    code = "import mlx.core as mx; print(mx.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()  # fmt: skip


def hardware() -> dict[str, Any]:
    query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
    try:
        gpu = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        gpu = "unknown"
    return {"gpu": gpu, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def run(a: argparse.Namespace) -> None:
    arms = {"stock": a.stock, "pr": a.patched}
    split = {name: [*spec.split(":", 1), ""][:2] for name, spec in arms.items()}
    todo = cases(a.quick)
    rounds: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in arms}
    for r in range(a.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            python, site = split[name]
            rounds[name].append(run_arm(python, site, ARMS[name], todo, a.repeats))
            print(f"round {r + 1}/{a.rounds}: {name} done", file=sys.stderr, flush=True)
    copy = statistics.median(rr[0]["copy_bytes_per_s"] for rr in rounds["stock"])
    rows = []
    for i, first in enumerate(rounds["stock"][0][1:], start=1):
        row = {k: first[k] for k in ("K", "N", "bits", "M", "bytes")}
        for name in arms:
            row[name + "_us"] = statistics.median(rr[i]["us"] for rr in rounds[name])
        row["floor_us"] = first["bytes"] / copy * 1e6
        rows.append(row)
    report = {
        "command": "python3 bench/mlx_qmv.py run " + " ".join(sys.argv[2:]),
        "dtype": DTYPE,
        "group_size": GROUP,
        "rounds": a.rounds,
        "repeats": a.repeats,
        "mlx": {name: mlx_of(*split[name]) for name in ("stock", "pr")},
        "hardware": hardware(),
        "copy_bytes_per_s": copy,
        "rows": rows,
    }
    Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


def table(report: dict[str, Any]) -> str:
    """Time per call (µs) and the ratio to stock, per layer and M."""
    lines = [
        "| bits | K x N | M | stock µs | PR µs | PR / stock | floor µs | floor / PR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        s, p, f = r["stock_us"], r["pr_us"], r["floor_us"]
        lines.append(
            f"| {r['bits']} | {r['K']}x{r['N']} | {r['M']} | {s:.1f} | {p:.1f} | "
            f"{p / s:.2f} | {f:.1f} | {f / p:.0%} |"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Time vs M per layer and bits: stock, the PR, the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["bits"], r["K"], r["N"]) for r in report["rows"]})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4), squeeze=False)
    for ax, (bits, K, N) in zip(axes[0], keys, strict=True):
        rows = [r for r in report["rows"] if (r["bits"], r["K"], r["N"]) == (bits, K, N)]
        Ms = [r["M"] for r in rows]
        for arm, label in (("stock", "stock"), ("pr", "PR"), ("floor", "bytes / copy bandwidth")):
            ax.plot(Ms, [r[arm + "_us"] for r in rows], marker="o", label=label)
        ax.set_title(f"{bits}-bit {K}x{N}")
        ax.set_xlabel("M")
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("µs per call")
    axes[0][0].legend()
    fig.suptitle(f"mx.quantized_matmul, {report['dtype']}, group {report['group_size']}, "
                 f"{report['hardware']['gpu'].split(',')[0]}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time the arms, side by side")
    r.add_argument("--stock", required=True, help="PYTHON[:SITE] importing stock MLX")
    r.add_argument("--patched", required=True, help="PYTHON[:SITE] importing the patched MLX")
    r.add_argument("--json", required=True)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--repeats", type=int, default=200)
    r.add_argument("--quick", action="store_true", help="two layers")
    rep = sub.add_parser("report", help="the table (and a plot) of a run's JSON")
    rep.add_argument("json")
    rep.add_argument("--plot")
    sub.add_parser("worker", help="internal: one arm's round (cases on stdin)")
    a = ap.parse_args()
    if a.cmd == "worker":
        job = json.loads(sys.stdin.read())
        print(json.dumps(worker(job["cases"], job["repeats"])))
    elif a.cmd == "run":
        run(a)
    else:
        report = json.loads(Path(a.json).read_text())
        print(table(report))
        if a.plot:
            plot(report, Path(a.plot))


if __name__ == "__main__":
    main()
