"""Export a patched commit range as ``patches/<short>/``: a stable series plus ``overlay/``.

Layout::

    patches/<short>/0001-<subject>.patch ...   git format-patch series (base..head)
    patches/<short>/series                     patch file names, in order
    patches/<short>/overlay/<upstream path>    full patched files, each with a header

The series is byte-stable: zero commit ids, full index, no signature or stat,
and commits made with a fixed author and the upstream commit's date, so exporting
twice gives identical bytes and ``patchkit check`` can compare with ``cmp``.

Overlay files are for downstream engines that vendor whole files instead of
applying patches. Their header names the pin, the command that regenerates them
and the hunks they carry, so a reviewer can tell what differs from upstream
without diffing by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import unidiff

from patchkit.carry import commit, render
from patchkit.util import git
from patchkit.util.staging import atomic_write_text, scratch

OVERLAY = "overlay"
SERIES = "series"

_COMMENT = {".py": "# ", ".txt": "# ", ".cmake": "# "}


@dataclass(frozen=True)
class OverlayFile:
    """One overlay file: its upstream path, upstream text and patched (overlay-flavour) text."""

    path: str
    upstream: str
    patched: str


@dataclass(frozen=True)
class PinInfo:
    """What an overlay header says about the pin."""

    url: str
    commit: str
    release: str = ""


def comment_prefix(path: str) -> str:
    """Line-comment marker for ``path``'s language (C-family unless known otherwise)."""
    return _COMMENT.get(Path(path).suffix, "// ")


def hunk_headers(clone: Path, old: str, new: str) -> list[str]:
    """``@@ -a,b +c,d @@ context`` lines of the diff old -> new, in order."""
    a = git.hash_object(clone, old, write=True)
    b = git.hash_object(clone, new, write=True)
    diff = git.diff_blobs(clone, a, b)
    if not diff:
        return []
    patch = unidiff.PatchSet(diff)
    headers = []
    for pfile in patch:
        for h in pfile:
            section = f" {h.section_header}" if h.section_header else ""
            old_range = f"-{h.source_start},{h.source_length}"
            new_range = f"+{h.target_start},{h.target_length}"
            headers.append(f"@@ {old_range} {new_range} @@{section}")
    return headers


def overlay_header(f: OverlayFile, pin: PinInfo, hunks: list[str], regenerate: str) -> str:
    """The comment block prepended to an overlay file."""
    c = comment_prefix(f.path)
    upstream_blob = git.hash_object(None, f.upstream)
    release = f" (release {pin.release})" if pin.release else ""
    lines = [
        "patchkit overlay: generated, do not edit by hand.",
        f"upstream:   {pin.url} {f.path}",
        f"pinned:     {pin.commit}{release}",
        f"base blob:  {upstream_blob}",
        f"regenerate: {regenerate}",
        "hunks carried (line numbers against upstream, without this header):",
        *[f"  {h}" for h in hunks],
        "end of patchkit header",
    ]
    return "".join(f"{c}{line}".rstrip() + "\n" for line in lines)


def overlay_files(series_dir: Path) -> dict[str, Path]:
    """``{upstream path: file}`` of ``series_dir``'s overlay (``patches/<short>/``), sorted
    by path; empty where it has none."""
    overlay = series_dir / OVERLAY
    files = sorted(p for p in overlay.rglob("*") if p.is_file())
    return {p.relative_to(overlay).as_posix(): p for p in files}


def strip_header(path: str, text: str) -> str:
    """An overlay file's text without its patchkit header (the inverse of the export)."""
    c = comment_prefix(path)
    marker = f"{c}end of patchkit header\n"
    if not text.startswith(f"{c}patchkit overlay:") or marker not in text:
        return text
    return text.split(marker, 1)[1]


def write_series(clone: Path, base: str, head: str, dest: Path) -> list[str]:
    """Format-patch ``base..head`` into ``dest`` and write the ``series`` index."""
    with scratch("series") as tmp:
        files = git.format_patch(clone, base, head, tmp)
        names = []
        for f in files:
            names.append(f.name)
            atomic_write_text(dest / f.name, f.read_bytes().decode("utf-8", "surrogateescape"))
    atomic_write_text(dest / SERIES, "".join(n + "\n" for n in names))
    return names


def write_overlay(
    clone: Path, files: list[OverlayFile], pin: PinInfo, regenerate: str, dest: Path
) -> list[str]:
    """Write each overlay file with its header under ``dest/overlay``; return the paths."""
    written = []
    for f in sorted(files, key=lambda f: f.path):
        hunks = hunk_headers(clone, f.upstream, f.patched)
        text = overlay_header(f, pin, hunks, regenerate) + f.patched
        atomic_write_text(dest / OVERLAY / f.path, text)
        written.append(f.path)
    return written


def export(
    clone: Path,
    base: str,
    head: str,
    overlay: list[OverlayFile],
    pin: PinInfo,
    regenerate: str,
    dest: Path,
) -> list[str]:
    """Write the whole ``patches/<short>/`` content into ``dest``; return files written."""
    names = write_series(clone, base, head, dest)
    paths = write_overlay(clone, overlay, pin, regenerate, dest)
    return [*names, SERIES, *[f"{OVERLAY}/{p}" for p in paths]]


def export_patch(
    clone: Path,
    upstream: str,
    rendered: render.Rendered,
    pin: PinInfo,
    dest: Path,
    *,
    move_refs: bool = True,
) -> tuple[str, list[str]]:
    """Commit ``rendered`` on ``upstream`` (:mod:`.commit`) and export it into ``dest``.

    Returns (head commit, files written). ``move_refs=False`` (check) moves no ref.
    """
    head = commit.commit_patch(clone, upstream, rendered, move_refs=move_refs)
    overlay = [OverlayFile(p, rendered.upstream[p], rendered.overlay[p]) for p in rendered.upstream]
    regenerate = f"patchkit apply --pin {upstream[:8]}"
    return head, export(clone, upstream, head, overlay, pin, regenerate, dest)
