"""Kernel edits are diff templates: one per upstream function or file, rendered with
the patch's options (flavour differences inside), hunk counts taken from what rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchkit.carry import hunks, render
from patchkit.errors import AnchorError, UserError

UPSTREAM = "int f() {\n  int a = 1;\n  int b = 2;\n  return a + b;\n}\n"
# The hunk header's counts are the upstream flavour's; the overlay's branch has one line more.
TEMPLATE = """--- a/f
+++ b/f
@@ -1,5 +1,5 @@
 int f() {
   int a = 1;
-  int b = 2;
+  int b = 3;
{% if flavour == "overlay" %}
+  // overlay only
{% endif %}
   return a + b;
 }
"""


def _plan(tmp_path: Path, template: str) -> render.FilePlan:
    folder = tmp_path / "templates" / "src" / "f.cpp"
    folder.mkdir(parents=True)
    (folder / "f.diff.j2").write_text(template)
    (folder / "edits.toml").write_text(
        'backend = "metal"\n\n[[edit]]\nop = "patch_function"\nanchor = "f"\n'
        'template = "f.diff.j2"\n'
    )
    (plan,) = render.load_plans(tmp_path / "templates")
    return plan


@pytest.mark.parametrize("flavour", ["upstream", "overlay"])
def test_a_diff_template_renders_per_flavour(tmp_path: Path, flavour: str) -> None:
    plan = _plan(tmp_path, TEMPLATE)
    text = render.render_file(plan, UPSTREAM, render.RenderOptions(flavour=flavour))
    assert "int b = 3;" in text and "int b = 2;" not in text
    assert ("// overlay only" in text) == (flavour == "overlay")


def test_recount_takes_the_counts_from_the_body() -> None:
    overlay = render.environment(Path(".")).from_string(TEMPLATE).render(flavour="overlay")
    assert "@@ -1,5 +1,5 @@" in overlay  # as written: one line short for this flavour
    assert "@@ -1,5 +1,6 @@" in hunks.recount(overlay)
    assert hunks.recount(hunks.recount(overlay)) == hunks.recount(overlay)


def test_a_hunk_that_no_longer_fits_names_its_template(tmp_path: Path) -> None:
    plan = _plan(tmp_path, TEMPLATE.replace("int a = 1;", "int a = 7;"))
    with pytest.raises(AnchorError, match=r"f\.diff\.j2: f, hunk 1: its upstream lines no longer"):
        render.render_file(plan, UPSTREAM, render.RenderOptions())


def test_a_template_error_names_file_and_line(tmp_path: Path) -> None:
    plan = _plan(tmp_path, TEMPLATE.replace("{% endif %}", "{% endfor %}"))
    with pytest.raises(UserError, match=r"f\.diff\.j2:10"):
        render.render_file(plan, UPSTREAM, render.RenderOptions())


def test_no_kernel_edit_has_an_overlay_twin() -> None:
    """Flavour differences live inside one template per upstream function or file."""
    for plan in render.load_plans(render.TEMPLATES_DIR):
        patch_templates = [e.template for e in plan.edits if e.op in render.PATCH_OPS]
        assert all(t.endswith(".diff.j2") for t in patch_templates), plan.path
        anchors = [(e.op, e.anchor, e.index) for e in plan.edits if e.op in render.PATCH_OPS
                   and e.backend in (None, plan.backend)]  # fmt: skip
        assert len(anchors) == len(set(anchors)), f"{plan.path}: one diff per function"
        assert not [p for p in plan.template_dir.glob("*_overlay*")], plan.path
