"""The rendered Metal host code routes to the streamed qmv only where the patch claims.

The claim: for M in [2, batch limit), where stock MLX runs qmv_wide (affine on
generation 15+, the fp modes everywhere) or, for nvfp4 with a global scale
(which qmv_wide lacks), one fp_qmv per vector. Everywhere else the routing is
stock's: affine on generations 13/14 keeps its per-vector qmv, and QQMatmul,
which calls dispatch_qmv at every M, keeps fp_qmv_wide (or fp_qmv) from the
batch limit on. These tests read the rendered quantized.cpp, in both flavours,
against the pin's text.
"""

from __future__ import annotations

import itertools
import re

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import cxx, render
from patchkit.util import git

SPEC = mlx_clone()
METAL_CPP = "mlx/backend/metal/quantized.cpp"
HEADERS = ("mlx/backend/metal/kernels/quantized.h", "mlx/backend/metal/kernels/fp_quantized.h")
STOCK_WIDE = "M >= 2 && use_qmv_wide(mode, d) && !global_scale"

pytestmark = pytest.mark.skipif(
    SPEC is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)


def _upstream(path: str) -> str:
    from patchkit.carry import source

    return git.show_file(source.clone_dir(source.source_spec(SPEC)), PIN_SHA, path)


def _render(path: str, **options: str) -> str:
    opts = render.RenderOptions(backends=("metal",), **options)
    plan = next(p for p in render.selected_plans(opts) if p.path == path)
    return render.render_file(plan, _upstream(path), opts)


@pytest.fixture(scope="module", params=["upstream", "overlay"])
def rendered(request: pytest.FixtureRequest) -> str:
    return _render(METAL_CPP, flavour=request.param)


@pytest.fixture(scope="module")
def stock() -> str:
    return _upstream(METAL_CPP)


def _fn(text: str, name: str) -> str:
    return cxx.function_text(text, name)


def _squash(code: str) -> str:
    return " ".join(code.split())


def _streamed_condition(dispatch: str) -> str:
    """The condition of the branch in dispatch_qmv that calls the streamed kernels."""
    m = re.search(r"if \(([^{]*?)\) \{\s*if \(mode == \"affine\"\) \{\s*qmv_streamed\(", dispatch)
    assert m, "dispatch_qmv has no streamed branch"
    return _squash(m.group(1))


def _c_bool(cond: str, **names: object) -> bool:
    """Evaluate a C condition of &&, ||, ! and comparisons over Python ``names``."""
    py = cond.replace("&&", " and ").replace("||", " or ")
    py = re.sub(r"!(?!=)", " not ", py)
    return bool(eval(py, {}, names))


def test_callers_of_dispatch_qmv_are_stock(rendered: str, stock: str) -> None:
    # QuantizedMatmul bounds M by the batch limit before calling dispatch_qmv;
    # QQMatmul does not. Neither changes: the bound lives in dispatch_qmv.
    for name in ("QuantizedMatmul::eval_gpu", "QQMatmul::eval_gpu", "use_qmv_wide"):
        assert _fn(rendered, name) == _fn(stock, name), name
    assert "get_qmv_batch_limit(K, N, d)" not in _fn(stock, "QQMatmul::eval_gpu")


def test_dispatch_qmv_is_stock_plus_one_branch(rendered: str, stock: str) -> None:
    patched = _fn(rendered, "dispatch_qmv")
    start = patched.index("  // Small batch (M below the batch limit)")
    end = patched.index("    return;\n  }\n\n", start) + len("    return;\n  }\n\n")
    assert patched[:start] + patched[end:] == _fn(stock, "dispatch_qmv")
    # The new branch sits after qmv_quad and before the stock qmv_wide branch.
    assert patched.index("qmv_quad(") < start < patched.index(STOCK_WIDE)


@pytest.mark.parametrize("flavour", ["upstream", "overlay"])
def test_routing_outside_the_claim_is_stock(flavour: str) -> None:
    streamed = _streamed_condition(_fn(_render(METAL_CPP, flavour=flavour), "dispatch_qmv"))

    def use_qmv_wide(mode: str, gen: int) -> bool:  # the pin's use_qmv_wide
        return mode != "affine" or gen >= 15

    limit = 13
    for mode, gen, M, global_scale, switch in itertools.product(
        ("affine", "mxfp4", "nvfp4"),  # affine / fp without and with a global scale
        (13, 14, 15, 17),  # before and from generation 15
        range(1, 40),  # M = 1, the claimed range and past the batch limit (QQMatmul)
        (False, True),  # nvfp4's global scale (mx.qqmm only)
        (True, False),  # MLX_QMV_STREAMED
    ):
        if global_scale and mode != "nvfp4":
            continue
        names = {
            "M": M,
            "K": 4096,
            "N": 4096,
            "d": gen,
            "mode": mode,
            "global_scale": global_scale,
            "get_qmv_batch_limit": lambda K, N, d: limit,
            "use_qmv_wide": use_qmv_wide,
            "qmv_streamed_enabled": lambda on=switch: on,
        }
        stock = "qmv_wide" if _c_bool(STOCK_WIDE, **names) else "qmv"
        patched = "streamed" if _c_bool(streamed, **names) else stock
        claimed = switch and 2 <= M < limit and (stock == "qmv_wide" or global_scale)
        with_case = f"{mode} gen {gen} M {M} global_scale {global_scale} switch {switch}"
        assert (patched == "streamed") == claimed, with_case
        if not claimed:
            assert patched == stock, with_case


def test_gen_13_14_affine_and_large_m_qqmm_keep_stock_kernels(rendered: str) -> None:
    cond = _streamed_condition(_fn(rendered, "dispatch_qmv"))
    # Affine before generation 15: use_qmv_wide is false, so the per-vector qmv.
    assert "use_qmv_wide(mode, d)" in cond
    # QQMatmul at M >= the batch limit: fp_qmv_wide (or fp_qmv) as stock.
    assert "M < get_qmv_batch_limit(K, N, d)" in cond


@pytest.mark.parametrize("routing,default", [("stream", 1), ("opt_in", 0)])
def test_switch_is_a_function_local_static_read_through_env(routing: str, default: int) -> None:
    text = _render(METAL_CPP, routing=routing)
    body = _fn(text, "qmv_streamed_enabled")
    assert f'static bool enabled_ = env::get_var("MLX_QMV_STREAMED", {default});' in body
    # Internal linkage: inside the anonymous namespace, no setter, no global.
    anon = text.index("namespace {\n")
    assert anon < text.index(body) < text.index("} // namespace\n", anon)
    for absent in ("set_qmv_streamed_enabled", "std::atomic", "qmv_streamed_flag", "getenv"):
        assert absent not in text


def test_shared_helpers_hold_upstreams_statements(rendered: str, stock: str) -> None:
    # The lifted statements appear once, in the helpers; qmv, qmv_wide and the
    # streamed dispatch functions all call them.
    for statement, helper, stock_count in (
        # gather_qmv keeps its own copy of the fast rule; it has no streamed twin.
        ("bool fast = N % bn == 0 && K % qmv_fast_k_alignment(bits) == 0;", "qmv_variant", 2),
        ("int n_tiles = (M + 4) / 5;", "qmv_vecs_per_tg", 1),
    ):
        assert statement in _fn(rendered, helper)
        assert rendered.count(statement) == stock.count(statement) == stock_count
    for caller, call in (
        ("qmv", "qmv_variant("),
        ("qmv_streamed", "qmv_variant("),
        ("fp_qmv_streamed", "qmv_variant("),
        ("qmv_wide", "qmv_vecs_per_tg(M)"),
        ("qmv_streamed", "qmv_vecs_per_tg(M)"),
        ("fp_qmv_streamed", "qmv_vecs_per_tg(M)"),
    ):
        assert call in _fn(rendered, caller), (caller, call)
    assert "use_narrow_qmv = fast && N >= 4096" in _fn(rendered, "qmv_variant")
    assert "use_narrow_qmv = fast" not in _fn(rendered, "qmv")


@pytest.mark.parametrize("path", HEADERS)
def test_no_second_definition_of_any_qdot(path: str) -> None:
    text, stock = _render(path), _upstream(path)
    for name in ("qdot", "qdot_safe"):
        assert len(cxx.find_functions(text, name)) == len(cxx.find_functions(stock, name)) == 1
        assert cxx.function_text(text, name) == cxx.function_text(stock, name)
    assert not re.search(r"\bqdot\w*_thread\b|load_packed_weights", text)
