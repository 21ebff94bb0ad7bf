"""The compiled-build timing report: its tables come from the committed JSON and nothing else."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmark_results" / "cuda-compiled-h200-2026-12-01.json"


def _report() -> ModuleType:
    path = ROOT / "scripts" / "cuda_compiled_report.py"
    spec = importlib.util.spec_from_file_location("cuda_compiled_report", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(K: int, bits: int, us: list[float], differing: int = 0) -> dict:
    by_m = [{"M": i + 1, "us": t, "rows_differing": differing} for i, t in enumerate(us)]
    return {"K": K, "N": 4096, "bits": bits, "group_size": 64, "dtype": "bfloat16", "by_m": by_m}


def test_committed_markdown_is_the_json_rendered() -> None:
    """Regenerating the committed page from the committed JSON changes nothing."""
    report = _report()
    data = json.loads(RESULTS.read_text())
    assert report.markdown(data, "patched", "stock", RESULTS.name) == (
        RESULTS.with_suffix(".md").read_text()
    )


def test_summary_counts_cells_above_one_on_readable_shapes_only() -> None:
    report = _report()
    stock = [_row(4096, 8, [20.0] * 8), _row(1024, 8, [5.0] * 8)]
    # Readable shape: slower at M = 5 only; tiny shape: slower everywhere (ignored).
    patched = [_row(4096, 8, [20.0, 10, 10, 10, 30, 10, 10, 10]), _row(1024, 8, [9.0] * 8)]
    data = {"results": {"stock": stock, "patched": patched}}
    lines = report.summary(report.pairs(data, "patched", "stock"), "patched", "stock")
    row = next(line for line in lines if line.startswith("| 8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert cells[3] == "1.50-1.50 (1/1)"  # M = 5
    assert all(c == "0.50-0.50 (0/1)" for i, c in enumerate(cells) if i != 3)
    assert "spans 1.00-1.80 over all configurations" in lines[2]
