"""Variants of the patched CUDA qmv.cu, for timing arms (never for a patch).

Three kinds, each one extra qmv.cu built like a peer (swapped into the build tree and
rebuilt incrementally by ``scripts/cuda_build_device.sh``), with one ``// bench-arm:
NAME KEY=VALUE`` line per timing arm at its top: the arms travel inside the source
they describe.

``tilings`` (from the patched file):

The streamed kernel's tiling (how many vectors V one weight pass serves, how many
rows a warp and a block own) changes no row's summation order, only the speed;
which tiling ships is decided from timings. Building MLX once per tiling costs a
rebuild each, so this writes ONE extra qmv.cu whose launcher picks the tiling at
run time from ``PATCHKIT_QMV_VARIANT`` (read once).

  0  the patch's tiling: V in {2, 4}, 2 rows per warp, 8 rows a block
  1  adds V = 8 for M = 5..8 (one weight pass), 1 row per warp, 8 rows a block
  2  the same V = 8 in blocks of 4 rows: more blocks per SM, more x staging

``registers`` (from the pinned, unpatched file): the streamed kernel that reads x
from global memory into registers (``cuda_x_staging = "global"``: one warp per
row, no shared memory), with V in {2, 4, 8} so that M = 5..8 take one weight
pass, rendered with the opt-in routing; its arm sets MLX_CUDA_QMV_STREAMED=1, so
every M >= 2 of the timing grid runs it. The same per-thread order as qmv, so the
arm's rows are checked bitwise like the others. It is the layout of the 8-bit
peer (registers only, V up to 8), written with this project's templates.

``split`` (from the pinned, unpatched file, rendered with ``cuda_stream_min_weights = 0``):
the shipped route without its floor, so layers below 2**24 weights stream at M = 2..7 too,
M = 5..7 of one batch split into passes (a V = 4 pass, then a V = 2 pass and/or stock's
per-vector qmv: 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1; 4-bit M = 7 keeps two V = 4 tiles).
Beside the shipped arm on the cold grid's small shapes (1024 x 1024, 4096 x 1024,
3072 x 3072) it says where the floor belongs: on the H200, 4-bit 4096 x 1024 read the
streamed kernel 0.43-0.88 of stock's time kernel-only, 1024 x 1024 1.3-2.1x.

``tail`` (from the pinned file, rendered with ``cuda_async_tail``): the k steps past the
last full stage of 4 are copied with cp.async while the stage before is computed, instead of
one step at a time with plain loads (K = 2560 leaves 1 such step at 4-bit and 2 at 8-bit);
routing as shipped.

``rows1`` (from the pinned file, rendered with ``cuda_rows_per_warp = 1`` and no floor):
one row per warp, 8 warps per block as qmv has, instead of 2 rows per warp in 4 warps, on
every layer. The question it answers: is the streamed kernel's loss on a small layer with
cold weights about too few warps to hide memory latency (then a routing could pick the
block shape by n instead of falling back to the per-vector kernel)? On the H200, kernel-only,
it read 0.42-0.81 of stock on 4-bit 4096 x 1024 but still 1.2-1.6x at M = 2..6 on
1024 x 1024.

``bounds`` (from the pinned file, rendered with ``cuda_min_blocks_per_sm = 4``): the shipped
route with ``__launch_bounds__`` capping the V = 4 streamed kernel's registers at what 4
blocks per SM leave (128 per thread for blocks of 4 warps) and V = 2's at 5 blocks. ptxas at
sm_90a, bf16 group 64: 8-bit V = 4 128 registers (from 161) with 44 bytes of spill stores, 16
resident warps per SM (from 12), V = 2 unchanged (96, no spills); 4-bit V = 4 128 (from 174)
with 32 bytes, 16 warps (from 8), V = 2 96 (from 104) with 24 bytes, 20 warps (from 16).
The question it answers: does the 8-bit V = 4 kernel (the mlxcel peer's 4-vector kernel
takes 68 registers, 24 warps) gain more from resident warps than it loses to spills, where
the peer keeps 5-8% on 8-bit 2560 x 9728 at M = 2, 3?

Usage: python scripts/cuda_bench_variants.py tilings PATCHED_QMV_CU OUT_DIR
       python scripts/cuda_bench_variants.py registers PINNED_QMV_CU OUT_DIR
       python scripts/cuda_bench_variants.py split|tail|rows1|bounds PINNED_QMV_CU OUT_DIR
  PATCHED_QMV_CU: the rendered file, e.g. `git -C <cache clone> show
  patchkit/<pin>:mlx/backend/cuda/quantized/qmm/qmv.cu > qmv.cu`
  PINNED_QMV_CU: the same path at the pin itself (`show <pin>:...`)
  OUT_DIR: e.g. .peer/tilings or .peer/registers (git-ignored); gets
  mlx/backend/.../qmv.cu
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

QMV = "mlx/backend/cuda/quantized/qmm/qmv.cu"
ARMS = {"v8": 1, "v8-rows4": 2}  # arm name -> PATCHKIT_QMV_VARIANT (0 is `patched`)
# The registers kind: V per launch, and its arm's environment.
REGISTERS_VECS = (2, 4, 8)
REGISTERS_ARM = "registers MLX_CUDA_QMV_STREAMED=1"

ROWS = """  constexpr int rows_per_warp = 2;
  constexpr int rows_per_block = 8;
"""
LAUNCH_HEAD = """  auto launch = [&](auto vecs) {
    constexpr int V = decltype(vecs)::value;
"""
LAUNCH_HEAD_VARIANT = """  auto launch = [&](auto vecs, auto rows) {
    constexpr int V = decltype(vecs)::value;
    constexpr int rows_per_warp = V <= 4 ? 2 : 1;
    constexpr int rows_per_block = decltype(rows)::value;
"""
DISPATCH = """  if (m <= 2) {
    launch(cuda::std::integral_constant<int, 2>{});
    return;
  }
  launch(cuda::std::integral_constant<int, 4>{});
}
"""
DISPATCH_VARIANT = """  static int variant = [] {
    const char* v = std::getenv("PATCHKIT_QMV_VARIANT");
    return v ? std::atoi(v) : 0;
  }();
  using v2 = cuda::std::integral_constant<int, 2>;
  using v4 = cuda::std::integral_constant<int, 4>;
  using v8 = cuda::std::integral_constant<int, 8>;
  if (m <= 2) {
    launch(v2{}, v8{});
  } else if (m <= 4 || variant == 0) {
    launch(v4{}, v8{});
  } else if (variant == 2) {
    launch(v8{}, v4{});
  } else {
    launch(v8{}, v8{});
  }
}
"""


def with_cstdlib(source: str) -> str:
    """``source`` with <cstdlib> (std::getenv, std::atoi) included after cooperative_groups."""
    include = "#include <cooperative_groups.h>\n"
    return source.replace(include, include + "#include <cstdlib>\n", 1)


def variant_source(patched: str) -> str:
    """The patched qmv.cu with a launcher that reads PATCHKIT_QMV_VARIANT."""
    start = patched.find("void qmv_streamed(")
    if start < 0 or DISPATCH not in patched[start:]:
        raise SystemExit(
            f"the patched qmv_streamed launcher no longer has exactly one:\n{DISPATCH}"
        )
    end = patched.index(DISPATCH, start) + len(DISPATCH)
    launcher = patched[start:end]
    edits = [
        (ROWS, ""),
        (LAUNCH_HEAD, LAUNCH_HEAD_VARIANT),
        (DISPATCH, DISPATCH_VARIANT),
    ]
    for old, new in edits:
        if launcher.count(old) != 1:
            raise SystemExit(f"the patched qmv_streamed launcher no longer has exactly one:\n{old}")
        launcher = launcher.replace(old, new)
    head = with_cstdlib(patched[:start])
    arms = "".join(f"// bench-arm: {name} PATCHKIT_QMV_VARIANT={v}\n" for name, v in ARMS.items())
    return arms + head + launcher + patched[end:]


def option_source(pinned: str, arm: str, **options: Any) -> str:
    """The pinned qmv.cu rendered with these render options, under the arm line ``arm``
    (its name, then the KEY=VALUE environment it runs with)."""
    from patchkit.carry import render

    plan = next(p for p in render.load_plans() if p.path == QMV)
    rendered = render.render_file(plan, pinned, render.RenderOptions(backends=("cuda",), **options))
    return f"// bench-arm: {arm}\n" + rendered


def split_source(pinned: str) -> str:
    """The pinned qmv.cu rendered as shipped but without the floor: every layer streams
    M = 2..7, M = 5..7 split into passes."""
    return option_source(pinned, "split", cuda_stream_min_weights=0)


def tail_source(pinned: str) -> str:
    """The pinned qmv.cu rendered with ``cuda_async_tail``: the k steps past the last full
    stage go through the cp.async pipeline too (routing as shipped)."""
    return option_source(pinned, "tail", cuda_async_tail=True)


def rows1_source(pinned: str) -> str:
    """The pinned qmv.cu rendered with one row per warp (8 warps per block of 8 rows), on
    every layer (no floor)."""
    return option_source(pinned, "rows1", cuda_rows_per_warp=1, cuda_stream_min_weights=0)


def bounds_source(pinned: str) -> str:
    """The pinned qmv.cu rendered as shipped, the streamed kernel's registers bounded for 4
    blocks per SM."""
    return option_source(pinned, "bounds", cuda_min_blocks_per_sm=4)


def registers_source(pinned: str) -> str:
    """The pinned qmv.cu rendered with the register-only streamed kernel, V in REGISTERS_VECS."""
    from patchkit.carry import render

    # The launcher's V list is a render constant (Metal's tiles); this arm alone
    # swaps in its own, and puts the constant back.
    saved = render.STREAMED_VECS
    render.STREAMED_VECS = REGISTERS_VECS
    try:
        return option_source(pinned, REGISTERS_ARM, routing="opt_in", cuda_x_staging="global")
    finally:
        render.STREAMED_VECS = saved


KINDS = {
    "tilings": variant_source,
    "registers": registers_source,
    "split": split_source,
    "tail": tail_source,
    "rows1": rows1_source,
    "bounds": bounds_source,
}


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[1] not in KINDS:
        raise SystemExit(f"usage: cuda_bench_variants.py {'|'.join(KINDS)} QMV_CU OUT_DIR")
    kind, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    target = out / QMV
    target.parent.mkdir(parents=True, exist_ok=True)
    text = KINDS[kind](src.read_text())
    target.write_text(text)
    arms = re.findall(r"^// bench-arm: (\S+)", text, re.M)
    print(f"{target}: arms {', '.join(arms)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
