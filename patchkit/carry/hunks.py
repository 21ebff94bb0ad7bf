"""Apply a unified diff to upstream text by content, as ``patch`` does with fuzz 0.

The one-body change edits MLX's own functions in place (``qmv_fast_impl`` gains
the number of vectors it streams), so its template is a diff of that function:
only the changed lines and a little upstream context, never a copy of the body.
Each hunk's old lines (context and removals) must occur verbatim in the scope;
where they occur more than once (``qmv_impl`` repeats a loop in two branches),
the occurrence nearest the hunk's own line number wins, as with ``patch``, and
a tie is an error. A hunk that no longer matches means upstream changed the
lines the change rests on: that fails loudly (an :class:`AnchorError` naming
the hunk), never silently.
"""

from __future__ import annotations

import difflib
import re

from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from patchkit.errors import AnchorError

HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@(.*)$")


def recount(diff: str) -> str:
    """``diff`` with each hunk header's line counts taken from its body.

    A diff template renders per flavour (Jinja ``{% if %}`` around some of its lines), so
    one flavour's hunk holds lines the other's does not: the counts follow what rendered,
    and the start lines (where ``apply_diff`` looks first) stay as written.
    """
    lines = diff.splitlines(keepends=True)
    out: list[str] = []
    header: re.Match[str] | None = None
    body: list[str] = []

    def flush() -> None:
        if header is None:
            return
        old = sum(1 for ln in body if ln[:1] in (" ", "-"))
        new = sum(1 for ln in body if ln[:1] in (" ", "+"))
        out.append(f"@@ -{header.group(1)},{old} +{header.group(2)},{new} @@{header.group(3)}\n")
        out.extend(body)

    for line in lines:
        if m := HUNK_HEADER.match(line.rstrip("\n")):
            flush()
            header, body = m, []
        elif header is not None and line[:1] in (" ", "-", "+", "\\"):
            body.append(line)
        else:  # a file header or text between files
            flush()
            header, body = None, []
            out.append(line)
    flush()
    return "".join(out)


def apply_diff(text: str, diff: str, what: str) -> str:
    """``text`` with every hunk of ``diff`` applied; ``what`` names the scope in errors."""
    try:
        patch = PatchSet(diff)
    except UnidiffParseError as exc:
        raise AnchorError(f"{what}: the diff does not parse ({exc})") from exc
    if len(patch) != 1:
        raise AnchorError(f"{what}: the diff must hold one file, not {len(patch)}")
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    drift = 0  # how far earlier hunks moved the lines below them
    searched_from = 0
    for hunk in patch[0]:
        old = [ln.value for ln in hunk if not ln.is_added]
        new = [ln.value for ln in hunk if not ln.is_removed]
        expected = hunk.source_start - 1 + drift
        at = _locate(lines, old, expected, searched_from, f"{what}, hunk {hunk.source_start}")
        lines[at : at + len(old)] = new
        drift += len(new) - len(old)
        searched_from = at + len(new)
    out = "".join(lines)
    return out if text.endswith("\n") else out.removesuffix("\n")


def _locate(lines: list[str], old: list[str], expected: int, start: int, what: str) -> int:
    """Index where ``old`` occurs in ``lines[start:]``, nearest ``expected``."""
    hits = [i for i in range(start, len(lines) - len(old) + 1) if lines[i : i + len(old)] == old]
    if not hits:
        raise AnchorError(f"{what}: its upstream lines no longer match (upstream changed them)")
    hits.sort(key=lambda i: abs(i - expected))
    if len(hits) > 1 and abs(hits[0] - expected) == abs(hits[1] - expected):
        raise AnchorError(f"{what}: its upstream lines occur twice, equally near; add context")
    return hits[0]


def make_diff(old: str, new: str, name: str, context: int = 3) -> str:
    """The unified diff ``apply_diff`` takes, from two versions of one scope (for authoring)."""
    # A function's text ends at its closing brace; the diff's lines all end in a newline.
    return "".join(
        difflib.unified_diff(
            (old.rstrip("\n") + "\n").splitlines(keepends=True),
            (new.rstrip("\n") + "\n").splitlines(keepends=True),
            fromfile=f"a/{name}",
            tofile=f"b/{name}",
            n=context,
        )
    )
