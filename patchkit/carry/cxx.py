"""Find C++/Metal/CUDA code by structure, never by line number.

Upstream moves code around between releases; a function signature, a macro
name or a statement's text survives that far better than a line number. Every
finder here returns a half-open character span ``(start, end)`` into the text
and raises :class:`AnchorError` naming the anchor when it is absent or
ambiguous, so a pin bump that removes an anchor fails loudly instead of
patching the wrong place.

The scanner understands comments, string and character literals well enough
for MLX's sources; it is not a C++ parser and does not try to be.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from patchkit.errors import AnchorError

Span = tuple[int, int]


def _skip_literal_or_comment(text: str, i: int) -> int:
    """Return the index just past a comment or literal starting at ``i``, or ``i``."""
    if text.startswith("//", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        end = text.find("*/", i + 2)
        return len(text) if end < 0 else end + 2
    if text[i] in "\"'":
        # A digit separator (1'000) is not a character literal.
        if text[i] == "'" and i > 0 and text[i - 1].isalnum():
            return i
        quote = text[i]
        j = i + 1
        while j < len(text) and text[j] != quote:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def match_brace(text: str, open_index: int) -> int:
    """Index just past the brace/paren/bracket that closes the one at ``open_index``."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    opener = text[open_index]
    closer = pairs[opener]
    depth = 0
    i = open_index
    while i < len(text):
        j = _skip_literal_or_comment(text, i)
        if j != i:
            i = j
            continue
        c = text[i]
        if c == opener:
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise AnchorError(f"unbalanced {opener!r} at offset {open_index}")


def _code_mask(text: str) -> str:
    """The text with comments and literals blanked, so regexes see only code."""
    out = list(text)
    i = 0
    while i < len(text):
        j = _skip_literal_or_comment(text, i)
        if j != i:
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class Function:
    """A function definition: ``span`` covers its template header through its closing brace."""

    name: str
    span: Span
    body_open: int

    def text(self, source: str) -> str:
        return source[self.span[0] : self.span[1]]


def _statement_start(mask: str, pos: int) -> int:
    """Start of the declaration containing ``pos``: just after the previous ``;``/``}``/``{``.

    Includes a ``template <...>`` header and attributes, and skips leading blank lines.
    """
    i = pos
    while i > 0 and mask[i - 1] not in ";{}":
        i -= 1
    # A preprocessor line (#define, #include) ends a declaration too.
    line_starts = [m.end() for m in re.finditer(r"^[ \t]*#.*$\n?", mask[i:pos], re.M)]
    if line_starts:
        i += line_starts[-1]
    while i < pos and mask[i] in " \t\n":
        i += 1
    # Back up to the start of the line so indentation is kept.
    while i > 0 and mask[i - 1] in " \t":
        i -= 1
    return i


def find_functions(text: str, name: str) -> list[Function]:
    """Every definition (not declaration or call) of function ``name``, in order."""
    mask = _code_mask(text)
    found = []
    for m in re.finditer(rf"(?<![\w.>:]){re.escape(name)}\s*(?=\()", mask):
        paren = m.end()
        close = match_brace(mask, paren)
        j = close
        # Skip qualifiers and a trailing return type or attributes before the body.
        while j < len(mask) and mask[j] not in "{;,)=":
            j += 1
        if j >= len(mask) or mask[j] != "{":
            continue
        # A call inside an expression is preceded by an operator or '(' / ','; a
        # definition by a type name, '>' of a template, or a qualifier keyword.
        before = mask[: m.start()].rstrip()
        if not before or before[-1] in "=(,+-*/%&|!?:<[" or before.endswith("return"):
            continue
        end = match_brace(mask, j)
        found.append(Function(name, (_statement_start(mask, m.start()), end), j))
    return found


def find_function(text: str, name: str, index: int | None = None) -> Function:
    """The single definition of ``name`` (or the ``index``-th when overloaded)."""
    found = find_functions(text, name)
    if not found:
        raise AnchorError(f"function '{name}' not found in upstream source")
    if index is None:
        if len(found) > 1:
            raise AnchorError(
                f"function '{name}' is defined {len(found)} times; the edit must name an index"
            )
        return found[0]
    if index >= len(found):
        raise AnchorError(f"function '{name}' has {len(found)} definitions, not {index + 1}")
    return found[index]


def function_text(text: str, name: str, index: int | None = None) -> str:
    """Source text of a function definition, for change detection across pins."""
    return find_function(text, name, index).text(text)


def find_macro(text: str, name: str) -> Span:
    """Span of a ``#define name`` including its backslash-continued lines and the newline."""
    m = re.search(rf"^[ \t]*#[ \t]*define[ \t]+{re.escape(name)}\b", text, re.M)
    if not m:
        raise AnchorError(f"macro '{name}' not found in upstream source")
    i = m.start()
    while True:
        end = text.find("\n", i)
        if end < 0:
            return (m.start(), len(text))
        if text[:end].rstrip(" \t").endswith("\\"):
            i = end + 1
            continue
        return (m.start(), end + 1)


def _loose_pattern(snippet: str) -> str:
    """A regex that matches ``snippet`` with any whitespace between its tokens."""
    tokens = re.findall(r"\w+|[^\w\s]", snippet)
    return r"\s*".join(re.escape(t) for t in tokens)


def find_statement(text: str, head: str) -> Span:
    """Span of the statement starting with ``head`` (whitespace-insensitive).

    If the head ends in ``{`` the span runs to the matching ``}``; otherwise to the
    next ``;``. The span starts at the beginning of the line and ends after the
    newline, so inserting before it keeps the file's layout.
    """
    mask = _code_mask(text)
    matches = list(re.finditer(_loose_pattern(head), mask))
    if not matches:
        raise AnchorError(f"statement '{head}' not found in upstream source")
    if len(matches) > 1:
        raise AnchorError(f"statement '{head}' occurs {len(matches)} times; make the anchor longer")
    m = matches[0]
    if head.rstrip().endswith("{"):
        end = match_brace(mask, m.end() - 1)
    else:
        end = mask.index(";", m.end() - 1) + 1
    start = leading_comment_start(text, text.rfind("\n", 0, m.start()) + 1)
    nl = text.find("\n", end)
    return (start, len(text) if nl < 0 else nl + 1)


def find_statements(
    text: str, head: str, through: str | None = None, within: Span | None = None
) -> Span:
    """Span from the statement starting with ``head`` through the one starting with ``through``.

    ``within`` limits the search to part of the text (a function's span), for a
    statement that occurs in several functions. Without ``through`` this is
    :func:`find_statement`'s span.
    """
    lo, hi = within or (0, len(text))
    region = text[lo:hi]
    start, end = find_statement(region, head)
    if through is not None:
        last_start, end = find_statement(region, through)
        if last_start < start:
            raise AnchorError(f"statement '{through}' comes before '{head}'")
    return (lo + start, lo + end)


def leading_comment_start(text: str, line_start: int) -> int:
    """Move ``line_start`` up over the ``//`` comment lines directly above it.

    A comment right above a statement describes it, so inserting before the
    statement must not separate the two.
    """
    while line_start > 0:
        prev = text.rfind("\n", 0, line_start - 1) + 1
        if not text[prev:line_start].lstrip().startswith("//"):
            break
        line_start = prev
    return line_start


def line_end(text: str, pos: int) -> int:
    """Index just past the newline that ends the line containing ``pos``."""
    nl = text.find("\n", pos)
    return len(text) if nl < 0 else nl + 1
