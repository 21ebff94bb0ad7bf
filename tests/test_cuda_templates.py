"""CUDA templates and the CUDA JIT harness, on a machine without a GPU or MLX.

Three layers, cheapest first:
* snippets rendered through Jinja with an explicit context (no upstream text);
* against the pinned upstream text (needs a clone; skips saying so): the derived
  ``dequant_fma_streamed`` keeps upstream's statements, and the harness's JIT
  header holds the streamed kernel byte for byte as the patch inserts it;
* ``nvcc -c`` of the patched ``qmv.cu`` for sm_90 (needs nvcc, a clone and the
  mlx-cuda-13 wheel's headers; skips saying which is missing).

Each layer covers both x-staging variants (``RenderOptions.cuda_x_staging``):
the default ``smem`` (what ``patches/`` holds) and ``global``, the baseline.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import ClassVar

import pytest
from support_format import CLANG_FORMAT_VERSION, clang_format
from support_git import mlx_clone
from support_scripts import load_script

from patchkit.carry import render, source
from patchkit.errors import UserError
from patchkit.util import git
from patchkit.verify import dispatch
from patchkit.verify.harness import cuda

ROOT = Path(__file__).resolve().parents[1]
PIN = "9a795735ad9a42664e08f42361b405ed570bcf1a"
QMV = "mlx/backend/cuda/quantized/qmm/qmv.cu"
QCPP = "mlx/backend/cuda/quantized/quantized.cpp"


def _plan(path: str) -> render.FilePlan:
    return next(p for p in render.load_plans() if p.path == path)


def _ctx(
    routing: str = "stream",
    vecs: tuple[int, ...] = (2, 4, 8),
    staging: str = "global",
    split_tail: bool = False,
    async_tail: bool = False,
    min_weights: int = 0,
    rows_per_warp: int = 2,
    min_blocks: int = 0,
    **derived: str,
) -> dict:
    return {
        "flavour": "upstream",
        "routing": routing,
        "vecs": list(vecs),
        "cuda_x_staging": staging,
        "cuda_split_tail": split_tail,
        "cuda_stream_min_weights": min_weights,
        "cuda_rows_per_warp": rows_per_warp,
        "cuda_async_tail": async_tail,
        "cuda_min_blocks_per_sm": min_blocks,
        **derived,
    }


def _kernel(staging: str, async_tail: bool = False) -> str:
    ctx = _ctx(
        staging=staging,
        async_tail=async_tail,
        dequant_fma_streamed_t="/*T*/",
        dequant_fma_streamed_f="/*F*/",
    )
    return render.render_snippet(_plan(QMV), "streamed_kernel.cu.j2", ctx)


def _assert_in_order(text: str, *parts: str) -> None:
    """Each of ``parts`` is in ``text`` (first occurrence), in this order."""
    at = [text.index(part) for part in parts]
    assert at == sorted(at), list(zip(parts, at, strict=True))


def _between(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i : text.index(end, i) + len(end)]


# ---------------------------------------------------------------- snippets only


def test_kernel_snippet_keeps_the_m1_order_per_vector() -> None:
    """One sums row per vector, one cg::reduce per vector, M passed in, tails guarded."""
    ctx = _ctx(dequant_fma_streamed_t="/*T*/", dequant_fma_streamed_f="/*F*/")
    text = render.render_snippet(_plan(QMV), "streamed_kernel.cu.j2", ctx)
    assert "sums[V][elems_per_thread] =\n      {};" in text
    assert "dequant_fma_streamed<V, elems_per_thread, has_bias>(" in text
    assert text.count("cg::reduce(warp, sum, cg::plus<float>{})") == 1  # inside the per-v loop
    assert re.search(r"for \(int v = 0; v < V; \+\+v\) \{\s*if \(v < nv\)", text)
    assert "int m,\n    int n," in text and "grid.dim_blocks().y" not in text
    assert text.startswith("/*T*/\n\n/*F*/\n\n")


def _statements(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_smem_staging_keeps_the_order_defining_statements() -> None:
    """x from shared memory, 2 rows per warp: the same idx sequence, fma call, reduce and store.

    Only where x is read from (a bit copy in registers), which row pointer the call gets
    and the constant V (vectors past nv are computed on staged zeros, never stored) differ.
    """
    glob, smem = _kernel("global"), _kernel("smem")
    for text in (glob, smem):
        assert text.count("dequant_fma_streamed<V, elems_per_thread, has_bias>(") == 1
        assert text.count("cg::reduce(warp, sum, cg::plus<float>{})") == 1
        # The residue tail's idx, as qmv_kernel_impl computes it.
        assert "int idx = warp.thread_rank() * elems_per_thread + k - rest;" in text
    tail = "        w + w_step(idx),\n        scale,\n        bias,\n        sums,\n        nv);"
    assert tail in glob
    # One accumulator row per (row, vector); row j's own weights, scale and bias.
    assert "sums[rows_per_warp][V][elems_per_thread] = {};" in smem
    assert "w + jr * w_step(k) + w_step(idx),\n          scale,\n          bias,\n" in smem
    assert "sums[j],\n          V);" in smem
    assert "S scale = scales[jr * groups_per_row + idx / group_size];" in smem
    # Rows past n recompute row n - 1 (never stored); vectors past nv read staged zeros.
    assert "int jr = cuda::std::min(j, n - 1 - row);" in smem
    assert "*d = v < nv ? src[i] : 0u;" in smem
    assert "if (v < nv) {\n            cp_async<4>(" in smem and "*d = 0u;" in smem
    # cp.async through MLX's helpers only, and only where MLX says sm_80 is enabled:
    # below it the same stages are copied with plain loads and stores.
    assert 'asm volatile("cp.async' not in smem and "cp_async_wait<1>();" in smem
    guard = _between(smem, "#if defined(MLX_CUDA_SM_80_ENABLED)", "#endif")
    assert "constexpr bool async_x = x_async;" in guard
    assert "#else\n  constexpr bool async_x = false;" in guard
    assert "if constexpr (async_x) {" in smem and "if constexpr (x_async)" not in smem
    # x reaches the fma as a bit copy: 16-byte words from shared memory into registers.
    assert "uint4 x_regs[V][x_words / 4];" in smem
    assert "reinterpret_cast<const T*>(x_regs)" in smem and "x + idx" not in smem
    # idx for staged step s of a stage from r0 is qmv's idx for r = r0 + s; stages cover
    # r = 0, 1, ..., steps - 1 in increasing order (async full stages, or sync ones, then
    # single steps), each tile once.
    assert "warp.thread_rank() * elems_per_thread + (r0 + s) * elems_per_warp;" in smem
    assert "for (int s = 0; s < decltype(count)::value; ++s) {" in smem
    assert "for (int i = 0; i < full; ++i, r0 += stage_steps) {" in smem
    assert "for (; r0 + stage_steps <= steps; r0 += stage_steps) {" in smem
    assert "for (; r0 < steps; ++r0) {" in smem
    # The per-vector sum, reduce, scaling and store: the same statements, per row j.
    reduce_g = _between(glob, "      float sum{0};", "static_cast<T>(sum);")
    reduce_s = _between(smem, "        float sum{0};", "static_cast<T>(sum);")
    assert _statements(reduce_s.replace("sums[j][v]", "sums[v]").replace("row + j]", "row]")) == (
        _statements(reduce_g)
    )
    assert "if (v < nv && row + j < n) {" in smem


def test_smem_staging_has_no_early_return_before_a_barrier() -> None:
    """Warps past n must meet every __syncthreads(): no return before the last one."""
    glob, smem = _kernel("global"), _kernel("smem")
    assert "__syncthreads()" not in glob and "__shared__" not in glob
    assert "if (row >= n) {\n    return;\n  }" in glob
    assert "if (row >= n)" not in smem
    code = re.sub(r"//[^\n]*", "", smem)  # comments may say "return"
    impl = _between(code, "void qmv_streamed_kernel_impl(", "\n}\n")
    body = _between(code, "void qmv_streamed_kernel_body(", "\n}\n")
    assert not re.search(r"\breturn\b", body)
    barriers = [m.start() for m in re.finditer(r"__syncthreads\(\);", impl)]
    assert len(barriers) == 7  # async stages 2, sync stages 2, single steps 2, residue 1
    # A bare `return;` leaves the void kernel (lambdas return values): one, past the last barrier.
    exits = [m.start() for m in re.finditer(r"\breturn;", impl)]
    assert len(exits) == 1 and exits[0] > barriers[-1]
    assert "if (!row_active) {\n    return;" in impl[barriers[-1] :]
    # Compute and stores are guarded by the row instead.
    assert "if (row_active) {" in impl and "if (row_active && idx < k) {" in impl
    assert "bool row_active = row < n;" in impl
    # The async pipeline: stage i's copies have landed (wait_group 1) before the barrier
    # that precedes its compute; the barrier after the compute frees the buffer.
    loop = _between(impl, "for (int i = 0; i < full; ++i, r0 += stage_steps) {", "\n    }\n")
    _assert_in_order(
        loop,
        "cp_async_commit();",
        "cp_async_wait<1>();",
        "__syncthreads();",
        "compute_stage(",
        "__syncthreads();\n    }",
    )
    # The copy's stride is the block's thread count: warps = rows_per_block / rows_per_warp.
    assert "i += block_threads" in impl
    assert "block_threads = rows_per_block / rows_per_warp * WARP_SIZE;" in impl
    # The body's knobs default to the plain shape; the __global__ wrapper passes the tuned one.
    assert (
        "    int max_stage_steps = 4,\n    int rows_per_warp = 1,\n"
        "    bool l2_prefetch = false,\n    bool x_async = false>" in smem
    )
    wrapper = _between(smem, "__global__ void qmv_streamed_kernel(", "\n}\n")
    assert "      max_stage_steps,\n      rows_per_warp,\n" in wrapper
    # Below sm_80 (no cp.async) one k step per stage; the order is the same either way.
    arch = _between(wrapper, "#if defined(MLX_CUDA_SM_80_ENABLED)", "#endif")
    assert "#else\n  constexpr int max_stage_steps = 1;\n" in arch
    assert "/* l2_prefetch */ true,\n      /* x_async */ true>(" in wrapper
    assert "cuda::std::min(max_stage_steps, 6144 / (V * tile_words));" in impl
    launch = render.render_snippet(_plan(QMV), "streamed_launch.cu.j2", _ctx(staging="smem"))
    assert "constexpr int rows_per_warp = 2;\n  constexpr int rows_per_block = 8;" in launch
    assert "dim3 block_dims{WARP_SIZE, rows_per_block / rows_per_warp};" in launch
    assert re.findall(r"if \(m <= (\d+)\)", launch) == ["2"]
    assert "integral_constant<int, 4>" in launch.rstrip().rsplit("launch(", 1)[1]
    # The harness's shipped arm is what the wrapper and the launcher say.
    k = cuda.SHIPPED_KNOBS
    assert f"ENABLED)\n  constexpr int max_stage_steps = {k.stage_steps};" in wrapper
    assert f"constexpr int rows_per_warp = {k.rows_per_warp};" in launch
    assert f"/* l2_prefetch */ {str(k.l2_prefetch).lower()}," in wrapper
    assert f"/* x_async */ {str(k.x_async).lower()}>(" in wrapper


def test_min_blocks_bounds_only_the_streamed_kernels_registers() -> None:
    """cuda_min_blocks_per_sm adds __launch_bounds__ (threads per block; min blocks from
    V = 4 up, where ptxas gives 8-bit 161 registers) to the streamed kernel's declaration
    and nothing else; unset, the kernel has no bound."""
    derived = {"dequant_fma_streamed_t": "/*T*/", "dequant_fma_streamed_f": "/*F*/"}
    plain = render.render_snippet(
        _plan(QMV), "streamed_kernel.cu.j2", _ctx(staging="smem", **derived)
    )
    bound = render.render_snippet(
        _plan(QMV), "streamed_kernel.cu.j2", _ctx(staging="smem", min_blocks=4, **derived)
    )
    assert "__launch_bounds__" not in plain
    decl = (
        "__global__ void __launch_bounds__(\n"
        "    rows_per_block / rows_per_warp * WARP_SIZE,\n"
        "    V >= 4 ? 4 : 5)\n"
    )
    assert decl + "    qmv_streamed_kernel(\n        const T* x,\n" in bound
    # Without the bound and its comment, the same kernel (clang-format indents the
    # parameters of the bounded declaration one level deeper).
    why = bound[bound.index("// From V = 4 up, at most the registers") : bound.index(decl)]
    params = bound[bound.index(decl) + len(decl) : bound.index(") {", bound.index(decl)) + 3]
    unbound = bound.replace(why, "").replace(
        decl + params, "__global__ void " + params.strip().replace("\n    ", "\n")
    )
    assert unbound == plain
    with pytest.raises(UserError, match="cuda_min_blocks_per_sm needs"):
        render.RenderOptions(cuda_min_blocks_per_sm=4, cuda_x_staging="global")


def test_async_tail_option_keeps_the_step_order() -> None:
    """cuda_async_tail: the steps past the last full stage become one more, shorter stage of
    the cp.async pipeline; every step r = 0 .. steps - 1 is still computed once, in order,
    after its copy landed and a barrier, and no warp leaves before the last barrier. Only
    the async pipeline changes: the plain-copy path (below sm_80) is the default's."""
    plain, tail = _kernel("smem"), _kernel("smem", async_tail=True)
    code = re.sub(r"//[^\n]*", "", tail)
    impl = _between(code, "void qmv_streamed_kernel_impl(", "\n}\n")
    loop = _between(impl, "for (int i = 0; i < stages; ++i) {", "\n    }\n")
    _assert_in_order(
        loop,
        "cp_async_commit();",
        "cp_async_wait<1>();",
        "__syncthreads();",
        "compute_stage(buf, r0, full_stage{});",
        "compute_stage(buf + s * tile_words, r0 + s, one_step{});",
        "__syncthreads();\n    }",
    )
    # Full stages advance r0 by stage_steps, the tail stage by its own length: r0 ends at
    # steps, so the single-step loop after the pipeline (the plain path's) runs no step.
    assert "r0 += stage_steps;" in loop and "r0 += tail;" in loop
    assert "int tail = steps - full * stage_steps;" in impl
    assert "return (i < full ? stage_steps : tail) * elems_per_warp;" in impl
    # A step's slice of a stage buffer: x_slice(buf, s) == buf + s * tile_words + lane pitch.
    assert "return buf + s * tile_words + warp.thread_rank() * x_pitch;" in impl
    assert "for (; r0 < steps; ++r0) {" in impl
    # Barriers: async stages 2, sync stages 2, single steps 2, residue 1; one exit after them.
    barriers = [m.start() for m in re.finditer(r"__syncthreads\(\);", impl)]
    exits = [m.start() for m in re.finditer(r"\breturn;", impl)]
    assert len(barriers) == 7 and len(exits) == 1 and exits[0] > barriers[-1]
    # Everything outside the async pipeline is the default render's text.
    start, end = "if constexpr (async_x) {", "  } else {\n    for (; r0 + stage_steps"
    assert tail.split(start)[0] == plain.split(start)[0]
    assert tail.split(end)[1] == plain.split(end)[1]
    with pytest.raises(UserError, match="cuda_async_tail needs"):
        render.RenderOptions(cuda_async_tail=True, cuda_x_staging="global")


def test_x_staging_option() -> None:
    """A render option, default smem since the H200 runs, validated, and in the context."""
    assert render.RenderOptions().cuda_x_staging == "smem"
    glob = render.RenderOptions(cuda_x_staging="global")
    assert render.context(glob, {})["cuda_x_staging"] == "global"
    with pytest.raises(UserError, match="cuda_x_staging"):
        render.RenderOptions(cuda_x_staging="registers")  # type: ignore[arg-type]


@pytest.mark.parametrize("vecs", [(2, 3, 4, 5), (2, 4, 8), (8,)])  # lead's default, CUDA's, one V
def test_launcher_picks_smallest_v_holding_m(vecs: tuple[int, ...]) -> None:
    """Branches ascend; the largest V takes any larger M as several M tiles."""
    text = render.render_snippet(_plan(QMV), "streamed_launch.cu.j2", _ctx(vecs=vecs))
    branches = [int(v) for v in re.findall(r"if \(m <= (\d+)\)", text)]
    assert branches == list(vecs[:-1])
    tail = text.rstrip().rsplit("launch(", 1)[1]
    assert f"integral_constant<int, {vecs[-1]}>" in tail
    for m in range(1, 17):  # the harness mirrors the launcher's rule
        assert cuda.pick_vecs(m, vecs) == next((x for x in vecs if m <= x), vecs[-1])


def _kernel_nodes_per_call(qmv_cu: str) -> list[int]:
    """Per exit of ``qmv_streamed``, how many kernels that path launches.

    The body is read statement by statement: ``launch(...)`` (one kernel),
    ``qmv<...>(...)`` (stock's launcher: one kernel), and ``return;`` / the end close
    a path. Enough for the launcher's straight-line branches, which is all it has.
    """
    body = qmv_cu[qmv_cu.index("void qmv_streamed(") :]
    body = body[body.index("launch_kernel(") :]  # past the launch lambda's own call
    body = body[body.index("};") + 2 : body.index("\n}\n")]
    counts, open_path = [], 0
    for stmt in re.findall(r"\blaunch\(|\bqmv<[^>]*>\(|\breturn;", body):
        if stmt == "return;":
            counts.append(open_path)
            open_path = 0
        else:
            open_path += 1
    return [*counts, open_path]


def test_streamed_launcher_launches_several_kernels_only_in_the_concurrent_context() -> None:
    """MLX's CommandEncoder gives a CUDA graph node only the arrays registered since the
    node before it: a second kernel of the same call runs without dependencies unless the
    call holds the encoder's concurrent context (the `split` arm returned differing rows
    until it did). The shipped launcher's only path of several kernels is the split
    (``qmv_streamed_splits``: 4 + 2 + 1 at most), and the caller enters the concurrent
    context under the very same predicate, before the launcher runs. Control: without the
    split, every path launches one kernel and no context is taken."""
    shipped = (ROOT / "patches" / "9a795735" / "overlay" / QMV).read_text()
    assert _kernel_nodes_per_call(shipped) == [3, 1, 1]  # split, then V = 2, V = 4
    launcher = shipped[shipped.index("void qmv_streamed(") :]
    launcher = launcher[launcher.index("launch_kernel(") :]  # the launch lambda's own call
    after_lambda = launcher[launcher.index("};") + 2 :]
    assert after_lambda.lstrip().startswith(
        "if (qmv_streamed_splits(m, l, cute::sizeof_bits_v<Q>)) {"
    )
    caller = shipped[shipped.index("if (cu::use_qmv_streamed(m, n, k, l, bits)) {") :]
    caller = caller[: caller.index("cu::qmv_streamed<")]
    assert (
        "if (cu::qmv_streamed_splits(m, l, bits)) {\n              concurrent.emplace(encoder);"
        in caller
    )
    one_each = render.render_snippet(
        _plan(QMV), "streamed_launch.cu.j2", _ctx(staging="smem", split_tail=False)
    )
    assert _kernel_nodes_per_call(one_each) == [1, 1]  # m <= 2: V = 2; else V = 4
    assert "concurrent" not in one_each


CXX = shutil.which("g++") or shutil.which("clang++")
ROUTING_CASES = [
    (m, n, k, b, bits)
    for m, b, bits in itertools.product(range(1, 17), (1, 2), (2, 3, 4, 5, 6, 8))
    for n, k in ((1024, 1024), (4096, 4095), (4096, 4096), (8192, 28672))
]


def _compiled_routing(launch: str, signature: str, tmp_path: Path) -> dict[tuple, tuple]:
    """The rendered routing functions (everything before the qmv_streamed template) compiled
    on the host and run over ROUTING_CASES: per case, (use_qmv_streamed, splits)."""
    head = launch[: launch.index("template <")]
    splits = "qmv_streamed_splits(m, l, bits)" if "qmv_streamed_splits" in head else "false"
    src = tmp_path / "routing.cpp"
    src.write_text(
        "#include <cstdint>\n#include <cstdio>\n" + head
        + "int main() {\n  int m, n, k, l, bits;\n"
        + '  while (std::scanf("%d %d %d %d %d", &m, &n, &k, &l, &bits) == 5) {\n'
        + f'    std::printf("%d %d\\n", use_qmv_streamed({signature}), {splits});\n'
        + "  }\n}\n"
    )  # fmt: skip
    exe = tmp_path / "routing"
    subprocess.run([CXX, "-std=c++17", "-o", str(exe), str(src)], check=True)
    cases = "".join(" ".join(map(str, c)) + "\n" for c in ROUTING_CASES)
    out = subprocess.run([str(exe)], input=cases, capture_output=True, text=True, check=True)
    rows = [tuple(map(int, line.split())) for line in out.stdout.splitlines()]
    return {c: (bool(a), bool(z)) for c, (a, z) in zip(ROUTING_CASES, rows, strict=True)}


@pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (g++ or clang++)")
@pytest.mark.parametrize(("split", "floor"), [(False, 0), (True, 0), (True, 1 << 24)])
def test_compiled_routing_is_dispatchs_model(split: bool, floor: int, tmp_path: Path) -> None:
    """The rendered C++ routing, compiled and run, against dispatch.cuda_streams (what
    parity labels each row with) on every M, bit width, batch and a shape either side of
    the floor; the floor keeps M = 2..7 of a small layer on the per-vector kernel, never
    M >= 8 of the exact route; 4-bit M = 7 is never split."""
    ctx = _ctx(staging="smem", split_tail=split, min_weights=floor)
    launch = render.render_snippet(_plan(QMV), "streamed_launch.cu.j2", ctx)
    route = render.render_snippet(_plan(QMV), "streamed_route.cu.j2", ctx)
    signature = "m, n, k, l, bits" if split else "m, bits"
    assert f"if (cu::use_qmv_streamed({signature})) {{" in route
    table = _compiled_routing(launch, signature, tmp_path)
    opts = render.RenderOptions(cuda_split_tail=split, cuda_stream_min_weights=floor)
    for (m, n, k, b, bits), (streams, splits) in table.items():
        assert streams == dispatch.cuda_streams(m, bits, k, n, b, opts), (m, n, k, b, bits)
        assert splits == (split and dispatch.cuda_splits(m, b, bits)), (m, n, k, b, bits)
        if floor and 2 <= m < 8 and n * k < floor:
            assert not streams
        if m >= 8:
            assert streams
    if split:
        assert table[(7, 8192, 28672, 1, 4)] == (True, False)
        assert table[(7, 8192, 28672, 1, 8)] == (True, True)
        assert table[(6, 8192, 28672, 2, 8)] == (False, False)  # B > 1: not split, not streamed
    if floor:
        assert table[(4, 1024, 1024, 1, 4)] == (False, False)
        assert table[(4, 4096, 4096, 1, 4)][0]  # 2**24 weights: at the floor, streams
        assert not table[(4, 4096, 4095, 1, 4)][0]  # one column fewer: below it


def test_split_tail_option() -> None:
    """cuda_split_tail: M = 5..7 of one batch run as V = 4 + V = 2 + per-vector passes, the
    route holds MLX's concurrent context around exactly those calls; off (the default)
    renders none of it. Only with the smem kernel and the streaming routing."""
    ctx = _ctx(staging="smem", split_tail=True)
    launch = render.render_snippet(_plan(QMV), "streamed_launch.cu.j2", ctx)
    route = render.render_snippet(_plan(QMV), "streamed_route.cu.j2", ctx)
    head = _between(launch, "void qmv_streamed(", "if (m <= 2) {")
    assert "if (qmv_streamed_splits(m, l, cute::sizeof_bits_v<Q>)) {" in head
    assert "qmv<group_size, has_bias>(" in head  # the per-vector launcher for the last one
    guard = _between(route, "if (cu::use_qmv_streamed(m, n, k, l, bits)) {", "cu::qmv_streamed<")
    assert (
        "if (cu::qmv_streamed_splits(m, l, bits)) {\n              concurrent.emplace(encoder);"
        in (guard)
    )
    plain = _ctx(staging="smem")
    for name in ("streamed_launch.cu.j2", "streamed_route.cu.j2"):
        assert "qmv_streamed_splits" not in render.render_snippet(_plan(QMV), name, plain)
    assert render.context(render.RenderOptions(cuda_split_tail=True), {})["cuda_split_tail"]
    with pytest.raises(UserError, match="cuda_split_tail needs"):
        render.RenderOptions(cuda_split_tail=True, cuda_x_staging="global")
    with pytest.raises(UserError, match="cuda_stream_min_weights needs"):
        render.RenderOptions(cuda_stream_min_weights=1, routing="opt_in")
    # The floor is the split's: without it there is no floor, set or unset.
    with pytest.raises(UserError, match="cuda_stream_min_weights needs cuda_split_tail"):
        render.RenderOptions(cuda_split_tail=False, cuda_stream_min_weights=1 << 24)
    assert render.RenderOptions(cuda_split_tail=False).stream_min_weights == 0
    assert render.RenderOptions(cuda_x_staging="global").stream_min_weights == 0
    assert render.RenderOptions().stream_min_weights == render.CUDA_STREAM_MIN_WEIGHTS


def test_rows_per_warp_option() -> None:
    """cuda_rows_per_warp = 1: the launcher's one constant (8 warps per block of 8 rows);
    2, the default, renders the shipped text; anything else, or without smem, is refused."""
    launch = {
        r: render.render_snippet(
            _plan(QMV), "streamed_launch.cu.j2", _ctx(staging="smem", rows_per_warp=r)
        )
        for r in (1, 2)
    }
    assert "constexpr int rows_per_warp = 2;" in launch[2] and "4 warps of 2 rows" in launch[2]
    assert "constexpr int rows_per_warp = 1;" in launch[1] and "8 warps of 1 row," in launch[1]
    differing = [
        (a, b) for a, b in zip(launch[1].splitlines(), launch[2].splitlines(), strict=True)
        if a != b
    ]  # fmt: skip
    assert len(differing) == 2  # a comment line and the constant
    for bad in ({"cuda_rows_per_warp": 4}, {"cuda_rows_per_warp": 1, "cuda_x_staging": "global"}):
        with pytest.raises(UserError, match="cuda_rows_per_warp"):
            render.RenderOptions(**bad)


@pytest.mark.parametrize("routing", ["stream", "opt_in"])
def test_routing_snippets(routing: str) -> None:
    """opt_in reads MLX_CUDA_QMV_STREAMED in both files. stream streams the M that
    reach qmv where that was measured faster (same numbers either way) and extends qmv
    to M <= 16 (exact rows at 2.5-4.6x qmm's cost, measured) only under
    MLX_CUDA_QMV_EXACT; dispatch.cuda_streams mirrors the launcher's rule."""
    launch = render.render_snippet(_plan(QMV), "streamed_launch.cu.j2", _ctx(routing))
    route = render.render_snippet(_plan(QCPP), "streamed_route.cpp.j2", _ctx(routing))
    for text in (launch, route):
        assert ("MLX_CUDA_QMV_STREAMED" in text) == (routing == "opt_in")
    assert ("MLX_CUDA_QMV_EXACT" in route) == (routing == "stream")
    assert "MLX_CUDA_QMV_EXACT" not in launch
    assert "bool m1_runs_qmv = qmv_streamed_exact &&" in route
    # Streams only where M = 1 of the same rows would run qmv.
    assert "B == 1 && N <= 16384 && K <= 16384" in route and "(B < 8)" in route
    assert "!can_use_fp_qmv && M >= 2 && M <= 16" in route
    # The stream rule itself: test_compiled_routing_is_dispatchs_model.


def test_harness_bodies_and_grids() -> None:
    """Bodies instantiate what qmv would; grids are in threads, as cuda_kernel wants."""
    cfg = cuda.Config(4160, 4096, 4, 64, "bfloat16")
    assert cfg.elems_per_thread == 16 and cfg.has_residue_k  # 4160 % 512 == 64: the K tail
    assert "qmv_streamed_kernel_body<8, 8, 16, 64, true, true, T, Q, S>" in cuda.streamed_body(
        cfg, 8
    )
    assert "qmv_kernel_jit<8, 16, 64, true, true, T, Q, S>" in cuda.m1_body(cfg)
    assert cuda.streamed_grid(cfg, 16, 8) == ((32 * 512 * 2, 8, 1), (32, 8, 1))
    assert cuda.m1_grid(cfg, 3) == ((32 * 512, 24, 1), (32, 8, 1))
    assert not cuda.Config(8192, 28672, 8, 64, "float16").has_residue_k
    # Either header takes the same body; rows per block is a template argument and the grid's y.
    assert "qmv_streamed_kernel_body<5, 16, 16, 64, true, true, T, Q, S>" in cuda.streamed_body(
        cfg, 5, 16
    )
    assert cuda.streamed_grid(cfg, 16, 8, 16) == ((32 * 256 * 2, 16, 1), (32, 16, 1))
    assert cuda.streamed_grid(cuda.Config(4160, 4100, 4, 64, "bfloat16"), 5, 5, 16)[0][0] == (
        32 * 257
    )  # N % 16 != 0: the last block has warps past n
    # Bare V sets stay the default arm; kernel names keep the old form for it.
    assert cuda.as_arm((2, 4)) == cuda.Arm((2, 4), "global", 8)
    assert cuda.kernel_name("global", cfg, 4, 8) == f"qmv_streamed_v4_{cfg.tag}"
    assert cuda.kernel_name("smem", cfg, 4, 16) == f"qmv_streamed_smem_v4_r16_{cfg.tag}"
    one_step = cuda.Knobs(stage_steps=1)
    assert cuda.kernel_name("smem", cfg, 4, 8, one_step) == f"qmv_streamed_smem_v4_r8_s1_{cfg.tag}"
    shipped = cuda.kernel_name("smem", cfg, 4, 8, cuda.SHIPPED_KNOBS)
    assert shipped == f"qmv_streamed_smem_v4_r8_w2_pf_async_{cfg.tag}"
    # The smem body's trailing knobs are passed only up to the last non-default one,
    # in the order the body declares them: max_stage_steps, rows_per_warp, prefetch, async.
    assert "<5, 8, 16, 64, true, true, T, Q, S, 1>(" in cuda.streamed_body(cfg, 5, 8, one_step)
    assert "T, Q, S>(" in cuda.streamed_body(cfg, 5, 8)
    assert "T, Q, S, 4, 2, true, true>(" in cuda.streamed_body(cfg, 4, 8, cuda.SHIPPED_KNOBS)
    assert "T, Q, S, 4, 1, true>(" in cuda.streamed_body(cfg, 4, 8, cuda.Knobs(l2_prefetch=True))
    assert set(cuda.HEADER_NAMES) == {"global", "smem"}
    assert cuda.HEADER_NAME == cuda.HEADER_NAMES["global"] == "qmv_jit_header.cuh"


def test_ptxas_usage_parses_registers_smem_and_spills() -> None:
    log = (
        "ptxas info    : Compiling entry function '_Z3fooPKt' for 'sm_90a'\n"
        "ptxas info    : Function properties for _Z3fooPKt\n"
        "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 80 registers, used 1 barriers, 23040 bytes smem, 392 bytes cmem[0]\n"
    )
    assert cuda.ptxas_usage(log) == {"_Z3fooPKt": {"registers": 80, "smem": 23040, "spill": 12}}


# ------------------------------------------------------- against the pinned text

needs_clone = pytest.mark.skipif(
    mlx_clone() is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)


@pytest.fixture(scope="module")
def upstream() -> dict[str, str]:
    clone = source.ensure_clone(mlx_clone())
    read = source.reader(clone, PIN)
    return {QMV: read(QMV), QCPP: read(QCPP), "clone": str(clone), "read": read}


@needs_clone
@pytest.mark.clone
def test_derived_dequant_fma_moves_only_the_per_vector_statements(upstream: dict[str, str]) -> None:
    """Upstream's fma statement appears verbatim inside the loop, once per overload."""
    plan = _plan(QMV)
    for d in plan.derives:
        text = render.derive(upstream[QMV], d)
        loop = text[text.index("for (int v = 0; v < V; ++v)") :]
        assert re.search(r"\*out_vec = cutlass::fma\((x_vec, w_dq|x_f, w_f), \*out_vec\);", loop)
        assert "auto x_vec = *(reinterpret_cast<const cutlass::Array<T, N>*>(x));" in loop
        head = text[: text.index("for (int v = 0; v < V; ++v)")]
        assert "converter_tq(w_vec)" in head and "x_vec" not in head.split("Read x/w")[1]


@needs_clone
@pytest.mark.clone
@pytest.mark.parametrize("staging", ["global", "smem"])
@pytest.mark.parametrize("routing", ["stream", "opt_in"])
def test_harness_measures_what_is_patched(
    upstream: dict[str, str], routing: str, staging: str
) -> None:
    """The JIT header's streamed kernel is a verbatim substring of the patched qmv.cu."""
    options = render.RenderOptions(backends=("cuda",), routing=routing, cuda_x_staging=staging)
    patched = render.render_file(_plan(QMV), upstream[QMV], options)
    snippet = cuda.streamed_kernel_text(upstream[QMV], options)
    header = cuda.jit_header(upstream[QMV], options, upstream["read"])
    assert snippet in patched
    assert snippet in header
    assert ("__syncthreads();" in patched) == (staging == "smem")
    # The M = 1 arm is upstream's kernel, only made callable from a cuda_kernel body.
    assert "__device__ __forceinline__ void qmv_kernel_jit(" in header
    # The smem kernel's cp.async helpers: MLX's own, inlined (its JIT embeds only device/).
    assert ("void cp_async_commit()" in header) == (staging == "smem")
    assert '#include "mlx/backend/cuda/steel/' not in header
    if staging == "smem":
        assert '#include "mlx/backend/cuda/steel/utils.cuh"' in patched
        with pytest.raises(ValueError, match="steel"):
            cuda.jit_header(upstream[QMV], options)


@needs_clone
@pytest.mark.clone
def test_smem_staging_changes_only_the_streamed_kernel(
    upstream: dict[str, str], tmp_path: Path
) -> None:
    """The smem render (the default) differs from global only inside our snippets, and
    build_bundle writes each under its own name. Without the split, which only smem can
    run (it changes the routing site too)."""
    base = render.RenderOptions(backends=("cuda",), cuda_x_staging="global")
    smem = render.RenderOptions(backends=("cuda",), cuda_split_tail=False)
    a = render.render_file(_plan(QMV), upstream[QMV], base)
    b = render.render_file(_plan(QMV), upstream[QMV], smem)
    head = a[: a.index("// Streamed qmv: one warp per output row")]
    # Upstream text and the derived dequant_fma_streamed; smem adds MLX's cp.async helpers.
    steel = '#include "mlx/backend/cuda/steel/utils.cuh"\n\n'
    assert b.replace(steel, "", 1).startswith(head) and steel in b and steel not in a
    assert a[a.index("} // namespace cu") :] == b[b.index("} // namespace cu") :]
    paths = {
        cuda.build_bundle(upstream[QMV], tmp_path, o, upstream["read"]).name for o in (base, smem)
    }
    assert paths == set(cuda.HEADER_NAMES.values())


@needs_clone
@pytest.mark.clone
@pytest.mark.skipif(clang_format() is None, reason=f"needs clang-format {CLANG_FORMAT_VERSION}")
@pytest.mark.parametrize(
    "options",
    [
        render.RenderOptions(backends=("cuda",), cuda_x_staging="global"),
        render.RenderOptions(backends=("cuda",), cuda_split_tail=True),
        render.RenderOptions(backends=("cuda",), cuda_async_tail=True),
        render.RenderOptions(backends=("cuda",), cuda_split_tail=True, cuda_async_tail=True),
        render.RenderOptions(
            backends=("cuda",), cuda_split_tail=True, cuda_stream_min_weights=1 << 24
        ),
        render.RenderOptions(backends=("cuda",), cuda_rows_per_warp=1),
        render.RenderOptions(backends=("cuda",), cuda_min_blocks_per_sm=4),
    ],
    ids=["global", "split_tail", "async_tail", "both", "split_floor", "rows1", "bounds"],
)
def test_other_renders_are_clang_format_clean(
    upstream: dict[str, str], tmp_path: Path, options: render.RenderOptions
) -> None:
    """The lines a non-default render adds are clang-format clean under MLX's config.

    (tests/test_format.py checks the default render, smem, through patches/.)
    """
    patched = render.render_file(_plan(QMV), upstream[QMV], options)
    config = source.reader(Path(upstream["clone"]), PIN)(".clang-format")
    (tmp_path / ".clang-format").write_text(config)
    path = tmp_path / "qmv.cu"
    path.write_text(patched)
    old, new = upstream[QMV].splitlines(), patched.splitlines()
    ranges = [
        f"--lines={j1 + 1}:{j2}"
        for op, _, _, j1, j2 in difflib.SequenceMatcher(None, old, new).get_opcodes()
        if op in ("insert", "replace")
    ]
    assert ranges
    proc = subprocess.run(
        [clang_format(), f"--style=file:{tmp_path / '.clang-format'}", *ranges, str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    diff = "".join(difflib.unified_diff(patched.splitlines(True), proc.stdout.splitlines(True)))
    assert proc.stdout == patched, diff[:4000]


# ------------------------------------------------------------- nvcc compile check

WHEEL_ENV = "PATCHKIT_MLX_CUDA_WHEEL"  # path to mlx_cuda_13-0.32.1-*.whl (ships include/)
FMT_SHIM = """#pragma once
#include <string>
// Compile check only: the wheel ships no fmt; host error strings need not format.
namespace fmt {
template <typename... A>
std::string format(const char* f, A&&...) { return f; }
}
"""


def _wheel_include(tmp: Path) -> Path | None:
    whl = os.environ.get(WHEEL_ENV)
    if not whl or not Path(whl).is_file():
        return None
    with zipfile.ZipFile(whl) as z:
        members = [n for n in z.namelist() if n.startswith("mlx/include/")]
        z.extractall(tmp / "wheel", members)
    return tmp / "wheel" / "mlx" / "include"


def _pinned_cuh(upstream: dict[str, str], src: Path) -> None:
    """The .cuh files the wheel does not ship, from the pinned clone, under ``src``."""
    read = source.reader(Path(upstream["clone"]), PIN)
    entries = git.ls_tree(Path(upstream["clone"]), PIN, ["mlx/backend/cuda/device/"])
    listing = [e.path for e in entries]
    for rel in [*listing, "mlx/backend/cuda/kernel_utils.cuh"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(read(rel))


def _nvcc_includes(upstream: dict[str, str], tmp_path: Path) -> tuple[Path, Path]:
    """(wheel include dir, pin's .cuh dir) for an nvcc check; skips without the wheel."""
    inc = _wheel_include(tmp_path)
    if inc is None:
        pytest.skip(f"set {WHEEL_ENV} to the mlx-cuda-13 0.32.1 wheel file")
    src = tmp_path / "src"
    _pinned_cuh(upstream, src)
    return inc, src


def _no_streamed_spills(log: str) -> dict[str, dict[str, int]]:
    usage = {k: v for k, v in cuda.ptxas_usage(log).items() if "streamed" in k}
    assert usage, log[-2000:]
    spilling = {k: v for k, v in usage.items() if v["spill"]}
    assert not spilling, spilling
    return usage


@needs_clone
@pytest.mark.clone
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("staging", ["global", "smem"])
def test_patched_qmv_compiles_for_sm90(
    upstream: dict[str, str], tmp_path: Path, staging: str
) -> None:
    """nvcc -c of the patched qmv.cu against the wheel's headers plus the pin's .cuh files.

    The wheel ships cutlass/cute/cccl and MLX's .h headers but none of the .cuh
    files qmv.cu includes (device/*.cuh, kernel_utils.cuh) and no fmt; those come
    from the pinned clone and a two-line shim. Slow (all instantiations): ~minutes
    per x-staging variant. No qmv_streamed_kernel instantiation may spill.
    """
    inc, src = _nvcc_includes(upstream, tmp_path)
    (tmp_path / "fmt").mkdir()
    (tmp_path / "fmt" / "format.h").write_text(FMT_SHIM)
    patched = tmp_path / "qmv.cu"
    options = render.RenderOptions(backends=("cuda",), cuda_x_staging=staging)
    patched.write_text(render.render_file(_plan(QMV), upstream[QMV], options))
    cmd = [
        "nvcc",
        "-std=c++20",
        "-arch=sm_90a",
        "-c",
        str(patched),
        "-o",
        str(tmp_path / "qmv.o"),
        f"-I{src}",
        f"-I{tmp_path}",
        f"-I{inc}",
        f"-I{inc / 'cccl'}",
        "--expt-relaxed-constexpr",
        "--extended-lambda",
        "-Xptxas",
        "-v",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _no_streamed_spills(proc.stdout + proc.stderr)


@needs_clone
@pytest.mark.clone
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("staging", ["global", "smem"])
def test_jit_header_compiles_for_sm90(
    upstream: dict[str, str], tmp_path: Path, staging: str
) -> None:
    """The JIT bundle header, wrapped as cuda_kernel wraps a body, compiles with nvcc.

    V = 2..5 at 8 and 16 rows per block, 4/8-bit bf16 and the 4160 K tail in fp16.
    Prints ptxas's registers / shared bytes per instance (``pytest -s``); none spills.
    """
    inc, src = _nvcc_includes(upstream, tmp_path)
    options = render.RenderOptions(cuda_x_staging=staging)
    header = cuda.jit_header(upstream[QMV], options, upstream["read"])
    configs = [
        cuda.Config(8192, 28672, 4, 64, "bfloat16"),
        cuda.Config(8192, 28672, 8, 64, "bfloat16"),
        cuda.Config(4160, 4096, 4, 64, "float16"),
    ]
    instances: list[cuda.Instance] = [
        (c, v, r, cuda.Knobs()) for c in configs for r in (8, 16) for v in (2, 3, 4, 5)
    ]
    if staging == "smem":  # the one-k-step-per-stage arm, and the shape the patch launches
        one_step = cuda.Knobs(stage_steps=1)
        instances += [(c, v, 8, one_step) for c in configs for v in (2, 3, 4, 5)]
        instances += [(c, v, 8, cuda.SHIPPED_KNOBS) for c in configs for v in (2, 4)]
    tu = tmp_path / "jit.cu"
    tu.write_text(cuda.nvcc_source(header, instances))
    cmd = [
        "nvcc",
        "-std=c++20",
        "-arch=sm_90a",
        "-cubin",
        str(tu),
        "-o",
        str(tmp_path / "jit.cubin"),
        f"-I{src}",
        f"-I{inc}",
        f"-I{inc / 'cccl'}",
        "--expt-relaxed-constexpr",
        "-Xptxas",
        "-v",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    usage = _no_streamed_spills(proc.stdout + proc.stderr)
    assert len(usage) == len(instances)
    for name, u in sorted(usage.items()):
        print(staging, re.search(r"streamed_\w+?_v\d+_r\d+\w*?(?=E|$)", name).group(0), u)  # type: ignore[union-attr]
        assert (u["smem"] > 0) == (staging == "smem")
        assert u["smem"] <= 48 * 1024  # static shared memory: no opt-in launch attribute needed


# ------------------------------------- the GPU half, with a CPU stand-in kernel


class _StandInKernels(cuda.Kernels):
    """cuda_kernel's place taken by MLX's CPU quantized_matmul, one row at a time.

    Exercises the harness's control flow (arms, variants, kernel names, grids,
    JSON shape, the report) on a machine without a GPU. The ``smem`` stand-in
    leaves the last row of every M >= 2 launch unwritten (the launch's fill value
    stays), so the parity verdict has a known number of differing rows to find.
    """

    fills: ClassVar[list[object]] = []  # init_value of every launch, in order

    def get(self, name: str, body: str) -> object:
        mx = pytest.importorskip("mlx.core")
        self._cache[name] = body

        def kern(inputs: list, output_shapes: list, **launch: object) -> list:
            x, wq, s, b, _ = inputs
            k = x.shape[-1]
            bits, gs = wq.shape[-1] * 32 // k, k // s.shape[-1]
            rows = [
                mx.quantized_matmul(x[i : i + 1], wq, s, b, group_size=gs, bits=bits)
                for i in range(x.shape[0])
            ]
            if self.variant == "smem" and len(rows) >= 2:
                fill = launch["init_value"]
                rows[-1] = mx.full(rows[-1].shape, 0.0 if fill is None else fill, x.dtype)
            assert launch["threadgroup"][1] in (4, 8, 16)  # type: ignore[index]
            self.fills.append(launch["init_value"])
            return [mx.concatenate(rows)]

        return kern


def _script(name: str) -> object:
    return load_script(f"scripts/{name}.py")


def test_both_variants_run_through_the_harness_and_report(tmp_path: Path) -> None:
    """cuda_h200.py --variant both's arms, on a tiny config, through run_config and the report."""
    pytest.importorskip("mlx.core")
    h200 = _script("cuda_h200")
    report = _script("cuda_report")
    parity_sets, timing_sets = h200.ARMS["both"]  # type: ignore[attr-defined]
    smem_arms = {k for k, a in parity_sets.items() if isinstance(a, cuda.Arm)}
    assert {a.variant for a in parity_sets.values() if isinstance(a, cuda.Arm)} == {"smem"}
    assert h200.RAGGED in [c for c, _ in h200.plan("both")]  # type: ignore[attr-defined]
    assert h200.RAGGED not in [c for c, _ in h200.plan()]  # type: ignore[attr-defined]
    kernels = {v: _StandInKernels("", v) for v in ("global", "smem")}
    cfg = cuda.Config(512, 72, 4, 64, "bfloat16")
    _StandInKernels.fills = []
    res = cuda.run_config(kernels, cfg, parity_sets, timing_sets, ms=(1, 2, 5), iters=1)
    # Parity launches pre-fill with NaN (an unwritten element fails); timed ones do not.
    fills = _StandInKernels.fills
    assert any(f is None for f in fills) and any(f != f for f in fills if f is not None)
    first_timed = fills.index(None)
    assert all(f is not None for f in fills[:first_timed])
    assert all(f is None for f in fills[first_timed:])
    # The global stand-in writes M = 1's rows; the smem one leaves one row unwritten per
    # M in 2..16, and the NaN fill makes each of those a differing row.
    expected = {f"streamed_{k}": 15 if k in smem_arms else 0 for k in parity_sets}
    assert cuda.verdict(res)["streamed_rows_differing"] == expected
    assert set(expected.values()) == {0, 15}
    assert "qmv_streamed_smem_v4_r8_w2_pf_async_bfloat16_b4_g64_r0" in kernels["smem"]._cache
    assert "qmv_streamed_v5_bfloat16_b4_g64_r0" in kernels["global"]._cache
    payload = {"variant": "both", "results": [res]}
    cuda.dump(tmp_path / "run.json", payload)
    loaded = json.loads((tmp_path / "run.json").read_text())["results"]
    shipped = report.ARM_NAMES[report.SHIPPED]  # type: ignore[attr-defined]
    assert shipped in report.parity_table(loaded)[0]  # type: ignore[attr-defined]
    table = report.comparison_table(loaded[0])  # type: ignore[attr-defined]
    assert table[-1].startswith("| us per added vector (M=1..5) |")
    assert f"{shipped} us" in table[2]
    assert f"Streamed arm: {shipped}." in report.timing_table(loaded[0])  # type: ignore[attr-defined]


class _FailingKernels(cuda.Kernels):
    def get(self, name: str, body: str) -> object:
        raise RuntimeError(f"nvrtc: {name}")


def test_cuda_h200_both_falls_back_to_global_arms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--variant both: an smem failure is recorded, and the global arms still run."""
    pytest.importorskip("mlx.core")
    h200 = _script("cuda_h200")
    tiny = cuda.Config(512, 72, 4, 64, "bfloat16")

    class Kernels(cuda.Kernels):  # what cuda_h200.py constructs: a stand-in per variant
        def __new__(cls, header: str, variant: str = "global") -> cuda.Kernels:  # type: ignore[misc]
            return (_FailingKernels if variant == "smem" else _StandInKernels)(header, variant)

    monkeypatch.setattr(h200.cuda, "Kernels", Kernels)  # type: ignore[attr-defined]
    monkeypatch.setattr(h200, "plan", lambda variant="global": [(tiny, False), (tiny, False)])
    monkeypatch.setattr(h200, "environment", lambda: {})
    for name in cuda.HEADER_NAMES.values():
        (tmp_path / name).write_text("// header\n")
    argv = ["cuda_h200.py", "--header", str(tmp_path / cuda.HEADER_NAME), "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", [*argv, "--variant", "both"])
    h200.main()  # type: ignore[attr-defined]
    out = json.loads((tmp_path / "cuda_h200.json").read_text())
    assert out["variant"] == "both" and len(out["errors"]) == 1
    assert [list(r["parity"]) for r in out["results"]] == [
        ["jit_m1_copy", "batched_control", "streamed_render"]
    ] * 2
    monkeypatch.setattr("sys.argv", [*argv, "--variant", "smem"])
    with pytest.raises(RuntimeError, match="nvrtc"):
        h200.main()  # type: ignore[attr-defined]
