"""The checkout's outputs, ``patches/`` and ``pin.toml``: one writer at a time, all or nothing.

apply, rebase and vendor write the checkout; check and status only read it.
A writer holds the checkout's lock (:func:`writer`) for its whole run, refuses
to overwrite hand edits (:func:`ensure_outputs_clean`), stages the new
``patches/<short>/`` and ``pin.toml`` and installs them as one transaction
(:func:`write_outputs`): a kill at any moment leaves the old outputs or the new
ones, and the next writer finishes or rolls back what it finds
(:func:`recover_outputs`). Readers see a killed write's committed state
without recovering it (:func:`output_path`, :func:`outputs_state`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

from patchkit.carry import pin, source
from patchkit.errors import BusyError, UserError
from patchkit.util import cache, git, staging
from patchkit.util.staging import Transaction, atomic_write_text, recover, same_tree

PATCHES = "patches"  # the checkout's folder of rendered patches, one folder per pin
TXN_DIR = ".txn"  # under patches/: one in-flight write of patches/ and pin.toml
LOCK = "patchkit.lock"  # in the checkout's git directory (else in the cache)
RECORD = "patchkit-written.json"  # in the checkout's git directory: what apply last wrote
# What a transaction may change in the checkout: a journal read back naming anything else
# (a path outside, ``..``, a link out) is refused before anything is touched.
OUTPUTS = (PATCHES, pin.PIN_FILE)


def lock_path(root: Path) -> Path:
    """The checkout's lock file: in its git directory, else in the cache (never in the tree)."""
    in_git = git.git_path(root, LOCK)
    if in_git is not None:
        return in_git
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return cache.folder("locks") / f"{root.name}-{digest}.lock"


@contextmanager
def writer(
    root: Path, *, wait: bool = True, progress: source.Progress = source._quiet
) -> Iterator[None]:
    """Hold the checkout's lock for a command that writes it; first clear what killed runs left.

    A second writer waits (saying so) or, with ``wait=False``, is refused in one
    line. Under the lock, scratch folders of dead runs are pruned and an interrupted
    write of patches/ and pin.toml is finished or rolled back.
    """
    if not root.is_dir():
        raise UserError(f"{root} is not a folder; pass --root PATCHKIT_CHECKOUT")
    lock = lock_path(root)
    try:
        with staging.exclusive(
            lock,
            wait=wait,
            on_wait=lambda: progress(f"waiting for another patchkit run writing {root}"),
        ):
            for leftover in staging.prune_scratch():
                progress(f"removed {leftover}, which a killed run left")
            recover_outputs(root, progress)
            yield
    except staging.Busy:
        raise BusyError(
            f"another patchkit run is writing {root} (lock {lock});"
            " retry when it ends, or drop --no-wait to wait for it"
        ) from None


@contextmanager
def reading(root: Path, progress: source.Progress = source._quiet) -> Iterator[None]:
    """Hold the checkout's lock while a reader (check, status) reads, so a live writer is
    waited for, not mistaken for a killed one; nothing is recovered or written.

    A checkout whose lock file cannot be opened (a read-only tree) has no live writer
    patchkit could wait for: the reader reads at once, as before.
    """
    lock = lock_path(root)
    with ExitStack() as held:
        if lock.exists():  # else no writer has run here, so none is running
            with suppress(OSError):  # a lock this reader cannot open: a read-only checkout
                held.enter_context(staging.exclusive(
                    lock, on_wait=lambda: progress(f"waiting for the patchkit run writing {root}")
                ))  # fmt: skip
        yield


def recover_outputs(root: Path, progress: source.Progress = source._quiet) -> None:
    """Finish or roll back a write of patches/ and pin.toml that a kill interrupted."""
    done = recover(root, root / PATCHES / TXN_DIR, OUTPUTS)
    if done:
        progress(f"an interrupted write of patches/ and pin.toml was found and {done}")


def outputs_state(root: Path) -> str | None:
    """Read only: "new" when a killed write committed (the next writer finishes it), "old"
    when one did not (the next writer deletes its leftover), None when none was killed."""
    return {"committed": "new", "uncommitted": "old", None: None}[
        staging.pending(root / PATCHES / TXN_DIR)
    ]


def output_path(root: Path, target: Path) -> Path | None:
    """Where ``target``'s current content is, a killed write's committed state included."""
    return staging.view(root, root / PATCHES / TXN_DIR, target, OUTPUTS)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record_file(root: Path) -> Path | None:
    return git.git_path(root, RECORD) if git.try_rev_parse(root, "HEAD") else None


def _read_record(root: Path) -> dict[str, list[str]]:
    path = _record_file(root)
    try:
        data = json.loads(path.read_text()) if path and path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_written(root: Path, files: dict[str, bytes]) -> None:
    """Remember the digests of files patchkit is writing (relative paths), beside older ones.

    :func:`ensure_outputs_clean` accepts an uncommitted file whose content patchkit
    wrote: a re-run before the output is committed is a no-op, not a refusal.
    """
    path = _record_file(root)
    if path is None:
        return
    record = _read_record(root)
    for rel, data in files.items():
        digests = [d for d in record.get(rel, []) if d != _digest(data)]
        record[rel] = [_digest(data), *digests][:4]  # the last few generations
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def begin_outputs(root: Path) -> Transaction:
    """A transaction for the next write of patches/ and pin.toml (renames stay in one fs)."""
    return Transaction.begin(root, root / PATCHES / TXN_DIR, OUTPUTS)


def ensure_outputs_clean(root: Path) -> None:
    """Refuse to overwrite hand edits: in a git checkout, pin.toml and patches/ must be clean.

    Uncommitted files patchkit itself wrote (see :func:`record_written`) and deleted
    files (git still has them) are not hand edits.
    """
    if git.try_rev_parse(root, "HEAD") is None:
        return  # not a git checkout (or no commits yet): nothing committed to protect
    dirty = git.status_porcelain(root, [pin.PIN_FILE, PATCHES])
    record = _read_record(root) if dirty.strip() else {}
    for line in dirty.splitlines():
        rel = line[3:].split(" -> ")[-1].strip('"')
        path = root / rel
        if not path.is_file() or _digest(path.read_bytes()) in record.get(rel, []):
            continue
        raise UserError(
            f"uncommitted changes in {path} that patchkit did not write;"
            " commit or stash pin.toml and patches/ and retry"
        )


class Written(NamedTuple):
    """What :func:`write_outputs` changed."""

    patches_changed: bool
    pin_changed: bool
    removed: list[str]  # files in patches/<short>/ the render did not produce, now gone


def write_outputs(
    root: Path, new_pin: pin.Pin, txn: Transaction, staged: Path, drop: Sequence[Path] = ()
) -> Written:
    """Install a staged ``patches/<short>``, drop superseded dirs and save pin.toml, as one commit.

    Nothing unchanged is touched, so re-running is a no-op down to file
    timestamps; a kill at any point leaves the old outputs or the new ones
    (:func:`recover_outputs` on the next run).
    """
    target = root / PATCHES / new_pin.short
    differing = same_tree(staged, target)
    removed = [p for p in differing if not (staged / p).exists()]
    patches_changed = bool(differing)
    if patches_changed:
        txn.install(staged, target)
    for old in drop:
        if old.exists() and old != target:
            txn.remove(old)
            patches_changed = True
    pin_path = root / pin.PIN_FILE
    existing = pin_path.read_text() if pin_path.is_file() else None
    text = pin.dumps(new_pin, existing)
    pin_changed = existing != text
    if pin_changed:
        (txn.stage / pin.PIN_FILE).write_text(text)
        txn.install(txn.stage / pin.PIN_FILE, pin_path)
    files = {f"{PATCHES}/{new_pin.short}/{p}": (staged / p).read_bytes() for p in _files(staged)}
    record_written(root, {**files, pin.PIN_FILE: text.encode()})  # before the commit point
    txn.commit()
    return Written(patches_changed, pin_changed, removed)


def _files(tree: Path) -> list[str]:
    return sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
