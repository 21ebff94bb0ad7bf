"""Pull the functions the emulator runs out of a real (patched or stock) quantized.h.

The emulator never carries its own copy of MLX's kernels: it takes them from
the header of the tree under test, by structure, at run time. Functions are
emitted in the order the header defines them, which already satisfies their
dependencies (the patch inserts its functions after the ones they call).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from patchkit.carry import cxx
from patchkit.errors import AnchorError, UserError

# Helpers every kernel below needs; (name, overload index or None).
HELPERS: tuple[tuple[str, int | None], ...] = (
    ("get_pack_factor", None),
    ("get_bytes_per_pack", None),
    ("load_vector", None),
    ("load_vector_safe", None),
    ("qdot", None),
    ("qdot_safe", None),
    ("dequantize", None),
    # The strided batch overload; the gather overload is not used by qmv.
    ("adjust_matrix_offsets", 0),
)

# Kernel kind -> the functions (impl + [[kernel]] entry) it needs beyond HELPERS.
KERNELS: dict[str, tuple[str, ...]] = {
    "qmv_fast": ("qmv_fast_impl", "affine_qmv_fast"),
    "qmv": ("qmv_impl", "affine_qmv"),
    "qmv_wide": ("qmv_wide_impl", "affine_qmv_wide"),
    "qmv_fast_streamed": ("qmv_fast_streamed_impl", "affine_qmv_fast_streamed"),
    "qmv_streamed": ("qmv_streamed_impl", "affine_qmv_streamed"),
}

UPSTREAM_KERNELS = ("qmv_fast", "qmv", "qmv_wide")
STREAMED_KERNELS = ("qmv_fast_streamed", "qmv_streamed")


@dataclass(frozen=True)
class Extracted:
    """Kernel source ready to compile against the shim, and which kernels it holds."""

    source: str
    kernels: tuple[str, ...]


def _constants(header: str) -> str:
    """The header's ``MLX_MTL_CONST`` lines (SIMD_SIZE and friends)."""
    return "\n".join(re.findall(r"^MLX_MTL_CONST\b.*;$", header, re.M))


def _function_texts(
    header: str,
    helpers: tuple[tuple[str, int | None], ...],
    table: dict[str, tuple[str, ...]],
    kernels: tuple[str, ...],
    what: str,
    extra_spans: list[tuple[int, int]],
) -> str:
    """The helpers' and ``kernels``' function texts (plus ``extra_spans``), in header order.

    Raises a :class:`UserError` naming the function when the header lacks one:
    asking for the streamed kernels from an unpatched header is the usual cause.
    """
    unknown = set(kernels) - set(table)
    if unknown:
        raise UserError(f"unknown kernel(s) {sorted(unknown)}; choose from {sorted(table)}")
    wanted: list[tuple[str, int | None]] = list(helpers)
    for kernel in kernels:
        wanted += [(name, None) for name in table[kernel] if (name, None) not in wanted]
    spans = list(extra_spans)
    for name, index in wanted:
        try:
            fn = cxx.find_function(header, name, index)
        except AnchorError as exc:
            raise UserError(
                f"the {what} has no '{name}' (needed for {', '.join(kernels)}): {exc}"
            ) from exc
        spans.append(fn.span)
    return "\n\n".join(header[a:b] for a, b in sorted(spans))


def extract(header: str, kernels: tuple[str, ...]) -> Extracted:
    """Source for ``kernels`` taken from ``header``, in header order.

    Raises a :class:`UserError` naming the function when the header lacks one:
    asking for the streamed kernels from an unpatched header is the usual cause.
    """
    body = _function_texts(header, HELPERS, KERNELS, kernels, "kernel header", [])
    return Extracted(source=_constants(header) + "\n\n" + body + "\n", kernels=tuple(kernels))


# ---- the fp modes (fp_quantized.h) -------------------------------------------

# Helpers the fp kernels need, in the same (name, overload index) form; the
# Dequantize struct is taken separately (a struct, not a function).
FP_HELPERS: tuple[tuple[str, int | None], ...] = (
    ("get_pack_factor", None),
    ("get_bytes_per_pack", None),
    ("dequantize_scale", None),
    ("load_vector", None),
    ("load_vector_safe", None),
    ("qdot", None),
    ("qdot_safe", None),
    ("adjust_matrix_offsets", 0),
)
FP_STRUCTS = ("Dequantize",)

FP_KERNELS: dict[str, tuple[str, ...]] = {
    "fp_qmv_fast": ("fp_qmv_fast_impl", "fp_qmv_fast"),
    "fp_qmv": ("fp_qmv_impl", "fp_qmv"),
    "fp_qmv_wide": ("fp_qmv_wide_impl", "fp_qmv_wide"),
    "fp_qmv_fast_streamed": ("fp_qmv_fast_streamed_impl", "fp_qmv_fast_streamed"),
    "fp_qmv_streamed": ("fp_qmv_streamed_impl", "fp_qmv_streamed"),
}
FP_UPSTREAM_KERNELS = ("fp_qmv_fast", "fp_qmv", "fp_qmv_wide")
FP_STREAMED_KERNELS = ("fp_qmv_fast_streamed", "fp_qmv_streamed")


def _struct_span(header: str, name: str) -> tuple[int, int]:
    """Span of ``[template <...>] struct name { ... };`` in ``header``."""
    pattern = rf"^(?:template\s*<[^;{{}}]*>\s*)?struct\s+{re.escape(name)}\s*\{{"
    found = list(re.finditer(pattern, header, re.M))
    if len(found) != 1:
        raise UserError(f"the fp header defines struct '{name}' {len(found)} times, not once")
    m = found[0]
    end = cxx.match_brace(header, m.end() - 1)
    if header[end : end + 1] == ";":
        end += 1
    return m.start(), end


def _without_pragma_once(text: str) -> str:
    return re.sub(r"^#pragma once\s*$", "", text, flags=re.M)


def extract_fp(header: str, fp4: str, fp8: str, kernels: tuple[str, ...]) -> Extracted:
    """Source for the fp ``kernels`` from ``fp_quantized.h`` and the fp types it includes.

    ``fp4.h`` and ``fp8.h`` (the ``fp4_e2m1``, ``fp8_e4m3`` and ``fp8_e8m0``
    types, with the decode the kernels use) are taken whole: they hold only
    those structs and two constants, and compile under the shim as they are.
    """
    structs = [_struct_span(header, name) for name in FP_STRUCTS]
    body = _function_texts(header, FP_HELPERS, FP_KERNELS, kernels, "fp kernel header", structs)
    types = _without_pragma_once(fp4) + "\n" + _without_pragma_once(fp8)
    return Extracted(
        source=types + "\n" + _constants(header) + "\n\n" + body + "\n", kernels=tuple(kernels)
    )
