"""What patchkit keeps in its cache, and freeing it (``patchkit clean``).

Only the cache root (``PATCHKIT_CACHE_DIR`` or the user cache folder) is read or removed,
never a checkout or a venv a user named. An entry a running patchkit holds (a build, a
clone, the dependency folder: each has its lock) is skipped and named, not torn: it is
renamed away under its lock, then deleted, so no reader ever sees half of it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from patchkit.util import cache, staging

# Freed by `patchkit clean --yes` with no names: rebuilt or refilled on the next run that
# needs them, from what is already on this machine.
DEFAULT: tuple[cache.Folder, ...] = ("builds", "emulate", "wheels", "tools")
# Freed only when named: a refill needs the network (or `patchkit deps --from` again), and
# the clones hold apply's branches (apply makes them again).
NAMED_ONLY: tuple[cache.Folder, ...] = ("clones", "deps")
WHAT = {
    "builds": "MLX worktrees, venvs, wheels and logs of `patchkit build`",
    "clones": "bare MLX clones with apply's branches (refetched and re-applied on demand)",
    "deps": "MLX's build dependencies for offline builds (`patchkit deps` refills)",
    "emulate": "the emulator's compiled kernels (recompiled on demand)",
    "wheels": "stock mlx-cpu wheels and their headers (downloaded again on demand)",
    "tools": "venvs of MLX's formatter pins for export-pr (made again on demand)",
}


@dataclass(frozen=True)
class Entry:
    """One removable thing in the cache, and the lock its owner holds while using it."""

    folder: cache.Folder
    path: Path
    lock: Path | None

    @property
    def size(self) -> int:
        return tree_size(self.path)


def tree_size(path: Path) -> int:
    """Bytes under ``path`` (files only, links not followed); 0 when absent."""
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(base, name)).st_size
    return total


def entries(folder: cache.Folder) -> list[Entry]:
    """The removable entries of one cache folder, each with its owner's lock (or None)."""
    where = cache.folder(folder)
    if not where.is_dir():
        return []
    if folder == "builds":  # one lock per build, beside it (mlx_build.execute)
        return [Entry(folder, d, where / f"{d.name}.lock") for d in sorted(where.iterdir())
                if d.is_dir()]  # fmt: skip
    if folder == "clones":  # one lock per clone, inside it (source.locked_clone)
        return [Entry(folder, d, d / "patchkit.lock") for d in sorted(where.iterdir())
                if d.is_dir()]  # fmt: skip
    if folder == "deps":  # one filler at a time (mlx_deps.fill)
        return [Entry(folder, where, where.parent / f"{where.name}.lock")]
    return [Entry(folder, where, None)]


def usage() -> list[dict[str, object]]:
    """Each cache folder's size and meaning, for ``patchkit clean`` without ``--yes``."""
    rows = []
    for folder in (*DEFAULT, *NAMED_ONLY):
        rows.append({
            "folder": folder, "path": str(cache.folder(folder)),
            "bytes": sum(e.size for e in entries(folder)), "what": WHAT[folder],
            "freed_by_default": folder in DEFAULT,
        })  # fmt: skip
    return rows


def free(folders: tuple[cache.Folder, ...]) -> dict[str, list[str]]:
    """Remove the entries of ``folders``; returns what was removed and what was in use."""
    removed, busy = [], []
    trash = cache.root() / ".trash"
    if trash.is_dir():  # what a killed clean left half-deleted
        staging.prune_scratch(trash)
    for folder in folders:
        for entry in entries(folder):
            try:
                if entry.lock is None:
                    _remove(entry.path, trash)
                else:
                    with staging.exclusive(entry.lock, wait=False):
                        _remove(entry.path, trash)
            except staging.Busy:
                busy.append(str(entry.path))
                continue
            removed.append(str(entry.path))
    return {"removed": removed, "in_use": busy}


def _remove(path: Path, trash: Path) -> None:
    """Rename ``path`` into the trash (one atomic step readers see), then delete it there."""
    trash.mkdir(parents=True, exist_ok=True)
    gone = staging.scratch_dir("clean", trash)
    os.replace(path, gone / path.name)
    shutil.rmtree(gone, ignore_errors=True)
