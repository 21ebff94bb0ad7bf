"""Write outputs all-or-nothing: stage next to the target, then rename into place.

A rename within one directory is atomic on POSIX, so a reader (or a crash)
sees either the old file/tree or the new one, never a half-written mix. An
update of several paths (a new ``patches/<sha>/``, the old one dropped, a new
``pin.toml``) is one :class:`Transaction`: everything is staged in one
directory, a journal listing the renames is written atomically (the commit
point), then the renames run; :func:`recover` at the next start rolls an
uncommitted transaction back and finishes a committed one, so a kill at any
moment leaves the old state or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

JOURNAL = "journal.json"


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


class Transaction:
    """A multi-path update staged in ``txn_dir`` and committed by one journal write.

    Paths in the journal are relative to ``base`` (the directory whose contents
    change), so a moved checkout still recovers. Every operation is a rename and
    each is idempotent when replayed: install (``stage/x`` -> ``x``, the old
    ``x`` moved to the trash first) and remove (``x`` -> trash). The trash and the
    stage go with the transaction directory at the end.
    """

    def __init__(self, base: Path, txn_dir: Path):
        self.base, self.dir = base, txn_dir
        self.ops: list[dict[str, str]] = []

    @property
    def stage(self) -> Path:
        return self.dir / "stage"

    @classmethod
    def begin(cls, base: Path, txn_dir: Path) -> Transaction:
        """A fresh transaction; an interrupted one in ``txn_dir`` is recovered first."""
        recover(base, txn_dir)
        (txn_dir / "stage").mkdir(parents=True)
        return cls(base, txn_dir)

    def install(self, staged: Path, target: Path) -> None:
        """Put ``staged`` (inside the stage) at ``target`` (under ``base``) on commit."""
        self.ops.append({"op": "install", "from": self._rel(staged), "to": self._rel(target)})

    def remove(self, target: Path) -> None:
        """Drop ``target`` on commit (moved to the trash, then deleted)."""
        self.ops.append({"op": "remove", "path": self._rel(target)})

    def commit(self) -> None:
        """Write the journal (the commit point), then run it; afterwards nothing is left."""
        tmp = self.dir / (JOURNAL + ".tmp")
        tmp.write_text(json.dumps(self.ops))
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / JOURNAL)
        _replay(self.base, self.dir)

    def abort(self) -> None:
        """Forget an uncommitted transaction; a committed one stays for :func:`recover`."""
        if not (self.dir / JOURNAL).is_file():
            shutil.rmtree(self.dir, ignore_errors=True)

    def _rel(self, path: Path) -> str:
        return os.path.relpath(path, self.base)


def _replay(base: Path, txn_dir: Path) -> None:
    """Run (or finish) a committed journal, then delete the transaction directory."""
    trash = txn_dir / "trash"
    trash.mkdir(exist_ok=True)
    for i, op in enumerate(json.loads((txn_dir / JOURNAL).read_text())):
        if op["op"] == "install":
            src, dst = base / op["from"], base / op["to"]
            if src.exists() or src.is_symlink():  # not yet moved in
                if dst.exists():
                    os.replace(dst, trash / f"{i}")
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
        elif op["op"] == "remove":
            path = base / op["path"]
            if path.exists():
                os.replace(path, trash / f"{i}")
    # Journal first: a kill during the deletion below leaves an uncommitted
    # directory, which recovery simply deletes.
    (txn_dir / JOURNAL).unlink()
    shutil.rmtree(txn_dir)


def recover(base: Path, txn_dir: Path) -> str | None:
    """Finish or roll back an interrupted transaction; returns what was done, or None."""
    if not txn_dir.exists():
        return None
    if (txn_dir / JOURNAL).is_file():
        _replay(base, txn_dir)
        return "completed"
    shutil.rmtree(txn_dir)
    return "rolled back"
