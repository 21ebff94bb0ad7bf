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
    """The patched ``qmv_vecs_per_tg``: tiles of 5 (as many as ``qmv_wide``'s), 2 for M = 2.
    A tile takes a lane's last block of K whole: K is a multiple of the group size (MLX's
    ``quantized_matmul`` checks it), so of 16, the largest ``values_per_thread``."""
    return 2 if M == 2 else 5


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

    Off Metal there is no such limit. CUDA is asked up to M = 16, the range the patched
    qmv promises (:data:`CUDA_QMV_MMA_MAX_ROWS`); the CPU uses a generation-15 Mac's, so
    it is asked about the M range where the defect lives.
    """
    if dev.backend == "cuda":
        return CUDA_QMV_MMA_MAX_ROWS + 1
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


def cuda_no_qmm(K: int, group_size: int) -> bool:
    """Neither ``supports_qmm_sm80`` nor ``supports_qmm_naive`` takes a transposed call
    whose K is not a multiple of ``max(64, group_size)`` (nor ``qmm_sm90``, K % 64 != 0):
    ``QuantizedMatmul::eval_gpu`` falls through to qmv at every M."""
    return K % max(64, group_size) != 0


def kernel_path(
    dev: DeviceInfo, mode: str, bits: int, K: int, N: int, M: int, B: int, group_size: int = 0
) -> str:
    """The kernel *stock* MLX's dispatch picks for one call of ``M`` rows on ``dev``.

    - Metal ``QuantizedMatmul::eval_gpu``: M >= batch limit -> qmm (split-K when B == 1).
    - Metal ``dispatch_qmv``: qmv_quad, then ``M >= 2 && use_qmv_wide`` -> qmv_wide,
      otherwise the per-vector qmv (qmv_fast when aligned) with a grid of M.
    - CUDA: where ``qmm_sm90`` applies (:func:`cuda_qmm_sm90`; ``group_size`` 0 says it
      does not), everything but M = B = 1 goes there; where no qmm takes K
      (:func:`cuda_no_qmm`), qmv serves every M; otherwise M * B < 8 -> qmv (one warp per
      row, order of M = 1), else qmm.
    - CPU: one code path, reported as "cpu".
    """
    fp = mode != "affine"
    prefix = "fp_" if fp else ""
    if dev.backend == "cpu":
        return "cpu"
    if dev.backend == "cuda":
        if cuda_qmm_sm90(dev, mode, bits, K, N, group_size):
            return "qmv" if cuda_m1_qmv_on_sm90(M, B, K, N) else "qmm_sm90"
        if cuda_no_qmm(K, group_size) or M * B < CUDA_QMV_MAX_ROWS:
            return prefix + "qmv"
        return "qmm"
    if batch_limit(K, N, dev) <= M:
        return "qmm_splitk" if B == 1 else "qmm"
    if uses_qmv_quad(K, bits):
        return "qmv_quad"
    if M >= 2 and uses_qmv_wide(mode, dev):
        return prefix + "qmv_wide"
    return prefix + ("qmv_fast" if uses_qmv_fast(K, N, bits) else "qmv")


CUDA_QMV_EXACT_MAX_ROWS = 16  # the overlay's exact route: 2 <= M <= 16 (quantized.cpp)
CUDA_QMV_MMA_MAX_ROWS = 16  # the patched quantized.cpp: M * B <= 16 takes qmv's tensor cores


def cuda_qmv_mma(
    dev: DeviceInfo, mode: str, bits: int, dtype: str, K: int, enabled: bool = True
) -> bool:
    """``supports_qmv_mma`` of the patched ``qmv.cu``: compute capability 9 (where rows
    are measured equal to M = 1, and the speed), float16/bfloat16 activations,
    4- or 8-bit weights (affine and the fp modes) and K in whole 16-byte loads of a weight
    row (K % (128 / bits) == 0). Its other condition, x and w starting
    16-byte aligned in their buffers, holds for every array parity makes. ``enabled`` is
    the overlay's ``MLX_CUDA_QMV_SHARED_WEIGHTS`` (0: upstream's kernels everywhere)."""
    return (
        enabled
        and dev.cc_major == 9
        and dtype in ("float16", "bfloat16")
        and bits in (4, 8)
        and K % (128 // bits) == 0
    )


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
    *,
    dtype: str,
    cuda_shared_weights: bool = True,
) -> str:
    """The kernel an MLX built from ``patches/`` takes for the same call (activations in
    ``dtype``, which only the CUDA routing reads).

    - Metal: what stock sends to ``qmv_wide`` goes to the streamed kernel of the
      M = 1 path's flavour (``qmv_fast_streamed`` / ``qmv_streamed``).
    - CUDA: where ``supports_qmv_mma`` holds (:func:`cuda_qmv_mma`), ``M * B <= 16`` goes
      to ``qmv``, which runs on tensor cores there (``qmv_mma``: each weight read once for
      up to 16 vectors, every row as its vector alone), as does every M stock already
      sends to ``qmv`` (in tiles of 16). Other calls that reach ``qmv`` run upstream's
      kernel, one vector per block (also exact).
      The overlay's switches: ``cuda_exact`` (``MLX_CUDA_QMV_EXACT=1``) also sends affine
      ``2 <= M <= 16`` to ``qmv`` where the M = 1 call of those rows runs ``qmv`` (``B < 8``;
      where ``qmm_sm90`` applies, ``B == 1`` with N, K <= 16384), where stock runs ``qmm``;
      ``cuda_shared_weights`` off (``MLX_CUDA_QMV_SHARED_WEIGHTS=0``) turns the tensor-core
      path and its route off.
    - Everything else is stock's routing.
    """
    stock = kernel_path(dev, mode, bits, K, N, M, B, group_size)
    if dev.backend == "metal" and stock.endswith("qmv_wide"):
        fast = "qmv_fast_streamed" if uses_qmv_fast(K, N, bits) else "qmv_streamed"
        return ("fp_" if mode != "affine" else "") + fast
    if dev.backend == "cuda":
        mma = cuda_qmv_mma(dev, mode, bits, dtype, K, cuda_shared_weights)
        if mma and (M * B <= CUDA_QMV_MMA_MAX_ROWS or stock in ("qmv", "fp_qmv")):
            return "qmv_mma"
        if cuda_qmm_sm90(dev, mode, bits, K, N, group_size):
            m1_runs_qmv = cuda_m1_qmv_on_sm90(1, B, K, N)
        else:
            m1_runs_qmv = B < CUDA_QMV_MAX_ROWS
        exact_range = 2 <= M <= CUDA_QMV_EXACT_MAX_ROWS and m1_runs_qmv
        if cuda_exact and mode == "affine" and exact_range:
            return "qmv"
    return stock
