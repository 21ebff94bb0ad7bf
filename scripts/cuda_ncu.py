"""One launch of each arm on 8192x28672 4-bit bf16, for ``ncu`` to read counters from.

Run under ``ncu --kernel-name regex:"qmv|qmm"``: MLX's compiled qmv (M = 1), MLX's
batched qmm (M = 8), the JIT copy of stock qmv (M = 1) and the streamed kernel
(M = 8, V = 8 and V = 4). Each is launched once, with no timing loop, so the
profile holds exactly these kernels.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from patchkit.harness import cuda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--header", type=Path, required=True)
    args = ap.parse_args()
    import mlx.core as mx

    kernels = cuda.Kernels(args.header.read_text())
    cfg = cuda.Config(8192, 28672, 4, 64, "bfloat16")
    prob = cuda.make_problem(cfg, seed=1)
    mx.eval(prob.qmm(prob.rows[0]))
    mx.eval(prob.qmm(prob.prefixes[8]))
    mx.eval(cuda.run_jit(kernels, prob, 1, None))
    mx.eval(cuda.run_jit(kernels, prob, 8, 8))
    mx.eval(cuda.run_jit(kernels, prob, 8, 4))
    mx.synchronize()
    print("launched: mlx qmv M=1, mlx qmm M=8, jit qmv M=1, streamed V=8 M=8, streamed V=4 M=8")


if __name__ == "__main__":
    main()
