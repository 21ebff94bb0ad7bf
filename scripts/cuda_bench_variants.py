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

``split`` (from the patched file): M = 5..7 of one batch (B = 1) as several launches
instead of V = 4 tiles: a V = 4 pass, then the rest as a V = 2 pass and/or stock's
per-vector qmv for the last vector (5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1). Each pass
reads the weights again, so the costs add up; summed from the compiled grid's own cells,
8-bit M = 5..7 would take some 0.6-0.9 of stock's time, where two V = 4 passes (the
tail one partly on zero vectors) read 0.8-1.3 (docs/cuda.md, "Next to time"). Its arm
streams 8-bit at every M as well (PATCHKIT_QMV_VARIANT=1); every row comes from the same
two kernels as before, so it stays exact and is checked bitwise.

Usage: python scripts/cuda_bench_variants.py tilings PATCHED_QMV_CU OUT_DIR
       python scripts/cuda_bench_variants.py registers PINNED_QMV_CU OUT_DIR
       python scripts/cuda_bench_variants.py split PATCHED_QMV_CU OUT_DIR
  PATCHED_QMV_CU: the rendered file, e.g. `git -C <cache clone> show
  patchkit/<pin>:mlx/backend/cuda/quantized/qmm/qmv.cu > qmv.cu`
  PINNED_QMV_CU: the same path at the pin itself (`show <pin>:...`)
  OUT_DIR: e.g. .peer/tilings or .peer/registers (git-ignored); gets
  mlx/backend/.../qmv.cu
"""

from __future__ import annotations

import sys
from pathlib import Path

QMV = "mlx/backend/cuda/quantized/qmm/qmv.cu"
ARMS = {"v8": 1, "v8-rows4": 2}  # arm name -> PATCHKIT_QMV_VARIANT (0 is `patched`)
# The split kind: the routing it replaces, and the launcher head it adds before DISPATCH.
ROUTE = """inline bool use_qmv_streamed(int m, int bits) {
  return m >= 8 || (m >= 2 && (bits == 4 || (bits == 8 && m <= 4)));
}
"""
ROUTE_SPLIT = """inline int patchkit_qmv_variant() {
  static int variant = [] {
    const char* v = std::getenv("PATCHKIT_QMV_VARIANT");
    return v ? std::atoi(v) : 0;
  }();
  return variant;
}

// M = 5..7 of one batch, under the split variant: several launches (SPLIT_HEAD).
inline bool patchkit_qmv_split(int m, int l) {
  return patchkit_qmv_variant() == 1 && l == 1 && m > 4 && m < 8;
}

inline bool use_qmv_streamed(int m, int bits) {
  if (patchkit_qmv_variant() == 1) {
    return m >= 2 && (bits == 4 || bits == 8);
  }
  return m >= 8 || (m >= 2 && (bits == 4 || (bits == 8 && m <= 4)));
}
"""
SPLIT_HEAD = """  if (patchkit_qmv_split(m, l)) {
    // M = 5..7 of one batch: a V = 4 pass, then a V = 2 pass and/or stock's
    // per-vector qmv (each launch copies its arguments when it is added; the
    // caller holds MLX's concurrent context around them).
    int rest = m - 4;
    m = 4;
    launch(cuda::std::integral_constant<int, 4>{});
    x += 4 * static_cast<int64_t>(k);
    out += 4 * static_cast<int64_t>(n);
    if (rest >= 2) {
      m = 2;
      launch(cuda::std::integral_constant<int, 2>{});
      x += 2 * static_cast<int64_t>(k);
      out += 2 * static_cast<int64_t>(n);
      rest -= 2;
    }
    if (rest == 1) {
      qmv<group_size, has_bias>(
          x, w, scales, biases, global_scale, out, 1, n, k, 1, broadcast_w, launch_kernel);
    }
    return;
  }
"""
# The streamed route in mlx::core::qmv, and the split's. MLX's CommandEncoder gives a CUDA
# graph node the arrays registered since the node before it, then clears them: a second
# kernel node of one primitive would have no dependencies (free to run before x is ready,
# or after the next op read out). MLX's own answer for several kernels in one primitive
# is its concurrent context (as concatenate uses it): the nodes added inside it all get the
# registered arrays as dependencies and are joined by one node that out then maps to. The
# split's passes write disjoint rows of out, so they may run side by side.
ROUTE_CALL = """          if (cu::use_qmv_streamed(m, bits)) {
            cu::qmv_streamed<group_size, has_bias>(
"""
ROUTE_CALL_SPLIT = """          if (cu::use_qmv_streamed(m, bits)) {
            std::optional<cu::CommandEncoder::ConcurrentContext> concurrent;
            if (cu::patchkit_qmv_split(m, l)) {
              concurrent.emplace(encoder);
            }
            cu::qmv_streamed<group_size, has_bias>(
"""
SPLIT_ARM = "// bench-arm: split PATCHKIT_QMV_VARIANT=1\n"
# The registers kind: V per launch, and its arm's environment.
REGISTERS_VECS = (2, 4, 8)
REGISTERS_ARM = "// bench-arm: registers MLX_CUDA_QMV_STREAMED=1\n"

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


def split_source(patched: str) -> str:
    """The patched qmv.cu whose launcher splits M = 5..7 (B = 1) into passes (variant 1)."""
    start = patched.find("void qmv_streamed(")
    wheres = ((ROUTE, patched[:start]), (DISPATCH, patched[start:]), (ROUTE_CALL, patched))
    for old, where in wheres:
        if start < 0 or where.count(old) != 1:
            raise SystemExit(f"the patched qmv.cu no longer has exactly one:\n{old}")
    out = patched.replace(ROUTE, ROUTE_SPLIT, 1).replace(ROUTE_CALL, ROUTE_CALL_SPLIT, 1)
    start = out.index("void qmv_streamed(")
    out = out[:start] + out[start:].replace(DISPATCH, SPLIT_HEAD + DISPATCH, 1)
    return SPLIT_ARM + with_cstdlib(out)


def registers_source(pinned: str) -> str:
    """The pinned qmv.cu rendered with the register-only streamed kernel, V in REGISTERS_VECS."""
    from patchkit.carry import render

    plan = next(p for p in render.load_plans() if p.path == QMV)
    options = render.RenderOptions(backends=("cuda",), routing="opt_in", cuda_x_staging="global")
    # The launcher's V list is a render constant (Metal's tiles); this arm alone
    # swaps in its own, and puts the constant back.
    saved = render.STREAMED_VECS
    render.STREAMED_VECS = REGISTERS_VECS
    try:
        rendered = render.render_file(plan, pinned, options)
    finally:
        render.STREAMED_VECS = saved
    return REGISTERS_ARM + rendered


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[1] not in ("tilings", "registers", "split"):
        raise SystemExit("usage: cuda_bench_variants.py tilings|registers|split QMV_CU OUT_DIR")
    kind, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    target = out / QMV
    target.parent.mkdir(parents=True, exist_ok=True)
    if kind == "tilings":
        target.write_text(variant_source(src.read_text()))
        print(f"{target}: arms {', '.join(ARMS)}")
    elif kind == "split":
        target.write_text(split_source(src.read_text()))
        print(f"{target}: arm split")
    else:
        target.write_text(registers_source(src.read_text()))
        print(f"{target}: arm registers, V in {REGISTERS_VECS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
