"""Python-structure anchors for the files only the upstream PR adds to: tests and benchmarks.

The C++ finder in :mod:`patchkit.carry.cxx` anchors on braces and statements; a Python
test class has neither, so these edits anchor by the ``ast`` module instead: a
class is found by name and a method is appended after the last line of its body.
The edits are pure text functions (``str -> str``) so ``render.py`` can call
them from ``_apply_edit`` exactly like the C++ ops.

Ops:

* ``append_to_class``: add a snippet (written at method indentation) as the last
  member of class ``anchor``, separated from the previous member by a blank line.
* ``after_method``: add a snippet as a new member right after method ``Class.method``.
* ``patch_method``: apply a diff (``*.diff.j2``, hunks numbered from the method's first
  line) inside method ``Class.method``: an upstream test the PR makes stale is edited in
  place, and a hunk can match nowhere else in the file.
* ``new_file``: the file does not exist upstream; the snippet is the whole file.
"""

from __future__ import annotations

import ast
import re

from patchkit.carry import hunks
from patchkit.errors import AnchorError

PY_OPS = ("append_to_class", "after_method", "patch_method", "new_file")
# The ops whose snippet is a new member of a class (new test methods, in a test file).
ADDING_OPS = ("append_to_class", "after_method")
# A unittest method's definition, at any indentation: its name is group 1.
TEST_METHOD_DEF = re.compile(r"^\s*def (test_\w+)\(", re.M)


def find_class(source: str, name: str) -> ast.ClassDef:
    """The module-level class ``name``; missing or duplicated is an :class:`AnchorError`.

    Only top-level classes count: a nested class of the same name is a
    different anchor and silently picking it would put the test in the wrong place.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise AnchorError(f"cannot parse Python source: {exc.msg} (line {exc.lineno})") from exc
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if not found:
        raise AnchorError(f"no top-level class '{name}'")
    if len(found) > 1:
        raise AnchorError(f"class '{name}' is defined {len(found)} times")
    return found[0]


def class_end_line(source: str, name: str) -> int:
    """1-based number of the last line of class ``name``'s body (its last member's end).

    ``end_lineno`` of the last body statement excludes trailing blank lines and
    comments after the class, so an insertion there lands inside the class.
    """
    node = find_class(source, name)
    last = node.body[-1]
    if last.end_lineno is None:  # pragma: no cover - CPython always sets it
        raise AnchorError(f"class '{name}' has no end line")
    return last.end_lineno


def append_to_class(source: str, name: str, snippet: str) -> str:
    """``source`` with ``snippet`` appended as the last member of class ``name``.

    The snippet carries its own indentation (method level). One blank line
    separates it from the previous member, as black keeps methods; what
    followed the class (blank lines, ``if __name__ == ...``) is untouched.
    """
    end = class_end_line(source, name)
    lines = source.splitlines(keepends=True)
    body = snippet.strip("\n") + "\n"
    head = "".join(lines[:end])
    if not head.endswith("\n"):
        head += "\n"
    return head + "\n" + body + "".join(lines[end:])


def find_method(source: str, anchor: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """Method ``Class.method`` of a top-level class; missing or defined twice is an
    :class:`AnchorError`."""
    cls_name, _, method = anchor.partition(".")
    found = [
        n
        for n in find_class(source, cls_name).body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == method
    ]
    if len(found) != 1:
        raise AnchorError(f"class '{cls_name}' has {len(found)} methods '{method}', not one")
    return found[0]


def after_method(source: str, anchor: str, snippet: str) -> str:
    """``source`` with ``snippet`` as a new member right after method ``Class.method``.

    Two PRs that each add a test method at their own anchor in one class apply in
    either order; both appended at the class's end would conflict.
    """
    end = find_method(source, anchor).end_lineno or 0
    lines = source.splitlines(keepends=True)
    return "".join(lines[:end]) + "\n" + snippet.strip("\n") + "\n" + "".join(lines[end:])


def patch_method(source: str, anchor: str, diff: str) -> str:
    """``source`` with ``diff`` applied inside method ``Class.method`` (decorators
    included), as ``patch_function`` does for C++: the hunks are found in that method
    only, so the same lines elsewhere in the file are never the ones changed."""
    node = find_method(source, anchor)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    end = node.end_lineno or 0
    lines = source.splitlines(keepends=True)
    method = hunks.apply_diff("".join(lines[start:end]), diff, anchor)
    return "".join(lines[:start]) + method + "".join(lines[end:])


def new_file(existing: str | None, snippet: str) -> str:
    """The text of a file the patch creates; refuse if upstream now has another file there.

    Overwriting an upstream file of the same name would silently drop upstream's
    content from the PR, so an existing file is an anchor error for the rebase to report;
    the same text already there (an earlier PR of a stack added it) is kept as it is.
    """
    text = snippet.rstrip("\n") + "\n"
    if existing is not None and existing != text:
        raise AnchorError("the file exists upstream; a new_file edit would overwrite it")
    return text


def apply_edit(text: str | None, op: str, anchor: str, snippet: str) -> str:
    """Apply one Python-structure op; ``text`` is None when the file is absent upstream."""
    if op == "new_file":
        return new_file(text, snippet)
    if op == "append_to_class":
        if text is None:
            raise AnchorError(f"append_to_class '{anchor}': the file does not exist upstream")
        return append_to_class(text, anchor, snippet)
    if op == "after_method":
        if text is None:
            raise AnchorError(f"after_method '{anchor}': the file does not exist upstream")
        return after_method(text, anchor, snippet)
    if op == "patch_method":
        if text is None:
            raise AnchorError(f"patch_method '{anchor}': the file does not exist upstream")
        return patch_method(text, anchor, snippet)
    raise AnchorError(f"unknown Python edit op '{op}'; choose from {list(PY_OPS)}")
