"""Bitwise parity of batched kernels against MLX's M = 1 kernel, on the CPU.

For one case (mode, shape, bits, group size, dtype, M, B and, for nvfp4, the
global scale and output tile) this runs, through the emulator, the M = 1
kernel MLX would pick for that shape (``qmv_fast`` when
:func:`dispatch.uses_qmv_fast` holds, else ``qmv``, with the mode's prefix)
once per vector, alone, and then a batched kernel over all M vectors with the
V tiling MLX's dispatch uses. Every output row is compared as raw bits.

The batched kernel is the streamed kernel under test, or ``qmv_wide`` as the
negative control: a harness that cannot see ``qmv_wide`` diverge proves
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from patchkit.errors import UserError
from patchkit.verify.dispatch import uses_qmv_fast, vecs_per_tg, wide_vecs_per_tg
from patchkit.verify.emulate import sums as sums_mod
from patchkit.verify.emulate.build import Library
from patchkit.verify.emulate.families import FAMILIES, ROLES, Family, Header

# Kernel kinds as runner.cpp numbers them, by role.
KIND = {role: i for i, role in enumerate(ROLES)}


@dataclass(frozen=True)
class Case:
    """One parity configuration; ``hgs`` nvfp4's global scale, ``rps`` its fast tile.

    The fp modes fix bits and group size (:data:`dispatch.FP_MODES`); affine
    cases give them (:meth:`affine`).
    """

    mode: str
    K: int
    N: int
    dtype: str
    M: int
    B: int = 1
    hgs: bool = False
    rps: int = 4
    seed: int = 0
    bits: int = field(default=0, kw_only=True)
    group_size: int = field(default=0, kw_only=True)
    # A multi-dimensional batch shape (B is its product) and the bitmask of its
    # dimensions along which the weights are shared (stored once, stride 0
    # there); empty: one batch dimension of B, each batch with its own weights.
    batch: tuple[int, ...] = field(default=(), kw_only=True)
    w_shared: int = field(default=0, kw_only=True)

    @classmethod
    def affine(
        cls, K: int, N: int, bits: int, group_size: int, dtype: str, M: int, B: int = 1
    ) -> Case:
        return cls("affine", K, N, dtype, M, B, bits=bits, group_size=group_size)

    def __post_init__(self) -> None:
        family = FAMILIES.get(self.mode)
        if family is None:
            raise UserError(f"unknown mode '{self.mode}'; choose from {list(FAMILIES)}")
        if len(family.bits) == 1 and not self.bits:
            object.__setattr__(self, "bits", family.bits[0])
        if len(family.group_sizes) == 1 and not self.group_size:
            object.__setattr__(self, "group_size", family.group_sizes[0])
        if self.bits not in family.bits or self.group_size not in family.group_sizes:
            raise UserError(
                f"{self.mode} takes bits {list(family.bits)} and group sizes "
                f"{list(family.group_sizes)}, not {self.bits} and {self.group_size}"
            )
        if (self.hgs, self.rps) != (False, 4) and not family.variants:
            raise UserError("the global scale and the r_2 tile exist for nvfp4 only")
        if (self.hgs, self.rps) not in family.variants_at(self.K, self.N):
            raise UserError("the r_2 tile is a qmv_fast variant: it needs an aligned shape")
        if self.batch:
            object.__setattr__(self, "B", int(np.prod(self.batch)))
        if self.w_shared >> max(len(self.batch), 1):
            raise UserError("w_shared names batch dimensions the batch shape does not have")

    @property
    def w_batch_shape(self) -> tuple[int, ...]:
        """The weights' stored batch shape: the batch with shared dimensions of 1."""
        dims = self.batch or (self.B,)
        return tuple(1 if self.w_shared >> i & 1 else d for i, d in enumerate(dims))

    @property
    def w_batches(self) -> int:
        """How many weight matrices (and scales, biases) the case stores."""
        return int(np.prod(self.w_batch_shape))

    def w_index(self, b: int) -> int:
        """The stored weight matrix flat batch ``b`` reads (last batch dimension fastest)."""
        dims = self.batch or (self.B,)
        index = np.unravel_index(b, dims)
        wdims = self.w_batch_shape
        stored = tuple(i if w > 1 else 0 for i, w in zip(index, wdims, strict=True))
        return int(np.ravel_multi_index(stored, wdims))

    @property
    def family(self) -> Family:
        return FAMILIES[self.mode]

    @property
    def header(self) -> Header:
        return self.family.header

    @property
    def fast(self) -> bool:
        """Whether MLX runs ``qmv_fast`` (not ``qmv``) for this shape at M = 1."""
        return uses_qmv_fast(self.K, self.N, self.bits)

    @property
    def m1_kernel(self) -> str:
        return self.header.kernel("qmv_fast" if self.fast else "qmv")

    @property
    def streamed_kernel(self) -> str:
        return self.header.kernel("qmv_fast_streamed" if self.fast else "qmv_streamed")

    @property
    def wide_kernel(self) -> str:
        return self.header.wide

    @property
    def V(self) -> int:
        """The patched dispatch's vectors per threadgroup (2 or 5)."""
        return vecs_per_tg(self.M)

    def vecs(self, kernel: str) -> int:
        """Vectors per threadgroup of a batched ``kernel``: the control keeps qmv_wide's tile."""
        return wide_vecs_per_tg(self.M) if kernel == self.wide_kernel else self.V

    @property
    def streamed_rps(self) -> int:
        """The output tile of the batched kernels: MLX instantiates only the full one."""
        return 4

    def _label(self) -> str:
        if self.mode == "affine":
            return (
                f"K={self.K} N={self.N} bits={self.bits} gs={self.group_size} "
                f"{self.dtype} M={self.M} B={self.B}"
            )
        extra = (" hgs" if self.hgs else "") + (" r_2" if self.rps == 2 else "")
        return f"{self.mode} K={self.K} N={self.N} {self.dtype} M={self.M} B={self.B}{extra}"

    def label(self) -> str:
        if not self.batch:
            return self._label()
        shared = f" w_shared={self.w_shared}" if self.w_shared else ""
        return f"{self._label()} batch={'x'.join(map(str, self.batch))}{shared}"

    def as_dict(self) -> dict[str, object]:
        """The fields JSON carries for this case's header (``case_keys``; any batch shape)."""
        fields = {k: getattr(self, k) for k in self.header.case_keys}
        if self.batch:
            fields.update(batch=list(self.batch), w_shared=self.w_shared)
        return fields


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
    # The simd_sum inputs (sums.py), where both runs recorded them: output
    # elements compared, those whose 32 per-lane inputs differ, and calls whose
    # key the kernel's own store did not confirm. None: not recorded (qmv_wide
    # reduces with simd_shuffle_down and calls no simd_sum).
    sum_inputs: int | None = None
    sum_inputs_differing: int | None = None
    sum_calls_unconfirmed: int | None = None

    @property
    def identical(self) -> bool:
        """Every row equal and, where recorded, every simd_sum handed the same values."""
        return (
            self.rows_differing == 0
            and not self.sum_inputs_differing
            and not (self.sum_calls_unconfirmed)
        )

    def as_dict(self) -> dict[str, object]:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "case"}
        return {**self.case.as_dict(), **fields}


def to_float(y: np.ndarray, dtype: str) -> np.ndarray:
    """Stored outputs as float64, for reporting differences."""
    if dtype == "bfloat16":
        return (y.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return y.astype(np.float64)


def make_inputs(case: Case) -> tuple[np.ndarray, ...]:
    """The family's random inputs for ``case``: (w, scales, biases or global scale, x)."""
    return case.family.inputs(case)


def _empty_out(case: Case, M: int, B: int, like: np.ndarray) -> np.ndarray:
    # NaN-filled (all ones) so a row a kernel never writes cannot pass as equal.
    return (
        np.full((B, M, case.N), np.iinfo(np.uint16).max, dtype=np.uint16).view(like.dtype)
        if (like.itemsize == 2)
        else np.full((B, M, case.N), np.nan, dtype=like.dtype)
    )


@dataclass(frozen=True)
class Output:
    """What one kernel run produced: y (B, M, N) and, when recorded, its simd_sum calls."""

    y: np.ndarray
    sums: sums_mod.Sums | None = None


def _run(
    lib: Library, case: Case, kernel: str, V: int, dims, buffers, batch=True, record=None
) -> int:
    role = kernel.removeprefix(case.header.kernel_prefix)
    shape = dict(batch=case.batch, w_shared=case.w_shared) if batch else {}
    return lib.run(
        case.dtype,
        case.group_size,
        case.bits,
        KIND[role],
        V,
        dims,
        buffers,
        case.hgs,
        case.rps,
        **shape,
        record=record,
    )


def _recorded(lib: Library, case: Case, kernel: str, V: int, dims, buffers, **kw) -> np.ndarray:
    """Run with a simd_sum recording; the records."""
    B, M, N, _ = dims
    rps = case.rps if V == 1 else case.streamed_rps
    records = np.zeros(sums_mod.capacity(N, M, B, V, rps), dtype=sums_mod.RECORD)
    n = _run(lib, case, kernel, V, dims, buffers, record=records, **kw)
    return records[:n]


def run_m1(
    lib: Library, case: Case, inputs: tuple[np.ndarray, ...], record: bool = False
) -> Output:
    """Each vector alone through the M = 1 kernel MLX would choose: y of shape (B, M, N)."""
    w, s, aux, x = inputs
    batched_aux = aux.ndim == 3  # biases are per batch; the global scale is one value
    y = _empty_out(case, case.M, case.B, x)
    parts = []
    for bi in range(case.B):
        wi = case.w_index(bi)
        for i in range(case.M):
            one = np.array(y[bi, i : i + 1][None])
            a = aux[wi] if batched_aux else aux
            # Copies: each buffer its own allocation, so a read past one is a
            # read past an allocation (sanitize.py), not into the next batch.
            bufs = (*(np.array(b) for b in (w[wi], s[wi], a, x[bi, i : i + 1])), one)
            dims = (1, 1, case.N, case.K)
            if record:
                records = _recorded(lib, case, case.m1_kernel, 1, dims, bufs, batch=False)
                parts.append(sums_mod.keyed(case, records, one, aux, V=1, vector=(bi, i)))
            else:
                _run(lib, case, case.m1_kernel, 1, dims, bufs, batch=False)
            y[bi, i] = one[0, 0]
    return Output(y, sums_mod.Sums.concat(parts) if record else None)


def run_batched(
    lib: Library, case: Case, inputs: tuple[np.ndarray, ...], kernel: str, record: bool = False
) -> Output:
    """All M vectors (and B batches) in one launch of ``kernel``: y of shape (B, M, N)."""
    w, s, aux, x = inputs
    y = _empty_out(case, case.M, case.B, x)
    dims = (case.B, case.M, case.N, case.K)
    V = case.vecs(kernel)
    if not record:
        _run(lib, case, kernel, V, dims, (w, s, aux, x, y))
        return Output(y)
    records = _recorded(lib, case, kernel, V, dims, (w, s, aux, x, y))
    return Output(y, sums_mod.keyed(case, records, y, aux, V=V, rps=case.streamed_rps))


def compare(case: Case, kernel: str, reference: Output, candidate: Output) -> Result:
    """Bitwise row comparison of ``candidate`` against the M = 1 ``reference``.

    Where both runs recorded their simd_sum calls, also the 32 per-lane inputs
    of every output element's simd_sum (:func:`sums.compare`).
    """
    ref_bits = reference.y.view(np.uint16 if reference.y.itemsize == 2 else np.uint32)
    cand_bits = candidate.y.view(ref_bits.dtype)
    differs = ref_bits != cand_bits
    diff = np.abs(to_float(reference.y, case.dtype) - to_float(candidate.y, case.dtype))
    extra: dict[str, int] = {}
    if reference.sums is not None and candidate.sums is not None:
        c = sums_mod.compare(reference.sums, candidate.sums, case.B * case.M * case.N)
        extra = dict(
            sum_inputs=c.elements,
            sum_inputs_differing=c.differing,
            sum_calls_unconfirmed=c.unconfirmed,
        )
    return Result(
        case=case,
        kernel=kernel,
        m1_kernel=case.m1_kernel,
        V=case.vecs(kernel),
        rows=case.B * case.M,
        rows_differing=int(differs.any(axis=-1).sum()),
        elements_differing=int(differs.sum()),
        max_abs_diff=float(np.nan_to_num(diff, nan=np.inf).max()),
        **extra,
    )
