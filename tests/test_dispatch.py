"""The dispatch facts (patchkit.verify.dispatch) against the pinned upstream source text.

Each restated rule is checked two ways: by value on the cases the proof relies
on, and, with a clone of the pin, against upstream's own expression, so a pin
bump that changes the rule fails here instead of silently proving the wrong
kernel.
"""

from __future__ import annotations

import re

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import cxx, render
from patchkit.util import git
from patchkit.verify import dispatch

SPEC = mlx_clone()
METAL_CPP = "mlx/backend/metal/quantized.cpp"


def test_qmv_fast_alignment_by_value() -> None:
    # 512 is the K step at 4 bits (8 values per pack, 2 packs per lane, 32 lanes).
    assert [dispatch.qmv_fast_k_alignment(b) for b in (2, 3, 4, 5, 6, 8)] == [
        512, 512, 512, 512, 256, 256,
    ]  # fmt: skip
    assert dispatch.uses_qmv_fast(4096, 64, 4) and not dispatch.uses_qmv_fast(4096, 60, 4)
    assert not dispatch.uses_qmv_fast(640, 64, 4)


def test_tiling_caps_at_five_and_balances() -> None:
    # qmv_wide's tile: the fewest tiles of at most 5, then the smallest that fills them.
    assert [dispatch.wide_vecs_per_tg(m) for m in range(2, 13)] == [2, 3, 4, 5, 3, 4, 4, 5, 5, 4, 4]
    # The patched dispatch: as many tiles (weight reads), each of an instantiated size.
    assert [dispatch.vecs_per_tg(m) for m in range(2, 13)] == [2] + [5] * 10
    for m in range(2, 33):
        assert -(-m // dispatch.vecs_per_tg(m)) == -(-m // dispatch.wide_vecs_per_tg(m)), m


def test_kernel_path_routes_like_stock() -> None:
    g15 = dispatch.DeviceInfo("metal", "applegpu_g15s", 15, "s")
    g14 = dispatch.DeviceInfo("metal", "applegpu_g14g", 14, "g")
    cuda = dispatch.DeviceInfo("cuda", "NVIDIA H200")
    assert dispatch.kernel_path(g15, "affine", 4, 4096, 4096, 2, 1) == "qmv_wide"
    assert dispatch.kernel_path(g14, "affine", 4, 4096, 4096, 2, 1) == "qmv_fast"
    assert dispatch.kernel_path(g14, "mxfp4", 4, 4096, 4096, 2, 1) == "fp_qmv_wide"
    assert dispatch.kernel_path(g15, "affine", 4, 4096, 4096, 15, 1) == "qmm_splitk"
    assert dispatch.kernel_path(g15, "affine", 4, 128, 4096, 2, 1) == "qmv_quad"
    assert dispatch.kernel_path(cuda, "affine", 4, 4096, 4096, 7, 1) == "qmv"
    assert dispatch.kernel_path(cuda, "affine", 4, 4096, 4096, 4, 2) == "qmm"


def test_sm90_qmm_branch_is_modelled() -> None:
    """Where stock's qmm_sm90 applies (sm90, affine 4/8-bit, group size >= K), everything but
    M = B = 1 goes there, on the default route of the patch too; the exact route takes B = 1
    only. The shapes are those of the test_qmv / test_qmv_wide subtests that fail on sm90."""
    h200 = dispatch.DeviceInfo("cuda", "NVIDIA H200", cc_major=9)
    a100 = dispatch.DeviceInfo("cuda", "NVIDIA A100", cc_major=8)
    stock, patched = dispatch.kernel_path, dispatch.patched_kernel_path
    assert stock(h200, "affine", 4, 64, 256, 1, 3, group_size=64) == "qmm_sm90"
    assert stock(h200, "affine", 8, 128, 256, 2, 1, group_size=128) == "qmm_sm90"
    assert stock(h200, "affine", 4, 64, 256, 1, 1, group_size=64) == "qmv"
    assert stock(h200, "affine", 4, 128, 256, 2, 1, group_size=64) == "qmv"  # group < K
    assert stock(h200, "affine", 4, 96, 256, 2, 1, group_size=128) == "qmv"  # K % 64 != 0
    assert stock(h200, "affine", 6, 128, 256, 2, 1, group_size=128) == "qmv"  # 6-bit
    assert stock(h200, "affine", 4, 128, 258, 2, 1, group_size=128) == "qmv"  # N % 4 != 0
    assert stock(a100, "affine", 4, 128, 256, 2, 1, group_size=128) == "qmv"
    assert stock(h200, "affine", 4, 128, 256, 2, 1) == "qmv"  # group size not given
    assert patched(h200, "affine", 4, 128, 256, 2, 1, group_size=128) == "qmm_sm90"
    exact = {"cuda_exact": True, "group_size": 128}
    # These layers are below the streaming floor: the exact route's M = 2 runs the
    # per-vector qmv (streamed from M = 8).
    assert patched(h200, "affine", 4, 128, 256, 2, 1, **exact) == "qmv"
    assert patched(h200, "affine", 4, 128, 256, 8, 1, **exact) == "qmv_streamed"
    assert patched(h200, "affine", 4, 128, 256, 2, 3, **exact) == "qmm_sm90"  # B > 1
    assert patched(a100, "affine", 4, 128, 256, 2, 3, **exact) == "qmv"
    assert patched(a100, "affine", 4, 128, 256, 8, 3, **exact) == "qmv_streamed"


def test_test_qmms_points_take_stocks_kernels_on_the_default_route() -> None:
    """Every transposed point of MLX's test_qmm grid (group 128/64/32, 2/4/8 bits, M 8, 32,
    33, 64, N and K 128/256, B = 1) takes the same kernel on the patch's default route as on
    stock, on sm90 and sm80: M >= 8 stays on qmm. (Its non-transposed points, like
    test_qvm's and test_qmm_non_transposed's, never reach qmv: stock's supports_qmv refuses
    them.) So a failure of that test on the patched build is stock's code. Control: the
    exact route takes some of the same points to the streamed kernel."""
    devices = [
        dispatch.DeviceInfo("cuda", "NVIDIA H200", cc_major=9),
        dispatch.DeviceInfo("cuda", "NVIDIA A100", cc_major=8),
    ]
    grid = [
        (dev, g, bits, m, n, k)
        for dev in devices
        for g in (128, 64, 32)
        for bits in (2, 4, 8)
        for m in (8, 32, 33, 64)
        for n in (128, 256)
        for k in (128, 256)
    ]
    exact_paths = set()
    for dev, g, bits, m, n, k in grid:
        stock = dispatch.kernel_path(dev, "affine", bits, k, n, m, 1, g)
        assert stock.startswith("qmm")
        assert dispatch.patched_kernel_path(dev, "affine", bits, k, n, m, 1, False, g) == stock
        exact_paths.add(dispatch.patched_kernel_path(dev, "affine", bits, k, n, m, 1, True, g))
    assert "qmv_streamed" in exact_paths


def _upstream(path: str) -> str:
    from patchkit.carry import source

    clone = source.clone_dir(source.source_spec(SPEC))
    return git.show_file(clone, PIN_SHA, path)


needs_clone = pytest.mark.skipif(
    SPEC is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)


def _c_int(expr: str, **names: int) -> int:
    """Evaluate a C integer expression of + - * / and ternaries over ``names``."""
    py = re.sub(r"(\w+)\s*==\s*(\w+)\s*\?\s*(\w+)\s*:\s*(\w+)", r"(\3 if \1 == \2 else \4)", expr)
    return int(eval(py.replace("/", "//"), {}, names))


@needs_clone
def test_alignment_is_upstreams_expression() -> None:
    body = cxx.function_text(_upstream(METAL_CPP), "qmv_fast_k_alignment")
    expr = re.search(r"return (.*);", body).group(1)
    expr = expr.replace("get_pack_factor(bits, 32)", "pack")
    for bits in (2, 3, 4, 5, 6, 8):
        got = _c_int(expr, bits=bits, pack=dispatch.pack_factor(bits))
        assert got == dispatch.qmv_fast_k_alignment(bits), bits


@needs_clone
def test_tiling_is_upstreams_expression() -> None:
    text = _upstream(METAL_CPP)
    n_tiles = re.search(r"int n_tiles = (\(M \+ 4\) / 5);", text).group(1)
    vecs = re.search(r"int vecs_per_tg = (.*);", text).group(1)
    for m in range(2, 33):
        tiles = _c_int(n_tiles, M=m)
        assert _c_int(vecs, M=m, n_tiles=tiles) == dispatch.wide_vecs_per_tg(m), m


@needs_clone
def test_patched_tiling_is_the_rendered_expression() -> None:
    plan = next(p for p in render.load_plans() if p.path == METAL_CPP)
    text = render.render_file(plan, _upstream(METAL_CPP), render.RenderOptions(("metal",)))
    body = cxx.function_text(text, "qmv_vecs_per_tg")
    n_tiles = re.search(r"int n_tiles = (.*);", body).group(1)
    cond, small, large = re.search(r"return (.*) <= 2 \? (\d) : (\d);", body).groups()
    assert (int(small), int(large)) == dispatch.STREAMED_VECS
    for m in range(2, 33):
        tiles = _c_int(n_tiles, M=m)
        want = int(small) if _c_int(cond, M=m, n_tiles=tiles) <= 2 else int(large)
        assert want == dispatch.vecs_per_tg(m), m


@needs_clone
def test_batch_limit_table_is_upstreams() -> None:
    body = cxx.function_text(_upstream(METAL_CPP), "get_qmv_batch_limit")
    upstream_numbers = [int(n) for n in re.findall(r"return (\d+);", body)]
    ours = []
    for gen, size in ((17, "s"), (15, "s"), (13, "d"), (13, "g"), (12, "d"), (12, "g")):
        dev = dispatch.DeviceInfo("metal", f"applegpu_g{gen}{size}", gen, size)
        ours += [dispatch.batch_limit(k, k, dev) for k in (2048, 4096, 8192)]
    assert ours == upstream_numbers


@needs_clone
def test_routing_conditions_are_upstreams() -> None:
    text = _upstream(METAL_CPP)
    body = cxx.function_text(text, "use_qmv_wide")
    assert 'mode != "affine" || d.get_architecture_gen() >= 15' in body
    assert "if (M >= 2 && use_qmv_wide(mode, d) && !global_scale) {" in text
    assert "bool fast = N % bn == 0 && K % qmv_fast_k_alignment(bits) == 0;" in text
    assert "if ((K == 128 || K == 64) && is_power_of_2(bits) && !global_scale)" in text
    cuda = _upstream("mlx/backend/cuda/quantized/quantized.cpp")
    assert f"(M * B < {dispatch.CUDA_QMV_MAX_ROWS})" in cuda


@needs_clone
def test_sm90_model_reads_the_pinned_conditions() -> None:
    """Each condition cuda_qmm_sm90 / cuda_m1_qmv_on_sm90 encode is in the pinned source."""
    qmm = _upstream("mlx/backend/cuda/quantized/qmm/qmm.cu")
    body = qmm[qmm.index("bool supports_qmm_sm90(") :]
    body = body[: body.index("\n}\n")]
    for condition in (
        "device.compute_capability_major() != 9",
        "(n * w.itemsize()) % 16 != 0",
        "k % 64 != 0",
        "bits != 4 && bits != 8",
        "group_size < k",
        "mode != QuantizationMode::Affine",
    ):
        assert condition in body, condition
    route = _upstream("mlx/backend/cuda/quantized/quantized.cpp")
    assert "can_use_qmv && (M == 1 && B == 1 && N <= 16384 && K <= 16384)" in route
