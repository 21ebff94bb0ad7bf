"""Mutations of the patched kernel text, for the tests that show a check can fail, and the
checks every kernel family's matrix report must pass."""

from __future__ import annotations

import dataclasses
import re

from patchkit.verify import emulate
from patchkit.verify.emulate import suite


def loose(snippet: str) -> re.Pattern[str]:
    """``snippet`` as a pattern that allows any whitespace between its tokens."""
    tokens = re.findall(r"\w+|[^\w\s]", snippet)
    return re.compile(r"\s*".join(re.escape(t) for t in tokens))


def mutate(src: emulate.Sources, old: str, new: str, count: int) -> emulate.Sources:
    """``src`` with ``old`` (whitespace-insensitive) replaced by ``new`` in the patched text.

    The patched text must hold ``old`` exactly ``count`` times: a mutation that
    silently matches nothing would make its test prove nothing.
    """
    text, n = loose(old).subn(lambda _: new, src.patched)
    assert n == count, (old, n, count)
    return dataclasses.replace(src, patched=text)


def assert_streamed_equal_m1(report: suite.Report) -> None:
    """Every streamed row equals upstream's M = 1 bit for bit, and every output element's
    simd_sum was handed the M = 1 kernel's 32 per-lane values, each recorded call's key
    confirmed by the kernel's own store (sums.py)."""
    assert report.streamed(), "no streamed cases ran"
    assert report.failures() == []
    for r in report.streamed():
        assert r.sum_inputs == r.case.B * r.case.M * r.case.N, r.case.label()
        assert (r.sum_inputs_differing, r.sum_calls_unconfirmed) == (0, 0), r.case.label()
