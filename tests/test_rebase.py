"""rebase: the exactness gates, the anchor-following re-render, the 3-way fallback, atomicity.

Upstream material is real: the 0.32.1 and 0.32.4 quantized.h from the mlx-cpu
wheels, and commits made by editing the 0.32.1 text in the ways upstream does
(code moved, an unrelated function changed, a called helper replaced by its
0.32.4 version, an anchor renamed).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from support_git import PIN_SHA, QH, mlx_clone, write_templates

from patchkit.carry import apply, cxx, pin, rebase, render, source, wheels
from patchkit.errors import UserError
from patchkit.util import git
from patchkit.verify import rebase_gate

# Fixtures (header_repo, upstream, env) live in tests/support_git.py.
pytest_plugins = ("support_git",)

DATE = "2026-08-20T00:00:00+00:00"


class ParityStub:
    """Stands in for the CPU emulator (too slow for every case); records what it was given."""

    def __init__(self, ok: bool | None) -> None:
        self.ok, self.headers = ok, []

    def __call__(self, upstream: str, header: str) -> rebase.Parity | None:
        self.headers.append(header)
        if self.ok is None:
            return None
        return rebase.Parity(
            self.ok, "stub: 3 cases", () if self.ok else ("qmv M=3 row 1 differs",)
        )


def commit_edit(e: dict, edit: Callable[[str], str], branch: str) -> str:
    """Commit ``edit(quantized.h at the old pin)`` on a new upstream branch; return its id."""
    repo = e["path"]
    git.run(repo, "checkout", "--quiet", "-B", branch, e["old"])
    path = repo / QH
    path.write_bytes(edit(path.read_bytes().decode()).encode())
    git.add(repo, [QH])
    return git.commit(repo, f"upstream: {branch}", date=DATE, author=("MLX", "mlx@example.com"))


def replace_function(text: str, name: str, new_text: str) -> str:
    fn = cxx.find_function(text, name)
    return text[: fn.span[0]] + new_text + text[fn.span[1] :]


def moved_and_unrelated(text: str) -> str:
    """Code above the anchors grows and qvm_impl (not a dependency) changes."""
    qvm = cxx.function_text(text, "qvm_impl")
    text = replace_function(text, "qvm_impl", qvm.replace("{", "{\n  // upstream tweak", 1))
    return text.replace(
        "using namespace metal;\n", "using namespace metal;\n\n// moved\n// down\n", 1
    )


def new_load_vector(text: str) -> str:
    """Only a called helper changes: 0.32.4's load_vector in the 0.32.1 file."""
    newer = cxx.function_text(wheels.read_header("0.32.4", QH), "load_vector")
    return replace_function(text, "load_vector", newer)


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def do_rebase(e: dict, rev: str, parity: ParityStub, templates: Path | None = None):
    return rebase.rebase(
        rev, root=e["root"], templates_dir=templates or e["templates"], parity_check=parity
    )


def test_follows_moved_anchor_and_accepts_unrelated_change(env: dict) -> None:
    old = apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    old_overlay = (old.patches_dir / "overlay" / QH).read_text()
    new = commit_edit(env, moved_and_unrelated, "unrelated")
    parity = ParityStub(True)
    r = do_rebase(env, new[:10], parity)
    assert (r.changed_mirrored, r.changed_called, r.merged_files) == ({}, {}, [])
    assert r.parity and r.parity.ok and "// patchkit test payload" in parity.headers[0]
    root = env["root"]
    assert not (root / "patches" / env["old"][:8]).exists()  # superseded export dropped
    overlay = (root / "patches" / new[:8] / "overlay" / QH).read_text()
    # The insertion followed qmv_impl three lines down: 982 -> 985 in the hunk header.
    assert "//   @@ -982,6 +982," in old_overlay
    assert "//   @@ -985,6 +985," in overlay, overlay[:800]
    p = pin.load(root / "pin.toml")
    assert p.commit == new and [b.new for b in p.history] == [env["old"], new]
    last = p.history[-1]
    assert (last.note, last.called, last.routing, last.parity) == ("rebase", (), (), "passed")
    assert p.blobs[QH] == git.blob_id(env["path"], new, QH)


def test_refuses_when_a_mirrored_function_changes(env: dict) -> None:
    """0.32.4 (a real release) rewrites qmv_fast_impl's loop: the M = 1 order may differ."""
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    before = snapshot(env["root"])
    parity = ParityStub(True)
    with pytest.raises(rebase.RebaseRefused, match=r"mirrors \(.*quantized.h: qmv_fast_impl\)"):
        do_rebase(env, env["new"], parity)
    assert snapshot(env["root"]) == before and parity.headers == []


@pytest.mark.parametrize(
    ("parity_ok", "accepted"),
    [
        (True, True),  # called helper changed, parity passes: accept and report
        (False, False),  # control: parity fails -> refuse, naming the failure
        (None, False),  # emulator unavailable: a changed helper cannot be judged
    ],
    ids=["parity-pass", "parity-fail", "parity-missing"],
)
def test_called_function_change_is_gated_on_parity(
    env: dict, parity_ok: bool | None, accepted: bool
) -> None:
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    new = commit_edit(env, new_load_vector, "load-vector")
    before = snapshot(env["root"])
    if accepted:
        r = do_rebase(env, new, ParityStub(parity_ok))
        assert r.changed_called == {QH: ["load_vector"]} and r.written
        assert "load_vector" in pin.load(env["root"] / "pin.toml").history[-1].called
        return
    match = "row 1 differs" if parity_ok is False else "not available to judge"
    with pytest.raises(rebase.RebaseRefused, match=match):
        do_rebase(env, new, ParityStub(parity_ok))
    assert snapshot(env["root"]) == before


QUAD_EDITS = """\
backend = "metal"
[depends]
mirrored = ["qmv_impl"]
called = []
[[edit]]
op = "after_function"
anchor = "qmv_quad_impl"
template = "copy.j2"
"""
QUAD_SNIPPET = "// patchkit payload after qmv_quad_impl\n"


def rename_quad(text: str) -> str:
    return text.replace("METAL_FUNC void qmv_quad_impl(", "METAL_FUNC void qmv_quad_impl_v2(", 1)


def rename_quad_and_touch_end(text: str) -> str:
    """Rename the anchor and add a line exactly where the patch inserts: a real conflict."""
    fn = cxx.find_function(text, "qmv_quad_impl")
    end = text.index("\n\n", fn.span[1]) + 2  # after the blank line, where the snippet goes
    return rename_quad(text[:end] + "// upstream note\n" + text[end:])


@pytest.mark.parametrize(
    ("edit", "conflict"),
    [(rename_quad, False), (rename_quad_and_touch_end, True)],
    ids=["anchor-renamed-clean-merge", "anchor-renamed-conflict"],
)
def test_vanished_anchor_falls_back_to_three_way_merge(
    env: dict, tmp_path: Path, edit: Callable[[str], str], conflict: bool
) -> None:
    templates = write_templates(tmp_path / "quad", QUAD_EDITS, QUAD_SNIPPET)
    apply.apply(env["old"], root=env["root"], templates_dir=templates)
    new = commit_edit(env, edit, edit.__name__)
    before = snapshot(env["root"])
    if not conflict:
        r = do_rebase(env, new, ParityStub(True), templates)
        assert r.merged_files == [QH]
        text = (env["root"] / "patches" / new[:8] / "overlay" / QH).read_text()
        assert "qmv_quad_impl_v2(" in text and QUAD_SNIPPET in text
        assert "<<<<<<<" not in text
        return
    # The error names the file and the anchor that failed, not lines of a discarded merge.
    with pytest.raises(
        rebase.MergeConflictError,
        match=rf"conflicts \({QH}: copy.j2: function 'qmv_quad_impl' not found",
    ) as info:
        do_rebase(env, new, ParityStub(True), templates)
    assert "nothing was written" in str(info.value)
    assert isinstance(info.value, UserError)
    assert snapshot(env["root"]) == before


def test_conflicts_in_reports_line_ranges() -> None:
    text = "a\n<<<<<<< overlay\nx\n=======\ny\n>>>>>>> new-upstream\nb\n"
    assert [str(c) for c in rebase.conflicts_in("f.h", text)] == ["f.h:2-6"]
    assert rebase.conflicts_in("f.h", "a\nb\n") == []  # control: clean text


@pytest.mark.wide
def test_real_parity_accepts_a_called_helper_change(env: dict, tmp_path: Path) -> None:
    """The real gate: the real quantized.h templates, CPU emulator, load_vector from 0.32.4.

    Runs with --wide: the quick parity suite alone takes ~45 s (two toolchains).
    """
    real = Path(__file__).resolve().parent.parent / "templates" / QH
    templates = tmp_path / "real" / "templates"
    shutil.copytree(real, templates / QH)
    apply.apply(env["old"], root=env["root"], templates_dir=templates)
    new = commit_edit(env, new_load_vector, "load-vector")
    r = rebase.rebase(
        new,
        root=env["root"],
        templates_dir=templates,
        parity_check=rebase_gate.emulator_parity,  # what the CLI passes
        fp_parity_check=rebase_gate.emulator_fp_parity,
    )
    assert r.parity is not None and r.parity.ok, r.parity
    assert r.changed_called == {QH: ["load_vector"]}


def test_rebase_to_the_pin_is_a_no_op(env: dict) -> None:
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"], release="0.32.1")
    before = snapshot(env["root"])
    parity = ParityStub(True)
    r = do_rebase(env, env["old"][:10], parity)
    assert not r.written and "nothing to do" in r.summary()
    assert parity.headers == [], "no gate runs for a no-op"
    assert snapshot(env["root"]) == before  # release twin, overlay headers, history unchanged


def commit_untouched(e: dict, branch: str) -> str:
    """An upstream commit that changes a file the patch does not touch."""
    repo = e["path"]
    git.run(repo, "checkout", "--quiet", "-B", branch, e["old"])
    (repo / "NOTES.md").write_text("unrelated upstream change\n")
    git.add(repo, ["NOTES.md"])
    return git.commit(repo, f"upstream: {branch}", date=DATE, author=("MLX", "mlx@example.com"))


def test_release_twin_kept_while_touched_files_match_and_downgrade_refused(env: dict) -> None:
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"], release="0.32.1")
    new = commit_untouched(env, "untouched")
    do_rebase(env, new, ParityStub(True))
    assert pin.load(env["root"] / "pin.toml").release == "0.32.1"  # same blobs: still a twin
    before = snapshot(env["root"])
    with pytest.raises(rebase.RebaseRefused, match="older than the pin"):
        do_rebase(env, env["old"], ParityStub(True))
    assert snapshot(env["root"]) == before
    r = rebase.rebase(
        env["old"], root=env["root"], templates_dir=env["templates"],
        parity_check=ParityStub(True), allow_downgrade=True,
    )  # fmt: skip
    assert r.written and pin.load(env["root"] / "pin.toml").commit == env["old"]


def test_release_twin_dropped_when_a_touched_file_changes(env: dict) -> None:
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"], release="0.32.1")
    new = commit_edit(env, moved_and_unrelated, "unrelated")
    do_rebase(env, new, ParityStub(True))
    assert pin.load(env["root"] / "pin.toml").release == ""  # quantized.h is no longer 0.32.1's


ROUTING_EDITS = """\
backend = "metal"

[depends]
mirrored = []
called = []

[[edit]]
op = "before_statement"
anchor = "if (out_row >= out_vec_size) {"
within = "qmv_impl"
template = "copy.j2"
"""


def test_refuses_when_upstream_edits_an_anchored_statement(env: dict, tmp_path: Path) -> None:
    """The anchor still matches, but upstream changed the block the snippet sits before."""
    templates = write_templates(tmp_path / "routing", ROUTING_EDITS, "// patchkit guard\n")
    apply.apply(env["old"], root=env["root"], templates_dir=templates)
    narrowed = commit_edit(
        env,
        lambda t: t.replace(
            "  if (out_row >= out_vec_size) {\n    return;",
            "  if (out_row >= out_vec_size) {\n    // upstream: new early exit\n    return;",
            1,
        ),
        "narrowed",
    )
    before = snapshot(env["root"])
    with pytest.raises(rebase.RebaseRefused, match=r"copy\.j2 at 'if \(out_row >= out_vec_size\)"):
        do_rebase(env, narrowed, ParityStub(True), templates)
    assert snapshot(env["root"]) == before
    # Control: an edit elsewhere in the file moves the anchor but leaves the block alone.
    moved = commit_edit(env, moved_and_unrelated, "unrelated")
    assert do_rebase(env, moved, ParityStub(True), templates).written


@pytest.mark.skipif(
    mlx_clone() is None, reason="needs a full MLX clone with 9a795735: set PATCHKIT_MLX_REPO"
)
def test_a_rebase_without_merges_stages_the_changes_as_apply_does() -> None:
    """Rendered onto a tree where every anchor holds, a rebase commits the same series as
    apply: one commit per change (the two fixes, Metal, CUDA), the JIT fix before Metal in the
    one file both edit. Without its stages a rebase would fold the fix into Metal."""
    read = source.reader(Path(mlx_clone() or ""), PIN_SHA)
    options = render.RenderOptions()
    plans = render.selected_plans(options)
    rendered, merged, conflicts = rebase.render_or_merge(plans, read, read, options)
    assert (merged, conflicts) == ([], [])
    applied = render.render_all(read, options, render.TEMPLATES_DIR)
    assert [b for b, _ in rendered.stages] == ["jit-fix", "qmm-sm90", "metal", "cuda"]
    assert rendered.stages == applied.stages
