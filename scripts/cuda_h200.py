"""Driver for one GPU run: JIT-vs-compiled sanity, the parity matrix and the timing sweep.

Thin on purpose: the work is in ``patchkit.verify.harness.cuda``. Run on the GPU host
with the stock mlx + mlx-cuda-13 wheels importable and the header built here by
``scripts/cuda_jit_bundle.py`` (see docs/cuda.md). Configs run in
priority order and the JSON is rewritten after each, so a run cut off by its
deadline still returns everything it finished.

``--variant`` picks the streamed arms: ``global`` (the baseline, x read from
global memory, from ``--header``), ``smem`` (the default render, from the sibling
header ``qmv_jit_header_smem.cuh``; the shipped shape is the arm
``smem_v24_w2_pf_async_4warps``), or ``both`` side by side. The stock arms (JIT
M = 1 copy, MLX compiled M = 1 calls, MLX batched) run in every variant.
``--arms``, ``--parity-only`` and ``--skip-configs`` cut a run down, e.g. the
shipped arm's parity over the configs a timed run did not reach.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

from patchkit.carry import render
from patchkit.verify.harness import cuda

SHAPES = [(8192, 28672), (3840, 15360), (15360, 3840), (4096, 4096), (4160, 4096)]  # K x N
PARITY_SETS = {
    "render": render.STREAMED_VECS,  # what the patch renders today
    "v248": (2, 4, 8),
    "v8": (8,),  # every M through V = 8: tails nv < V for M < 8 and M = 9..15
    "v16": (16,),
}
TIMING_SETS = {"render": render.STREAMED_VECS, "v248": (2, 4, 8), "v24816": (2, 4, 8, 16)}

# x staged in shared memory: Arm(vecs, "smem", rows_per_block, Knobs(...)). A warp owns
# rows_per_warp rows and reads its x slices once for them; a block has rows_per_block /
# rows_per_warp warps; l2_prefetch asks L2 for the warp's weight rows up front; x_async
# double-buffers the x staging with cp.async. Registers (nvcc 13.0, sm_90a, 4-bit bf16):
# shipped V2 107, V4 165; 8 warps x 1 row, prefetch, V8 158; 4 warps x 2 rows V8 215+.
PF_ASYNC = cuda.Knobs(l2_prefetch=True, x_async=True)
W2_PF = cuda.Knobs(rows_per_warp=2, l2_prefetch=True)
SHIPPED = cuda.Arm((2, 4), "smem", 8, cuda.SHIPPED_KNOBS)  # what patches/ renders
SMEM_PARITY = {
    "smem_v24_w2_pf_4warps": cuda.Arm((2, 4), "smem", 8, W2_PF),
    "smem_v24_w2_pf_async_4warps": SHIPPED,
    "smem_v248_pf_async": cuda.Arm((2, 4, 8), "smem", 8, PF_ASYNC),
}
SMEM_TIMING = {
    "smem_v24_w2_pf_4warps": cuda.Arm((2, 4), "smem", 8, W2_PF),
    "smem_v24_w2_pf_async_4warps": SHIPPED,
    "smem_v24_w2_async_4warps": cuda.Arm(
        (2, 4), "smem", 8, cuda.Knobs(rows_per_warp=2, x_async=True)
    ),
    "smem_v248_pf_async": cuda.Arm((2, 4, 8), "smem", 8, PF_ASYNC),
    "smem_v248_w2_pf_async_4warps": cuda.Arm((2, 4, 8), "smem", 8, cuda.SHIPPED_KNOBS),
}
# Side by side: the global arms the smem ones are compared with, then the smem ones.
GLOBAL_ARMS = {"render": render.STREAMED_VECS}  # parity and timing
ARMS = {
    "global": (PARITY_SETS, TIMING_SETS),
    "smem": (SMEM_PARITY, SMEM_TIMING),
    "both": (
        {**GLOBAL_ARMS, **SMEM_PARITY},
        {**GLOBAL_ARMS, **SMEM_TIMING},
    ),
}
# N % 4 == 2 and a K tail: the last row block has warps past n, which must still
# stage x and meet every barrier, and (rows_per_warp 4) a warp whose last two rows
# are past n (recomputed from row n - 1, never stored). Parity only; runs right after
# the first headline config.
RAGGED = cuda.Config(4160, 4098, 4, 64, "bfloat16")


def plan(variant: str = "global") -> list[tuple[cuda.Config, bool]]:
    """(config, timed?) in priority order: the headline shape first, gs 32/128 last.

    With smem arms, the ragged-N config comes second, and 8-bit bf16 before 4-bit fp16.
    """
    big = [
        (cuda.Config(8192, 28672, b, 64, d), True)
        for b, d in ((4, "bfloat16"), (4, "float16"), (8, "bfloat16"))
    ]
    if variant != "global":  # 4-bit bf16, the ragged check, 8-bit bf16, then 4-bit fp16
        big = [big[0], (RAGGED, False), big[2], big[1]]
    rest = [(cuda.Config(k, n, b, 64, "bfloat16"), True) for b in (4, 8) for k, n in SHAPES[1:]]
    fp16 = [(cuda.Config(k, n, b, 64, "float16"), False) for b in (4, 8) for k, n in SHAPES]
    groups = [
        (cuda.Config(k, n, 4, g, d), False)
        for g in (32, 128)
        for d in ("bfloat16", "float16")
        # The K tail must stay a multiple of the group: 4160 for 32, 4224 for 128.
        for k, n in ((8192, 28672), (4160 if g == 32 else 4224, 4096))
    ]
    seen, out = set(), []
    for cfg, timed in big + rest + fp16 + groups:
        if cfg not in seen:
            seen.add(cfg)
            out.append((cfg, timed))
    return out


def environment() -> dict[str, Any]:
    """Versions and GPU, recorded beside the numbers."""
    import mlx.core as mx

    info: dict[str, Any] = {"mlx": mx.__version__, "python": platform.python_version()}
    try:
        info["device"] = mx.device_info()
    except (AttributeError, RuntimeError):
        info["device"] = str(mx.default_device())
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--header", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds; no new config after")
    ap.add_argument(
        "--variant",
        choices=sorted(ARMS),
        default="global",
        help="streamed arms: x from global memory (default), staged in shared memory, or both",
    )
    ap.add_argument(
        "--smem-header",
        type=Path,
        help="the smem variant's header (default: qmv_jit_header_smem.cuh beside --header)",
    )
    ap.add_argument("--arms", help="comma-separated arm names: keep only these parity/timing arms")
    ap.add_argument("--parity-only", action="store_true", help="no timing sweep")
    ap.add_argument(
        "--skip-configs",
        type=int,
        default=0,
        help="leave out the first N configs of the plan (a follow-up run)",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    headers = {"global": args.header}
    if args.variant != "global":
        headers["smem"] = args.smem_header or args.header.with_name(cuda.HEADER_NAMES["smem"])
    kernels = {v: cuda.Kernels(path.read_text(), v) for v, path in headers.items()}
    parity_sets, timing_sets = ARMS[args.variant]
    if args.arms:
        keep = set(args.arms.split(","))
        parity_sets = {k: v for k, v in parity_sets.items() if k in keep}
        timing_sets = {k: v for k, v in timing_sets.items() if k in keep}
    payload: dict[str, Any] = {
        "environment": environment(),
        "variant": args.variant,
        "results": [],
        "skipped": [],
    }
    for cfg, timed in plan(args.variant)[args.skip_configs :]:
        timed = timed and not args.parity_only
        if time.perf_counter() - t0 > args.deadline:
            payload["skipped"].append(cfg.__dict__)
            continue
        # Full M sweep on the headline shape; a sparser one elsewhere keeps the run short.
        ms = range(1, 17) if cfg.N == 28672 else (1, 2, 4, 6, 8, 12, 16)
        try:
            res = cuda.run_config(kernels, cfg, parity_sets, timing_sets if timed else None, ms=ms)
        except Exception as exc:
            # One device run: if an smem arm fails (NVRTC, launch), record it and keep the
            # global arms of --variant both for the rest of the run.
            if args.variant != "both" or parity_sets is GLOBAL_ARMS:
                raise
            payload.setdefault("errors", []).append({"config": cfg.__dict__, "error": repr(exc)})
            print(cfg, "smem arms failed, global only from here:", repr(exc), flush=True)
            parity_sets = timing_sets = GLOBAL_ARMS
            res = cuda.run_config(kernels, cfg, parity_sets, timing_sets if timed else None, ms=ms)
        payload["results"].append(res)
        print(cfg, cuda.verdict(res), f"{res['seconds']:.1f}s", flush=True)
        cuda.dump(args.out / "cuda_h200.json", payload)
    payload["wall_s"] = time.perf_counter() - t0
    cuda.dump(args.out / "cuda_h200.json", payload)


if __name__ == "__main__":
    main()
