"""compute-sanitizer's racecheck reports in words, one way for results pages and PR bodies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def race_phrases(races: Sequence[Mapping[str, Any]]) -> list[str]:
    """Pairs of racing accesses (``bench/sanitizer_logs.py``'s ``races``: severity, kernel,
    access, with, reports, hazards) as one phrase per first access. A report names one
    access and every access it races with, so each report is counted once, not per pair."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in races:
        groups.setdefault((r["kernel"], r["severity"], r["access"]), []).append(r)
    phrases = []
    for (kernel, severity, access), pairs in groups.items():
        most = max(p["reports"] for p in pairs)
        withs = " and ".join(
            f"{p['with']} ({p['hazards']:,} hazards"
            + (f", in {p['reports']} of them)" if p["reports"] != most else ")")
            for p in pairs
        )
        phrases.append(f"`{kernel}`: {severity}: {access}, in {most} reports, with {withs}")
    return phrases
