"""CUDA templates and the CUDA JIT harness, on a machine without a GPU or MLX.

Three layers, cheapest first:
* snippets rendered through Jinja with an explicit context (no upstream text);
* against the pinned upstream text (needs a clone; skips saying so): the derived
  ``dequant_fma_streamed`` keeps upstream's statements, and the harness's JIT
  header holds the streamed kernel byte for byte as the patch inserts it;
* ``nvcc -c`` of the patched ``qmv.cu`` for sm_90 (needs nvcc, a clone and the
  mlx-cuda-13 wheel's headers; skips saying which is missing).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from support_git import mlx_clone

from patchkit import render, source
from patchkit.harness import cuda

PIN = "9a795735ad9a42664e08f42361b405ed570bcf1a"
QMV = "mlx/backend/cuda/quantized/qmm/qmv.cu"
QCPP = "mlx/backend/cuda/quantized/quantized.cpp"


def _plan(path: str) -> render.FilePlan:
    return next(p for p in render.load_plans() if p.path == path)


def _ctx(routing: str = "stream", vecs: tuple[int, ...] = (2, 4, 8), **derived: str) -> dict:
    return {"flavour": "upstream", "routing": routing, "vecs": list(vecs), **derived}


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


@pytest.mark.parametrize("routing", ["stream", "opt_in"])
def test_routing_snippets(routing: str) -> None:
    """opt_in reads MLX_CUDA_QMV_STREAMED in both files. stream streams every M that
    reaches qmv unconditionally (same numbers, faster) and extends qmv to M <= 16
    (exact rows at ~8x qmm's cost, measured) only under MLX_CUDA_QMV_EXACT."""
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


# ------------------------------------------------------- against the pinned text

needs_clone = pytest.mark.skipif(
    mlx_clone() is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)


@pytest.fixture(scope="module")
def upstream() -> dict[str, str]:
    clone = source.ensure_clone(mlx_clone())
    read = source.reader(clone, PIN)
    return {QMV: read(QMV), QCPP: read(QCPP), "clone": str(clone)}


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
@pytest.mark.parametrize("routing", ["stream", "opt_in"])
def test_harness_measures_what_is_patched(upstream: dict[str, str], routing: str) -> None:
    """The JIT header's streamed kernel is a verbatim substring of the patched qmv.cu."""
    options = render.RenderOptions(backends=("cuda",), routing=routing)
    patched = render.render_file(_plan(QMV), upstream[QMV], options)
    snippet = cuda.streamed_kernel_text(upstream[QMV], options)
    assert snippet in patched
    assert snippet in cuda.jit_header(upstream[QMV], options)
    # The M = 1 arm is upstream's kernel, only made callable from a cuda_kernel body.
    assert "__device__ __forceinline__ void qmv_kernel_jit(" in cuda.jit_header(upstream[QMV])


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


@needs_clone
@pytest.mark.clone
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_patched_qmv_compiles_for_sm90(upstream: dict[str, str], tmp_path: Path) -> None:
    """nvcc -c of the patched qmv.cu against the wheel's headers plus the pin's .cuh files.

    The wheel ships cutlass/cute/cccl and MLX's .h headers but none of the .cuh
    files qmv.cu includes (device/*.cuh, kernel_utils.cuh) and no fmt; those come
    from the pinned clone and a two-line shim. Slow (all instantiations): ~minutes.
    """
    inc = _wheel_include(tmp_path)
    if inc is None:
        pytest.skip(f"set {WHEEL_ENV} to the mlx-cuda-13 0.32.1 wheel file")
    src = tmp_path / "src"
    read = source.reader(Path(upstream["clone"]), PIN)
    listing = subprocess.run(
        ["git", "-C", upstream["clone"], "ls-tree", "--name-only", PIN, "mlx/backend/cuda/device/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for rel in [*listing, "mlx/backend/cuda/kernel_utils.cuh"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(read(rel))
    (tmp_path / "fmt").mkdir()
    (tmp_path / "fmt" / "format.h").write_text(FMT_SHIM)
    patched = tmp_path / "qmv.cu"
    options = render.RenderOptions(backends=("cuda",))
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
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
