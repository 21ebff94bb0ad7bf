"""Fail (exit 1) if any benchmark JSON reports a batched row that differs from M = 1.

Reads ``patchkit bench`` output (``rows_differing`` counts) and the PR benchmark's
``--json`` output of the patched build (``rows_match``). The stock build's file is not
checked: stock reorders, so its rows are expected to differ.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path


def differing(node: object, where: str = "") -> Iterator[str]:
    """Paths inside a JSON value whose ``rows_differing`` > 0 or ``rows_match`` is false."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "rows_differing" and isinstance(value, int) and value > 0:
                yield f"{where}.{key}={value}"
            elif key == "rows_match" and value is False:
                yield f"{where}.{key}=false"
            else:
                yield from differing(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from differing(value, f"{where}[{i}]")


def main(paths: list[str]) -> int:
    """Print each differing entry; 1 if any (or a file is missing), else 0."""
    bad = 0
    for path in paths:
        if not Path(path).is_file():
            print(f"{path}: missing")
            bad += 1
            continue
        for hit in differing(json.loads(Path(path).read_text())):
            print(f"{path}: {hit}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
