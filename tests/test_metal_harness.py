"""The Metal JIT source `patchkit bench` hands to metal_kernel is the text the emulator proves.

No Apple GPU here: the proof is that the identical string compiles under the
CPU Metal shim and its rows at vecs_per_tg > 1 equal upstream's M = 1 bit for bit,
with qmv_wide as the negative control showing the comparison can fail.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from patchkit.carry import cxx
from patchkit.verify import emulate
from patchkit.verify.emulate import build, extract, suite
from patchkit.verify.emulate import parity as emu
from patchkit.verify.emulate.families import AFFINE
from patchkit.verify.harness import metal

ROOT = Path(__file__).resolve().parents[1]
# One (dtype, bits) so one library serves both; one case per M = 1 path.
CASES = [
    emu.Case.affine(1024, 64, 4, 64, "float16", 5),  # qmv_fast at V = 5
    emu.Case.affine(640, 37, 4, 64, "float16", 7),  # qmv (tail, moved-back tile), V = 5 partial
]


@pytest.fixture(scope="module")
def patched() -> emulate.Sources:
    # Like the emulator tests: the pinned wheel is needed (PyPI, cached after once),
    # and a blob mismatch must fail, not skip.
    return emulate.sources(emulate.pinned_header(ROOT), AFFINE)


@pytest.fixture(scope="module")
def src() -> metal.MetalSource:
    # What `patchkit bench` hands to metal_kernel.
    return metal.metal_source(ROOT)


def test_preamble_declares_what_the_extracted_text_uses(src: metal.MetalSource) -> None:
    """The extracted functions use MLX_MTL_CONST and simd_* but declare neither."""
    lines = src.preamble.splitlines()
    body = src.extracted.source
    assert "MLX_MTL_CONST" in body and "#define MLX_MTL_CONST" not in body
    assert "#define MLX_MTL_CONST static constant constexpr const" in lines
    assert "simd_sum" in body and "#include" not in body and "using namespace" not in body
    assert {"#include <metal_simdgroup>", "#include <metal_stdlib>", "using namespace metal;"} <= (
        set(lines)
    )
    assert src.header.startswith(src.preamble) and src.header.endswith(body)


def test_preamble_follows_the_header_text(patched: emulate.Sources) -> None:
    """A pin bump that changes the define or drops a line changes the preamble with it."""
    changed = patched.upstream.replace(
        "#define MLX_MTL_CONST static constant constexpr const",
        "#define MLX_MTL_CONST constant constexpr",
    ).replace("#include <metal_simdgroup>\n", "")
    lines = metal.preamble(changed).splitlines()
    assert "#define MLX_MTL_CONST constant constexpr" in lines
    assert "#include <metal_simdgroup>" not in lines
    assert "#define MLX_MTL_CONST static constant constexpr const" not in lines


def test_impl_texts_equal_what_the_emulator_suite_compiles(
    src: metal.MetalSource, patched: emulate.Sources
) -> None:
    # The harness's kernels are the suite's, qmv_wide aside: the same extraction.
    assert src.extracted.source == extract.extract(patched, metal.KERNELS).source
    suite_source = extract.extract(patched, tuple(AFFINE.kernels)).source
    patched_ns = suite_source[suite_source.index("namespace patched {") :]
    assert patched_ns in src.header


@pytest.mark.parametrize("fast", [True, False])
def test_body_calls_an_impl_of_the_header_with_metal_kernel_names(
    src: metal.MetalSource, fast: bool
) -> None:
    body = metal.kernel_body(fast)
    impl = re.match(r"\s*patched::(\w+)<", body).group(1)
    patched_ns = src.header[src.header.index("namespace patched {") :]
    cxx.find_function(patched_ns, impl, None)  # raises if the patched text lacks it
    for name in (*metal.INPUT_NAMES, *metal.OUTPUT_NAMES):
        assert re.search(rf"\b{name}\b", body), name
    # metal_kernel adds these attributes to the signature only if the source names them
    for attr in ("threadgroup_position_in_grid", "simdgroup_index_in_threadgroup"):
        assert attr in body


def test_grid_matches_mlx_qmv_dispatch() -> None:
    # threads: ceil(M / V) tiles x 32 lanes, ceil(N / 8) threadgroups x 2 simdgroups
    assert metal.grid(7, 37, 4) == (64, 10, 1)
    assert metal.grid(5, 15360, 5) == (32, 3840, 1)
    assert metal.is_fast(4096, 15360, 4) and not metal.is_fast(640, 37, 4)
    # gemma's K = 3840 is not a multiple of 4-bit's 512-value step: qmv, not qmv_fast
    assert not metal.is_fast(3840, 15360, 4)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed (apt-get install g++)")
def test_the_metal_header_text_is_exact_under_the_emulator(
    src: metal.MetalSource, patched: emulate.Sources
) -> None:
    lib = build.Library(build.build(src.extracted, [("float16", 64, 4)], build.TOOLCHAINS["gcc"]))
    for case in CASES:
        inputs = emu.make_inputs(case)
        ref = emu.run_m1(lib, case, inputs)
        got = emu.run_batched(lib, case, inputs, case.streamed_kernel)
        assert emu.compare(case, case.streamed_kernel, ref, got).identical, case.label()
    # The suite on the patched header: the same function texts, plus the control.
    report = suite.run(patched, CASES, build.TOOLCHAINS["gcc"])
    assert report.streamed_identical
    assert any(not r.identical for r in report.wide()), "qmv_wide control never diverged"


def test_bench_without_an_apple_gpu_says_so_in_one_line_and_fails() -> None:
    from click.testing import CliRunner

    from patchkit.cli import main

    mx = pytest.importorskip("mlx.core", reason="mlx not importable: pip install -e '.[mlx]'")
    if mx.metal.is_available():
        pytest.skip("this machine has an Apple GPU: bench would run")
    r = CliRunner().invoke(main, ["bench", "--quick", "--out", "unused.json"])
    assert r.exit_code == 1
    message = " ".join(r.stderr.split())
    assert "needs an Apple GPU" in message and "bench/cuda_qmv.py" in message
    assert not Path("unused.json").exists()


def test_recovered_fraction() -> None:
    from patchkit.verify.bench import recovered_fraction

    # streamed halfway between per-vector qmv and batched: half the gap recovered
    assert recovered_fraction(10.0, 7.5, 5.0) == 0.5
    # generation 13/14: batched *is* per-vector qmv, so there is no gap to recover
    assert recovered_fraction(10.0, 6.0, 10.0) is None
