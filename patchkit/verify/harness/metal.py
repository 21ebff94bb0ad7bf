"""Metal harness: the streamed qmv through ``mx.fast.metal_kernel`` on a stock MLX wheel.

The kernel text is never written here. :func:`metal_source` takes the pin's real
``quantized.h``, renders the patch into it (``patchkit.verify.emulate.patched_header``)
and extracts the functions the streamed kernels need with the emulator's own
extractor, so the ``header`` handed to Metal holds byte for byte the text the
CPU emulator compiles and proves exact (``tests/test_metal_harness.py``). The
only code of our own is the kernel body: one call of the streamed impl with
``metal_kernel``'s input names, dispatched exactly as MLX dispatches it.

Building sources needs neither MLX nor a GPU; :func:`make_kernel` and
:func:`run_streamed` import nothing themselves but need a Metal-capable ``mx``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchkit.verify import emulate
from patchkit.verify.dispatch import uses_qmv_fast
from patchkit.verify.emulate import extract
from patchkit.verify.emulate.families import AFFINE, FAMILIES, FP, M1_ROLES, Header


def _harness_kernels(family: Header) -> tuple[str, ...]:
    # The M = 1 kernels ride along so the same text also holds the emulator's
    # reference; the streamed kernels are what Metal runs.
    return (*(family.kernel(r) for r in M1_ROLES), *family.streamed_kernels)


KERNELS = _harness_kernels(AFFINE)
FP_KERNELS = _harness_kernels(FP)
INPUT_NAMES = ("w", "scales", "biases", "x", "in_vec_size", "out_vec_size", "M")
# The fp modes have no biases; their global scale (nvfp4 only) is not benched.
FP_INPUT_NAMES = ("w", "scales", "x", "in_vec_size", "out_vec_size", "M")
OUTPUT_NAMES = ("y",)
# MLX's qmv tiling: 2 simdgroups of 32 lanes, 4 output rows each.
THREADGROUP = (32, 2, 1)
ROWS_PER_THREADGROUP = 8


@dataclass(frozen=True)
class MetalSource:
    """What ``metal_kernel`` gets: ``header`` = preamble + ``extracted.source``."""

    preamble: str
    extracted: extract.Extracted

    @property
    def header(self) -> str:
        return self.preamble + "\n" + self.extracted.source


def preamble(upstream: str) -> str:
    """quantized.h's own includes, ``using namespace metal`` and ``MLX_MTL_CONST`` define.

    Taken from the header text rather than written here, so a pin bump carries them.
    """
    pattern = r"^(#include <metal_\w+>|using namespace metal;|#define MLX_MTL_CONST\b.*)$"
    return "\n".join(re.findall(pattern, upstream, re.M)) + "\n"


def metal_source(root: Path, header: Path | None = None, mode: str = "affine") -> MetalSource:
    """The pinned header, upstream and patched, reduced to the kernels and their helpers.

    For the fp modes the header is ``fp_quantized.h`` and the fp4/fp8 type
    headers it includes are inlined, exactly as the fp emulator compiles them.
    """
    family = FAMILIES[mode].header
    upstream, types = emulate.pinned_sources(root, family, header)
    sources = emulate.sources(upstream, family)
    return MetalSource(
        preamble(upstream), extract.extract(sources, _harness_kernels(family), family, types)
    )


def is_fast(K: int, N: int, bits: int) -> bool:
    """MLX's M = 1 choice (qmv_fast vs qmv), which the streamed kernel mirrors.

    The same rule for every mode: quantized.cpp's ``qmv`` decides it before it
    looks at the mode.
    """
    return uses_qmv_fast(K, N, bits)


def kernel_body(fast: bool, mode: str = "affine") -> str:
    """The ``source`` of the kernel: the patched M = 1 impl at vecs_per_tg = V, as MLX calls it."""
    impl = (
        "patched::"
        + ("" if mode == "affine" else "fp_")
        + ("qmv_fast_impl" if fast else "qmv_impl")
    )
    # fp kernels take a global-scale pointer where affine takes biases; without
    # has_global_scale the kernel never reads it. Their template arguments: has
    # the global scale, (qmv_fast only) the output tile, then vecs_per_tg.
    operands = "biases" if mode == "affine" else "(const device float*)nullptr"
    args = "T, GROUP_SIZE, BITS, " + (
        "V" if mode == "affine" else ("false, 4, V" if fast else "false, V")
    )
    return (
        f"  {impl}<{args}>(\n"
        f"      w, scales, {operands}, x, y, in_vec_size, out_vec_size,\n"
        "      threadgroup_position_in_grid,\n"
        "      simdgroup_index_in_threadgroup,\n"
        "      thread_index_in_simdgroup,\n"
        "      M - static_cast<int>(threadgroup_position_in_grid.x) * V);\n"
    )


def grid(M: int, N: int, V: int) -> tuple[int, int, int]:
    """Threads (not threadgroups, as ``metal_kernel`` counts): one tile of V vectors per x."""
    return (-(-M // V) * THREADGROUP[0], -(-N // ROWS_PER_THREADGROUP) * THREADGROUP[1], 1)


def make_kernel(mx: Any, src: MetalSource, fast: bool, mode: str = "affine") -> Any:
    """The ``mx.fast.metal_kernel`` object for one M = 1 path (fast or not)."""
    prefix = "patchkit_" + ("" if mode == "affine" else "fp_")
    return mx.fast.metal_kernel(
        name=prefix + ("qmv_fast_streamed" if fast else "qmv_streamed"),
        input_names=list(INPUT_NAMES if mode == "affine" else FP_INPUT_NAMES),
        output_names=list(OUTPUT_NAMES),
        source=kernel_body(fast, mode),
        header=src.header,
    )


def run_streamed(
    mx: Any, kernel: Any, w: Any, scales: Any, biases: Any, x: Any, gs: int, bits: int, V: int
) -> Any:
    """``y`` of shape (M, N) for ``x`` of shape (M, K), the weights as ``mx.quantize`` made them.

    ``biases`` is None for the fp modes (their kernels take no biases input).
    """
    M, K = x.shape
    N = w.shape[0]
    weights = [w, scales] if biases is None else [w, scales, biases]
    (y,) = kernel(
        inputs=[*weights, x, mx.array(K), mx.array(N), mx.array(M)],
        template=[("T", x.dtype), ("GROUP_SIZE", gs), ("BITS", bits), ("V", V)],
        grid=grid(M, N, V),
        threadgroup=THREADGROUP,
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
    return y
