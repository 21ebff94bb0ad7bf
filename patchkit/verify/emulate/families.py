"""The kernel families the emulator runs: one table, read by every step.

A :class:`Header` is one upstream kernel header and what the emulator takes
from it (functions, structs, type headers), how the runner calls its kernels,
how its libraries are grouped and how its negative control is judged. A
:class:`Family` is one quantization mode on a header: its group sizes and
bits (from :mod:`patchkit.verify.dispatch`), its variants and its inputs.
Extraction, build, runner, case matrix, report and verdict are one code path
over this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from patchkit.verify import dispatch

# The five kernel roles, as runner.cpp numbers them; a header's kernel names
# are its prefix + role. The first three run the upstream text (the M = 1
# reference and the qmv_wide control); the streamed roles run the patched
# text's qmv_fast / qmv with vecs_per_tg > 1.
ROLES = ("qmv_fast", "qmv", "qmv_wide", "qmv_fast_streamed", "qmv_streamed")
M1_ROLES = ("qmv_fast", "qmv")
STREAMED_ROLES = ("qmv_fast_streamed", "qmv_streamed")
DTYPES = ("float32", "float16", "bfloat16")


def base_role(role: str) -> str:
    """The M = 1 kernel a role runs: a streamed role is that kernel with vecs_per_tg > 1."""
    return role.removesuffix("_streamed")


@dataclass(frozen=True)
class Header:
    """One upstream kernel header and how the emulator compiles, runs and judges its kernels."""

    name: str  # the suite's name: "affine" or "fp"
    path: str  # upstream path of the kernel header
    type_headers: tuple[str, ...]  # compiled whole before the kernels (fp4.h, fp8.h)
    # Helpers every kernel needs, (name, overload index or None), and structs.
    helpers: tuple[tuple[str, int | None], ...]
    structs: tuple[str, ...]
    kernel_prefix: str  # kernel names: prefix + role ("fp_qmv_fast")
    entry_prefix: str  # [[kernel]] entries: prefix + role ("affine_qmv_fast")
    runner_family: str  # the runner's PATCHKIT_FAMILY_<name> macro
    # One library per (mode, bits) with every dtype, rather than one per (dtype, bits).
    library_per_mode: bool
    # Control divergence, per group of dtypes, as JSON reports it; the first
    # group gates the verdict at min_control.
    control_groups: tuple[tuple[str, ...], ...]
    min_control: float
    case_keys: tuple[str, ...]  # the case fields JSON carries for this header

    def kernel(self, role: str) -> str:
        return self.kernel_prefix + role

    @property
    def kernels(self) -> dict[str, tuple[str, ...]]:
        """Kernel name -> the functions (impl, [[kernel]] entry) it needs beyond the helpers.

        A streamed role is the patched tree's own M = 1 kernel (one body, run with
        vecs_per_tg > 1), so it needs that kernel's functions, from the patched text.
        """
        return {
            self.kernel(role): (
                self.kernel(base_role(role)) + "_impl",
                self.entry_prefix + base_role(role),
            )
            for role in ROLES
        }

    @property
    def upstream_kernels(self) -> tuple[str, ...]:
        return tuple(self.kernel(r) for r in ROLES if r not in STREAMED_ROLES)

    @property
    def streamed_kernels(self) -> tuple[str, ...]:
        return tuple(self.kernel(r) for r in STREAMED_ROLES)

    @property
    def wide(self) -> str:
        return self.kernel("qmv_wide")


@dataclass(frozen=True)
class Family:
    """One quantization mode: its header, parameters, variants and inputs."""

    mode: str
    header: Header
    group_sizes: tuple[int, ...]
    bits: tuple[int, ...]
    # (global scale, results per simdgroup) variants beyond the plain (False, 4).
    variants: tuple[tuple[bool, int], ...]
    inputs: Callable[[Any], tuple[np.ndarray, ...]]

    def variants_at(self, K: int, N: int) -> list[tuple[bool, int]]:
        """The (global scale, tile) variants MLX has at this shape; r_2 is a qmv_fast tile."""
        fast = dispatch.uses_qmv_fast(K, N, self.bits[0])
        return [(False, 4)] + [(h, r) for h, r in self.variants if r == 4 or fast]


def storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values rounded to ``dtype`` and held in its storage type (bf16 as uint16 bits)."""
    if dtype == "float32":
        return values.astype(np.float32)
    if dtype == "float16":
        return values.astype(np.float16)
    u = values.astype(np.float32).view(np.uint32)
    rounded = u + 0x7FFF + ((u >> 16) & 1)  # round to nearest even
    return (rounded >> 16).astype(np.uint16)


def affine_inputs(case: Any) -> tuple[np.ndarray, ...]:
    """Random packed weights, scales, biases and inputs for an affine ``case`` (w, s, b, x)."""
    rng = np.random.default_rng(
        [case.seed, case.K, case.N, case.bits, case.group_size, case.M, case.B]
    )
    B, M, N, K = case.B, case.M, case.N, case.K
    Bw = case.w_batches  # B, or fewer where weights are shared along a batch dimension
    w = rng.integers(0, 2**32, size=(Bw, N, K * case.bits // 32), dtype=np.uint32)
    groups = K // case.group_size
    scales = rng.uniform(0.002, 0.02, size=(Bw, N, groups))
    biases = -scales * (2 ** (case.bits - 1)) * rng.uniform(0.8, 1.2, size=(Bw, N, groups))
    x = rng.standard_normal(size=(B, M, K))
    return (
        w,
        storage(scales, case.dtype),
        storage(biases, case.dtype),
        storage(x, case.dtype),
    )


# fp_quantized.h's F8E4M3_MAX * F4E2M1_MAX, the nvfp4 global-scale encoding.
GLOBAL_SCALE_DIVISOR = 448.0 * 6.0


def fp_inputs(case: Any) -> tuple[np.ndarray, ...]:
    """Random packed weights, scale bytes, global scale and inputs (w, s, g, x).

    Weights are any bytes (every fp4 nibble and, by MLX's decode, every fp8 byte
    is finite). Scales keep dequantized weights near real checkpoints' range
    (e8m0 exponents 2^-8..2^-5 for mxfp4, 2^-12..2^-9 for mxfp8; e4m3 values
    0.25..3.75 for nvfp4), so no output overflows float16.

    Inputs are normal values times a log-uniform magnitude 2^-8..2^4, the
    outlier-heavy spread of real activations. This matters for the proof: with
    standard-normal float16/bfloat16 inputs, products with fp4/fp8 weights are
    exact in float32 and most sums are too, so any summation order gives the
    same bits and neither the streamed check nor the fp_qmv_wide control
    could fail (measured: the control then differed on 2 of 54 float16 and 1
    of 54 bfloat16 default cases).
    """
    rng = np.random.default_rng(
        [case.seed, case.K, case.N, case.bits, case.group_size, case.M, case.B, case.hgs]
    )
    B, M, N, K = case.B, case.M, case.N, case.K
    Bw = case.w_batches  # B, or fewer where weights are shared along a batch dimension
    w = rng.integers(0, 2**32, size=(Bw, N, K * case.bits // 32), dtype=np.uint32)
    groups = K // case.group_size
    if case.group_size == 16:
        # e4m3: exponent field 5..8 (bias 7), any mantissa.
        scales = rng.integers(0x28, 0x48, size=(Bw, N, groups), dtype=np.uint8)
    elif case.bits == 4:
        scales = rng.integers(127 - 8, 127 - 4, size=(Bw, N, groups), dtype=np.uint8)
    else:
        scales = rng.integers(127 - 12, 127 - 8, size=(Bw, N, groups), dtype=np.uint8)
    # A global scale as nvfp4 checkpoints store it (amax-derived, of order 448 * 6).
    g = np.array([rng.uniform(0.05, 2.0) * GLOBAL_SCALE_DIVISOR], dtype=np.float32)
    x = rng.standard_normal(size=(B, M, K)) * 2.0 ** rng.uniform(-8, 4, size=(B, M, K))
    return w, scales, g, storage(x, case.dtype)


_SHARED_HELPERS: tuple[tuple[str, int | None], ...] = (
    ("get_pack_factor", None),
    ("get_bytes_per_pack", None),
)
# The strided batch overload; the gather overload is not used by qmv.
_BATCH_OFFSETS = (("adjust_matrix_offsets", 0),)

AFFINE = Header(
    name="affine",
    path="mlx/backend/metal/kernels/quantized.h",
    type_headers=(),
    helpers=(
        *_SHARED_HELPERS,
        ("load_vector", None),
        ("load_vector_safe", None),
        ("qdot", None),
        ("qdot_safe", None),
        ("dequantize", None),
        *_BATCH_OFFSETS,
    ),
    structs=(),
    kernel_prefix="",
    entry_prefix="affine_",
    runner_family="AFFINE",
    library_per_mode=False,
    # A harness that cannot see qmv_wide diverge proves nothing; on the default
    # matrix it diverges on nearly every float32/float16 case (see docs/kernel.md).
    control_groups=(("float32", "float16"), ("bfloat16",)),
    min_control=0.5,
    case_keys=("K", "N", "bits", "group_size", "dtype", "M", "B", "seed"),
)

FP = Header(
    name="fp",
    path="mlx/backend/metal/kernels/fp_quantized.h",
    type_headers=("mlx/backend/metal/kernels/fp4.h", "mlx/backend/metal/kernels/fp8.h"),
    helpers=(
        *_SHARED_HELPERS,
        ("dequantize_scale", None),
        ("load_vector", None),
        ("load_vector_safe", None),
        ("qdot", None),
        ("qdot_safe", None),
        *_BATCH_OFFSETS,
    ),
    structs=("Dequantize",),
    kernel_prefix="fp_",
    entry_prefix="fp_",
    runner_family="FP",
    # A build costs mostly fixed overhead (shim, fibers), so one library per
    # mode holding all three dtypes is barely slower than one dtype, and every
    # run of a mode (matrix, one case, tests) then hits the same cache.
    library_per_mode=True,
    # float32 outputs show every float32 order difference, so fp_qmv_wide must
    # differ on nearly all of them (measured: 100%); narrower outputs hide most
    # differences below their rounding (see suite.FP_SHAPES): reported, not gated.
    control_groups=(("float32",), ("float16",), ("bfloat16",)),
    min_control=0.9,
    case_keys=("mode", "K", "N", "dtype", "M", "B", "hgs", "rps", "seed"),
)

HEADERS = {h.name: h for h in (AFFINE, FP)}

FAMILIES: dict[str, Family] = {
    "affine": Family(
        "affine", AFFINE, dispatch.GROUP_SIZES, dispatch.AFFINE_BITS, (), affine_inputs
    ),
    **{
        mode: Family(
            mode,
            FP,
            (gs,),
            (bits,),
            # nvfp4 alone has the global scale (_hgs) and the narrow fast tile (_r_2).
            ((True, 4), (False, 2), (True, 2)) if mode == "nvfp4" else (),
            fp_inputs,
        )
        for mode, (gs, bits) in dispatch.FP_MODES.items()
    },
}
FP_MODES = tuple(dispatch.FP_MODES)


def modes_of(header: Header) -> tuple[str, ...]:
    """The modes whose kernels live in ``header``."""
    return tuple(m for m, f in FAMILIES.items() if f.header is header)
