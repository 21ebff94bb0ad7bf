"""The route to the patched kernels, found from upstream's source rather than typed by hand.

Which kernel a shape reaches is decided by host code: each primitive's ``eval_gpu``, the
functions it calls on the way to the patched launchers, and the predicates and helpers
whose values those read (``supports_qmv``, ``qmv_fast_k_alignment``). A rebase must stop
when any of them changes, including one upstream adds (a second caller of the dispatch, a
new predicate). So the gate derives that set at each commit from a light call graph of the
folders the patch edits, and compares the sets and the functions' text.

The graph is deliberately coarse: a function refers to another when the other's name
appears in its body as a name (a call, ``&f``, a function passed as a value), not after
``.`` or ``->``. Names are matched without namespaces, so it can only find more of the
route than the compiler would, never less. Not a C++ parser (see :mod:`cxx`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from patchkit.carry import cxx
from patchkit.errors import AnchorError

HOST_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")
ROOT_NAME = "eval_gpu"  # each primitive's entry on a GPU backend
_KEYWORDS = frozenset({
    "if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "decltype",
    "static_assert", "static_cast", "reinterpret_cast", "const_cast", "dynamic_cast",
    "throw", "new", "delete", "template", "typename",
})  # fmt: skip
_NAME = re.compile(r"(?<![\w.:>])(?<!->)(~?[A-Za-z_]\w*(?:::~?[A-Za-z_]\w*)*)")
_DEFINED = re.compile(r"((?:[A-Za-z_]\w*::)*~?[A-Za-z_]\w*)\s*(?:<[^(){};]*>)?\s*$")
_PREPROCESSOR = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)


@dataclass(frozen=True)
class Definition:
    """One function defined in a file: its name as written there (``Class::method`` when out
    of line), the names its body refers to, and whether it hands a value back."""

    path: str
    name: str  # as written at the definition (cxx.find_functions finds it so)
    qualified: str  # with the enclosing namespaces
    refs: frozenset[str]  # names as written in the body, qualifiers kept
    returns_scalar: bool  # bool, an integer or a float: what a decision reads

    @property
    def simple(self) -> str:
        return self.name.rsplit("::", 1)[-1]


def _mask(text: str) -> str:
    """Code only: comments, literals and preprocessor lines blanked, offsets kept."""
    mask = cxx._code_mask(text)
    return _PREPROCESSOR.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), mask)


def definitions(path: str, text: str) -> list[Definition]:
    """Every function defined at namespace scope in ``text`` (free functions, function
    templates, out-of-line members); class bodies and initializers are skipped whole."""
    mask = _mask(text)
    found: list[Definition] = []
    spaces: list[tuple[int, str]] = []  # (closing offset, name) of the open namespaces
    start, i = 0, 0  # start: where the current declaration's header begins
    while i < len(mask):
        while spaces and i >= spaces[-1][0]:
            spaces.pop()
        c = mask[i]
        if c in ";}":
            start = i + 1
        elif c == "{":
            header = mask[start:i].strip()
            space = re.match(r"^(?:inline\s+)?namespace\s*([\w:]*)\s*$|^extern\s*$", header)
            if space:  # into the namespace: its functions are namespace scope too
                spaces.append((cxx.match_brace(mask, i) - 1, space.group(1) or ""))
                start = i + 1
            else:
                end = cxx.match_brace(mask, i)
                where = "::".join(n for _, n in spaces if n)
                if (d := _definition(path, where, header, mask[i:end])) is not None:
                    found.append(d)
                start = i = end
                continue
        i += 1
    return found


_SCALAR = re.compile(
    r"^(?:bool|(?:unsigned|signed)?\s*(?:int|long|short|char)|(?:std::)?u?int\d+_t|"
    r"(?:std::)?size_t|float|double)$"
)


def _definition(path: str, where: str, header: str, body: str) -> Definition | None:
    """The function a ``header { body }`` at namespace scope defines, or None (a class, an
    enum, an initializer, a lambda)."""
    if re.match(r"^(?:template\s*<.*>\s*)?(?:class|struct|union|enum)\b", header, re.S):
        return None
    close = _signature_end(header)
    if close is None:
        return None
    depth, j = 0, close
    while j >= 0:  # back to the '(' that opens the parameter list
        depth += {")": 1, "(": -1}.get(header[j], 0)
        if depth == 0:
            break
        j -= 1
    m = _DEFINED.search(header[:j]) if j > 0 else None
    if m is None or m.group(1) in _KEYWORDS or header[: m.start()].rstrip().endswith("="):
        return None
    before = re.sub(r"template\s*<.*?>", " ", header[: m.start()], flags=re.S)
    kind = re.sub(r"\b(?:static|inline|constexpr|__host__|__device__|__forceinline__|"
                  r"MLX_\w+)\b", " ", before).strip()  # fmt: skip
    refs = frozenset(name for name in _NAME.findall(body) if name not in _KEYWORDS)
    name = m.group(1)
    qualified = f"{where}::{name}" if where else name
    return Definition(path, name, qualified, refs, bool(_SCALAR.match(" ".join(kind.split()))))


def _signature_end(header: str) -> int | None:
    """Index of the ``)`` closing the parameter list, past trailing qualifiers, or None."""
    tail = re.search(  # one way to match each character: no backtracking blow-up
        r"\)(?:\s|const\b|override\b|final\b|noexcept\b(?:\([^()]*\))?|mutable\b|&)*"
        r"(?:->[^{}]*)?$",
        header,
    )
    return tail.start() if tail else None


def folders_of(paths: Iterable[str]) -> set[str]:
    """The host-code folders of the files a patch edits (device ``kernels/`` folders left
    out: they hold kernels, not the decisions that pick one)."""
    return {
        str(PurePosixPath(p).parent)
        for p in paths
        if p.endswith(HOST_SUFFIXES) and "kernels" not in PurePosixPath(p).parts
    }


def _resolve(ref: str, by_simple: dict[str, list[Definition]]) -> list[Definition]:
    """The definitions a name written in a body may mean: same simple name, and, when the
    name is qualified (``cu::qmv``), a qualified name that ends the same way."""
    simple = ref.rsplit("::", 1)[-1]
    if simple == ROOT_NAME:  # an entry point is never a step on another's route
        return []
    found = by_simple.get(simple, [])
    if "::" in ref:
        found = [d for d in found if ("::" + d.qualified).endswith("::" + ref)]
    return found


def route(defs: list[Definition], targets: set[str]) -> list[Definition]:
    """The definitions a routing gate fingerprints: every function on a path from an
    ``eval_gpu`` to a target (by simple name), and every function returning a bool or a
    number that such a function refers to (the predicates and sizes its decisions read)."""
    by_simple: dict[str, list[Definition]] = {}
    for d in defs:
        by_simple.setdefault(d.simple, []).append(d)
    key = {id(d): i for i, d in enumerate(defs)}
    callees = [{key[id(c)] for r in d.refs for c in _resolve(r, by_simple)} for d in defs]
    callers: list[set[int]] = [set() for _ in defs]
    for i, out in enumerate(callees):
        for j in out:
            callers[j].add(i)

    def closure(start: Iterable[int], step: Callable[[int], Iterable[int]]) -> set[int]:
        seen, todo = set(start), list(start)
        while todo:
            for nxt in step(todo.pop()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    roots = [i for i, d in enumerate(defs) if d.simple == ROOT_NAME]
    ends = [i for i, d in enumerate(defs) if d.simple in targets]
    on_route = closure(roots, callees.__getitem__) & closure(ends, callers.__getitem__)
    read = {j for i in on_route for j in callees[i] if defs[j].returns_scalar}
    return [d for i, d in enumerate(defs) if i in on_route | read]


def route_in(files: dict[str, str], targets: set[str]) -> dict[tuple[str, str], list[str]]:
    """``{(path, name): [definition texts]}`` of :func:`route` over ``files`` (path: text);
    a file the scanner cannot balance is left out rather than guessed at."""
    defs = []
    for path, text in sorted(files.items()):
        try:
            defs += definitions(path, text)
        except AnchorError:
            continue
    chosen = {(d.path, d.name) for d in route(defs, targets)}
    return {
        key: [f.text(files[key[0]]) for f in cxx.find_functions(files[key[0]], key[1])]
        for key in sorted(chosen)
    }
