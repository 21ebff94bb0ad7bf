"""patchkit's one cache folder and the named subfolders in it.

Everything patchkit keeps between runs lives under one root, so one variable
moves (or isolates) all of it: ``PATCHKIT_CACHE_DIR``, else the platform's user
cache folder (``platformdirs``). Nothing is created here; each owner creates
its subfolder when it first writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import platformdirs

ENV = "PATCHKIT_CACHE_DIR"

Folder = Literal["clones", "deps", "builds", "emulate", "wheels", "tools", "locks"]
FOLDERS: tuple[Folder, ...] = ("clones", "deps", "builds", "emulate", "wheels", "tools", "locks")
# clones   bare clones of MLX, one per source (carry.source)
# deps     third-party sources an offline MLX build reads (carry.mlx_deps)
# builds   one worktree, venv, wheel and log per backend and pin (carry.mlx_build)
# emulate  the emulator's compiled kernel libraries (verify.emulate.build)
# wheels   mlx-cpu wheels and their extracted headers (carry.wheels)
# tools    venvs of the formatters MLX's pre-commit pins (carry.export_pr)
# locks    lock files of checkouts that have no git directory


def root() -> Path:
    """The cache root: ``PATCHKIT_CACHE_DIR``, else the user cache folder for patchkit."""
    override = os.environ.get(ENV)
    return Path(override).expanduser() if override else platformdirs.user_cache_path("patchkit")


def folder(name: Folder) -> Path:
    """One named subfolder of the cache root (not created)."""
    if name not in FOLDERS:
        raise ValueError(f"unknown cache folder {name!r}; one of {FOLDERS}")
    return root() / name
