"""clang-format at the version MLX's pre-commit pins, for the format tests."""

from __future__ import annotations

import shutil
import subprocess

CLANG_FORMAT_VERSION = "21.1.8"  # the version in MLX's .pre-commit-config.yaml at the pin


def clang_format() -> str | None:
    """Path of a clang-format of exactly that version, else None (the tests skip)."""
    exe = shutil.which("clang-format")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return exe if CLANG_FORMAT_VERSION in out else None
