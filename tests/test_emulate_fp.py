"""The patched fp kernels (mxfp4, nvfp4, mxfp8) at vecs_per_tg > 1 are bit-identical to
upstream's M = 1 kernels on the CPU, and the harness sees a difference when there is one.

These run the real kernel source: upstream's functions from the pinned wheel's
fp_quantized.h (hash-checked), the fp types from the same wheel's fp4.h and
fp8.h, and the header with the patch rendered in by the templates.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from support_emulate import assert_streamed_equal_m1, mutate

from patchkit.errors import BlobMismatchError, UserError
from patchkit.verify import dispatch, emulate
from patchkit.verify.dispatch import STREAMED_VECS
from patchkit.verify.emulate import build, extract, parity, suite
from patchkit.verify.emulate.families import DTYPES, FP, FP_MODES

ROOT = Path(__file__).resolve().parent.parent
KERNELS = FP.upstream_kernels + FP.streamed_kernels


@pytest.fixture(scope="module")
def headers() -> tuple[str, tuple[str, str]]:
    return emulate.pinned_fp_headers(ROOT)


@pytest.fixture(scope="module")
def patched(headers: tuple[str, tuple[str, str]]) -> emulate.Sources:
    """The pin's fp_quantized.h, upstream (the M = 1 reference) and patched."""
    return emulate.sources(headers[0], FP)


R = "result[v * results_per_simdgroup + row]"
# The guarded kernel's row sums, held in registers across the vectors' calls.
ACC = "acc[v]"
X = "x_thread + v * values_per_thread"
# The patched kernels' main-loop accumulation, by the sum it adds into and how many
# times: qmv_fast_impl's into the result array; qmv_impl's two main loops and its guarded
# branch's tail (qdot there, as upstream has it) into the row's registers.
ACCUMULATIONS = ((R, 1), (ACC, 3))


def accumulate(into: str) -> str:
    return f"{into} += qdot<U, values_per_thread, bits>(wl, {X}, s);"


def mutate_accumulations(src: emulate.Sources, make: Callable[[str], str]) -> emulate.Sources:
    """``src`` with every main-loop accumulation replaced by ``make(sum it adds into)``."""
    for into, count in ACCUMULATIONS:
        src = mutate(src, accumulate(into), make(into), count)
    return src


@pytest.fixture(scope="module")
def types(headers: tuple[str, tuple[str, str]]) -> tuple[str, str]:
    return headers[1]


@pytest.fixture(scope="module", params=["gcc", "clang"])
def toolchain(request: pytest.FixtureRequest) -> build.Toolchain:
    tc = build.TOOLCHAINS[request.param]
    build.require_compiler(tc)
    return tc


def _cases_for(toolchain: build.Toolchain) -> list[parity.Case]:
    # clang builds at -O0 and runs several times slower. Its default share is
    # what contraction could break: every float32 case (where the control is
    # loudest) and the nvfp4 global-scale and r_2 variants, at N <= 64;
    # `patchkit emulate --mode fp --full` runs everything with both.
    cases = suite.default_matrix(FP_MODES)
    if toolchain.name == "clang":
        picked = [c for c in cases if c.dtype == "float32" or (c.hgs or c.rps == 2)]
        small = [dataclasses.replace(c, N=suite.small_shape(c.K, c.N)[1]) for c in picked]
        cases = [c for c in small if c.dtype != "bfloat16"]
    return cases


@pytest.fixture(scope="module")
def report(
    patched: emulate.Sources, types: tuple[str, str], toolchain: build.Toolchain
) -> suite.Report:
    return suite.run(patched, _cases_for(toolchain), toolchain, types=types)


def test_streamed_rows_equal_m1_bitwise(report: suite.Report) -> None:
    assert_streamed_equal_m1(report)  # as for affine: rows and simd_sum inputs


def test_simd_sum_inputs_catch_what_one_tree_hides(
    patched: emulate.Sources, types: tuple[str, str]
) -> None:
    # Mutation as for affine: lanes l and l ^ 16 swap their partial sums before
    # simd_sum, which the shim's butterfly cannot see in the outputs (it adds
    # those pairs first) and the input comparison must see on every output,
    # with and without nvfp4's global scale, on both M = 1 paths.
    store = f"{R} = simd_sum({R});"
    new = f"{R} = simd_sum(simd_shuffle_xor({R}, 16));"
    mutated = mutate(patched, store, new, 3)
    cases = [
        parity.Case("nvfp4", 1024, 64, "float32", 5, 1, True),
        parity.Case("mxfp4", 544, 37, "float16", 7, 2),
        parity.Case("mxfp8", 544, 6, "float32", 3),
    ]
    mutant = suite.run(mutated, cases, build.TOOLCHAINS["gcc"], types=types, controls=False)
    for r in mutant.streamed():
        assert r.rows_differing == 0, r.case.label()
        assert r.sum_inputs_differing == r.sum_inputs > 0, r.case.label()


def test_matrix_reaches_every_path_tile_and_variant(report: suite.Report) -> None:
    ran = {(r.case.mode, r.m1_kernel, r.V) for r in report.streamed()}
    for mode, m1, V in itertools.product(
        FP_MODES,  # every fp mode
        ("fp_qmv_fast", "fp_qmv"),  # both M = 1 kernels
        STREAMED_VECS,  # every instantiated tile size
    ):
        assert (mode, m1, V) in ran, (mode, m1, V)
    cases = [r.case for r in report.streamed()]
    for mode in FP_MODES:
        assert any(c.mode == mode and c.B > 1 and not c.fast for c in cases)
        assert any(c.mode == mode and c.B > 1 and c.fast for c in cases)
        # fp_qmv's guarded (N < 8) branch and its moved-back branch, each with a K tail.
        assert any(c.mode == mode and c.N < 8 and c.K % 256 for c in cases)
        assert any(c.mode == mode and c.N >= 8 and not c.fast and c.K % 256 for c in cases)
    assert any(c.hgs and c.fast for c in cases) and any(c.hgs and not c.fast for c in cases)
    assert any(c.rps == 2 and c.hgs for c in cases) and any(c.rps == 2 and not c.hgs for c in cases)


def test_negative_control_fp_qmv_wide_diverges(report: suite.Report) -> None:
    # Measured on the default matrix: 100% of float32 cases differ with both
    # toolchains, about half of float16 (the rounding of fp rows hides most
    # last-ulp float32 differences; see suite.FP_SHAPES).
    assert report.control_divergence(("float32",)) >= FP.min_control
    if report.toolchain == "gcc":
        assert report.control_divergence(("float16",)) > 0.25
    assert suite.summarize(report)["ok"] is True


def _mutant_run(
    patched: emulate.Sources,
    types: tuple[str, str],
    mutated: emulate.Sources,
    cases: list[parity.Case],
) -> suite.Report:
    # clang -O0: a mutant is built once and runs a few small cases, so the
    # faster build wins.
    assert mutated != patched
    return suite.run(mutated, cases, build.TOOLCHAINS["clang"], types=types, controls=False)


def test_harness_catches_a_reordered_streamed_kernel(
    patched: emulate.Sources, types: tuple[str, str]
) -> None:
    # Mutation: the streamed kernels add each block's qdot to the row's sum in
    # two exact halves, the same value in exact arithmetic, rounded twice.
    # (Moving the scale out of qdot would not do: e8m0 scales are powers of
    # two, so that changes no bits.) A harness that cannot see this could not
    # prove identity.
    mutated = mutate_accumulations(
        patched,
        lambda into: (
            f"{{ U q = qdot<U, values_per_thread, bits>(wl, {X}, s);"
            f" {into} += q * 0.5f; {into} += q * 0.5f; }}"
        ),
    )
    cases = [
        parity.Case(mode, K, N, "float32", M)
        for mode in ("mxfp4", "mxfp8")
        for K, N, M in ((1024, 64, 5), (544, 37, 7))
    ]
    mutant = _mutant_run(patched, types, mutated, cases)
    assert len(mutant.failures()) == len(cases)


def test_harness_checks_the_global_scale_store(
    patched: emulate.Sources, types: tuple[str, str]
) -> None:
    # Mutation: the streamed kernels forget the nvfp4 global scale at the store.
    # Only the _hgs cases can see it, so this shows they really run with it.
    store = f"static_cast<T>({R} * inv_scale_enc)"
    mutated = mutate(patched, store, f"static_cast<T>({R})", 3)
    cases = [
        parity.Case("nvfp4", 1024, 64, "float16", 5, hgs=True),
        parity.Case("nvfp4", 544, 37, "float16", 3, hgs=True),
        parity.Case("nvfp4", 1024, 64, "float16", 5),
    ]
    mutant = _mutant_run(patched, types, mutated, cases)
    assert [r.identical for r in mutant.streamed()] == [False, False, True]


def test_fp_types_decode_as_the_ocp_mx_spec(
    patched: emulate.Sources, types: tuple[str, str]
) -> None:
    # fp4.h and fp8.h are compiled from the wheel as they are; their decode
    # must match values derived here from the OCP MX spec (v1.0, section 5.3):
    # E2M1 bias 1, E4M3 bias 7 with subnormals, E8M0 = 2^(e - 127).
    # The mxfp4 library the matrix builds (a cache hit after the report).
    cases = suite.default_matrix(("mxfp4",))
    libs = suite.build_libraries(patched, cases, build.TOOLCHAINS["gcc"], KERNELS, types)
    lib = suite.library_for(libs, cases[0])

    def e2m1(b: int) -> float:
        e, m = (b >> 1) & 3, b & 1
        mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        return -mag if b & 8 else mag

    def e4m3(b: int) -> float:
        e, m = (b >> 3) & 15, b & 7
        mag = m / 8 * 2.0**-6 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
        return -mag if b & 0x80 else mag

    assert [lib.decode(0, b) for b in range(16)] == [e2m1(b) for b in range(16)]
    for b in range(256):
        if b & 0x7F == 0x7F:
            # The spec's NaN code; MLX's decode (a bit shift into half) gives
            # +-480, which the kernels then use like any weight.
            assert lib.decode(1, b) == (-480.0 if b & 0x80 else 480.0)
        else:
            assert lib.decode(1, b) == e4m3(b), hex(b)
    for b in range(255):
        # MLX decodes exponent 0 as 2^-127 (a float subnormal), as the spec says.
        assert lib.decode(2, b) == math.ldexp(1.0, b - 127), b
    # The spec's NaN code 0xFF; MLX's decode gives +inf.
    assert lib.decode(2, 255) == math.inf


def test_pinned_fp_header_refuses_a_different_blob(tmp_path: Path, headers) -> None:
    other = tmp_path / "fp_quantized.h"
    other.write_text(headers[0] + "\n// changed\n")
    with pytest.raises(BlobMismatchError, match=r"pin\.toml records 8c963030"):
        emulate.pinned_fp_headers(ROOT, other)


def test_cli_fp_one_case_json() -> None:
    cmd = ["patchkit", "emulate", "--mode", "nvfp4", "--kernel", "streamed", "-K", "544"]
    cmd += ["-N", "6", "-M", "7", "-B", "2", "--global-scale", "--toolchain", "gcc", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["mode"] == "nvfp4" and data["hgs"] is True
    assert data["rows"] == 14 and data["rows_differing"] == 0 and data["identical"] is True


def test_cli_fp_rejects_a_wide_global_scale_case() -> None:
    cmd = ["patchkit", "emulate", "--mode", "nvfp4", "--kernel", "wide", "-K", "512", "-N", "8"]
    proc = subprocess.run([*cmd, "--global-scale"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert "fp_qmv_wide has no global-scale" in proc.stderr and "Traceback" not in proc.stderr


def test_two_dim_batches_equal_m1(patched: emulate.Sources, types: tuple[str, str]) -> None:
    # As the affine test: 2-D batches, weights own or shared along each
    # dimension, every fp mode (nvfp4 with and without its global scale).
    cases = [c for c in suite.multi_batch_cases(FP_MODES) if c.dtype == "float32" and c.M == 7]
    report = suite.run(patched, cases, build.TOOLCHAINS["gcc"], types=types)
    assert report.failures() == []
    assert len(report.streamed()) == len(cases) and report.control_divergence() >= FP.min_control


@pytest.mark.wide
def test_two_dim_batches_every_build(
    patched: emulate.Sources, types: tuple[str, str], toolchain: build.Toolchain
) -> None:
    cases = suite.multi_batch_cases(FP_MODES)
    for name in (toolchain.name, toolchain.name + "-fast"):
        report = suite.run(patched, cases, build.TOOLCHAINS[name], types=types)
        assert report.failures() == [], name
        assert suite.summarize(report)["ok"] is True, name


@pytest.mark.wide
def test_full_fp_matrix(
    patched: emulate.Sources, types: tuple[str, str], toolchain: build.Toolchain
) -> None:
    full = suite.run(patched, suite.full_matrix(FP_MODES), toolchain, types=types)
    assert full.failures() == []
    assert suite.summarize(full)["ok"] is True


# nvfp4's e4m3 scales are not powers of two, so fusing qdot's `scale * accum`
# into the caller's `result +=` changes bits: the cases where cross-statement
# contraction could break identity. mxfp4 (e8m0 scales) as a second mode.
FUSION_CASES = [
    parity.Case(mode, K, N, "float32", M, B, hgs)
    for mode, (K, N), M, B, hgs in (
        ("nvfp4", (1024, 64), 5, 1, False),  # fp_qmv_fast
        ("nvfp4", (1024, 64), 3, 2, True),
        ("nvfp4", (544, 6), 7, 1, False),  # fp_qmv, guarded rows, qdot tail
        ("nvfp4", (544, 37), 4, 1, True),  # fp_qmv, moved-back tile, qdot_safe tail
        ("nvfp4", (512, 5), 9, 2, False),
        ("mxfp4", (1024, 64), 7, 1, False),
        ("mxfp4", (544, 37), 5, 1, False),
    )
]


@pytest.mark.parametrize("name", ["gcc-fast", "clang-fast"])
def test_cross_statement_contraction_keeps_identity(
    patched: emulate.Sources, types: tuple[str, str], name: str
) -> None:
    # -O2 -ffp-contract=fast: fusion across statements once qdot is inlined.
    # The full default matrix under these builds runs in `patchkit emulate`.
    tc = build.TOOLCHAINS[name]
    build.require_compiler(tc)
    report = suite.run(patched, FUSION_CASES, tc, types=types, controls=False)
    assert len(report.streamed()) == len(FUSION_CASES)
    assert report.failures() == []


def test_contraction_builds_see_a_fusion_mismatch(
    patched: emulate.Sources, types: tuple[str, str]
) -> None:
    # Mutation: the streamed main loops add qdot's result through a volatile,
    # so `scale * accum` can no longer fuse into `result +=` there while M = 1
    # still fuses it. Without contraction the mutant is exact (the g++ build
    # proves it); the cross-statement build must see nvfp4 float32 rows differ,
    # or it would prove nothing about fusion.
    mutated = mutate_accumulations(
        patched,
        lambda into: (
            f"{{ volatile U q = qdot<U, values_per_thread, bits>(wl, {X}, s); {into} += q; }}"
        ),
    )
    cases = [c for c in FUSION_CASES if c.mode == "nvfp4"]
    plain = suite.run(mutated, cases, build.TOOLCHAINS["gcc"], types=types, controls=False)
    assert plain.failures() == []
    for name in ("gcc-fast", "clang-fast"):
        fused = suite.run(mutated, cases, build.TOOLCHAINS[name], types=types, controls=False)
        assert fused.failures(), f"{name} did not see unfused streamed rows"


def test_address_space_check_passes_the_fp_kernels(
    patched: emulate.Sources, types: tuple[str, str]
) -> None:
    # As for affine, with fp4.h/fp8.h compiled whole: their half returned by
    # value, fp_qmv_wide's in-place vec reads, nvfp4's global-scale and r_2
    # variants; every mode and dtype.
    build.require_compiler(build.TOOLCHAINS["clang"])
    src = extract.extract(patched, KERNELS, FP, types)
    combos = [(d, gs, bits) for d in DTYPES for gs, bits in dispatch.FP_MODES.values()]
    build.check_address_spaces(src, combos)


@pytest.mark.parametrize(
    "call, bad",
    [
        # The patched fast kernel hands qdot a thread pointer (x_thread) where it
        # takes the device pointer to the packed weights.
        (
            "qdot<U, values_per_thread, bits>(wl, x_thread + v * values_per_thread, s)",
            "qdot<U, values_per_thread, bits>((thread uint8_t*)x_thread, x_thread, s)",
        ),
        # The patched general kernel's tail reads x through a thread pointer.
        (
            "x + (vecs_per_tg == 1 ? 0 : min(v, n_vecs - 1)) * in_vec_size,"
            " x_thread + v * values_per_thread, tail)",
            "(thread T*)x_thread, x_thread, tail)",
        ),
    ],
)
def test_address_space_check_refuses_a_thread_pointer_as_device(
    patched: emulate.Sources, types: tuple[str, str], call: str, bad: str
) -> None:
    # The shim without address spaces compiles and runs these; the check must
    # refuse them as Metal's compiler would, naming the mutated line.
    build.require_compiler(build.TOOLCHAINS["clang"])
    mutated = mutate(patched, call, bad, 4 if "qdot" in call else 2)  # every such call
    src = extract.extract(mutated, KERNELS, FP, types)
    with pytest.raises(UserError, match=r"address-space check failed") as err:
        build.check_address_spaces(src, [("float16", 16, 4), ("float32", 32, 8)])
    # The error quotes the statement's first line: the call the mutated argument is in.
    named = "qdot" if "qdot" in call else "load_vector_safe"
    assert f"no matching function for call to '{named}'" in str(err.value)
