"""The CPU parity gate ``patchkit rebase`` runs before it writes: the emulator's quick suites.

:func:`patchkit.carry.rebase.rebase` takes its gates as arguments, so the
pipeline never imports the verifier; the CLI passes these two. Each runs the
quick suite on the new tree's header as upstream has it and with the patch
rendered in, and returns the part of the report rebase judges.
"""

from __future__ import annotations

from collections.abc import Callable

from patchkit.carry.rebase import Parity
from patchkit.verify.emulate import Sources, verify_fp_header, verify_header


def emulator_parity(
    upstream_header: str, patched_header: str, say: Callable[[str], None] | None = None
) -> Parity:
    """The affine suite (``verify_header``, quick mode) on the new ``quantized.h``."""
    report = verify_header(Sources(upstream_header, patched_header), quick=True, say=say)
    return Parity(bool(report.ok), str(report.summary), tuple(report.failures))


def emulator_fp_parity(
    upstream_header: str,
    patched_header: str,
    types: tuple[str, str],
    say: Callable[[str], None] | None = None,
) -> Parity:
    """The fp suite (``verify_fp_header``, quick mode) on the new ``fp_quantized.h``."""
    report = verify_fp_header(Sources(upstream_header, patched_header), types, quick=True, say=say)
    return Parity(bool(report.ok), str(report.summary), tuple(report.failures))
