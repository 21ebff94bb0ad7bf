"""The rebase gate judges the fp kernels too: fp_quantized.h goes through the fp suite.

The suites themselves are tested in test_emulate*.py; here the seam is checked:
the patched fp header and the new tree's fp4.h/fp8.h reach the fp check, and
its verdict refuses or accepts the rebase.
"""

from __future__ import annotations

import pytest

from patchkit.carry import rebase, render

FP = rebase.FP_PARITY_FILE
OK = rebase.Parity(True, "fine")
BAD = rebase.Parity(False, "1 differing", ("[gcc] nvfp4 K=512 ...: 1/2 rows differ",))


def _rendered() -> render.Rendered:
    return render.Rendered({FP: "up"}, {FP: "patched fp"}, {FP: "overlay fp"}, {FP: "metal"})


def _reader(path: str) -> str:
    return {"mlx/backend/metal/kernels/fp4.h": "fp4", "mlx/backend/metal/kernels/fp8.h": "fp8"}[
        path
    ]


@pytest.mark.parametrize(
    "verdict, called, refused",
    [
        (OK, {}, False),  # nothing changed, suite passes
        (OK, {FP: ["qdot"]}, False),  # a called function changed, suite passes: accepted
        (BAD, {}, True),  # suite fails: refused
        (None, {FP: ["qdot"]}, True),  # suite unavailable while a called function changed
        (None, {}, False),  # unavailable, nothing to judge
    ],
)
def test_fp_gate(verdict: rebase.Parity | None, called: dict, refused: bool) -> None:
    seen: list[tuple[str, tuple[str, str]]] = []

    def fp_check(upstream: str, text: str, types: tuple[str, str]) -> rebase.Parity | None:
        seen.append((text, types))
        return verdict

    result = rebase.RebaseResult("a" * 40, "b" * 40, changed_called=called)
    if refused:
        with pytest.raises(rebase.RebaseRefused):
            rebase.gate_parity(result, _rendered(), lambda _u, _p: OK, fp_check, _reader)
    else:
        rebase.gate_parity(result, _rendered(), lambda _u, _p: OK, fp_check, _reader)
        assert result.fp_parity == verdict
    assert seen == [("patched fp", ("fp4", "fp8"))]
