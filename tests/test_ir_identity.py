"""The patch leaves M = 1 untouched: at vecs_per_tg = 1 every M = 1 kernel MLX
instantiates compiles to upstream's own optimized IR (clang -O2 over the Metal shim),
and a change of one operation in the patched kernel shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support_emulate import mutate

from patchkit.verify import emulate
from patchkit.verify.emulate import build, ir
from patchkit.verify.emulate.families import AFFINE, FP, Header

ROOT = Path(__file__).resolve().parent.parent
R = "result[v * results_per_simdgroup + row]"


@pytest.fixture(scope="module", params=[AFFINE, FP], ids=lambda h: h.name)
def family(request: pytest.FixtureRequest) -> tuple[Header, emulate.Sources, tuple[str, ...]]:
    build.require_compiler(build.TOOLCHAINS["clang"])
    header = request.param
    upstream, types = emulate.pinned_sources(ROOT, header)
    return header, emulate.sources(upstream, header), types


def test_every_m1_kernel_compiles_to_upstreams_ir(family) -> None:
    header, sources, types = family
    pairs = ir.compare(sources, header, types)
    # Every instance quantized.metal / fp_quantized.metal has for qmv_fast and qmv:
    # affine 3 types x 3 group sizes x 6 bits x 2 kernels x batched 0/1; fp 3 types
    # x 3 modes x 2 kernels x batched 0/1 x global scale, plus nvfp4's narrow tile.
    assert len(pairs) == (216 if header is AFFINE else 84)
    assert [p.instance.label for p in pairs if not p.identical] == []
    assert all(len(p.upstream) > 1000 for p in pairs)  # whole kernels, not stubs


def test_one_changed_operation_shows(family) -> None:
    # Mutation: the patched kernels hand simd_sum their partial sum plus 0.0f, a
    # change only for -0.0, so no compiler may drop it: every M = 1 instance of
    # the float type must differ.
    header, sources, types = family
    mutated = mutate(sources, f"{R} = simd_sum({R});", f"{R} = simd_sum({R} + 0.0f);", 3)
    todo = [i for i in ir.instances(header) if i.args[0] == "float"]
    assert not any(p.identical for p in ir.compare(mutated, header, types, todo))


# One function twice, as a compiler may print it: the "then" block before the
# join block, or after it. Parameters %0, %1; the entry block is %2.
THEN_FIRST = """\
  %3 = icmp eq i32 %0, 0
  br i1 %3, label %4, label %6
4:
  %5 = add i32 %1, 1
  br label %6
6:
  %7 = phi i32 [ %5, %4 ], [ %1, %2 ]
  ret i32 %7
"""
JOIN_FIRST = """\
  %3 = icmp eq i32 %0, 0
  br i1 %3, label %6, label %4
4:
  %5 = phi i32 [ %1, %2 ], [ %7, %6 ]
  ret i32 %5
6:
  %7 = add i32 %1, 1
  br label %4
"""


def test_canonical_layout_ignores_block_order_only() -> None:
    assert ir.canonical(THEN_FIRST, 2) == ir.canonical(JOIN_FIRST, 2)
    changed = JOIN_FIRST.replace("add i32 %1, 1", "add i32 %1, 2")
    assert ir.canonical(THEN_FIRST, 2) != ir.canonical(changed, 2)
    swapped = JOIN_FIRST.replace("label %6, label %4", "label %4, label %6")  # the branch inverted
    assert ir.canonical(THEN_FIRST, 2) != ir.canonical(swapped, 2)
