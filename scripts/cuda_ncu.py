"""One launch of each arm on 8192x28672 4-bit bf16, for ``ncu`` to read counters from.

Run under ``ncu --kernel-name regex:"qmv|qmm"``: MLX's compiled qmv (M = 1), MLX's
batched qmm (M = 8), the JIT copy of stock qmv (M = 1) and the streamed kernel
(M = 8, V = 8 and V = 4). Each is launched once, with no timing loop, so the
profile holds exactly these kernels. With ``--smem`` (needs
``qmv_jit_header_smem.cuh`` beside ``--header``), the shipped smem kernel (M = 8 as
two V = 4 tiles, 4 warps x 2 rows, L2 prefetch, cp.async x staging) and its plain
smem form (V = 8, 8 warps x 1 row) are launched too, for the same counters.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from patchkit.verify.harness import cuda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--header", type=Path, required=True)
    ap.add_argument("--smem", action="store_true", help="also the smem-staged streamed kernel")
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
    launched = "mlx qmv M=1, mlx qmm M=8, jit qmv M=1, streamed V=8 M=8, streamed V=4 M=8"
    if args.smem:
        smem_header = args.header.with_name(cuda.HEADER_NAMES["smem"])
        smem = cuda.Kernels(smem_header.read_text(), "smem")
        mx.eval(cuda.run_jit(smem, prob, 8, 4, 0, 8, cuda.SHIPPED_KNOBS))  # shipped
        mx.eval(cuda.run_jit(smem, prob, 8, 8))
        launched += ", shipped smem V=4 M=8, plain smem V=8 M=8"
    mx.synchronize()
    print("launched:", launched)


if __name__ == "__main__":
    main()
