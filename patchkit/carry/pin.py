"""``pin.toml``: which upstream commit the patch targets, and how we know it is that commit.

It holds the upstream URL, the full pinned commit, the release whose touched files
are byte-identical (so wheels can stand in for a clone), the git blob id of every
upstream file the patch touches, and the history of bumps. Blob ids are what make
"the tree is the one we rendered against" checkable without trusting branch names.

Writes go through tomlkit on the existing document, so comments and key order a
person added survive a bump, and through a staged rename so a failure never leaves
a half-written file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from patchkit.errors import BlobMismatchError, UserError
from patchkit.util import read_state_text
from patchkit.util.staging import atomic_write_text

PIN_FILE = "pin.toml"
UPSTREAM_URL = "https://github.com/ml-explore/mlx"

_HEADER = (
    "patchkit pin: the single source of truth for the upstream commit the patch targets.\n"
    "Written by `patchkit apply` / `patchkit rebase`; `patchkit check` verifies it."
)


@dataclass(frozen=True)
class Bump:
    """One entry of the pin history: moved from ``old`` to ``new`` on ``date``."""

    old: str
    new: str
    date: str
    note: str = ""
    # What the rebase gate saw: upstream functions the patch calls that changed, routing
    # changes the user accepted, and the parity verdict ("passed", "failed", "not run").
    called: tuple[str, ...] = ()
    routing: tuple[str, ...] = ()
    parity: str = ""


@dataclass(frozen=True)
class Pin:
    """The parsed contents of ``pin.toml``."""

    commit: str
    blobs: Mapping[str, str]
    url: str = UPSTREAM_URL
    release: str = ""
    history: tuple[Bump, ...] = field(default_factory=tuple)

    @property
    def short(self) -> str:
        """The 8-character abbreviation used for branch and ``patches/`` names."""
        return self.commit[:8]


def load(path: Path) -> Pin:
    """Read ``pin.toml``; a missing or malformed file is a :class:`UserError`."""
    if not path.exists():
        raise UserError(f"{path} not found; create it with `patchkit apply --pin REV`")
    try:
        doc = tomlkit.parse(read_state_text(path)).unwrap()
        up = doc["upstream"]
        pin = Pin(
            commit=up["commit"],
            url=up.get("url", UPSTREAM_URL),
            release=up.get("release", ""),
            blobs=dict(doc.get("blobs", {})),
            history=tuple(_bump(h) for h in doc.get("history", [])),
        )
    except (TOMLKitError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{path} is malformed ({exc}); fix it or restore it from git") from exc
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror}); it must be a file") from exc
    problem = _invalid(pin)
    if problem:
        raise UserError(f"{path} is malformed ({problem}); fix it or restore it from git")
    return pin


_SHA = re.compile(r"[0-9a-f]{40}")
RELEASE = re.compile(r"\d+\.\d+\.\d+(?:[.-]?(?:dev|rc|post|a|b)\d*)?")


def _invalid(pin: Pin) -> str | None:
    """What is wrong with a parsed pin's values, or None."""
    if not isinstance(pin.commit, str) or not _SHA.fullmatch(pin.commit):
        return f"upstream.commit must be a 40-hex-digit commit id, not {pin.commit!r}"
    if not isinstance(pin.url, str):
        return f"upstream.url must be a string, not {pin.url!r}"
    if not isinstance(pin.release, str) or (pin.release and not RELEASE.fullmatch(pin.release)):
        return f"upstream.release must be a version such as 0.32.1, not {pin.release!r}"
    bad = [p for p, b in pin.blobs.items() if not (isinstance(b, str) and _SHA.fullmatch(b))]
    return f"blobs.{bad[0]} must be a 40-hex-digit blob id" if bad else None


def check_release(release: str) -> str:
    """``release`` if it is a version (it goes into generated file headers); else UserError."""
    if not RELEASE.fullmatch(release):
        raise UserError(f"--release {release!r} is not a version such as 0.32.1")
    return release


def dumps(pin: Pin, existing: str | None = None) -> str:
    """TOML text for ``pin``, edited into ``existing`` when given (keeps comments)."""
    doc = tomlkit.parse(existing) if existing else tomlkit.document()
    if not existing:
        for line in _HEADER.splitlines():
            doc.add(tomlkit.comment(line))
    up = doc.get("upstream") or tomlkit.table()
    up["url"] = pin.url
    up["commit"] = pin.commit
    if pin.release:
        up["release"] = pin.release
        up["release"].comment("release whose touched files are byte-identical to the pin")
    elif "release" in up:
        del up["release"]
    doc["upstream"] = up
    blobs = tomlkit.table()
    for path in sorted(pin.blobs):
        blobs[path] = pin.blobs[path]
    doc["blobs"] = blobs
    _set_history(doc, pin.history)
    return tomlkit.dumps(doc)


def _bump(h: dict) -> Bump:
    """One ``[[history]]`` table as a :class:`Bump`."""
    return Bump(
        h["from"],
        h["to"],
        h["date"],
        h.get("note", ""),
        tuple(h.get("called", ())),
        tuple(h.get("routing", ())),
        h.get("parity", ""),
    )


def _entry(bump: Bump) -> tomlkit.items.Table:
    entry = tomlkit.table()
    entry["from"], entry["to"], entry["date"] = bump.old, bump.new, bump.date
    if bump.note:
        entry["note"] = bump.note
    for key in ("called", "routing"):
        if getattr(bump, key):
            entry[key] = list(getattr(bump, key))
    if bump.parity:
        entry["parity"] = bump.parity
    return entry


def _set_history(doc: tomlkit.TOMLDocument, history: tuple[Bump, ...]) -> None:
    """Append new bumps to the existing array of tables (keeping its comments) when possible."""
    current = doc.get("history")
    known = [_bump(h) for h in (current or [])]
    if current is not None and tuple(known) == history[: len(known)]:
        for bump in history[len(known) :]:
            current.append(_entry(bump))
        return
    aot = tomlkit.aot()
    for bump in history:
        aot.append(_entry(bump))
    doc["history"] = aot


def save(pin: Pin, path: Path) -> bool:
    """Write ``pin`` to ``path`` atomically; return whether the file changed."""
    existing = path.read_text() if path.exists() else None
    return atomic_write_text(path, dumps(pin, existing))


def mismatches(pin: Pin, blob_of: Callable[[str], str | None]) -> dict[str, tuple[str, str | None]]:
    """``{path: (recorded, actual)}`` for every recorded blob the tree does not match."""
    bad = {}
    for path, recorded in sorted(pin.blobs.items()):
        actual = blob_of(path)
        if actual != recorded:
            bad[path] = (recorded, actual)
    return bad


def verify(pin: Pin, blob_of: Callable[[str], str | None], touched: list[str]) -> None:
    """Raise :class:`BlobMismatchError` unless pin.toml's blobs are exactly the tree's.

    ``touched`` is the set of files the templates edit now; a file added to or
    dropped from the patch without re-pinning is a mismatch too.
    """
    bad = mismatches(pin, blob_of)
    if bad:
        path, (recorded, actual) = next(iter(bad.items()))
        raise BlobMismatchError(
            f"{path} at {pin.short} is blob {actual or 'missing'}, pin.toml records {recorded}"
            f" ({len(bad)} file(s) differ); the clone is not the pinned tree, or re-pin with"
            " `patchkit rebase --to REV`"
        )
    missing = sorted(set(touched) - set(pin.blobs))
    extra = sorted(set(pin.blobs) - set(touched))
    if missing or extra:
        raise BlobMismatchError(
            f"pin.toml blobs do not cover the touched files (missing {missing}, extra {extra});"
            f" re-run `patchkit apply --pin {pin.short}` to record them"
        )


def today() -> str:
    """UTC date for pin history entries."""
    return datetime.now(UTC).date().isoformat()
