"""Tiling variants of the patched CUDA qmv.cu, for timing arms (never for a patch).

The streamed kernel's tiling (how many vectors V one weight pass serves, how many
rows a warp and a block own) changes no row's summation order, only the speed;
which tiling ships is decided from timings. Building MLX once per tiling costs a
rebuild each, so this writes ONE extra qmv.cu whose launcher picks the tiling at
run time from ``PATCHKIT_QMV_VARIANT`` (read once), with one ``// bench-arm: NAME
KEY=VALUE`` line per timing arm at its top: the arms travel inside the source they
describe. ``scripts/cuda_build_device.sh`` builds it like a peer (swapped into the
build tree, rebuilt incrementally) and times every arm it names.

  0  the patch's tiling: V in {2, 4}, 2 rows per warp, 8 rows a block
  1  adds V = 8 for M = 5..8 (one weight pass), 1 row per warp, 8 rows a block
  2  the same V = 8 in blocks of 4 rows: more blocks per SM, more x staging

Usage: python scripts/cuda_bench_variants.py PATCHED_QMV_CU OUT_DIR
  PATCHED_QMV_CU: the rendered file, e.g. `git -C <cache clone> show
  patchkit/<pin>:mlx/backend/cuda/quantized/qmm/qmv.cu > qmv.cu`
  OUT_DIR: e.g. .peer/tilings (git-ignored); gets mlx/backend/.../qmv.cu
"""

from __future__ import annotations

import sys
from pathlib import Path

QMV = "mlx/backend/cuda/quantized/qmm/qmv.cu"
ARMS = {"v8": 1, "v8-rows4": 2}  # arm name -> PATCHKIT_QMV_VARIANT (0 is `patched`)

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
    include = "#include <cooperative_groups.h>\n"
    head = patched[:start].replace(include, include + "#include <cstdlib>\n", 1)
    arms = "".join(f"// bench-arm: {name} PATCHKIT_QMV_VARIANT={v}\n" for name, v in ARMS.items())
    return arms + head + launcher + patched[end:]


def main() -> int:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    target = out / QMV
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(variant_source(src.read_text()))
    print(f"{target}: arms {', '.join(ARMS)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
