"""The CUDA templates, rendered against the pin: one body, knobs in the overlay only.

Fast tests on the rendered text (no GPU, no nvcc); the PTX identity of the
one-vector kernels is ``test_cuda_ptx_identity.py``, the compile for every wheel
architecture ``test_cuda_arch_compile.py``, rows and timing on a GPU
``bench/cuda_qmv.py`` (``docs/results/cuda-kernel.md``).
"""

from __future__ import annotations

import re

import pytest
from support_git import PIN_SHA, mlx_clone
from support_scripts import load_script

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
    """The PR reads no environment: qmv.cu and quantized.cpp carry no knob."""
    for path in (QMV, QUANTIZED):
        assert "get_var" not in renders[path, "upstream"]
        assert "getenv" not in renders[path, "upstream"]


def test_overlay_has_both_downstream_knobs(renders: dict) -> None:
    """The overlay adds the off switch (qmv.cu) and the exact-at-M >= 8 route (quantized.cpp)."""
    assert 'env::get_var("MLX_CUDA_QMV_SHARED_WEIGHTS", 1)' in renders[QMV, "overlay"]
    assert 'env::get_var("MLX_CUDA_QMV_EXACT", 0)' in renders[QUANTIZED, "overlay"]
    # Only the knob and its include differ (blank lines and braces aside).
    up, ov = renders[QMV, "upstream"], renders[QMV, "overlay"]
    extra = [ln for ln in ov.splitlines() if ln not in up.splitlines()]
    assert len(extra) == 4 and extra[0] == '#include "mlx/utils.h"'


def test_upstream_code_is_left_as_it_is(renders: dict) -> None:
    """Upstream's kernels and dequantization are untouched; one kernel is added, and its
    MMAs are CuTe's wrappers (no inline asm of the patch's own)."""
    stock, patched = renders[QMV, "stock"], renders[QMV, "upstream"]
    for name, index in (
        ("dequant_fma", 0),
        ("dequant_fma", 1),
        ("qmv_kernel_impl", 0),
        ("qmv_kernel", 0),
        ("gather_qmv_kernel", 0),
        ("gather_qmv", 0),
    ):
        want = cxx.find_function(stock, name, index).text(stock)
        assert cxx.find_function(patched, name, index).text(patched) == want, name
    assert patched.count("asm") == stock.count("asm")
    assert patched.count("__global__") == stock.count("__global__") + 1
    assert "cute::SM80_16x8x16_F32BF16BF16F32_TN" in patched
    assert "#include <cute/arch/mma_sm80.hpp>" in patched


def test_each_vector_takes_the_same_instructions(renders: dict) -> None:
    """What makes row i independent of M, read from the kernel: vectors are MMA columns
    (x of vectors past M is zero, never a branch around their MMA; the second MMA, for
    vectors 8 to 15, runs whenever the block has any), the K steps a warp takes depend on
    k alone, and the warps' partials are summed in warp order."""
    text = renders[QMV, "upstream"]
    kernel = cxx.find_function(text, "qmv_mma_kernel").text(text)
    flat = " ".join(kernel.split())
    assert "bool x_real[2] = {g < vecs, g + 8 < vecs};" in flat
    assert "bool two = vecs > 8;" in flat
    assert "if (in_k && x_real[h]) {" in flat
    assert (
        "qmv_mma_fma<T>(acc[t][0], a, xs[0][2 * j], xs[0][2 * j + 1]); if (two) "
        "{ qmv_mma_fma<T>(acc[t][1], a, xs[1][2 * j], xs[1][2 * j + 1]); }"
    ) in flat
    assert flat.count("qmv_mma_fma<T>(") == 2
    assert "for (int s0 = warp; s0 < steps; s0 += k_warps * stages) {" in flat
    assert "int s = s0 + slot * k_warps;" in flat
    # Each warp's ring holds stages steps; the one in use is complete.
    assert "fetch((slot + stages - 1) % stages, s + (stages - 1) * k_warps);" in flat
    assert "cute::cp_async_wait<stages - 1>();" in flat
    assert "int steps = cuda::ceil_div(k, step_k);" in flat
    assert "float sum = partial[0][t][h][i][src];" in flat
    assert "for (int p = 1; p < k_warps; ++p) { sum += partial[p][t][h][i][src]; }" in flat
    # m enters only through the number of real vectors and the pointers.
    assert [ln for ln in kernel.splitlines() if re.search(r"\bm\b", ln)] == [
        "        int m,",
        "  int vecs = cuda::std::min(16, m - v0);",
        "  x += (static_cast<int64_t>(l) * m + v0) * k;",
        "  out += (static_cast<int64_t>(l) * m + v0) * n;",
    ]
    # The warps over K follow the layer's n, never m; tiles and slots, only on wide layers.
    launch = cxx.find_function(text, "qmv_mma").text(text)
    flat_launch = " ".join(launch.split())
    branches = [
        ("if (n < wide_n)", "narrow_k_warps, tiles, stages"),
        ("else if (n <= wider_n)", "wide_k_warps, tiles, stages"),
        ("else", "wide_k_warps, wider_tiles, wider_stages"),
    ]
    assert (
        " } ".join(f"{cond} {{ launch.template operator()<{args}>();" for cond, args in branches)
        + " } }"
        in flat_launch
    )
    m_uses = [" ".join(ln.split()) for ln in launch.splitlines() if re.search(r"\bm\b", ln)]
    assert m_uses == [
        "int m,",
        "&x, &w, &scales, &biases, &global_scale, &out, &m, &n, &k, &broadcast_w};",
        "uint32_t(cuda::ceil_div(m, 16)),",
    ]


def test_launch_constants_are_set_one_each(renders: dict) -> None:
    """bench/cuda_qmv.py's variants change qmv_mma()'s nine constants and nothing else;
    six of them give wide layers the same tiles and stages as narrow ones."""
    text = renders[QMV, "upstream"]
    assert cuda.launch_constants(text) == [1, 4, 16, 8, 8192, 4, 8192, 2, 2]
    nine = cuda.with_launch_constants(text, (1, 4, 16, 8, 8192, 4, 16384, 3, 1))
    assert cuda.launch_constants(nine) == [1, 4, 16, 8, 8192, 4, 16384, 3, 1]
    variant = cuda.with_launch_constants(text, (2, 8, 8, 4, 0, 2))
    assert cuda.launch_constants(variant) == [2, 8, 8, 4, 0, 2, 0, 2, 8]
    changed = [
        (a, b) for a, b in zip(text.splitlines(), variant.splitlines(), strict=True) if a != b
    ]
    assert changed == [
        ("  constexpr int tiles = 1;", "  constexpr int tiles = 2;"),
        ("  constexpr int stages = 4;", "  constexpr int stages = 8;"),
        ("  constexpr int warps_per_sm = 16;", "  constexpr int warps_per_sm = 8;"),
        ("  constexpr int narrow_k_warps = 8;", "  constexpr int narrow_k_warps = 4;"),
        ("  constexpr int wide_n = 8192;", "  constexpr int wide_n = 0;"),
        ("  constexpr int wide_k_warps = 4;", "  constexpr int wide_k_warps = 2;"),
        ("  constexpr int wider_n = 8192;", "  constexpr int wider_n = 0;"),
        ("  constexpr int wider_stages = 2;", "  constexpr int wider_stages = 8;"),
    ]
    assert cuda.full_launch_constants((1, 4, 16, 8, 8192, 4)) == [1, 4, 16, 8, 8192, 4, 8191, 1, 4]
    with pytest.raises(ValueError, match="give 6 or 9"):
        cuda.with_launch_constants(text, (1, 4, 16))
    with pytest.raises(ValueError, match="tiles"):
        cuda.with_launch_constants(
            text.replace("constexpr int tiles = 1;", ""), (1, 4, 16, 8, 8192, 4)
        )


def test_wrapper_asks_each_arm_for_its_kernel() -> None:
    """The harness calls cu::qmv as MLX does: stock's signature, and the patched one with
    the tensor-core path asked for."""
    src = cuda.wrapper_source("patched")
    assert src.count("&launch<") == len(cuda.DTYPES) * len(cuda.QTYPES) * len(cuda.GROUPS)
    assert "m, n, k, 1, true, true, launch_kernel);" in src
    assert "m, n, k, 1, true, launch_kernel);" in cuda.wrapper_source("stock")


@pytest.mark.parametrize(
    ("diff", "marker"),
    [
        ("persistent-tiles.diff", "tile_row(fetch_j)"),
        ("row-pointers.diff", "int vec_mmas,"),
        ("scale-ring.diff", "qmv_mma_copy_word(smem.ring.s["),
        ("scale-rounds.diff", "load_scales(next_scale, next_bias,"),
        ("x-ring.diff", "v = x_ring[warp][slot][quad][j];"),
        ("x-ring-scale-rounds.diff", "v = x_ring[warp][slot][quad][j];"),
        ("scale-after.diff", "qmv_mma_scale_after<T, Q, has_bias>"),
        ("x-prefetch.diff", "prefetch.global.L1"),
        ("x-prefetch-16.diff", '::"l"(x_rows[h] + k0)'),
        ("x-registers.diff", "load_x(s + k_warps);"),
        ("wide-steps.diff", "constexpr int words = 2;"),
    ],
)
def test_template_variants_apply_and_keep_the_launch_constants(
    renders: dict, diff: str, marker: str
) -> None:
    """Each kernel experiment kept in bench/variants applies to this checkout's templates
    and makes its change (its marker). One that keeps the shipped kernel's order keeps its
    launch constants too, so compare holds its rows to the shipped kernel's; the two whose
    diffs declare an order of its own are held to their own M = 1 and may change them."""
    bench = load_script("bench/cuda_qmv.py")
    read = source.reader(source.ensure_clone(mlx_clone()), PIN_SHA)
    shipped = bench.rendered_qmv(read)
    assert shipped == renders[QMV, "upstream"] and marker not in shipped  # control
    variant = bench.rendered_qmv(read, bench.ROOT / "bench" / "variants" / diff)
    assert marker in variant
    own = cuda.declares_own_order((bench.ROOT / "bench" / "variants" / diff).read_text())
    assert own == (diff in ("scale-after.diff", "wide-steps.diff"))
    if not own:
        assert cuda.launch_constants(variant) == cuda.launch_constants(shipped)
