"""Probe stock MLX's `qmm_sm90` on an H100/H200: which calls come out wrong, and how.

    python3 bench/qmm_sm90_probe.py [--full]      # with the MLX to probe importable

MLX's own `test_qmm`, `test_qmv` and `test_qmv_wide` fail on sm90 exactly in the subtests
that reach `qmm_sm90`; its support test takes only K == group size there (K of 64 or 128),
so the tests hold no case of that kernel with K over the group size (`docs/cuda.md`).
Each case here runs `mx.quantized_matmul` three times into buffers first filled with NaN
and freed, against float32 math on the CPU (and the same with TF32-rounded operands,
which sm90 uses for float32), and prints one line: the largest error over the reference's
standard deviation, the rows and columns that are off, whether the three runs agree,
whether any output was never written, and which JIT modules the case compiled (which
kernel it reached). The K = 2 * group case is the control that does not reach `qmm_sm90`.
It patches nothing: run it with stock wheels or any build.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import tempfile

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


def probe(mx, cache: str, case: tuple) -> str:
    """One case's line."""
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
        rows = [i for i, off in enumerate(row_off) if off]
        cols = [j for j, off in enumerate(col_off) if off]
        disagree = max((ys[0] - t).abs().max().item() for t in ys[1:])
        unwritten = mx.isnan(y).any().item()
        off_tf32 = (y - ref_tf32).abs().max().item() / sd
    return (
        f"{dtype:>8} M={m:<3} N={n:<5} K={k:<3} group={group:<3} bits={bits} B={batch} "
        f"batched_w={int(batched_w)} err/std={err.max().item() / sd:.1e} "
        f"vs_tf32={off_tf32:.1e} rows_off={len(rows)}{rows[:3]} cols_off={len(cols)}{cols[:3]} "
        f"runs_disagree={disagree:.0e} unwritten={int(unwritten)} jit={compiled or '-'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true",
                    help="also 8-bit, bfloat16, more shapes (minutes on a CPU)")  # fmt: skip
    args = ap.parse_args()
    # A JIT cache of its own (removed after the run, unless MLX_PTX_CACHE_DIR names one),
    # so that "jit=" names what each case compiled.
    with tempfile.TemporaryDirectory(prefix="qmm-probe-") as own:
        cache = os.environ.setdefault("MLX_PTX_CACHE_DIR", own)
        os.makedirs(cache, exist_ok=True)
        run(args.full, cache)


def run(full: bool, cache: str) -> None:
    """Print the header and one line per case, with ``cache`` as MLX's JIT cache."""
    import mlx.core as mx

    packages = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("mlx")
    )
    print(f"MLX {mx.__version__} on {mx.default_device()}; packages: {', '.join(packages)}")
    for case in CASES + (MORE if full else []):
        print(probe(mx, cache, case), flush=True)


if __name__ == "__main__":
    main()
