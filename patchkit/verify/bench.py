"""`patchkit bench`: the step-1 microbenchmark on an Apple GPU, without rebuilding MLX.

Three arms on one stock MLX, side by side in one run: stock ``qmv`` (M
separate M = 1 calls: what engines pin today for exactness), stock batched
(``quantized_matmul`` on M rows: ``qmv_wide`` on generation 15+), and the
streamed kernel through ``mx.fast.metal_kernel`` (:mod:`patchkit.verify.harness.metal`),
for each V. Every streamed configuration is checked bit for bit against M = 1
before it is timed; a differing one is reported and never timed.

The number it exists for is the recovered fraction
``(t_qmv - t_streamed) / (t_qmv - t_wide)``. Timing cannot be tested off an
Apple GPU, so this module keeps it small: warm-ups, then ``iters`` calls
evaluated once, best of ``repeats``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from patchkit.errors import UserError
from patchkit.verify import dispatch, mlx_parity
from patchkit.verify.harness import metal

# (K, N): the projections of real models, where a decode step's time goes.
SHAPES = {
    "gemma-4-12b up": (3840, 15360),
    "gemma-4-12b down": (15360, 3840),
    "70b-class up": (8192, 28672),
}
VS = (2, 3, 4, 5)
QUICK_M = (2, 3, 5, 8)
BITS, GROUP_SIZE, DTYPE = 4, 64, "float16"
# (group size, bits) per mode: affine as engines ship it; the fp modes as MLX defines them.
MODE_PARAMS = {"affine": (GROUP_SIZE, BITS), **dispatch.FP_MODES}


def require_apple_gpu(mx: Any) -> None:
    """Refuse, in one line, where there is no Metal device to run the kernel on."""
    if not mx.metal.is_available():
        raise UserError(
            "the Metal arm of `patchkit bench` needs an Apple GPU (Apple silicon macOS); "
            "on an NVIDIA machine run bench/cuda_qmv.py (the CUDA harness: the pin's "
            "and the patched qmv.cu compiled side by side)"
        )


def recovered_fraction(t_qmv: float, t_streamed: float, t_wide: float) -> float | None:
    """Share of the qmv -> batched gap the streamed kernel recovers; None without a gap.

    On generations 13/14 stock batched affine *is* per-vector qmv, so there is no
    gap to recover and the fraction is undefined, not zero.
    """
    gap = t_qmv - t_wide
    return (t_qmv - t_streamed) / gap if gap > 0 else None


def seconds_per_call(mx: Any, fn: Callable[[], Any], iters: int, repeats: int = 3) -> float:
    """Best of ``repeats`` of ``iters`` calls evaluated together, after warm-ups."""
    for _ in range(3):
        mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(iters)])
        best = min(best, time.perf_counter() - start)
    return best / iters


def _bits(mx: Any, y: Any) -> np.ndarray:
    return np.array(y.view(mx.uint16))


class _Problem:
    """One shape's quantized weights, vectors and kernel, with the three arms as calls."""

    def __init__(
        self, mx: Any, src: metal.MetalSource, K: int, N: int, m_max: int, mode: str = "affine"
    ):
        dtype = getattr(mx, DTYPE)
        w = mx.random.normal((N, K)).astype(dtype)
        self.mx, self.K, self.N, self.mode = mx, K, N, mode
        self.gs, self.bits = MODE_PARAMS[mode]
        q = mx.quantize(w, group_size=self.gs, bits=self.bits, mode=mode)
        self.wq, self.scales = q[0], q[1]
        self.biases = q[2] if mode == "affine" else None
        self.x = mx.random.normal((m_max, K)).astype(dtype)
        self.kernel = metal.make_kernel(mx, src, metal.is_fast(K, N, self.bits), mode)

    def stock(self, x: Any) -> Any:
        return self.mx.quantized_matmul(
            x,
            self.wq,
            self.scales,
            self.biases,
            transpose=True,
            group_size=self.gs,
            bits=self.bits,
            mode=self.mode,
        )

    def per_vector(self, M: int) -> list[Any]:
        return [self.stock(self.x[i : i + 1]) for i in range(M)]

    def streamed(self, M: int, V: int) -> Any:
        mx, x = self.mx, self.x[:M]
        return metal.run_streamed(mx, self.kernel, self.wq, self.scales, self.biases, x,
                                  self.gs, self.bits, V)  # fmt: skip


def bench_m(p: _Problem, dev: mlx_parity.DeviceInfo, M: int, iters: int) -> dict[str, Any]:
    """One row: check each V bit for bit against M = 1, then time the three arms."""
    mx = p.mx
    ref = np.concatenate([_bits(mx, y) for y in p.per_vector(M)])
    cfg = mlx_parity.Config(p.mode, p.bits, p.gs, DTYPE, p.K, p.N, 1)
    row: dict[str, Any] = {
        "K": p.K, "N": p.N, "M": M, "batched_path": mlx_parity.kernel_path(dev, cfg, M),
        "t_qmv": seconds_per_call(mx, lambda: p.per_vector(M), iters),
        "t_batched": seconds_per_call(mx, lambda: p.stock(p.x[:M]), iters),
        "streamed": {},
    }  # fmt: skip
    for V in VS:
        differing = int((_bits(mx, p.streamed(M, V)) != ref).any(axis=-1).sum())
        t = seconds_per_call(mx, lambda V=V: p.streamed(M, V), iters) if not differing else None
        row["streamed"][V] = {"rows_differing": differing, "t": t}
    timed = {V: s["t"] for V, s in row["streamed"].items() if s["t"] is not None}
    row["best_V"] = min(timed, key=timed.__getitem__) if timed else None
    row["recovered"] = (
        recovered_fraction(row["t_qmv"], timed[row["best_V"]], row["t_batched"]) if timed else None
    )
    return row


def bench_shape(
    mx: Any,
    src: metal.MetalSource,
    dev: mlx_parity.DeviceInfo,
    K: int,
    N: int,
    quick: bool,
    mode: str = "affine",
) -> list[dict[str, Any]]:
    """Rows for M = 2 ... limit - 1 (a few M with ``quick``) on one shape."""
    limit = mlx_parity.batch_limit(K, N, dev)
    ms = [m for m in (QUICK_M if quick else range(2, limit)) if m < limit]
    p = _Problem(mx, src, K, N, max(ms), mode)
    return [{"limit": limit, **bench_m(p, dev, M, 20 if quick else 50)} for M in ms]


def run(
    root: Path, quick: bool, progress: Callable[[str], None], mode: str = "affine"
) -> dict[str, Any]:
    """The whole benchmark (JSON), on this Mac's GPU, for one quantization mode."""
    if mode not in MODE_PARAMS:
        raise UserError(f"unknown mode '{mode}'; choose from {list(MODE_PARAMS)}")
    mx = mlx_parity.import_mlx()
    require_apple_gpu(mx)
    dev = mlx_parity.detect_device(mx)
    src = metal.metal_source(root, mode=mode)
    shapes = dict(list(SHAPES.items())[:1]) if quick else SHAPES
    rows = []
    for name, (K, N) in shapes.items():
        progress(f"{name} K={K} N={N}")
        rows += [{"shape": name, **r} for r in bench_shape(mx, src, dev, K, N, quick, mode)]
    return {
        "mlx_version": mx.__version__,
        "device": asdict(dev),
        "mode": mode,
        "bits": MODE_PARAMS[mode][1],
        "group_size": MODE_PARAMS[mode][0],
        "dtype": DTYPE,
        "quick": quick,
        "rows": rows,
    }


def markdown(report: dict[str, Any]) -> str:
    """The table docs/apple.md asks owners to paste back."""
    dev = report["device"]
    out = [
        f"MLX {report['mlx_version']}, {dev['name']} (gen {dev['gen']}), "
        f"{report.get('mode', 'affine')} {report['bits']}-bit g{report['group_size']} "
        f"{report['dtype']}",
        "",
        "| shape | M | batched path | qmv µs | batched µs | best V | streamed µs | recovered |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        best = r["streamed"][r["best_V"]]["t"] if r["best_V"] else None
        us = lambda t: f"{t * 1e6:.1f}" if t is not None else "-"  # noqa: E731
        rec = f"{r['recovered']:.2f}" if r["recovered"] is not None else "n/a"
        out.append(
            f"| {r['shape']} | {r['M']} | {r['batched_path']} | {us(r['t_qmv'])} | "
            f"{us(r['t_batched'])} | {r['best_V'] or '-'} | {us(best)} | {rec} |"
        )
    return "\n".join(out) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    """Recovered fraction against M per shape, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for shape in dict.fromkeys(r["shape"] for r in report["rows"]):
        pts = [
            (r["M"], r["recovered"])
            for r in report["rows"]
            if r["shape"] == shape and r["recovered"] is not None
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=shape)
    ax.set(xlabel="M (rows)", ylabel="recovered fraction", ylim=(None, 1.05))
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return True


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """JSON at ``out``, the markdown and the plot beside it."""
    out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown(report))
    png = out.with_suffix(".png")
    return [out, md, *([png] if plot(report, png) else [])]
