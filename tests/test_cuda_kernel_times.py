"""The kernel-time reader: ncu's raw CSV, and the marker attribution of kernels to M."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cuda_kernel_times.py"


def _module():
    return load_script("scripts/cuda_kernel_times.py")


def _csv(rows: list[tuple[int, str, str]], unit: str = "nsecond") -> str:
    """A CSV shaped like ``ncu --csv --page raw``: ==PROF== lines, header, units, rows."""
    head = '"ID","Process ID","Kernel Name","gpu__time_duration.sum"'
    units = f'"","","","{unit}"'
    body = [f'"{i}","77","{name}","{value}"' for i, name, value in rows]
    return "\n".join(["==PROF== Connected to process 77", head, units, *body]) + "\n"


def test_parse_reads_names_and_durations_in_launch_order() -> None:
    kt = _module()
    text = _csv([(1, "void cu::qmv_kernel<8>(...)", "2,500"), (0, "cu::arange<float>", "1000")])
    assert kt.parse_ncu_csv(text) == [
        ("cu::arange<float>", 1.0),
        ("void cu::qmv_kernel<8>(...)", 2.5),
    ]
    assert kt.parse_ncu_csv(_csv([(0, "k", "3")], "usecond")) == [("k", 3.0)]
    assert kt.parse_ncu_csv(_csv([(0, "k", "3")], "us")) == [("k", 3.0)]
    no_units = "\n".join(ln for ln in _csv([(0, "k", "3000")]).splitlines() if '""' not in ln)
    assert kt.parse_ncu_csv(no_units) == [("k", 3.0)]  # --print-units base: ns
    with pytest.raises(ValueError, match="unknown unit 'cycle'"):
        kt.parse_ncu_csv(_csv([(0, "k", "3")], "cycle"))
    with pytest.raises(ValueError, match="Kernel Name"):
        kt.parse_ncu_csv("==PROF== nothing profiled\n")


def test_kernels_between_markers_are_that_ms_calls() -> None:
    kt = _module()
    setup = [("random_bits", 9.0), ("affine_quantize", 9.0)]
    kernels = [
        *setup,
        ("cu::arange<int>", 1.0), ("qmv_kernel", 2.0), ("qmv_kernel", 4.0),  # M = 1, 2 calls
        ("cu::arange<int>", 1.0), ("qmv_streamed_kernel", 3.0), ("qmv_kernel", 1.0),
        ("qmv_streamed_kernel", 3.0), ("qmv_kernel", 1.0),  # M = 2: two kernels a call
    ]  # fmt: skip
    got = kt.per_m(kernels, (1, 2), calls=2)
    assert got[1] == {"us_per_call": 3.0, "kernels_per_call": 1, "kernels": ["qmv_kernel"]}
    assert got[2]["us_per_call"] == 4.0 and got[2]["kernels_per_call"] == 2
    with pytest.raises(ValueError, match="marker blocks"):
        kt.per_m(kernels, (1, 2, 3), calls=2)
    with pytest.raises(ValueError, match="kernels for 3 calls"):
        kt.per_m(kernels, (1, 2), calls=3)


def test_launch_runs_on_any_mlx() -> None:
    """The profiled process itself, on whatever device this MLX has (no ncu here)."""
    pytest.importorskip("mlx.core")
    cfg = '{"K": 256, "N": 64, "bits": 4, "group_size": 64, "dtype": "float16"}'
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--launch", cfg, "--calls", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_median_per_m_skips_failed_rounds() -> None:
    kt = _module()
    rounds = [
        {1: {"us_per_call": 3.0}, 2: {"us_per_call": 5.0}},
        {"error": "ncu exited 1"},
        {1: {"us_per_call": 1.0}, 2: {"us_per_call": 7.0}},
    ]
    assert kt.median_per_m(rounds) == {1: 2.0, 2: 6.0}
    assert kt.median_per_m([{"error": "x"}]) == {}


def test_report_is_ratios_to_the_base_arm() -> None:
    kt = _module()
    payload = {
        "method": "m",
        "results": [
            {"K": 1024, "N": 1024, "bits": 8, "group_size": 128, "dtype": "bfloat16",
             "median_us": {"stock": {"1": 2.0, "2": 4.0}, "patched": {"1": 2.0, "2": 3.0}}}
        ],
    }  # fmt: skip
    text = kt.report(payload, "stock")
    assert "### 1024x1024 8-bit g128 bfloat16" in text
    assert "| `stock`, us | 2.00 | 4.00 |" in text
    assert "| `patched` | 1.00 | 0.75 |" in text
