"""Write outputs all-or-nothing: stage next to the target, then rename into place.

A rename within one directory is atomic on POSIX, so a reader (or a crash)
sees either the old file/tree or the new one, never a half-written mix. An
update of several paths (a new ``patches/<sha>/``, the old one dropped, a new
``pin.toml``) is one :class:`Transaction`: everything is staged in one
directory, a journal listing the renames is written atomically (the commit
point), then the renames run; :func:`recover` at the next start rolls an
uncommitted transaction back and finishes a committed one, so a kill at any
moment leaves the old state or the new one. :func:`view` lets a read-only
command see that state without recovering it.

The module also holds the other pieces of "nothing torn, nothing left behind":
:func:`exclusive`, an inter-process lock (``filelock``) that a second writer
waits on or is refused by, and :func:`scratch_dir`, temporary folders tagged
with their owner's process id so the next run can prune those of killed runs
(:func:`prune_scratch`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

from patchkit.errors import UserError
from patchkit.util import read_state_text

JOURNAL = "journal.json"
# Tests only: SIGKILL this process just before its N-th rename (every os.replace this
# module makes, staging writes included), to prove a kill anywhere leaves old or new.
KILL_AT_RENAME = "PATCHKIT_TEST_KILL_AT_RENAME"
_renames = 0


def _replace(src: Path | str, dst: Path | str) -> None:
    """``os.replace`` with the test hook above; the only way this module renames."""
    global _renames
    _renames += 1
    if os.environ.get(KILL_AT_RENAME) == str(_renames):
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace(src, dst)


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
        _replace(tmp, path)
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

    def __init__(self, base: Path, txn_dir: Path, allowed: tuple[str, ...] = ()):
        self.base, self.dir, self.allowed = base, txn_dir, allowed
        self.ops: list[dict[str, str]] = []

    @property
    def stage(self) -> Path:
        return self.dir / "stage"

    @classmethod
    def begin(cls, base: Path, txn_dir: Path, allowed: tuple[str, ...] = ()) -> Transaction:
        """A fresh transaction; an interrupted one in ``txn_dir`` is recovered first.

        ``allowed``: the top-level names under ``base`` it may change (every journal read
        back is held to them, :func:`read_journal`); empty: anything inside ``base``.
        """
        recover(base, txn_dir, allowed)
        (txn_dir / "stage").mkdir(parents=True)
        return cls(base, txn_dir, allowed)

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
        _replace(tmp, self.dir / JOURNAL)
        _replay(self.base, self.dir, self.allowed)

    def abort(self) -> None:
        """Forget an uncommitted transaction; a committed one stays for :func:`recover`."""
        if not (self.dir / JOURNAL).is_file():
            shutil.rmtree(self.dir, ignore_errors=True)

    def _rel(self, path: Path) -> str:
        return os.path.relpath(path, self.base)


class UnsafeJournal(UserError):
    """A journal entry that is malformed or names a path outside where it belongs."""

    def __init__(self, txn_dir: Path, why: str):
        super().__init__(
            f"refusing the interrupted write in {txn_dir}: {why}; nothing was touched"
            " (look at it, then delete that folder)"
        )


def _relative(op: dict, key: str, i: int) -> str:
    """Entry ``i``'s path ``key``: a non-empty relative path, else ValueError."""
    path = op.get(key)
    if not isinstance(path, str) or not path or os.path.isabs(path):
        raise ValueError(f"journal entry {i}: {key} {path!r} is not a relative path")
    return path


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


JOURNAL_FIELDS = {"install": ("from", "to"), "remove": ("path",)}


def read_journal(base: Path, txn_dir: Path, allowed: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """The committed journal's operations, each checked before any is run.

    The journal is read from disk, where anything may have put it (a tarball, a shared
    folder, a cache), so every path must resolve, symbolic links followed, inside the
    place it belongs: an install's source inside the transaction's stage, its target and
    a removal strictly inside ``base``, outside the transaction directory, and under one
    of the ``allowed`` top-level names when given. Anything else raises
    :class:`UnsafeJournal` naming the entry, and nothing has been touched.
    """
    try:
        ops = json.loads(read_state_text(txn_dir / JOURNAL))
        return _checked_ops(base, txn_dir, ops, allowed)
    except (OSError, ValueError) as exc:
        raise UnsafeJournal(txn_dir, str(exc)) from exc


def _checked_ops(
    base: Path, txn_dir: Path, ops: object, allowed: tuple[str, ...]
) -> list[dict[str, str]]:
    """``ops`` if every entry is well formed and contained (:func:`read_journal`)."""
    if not isinstance(ops, list):
        raise ValueError(f"{JOURNAL} is not a list of operations")
    real_base, real_txn = base.resolve(), txn_dir.resolve()
    for i, op in enumerate(ops):
        name = op.get("op") if isinstance(op, dict) else None
        keys = JOURNAL_FIELDS.get(name) if isinstance(name, str) else None
        if keys is None or set(op) != {"op", *keys}:
            raise ValueError(f"journal entry {i}: not an install or remove operation: {op!r}")
        for key in keys:
            real = (base / _relative(op, key, i)).resolve()
            if key == "from":
                ok, where = _within(real, real_txn / "stage"), "the transaction's stage"
            else:
                top = real.relative_to(real_base).parts[0] if real_base in real.parents else ""
                ok = bool(top) and not _within(real, real_txn) and (not allowed or top in allowed)
                where = f"{base} ({', '.join(allowed) or 'any path'}, outside {txn_dir.name})"
            if not ok:
                raise ValueError(f"journal entry {i}: {key} {op[key]!r} is not inside {where}")
    return ops


def _replay(base: Path, txn_dir: Path, allowed: tuple[str, ...] = ()) -> None:
    """Run (or finish) a committed journal, then delete the transaction directory."""
    ops = read_journal(base, txn_dir, allowed)  # every entry checked before the first rename
    trash = txn_dir / "trash"
    trash.mkdir(exist_ok=True)
    for i, op in enumerate(ops):
        if op["op"] == "install":
            src, dst = base / op["from"], base / op["to"]
            if src.exists() or src.is_symlink():  # not yet moved in
                if dst.exists():
                    _replace(dst, trash / f"{i}")
                dst.parent.mkdir(parents=True, exist_ok=True)
                _replace(src, dst)
        elif op["op"] == "remove":
            path = base / op["path"]
            if path.exists():
                _replace(path, trash / f"{i}")
    # Journal first: a kill during the deletion below leaves an uncommitted
    # directory, which recovery simply deletes.
    (txn_dir / JOURNAL).unlink()
    shutil.rmtree(txn_dir)


def recover(base: Path, txn_dir: Path, allowed: tuple[str, ...] = ()) -> str | None:
    """Finish or roll back an interrupted transaction; returns what was done, or None."""
    if not txn_dir.exists():
        return None
    if (txn_dir / JOURNAL).is_file():
        _replay(base, txn_dir, allowed)
        return "completed"
    shutil.rmtree(txn_dir)
    return "rolled back"


def pending(txn_dir: Path) -> str | None:
    """State of an interrupted transaction, read only: "committed", "uncommitted" or None.

    Committed: the journal was written, so the new state is the outcome and the next
    writer finishes the renames. Uncommitted: the old state stands and the next writer
    deletes the leftover.
    """
    if (txn_dir / JOURNAL).is_file():
        return "committed"
    return "uncommitted" if txn_dir.exists() else None


def view(base: Path, txn_dir: Path, target: Path, allowed: tuple[str, ...] = ()) -> Path | None:
    """Where ``target``'s committed content is now (None: absent), without recovering.

    Between the journal and the end of its renames the new file may still sit in the
    stage; a read-only command reads it there, so it sees the new state whole.
    """
    if pending(txn_dir) != "committed":
        return target if target.exists() else None
    rel = os.path.relpath(target, base)
    for op in read_journal(base, txn_dir, allowed):
        if op["op"] == "install" and op["to"] == rel:
            src = base / op["from"]
            return src if src.exists() else (target if target.exists() else None)
        if op["op"] == "remove" and op["path"] == rel:
            return None
    return target if target.exists() else None


def journal_targets(
    base: Path, txn_dir: Path, allowed: tuple[str, ...] = ()
) -> tuple[list[Path], list[Path]]:
    """``(installed, removed)`` targets of a committed journal (empty lists otherwise)."""
    if pending(txn_dir) != "committed":
        return [], []
    ops = read_journal(base, txn_dir, allowed)
    return (
        [base / op["to"] for op in ops if op["op"] == "install"],
        [base / op["path"] for op in ops if op["op"] == "remove"],
    )


class Busy(Exception):
    """Another process holds the lock and the caller asked not to wait."""


@contextmanager
def exclusive(
    path: Path, *, wait: bool = True, on_wait: Callable[[], None] | None = None
) -> Iterator[None]:
    """Hold an inter-process lock on ``path`` for the block (created if needed).

    A free lock is taken at once. A held one raises :class:`Busy` when ``wait`` is
    false; otherwise ``on_wait`` is called once (to say who waits on what) and the
    call blocks until the holder ends. The kernel drops the lock of a killed process.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(path)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        if not wait:
            raise Busy(str(path)) from None
        if on_wait is not None:
            on_wait()
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


_SCRATCH = re.compile(r"patchkit-[\w-]+\.(\d+)\.")


def scratch_dir(kind: str, parent: Path | None = None) -> Path:
    """A fresh temporary folder ``patchkit-<kind>.<pid>.<random>`` (see :func:`prune_scratch`)."""
    return Path(tempfile.mkdtemp(prefix=f"patchkit-{kind}.{os.getpid()}.", dir=parent))


@contextmanager
def scratch(kind: str, parent: Path | None = None) -> Iterator[Path]:
    """:func:`scratch_dir` for the block, removed afterwards."""
    path = scratch_dir(kind, parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a pid of ours that ended may be reused; rare)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


# Folders from before the pid tag: only ones no run could still be using.
_LEGACY_AGE_S = 24 * 3600


def prune_scratch(parent: Path | None = None) -> list[Path]:
    """Remove ``patchkit-*`` scratch folders whose process is gone; return them."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for path in parent.glob("patchkit-*"):
        if not path.is_dir() or path.is_symlink():
            continue
        m = _SCRATCH.match(path.name)
        if m:
            stale = not alive(int(m.group(1)))
        else:
            try:
                stale = time.time() - path.stat().st_mtime > _LEGACY_AGE_S
            except OSError:
                continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
