"""Upstream's dispatch facts, in one place: which kernel a quantized matmul call takes.

Everything that decides *which* kernel the proof, the parity suite, the
benchmarks or the probe must exercise asks this module, so the facts cannot
drift apart between them. Each function names the upstream code it restates
(pin 9a795735, ``mlx/backend/metal/quantized.cpp`` unless said otherwise), and
``tests/test_dispatch.py`` checks the restatements against the pinned source
text where a clone is available.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from patchkit.carry.render import RenderOptions

# The fp modes and their fixed (group_size, bits): ``quantized.cpp``'s mode table.
FP_MODES: dict[str, tuple[int, int]] = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
MODES = ("affine", *FP_MODES)
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# qmv_wide and the batched qmv take at most this many vectors per threadgroup.
MAX_VECS_PER_TG = 5


def pack_factor(bits: int) -> int:
    """Values per 32-bit pack, as ``get_pack_factor<bits, 32>`` (``kernels/quantized_utils.h``)."""
    return 8 if bits in (3, 5) else (4 if bits == 6 else 32 // bits)


def qmv_fast_k_alignment(bits: int) -> int:
    """The K step of ``qmv_fast_impl`` (``qmv_fast_k_alignment``): packs per thread x 32 lanes."""
    return pack_factor(bits) * (1 if bits == 2 else 2) * 32


def uses_qmv_fast(K: int, N: int, bits: int) -> bool:
    """``qmv``'s M = 1 choice, the same for every mode: ``N % 8 == 0 && K % alignment == 0``."""
    return N % 8 == 0 and K % qmv_fast_k_alignment(bits) == 0


def wide_vecs_per_tg(M: int) -> int:
    """Upstream ``qmv_wide``'s tile: the fewest tiles of at most 5 vectors, then the smallest."""
    n_tiles = -(-M // MAX_VECS_PER_TG)
    return -(-M // n_tiles)


# The vecs_per_tg the patched tree instantiates for M >= 2 (``quantized.metal``).
STREAMED_VECS = (2, 5)


def vecs_per_tg(M: int) -> int:
    """The patched ``qmv_vecs_per_tg``: as few tiles as ``qmv_wide``, each of 2 or 5 vectors."""
    return 2 if wide_vecs_per_tg(M) <= 2 else 5


def uses_qmv_quad(K: int, bits: int) -> bool:
    """``dispatch_qmv``: K in {64, 128} with power-of-two bits takes ``qmv_quad`` (out of scope)."""
    return K in (64, 128) and bits & (bits - 1) == 0


@dataclass(frozen=True)
class DeviceInfo:
    """Where MLX's default device runs, as the dispatch sees it."""

    backend: str  # "metal" | "cuda" | "cpu"
    name: str  # e.g. "applegpu_g15s", "NVIDIA H200", "cpu"
    gen: int | None = None  # Metal architecture generation (device.cpp's arch_gen)
    size: str = ""  # Metal architecture size letter: 'p' phone, 'g', 's', 'c', 'd'
    cc_major: int = 0  # CUDA compute capability major (0: not CUDA, or not reported)


def metal_arch(name: str) -> tuple[int, str]:
    """(gen, size) from an architecture name such as ``applegpu_g15s``, as device.cpp parses it."""
    digits = name[-3:-1] if len(name) >= 3 else ""
    gen = int(digits) if re.fullmatch(r"\d\d", digits) else 0
    return gen, name[-1:] if name else ""


def batch_limit(K: int, N: int, dev: DeviceInfo) -> int:
    """``get_qmv_batch_limit(D=K, O=N)``: from this M on, Metal runs qmm.

    Off Metal there is no such limit; we use a generation-15 Mac's, so every
    backend is asked about the M range where the defect lives.
    """
    gen, size = (dev.gen or 15, dev.size or "s") if dev.backend == "metal" else (15, "s")
    small, mid = K <= 2048 and N <= 2048, K <= 4096 and N <= 4096
    if gen >= 17 and size != "d":
        table = (33, 25, 13)
    elif gen >= 15 and size != "d":
        table = (13, 15, 13)
    elif size == "d":  # gen 13/14 and older share the 'd' (Ultra) table
        table = (32, 18, 12)
    elif gen >= 13:
        table = (14, 10, 6)
    else:
        table = (18, 12, 10)
    return table[0] if small else table[1] if mid else table[2]


def uses_qmv_wide(mode: str, dev: DeviceInfo) -> bool:
    """``use_qmv_wide``: the fp modes on every generation, affine from generation 15 on."""
    return mode != "affine" or (dev.gen or 0) >= 15


CUDA_QMV_MAX_ROWS = 8  # cuda/quantized/quantized.cpp: M * B below this takes qmv


def cuda_qmm_sm90(dev: DeviceInfo, mode: str, bits: int, K: int, N: int, group_size: int) -> bool:
    """Stock's ``supports_qmm_sm90`` for parity's calls (transposed, row-contiguous, affine
    with biases): compute capability 9, 4- or 8-bit, one group per row of W
    (``group_size >= K``), K % 64 == 0 and N 16-byte aligned in packed uint32 words (TMA)."""
    return (
        dev.cc_major == 9
        and mode == "affine"
        and bits in (4, 8)
        and group_size >= K
        and K % 64 == 0
        and N % 4 == 0
    )


def cuda_m1_qmv_on_sm90(M: int, B: int, K: int, N: int) -> bool:
    """Where ``qmm_sm90`` applies, stock keeps ``qmv`` only for one vector of one batch."""
    return M == 1 and B == 1 and N <= 16384 and K <= 16384


def kernel_path(
    dev: DeviceInfo, mode: str, bits: int, K: int, N: int, M: int, B: int, group_size: int = 0
) -> str:
    """The kernel *stock* MLX's dispatch picks for one call of ``M`` rows on ``dev``.

    - Metal ``QuantizedMatmul::eval_gpu``: M >= batch limit -> qmm (split-K when B == 1).
    - Metal ``dispatch_qmv``: qmv_quad, then ``M >= 2 && use_qmv_wide`` -> qmv_wide,
      otherwise the per-vector qmv (qmv_fast when aligned) with a grid of M.
    - CUDA: where ``qmm_sm90`` applies (:func:`cuda_qmm_sm90`; ``group_size`` 0 says it
      does not), everything but M = B = 1 goes there; otherwise M * B < 8 -> qmv (one warp
      per row, order of M = 1), else qmm.
    - CPU: one code path, reported as "cpu".
    """
    fp = mode != "affine"
    prefix = "fp_" if fp else ""
    if dev.backend == "cpu":
        return "cpu"
    if dev.backend == "cuda":
        if cuda_qmm_sm90(dev, mode, bits, K, N, group_size):
            return "qmv" if cuda_m1_qmv_on_sm90(M, B, K, N) else "qmm_sm90"
        return prefix + "qmv" if M * B < CUDA_QMV_MAX_ROWS else "qmm"
    if batch_limit(K, N, dev) <= M:
        return "qmm_splitk" if B == 1 else "qmm"
    if uses_qmv_quad(K, bits):
        return "qmv_quad"
    if M >= 2 and uses_qmv_wide(mode, dev):
        return prefix + "qmv_wide"
    return prefix + ("qmv_fast" if uses_qmv_fast(K, N, bits) else "qmv")


CUDA_QMV_EXACT_MAX_ROWS = 16  # the opt-in exact range of the patched quantized.cpp


def cuda_splits(M: int, B: int, bits: int) -> bool:
    """``cu::qmv_streamed_splits(m, l, bits)`` with ``cuda_split_tail``: M = 5..7 of one
    batch as several passes (4-bit at M = 7 keeps one launch of two V = 4 tiles)."""
    return B == 1 and (M in (5, 6) or (M == 7 and bits == 8))


def cuda_streams(
    M: int, bits: int, K: int, N: int, B: int = 1, options: RenderOptions | None = None
) -> bool:
    """``cu::use_qmv_streamed`` of the patched qmv.cu rendered with ``options`` (default:
    the shipped ``patches/``), for the M >= 2 that reach it.

    Shipped: where the compiled kernel was timed faster than stock's per-vector qmv on an
    H200 with the weights read from HBM: layers of at least ``cuda_stream_min_weights``
    weights (n * k, 2**24), 4-bit from M = 2, 8-bit at M = 2..7 (M = 5..7 of one batch
    split into passes, ``cuda_split_tail``; in a batch of B > 1 they keep the per-vector
    kernel). Smaller layers and other widths stream only at M >= 8, which only the exact
    route reaches.
    """
    opts = options or RenderOptions()
    if M >= 8:
        return True
    if opts.stream_min_weights > N * K:
        return False
    if M < 2:
        return False
    if bits == 4:
        return True
    return bits == 8 and (M <= 4 or (opts.split_tail and cuda_splits(M, B, bits)))


def patched_kernel_path(
    dev: DeviceInfo,
    mode: str,
    bits: int,
    K: int,
    N: int,
    M: int,
    B: int,
    cuda_exact: bool = False,
    group_size: int = 0,
) -> str:
    """The kernel an MLX built from ``patches/`` (upstream flavour) takes for the same call.

    - Metal: what stock sends to ``qmv_wide`` goes to the streamed kernel of the
      M = 1 path's flavour (``qmv_fast_streamed`` / ``qmv_streamed``).
    - CUDA: ``qmv`` streams the M >= 2 that reach it where that was measured faster
      (``cuda_streams``), otherwise it runs stock's per-vector ``qmv``, which is just as
      exact (affine; ``fp_qmv`` is stock). With ``cuda_exact``
      (``MLX_CUDA_QMV_EXACT=1``), affine ``2 <= M <= 16`` with ``B < 8`` reaches ``qmv``
      too, where stock would run ``qmm``; where ``qmm_sm90`` applies, with ``B == 1`` (the
      calls whose M = 1 stock runs on ``qmv``) instead of ``B < 8``.
    - Everything else is stock's routing.
    """
    stock = kernel_path(dev, mode, bits, K, N, M, B, group_size)
    if dev.backend == "metal" and stock.endswith("qmv_wide"):
        fast = "qmv_fast_streamed" if uses_qmv_fast(K, N, bits) else "qmv_streamed"
        return ("fp_" if mode != "affine" else "") + fast
    if dev.backend == "cuda":
        if cuda_qmm_sm90(dev, mode, bits, K, N, group_size):
            m1_runs_qmv = cuda_m1_qmv_on_sm90(1, B, K, N)
        else:
            m1_runs_qmv = B < CUDA_QMV_MAX_ROWS
        exact_range = 2 <= M <= CUDA_QMV_EXACT_MAX_ROWS and m1_runs_qmv
        if stock == "qmv" or (cuda_exact and mode == "affine" and exact_range):
            return "qmv_streamed" if cuda_streams(M, bits, K, N, B) else "qmv"
    return stock
