"""The rendered Metal host code routes every shape as stock MLX does, to one body.

The claim: where stock MLX runs qmv_wide (2 <= M < batch limit; affine on
generation 15+, the fp modes everywhere; no global scale), the patched tree runs
qmv itself at vecs_per_tg 2 or 5; everywhere else nothing changes, and the PR adds
no environment variable. The overlay adds one downstream switch that restores
qmv_wide. These tests read the rendered quantized.cpp against the pin's text.
"""

from __future__ import annotations

import itertools
import re

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import cxx, render
from patchkit.util import git
from patchkit.verify import dispatch

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

    return git.show_file(source.ensure_clone(source.source_spec(SPEC)), PIN_SHA, path)


def _render(path: str, flavour: str = "upstream") -> str:
    opts = render.RenderOptions(backends=("metal",), flavour=flavour)
    plan = next(p for p in render.selected_plans(opts) if p.path == path)
    return render.render_file(plan, _upstream(path), opts)


@pytest.fixture(scope="module", params=["upstream", "overlay"])
def rendered(request: pytest.FixtureRequest) -> str:
    return _render(METAL_CPP, request.param)


@pytest.fixture(scope="module")
def stock() -> str:
    return _upstream(METAL_CPP)


def _fn(text: str, name: str) -> str:
    return cxx.function_text(text, name)


def _squash(code: str) -> str:
    return " ".join(code.split())


def _c_bool(cond: str, **names: object) -> bool:
    """Evaluate a C condition of &&, ||, ! and comparisons over Python ``names``."""
    py = cond.replace("&&", " and ").replace("||", " or ")
    py = re.sub(r"!(?!=)", " not ", py)
    return bool(eval(py, {}, names))


def _batched_condition(dispatch_qmv: str) -> str:
    m = re.search(r"if \(([^{]*use_batched_qmv[^{]*)\) \{", dispatch_qmv)
    assert m, "dispatch_qmv has no batched branch"
    return _squash(m.group(1))


def test_callers_of_dispatch_qmv_are_stock(rendered: str, stock: str) -> None:
    for name in ("QuantizedMatmul::eval_gpu", "QQMatmul::eval_gpu", "get_qmv_batch_limit"):
        assert _fn(rendered, name) == _fn(stock, name), name
    # use_qmv_wide is renamed, its rule untouched.
    assert (
        _fn(rendered, "use_batched_qmv").split("{", 1)[1]
        == (_fn(stock, "use_qmv_wide").split("{", 1)[1])
    )


def test_every_shape_takes_the_stock_branch(rendered: str) -> None:
    # Same branch conditions as stock: the batched branch is qmv_wide's, renamed.
    batched = _batched_condition(_fn(rendered, "dispatch_qmv"))
    assert batched == STOCK_WIDE.replace("use_qmv_wide", "use_batched_qmv")

    def use(mode: str, gen: int) -> bool:  # the pin's use_qmv_wide
        return mode != "affine" or gen >= 15

    for mode, gen, M, global_scale in itertools.product(
        ("affine", "mxfp4", "nvfp4"), (13, 14, 15, 17), range(1, 40), (False, True)
    ):
        names = {"M": M, "d": gen, "mode": mode, "global_scale": global_scale}
        stock_wide = _c_bool(STOCK_WIDE, use_qmv_wide=use, **names)
        assert _c_bool(batched, use_batched_qmv=use, **names) == stock_wide


def test_the_batched_branch_calls_qmv_with_the_tile_size(rendered: str) -> None:
    """One qmv call, stock's, given the tile: 1 (the M = 1 kernel) unless the batched
    branch picks one; every branch before it is stock's."""
    body = _squash(_fn(rendered, "dispatch_qmv"))
    args = "x, w, scales, biases, global_scale, out, group_size, bits, M, N, K, d, s, mode"
    assert body.endswith(f"qmv({args}, vecs_per_tg); }}")
    assert body.count(f"qmv({args}") == 1
    batched = body[body.index("int vecs_per_tg = 1; if (M >= 2") : body.rindex(f"qmv({args}")]
    assert batched.endswith("vecs_per_tg = qmv_vecs_per_tg(M); } ")
    stock_body = _squash(_fn(_upstream(METAL_CPP), "dispatch_qmv"))
    assert stock_body.endswith(f"qmv({args}); }}")  # the call the PR gives the tile
    head = stock_body[: stock_body.index("// Small batch")]
    assert body.startswith(head)


def test_tile_size_rule_matches_the_dispatch_facts(rendered: str) -> None:
    body = _fn(rendered, "qmv_vecs_per_tg")
    assert f"return M == 2 ? {dispatch.STREAMED_VECS[0]} : {dispatch.STREAMED_VECS[1]};" in body
    # Tiles of 5 read the weights as often as qmv_wide's tiles (at most 5 vectors each).
    for m in range(2, 33):
        tiles = -(-m // dispatch.vecs_per_tg(m))
        assert tiles == -(-m // dispatch.wide_vecs_per_tg(m)), m


def test_pr_has_no_environment_variable_and_no_qmv_wide(stock: str) -> None:
    pr = _render(METAL_CPP, "upstream")
    assert pr.count("env::get_var") == stock.count("env::get_var")
    assert "qmv_wide" not in pr and "MLX_QMV" not in pr
    for path in HEADERS:
        assert "qmv_wide" not in _render(path, "upstream"), path


def test_overlay_switch_restores_stock_qmv_wide(stock: str) -> None:
    overlay = _render(METAL_CPP, "overlay")
    body = _fn(overlay, "qmv_streamed_enabled")
    assert 'static bool enabled_ = env::get_var("MLX_QMV_STREAMED", 1);' in body
    assert _fn(overlay, "qmv_wide") == _fn(stock, "qmv_wide")
    branch = _squash(_fn(overlay, "dispatch_qmv"))
    assert (
        "if (!qmv_streamed_enabled()) { qmv_wide( x, w, scales, biases, out, group_size, bits, "
        "M, N, K, d, s, mode); return; } vecs_per_tg = qmv_vecs_per_tg(M); }"
    ) in branch
    # Read once, as MLX reads its other switches (a function-local static).
    assert overlay.index("inline bool qmv_streamed_enabled()") < overlay.index("void dispatch_qmv(")
    impls = {path: ("fp_" if "fp_" in path else "") + "qmv_wide_impl" for path in HEADERS}
    for path, impl in impls.items():
        assert cxx.function_text(_render(path, "overlay"), impl)


@pytest.mark.parametrize("path", HEADERS)
def test_no_second_definition_of_any_qdot(path: str) -> None:
    text, stock = _render(path), _upstream(path)
    for name in ("qdot", "qdot_safe", "load_vector", "load_vector_safe"):
        assert len(cxx.find_functions(text, name)) == len(cxx.find_functions(stock, name))
        assert [f.text(text) for f in cxx.find_functions(text, name)] == [
            f.text(stock) for f in cxx.find_functions(stock, name)
        ]


# A line that starts a function definition in MLX's clang-formatted headers
# (``METAL_FUNC void qmv_impl(``, ``[[kernel]] void affine_qmv(``, ``inline U qdot(``).
DEFINITION_HEAD = re.compile(r"^[^\s/#][^;{}()]*?\b(\w+)\($", re.M)


def _defined(text: str) -> set[str]:
    return {n for n in DEFINITION_HEAD.findall(text) if cxx.find_functions(text, n)}


@pytest.mark.parametrize("path", HEADERS)
def test_headers_define_upstreams_functions_less_qmv_wides(path: str) -> None:
    """One body: the PR deletes qmv_wide's functions and defines no function of its own
    (control: upstream's header defines qmv_wide's, which the PR's lacks)."""
    stock = _defined(_upstream(path))
    wide = {n for n in stock if "qmv_wide" in n}
    assert wide and len(stock) > len(wide)
    assert _defined(_render(path)) == stock - wide
