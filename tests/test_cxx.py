"""patchkit.carry.cxx: the structural finders every anchor, derivation and extraction uses.

Small texts pin each rule (definition vs call vs declaration, literals and
comments, ambiguity), and the pinned upstream header from the release-twin
wheel shows the finders hold on the real code they are used on.
"""

from __future__ import annotations

import pytest

from patchkit.carry import cxx, wheels
from patchkit.errors import AnchorError

SOURCE = """\
// qdot(x) in a comment is not a definition
template <typename U, int bits>
inline U qdot(const device uint8_t* w, U sum) {
  const char* s = "qdot(w) { not code }";
  char brace = '}';
  int big = 1'000;
  return sum + qdot_helper(w);
}

U qdot(const device uint8_t* w, U sum);  // a declaration

void caller() {
  auto y = qdot(w, 0);
  y += qdot(w, y) * 2;
  if (qdot(w, 1)) {
  }
}

#define MACRO(a) \\
  do {             \\
    a;             \\
  } while (0)
int after_macro;
"""


def test_match_brace_skips_literals_comments_and_digit_separators() -> None:
    start = SOURCE.index("{", SOURCE.index("inline U qdot"))
    end = cxx.match_brace(SOURCE, start)
    assert SOURCE[end - 1] == "}" and SOURCE[end:].startswith("\n\nU qdot(")
    with pytest.raises(AnchorError, match="unbalanced"):
        cxx.match_brace("{ { }", 0)


def test_only_the_definition_is_found_not_calls_or_declarations() -> None:
    found = cxx.find_functions(SOURCE, "qdot")
    assert len(found) == 1
    text = found[0].text(SOURCE)
    assert text.startswith("template <typename U, int bits>\ninline U qdot(")
    assert text.endswith("return sum + qdot_helper(w);\n}")
    assert SOURCE[found[0].body_open] == "{"


def test_a_return_or_operator_before_the_name_makes_it_a_call() -> None:
    text = "int f() { return g(1); }\nint h() { x = g (2); }\nint g(int a) { return a; }\n"
    (g,) = cxx.find_functions(text, "g")
    assert g.text(text) == "int g(int a) { return a; }"


def test_member_and_qualified_names_are_not_the_function() -> None:
    text = "void a() { obj.f(1); p->f(2); ns::f(3); }\nvoid f(int x) {}\n"
    assert [fn.text(text) for fn in cxx.find_functions(text, "f")] == ["void f(int x) {}"]


def test_overloads_need_an_index() -> None:
    text = "void f(int) {}\nvoid f(float) {}\n"
    with pytest.raises(AnchorError, match="defined 2 times"):
        cxx.find_function(text, "f")
    assert cxx.function_text(text, "f", 1) == "void f(float) {}"
    with pytest.raises(AnchorError, match="not 3"):
        cxx.find_function(text, "f", 2)
    with pytest.raises(AnchorError, match="'nope' not found"):
        cxx.find_function(text, "nope")


def test_macro_span_covers_continuation_lines() -> None:
    start, end = cxx.find_macro(SOURCE, "MACRO")
    assert SOURCE[start:end].endswith("} while (0)\n")
    assert SOURCE[end:] == "int after_macro;\n"
    with pytest.raises(AnchorError):
        cxx.find_macro(SOURCE, "MISSING")


def test_statement_is_whitespace_insensitive_unique_and_keeps_its_comment() -> None:
    text = "void f() {\n  // why\n  if (a &&   b) {\n    c();\n  }\n  d();\n}\n"
    start, end = cxx.find_statement(text, "if (a && b) {")
    assert text[start:end] == "  // why\n  if (a &&   b) {\n    c();\n  }\n"
    start, end = cxx.find_statement(text, "d()")
    assert text[start:end] == "  d();\n"
    with pytest.raises(AnchorError, match="occurs 2 times"):
        cxx.find_statement("x = 1;\nx = 1;\n", "x = 1")
    with pytest.raises(AnchorError, match="not found"):
        cxx.find_statement(text, "e()")


def test_finders_hold_on_the_pinned_upstream_header() -> None:
    try:
        header = wheels.header_path("0.32.1", "mlx/backend/metal/kernels/quantized.h")
    except Exception as exc:
        pytest.skip(f"needs the mlx-cpu 0.32.1 wheel: {exc}")
    text = header.read_text()
    for name in ("qmv_fast_impl", "qmv_impl", "load_vector", "load_vector_safe"):
        body = cxx.function_text(text, name)
        assert body.count("{") == body.count("}") or "'{'" in body, name
        assert f"{name}(" in body
    # qdot is called inside qmv_fast_impl, defined once on its own.
    assert "qdot<" in cxx.function_text(text, "qmv_fast_impl")
    assert len(cxx.find_functions(text, "qdot")) == 1
