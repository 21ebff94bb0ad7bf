"""Compiled MLX builds side by side on one CUDA GPU: quantized_matmul per M, timed and checked.

Each arm is an MLX installation, a Python interpreter with an optional
PYTHONPATH and environment: ``patched`` is the venv `patchkit build --backend
cuda` made (with ``MLX_CUDA_QMV_EXACT=1`` its exact route covers M <= 16),
``stock`` is the released wheel, ``peer`` another build of the same MLX. Two
builds of ``mlx`` cannot share a process, so every arm is one long-lived worker
process; the orchestrator hands each configuration to the arms in turn
(alternating who goes first), so drift in clocks or temperature lands on all of
them, and only one arm touches the GPU at a time. Each worker checks its rows
bitwise against its own M = 1 output before timing: the stock arm's rows at
M >= 8 (qmm) are the negative control and the patched arm's rows are the claim.
At M = 1 every arm runs the same stock kernel, so the M = 1 ratio is a direct
reading of the run-to-run noise.

Weights as decoding sees them: a model's layers together far exceed the L2 cache, so each
call reads its weights from HBM. One weight set called back to back would stay in L2 where
it fits (a 1024x1024 4-bit layer is 0.6 MB; the H200's L2 holds 50 MB) and time a warm
cache instead. So each worker holds bit-identical copies of the weights adding up to at
least ``--cold-mib`` (default 256 MiB, several times any current L2) and every call takes
the next copy; ``--cold-mib 0`` times one warm set (how runs before this option timed).

The JSON is rewritten after every configuration; ``--resume`` skips the
configurations an earlier, interrupted run of the same arms already finished.

Usage (on the GPU host):
  python3 scripts/cuda_compiled_bench.py --arm patched=PYTHON --arm stock=PYTHON:SITE \
      --arm-env patched:MLX_CUDA_QMV_EXACT=1 --out results.json [--quick] [--deadline S] \
      [--headline] [--bits 4|8 ...]
``--headline`` and ``--bits`` keep a subset of the grid (e.g. peers on the 8-bit
headline configurations only, where the full grid runs with fewer arms).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (K, N) = (in, out) features of real projections, small to large.
# 4096x1024 (a GQA k/v projection) and 3072x3072 sit between the smallest shape and the
# 2**24-weight ones, where the routing's floor (cuda_stream_min_weights) is to be placed.
SHAPES = [(1024, 1024), (4096, 1024), (3072, 3072), (2048, 8192), (4096, 4096), (4096, 14336),
          (2560, 9728), (8192, 28672)]  # fmt: skip
MS = tuple(range(1, 17))
BITS = (4, 8)
GROUPS = (32, 64, 128)
DTYPES = ("bfloat16", "float16")
HEADLINE = {"group_size": 64, "dtype": "bfloat16"}
MAX_CALLS = 400  # calls per repeat, at most (each builds a graph node before the eval)
MAX_COPIES = 1024  # weight copies a cold run rotates through, at most
COLD_MIB = 256  # the default: the copies add up to at least this much


def weight_bytes(cfg: dict[str, Any]) -> int:
    """Bytes one call reads of the quantized weights: packed values, scales and biases."""
    groups = cfg["N"] * (cfg["K"] // cfg["group_size"])
    return cfg["N"] * cfg["K"] * cfg["bits"] // 8 + 2 * groups * 2  # half-precision scales


def weight_copies(cfg: dict[str, Any], cold_bytes: int) -> int:
    """How many weight copies the calls rotate through so that each call's weights have left
    L2 by its turn: enough to add up to cold_bytes (1 when 0: one warm set)."""
    if cold_bytes <= 0:
        return 1
    return min(MAX_COPIES, max(2, -(-cold_bytes // weight_bytes(cfg))))


def grid(quick: bool) -> list[dict[str, Any]]:
    """Every configuration: the headline (group 64, bf16) on all shapes and bits first, then
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


def problem(cfg: dict[str, Any], copies: int = 1) -> tuple[Callable[..., Any], Any]:
    """quantized_matmul on the configuration's quantized weights, and max(MS) input vectors,
    evaluated; seeded, so every arm and every tool (cuda_kernel_times.py) sees one problem.
    ``qmm(x, i)`` uses weight copy ``i % copies``: the copies are bit-identical, made through
    the host so that each is its own buffer."""
    import mlx.core as mx
    import numpy as np

    dtype = getattr(mx, cfg["dtype"])
    K, N = cfg["K"], cfg["N"]
    kw, kx = mx.random.split(mx.random.key(0))
    w = mx.random.normal((N, K), key=kw).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=cfg["group_size"], bits=cfg["bits"])
    del w
    xs = mx.random.normal((max(MS), K), key=kx).astype(dtype)
    mx.eval(wq, scales, biases, xs)
    sets = [(wq, scales, biases)]
    host = [np.array(a.view(mx.uint8)) for a in sets[0]] if copies > 1 else []
    for _ in range(copies - 1):
        sets.append(tuple(mx.array(h).view(a.dtype) for h, a in zip(host, sets[0], strict=True)))
        mx.eval(sets[-1])

    def qmm(x: Any, i: int = 0) -> Any:
        w, s, b = sets[i % copies]
        return mx.quantized_matmul(
            x, w, s, b, transpose=True, group_size=cfg["group_size"], bits=cfg["bits"]
        )

    touch_every_copy(qmm, xs, copies)
    return qmm, xs


def touch_every_copy(qmm: Callable[..., Any], xs: Any, copies: int) -> None:
    """Run the kernel once on every weight copy before anything is timed.

    A copy made from host memory lives in MLX's CUDA unified (managed) memory, and the first
    kernel to read it migrates its pages to the GPU. Untouched, the first M timed (M = 1)
    paid that migration: on the H200, M = 1 of the first three configurations of a fresh
    process read 77-208 us for calls of 4-16 us, while later configurations reused buffers
    already on the GPU."""
    import mlx.core as mx

    mx.eval([qmm(xs[:1], i) for i in range(copies)])
    mx.synchronize()


def measure(
    cfg: dict[str, Any], iters: int, repeats: int, min_repeat_us: float, cold_bytes: int = 0
) -> dict[str, Any]:
    """Time quantized_matmul at every M for one configuration, after a bitwise row check."""
    import mlx.core as mx
    import numpy as np

    copies = weight_copies(cfg, cold_bytes)
    qmm, xs = problem(cfg, copies)
    turn = itertools.count()  # the next weight copy, across repeats and M
    single = [np.array(qmm(xs[i : i + 1]).view(mx.uint16)) for i in range(max(MS))]
    rows = []
    for M in MS:
        x = mx.contiguous(xs[:M])
        # The batch on the last copy against M = 1 on the first: the rows claim, and the
        # copies' identity with it.
        got = np.array(qmm(x, copies - 1).view(mx.uint16))
        differing = sum(int((got[i] != single[i][0]).any()) for i in range(M))

        def per_call_us(calls: int, x: Any = x) -> float:
            start = time.perf_counter()
            mx.eval([qmm(x, next(turn)) for _ in range(calls)])
            mx.synchronize()
            return (time.perf_counter() - start) / calls * 1e6

        # Warm-up, which also sizes a repeat: at least `iters` calls and about
        # min_repeat_us of them, so a short call is not read off a few microseconds.
        warm_us = min(per_call_us(iters) for _ in range(2))
        calls = max(iters, min(MAX_CALLS, int(min_repeat_us / warm_us)))
        times = [per_call_us(calls) for _ in range(repeats)]
        rows.append(
            {"M": M, "us": sorted(times)[len(times) // 2], "us_min": min(times),
             "calls": calls, "rows_differing": differing}
        )  # fmt: skip
    return {**cfg, "weight_copies": copies, "by_m": rows}


def serve(iters: int, repeats: int, min_repeat_us: float, cold_bytes: int) -> int:
    """Worker: one configuration per stdin line, one JSON result per stdout line."""
    import mlx.core as mx

    hello = {"mlx_version": mx.__version__, "mlx_path": mx.__file__,
             "device": str(mx.default_device())}  # fmt: skip
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        cfg = json.loads(line)
        try:
            result = measure(cfg, iters, repeats, min_repeat_us, cold_bytes)
        except Exception as exc:  # reported per configuration; the run goes on
            result = {**cfg, "error": f"{type(exc).__name__}: {exc}"}
        mx.clear_cache()  # the configuration's buffers are gone with measure()'s frame
        print(json.dumps(result), flush=True)
    return 0


class Worker:
    """One arm's long-lived process."""

    def __init__(self, name: str, python: str, site: str, env: dict[str, str], a: Any):
        self.name = name
        full_env = {**os.environ, **env}
        if site:
            full_env["PYTHONPATH"] = site + os.pathsep + full_env.get("PYTHONPATH", "")
        cmd = [python, __file__, "--serve", "--iters", str(a.iters), "--repeats", str(a.repeats),
               "--min-repeat-ms", str(a.min_repeat_ms), "--cold-mib", str(a.cold_mib)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.hello = self._read()
        self.hello.update({"python": python, "site": site, "env": env})

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"arm {self.name}: worker exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, cfg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def parse_arms(a: argparse.Namespace) -> dict[str, tuple[str, str, dict[str, str]]]:
    """``--arm NAME=PYTHON[:SITE]`` and ``--arm-env NAME:KEY=VALUE`` into name -> spec."""
    arms: dict[str, tuple[str, str, dict[str, str]]] = {}
    for spec in a.arm:
        name, _, rest = spec.partition("=")
        python, _, site = rest.partition(":")
        arms[name] = (python, site, {})
    for spec in a.arm_env:
        name, _, kv = spec.partition(":")
        key, _, value = kv.partition("=")
        arms[name][2][key] = value
    return arms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", default=[], help="NAME=PYTHON[:SITE]")
    ap.add_argument("--arm-env", action="append", default=[], help="NAME:KEY=VALUE")
    ap.add_argument("--out", type=Path, required=False)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--headline", action="store_true", help="only group 64, bf16 (all shapes)")
    ap.add_argument("--bits", type=int, action="append", choices=BITS, help="only these widths")
    ap.add_argument("--resume", action="store_true", help="keep the finished configs in --out")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-repeat-ms", type=float, default=4.0, help="a repeat's least duration")
    ap.add_argument(
        "--cold-mib",
        type=int,
        default=COLD_MIB,
        help="rotate weight copies adding up to this many MiB (0: one warm set)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0, help="stop starting configs after N s")
    a = ap.parse_args()
    if a.serve:
        return serve(a.iters, a.repeats, a.min_repeat_ms * 1e3, a.cold_mib << 20)
    arms = parse_arms(a)
    results: dict[str, list[Any]] = {name: [] for name in arms}
    if a.resume and a.out and a.out.is_file():
        earlier = json.loads(a.out.read_text())["results"]
        if set(earlier) == set(arms):
            results = earlier
    done = [{k: r[k] for k in ("K", "N", "bits", "group_size", "dtype")}
            for r in next(iter(results.values()), [])]  # fmt: skip
    start = time.monotonic()
    workers = {name: Worker(name, *spec, a) for name, spec in arms.items()}
    payload: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "host": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "gpu": gpu_name(),
        },
        "arms": {name: w.hello for name, w in workers.items()},
        "method": f"per M: median of {a.repeats} repeats, each of back-to-back calls (at least "
        f"{a.iters}, and at least {a.min_repeat_ms:g} ms of them, up to {MAX_CALLS}) and one "
        "eval, after 2 warm-up repeats; rows checked bitwise against M = 1 first; "
        "one long-lived process per arm, arms in alternating order per configuration; "
        + (
            f"weights cold: each call takes the next of bit-identical copies adding up to "
            f">= {a.cold_mib} MiB (weight_copies per configuration)"
            if a.cold_mib > 0
            else "weights warm: one weight set, called back to back"
        ),
        "complete": False,
        "results": results,
    }
    todo = [
        cfg
        for cfg in grid(a.quick)
        if cfg not in done
        and cfg["bits"] in (a.bits or BITS)
        and (not a.headline or all(cfg[k] == v for k, v in HEADLINE.items()))
    ]
    for i, cfg in enumerate(todo):
        if a.deadline and time.monotonic() - start > a.deadline:
            print(f"deadline: stopped before config {len(done) + i}", flush=True)
            break
        order = list(workers) if i % 2 == 0 else list(reversed(workers))
        for name in order:
            results[name].append(workers[name].run(cfg))
        print(json.dumps({"config": cfg, "done": len(done) + i + 1}), flush=True)
        if a.out:
            a.out.write_text(json.dumps(payload, indent=1) + "\n")
    else:
        payload["complete"] = True
    for w in workers.values():
        w.close()
    if a.out:
        a.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def gpu_name() -> str:
    """The GPU and driver as nvidia-smi names them (empty where it is absent)."""
    try:
        query = "--query-gpu=name,driver_version,clocks.max.sm"
        cmd = ["nvidia-smi", query, "--format=csv,noheader"]
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    raise SystemExit(main())
