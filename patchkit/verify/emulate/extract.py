"""Pull the functions the emulator runs out of a real (patched or stock) kernel header.

The emulator never carries its own copy of MLX's kernels: it takes them from
the header of the tree under test, by structure, at run time. Functions are
emitted in the order the header defines them, which already satisfies their
dependencies.

One translation unit holds the tree's kernels twice, each text in its own
namespace: ``upstream`` (the header as the tree has it: the M = 1 reference and
the ``qmv_wide`` control) and ``patched`` (the same header with the patch
rendered in: the M = 1 kernels now taking ``vecs_per_tg``). The parity suite
then compares the patched kernel at V > 1 with upstream's own M = 1 kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from patchkit.carry import cxx
from patchkit.errors import AnchorError, UserError
from patchkit.verify.emulate.families import AFFINE, Header


@dataclass(frozen=True)
class Sources:
    """One tree's kernel header as upstream has it and with the patch rendered in."""

    upstream: str
    patched: str


# The namespaces the two texts compile in (runner.cpp names them).
UPSTREAM_NS = "upstream"
PATCHED_NS = "patched"


@dataclass(frozen=True)
class Extracted:
    """Kernel source ready to compile against the shim, and which kernels it holds."""

    source: str
    kernels: tuple[str, ...]
    header: Header = AFFINE


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


def _struct_span(header: str, name: str) -> tuple[int, int]:
    """Span of ``[template <...>] struct name { ... };`` in ``header``."""
    pattern = rf"^(?:template\s*<[^;{{}}]*>\s*)?struct\s+{re.escape(name)}\s*\{{"
    found = list(re.finditer(pattern, header, re.M))
    if len(found) != 1:
        raise UserError(f"the kernel header defines struct '{name}' {len(found)} times, not once")
    m = found[0]
    end = cxx.match_brace(header, m.end() - 1)
    if header[end : end + 1] == ";":
        end += 1
    return m.start(), end


def _without_pragma_once(text: str) -> str:
    return re.sub(r"^#pragma once\s*$", "", text, flags=re.M)


def _namespace(name: str, header: str, family: Header, kernels: tuple[str, ...], what: str) -> str:
    """``kernels`` and their helpers from ``header``, inside ``namespace name``."""
    structs = [_struct_span(header, struct) for struct in family.structs]
    body = _function_texts(header, family.helpers, family.kernels, kernels, what, structs)
    return f"namespace {name} {{\n{_constants(header)}\n\n{body}\n}} // namespace {name}\n"


def extract(
    sources: Sources,
    kernels: tuple[str, ...],
    family: Header = AFFINE,
    types: tuple[str, ...] = (),
) -> Extracted:
    """Source for ``kernels``: upstream roles from ``sources.upstream``, streamed from ``.patched``.

    ``types`` are the texts of the family's type headers (``fp4.h`` and
    ``fp8.h`` for the fp modes: the ``fp4_e2m1``, ``fp8_e4m3`` and
    ``fp8_e8m0`` types with the decode the kernels use); they are taken whole,
    once, outside both namespaces, since they hold only those structs and two
    constants and compile under the shim as they are. Raises a
    :class:`UserError` naming the function when a header lacks one.
    """
    if len(types) != len(family.type_headers):
        raise UserError(f"the {family.name} kernels need {', '.join(family.type_headers)}")
    streamed = tuple(k for k in kernels if k in family.streamed_kernels)
    upstream = tuple(k for k in kernels if k not in streamed)
    parts = [_without_pragma_once(t) + "\n" for t in types]
    if upstream:
        what = f"upstream {family.name} kernel header"
        parts.append(_namespace(UPSTREAM_NS, sources.upstream, family, upstream, what))
    if streamed:
        what = f"patched {family.name} kernel header"
        parts.append(_namespace(PATCHED_NS, sources.patched, family, streamed, what))
    return Extracted(source="\n".join(parts), kernels=tuple(kernels), header=family)
