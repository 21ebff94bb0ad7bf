"""The tiling-variant source for timing arms: derived from the patched qmv.cu, loudly.

The variant file is never part of a patch; it lets one incremental rebuild time
several tilings (``PATCHKIT_QMV_VARIANT``). What must hold: variant 0 is the patch's
own tiling, the arms travel in the source, and a launcher that no longer looks
like the one the edits expect stops the script instead of producing a silent
copy of the patch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support_git import PIN_SHA, mlx_clone
from support_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
OVERLAY_QMV = ROOT / "patches" / "9a795735" / "overlay" / "mlx/backend/cuda/quantized/qmm/qmv.cu"


def _variants():
    return load_script("scripts/cuda_bench_variants.py")


def test_variant_source_switches_tilings_at_run_time() -> None:
    variants = _variants()
    patched = OVERLAY_QMV.read_text()
    out = variants.variant_source(patched)
    arms = re.findall(r"^// bench-arm: (\S+) PATCHKIT_QMV_VARIANT=(\d+)$", out, re.M)
    assert arms == [(name, str(v)) for name, v in variants.ARMS.items()]
    assert "0" not in {v for _, v in arms}  # 0 is the patch's tiling, the `patched` arm
    launcher = out[out.index("void qmv_streamed(") :]
    assert 'std::getenv("PATCHKIT_QMV_VARIANT")' in launcher
    # Variant 0 keeps the patch's V <= 4 tiles; the others add V = 8 at M = 5..8.
    assert "} else if (m <= 4 || variant == 0) {\n    launch(v4{}, v8{});" in launcher
    assert "} else if (variant == 2) {\n    launch(v8{}, v4{});" in launcher
    assert "constexpr int rows_per_warp = V <= 4 ? 2 : 1;" in launcher
    # Everything before the launcher is the patch's text (plus <cstdlib> and the arms).
    body = out.split("\n", len(arms))[-1].replace("#include <cstdlib>\n", "", 1)
    assert (
        body[: body.index("void qmv_streamed(")] == patched[: patched.index("void qmv_streamed(")]
    )


def test_a_changed_launcher_stops_the_script() -> None:
    variants = _variants()
    patched = OVERLAY_QMV.read_text().replace("launch(cuda::std::integral_constant<int, 4>{});", "")
    with pytest.raises(SystemExit, match="no longer has exactly one"):
        variants.variant_source(patched)


needs_clone = pytest.mark.skipif(
    mlx_clone() is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)


@needs_clone
@pytest.mark.clone
def test_registers_source_is_the_global_kernel_with_v8() -> None:
    """The registers arm: x from global memory, V in {2, 4, 8}, opt-in routing, one arm line."""
    from patchkit.carry import render, source

    variants = _variants()
    pinned = source.reader(source.ensure_clone(mlx_clone()), PIN_SHA)(variants.QMV)
    out = variants.registers_source(pinned)
    assert re.findall(r"^// bench-arm: .*$", out, re.M) == [
        "// bench-arm: registers MLX_CUDA_QMV_STREAMED=1"
    ]
    launcher = out[out.index("void qmv_streamed(") :]
    assert "if (m <= 4) {\n    launch(cuda::std::integral_constant<int, 4>{});" in launcher
    assert "\n  launch(cuda::std::integral_constant<int, 8>{});\n}" in launcher
    assert "__shared__" not in out[out.index("qmv_streamed_kernel_impl(") :]
    assert 'env::get_var("MLX_CUDA_QMV_STREAMED", 0)' in out
    # The render constant the arm swaps out is back for everything else.
    assert render.STREAMED_VECS == (2, 3, 4, 5)


@needs_clone
@pytest.mark.clone
def test_option_arms_are_the_pinned_file_rendered_with_the_option() -> None:
    """The split, tail, rows1 and bounds arms: the pinned file rendered with their options,
    one arm line; split and rows1 stream every layer (no floor), tail and bounds keep the
    shipped one."""
    from patchkit.carry import render, source

    variants = _variants()
    pinned = source.reader(source.ensure_clone(mlx_clone()), PIN_SHA)(variants.QMV)
    plan = next(p for p in render.load_plans() if p.path == variants.QMV)
    no_floor = {"cuda_stream_min_weights": 0}
    for make, arm, option in (
        (variants.split_source, "split", no_floor),
        (variants.tail_source, "tail", {"cuda_async_tail": True}),
        (variants.rows1_source, "rows1", {"cuda_rows_per_warp": 1, **no_floor}),
        (variants.bounds_source, "bounds", {"cuda_min_blocks_per_sm": 4}),
    ):
        out = make(pinned)
        assert re.findall(r"^// bench-arm: .*$", out, re.M) == [f"// bench-arm: {arm}"]
        options = render.RenderOptions(backends=("cuda",), **option)
        assert out == f"// bench-arm: {arm}\n" + render.render_file(plan, pinned, options)
    assert "concurrent.emplace(encoder);" in variants.split_source(pinned)
    assert "qmv_streamed_min_weights" not in variants.split_source(pinned)
    assert "int tail = steps - full * stage_steps;" in variants.tail_source(pinned)
    assert "qmv_streamed_min_weights = 16777216;" in variants.tail_source(pinned)
    assert "__launch_bounds__(" in variants.bounds_source(pinned)
    assert "constexpr int rows_per_warp = 1;" in variants.rows1_source(pinned)
