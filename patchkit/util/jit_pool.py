"""Compiled kernels shared between test processes that each keep their own JIT cache.

Why: MLX's CUDA backend writes each NVRTC-compiled module into ``MLX_PTX_CACHE_DIR``
with plain ofstreams (``<module>.ptx``, ``.txt``, ``.cu``, closed together when the write
returns) and takes a module from there whenever its ``.ptx`` exists, so processes sharing
one folder can read a half-written file. Each test process therefore keeps its own
folder, and this pool lets it start with every module an earlier process finished:

- a folder is published only after its process exited on its own (every write closed);
  each file enters the pool by an atomic rename, the ``.ptx`` last, so a module whose
  ``.ptx`` is in the pool is whole;
- a process is seeded, before it starts, with hard links to the pool's whole modules
  (no copies: MLX opens a module it finds only to read it);
- a process that was stopped or crashed may have been killed inside a write: its folder
  loses the module written last (MLX writes one at a time) and any without its ``.txt``,
  and nothing of it is published.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

PTX = ".ptx"
COMPANIONS = (".txt", ".cu")  # written with the .ptx; placed before it


def _modules(folder: Path) -> list[Path]:
    """The ``.ptx`` files under ``folder`` (MLX nests folders for long module names)."""
    return sorted(folder.rglob("*" + PTX)) if folder.is_dir() else []


def _place(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s content in one rename: a hard link, or a copy where the
    file system has none."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = dst.with_name(f"{dst.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        os.link(src, part)
    except OSError:
        shutil.copy2(src, part)
    os.replace(part, dst)


def _files(ptx: Path) -> list[Path]:
    """A module's files, its ``.ptx`` last (the order they are placed in)."""
    return [ptx.with_suffix(s) for s in COMPANIONS] + [ptx]


def _move_module(ptx: Path, src_root: Path, dst_root: Path) -> None:
    """One module's files from ``src_root`` to the same place under ``dst_root``, the
    ``.ptx`` last."""
    for src in _files(ptx):
        if src.exists():
            _place(src, dst_root / src.relative_to(src_root))


def _carry_missing(src_root: Path, dst_root: Path) -> int:
    """Place each module of ``src_root`` that ``dst_root`` lacks there; how many."""
    added = 0
    for ptx in _modules(src_root):
        if not (dst_root / ptx.relative_to(src_root)).exists():
            _move_module(ptx, src_root, dst_root)
            added += 1
    return added


def count(root: Path, pool: str, prefix: str) -> int:
    """Modules a split run under ``root`` can start with, each counted once by its path:
    those of the ``pool`` folder and those kept in the folders of earlier processes whose
    names start with ``prefix`` (a process stopped at a deadline keeps its folder, minus
    its torn last module, and its next run reuses it)."""
    folders = [root / pool, *(d for d in root.glob(prefix + "*") if d.is_dir())]
    return len({ptx.relative_to(d) for d in folders for ptx in _modules(d)})


def seed(pool: Path, folder: Path) -> int:
    """Link each whole module of ``pool`` that ``folder`` lacks into it; how many."""
    return _carry_missing(pool, folder)


def publish(folder: Path, pool: Path) -> int:
    """Add each module of ``folder`` (a process that exited on its own) that ``pool``
    lacks; how many."""
    return _carry_missing(folder, pool)


def drop_torn(folder: Path) -> list[Path]:
    """After a process was killed: remove from ``folder`` the module written last and
    any ``.ptx`` without its ``.txt`` (maybe half-written); the ``.ptx`` files removed."""
    modules = _modules(folder)
    torn = {ptx for ptx in modules if not ptx.with_suffix(".txt").exists()}
    if modules:
        torn.add(max(modules, key=lambda p: p.stat().st_mtime_ns))
    for ptx in torn:
        for path in _files(ptx):
            path.unlink(missing_ok=True)
    return sorted(torn)
