"""Write outputs all-or-nothing: stage next to the target, then rename into place.

A rename within one directory is atomic on POSIX, so a reader (or a crash)
sees either the old file/tree or the new one, never a half-written mix.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` via a sibling temp file; return False if it was already equal.

    Bytes are compared and written without newline translation, so what lands on
    disk is exactly ``text`` (UTF-8). Unchanged files are left alone so their
    timestamps stay put.
    """
    data = text.encode("utf-8", "surrogateescape")
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def swap_dir(new: Path, target: Path) -> None:
    """Replace directory ``target`` by ``new`` (same parent), keeping the old one until done."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        old.rmdir()
        os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old)


def same_tree(a: Path, b: Path) -> list[str]:
    """Relative paths that differ between two directory trees (missing on one side counts)."""

    def files(root: Path) -> dict[str, bytes]:
        if not root.exists():
            return {}
        return {
            p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
        }

    fa, fb = files(a), files(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
