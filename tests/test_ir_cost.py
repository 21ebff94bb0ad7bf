"""What a compiler makes of the tile at V > 1, read from clang -O2's IR over the Metal shim:
in affine qmv_fast (the path of layers with N % 8 == 0 and an aligned K, most LLM layers)
no per-vector input array survives in thread memory at V = 2 or 5, only the result array
(vecs_per_tg x 4 floats; upstream's own M = 1 kernel keeps its 4 there in this proxy), and
the weight loads do not grow with V: each block is read once for the whole tile.

A proxy: Apple's GPU compiler is not x86 clang, and only a Mac's Metal compiler and its
register report settle it. Control: the v loops bounded by the tile's real vectors at run
time (the earlier form) leave the V x values_per_thread input arrays in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support_emulate import mutate

from patchkit.verify import emulate
from patchkit.verify.emulate import build, ir
from patchkit.verify.emulate.costs import PROXIES
from patchkit.verify.emulate.families import AFFINE, FP

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PER_SIMDGROUP = 4  # qmv_fast_impl's output rows per simdgroup
BITS = ("2", "4", "8")


@pytest.fixture(scope="module")
def affine() -> tuple[emulate.Sources, tuple[str, ...], list[ir.Instance]]:
    build.require_compiler(build.TOOLCHAINS["clang"])
    upstream, types = emulate.pinned_sources(ROOT, AFFINE)
    todo = [ir.Instance("affine_qmv_fast", ("float", "64", b, "false")) for b in BITS]
    return emulate.sources(upstream, AFFINE), types, todo


def test_the_tile_keeps_only_its_results_in_memory_and_reads_weights_once(affine) -> None:
    sources, types, todo = affine
    costs = ir.costs(sources, AFFINE, types, todo)
    for inst in todo:
        by_v = {c.vecs: c for c in costs if c.instance == inst}
        for v in (2, 5):
            assert set(by_v[v].arrays) <= {v * RESULTS_PER_SIMDGROUP}, (inst.label, v)
        assert by_v[5].weight_loads == by_v[2].weight_loads, inst.label
        assert by_v[1].weight_loads > 0


def test_half_kernels_read_each_weight_once_though_x_loads_are_integer_loads(affine) -> None:
    """float16_t's x, scales and biases are 16-bit integer loads under the shim: counted by
    type, loads grow with V (each vector loads its own x); counted from the weights
    argument, they do not in affine qmv_fast (control: the by-type count does grow)."""
    sources, types, _ = affine
    inst = ir.Instance("affine_qmv_fast", ("float16_t", "64", "4", "false"))
    by_v = {c.vecs: c for c in ir.costs(sources, AFFINE, types, [inst])}
    assert by_v[1].weight_loads > 0
    assert by_v[5].weight_loads == by_v[2].weight_loads == by_v[1].weight_loads
    by_type = {v: sum(n for t, n in c.loads.items() if t.startswith("i")) for v, c in by_v.items()}
    assert by_type[5] > by_type[1]


def test_fp_fast_kernels_share_weight_loads_once_inlined() -> None:
    """fp qmv_fast, every call inlined: as many weight loads at V = 5 as at V = 1. It
    needs errno-free math (ir.COST_FLAGS): the shim's half conversions call ldexpf, which
    with errno may write memory between two copies of the same load."""
    upstream, types = emulate.pinned_sources(ROOT, FP)
    inst = ir.Instance("fp_qmv_fast", ("float16_t", "32", "4", "false"))
    costs = ir.costs(emulate.sources(upstream, FP), FP, types, [inst], inlined_unrolled=True)
    by_v = {c.vecs: c.weight_loads for c in costs}
    assert by_v[1] > 0 and by_v[5] == by_v[2] == by_v[1]


def test_a_runtime_bound_on_the_v_loops_leaves_the_inputs_in_memory(affine) -> None:
    sources, types, todo = affine
    # Mutation: the load and multiply-add loops stop at the tile's real vectors (n_vecs,
    # known only at run time), as the kernel once did.
    mutated = mutate(
        sources,
        "for (int v = 0; v < vecs_per_tg; v++) {",
        "for (int v = 0; v < vecs_per_tg && v < n_vecs; v++) {",
        21,  # qmv_fast_impl's 3 and qmv_impl's 18
    )
    costs = ir.costs(mutated, AFFINE, types, todo, vecs=(5,))
    assert any(max(c.arrays, default=0) > 5 * RESULTS_PER_SIMDGROUP for c in costs)


GUARDED_AFFINE = [ir.Instance("affine_qmv", ("float", "64", b, "false")) for b in BITS]
# The tile's last K block: V = 1 passes the guarded helpers the lane's run-time length,
# V > 1 the constant it then is (a lane's last block is whole or empty).
TAIL = "const int tail = vecs_per_tg == 1 ? remaining : values_per_thread;"
# Each row's V sums held in registers while the V calls read its weights.
ACC = "acc[v] += qdot"
STORE = "result[v * results_per_simdgroup + row] = acc[v];"


def _guarded_costs(sources: emulate.Sources, types: tuple[str, ...]) -> dict[str, dict]:
    costs = ir.costs(sources, AFFINE, types, GUARDED_AFFINE, inlined_unrolled=True)
    return {i.label: {c.vecs: c for c in costs if c.instance == i} for i in GUARDED_AFFINE}


def test_guarded_qmv_shares_each_blocks_weight_loads_once_inlined(affine) -> None:
    """affine qmv (layers with N % 8 != 0 or an unaligned K), every call inlined: no input
    array left in thread memory at V = 2 or 5, and as many weight loads at V = 5 as at
    V = 2, the last K block included. V = 1 (upstream's kernel) is not the reference
    here: its last block's guarded helpers loop to a run-time length, one load per trip,
    where the tile passes a constant and they unroll (the same loads per block).
    Controls: the run-time length in the tile (the earlier form) keeps the inputs in
    thread memory; each call's sum stored into the result array as it comes (the
    earlier form) puts stores between the V copies of a row's loads, and they are no
    longer merged."""
    sources, types, _ = affine
    for label, by_v in _guarded_costs(sources, types).items():
        for v in (2, 5):
            assert set(by_v[v].arrays) <= {v * RESULTS_PER_SIMDGROUP}, (label, v)
        assert by_v[5].weight_loads == by_v[2].weight_loads > 0, label
    runtime_tail = mutate(sources, TAIL, "const int tail = remaining;", 2)
    by_label = _guarded_costs(runtime_tail, types)
    assert any(max(at[5].arrays) > 5 * RESULTS_PER_SIMDGROUP for at in by_label.values())
    # each call's sum stored as it comes (the earlier form)
    summed_as_they_come = mutate(sources, ACC, "result[v * results_per_simdgroup + row] += qdot", 4)
    summed_as_they_come = mutate(summed_as_they_come, STORE, "", 4)
    by_label = _guarded_costs(summed_as_they_come, types)
    assert any(at[5].weight_loads > at[2].weight_loads for at in by_label.values())


def test_the_metal_ir_page_is_of_the_current_kernels(affine) -> None:
    """docs/results/metal-ir.json holds what the kernels compile to now: one instance is
    recompiled and its rows (patched at V = 1, 2, 5; qmv_wide at 2, 5) must match. When the
    templates change, rerun `python3 bench/metal_ir_costs.py run`."""
    sources, types, todo = affine
    page = json.loads((ROOT / "docs" / "results" / "metal-ir.json").read_text())
    rows = {(r["proxy"], r["kernel"], r["instance"], r["vecs"]): r for r in page["rows"]}
    for proxy, inlined_unrolled in PROXIES.items():
        costs = ir.costs(
            sources, AFFINE, types, [todo[1]], wide=True, inlined_unrolled=inlined_unrolled
        )
        assert len(costs) == 5
        for c in costs:
            row = rows[(proxy, c.kernel, c.instance.label, c.vecs)]
            got = (list(c.arrays), c.weight_loads, c.live_words)
            assert got == (row["thread_arrays"], row["weight_loads"], row["live_words"]), (
                f"{c.instance.label} at V = {c.vecs} ({c.kernel}, {proxy}): the page is stale"
            )


WEIGHTS_IR = """\
define void @k(i32* noundef %0, %struct.narrow_float* noundef %1) {
  %3 = getelementptr inbounds i32, i32* %0, i64 4
  %4 = bitcast i32* %3 to i16*
  %5 = load i16, i16* %4, align 2
  %6 = getelementptr inbounds %struct.narrow_float, %struct.narrow_float* %1, i64 0, i32 0
  %7 = load i16, i16* %6, align 2
  %8 = phi i16* [ %4, %2 ], [ %6, %9 ]
  %10 = load i16, i16* %8, align 2
  ret void
}
"""


def test_weight_loads_are_the_loads_from_the_weight_argument() -> None:
    """A load counts as a weight load when its address derives from the weights
    parameter (through getelementptr, bitcast and phi), whatever its type: a 16-bit load of
    a half scale from the next parameter is not one (control)."""
    assert ir.loads_from_argument(WEIGHTS_IR, 0) == 2  # %5, and %10 through the phi
    assert ir.loads_from_argument(WEIGHTS_IR, 1) == 2  # %7, and %10 again
    assert ir.loads_from_argument(WEIGHTS_IR, 2) == 0
