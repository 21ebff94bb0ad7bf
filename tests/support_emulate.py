"""Mutations of the patched kernel text, for the tests that show a check can fail."""

from __future__ import annotations

import dataclasses
import re

from patchkit.verify import emulate


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
