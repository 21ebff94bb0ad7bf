"""Proof that the patch leaves M = 1 untouched: vecs_per_tg = 1 compiles to upstream's IR.

The one-body change edits MLX's own M = 1 kernels. For every [[kernel]] instance
MLX instantiates for M = 1, this compiles upstream's text and the patched text
at ``vecs_per_tg = 1`` in one translation unit (the two namespaces of
:mod:`.extract`), with clang ``-O2`` over the Metal shim, and compares the
optimized LLVM IR of each pair, function names aside. Metal inlines every
function (``METAL_FUNC`` is always_inline there), so the shim's ``METAL_FUNC``
is made always_inline here too: each kernel's IR is then its whole body.

Equal IR means the same operations in the same order on the same values: the
M = 1 kernel computes what it computed before, and how. A change of one
operation shows (``tests/test_ir_identity.py`` mutates one).
"""

from __future__ import annotations

import itertools
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchkit.errors import UserError
from patchkit.util import proc
from patchkit.verify import dispatch
from patchkit.verify.emulate import build, extract, liveness
from patchkit.verify.emulate.extract import PATCHED_NS, UPSTREAM_NS
from patchkit.verify.emulate.families import FP, M1_ROLES, Header

FLAGS = ("-std=c++20", "-O2", "-S", "-emit-llvm", "-w")
# Narrow types by their Metal names, as MLX instantiates them.
TYPES = ("float", "float16_t", "bfloat16_t")


@dataclass(frozen=True)
class Instance:
    """One M = 1 [[kernel]] instance: its entry and upstream's template arguments."""

    entry: str  # e.g. "affine_qmv_fast"
    args: tuple[str, ...]  # e.g. ("float", "64", "4", "false")

    def upstream(self) -> str:
        return f"{UPSTREAM_NS}::{self.entry}<{', '.join(self.args)}>"

    def patched(self) -> str:
        """The patched kernel at vecs_per_tg = 1, every defaulted argument spelled out."""
        return f"{PATCHED_NS}::{self.entry}<{', '.join(self.full_args())}>"

    def full_args(self) -> tuple[str, ...]:
        # affine: (T, gs, bits, batched, has_global_scale); fp_qmv_fast adds the tile;
        # vecs_per_tg comes last everywhere.
        base = self.args + ("false",) * (5 - len(self.args))
        if self.entry == "fp_qmv_fast" and len(base) == 5:
            base += ("4",)
        return (*base, "1")

    @property
    def label(self) -> str:
        return f"{self.entry}<{', '.join(self.args)}>"


def instances(header: Header) -> list[Instance]:
    """Every M = 1 qmv instance MLX instantiates for ``header`` (quantized.metal's lists)."""
    out = []
    if header is FP:
        for (gs, bits), t, role, batched in itertools.product(
            dispatch.FP_MODES.values(), TYPES, M1_ROLES, ("true", "false")
        ):
            entry = header.entry_prefix + role
            base = (t, str(gs), str(bits), batched)
            out += [Instance(entry, base), Instance(entry, (*base, "true"))]
            if role == "qmv_fast" and gs == 16:  # nvfp4's narrow tile, with and without hgs
                out += [Instance(entry, (*base, hgs, "2")) for hgs in ("false", "true")]
        return sorted(set(out), key=lambda i: i.label)
    for gs, bits, t, role, batched in itertools.product(
        dispatch.GROUP_SIZES, dispatch.AFFINE_BITS, TYPES, M1_ROLES, ("true", "false")
    ):
        out.append(Instance(header.entry_prefix + role, (t, str(gs), str(bits), batched)))
    return out


@dataclass(frozen=True)
class Pair:
    """One instance's two optimized bodies (IR text, function name removed)."""

    instance: Instance
    upstream: str
    patched: str

    @property
    def identical(self) -> bool:
        return self.upstream == self.patched


def translation_unit(
    sources: extract.Sources, header: Header, types: tuple[str, ...], todo: list[Instance]
) -> str:
    """Shim, both texts' M = 1 kernels, and one address taken per instance (so each is emitted)."""
    kernels = tuple(header.kernel(r) for r in M1_ROLES) + header.streamed_kernels
    source = extract.extract(sources, kernels, header, types).source
    taken = "\n".join(
        f'extern "C" const void* pk_ir_{i}[2] = {{(const void*)&{inst.upstream()}, '
        f"(const void*)&{inst.patched()}}};"
        for i, inst in enumerate(todo)
    )
    return "\n".join(
        [
            '#include "metal_shim.h"',
            "#undef METAL_FUNC",
            "#define METAL_FUNC inline __attribute__((always_inline))",
            source,
            taken,
        ]
    )


# The cost proxy's second setting, closer to a GPU compiler, which inlines every call and
# unrolls loops of fixed trip count: MLX's helpers (``qdot``, ``load_vector``) are plain
# ``inline``, and x86 clang -O2 may keep ``qdot`` a call (the arrays whose address it takes
# then stay in memory) and leave a 4-trip loop rolled (its array index then stays dynamic).
# Every ``inline`` of MLX's source (after the shim) becomes always_inline, and the unroll
# and inline thresholds are raised. Costs only: the V = 1 identity keeps clang's defaults.
INLINE_ALL = "#define inline inline __attribute__((always_inline))"
INLINED_UNROLLED_FLAGS = ("-mllvm", "-inline-threshold=2000", "-mllvm", "-unroll-threshold=2000")


# The costs' math has no errno, as on Apple's platforms (clang's default there) and on a
# GPU: with errno, each libm call of the shim's half conversions (ldexpf) may write memory,
# and no load after it can be merged with the same load before it.
COST_FLAGS = ("-fno-math-errno",)


def compile_flags(inlined_unrolled: bool = False, costs: bool = False) -> tuple[str, ...]:
    """clang's flags for :func:`compile_ir` on this host (fused multiply-add where x86);
    ``inlined_unrolled``: the costs' second setting (see :data:`INLINE_ALL`); ``costs``:
    with :data:`COST_FLAGS`."""
    extra = INLINED_UNROLLED_FLAGS if inlined_unrolled else ()
    return (*FLAGS, *build._fma_flags(), *(COST_FLAGS if costs else ()), *extra)


def compile_ir(unit: str, inlined_unrolled: bool = False, costs: bool = False) -> str:
    """The optimized LLVM IR of ``unit`` (clang -O2)."""
    clang = shutil.which("clang++")
    if clang is None:
        raise UserError("clang++ not found: install it (Debian: apt-get install clang)")
    with tempfile.TemporaryDirectory(prefix="patchkit-ir.") as tmp:
        src = Path(tmp) / "ir.cpp"
        src.write_text(unit)
        flags = compile_flags(inlined_unrolled, costs)
        cmd = [clang, *flags, f"-I{build.HERE}", str(src), "-o", "-"]
        return proc.run(cmd).stdout


def _numbered_in_order(body: str) -> str:
    """``body`` with metadata nodes (``!14``) renumbered by first use in it.

    Inlining gives each function its own alias-scope nodes, numbered by where
    they land in the module; renumbering per body keeps which uses share a
    node and drops only that module-wide position.
    """
    seen: dict[str, str] = {}
    return re.sub(r"!(\d+)\b", lambda m: seen.setdefault(m.group(1), f"!m{len(seen)}"), body)


def canonical(body: str, params: int) -> str:
    """A function body in a canonical layout: blocks in depth-first order from the entry.

    Two compilations of the same operations may place a loop's exit block
    elsewhere; that changes the text (block order, value numbers, the order of
    a phi's incoming pairs) but no operation. Blocks are laid out depth-first
    along each terminator's successors, values renumbered by definition in
    that layout, phi pairs sorted by block, and metadata renumbered by first
    use (:func:`_numbered_in_order`). What remains is every instruction.
    """
    lines = [ln.split(";", 1)[0].rstrip() for ln in body.splitlines()]
    blocks: dict[str, list[str]] = {}
    order: list[str] = []
    current = "entry"
    for line in lines:
        if not line:
            continue
        label = re.fullmatch(r"(\d+):", line)
        if label:
            current = label.group(1)
            continue
        if current not in blocks:
            blocks[current] = []
            order.append(current)
        blocks[current].append(line)
    seen: list[str] = []
    stack = ["entry"]
    while stack:
        block = stack.pop()
        if block in seen:
            continue
        seen.append(block)
        # br and switch name their targets as `label %N` (a switch over several lines).
        successors = re.findall(r"label %(\d+)", "\n".join(blocks[block]))
        stack += reversed(successors)
    # Value numbers: parameters, then the entry block's implicit label, then in layout order.
    renumber = {str(i): str(i) for i in range(params)}
    for block in seen:
        if block != "entry":
            renumber[block] = str(len(renumber))
        else:
            renumber["entry"] = str(len(renumber))
        for line in blocks[block]:
            d = re.match(r"\s*%(\d+) = ", line)
            if d:
                renumber[d.group(1)] = str(len(renumber))

    def values(line: str) -> str:
        return re.sub(r"%(\d+)\b", lambda m: "%" + renumber.get(m.group(1), "?" + m.group(1)), line)

    def phi_sorted(line: str) -> str:
        if " phi " not in line:
            return line
        head, pairs = line.split("[", 1)
        items = sorted(re.findall(r"\[ [^\]]* \]", "[" + pairs), key=lambda p: p.rsplit("%", 1)[1])
        return head + ", ".join(items)

    out = []
    for block in seen:
        out.append(f"{renumber[block]}:")
        out += [phi_sorted(values(line)) for line in blocks[block]]
    # The two texts' helpers are one upstream text in two namespaces: a call left
    # out of line names the same function either way.
    text = re.sub(
        rf"@_ZN(?:{len(UPSTREAM_NS)}{UPSTREAM_NS}|{len(PATCHED_NS)}{PATCHED_NS})",
        "@_ZN@",
        "\n".join(out),
    )
    return _numbered_in_order(text)


def _bodies(ir: str) -> dict[str, str]:
    """Mangled name -> canonical body of every function defined in ``ir``."""
    found = {}
    pattern = r"^define [^@\n]*@([^(\s]+)\(([^\n]*)\{\n(.*?)^\}"
    for m in re.finditer(pattern, ir, re.M | re.S):
        params = len(re.findall(r"%\d+\b", m.group(2).split(")")[0]))
        found[m.group(1)] = canonical(m.group(3), params)
    return found


def _addresses(ir: str, count: int) -> list[tuple[str, str]]:
    """(upstream, patched) mangled names per pk_ir_<i>, in order."""
    pairs = []
    for i in range(count):
        m = re.search(rf"^@pk_ir_{i} = .*?@(\S+?)(?:,| ).*?@(\S+?)[\],\s]", ir, re.M)
        if not m:
            raise UserError(f"pk_ir_{i} not found in the compiled IR")
        pairs.append((m.group(1), m.group(2)))
    return pairs


def compare(
    sources: extract.Sources,
    header: Header,
    types: tuple[str, ...] = (),
    todo: list[Instance] | None = None,
) -> list[Pair]:
    """Each M = 1 instance's upstream and patched (V = 1) bodies, compiled together."""
    todo = instances(header) if todo is None else todo
    ir = compile_ir(translation_unit(sources, header, types, todo))
    bodies = _bodies(ir)
    return [
        Pair(inst, bodies[up], bodies[pa])
        for inst, (up, pa) in zip(todo, _addresses(ir, len(todo)), strict=True)
    ]


@dataclass(frozen=True)
class Cost:
    """What clang -O2 made of one patched kernel at ``vecs`` vectors per threadgroup: the
    arrays left in thread memory (``alloca``: floats each), the loads by type and the
    floating-point words live at once."""

    instance: Instance
    vecs: int
    arrays: tuple[int, ...]  # float elements of each alloca that survived optimization
    loads: dict[str, int]  # static loads per IR type ("float", "i8", "i16", "i32", ...)
    live_words: float  # peak floating-point words live at once (liveness.peak_live_words)
    kernel: str = "patched"  # or "qmv_wide": upstream's batched kernel at the same V
    weight_loads: int = 0  # static loads from the packed weights (loads_from_argument)


_DEF = re.compile(r"^\s*(%[\w.]+) = (.*)$", re.M)
_LOAD_ADDRESS = re.compile(r"= load [^,]+, (?:[^,%]*\*|ptr) (%[\w.]+)")
_NAME = re.compile(r"%[\w.]+")


def _sources_of(definition: str) -> list[str]:
    """The pointers a pointer defined by ``definition`` is derived from: the base of a
    getelementptr, the operand of a cast, every incoming value of a phi or select."""
    op = definition.split(" ", 1)[0]
    if op == "getelementptr":
        # getelementptr [inbounds] TYPE, PTRTYPE %base, indices...
        return _NAME.findall(definition.split(",", 2)[1])[-1:]  # after the type's name
    if op in ("bitcast", "addrspacecast"):
        return _NAME.findall(definition.split(" to ", 1)[0])[-1:]
    if op == "phi":
        return re.findall(r"\[ (%[\w.]+), ", definition)
    if op == "select":
        return re.findall(r"(?:\*|ptr) (%[\w.]+)", definition)
    return []


def loads_from_argument(body: str, index: int) -> int:
    """Static loads in one function's IR whose address derives from its parameter
    ``index`` (0-based; clang names unnamed parameters ``%0``, ``%1``, ...), through
    getelementptr, casts, phi and select. Why not every integer load: the shim's half
    types are structs of 16-bit integers, so their x, scale and bias loads are integer
    loads too; the packed weights are the one argument that holds only weights."""
    defs = {m.group(1): m.group(2) for m in _DEF.finditer(body)}
    target = f"%{index}"
    memo: dict[str, bool] = {}

    def reaches(name: str) -> bool:
        seen, todo = set(), [name]
        while todo:
            cur = todo.pop()
            if cur == target or memo.get(cur):
                return True
            if cur in seen:
                continue
            seen.add(cur)
            todo += _sources_of(defs.get(cur, ""))
        return False

    count = 0
    for address in _LOAD_ADDRESS.findall(body):
        memo[address] = memo.get(address) or reaches(address)
        count += memo[address]
    return count


WIDE_K_LANES = "8"  # the k_lanes every affine_qmv_wide instantiation of the pin uses


def costs(
    sources: extract.Sources,
    header: Header,
    types: tuple[str, ...],
    todo: list[Instance],
    vecs: tuple[int, ...] = (1, 2, 5),
    wide: bool = False,
    inlined_unrolled: bool = False,
) -> list[Cost]:
    """Each patched ``todo`` kernel at each of ``vecs`` (a proxy for a GPU compiler: x86
    clang over the shim), compiled together in one unit. With ``wide`` (affine only), also
    upstream's ``affine_qmv_wide`` at each V > 1 with the same type, group and bits: the
    kernel the patch replaces, as its ``kernel``. ``inlined_unrolled``: every call inlined
    and unrolling thresholds raised (:data:`INLINE_ALL`)."""
    kernels = tuple(header.kernel(r) for r in M1_ROLES) + header.streamed_kernels
    cases = [(inst, v, "patched", _patched_at(inst, v)) for inst in todo for v in vecs]
    if wide:
        kernels += (header.wide,)
        cases += [
            (inst, v, "qmv_wide", f"{UPSTREAM_NS}::{header.entry_prefix}qmv_wide<"
             f"{', '.join((*inst.args[:3], str(v), WIDE_K_LANES, inst.args[3]))}>")
            for inst in todo for v in vecs if v > 1
        ]  # fmt: skip
    source = extract.extract(sources, kernels, header, types).source
    taken = "\n".join(
        f'extern "C" const void* pk_cost_{i} = (const void*)&{address};'
        for i, (*_, address) in enumerate(cases)
    )
    unit = "\n".join(
        [
            '#include "metal_shim.h"',
            "#undef METAL_FUNC",
            "#define METAL_FUNC inline __attribute__((always_inline))",
            *([INLINE_ALL] if inlined_unrolled else []),
            source,
            taken,
        ]
    )
    out = compile_ir(unit, inlined_unrolled, costs=True)
    found = []
    for i, (inst, v, kernel, _) in enumerate(cases):
        name = re.search(rf"^@pk_cost_{i} = .*?@(\S+?)[,\s]", out, re.M)
        if name is None:
            raise UserError(f"pk_cost_{i} not found in the compiled IR")
        body = re.search(rf"^define [^\n]*@{re.escape(name.group(1))}\(.*?^\}}", out, re.M | re.S)
        if body is None:
            raise UserError(f"{inst.label} at V = {v}: no body in the compiled IR")
        text = body.group(0)
        arrays = tuple(int(n) for n in re.findall(r"= alloca \[(\d+) x float\]", text))
        loads: dict[str, int] = {}
        for t in re.findall(r"= load (\S+?),", text):
            loads[t] = loads.get(t, 0) + 1
        # The packed weights are every kernel's first parameter (w).
        weights = loads_from_argument(text, 0)
        found.append(Cost(inst, v, arrays, loads, liveness.peak_live_words(text), kernel, weights))
    return found


def _patched_at(inst: Instance, vecs: int) -> str:
    return f"{PATCHED_NS}::{inst.entry}<{', '.join((*inst.full_args()[:-1], str(vecs)))}>"
