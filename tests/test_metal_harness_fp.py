"""The fp Metal JIT source `patchkit bench --mode ...` hands to metal_kernel is the
text the fp emulator proves exact (no Apple GPU here: the same string runs under
the CPU shim, with fp_qmv_wide as the control that must diverge).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from patchkit.carry import cxx
from patchkit.verify import emulate
from patchkit.verify.emulate import build, extract
from patchkit.verify.emulate import parity as emu
from patchkit.verify.emulate.families import FP
from patchkit.verify.harness import metal

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pinned() -> tuple[emulate.Sources, tuple[str, str]]:
    # The pinned wheel is needed (PyPI, cached after once); a blob mismatch must fail.
    upstream, types = emulate.pinned_fp_headers(ROOT)
    return emulate.sources(upstream, FP), types


@pytest.fixture(scope="module")
def src() -> metal.MetalSource:
    return metal.metal_source(ROOT, mode="mxfp4")


def test_fp_texts_equal_what_the_fp_emulator_compiles(
    src: metal.MetalSource, pinned: tuple[emulate.Sources, tuple[str, str]]
) -> None:
    patched, types = pinned
    assert src.extracted.source == extract.extract(patched, metal.FP_KERNELS, FP, types).source
    emulated = extract.extract(patched, tuple(FP.kernels), FP, types).source
    assert emulated[emulated.index("namespace patched {") :] in src.header


@pytest.mark.parametrize("fast", [True, False])
def test_fp_body_calls_an_impl_of_the_header(src: metal.MetalSource, fast: bool) -> None:
    body = metal.kernel_body(fast, "mxfp4")
    impl = re.match(r"\s*patched::(\w+)<", body).group(1)
    assert impl.startswith("fp_qmv")
    patched_ns = src.header[src.header.index("namespace patched {") :]
    cxx.find_function(patched_ns, impl, None)  # raises if the patched text lacks it
    for name in (*metal.FP_INPUT_NAMES, *metal.OUTPUT_NAMES):
        assert re.search(rf"\b{name}\b", body), name
    assert "biases" not in body


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed (apt-get install g++)")
def test_the_fp_metal_header_text_is_exact_under_the_emulator(
    src: metal.MetalSource, pinned: tuple[emulate.Sources, tuple[str, str]]
) -> None:
    def library(extracted: extract.Extracted) -> build.Library:
        return build.Library(build.build(extracted, [("float32", 32, 4)], build.TOOLCHAINS["gcc"]))

    # The harness text itself (streamed kernels and the M = 1 reference) ...
    harness_lib = library(src.extracted)
    # ... and the emulator's full extraction, for the fp_qmv_wide control.
    patched, types = pinned
    control_lib = library(extract.extract(patched, tuple(FP.kernels), FP, types))
    cases = [emu.Case("mxfp4", 1024, 64, "float32", 5), emu.Case("mxfp4", 640, 37, "float32", 7)]
    for case in cases:
        inputs = emu.make_inputs(case)
        ref = emu.run_m1(harness_lib, case, inputs)
        streamed = emu.run_batched(harness_lib, case, inputs, case.streamed_kernel)
        assert emu.compare(case, case.streamed_kernel, ref, streamed).identical
        wide = emu.run_batched(control_lib, case, inputs, FP.wide)
        assert not emu.compare(case, FP.wide, ref, wide).identical, "control never diverged"
