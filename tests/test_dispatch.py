"""The dispatch facts (patchkit.verify.dispatch) against the pinned upstream source text.

Each restated rule is checked two ways: by value on the cases the proof relies
on, and, with a clone of the pin, against upstream's own expression, so a pin
bump that changes the rule fails here instead of silently proving the wrong
kernel.
"""

from __future__ import annotations

import ast
import itertools
import re
import types

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import cxx, render
from patchkit.util import git
from patchkit.verify import dispatch

SPEC = mlx_clone()
METAL_CPP = "mlx/backend/metal/quantized.cpp"
BF16 = "bfloat16"
F32 = "float32"


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
        tiles = -(-m // dispatch.vecs_per_tg(m))
        assert tiles == -(-m // dispatch.wide_vecs_per_tg(m)), m


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
    # The patch sends M * B <= 16 to qmv's tensor cores before that branch (16-bit
    # activations, 4/8-bit weights); float32 keeps stock's routing.
    f32 = {"group_size": 128, "dtype": "float32"}
    assert patched(h200, "affine", 4, 128, 256, 2, 1, group_size=128, dtype=BF16) == "qmv_mma"
    assert patched(h200, "affine", 4, 128, 256, 2, 1, **f32) == "qmm_sm90"
    assert patched(h200, "affine", 4, 128, 256, 17, 1, group_size=128, dtype=BF16) == "qmm_sm90"
    # The exact route (overlay) moves float32's small batches to qmv, one vector per block.
    exact = {"cuda_exact": True, **f32}
    assert patched(h200, "affine", 4, 128, 256, 2, 1, **exact) == "qmv"
    assert patched(h200, "affine", 8, 128, 16384, 8, 1, **exact) == "qmv"
    assert patched(h200, "affine", 4, 128, 256, 2, 3, **exact) == "qmm_sm90"  # B > 1
    assert patched(a100, "affine", 4, 128, 256, 2, 3, **exact) == "qmv"
    assert patched(a100, "affine", 4, 128, 256, 8, 3, **exact) == "qmv"


def test_test_qmms_points_take_stocks_kernels_on_the_default_route() -> None:
    """Every transposed point of MLX's test_qmm grid (group 128/64/32, 2/4/8 bits, M 8, 32,
    33, 64, N and K 128/256, B = 1, float32 inputs) takes the same kernel on the patch's
    default route as on stock, on sm90 and sm80: float32 never runs on the tensor cores.
    (Its non-transposed points, like test_qvm's and test_qmm_non_transposed's, never reach
    qmv: stock's supports_qmv refuses them.) So a failure of that test on the patched build
    is stock's code. Controls: the exact route takes some of the same points (M = 8) to
    qmv, and bfloat16 inputs take the 4/8-bit M = 8 points to qmv_mma on sm90."""
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
        path = dispatch.patched_kernel_path(dev, "affine", bits, k, n, m, 1, False, g, dtype=F32)
        assert path == stock
        exact_paths.add(dispatch.patched_kernel_path(dev, "affine", bits, k, n, m, 1, True, g,
                                                     dtype=F32))  # fmt: skip
        bf16 = dispatch.patched_kernel_path(dev, "affine", bits, k, n, m, 1, False, g, dtype=BF16)
        mma = dev.cc_major == 9 and bits in (4, 8) and m <= 16
        assert bf16 == ("qmv_mma" if mma else stock)
    assert "qmv" in exact_paths


def test_cuda_mma_route_by_value() -> None:
    """Default route: M * B <= 16 on qmv's tensor cores wherever supports_qmv_mma holds
    (sm90, float16/bfloat16, 4/8-bit weights, K % (128 / bits) == 0); everything else keeps
    stock's kernel (qmv below M * B = 8, qmm from there)."""
    h100 = dispatch.DeviceInfo("cuda", "NVIDIA H100", cc_major=9)
    a100 = dispatch.DeviceInfo("cuda", "NVIDIA A100", cc_major=8)
    t4 = dispatch.DeviceInfo("cuda", "NVIDIA T4", cc_major=7)
    b200 = dispatch.DeviceInfo("cuda", "NVIDIA B200", cc_major=10)

    def path(bits: int, k: int, m: int, b: int = 1, dtype: str = BF16, dev=h100, **kw) -> str:
        mode = kw.pop("mode", "affine")
        return dispatch.patched_kernel_path(dev, mode, bits, k, 4096, m, b, dtype=dtype, **kw)

    for bits in (4, 8):
        assert [path(bits, 4096, m) for m in (1, 8, 16, 17)] == ["qmv_mma"] * 3 + ["qmm"]
        assert [path(bits, 4096, m, 3) for m in (1, 5, 6)] == ["qmv_mma"] * 2 + ["qmm"]
        assert path(bits, 4096, 2, dtype="float16") == "qmv_mma"
        assert path(bits, 4096, 2, dtype="float32") == "qmv"
        assert path(bits, 4096, 2, dev=t4) == "qmv"  # no bfloat16 MMAs before sm80
        # sm80 to sm89 (not measured there) keep stock's routes, as past sm90.
        assert [path(bits, 4096, m, dev=a100) for m in (2, 8)] == ["qmv", "qmm"]
        assert path(bits, 4096, 2, cuda_shared_weights=False) == "qmv"
    assert path(4, 4112, 2) == "qmv"  # 4112 % 32 != 0
    assert path(8, 4112, 2) == "qmv_mma"  # 4112 % 16 == 0
    for bits in (2, 3, 5, 6):
        assert path(bits, 4096, 2) == "qmv"
    assert path(4, 4096, 2, mode="mxfp4") == "qmv_mma"
    assert path(8, 4096, 12, mode="mxfp8") == "qmv_mma"
    # Past sm90 (not measured there) the patch leaves stock's routes: fp_qmv for the fp
    # modes up to 7 vectors, qmv for affine, qmm from 8.
    assert path(4, 4096, 7, mode="nvfp4", dev=b200) == "fp_qmv"
    assert path(4, 4096, 9, mode="nvfp4", dev=b200) == "qmm"
    assert path(4, 4096, 2, dev=b200) == "qmv"
    assert path(4, 4096, 9, dev=b200) == "qmm"
    # The exact route (overlay) covers what the tensor cores do not.
    assert path(4, 4096, 12, dtype="float32", cuda_exact=True) == "qmv"
    assert path(4, 4096, 17, cuda_exact=True) == "qmm"


def _upstream(path: str) -> str:
    from patchkit.carry import source

    clone = source.ensure_clone(SPEC)
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
    small, large = re.search(r"return M == 2 \? (\d) : (\d);", body).groups()
    assert (int(small), int(large)) == dispatch.STREAMED_VECS
    assert "int qmv_vecs_per_tg(int M) {" in body and body.count("return") == 1
    assert all(dispatch.vecs_per_tg(m) == (2 if m == 2 else 5) for m in range(2, 33))


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


CUDA_QMV = "mlx/backend/cuda/quantized/qmm/qmv.cu"
CUDA_CPP = "mlx/backend/cuda/quantized/quantized.cpp"


def _cuda_render(path: str, flavour: str) -> str:
    plan = next(p for p in render.load_plans() if p.path == path)
    opts = render.RenderOptions(("cuda",), flavour=flavour)
    return render.render_file(plan, _upstream(path), opts)


@needs_clone
@pytest.mark.parametrize("flavour", ["upstream", "overlay"])
def test_cuda_mma_predicate_is_the_rendered_one(flavour: str) -> None:
    """dispatch.cuda_qmv_mma against the rendered supports_qmv_mma (qmv.cu), its use in
    mlx::core::qmv, and the compile-time twin that picks the instances."""
    text = _cuda_render(CUDA_QMV, flavour)
    body = " ".join(cxx.function_text(text, "supports_qmv_mma").split())
    assert (
        "int major = device.compute_capability_major(); if (major != 9) { return false; }"
    ) in body
    assert "if (out.dtype() != float16 && out.dtype() != bfloat16) { return false; }" in body
    assert "if (bits != 4 && bits != 8) { return false; }" in body
    assert "QuantizationMode::Affine" not in body  # every mode, on the same architectures
    assert ("return k % (128 / bits) == 0 && x.offset() % 16 == 0 && w.offset() % 16 == 0;") in body
    switch = 'static bool off = !env::get_var("MLX_CUDA_QMV_SHARED_WEIGHTS", 1);'
    assert (switch in body) == (flavour == "overlay")
    assert "bool mma = supports_qmv_mma(" in cxx.function_text(text, "qmv", 1)
    assert "if constexpr (qmv_mma_types<T, Q>) {" in cxx.function_text(text, "qmv", 0)
    twin = " ".join(text[text.index("constexpr bool qmv_mma_types") :].split()[:30])
    assert "cute::sizeof_bits_v<Q> == 4 || cute::sizeof_bits_v<Q> == 8" in twin


@needs_clone
@pytest.mark.parametrize("flavour", ["upstream", "overlay"])
def test_cuda_routes_are_the_rendered_ones(flavour: str) -> None:
    """The routes patched_kernel_path models are quantized.cpp's: the tensor-core route
    (both flavours) before stock's branches, then the overlay's exact route."""
    text = " ".join(_cuda_render(CUDA_CPP, flavour).split())
    mma = (
        f"if (can_use_qmv && !can_use_fp_qmv && M * B <= {dispatch.CUDA_QMV_MMA_MAX_ROWS} && "
        "supports(supports_qmv_mma)) { call_qmv(); return; }"
    )
    assert mma in text and text.index(mma) < text.index("if (can_use_qmm_sm90) {")
    exact = (
        "if (can_use_qmv && !can_use_fp_qmv && M >= 2 && "
        f"M <= {dispatch.CUDA_QMV_EXACT_MAX_ROWS} && m1_runs_qmv) {{ call_qmv(); return; }}"
    )
    assert (exact in text) == (flavour == "overlay")
    if flavour == "overlay":
        assert 'static bool qmv_exact = env::get_var("MLX_CUDA_QMV_EXACT", 0);' in text
        assert (
            "bool m1_runs_qmv = qmv_exact && (can_use_qmm_sm90 ? (B == 1 && N <= 16384 && "
            f"K <= 16384) : (B < {dispatch.CUDA_QMV_MAX_ROWS}));"
        ) in text
        assert text.index(mma) < text.index(exact) < text.index("if (can_use_qmm_sm90) {")


PR_TESTS = (
    "python/tests/test_quantized.py/test_qmv_small_batch.py.j2",
    "python/tests/test_quantized.py/test_qmv_tensor_cores.py.j2",
)
PR_CUDA_METHOD = "test_qmv_tensor_cores_match_single_vector"


def _pr_test_methods(backends: tuple[str, ...]) -> dict[str, ast.FunctionDef]:
    """The methods the PR's test snippet renders for ``backends``, parsed."""
    env = render.environment(render.TEMPLATES_DIR)
    context = render.pr_context(render.RenderOptions(backends=backends))
    text = "".join(env.get_template(t).render(**context) for t in PR_TESTS)
    tree = ast.parse("class TestQuantized:\n" + text)
    return {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}


# What the snippet's assignments may name: dtypes as their names, and range.
PR_NAMES = {"range": range, "mx": types.SimpleNamespace(float16="float16", bfloat16="bfloat16")}


def _assigned(fn: ast.FunctionDef, name: str, **names: object) -> object:
    """The value of the first plain assignment to ``name`` in ``fn``, with ``names`` bound."""
    node = next(
        n.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [name]
    )
    return eval(ast.unparse(node), {**PR_NAMES, **names})


def test_pr_cuda_test_reaches_the_tensor_core_route() -> None:
    """The CUDA PR's own test runs calls that the patched routing sends to qmv's tensor
    cores at every M = 2..16 it checks (past 16 where no qmm takes K): both dtypes, 4- and
    8-bit affine weights and the fp modes, a ragged shape, a K no qmm takes, batched and
    broadcast weights. The Metal PR renders no such method."""
    h100 = dispatch.DeviceInfo("cuda", "NVIDIA H100", cc_major=9)
    assert PR_CUDA_METHOD not in _pr_test_methods(("metal",))
    for backends in (("cuda",), ("metal", "cuda")):
        fn = _pr_test_methods(backends)[PR_CUDA_METHOD]
        shapes, modes, dtypes = (_assigned(fn, v) for v in ("shapes", "modes", "dtypes"))
        assert sorted(dtypes) == ["bfloat16", "float16"]
        assert {m for m, _, _ in modes} == {"affine", "mxfp4", "nvfp4", "mxfp8"}
        assert {b for m, b, _ in modes if m == "affine"} == {4, 8}
        checked = set()
        for (mode, bits, gs), (n, k, b), dtype in itertools.product(modes, shapes, dtypes):
            if k % gs:
                continue  # the test skips these (K a multiple of the group size)
            batch = b if b else 3
            max_m = _assigned(fn, "max_m", K=k, batch=batch)
            assert max_m * batch <= 16 or dispatch.cuda_no_qmm(k, gs)
            for m in range(1, max_m + 1):
                path = dispatch.patched_kernel_path(
                    h100, mode, bits, k, n, m, batch, group_size=gs, dtype=dtype
                )
                assert path == "qmv_mma", (mode, bits, n, k, b, dtype, m)
                checked.add((m, b, dispatch.cuda_no_qmm(k, gs)))
        assert {m for m, _, _ in checked} == set(range(1, 21))
        assert {b for _, b, _ in checked} == {0, 1, 3}
        assert {m for m, _, no_qmm in checked if m > 16} and all(
            no_qmm for m, _, no_qmm in checked if m > 16
        )
