"""The compiled bench's cold weights: bit-identical copies adding up to more than L2.

Runs on the CPU build of MLX; the timing itself is the GPU host's, the bookkeeping is here.
"""

from __future__ import annotations

import numpy as np
import pytest
from support_scripts import load_script

mx = pytest.importorskip("mlx.core", reason="needs MLX (the `mlx` extra)")

CFG = {"K": 256, "N": 64, "bits": 4, "group_size": 64, "dtype": "bfloat16"}


def _bench():
    return load_script("scripts/cuda_compiled_bench.py")


def test_copies_add_up_to_the_cold_size() -> None:
    bench = _bench()
    one = bench.weight_bytes(CFG)
    assert one == 64 * 256 // 2 + 2 * 64 * 4 * 2  # packed 4-bit values, bf16 scales and biases
    assert bench.weight_copies(CFG, 0) == 1  # warm: one set
    assert bench.weight_copies(CFG, 10 * one) == 10
    assert bench.weight_copies(CFG, 10 * one + 1) == 11  # at least the cold size
    assert bench.weight_copies(CFG, 1) == 2  # a cold run always rotates
    assert bench.weight_copies(CFG, 10**12) == bench.MAX_COPIES


def test_every_copy_gives_the_same_bits() -> None:
    """The rotation changes where the weights come from, never the result."""
    bench = _bench()
    qmm, xs = bench.problem(CFG, copies=3)
    x = xs[:2]
    first = np.array(qmm(x, 0).view(mx.uint16))
    for i in (1, 2, 5):
        assert np.array_equal(np.array(qmm(x, i).view(mx.uint16)), first)


def test_measure_records_the_copies() -> None:
    bench = _bench()
    cold = 3 * bench.weight_bytes(CFG)
    got = bench.measure(CFG, iters=1, repeats=1, min_repeat_us=0, cold_bytes=cold)
    assert got["weight_copies"] == 3
    assert [r["M"] for r in got["by_m"]] == list(bench.MS)
    assert all(r["us"] > 0 for r in got["by_m"])


def test_every_copy_is_touched_before_the_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """problem() hands back its copies already read once each (unified memory moved to the
    GPU), so the first M timed does not pay the move."""
    bench = _bench()
    touched: list[int] = []
    real = bench.touch_every_copy

    def spy(qmm, xs, copies):
        def counting(x, i=0):
            touched.append(i)
            return qmm(x, i)

        real(counting, xs, copies)

    monkeypatch.setattr(bench, "touch_every_copy", spy)
    bench.problem(CFG, copies=4)
    assert touched == [0, 1, 2, 3]
