"""The compiled-build timing report: its tables come from the committed JSON and nothing else,
and with more than two arms each comparison reads only the arms that finished a configuration."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmark_results" / "cuda-compiled-h200-2026-12-01.json"


def _report() -> ModuleType:
    return load_script("scripts/cuda_compiled_report.py")


def _row(K: int, bits: int, us: list[float], differing: int = 0) -> dict:
    by_m = [{"M": i + 1, "us": t, "rows_differing": differing} for i, t in enumerate(us)]
    return {"K": K, "N": 4096, "bits": bits, "group_size": 64, "dtype": "bfloat16", "by_m": by_m}


def _failed(K: int, bits: int) -> dict:
    cfg = _row(K, bits, [])
    del cfg["by_m"]
    return {**cfg, "error": "RuntimeError: no kernel image\nmore detail"}


def _four_arms() -> dict[str, Any]:
    """Two readable 8-bit shapes and one tiny one; `mlxcel` wins some cells, `patched` others,
    `v8-rows4` failed on the first shape, and stock's M = 8 (its qmm) is not exact."""
    stock = _row(4096, 8, [20.0] * 8)
    stock["by_m"][7]["rows_differing"] = 8
    return {
        "command": "scripts/cuda_compiled_bench.py --arm stock=python3:$WORK/stock-site",
        "host": {"gpu": "test GPU"},
        "method": "per M: median",
        "complete": True,
        "arms": {
            "stock": {"mlx_version": "0.32.1", "env": {}},
            "patched": {"mlx_version": "dev", "env": {"MLX_CUDA_QMV_EXACT": "1"}},
            "mlxcel": {"mlx_version": "dev", "env": {}},
            "v8-rows4": {"mlx_version": "dev", "env": {}},
        },
        "results": {
            "stock": [stock, _row(8192, 8, [40.0] * 8), _row(1024, 8, [5.0] * 8)],
            "patched": [
                _row(4096, 8, [20.0, 10, 10, 10, 30, 10, 10, 10]),
                _row(8192, 8, [40.0] * 8),
                _row(1024, 8, [9.0] * 8),
            ],
            "mlxcel": [
                _row(4096, 8, [20.0, 8, 12, 8, 8, 12, 8, 40]),
                _row(8192, 8, [40.0] * 8),
                _row(1024, 8, [4.0] * 8),
            ],
            "v8-rows4": [
                _failed(4096, 8),
                _row(8192, 8, [40.0, 20, 20, 20, 20, 20, 20, 20]),
                _row(1024, 8, [5.0] * 8),
            ],
        },
    }


def _cells(lines: list[str], start: str) -> list[str]:
    row = next(line for line in lines if line.startswith(start))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def test_committed_markdown_is_the_json_rendered() -> None:
    """Regenerating the committed page from the committed JSON changes nothing."""
    report = _report()
    data = json.loads(RESULTS.read_text())
    assert report.markdown(data, ["patched"], "stock", RESULTS.name) == (
        RESULTS.with_suffix(".md").read_text()
    )


def test_summary_counts_cells_above_one_on_readable_shapes_only() -> None:
    report = _report()
    stock = [_row(4096, 8, [20.0] * 8), _row(1024, 8, [5.0] * 8)]
    # Readable shape: slower at M = 5 only; tiny shape: slower everywhere (ignored).
    patched = [_row(4096, 8, [20.0, 10, 10, 10, 30, 10, 10, 10]), _row(1024, 8, [9.0] * 8)]
    data = {"results": {"stock": stock, "patched": patched}}
    lines = report.summary(report.pairs(data, "patched", "stock"), "patched", "stock")
    cells = _cells(lines, "| 8 |")
    assert cells[3] == "1.50-1.50 (1/1)"  # M = 5
    assert all(c == "0.50-0.50 (0/1)" for i, c in enumerate(cells) if i != 3)
    assert "spans 1.00-1.80 over all 2 configurations and 1.00-1.00 over the 1" in lines[2]


def test_fastest_per_cell_names_the_winner_its_ratio_and_margin() -> None:
    report = _report()
    lines, wins, inexact = report.fastest(_four_arms(), ["patched", "mlxcel", "v8-rows4"], "stock")
    assert not any(line.startswith("| 1024x4096") for line in lines)  # stock M = 1 < MIN_US
    first = _cells(lines, "| 4096x4096 8-bit")
    # M = 2: mlxcel 8 us, then patched 10; M = 3: patched 10, then mlxcel 12;
    # M = 5: mlxcel 8, then stock 20; M = 8: patched 10, then stock 20 (whose qmm is inexact).
    assert first[0] == "mlxcel 0.40 (0.80)"
    assert first[1] == "patched 0.50 (0.83)"
    assert first[3] == "mlxcel 0.40 (0.40)"
    assert first[6] == "patched 0.50 (0.50)"
    # v8-rows4 failed on 4096: it is never a candidate there; on 8192 it wins every cell.
    assert all(c == "v8-rows4 0.50 (0.50)" for c in _cells(lines, "| 8192x4096 8-bit"))
    assert wins == {"stock": 0, "patched": 3, "mlxcel": 4, "v8-rows4": 7}
    assert set(inexact.values()) == {0}


def test_fastest_per_cell_flags_an_inexact_winner() -> None:
    report = _report()
    lines, wins, inexact = report.fastest(_four_arms(), [], "stock")
    assert _cells(lines, "| 4096x4096 8-bit")[6] == "stock* 1.00 (-)"
    assert wins == {"stock": 14}
    assert inexact == {"stock": 1}  # M = 8 (qmm) of the readable configuration it finished


def test_versus_counts_cells_where_a_is_faster() -> None:
    report = _report()
    lines = report.versus(_four_arms(), "patched", "mlxcel", "stock")
    cells = _cells(lines, "| 4096x4096 8-bit")
    assert cells == ["1.25", "0.83", "1.25", "3.75", "0.83", "1.25", "0.25"]
    # 7 cells per configuration, 3 configurations; the tiny one (9 / 4 = 2.25) is in "all" only.
    assert lines[-1] == (
        "`patched` faster (ratio < 1.00) in 3 of 21 cells, ratios 0.25-3.75; on the 2 "
        "configurations whose M = 1 call takes >= 14 us: 3 of 14, 0.25-3.75."
    )


def test_a_failed_arm_is_skipped_and_reported() -> None:
    report = _report()
    data = _four_arms()
    labels = [report.label(r) for r, _ in report.pairs(data, "v8-rows4", "stock")]
    assert labels == ["8192x4096 8-bit g64 bfloat16", "1024x4096 8-bit g64 bfloat16"]
    page = report.markdown(data, ["patched", "mlxcel", "v8-rows4"], "stock", "x.json")
    assert "| 4096x4096 8-bit g64 bfloat16 | 8 / 36 | 0 / 36 | 0 / 36 | failed |" in page
    assert (
        "- `v8-rows4`: MLX dev, default environment; failed on 1 configuration(s), "
        "first: RuntimeError: no kernel image\n"
    ) in page
    assert "over all 2 configurations" in page  # v8-rows4's summary: only what it finished
    assert "## Head to head" not in page  # no --versus, no section


def test_cli_defaults_to_every_arm_but_the_base_in_json_order(tmp_path: Path) -> None:
    report = _report()
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_four_arms()))
    assert report.main([str(path), "--no-plot", "--versus", "patched", "mlxcel"]) == 0
    page = path.with_suffix(".md").read_text()
    assert page.startswith(
        "# Compiled MLX on CUDA: `patched`, `mlxcel`, `v8-rows4` against `stock`, side by side"
    )
    headings = [line for line in page.splitlines() if line.startswith("#")]
    assert headings.index("### t(`patched`) / t(`mlxcel`)") > headings.index("## Head to head")
    assert [h for h in headings if h.endswith("against `stock`")] == [
        "### `patched` against `stock`",
        "### `mlxcel` against `stock`",
        "### `v8-rows4` against `stock`",
    ]
    assert report.main([str(path), "--no-plot", "--arm", "mlxcel"]) == 0
    assert "`patched`" not in path.with_suffix(".md").read_text().split("## Rows")[1]
    with pytest.raises(SystemExit):
        report.main([str(path), "--no-plot", "--versus", "patched", "peer"])


def test_plot_draws_one_panel_per_bits_and_arm(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = _report()
    out = tmp_path / "bench.png"
    report.plot(_four_arms(), ["patched", "mlxcel", "v8-rows4"], "stock", out)
    assert out.stat().st_size > 0


def test_one_arms_stray_m1_reading_does_not_make_a_shape_readable() -> None:
    """Every arm runs stock's M = 1 kernel: the median of their readings decides, so stock's
    slow first configuration (22 us where three arms read 4) stays out of the summaries, and a
    shape all arms read at 20 us stays in."""
    report = _report()
    stray = [_row(1024, 8, [22.0] * 8), _row(4096, 8, [20.0] * 8)]
    data = {"results": {
        "stock": stray,
        "patched": [_row(1024, 8, [4.0] * 8), _row(4096, 8, [20.0] * 8)],
        "mlxcel": [_row(1024, 8, [4.5] * 8), _row(4096, 8, [19.0] * 8)],
    }}  # fmt: skip
    assert report.readable(stray[0])  # by its own reading, before the median is worked out
    report.with_m1_median(data)
    assert [report.readable(r) for r in stray] == [False, True]
    lines = report.summary(report.pairs(data, "patched", "stock"), "patched", "stock")
    assert "over the 1 whose M = 1 call takes >= 14 us" in lines[2]


def test_by_size_places_the_floor_above_the_last_slower_layer() -> None:
    """Per bit width: the worst M = 2..7 ratio per configuration by n * k, and the smallest
    n * k from which every configuration is within the run's noise (the largest readable
    M = 1 ratio): a small layer slower than that moves the floor above it; a large layer
    slower than that leaves no floor at all."""
    report = _report()
    stock = [_row(1024, 8, [5.0] * 8), _row(4096, 8, [20.0] * 8), _row(8192, 8, [40.0] * 8)]
    arm = [
        _row(1024, 8, [5.0, 9, 5, 5, 5, 5, 5, 5]),  # 1.80 at M = 2: slower
        _row(4096, 8, [21.0, 20, 20, 21, 20, 20, 20, 20]),  # 1.05 at M = 4, M = 1 reads 1.05
        _row(8192, 8, [40.0, 20, 20, 20, 20, 20, 20, 99]),  # M = 8 is not the default route
    ]
    data = {"results": {"stock": stock, "arm": arm}}
    report.with_m1_median(data)
    lines = report.by_size(report.pairs(data, "arm", "stock"), "arm", "stock")
    assert "| 8 | 4,194,304 | 1024x4096 8-bit g64 bfloat16 | 1.80 | 2 |" in lines
    assert "| 8 | 33,554,432 | 8192x4096 8-bit g64 bfloat16 | 0.50 | 2 |" in lines
    assert lines[-1] == "- 8-bit: every M = 2..7 within 1.05 of `stock` from n * k = 16,777,216 up."
    arm[2]["by_m"][5]["us"] = 60.0  # now the largest layer is slower at M = 6
    lines = report.by_size(report.pairs(data, "arm", "stock"), "arm", "stock")
    assert lines[-1] == "- 8-bit: every M = 2..7 within 1.05 of `stock` at no size."


def test_a_runs_caveats_follow_its_method() -> None:
    """What was learnt about a run after it ran travels in its JSON and every rendering of
    it prints it; a run without caveats has no such section."""
    report = _report()
    data = _four_arms()
    plain = report.header(data, ["patched"], "stock", "x.json")
    assert plain[-1] == "Method: per M: median." and "Caveats:" not in plain
    data["caveats"] = ["M = 1 of the first configuration paid a page migration."]
    lines = report.header(data, ["patched"], "stock", "x.json")
    assert lines[-4:] == [
        "Method: per M: median.",
        "",
        "Caveats:",
        "- M = 1 of the first configuration paid a page migration.",
    ]
