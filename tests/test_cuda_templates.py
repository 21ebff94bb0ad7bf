"""The CUDA templates, rendered against the pin: one body, knobs in the overlay only.

Fast tests on the rendered text (no GPU, no nvcc); the PTX identity of the
one-vector kernels is ``test_cuda_ptx_identity.py``, the compile for every wheel
architecture ``test_cuda_arch_compile.py``, rows and timing on a GPU
``bench/cuda_qmv.py`` (``docs/results/cuda.md``).
"""

from __future__ import annotations

import itertools
import re

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import cxx, render, source
from patchkit.verify.harness import cuda

QMV = cuda.QMV_PATH
QUANTIZED = "mlx/backend/cuda/quantized/quantized.cpp"

pytestmark = [
    pytest.mark.clone,
    pytest.mark.skipif(
        mlx_clone() is None,
        reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
    ),
]


@pytest.fixture(scope="module")
def renders() -> dict[tuple[str, str], str]:
    """(path, flavour) -> text, and (path, "stock") -> the pin's text."""
    read = source.reader(source.ensure_clone(mlx_clone()), PIN_SHA)
    plans = {p.path: p for p in render.load_plans()}
    out = {}
    for path in (QMV, QUANTIZED):
        out[path, "stock"] = read(path)
        for flavour in ("upstream", "overlay"):
            opts = render.RenderOptions(backends=("cuda",), flavour=flavour)
            out[path, flavour] = render.render_file(plans[path], read(path), opts)
    return out


def test_upstream_render_has_no_environment_variable(renders: dict) -> None:
    """The PR's qmv.cu reads no environment; quantized.cpp is not touched at all."""
    assert "get_var" not in renders[QMV, "upstream"]
    assert "getenv" not in renders[QMV, "upstream"]
    assert renders[QUANTIZED, "upstream"] == renders[QUANTIZED, "stock"]


def test_overlay_has_both_downstream_knobs(renders: dict) -> None:
    """The overlay adds the off switch (qmv.cu) and the exact-at-M >= 8 route (quantized.cpp)."""
    assert 'env::get_var("MLX_CUDA_QMV_SHARED_WEIGHTS", 1)' in renders[QMV, "overlay"]
    assert 'env::get_var("MLX_CUDA_QMV_EXACT", 0)' in renders[QUANTIZED, "overlay"]
    # Only the knob and its include differ (blank lines and braces aside).
    up, ov = renders[QMV, "upstream"], renders[QMV, "overlay"]
    extra = [ln for ln in ov.splitlines() if ln not in up.splitlines()]
    assert len(extra) == 5 and extra[0] == '#include "mlx/utils.h"'


def test_one_body_no_copy_no_inline_asm(renders: dict) -> None:
    """dequant_fma is upstream's, untouched; no function is added beside the kernels; no asm."""
    stock, patched = renders[QMV, "stock"], renders[QMV, "upstream"]
    for index in (0, 1):
        assert cxx.find_function(patched, "dequant_fma", index).text(patched) == cxx.find_function(
            stock, "dequant_fma", index
        ).text(stock)
    assert "asm" not in patched.replace("asm", "", stock.count("asm"))
    assert "streamed" not in patched
    assert patched.count("__global__") == stock.count("__global__")
    assert "vecs_per_block" in cxx.find_function(patched, "qmv_kernel_impl").text(patched)


def test_each_vector_keeps_the_single_vector_order(renders: dict) -> None:
    """Per vector: the same dequant_fma call into its own sums, the same reduce."""
    impl = cxx.find_function(renders[QMV, "upstream"], "qmv_kernel_impl")
    text = impl.text(renders[QMV, "upstream"])
    assert "Acc sums[vecs_per_block][elems_per_thread] = {};" in text
    assert "x + v * k + idx, w + w_step(idx), scale, bias, sums[v]" in text
    assert "sum = cg::reduce(warp, sum, cg::plus<float>{});" in text
    assert "out[v * n + row] = static_cast<T>(sum);" in text


def _template_routing(text: str) -> tuple[int, int]:
    """(floor in weights, largest vectors per block) as qmv_vecs_per_block renders them."""
    fn = cxx.find_function(text, "qmv_vecs_per_block").text(text)
    floor = re.search(r"\* k >= \(1 << (\d+)\)", fn)
    cap = re.search(r"cuda::std::min\((\d+),", fn)
    assert floor and cap, fn
    return 1 << int(floor.group(1)), int(cap.group(1))


def test_harness_route_is_the_templates(renders: dict) -> None:
    """The harness times what the routing launches: its Python mirror agrees with the C++."""
    floor, cap = _template_routing(renders[QMV, "upstream"])
    assert cap == 4 and floor == 1 << 23
    for m, (k, n), bits in itertools.product(range(1, 8), cuda.SHAPES, (4, 8)):
        cfg = cuda.Config(k, n, bits)
        plan = cuda.route(m, cfg)
        assert sum(count for _, count in plan) == m
        shared = bits == 8 and n * k >= floor and m >= 2
        assert all(v > 1 for v, _ in plan) == shared, (m, k, n, bits, plan)
        assert all(v <= cap for v, _ in plan)
    # A batch takes all its vectors in one launch (M * B < 8 leaves M <= 3 there).
    assert cuda.route(3, cuda.Config(4096, 4096, 8), batch=2) == ((3, 3),)


def test_wrapper_instantiates_every_plan() -> None:
    """The harness library holds every vectors-per-block value a candidate plan uses."""
    used = {v for plans in cuda.candidate_plans().values() for p in plans for v, _ in p}
    assert used <= set(cuda.VECS)
    src = cuda.wrapper_source("patched", cuda.VECS)
    assert src.count("&launch<") == len(cuda.DTYPES) * len(cuda.QTYPES) * len(cuda.GROUPS) * 7
    assert "mlx::core::cu::qmv<vecs, group_size, true>" in src
    assert "mlx::core::cu::qmv<group_size, true>" in cuda.wrapper_source("stock", cuda.VECS)
