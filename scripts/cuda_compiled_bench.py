"""Compiled patched MLX against the compiled stock wheel, side by side, on one CUDA GPU.

Each arm is an MLX installation (a Python interpreter plus an optional
PYTHONPATH): ``patched`` is the venv `patchkit build --backend cuda` made,
``stock`` is the released wheel. Both cannot live in one process (both are
``mlx``), so this orchestrator runs one worker process per (arm, shape) and
alternates the arms shape by shape, so drift in clocks or temperature lands on
both. Every worker also checks its rows bitwise against its own M = 1 output
before timing, so the stock arm's differing rows at M >= 8 are the negative
control and the patched arm's rows are the claim.

Usage (on the GPU host):
  python3 scripts/cuda_compiled_bench.py --arm patched=PYTHON[:SITE] --arm stock=PYTHON:SITE \
      --out results.json [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (K, N) = (in, out) features of real projections, small to large.
SHAPES = [(1024, 1024), (2048, 8192), (4096, 4096), (4096, 14336), (2560, 9728), (8192, 28672)]
MS = tuple(range(1, 17))
BITS = (4, 8)
GROUPS = (32, 64, 128)
DTYPES = ("bfloat16", "float16")
HEADLINE = {"group_size": 64, "dtype": "bfloat16"}


def grid(quick: bool) -> list[dict[str, Any]]:
    """Every configuration: the headline (group 64, bf16) on all shapes and bits, plus
    the other group sizes and fp16 on the shapes at both ends of the size range."""
    out = []
    for (K, N), bits in itertools.product(SHAPES, BITS):
        out.append({"K": K, "N": N, "bits": bits, **HEADLINE})
    if quick:
        return out[:4]
    for (K, N), bits, gs, dtype in itertools.product(
        (SHAPES[0], SHAPES[-1]),  # smallest and largest shape
        BITS,  # both bit widths
        GROUPS,  # every group size
        DTYPES,  # both half types
    ):
        cfg = {"K": K, "N": N, "bits": bits, "group_size": gs, "dtype": dtype}
        if cfg not in out:
            out.append(cfg)
    return out


def worker(cfg: dict[str, Any], iters: int, repeats: int) -> dict[str, Any]:
    """Time quantized_matmul at every M for one configuration, after a bitwise row check."""
    import mlx.core as mx
    import numpy as np

    dtype = getattr(mx, cfg["dtype"])
    K, N = cfg["K"], cfg["N"]
    key = mx.random.key(0)
    kw, kx = mx.random.split(key)
    w = mx.random.normal((N, K), key=kw).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=cfg["group_size"], bits=cfg["bits"])
    xs = mx.random.normal((max(MS), K), key=kx).astype(dtype)
    mx.eval(wq, scales, biases, xs)

    def qmm(x: Any) -> Any:
        return mx.quantized_matmul(
            x, wq, scales, biases, transpose=True, group_size=cfg["group_size"], bits=cfg["bits"]
        )

    view = mx.uint16
    single = [np.array(qmm(xs[i : i + 1]).view(view)) for i in range(max(MS))]
    rows = []
    for M in MS:
        x = mx.contiguous(xs[:M])
        y = qmm(x)
        mx.eval(y)
        got = np.array(y.view(view))
        differing = sum(int((got[i] != single[i][0]).any()) for i in range(M))
        for _ in range(3):  # warm-up
            mx.eval([qmm(x) for _ in range(iters)])
        mx.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval([qmm(x) for _ in range(iters)])
            mx.synchronize()
            times.append((time.perf_counter() - start) / iters * 1e6)
        rows.append(
            {"M": M, "us": sorted(times)[len(times) // 2], "us_min": min(times),
             "rows_differing": differing}
        )  # fmt: skip
    return {**cfg, "mlx_version": mx.__version__, "by_m": rows}


def run_arm(arm: str, python: str, site: str, cfg: dict[str, Any], a: argparse.Namespace) -> Any:
    """One worker process for ``arm`` on ``cfg``; its JSON result."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [python, __file__, "--worker", json.dumps(cfg), "--iters", str(a.iters),
           "--repeats", str(a.repeats)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {**cfg, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", default=[], help="NAME=PYTHON[:SITE]")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0, help="stop starting shapes after N s")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker), a.iters, a.repeats)))
        return 0
    arms = {}
    for spec in a.arm:
        name, _, rest = spec.partition("=")
        python, _, site = rest.partition(":")
        arms[name] = (python, site)
    start = time.monotonic()
    results: dict[str, list[Any]] = {name: [] for name in arms}
    for i, cfg in enumerate(grid(a.quick)):
        if a.deadline and time.monotonic() - start > a.deadline:
            print(f"deadline: stopped before config {i}", flush=True)
            break
        order = list(arms) if i % 2 == 0 else list(reversed(arms))  # alternate who goes first
        for name in order:
            results[name].append(run_arm(name, *arms[name], cfg, a))
        print(json.dumps({"config": cfg, "done": i + 1}), flush=True)
    payload = {
        "command": " ".join(sys.argv),
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "arms": {k: {"python": v[0], "site": bool(v[1])} for k, v in arms.items()},
        "method": f"median of {a.repeats} repeats of {a.iters} back-to-back calls, "
        "one eval per repeat, after 3 warm-up repeats; rows checked bitwise against M = 1 first",
        "results": results,
    }
    if a.out:
        a.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
