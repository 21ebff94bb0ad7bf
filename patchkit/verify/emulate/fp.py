"""Bitwise parity of the fp-mode kernels (mxfp4, nvfp4, mxfp8) on the CPU.

The fp twin of :mod:`parity` and :mod:`suite`: for one case (mode, shape,
dtype, M, B, global scale, output tile) it runs every vector alone through the
M = 1 kernel MLX picks (``fp_qmv_fast`` when ``N % 8 == 0 and K %
qmv_fast_k_alignment(bits) == 0``, else ``fp_qmv``) and compares each row of
one batched launch, bit for bit. The batched kernel is the streamed kernel
under test or ``fp_qmv_wide`` (k_lanes 16, as the fp dispatch sets it) as the
negative control. ``fp_qmv_wide`` has no global-scale variant, so global-scale
cases are controlled by the same harness's plain cases and by the mutation
test in ``tests/test_emulate_fp.py``.

The kernels come from the pin's ``fp_quantized.h`` (hash-checked against
``pin.toml``) with the templates rendered onto it; the fp types come from the
same wheel's ``fp4.h`` and ``fp8.h``, compiled as they are under the shim.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from patchkit.carry import pin as pin_mod
from patchkit.carry import render
from patchkit.errors import BlobMismatchError, UserError
from patchkit.verify.dispatch import FP_MODES as MODES
from patchkit.verify.dispatch import uses_qmv_fast, vecs_per_tg
from patchkit.verify.emulate import build, extract, parity
from patchkit.verify.emulate.parity import DTYPES, Result
from patchkit.verify.emulate.suite import Report, Verdict

FP_QUANTIZED_H = "mlx/backend/metal/kernels/fp_quantized.h"
FP_TYPE_HEADERS = ("mlx/backend/metal/kernels/fp4.h", "mlx/backend/metal/kernels/fp8.h")

# mode -> (group size, bits), as fp_quantized.metal instantiates them.
# Kernel kinds as runner_fp.cpp numbers them.
KIND = {
    "fp_qmv_fast": 0,
    "fp_qmv": 1,
    "fp_qmv_wide": 2,
    "fp_qmv_fast_streamed": 3,
    "fp_qmv_streamed": 4,
}
WIDE = "fp_qmv_wide"
# fp_quantized.h's F8E4M3_MAX * F4E2M1_MAX, the nvfp4 global-scale encoding.
_GLOBAL_SCALE_DIVISOR = 448.0 * 6.0


@dataclass(frozen=True)
class FpCase:
    """One fp parity configuration; ``hgs`` the nvfp4 global scale, ``rps`` the fast tile."""

    mode: str
    K: int
    N: int
    dtype: str
    M: int
    B: int = 1
    hgs: bool = False
    rps: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"unknown fp mode '{self.mode}'; choose from {list(MODES)}")
        if (self.hgs or self.rps != 4) and self.mode != "nvfp4":
            raise UserError("the global scale and the r_2 tile exist for nvfp4 only")
        if self.rps not in (2, 4) or (self.rps == 2 and not self.fast):
            raise UserError("the r_2 tile is a qmv_fast variant: it needs an aligned shape")

    @property
    def group_size(self) -> int:
        return MODES[self.mode][0]

    @property
    def bits(self) -> int:
        return MODES[self.mode][1]

    @property
    def fast(self) -> bool:
        """Whether MLX runs ``fp_qmv_fast`` (not ``fp_qmv``) for this shape at M = 1."""
        return uses_qmv_fast(self.K, self.N, self.bits)

    @property
    def m1_kernel(self) -> str:
        return "fp_qmv_fast" if self.fast else "fp_qmv"

    @property
    def streamed_kernel(self) -> str:
        return "fp_qmv_fast_streamed" if self.fast else "fp_qmv_streamed"

    @property
    def V(self) -> int:
        return vecs_per_tg(self.M)

    def label(self) -> str:
        extra = (" hgs" if self.hgs else "") + (" r_2" if self.rps == 2 else "")
        return f"{self.mode} K={self.K} N={self.N} {self.dtype} M={self.M} B={self.B}{extra}"


# (K, N) per M = 1 path and branch, with the reason each shape is in the matrix.
# N is a few hundred where the path allows: fp rows carry no bias term to
# cancel against, so a float32 order difference shows in a float16 output only
# when it crosses a rounding boundary, and the control needs enough outputs
# per case to show it (measured at K = 1024, float16: fp_qmv_wide differed on
# 7% of cases at N = 64, 47% at N = 256, 80% at N = 512).
SHAPES: dict[str, tuple[int, int]] = {
    # N % 8 == 0 and K % alignment == 0 for both bits: fp_qmv_fast.
    "aligned": (1024, 512),
    # fp_qmv's out_vec_size < 8 branch (guarded rows, qdot in the K tail).
    "n_lt_8": (512, 5),
    # The same branch with a K tail only some lanes reach.
    "n_lt_8_k_tail": (544, 6),
    # fp_qmv's moved-back last tile (261 = 32 tiles of 8 + 5), qdot_safe tail.
    "n_not_mult_8": (512, 261),
    # K % alignment != 0: fp_qmv with a K tail only some lanes reach.
    "k_tail": (544, 256),
    # The K = 4096 class of real models, on fp_qmv_fast.
    "k4096": (4096, 128),
}
ALL_M = tuple(range(2, 17))
BATCHES = (1, 3)


def _variants(mode: str, K: int, N: int) -> list[tuple[bool, int]]:
    """(global scale, tile) variants MLX has for ``mode`` at this shape."""
    if mode != "nvfp4":
        return [(False, 4)]
    fast = uses_qmv_fast(K, N, 4)
    return [(False, 4), (True, 4)] + ([(False, 2), (True, 2)] if fast else [])


def full_matrix(modes: Iterable[str] = tuple(MODES)) -> list[FpCase]:
    """Every mode x shape x dtype x M = 2..16 x B in {1, 3} x (global scale, tile) variant.

    As in :func:`default_matrix`, float16 runs the shapes at full N and float32
    / bfloat16 at N <= 64 on the same paths (float32's control diverges at any
    N; bfloat16's stays quiet at any N this emulator can afford).
    """
    cases = []
    for mode, shape, dtype, M, B in itertools.product(
        modes, SHAPES.values(), DTYPES, ALL_M, BATCHES
    ):
        K, N = shape if dtype == "float16" else small_shape(*shape)
        cases += [FpCase(mode, K, N, dtype, M, B, h, r) for h, r in _variants(mode, K, N)]
    return cases


def small_shape(K: int, N: int) -> tuple[int, int]:
    """(K, N) at N <= 64 on the same M = 1 path and branch (37 keeps N % 8 != 0)."""
    return K, (N if N < 8 else (37 if N % 8 else 64))


def default_matrix(modes: Iterable[str] = tuple(MODES)) -> list[FpCase]:
    """A subset that runs in seconds: every mode, shape, dtype and tile size V = 2..5.

    On the two fp_qmv branches with a full tile (aligned, n_not_mult_8) M = 2 (as
    a batch of 3), 3, 4, 5 and 7 cover every tile size and a partial last tile;
    the other shapes take M = 2 (B = 3) and 7. The nvfp4 global-scale and r_2
    variants run on float16 and bfloat16 at M = 5. Only float16 runs the shapes
    at full N (what its control needs, see SHAPES); float32 and bfloat16 run
    them at N <= 64 on the same paths.
    """
    cases = []
    for mode, (name, shape), dtype in itertools.product(modes, SHAPES.items(), DTYPES):
        K, N = shape if dtype == "float16" else small_shape(*shape)
        Ms = (2, 3, 4, 5, 7) if name in ("aligned", "n_not_mult_8") else (2, 7)
        for M in Ms:
            cases.append(FpCase(mode, K, N, dtype, M, 3 if M == 2 else 1))
        if dtype != "float32":
            for hgs, rps in _variants(mode, K, N)[1:]:
                cases.append(FpCase(mode, K, N, dtype, 5, 1, hgs, rps))
    return cases


def make_inputs(case: FpCase) -> tuple[np.ndarray, ...]:
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
    w = rng.integers(0, 2**32, size=(B, N, K * case.bits // 32), dtype=np.uint32)
    groups = K // case.group_size
    if case.group_size == 16:
        # e4m3: exponent field 5..8 (bias 7), any mantissa.
        scales = rng.integers(0x28, 0x48, size=(B, N, groups), dtype=np.uint8)
    elif case.bits == 4:
        scales = rng.integers(127 - 8, 127 - 4, size=(B, N, groups), dtype=np.uint8)
    else:
        scales = rng.integers(127 - 12, 127 - 8, size=(B, N, groups), dtype=np.uint8)
    # A global scale as nvfp4 checkpoints store it (amax-derived, of order 448 * 6).
    g = np.array([rng.uniform(0.05, 2.0) * _GLOBAL_SCALE_DIVISOR], dtype=np.float32)
    x = rng.standard_normal(size=(B, M, K)) * 2.0 ** rng.uniform(-8, 4, size=(B, M, K))
    return w, scales, g, parity._storage(x, case.dtype)


def run_m1(lib: build.FpLibrary, case: FpCase, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """Each vector alone through the M = 1 kernel MLX would choose: y of shape (B, M, N)."""
    w, s, g, x = inputs
    y = parity._empty_out(case, case.M, case.B, x)  # type: ignore[arg-type]
    for bi in range(case.B):
        for i in range(case.M):
            one = np.ascontiguousarray(y[bi, i : i + 1][None])
            bufs = (w[bi], s[bi], g, np.ascontiguousarray(x[bi, i : i + 1]), one)
            lib.run(
                case.dtype,
                case.group_size,
                case.bits,
                KIND[case.m1_kernel],
                1,
                case.hgs,
                case.rps,
                (1, 1, case.N, case.K),
                bufs,
            )
            y[bi, i] = one[0, 0]
    return y


def run_batched(
    lib: build.FpLibrary, case: FpCase, inputs: tuple[np.ndarray, ...], kernel: str
) -> np.ndarray:
    """All M vectors (and B batches) in one launch of ``kernel``: y of shape (B, M, N)."""
    w, s, g, x = inputs
    y = parity._empty_out(case, case.M, case.B, x)  # type: ignore[arg-type]
    lib.run(
        case.dtype,
        case.group_size,
        case.bits,
        KIND[kernel],
        case.V,
        case.hgs,
        case.rps,
        (case.B, case.M, case.N, case.K),
        (w, s, g, x, y),
    )
    return y


def build_libraries(
    header: str,
    types: tuple[str, str],
    cases: list[FpCase],
    toolchain: build.Toolchain,
    kernels: tuple[str, ...],
) -> dict[str, build.FpLibrary]:
    """One library per mode, built in parallel and cached."""
    source = extract.extract_fp(header, *types, kernels)
    # One library per mode holding all three dtypes: a build costs mostly fixed
    # overhead (shim, fibers), so this is barely slower than one dtype, and
    # every run of a mode (matrix, one case, tests) then hits the same cache.
    groups = {
        mode: [(dtype, *MODES[mode]) for dtype in DTYPES]
        for mode in sorted({c.mode for c in cases})
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        paths = dict(
            zip(
                groups,
                pool.map(
                    lambda g: build.build(source, g, toolchain, runner="runner_fp.cpp"),
                    groups.values(),
                ),
                strict=True,
            )
        )
    return {key: build.FpLibrary(path) for key, path in paths.items()}


def run_case(lib: build.FpLibrary, case: FpCase, controls: bool) -> list[Result]:
    """Streamed (and, without a global scale or narrow tile, fp_qmv_wide) against M = 1."""
    inputs = make_inputs(case)
    reference = run_m1(lib, case, inputs)
    kernels = [case.streamed_kernel]
    if controls and not case.hgs and case.rps == 4:
        kernels.append(WIDE)
    return [
        parity.compare(case, k, reference, run_batched(lib, case, inputs, k))  # type: ignore[arg-type]
        for k in kernels
    ]


class FpReport(Report):
    """:class:`Report` for fp cases: the control is ``fp_qmv_wide``."""

    def streamed(self) -> list[Result]:
        return [r for r in self.results if r.kernel != WIDE]

    def wide(self) -> list[Result]:
        return [r for r in self.results if r.kernel == WIDE]


def run(
    header: str,
    types: tuple[str, str],
    cases: list[FpCase],
    toolchain: build.Toolchain,
    *,
    controls: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> FpReport:
    """Build the fp kernels from ``header`` and run ``cases``, in parallel on all cores."""
    kernels = extract.FP_UPSTREAM_KERNELS + extract.FP_STREAMED_KERNELS
    libs = build_libraries(header, types, cases, toolchain, kernels)
    report = FpReport(toolchain.name)

    def one(case: FpCase) -> list[Result]:
        return run_case(libs[case.mode], case, controls)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for i, results in enumerate(pool.map(one, cases), 1):
            report.results += results
            if progress:
                progress(i, len(cases))
    return report


def pinned_fp_headers(root: Path, header: Path | None = None) -> tuple[str, tuple[str, str]]:
    """The pin's ``fp_quantized.h`` (hash-checked) and its ``fp4.h`` / ``fp8.h`` texts.

    ``header`` names an ``fp_quantized.h`` whose directory also holds fp4.h and
    fp8.h; by default all three come from the release-twin wheel, or the cached
    clone at the pin when there is none (:func:`emulate.pinned_file`). The blob
    must equal pin.toml's: a different header would prove something about
    another tree.
    """
    from patchkit.verify.emulate import blob_sha, pinned_file

    pin = pin_mod.load(root / "pin.toml")
    expected = pin.blobs.get(FP_QUANTIZED_H)
    if header is None:
        data, source = pinned_file(pin, FP_QUANTIZED_H)
    else:
        data, source = header.read_bytes(), str(header)
    actual = blob_sha(data)
    if actual != expected:
        raise BlobMismatchError(
            f"{FP_QUANTIZED_H} from {source} is blob {actual}, pin.toml records {expected}; "
            "use the pinned release's header or re-pin with `patchkit rebase`"
        )
    if header is None:
        types = tuple(pinned_file(pin, p)[0].decode() for p in FP_TYPE_HEADERS)
    else:
        types = tuple((header.parent / Path(p).name).read_text() for p in FP_TYPE_HEADERS)
    return data.decode(), (types[0], types[1])


def patched_fp_header(upstream_text: str, options: render.RenderOptions | None = None) -> str:
    """``upstream_text`` with the fp streamed kernels rendered in, exactly as `apply` would."""
    options = options or render.RenderOptions(backends=("metal",))
    plan = next(p for p in render.selected_plans(options) if p.path == FP_QUANTIZED_H)
    return render.render_file(plan, upstream_text, options)


# The control's bar. float32 outputs show every float32 order difference, so
# fp_qmv_wide must differ on nearly all of them (measured: 100%); narrower
# outputs hide most differences below their rounding (see SHAPES), so there the
# control is reported, not gated.
MIN_FP_F32_DIVERGENCE = 0.9


def summarize(report: FpReport) -> dict[str, object]:
    """Counts for JSON and docs, and the verdict: every streamed row equal, control loud.

    ok needs every streamed case identical and fp_qmv_wide differing on at
    least MIN_FP_F32_DIVERGENCE of the float32 control cases.
    """
    streamed = report.streamed()
    f32 = report.control_divergence(("float32",))
    return {
        "ok": report.streamed_identical and bool(report.wide()) and f32 >= MIN_FP_F32_DIVERGENCE,
        "streamed_cases": len(streamed),
        "streamed_differing": sum(not r.identical for r in streamed),
        "rows_checked": sum(r.rows for r in streamed),
        "rows_differing": sum(r.rows_differing for r in streamed),
        "control_cases": len(report.wide()),
        "wide_divergence_f32": f32,
        "wide_divergence_f16": report.control_divergence(("float16",)),
        "wide_divergence_bf16": report.control_divergence(("bfloat16",)),
        "failures": report.failures(),
    }


def verify_fp_header(
    patched_header: str,
    types: tuple[str, str],
    *,
    quick: bool = True,
    toolchains: Iterable[str] = ("gcc", "clang"),
) -> Verdict:
    """The fp suite on a patched ``fp_quantized.h`` text, shaped like :func:`verify_header`.

    For ``patchkit rebase`` to gate on the fp kernels as it gates on the affine
    ones; ``types`` are the target tree's fp4.h and fp8.h texts.
    """
    cases = default_matrix() if quick else full_matrix()
    failures: list[str] = []
    lines = []
    for name in toolchains:
        summary = summarize(run(patched_header, types, cases, build.TOOLCHAINS[name]))
        failures += [f"[{name}] {f}" for f in summary["failures"]]  # type: ignore[attr-defined]
        if not summary["ok"] and not summary["failures"]:
            failures.append(
                f"[{name}] negative control too quiet: fp_qmv_wide differed on only "
                f"{summary['wide_divergence_f32']:.0%} of float32 cases"
            )
        lines.append(
            f"{name}: {summary['streamed_cases']} fp streamed cases, "
            f"{summary['streamed_differing']} differing; fp_qmv_wide differs on "
            f"{summary['wide_divergence_f32']:.0%} of float32 cases"
        )
    return Verdict(ok=not failures, summary="; ".join(lines), failures=failures)
