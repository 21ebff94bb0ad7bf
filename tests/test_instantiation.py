"""The batched qmv kernels the host asks for are the ones the .metal files instantiate.

quantized.cpp's ``qmv`` builds a kernel name and, for the JIT build, a template
definition from ``get_quantized_kernel_wrapped``'s arguments; quantized.metal and
fp_quantized.metal instantiate names and template arguments through their
macros. A mismatch only shows on a Mac, at run time, as a missing kernel (or,
under JIT, a kernel with the wrong template arguments). These tests expand the
rendered .metal macros with the C preprocessor and check every name the host can
ask for at vecs_per_tg > 1 against them, with its template arguments; and that
the PR instantiates no more kernels than upstream.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import cxx, export, render
from patchkit.util import git
from patchkit.verify import dispatch

ROOT = Path(__file__).resolve().parent.parent
OVERLAY = ROOT / "patches" / PIN_SHA[:8] / "overlay" / "mlx" / "backend" / "metal"
TYPES = ("float", "float16_t", "bfloat16_t")  # get_type_string's Metal names
METAL_FILES = ("kernels/quantized.metal", "kernels/fp_quantized.metal")


def _overlay(rel: str) -> str:
    return export.strip_header(f"mlx/backend/metal/{rel}", (OVERLAY / rel).read_text())


def expand(metal: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{kernel name: (function, template arguments)} of every instantiation in ``metal``."""
    cpp = shutil.which("cpp")
    if cpp is None:
        pytest.skip("needs the C preprocessor (cpp)")
    body = "\n".join(line for line in metal.splitlines() if not line.startswith("#include"))
    prelude = "#define instantiate_kernel(name, func, ...) PK name | func | __VA_ARGS__ PK_END\n"
    out = subprocess.run(
        [cpp, "-P"], input=prelude + body, capture_output=True, text=True, check=True
    ).stdout
    found = {}
    for m in re.finditer(r"PK (.*?) \| (\w+) \| (.*?) PK_END", out):
        name = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        found[name] = (m.group(2), tuple(a.strip() for a in m.group(3).split(",")))
    return found


def expected() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every name qmv builds at vecs_per_tg > 1, with the template arguments its JIT passes."""
    want = {}
    affine = [("affine", gs, b) for gs in dispatch.GROUP_SIZES for b in dispatch.AFFINE_BITS]
    fp = [(mode, gs, b) for mode, (gs, b) in dispatch.FP_MODES.items()]
    for (mode, gs, bits), t, fast, V, batched in itertools.product(
        affine + fp, TYPES, (True, False), dispatch.STREAMED_VECS, (0, 1)
    ):
        kernel = "qmv_fast" if fast else "qmv"
        name = f"{mode}_{kernel}_{t}_gs_{gs}_b_{bits}_batch_{batched}_nv_{V}"
        func = ("affine_" if mode == "affine" else "fp_") + kernel
        # fp_qmv_fast alone takes the output tile (full: 4); vecs_per_tg last.
        tile = ("4",) if (fast and mode != "affine") else ()
        args = (t, str(gs), str(bits), str(batched), "false", *tile, str(V))
        want[name] = (func, args)
    return want


@pytest.fixture(scope="module")
def overlay_instances() -> dict[str, tuple[str, tuple[str, ...]]]:
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for rel in METAL_FILES:
        found |= expand(_overlay(rel))
    return found


def test_every_name_the_host_builds_is_instantiated_with_its_arguments(overlay_instances) -> None:
    batched = {k: v for k, v in overlay_instances.items() if "_nv_" in k and "wide" not in k}
    # Exactly the names the host builds, no more: the overlay's qmv_wide ones aside.
    assert batched == expected()


def test_host_name_and_jit_arguments_follow_the_kernel_signatures() -> None:
    host = _overlay("quantized.cpp")
    fn = cxx.function_text(host, "qmv")
    pieces = [
        '"_qmv_fast_" : "_qmv_"',
        '"_gs_"',
        '"_b_"',
        'use_narrow_qmv ? "_r_2" : ""',
        'B > 1 ? "_batch_1" : "_batch_0"',
        'global_scale ? "_hgs" : ""',
        '"_nv_" + std::to_string(vecs_per_tg)',
    ]
    positions = [fn.index(p) for p in pieces]
    assert positions == sorted(positions)
    # The narrow nvfp4 tile is an M = 1 choice: no batched kernel has it.
    assert "bool use_narrow_qmv = vecs_per_tg == 1 &&" in " ".join(fn.split())
    calls = re.findall(r"get_quantized_kernel_wrapped\(([^;]*)\);", fn)
    args = [[a.strip() for a in c.split(",")] for c in calls]
    # fp_qmv_fast: ..., batched, has_global_scale, results_per_simdgroup, vecs_per_tg;
    # the others: ..., batched, has_global_scale, vecs_per_tg.
    tail = ["B > 1", "global_scale.has_value()"]
    assert args[0][-4:] == [*tail, "results_per_simdgroup", "vecs_per_tg"]
    assert args[1][-3:] == [*tail, "vecs_per_tg"]
    signatures = {
        ("kernels/quantized.h", "affine_qmv_fast"): 6,
        ("kernels/quantized.h", "affine_qmv"): 6,
        ("kernels/fp_quantized.h", "fp_qmv_fast"): 7,
        ("kernels/fp_quantized.h", "fp_qmv"): 6,
    }
    for (rel, kernel), count in signatures.items():
        text = cxx.function_text(_overlay(rel), kernel)
        params = re.findall(r"(?:typename|int|bool)\s+(\w+)", text[: text.index("[[kernel]]")])
        assert len(params) == count and params[-1] == "vecs_per_tg", (kernel, params)
        # The JIT passes exactly as many arguments as the kernel declares.
        assert len(args[0 if kernel == "fp_qmv_fast" else 1]) - 4 == count, kernel


SPEC = mlx_clone()


@pytest.mark.skipif(
    SPEC is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)
@pytest.mark.parametrize("rel", METAL_FILES)
def test_the_pr_instantiates_no_more_kernels_than_upstream(rel: str) -> None:
    from patchkit.carry import source

    path = f"mlx/backend/metal/{rel}"
    stock = git.show_file(source.clone_dir(source.source_spec(SPEC)), PIN_SHA, path)
    opts = render.RenderOptions(backends=("metal",))
    plan = next(p for p in render.selected_plans(opts) if p.path == path)
    pr, upstream = expand(render.render_file(plan, stock, opts)), expand(stock)
    assert len(pr) == len(upstream)
    assert not [k for k in pr if "qmv_wide" in k]
    wide = {k for k in upstream if "qmv_wide" in k}
    batched = {k for k in pr if "_nv_" in k}
    assert len(batched) == len(wide) > 0
    assert set(pr) - batched == set(upstream) - wide  # nothing else changes
