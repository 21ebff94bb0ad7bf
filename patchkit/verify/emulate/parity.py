"""Bitwise parity of batched kernels against MLX's M = 1 kernel, on the CPU.

For one case (shape, bits, group size, dtype, M, B) this runs, through the
emulator, the M = 1 kernel MLX would pick for that shape (``qmv_fast`` when
``N % 8 == 0 and K % qmv_fast_k_alignment(bits) == 0``, else ``qmv``) once per
vector, alone, and then a batched kernel over all M vectors with the V tiling
MLX's dispatch uses. Every output row is compared as raw bits.

The batched kernel is the streamed kernel under test, or ``qmv_wide`` as the
negative control: a harness that cannot see ``qmv_wide`` diverge proves
nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from patchkit.verify.dispatch import uses_qmv_fast, vecs_per_tg
from patchkit.verify.emulate.build import Library

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = ("float32", "float16", "bfloat16")
# Kernel kinds as runner.cpp numbers them.
KIND = {"qmv_fast": 0, "qmv": 1, "qmv_wide": 2, "qmv_fast_streamed": 3, "qmv_streamed": 4}


@dataclass(frozen=True)
class Case:
    """One parity configuration."""

    K: int
    N: int
    bits: int
    group_size: int
    dtype: str
    M: int
    B: int = 1
    seed: int = 0

    @property
    def fast(self) -> bool:
        """Whether MLX runs ``qmv_fast`` (not ``qmv``) for this shape at M = 1."""
        return uses_qmv_fast(self.K, self.N, self.bits)

    @property
    def m1_kernel(self) -> str:
        return "qmv_fast" if self.fast else "qmv"

    @property
    def streamed_kernel(self) -> str:
        return "qmv_fast_streamed" if self.fast else "qmv_streamed"

    @property
    def V(self) -> int:
        return vecs_per_tg(self.M)

    def label(self) -> str:
        return (
            f"K={self.K} N={self.N} bits={self.bits} gs={self.group_size} "
            f"{self.dtype} M={self.M} B={self.B}"
        )


@dataclass(frozen=True)
class Result:
    """The bitwise comparison of one batched kernel against M = 1, for one case."""

    case: Case
    kernel: str
    m1_kernel: str
    V: int
    rows: int
    rows_differing: int
    elements_differing: int
    max_abs_diff: float

    @property
    def identical(self) -> bool:
        return self.rows_differing == 0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self.case), **{k: v for k, v in asdict(self).items() if k != "case"}}


def _storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values rounded to ``dtype`` and held in its storage type (bf16 as uint16 bits)."""
    if dtype == "float32":
        return values.astype(np.float32)
    if dtype == "float16":
        return values.astype(np.float16)
    u = values.astype(np.float32).view(np.uint32)
    rounded = u + 0x7FFF + ((u >> 16) & 1)  # round to nearest even
    return (rounded >> 16).astype(np.uint16)


def to_float(y: np.ndarray, dtype: str) -> np.ndarray:
    """Stored outputs as float64, for reporting differences."""
    if dtype == "bfloat16":
        return (y.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return y.astype(np.float64)


def make_inputs(case: Case) -> tuple[np.ndarray, ...]:
    """Random packed weights, scales, biases and inputs for ``case`` (w, s, b, x)."""
    rng = np.random.default_rng(
        [case.seed, case.K, case.N, case.bits, case.group_size, case.M, case.B]
    )
    B, M, N, K = case.B, case.M, case.N, case.K
    w = rng.integers(0, 2**32, size=(B, N, K * case.bits // 32), dtype=np.uint32)
    groups = K // case.group_size
    scales = rng.uniform(0.002, 0.02, size=(B, N, groups))
    biases = -scales * (2 ** (case.bits - 1)) * rng.uniform(0.8, 1.2, size=(B, N, groups))
    x = rng.standard_normal(size=(B, M, K))
    return (
        w,
        _storage(scales, case.dtype),
        _storage(biases, case.dtype),
        _storage(x, case.dtype),
    )


def _empty_out(case: Case, M: int, B: int, like: np.ndarray) -> np.ndarray:
    # NaN-filled (all ones) so a row a kernel never writes cannot pass as equal.
    return (
        np.full((B, M, case.N), np.iinfo(np.uint16).max, dtype=np.uint16).view(like.dtype)
        if (like.itemsize == 2)
        else np.full((B, M, case.N), np.nan, dtype=like.dtype)
    )


def run_m1(lib: Library, case: Case, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """Each vector alone through the M = 1 kernel MLX would choose: y of shape (B, M, N)."""
    w, s, b, x = inputs
    y = _empty_out(case, case.M, case.B, x)
    for bi in range(case.B):
        for i in range(case.M):
            one = np.ascontiguousarray(y[bi, i : i + 1][None])
            bufs = (w[bi], s[bi], b[bi], np.ascontiguousarray(x[bi, i : i + 1]), one)
            dims = (1, 1, case.N, case.K)
            lib.run(case.dtype, case.group_size, case.bits, KIND[case.m1_kernel], 1, dims, bufs)
            y[bi, i] = one[0, 0]
    return y


def run_batched(
    lib: Library, case: Case, inputs: tuple[np.ndarray, ...], kernel: str
) -> np.ndarray:
    """All M vectors (and B batches) in one launch of ``kernel``: y of shape (B, M, N)."""
    w, s, b, x = inputs
    y = _empty_out(case, case.M, case.B, x)
    dims = (case.B, case.M, case.N, case.K)
    lib.run(case.dtype, case.group_size, case.bits, KIND[kernel], case.V, dims, (w, s, b, x, y))
    return y


def compare(case: Case, kernel: str, reference: np.ndarray, candidate: np.ndarray) -> Result:
    """Bitwise row comparison of ``candidate`` against the M = 1 ``reference``."""
    ref_bits = reference.view(np.uint16 if reference.itemsize == 2 else np.uint32)
    cand_bits = candidate.view(ref_bits.dtype)
    differs = ref_bits != cand_bits
    diff = np.abs(to_float(reference, case.dtype) - to_float(candidate, case.dtype))
    return Result(
        case=case,
        kernel=kernel,
        m1_kernel=case.m1_kernel,
        V=case.V,
        rows=case.B * case.M,
        rows_differing=int(differs.any(axis=-1).sum()),
        elements_differing=int(differs.sum()),
        max_abs_diff=float(np.nan_to_num(diff, nan=np.inf).max()),
    )
