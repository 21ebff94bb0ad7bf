"""Our hunks in every patched upstream file are clang-format clean, as MLX's pre-commit asks.

Upstream files are not all clang-format clean themselves, so only the lines the
patch adds are checked: ``clang-format --lines`` over each hunk of the overlay
copy, with MLX's own ``.clang-format`` from the pinned tree. Needs the clone
(for that config) and clang-format 21.1.8 (the version in MLX's
.pre-commit-config.yaml at the pin); skips with a reason otherwise.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support_format import CLANG_FORMAT_VERSION, clang_format
from support_git import mlx_clone

from patchkit.carry import export, pin, source
from patchkit.util import git

ROOT = Path(__file__).resolve().parent.parent
CXX = (".h", ".cpp", ".cu", ".metal")


pytestmark = [
    pytest.mark.skipif(
        clang_format() is None,
        reason=f"needs clang-format {CLANG_FORMAT_VERSION}: "
        f"pip install clang-format=={CLANG_FORMAT_VERSION}",
    ),
    pytest.mark.skipif(
        mlx_clone() is None,
        reason="needs MLX's .clang-format from a clone: set PATCHKIT_MLX_REPO=/path/to/mlx",
    ),
]


def _added_ranges(header: str) -> list[tuple[int, int]]:
    """Line ranges (1-based, inclusive) of the new side of each hunk listed in an overlay header."""
    ranges = []
    for start, count in re.findall(r"@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", header):
        n = int(count or 1)
        if n:
            ranges.append((int(start), int(start) + n - 1))
    return ranges


def _overlay_files() -> list[Path]:
    p = pin.load(ROOT / "pin.toml")
    base = ROOT / "patches" / p.short / "overlay"
    return sorted(f for f in base.rglob("*") if f.suffix in CXX)


@pytest.mark.parametrize("overlay", _overlay_files(), ids=lambda f: f.name)
def test_patch_hunks_are_clang_format_clean(overlay: Path, tmp_path: Path) -> None:
    p = pin.load(ROOT / "pin.toml")
    upstream_path = overlay.relative_to(ROOT / "patches" / p.short / "overlay").as_posix()
    text = overlay.read_text()
    body = export.strip_header(upstream_path, text)
    ranges = _added_ranges(text[: len(text) - len(body)])
    assert ranges, f"{upstream_path}: its overlay header lists no hunks"
    clone = source.ensure_clone(source.source_spec(mlx_clone()))
    (tmp_path / ".clang-format").write_text(git.show_file(clone, p.commit, ".clang-format"))
    target = tmp_path / Path(upstream_path).name
    target.write_text(body)
    lines = [f"--lines={a}:{b}" for a, b in ranges]
    formatted = subprocess.run(
        [clang_format(), *lines, str(target)], capture_output=True, text=True, check=True
    ).stdout
    assert formatted == body, f"{upstream_path}: clang-format would change the patch's lines"
