"""apply / export / check / source on a real-header repository built from the mlx-cpu wheels."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from support_git import QH, write_templates

from patchkit import cli
from patchkit.carry import apply, check, pin, source
from patchkit.errors import AnchorError, BlobMismatchError, UserError
from patchkit.util import git

# Fixtures (header_repo, upstream, env) live in tests/support_git.py.
pytest_plugins = ("support_git",)

PIN_QH_BLOB = "f628c0561227b709e455d91dc0a0f5885368f26a"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (the project's outputs), for 'nothing was written' claims."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def run_apply(e: dict, rev: str | None = None, **kw: object) -> apply.ApplyResult:
    return apply.apply(rev or e["old"], root=e["root"], templates_dir=e["templates"], **kw)


def test_apply_commits_branch_and_exports(env: dict) -> None:
    r = run_apply(env, release="0.32.1")
    clone = source.clone_dir(str(env["path"]))
    assert git.rev_parse(clone, r.branch) == r.head
    assert git.rev_parse(clone, source.BASE_REF) == env["old"]
    assert git.out(clone, "diff", "--name-only", env["old"], r.head) == QH
    p = pin.load(env["root"] / "pin.toml")
    assert p.commit == env["old"] and p.blobs == {QH: PIN_QH_BLOB} and p.release == "0.32.1"
    d = r.patches_dir
    assert (d / "series").read_text().splitlines() == [x.name for x in sorted(d.glob("*.patch"))]
    overlay = (d / "overlay" / QH).read_text()
    assert f"// pinned:     {env['old']} (release 0.32.1)" in overlay
    assert f"// regenerate: patchkit apply --pin {env['old'][:8]}" in overlay
    assert "//   @@ -" in overlay and "METAL_FUNC void qmv_impl(" in overlay.split("\n", 9)[6]
    assert "// patchkit test payload (overlay)" in overlay  # overlay flavour
    assert "(upstream)" in (d / (d / "series").read_text().split()[0]).read_text()
    assert git.list_worktrees(clone) == [clone]  # the per-operation worktree is gone


def test_overlay_body_is_the_patched_file(env: dict) -> None:
    """Stripping the header gives exactly the overlay-flavour render of upstream."""
    from patchkit.carry import export, render

    r = run_apply(env)
    text = (r.patches_dir / "overlay" / QH).read_text()
    plans = render.load_plans(env["templates"])
    expected = render.render_file(
        plans[0],
        git.show_file(env["path"], env["old"], QH),
        render.RenderOptions(flavour="overlay"),
    )
    assert export.strip_header(QH, text) == expected
    assert export.strip_header(QH, expected) == expected  # control: no header, unchanged


def test_reapply_is_a_byte_identical_no_op(env: dict) -> None:
    first = run_apply(env)
    before = snapshot(env["root"])
    mtimes = {p: p.stat().st_mtime_ns for p in env["root"].rglob("*") if p.is_file()}
    second = run_apply(env, env["old"][:8])
    assert (second.head, second.patches_changed, second.pin_changed) == (first.head, False, False)
    assert snapshot(env["root"]) == before
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


def test_check_passes_then_fails_on_hand_edit(env: dict) -> None:
    run_apply(env)
    kw = {"root": env["root"], "templates_dir": env["templates"]}
    assert check.check(**kw).ok
    patch = next((env["root"] / "patches").glob("*/*.patch"))
    patch.write_text(patch.read_text().replace("patchkit test payload", "hand edit"))
    result = check.check(**kw)
    assert not result.ok and result.stale == [patch.name]
    assert f"stale: patches/{env['old'][:8]}/{patch.name}" in result.problems()


def _refs(clone: Path) -> str:
    return git.out(clone, "for-each-ref", "--format=%(refname) %(objectname)")


def test_check_and_status_read_only_after_a_template_edit(env: dict) -> None:
    run_apply(env)
    clone = source.clone_dir(source.source_spec(None))
    refs, before = _refs(clone), snapshot(env["root"])
    snippet = env["templates"] / QH / "copy.j2"
    snippet.write_text(snippet.read_text().replace("payload", "payload, edited"))
    root = env["root"]
    result = check.check(root=root, templates_dir=env["templates"])
    info = check.status(root=root, templates_dir=env["templates"])
    assert not result.ok and result.stale and not info["patches_current"]
    assert _refs(clone) == refs, "check/status moved a ref in the cache clone"
    assert snapshot(root) == before


def test_check_fails_on_blob_mismatch_and_extra_dir(env: dict) -> None:
    run_apply(env)
    path = env["root"] / "pin.toml"
    path.write_text(path.read_text().replace(PIN_QH_BLOB, "0" * 40))
    (env["root"] / "patches" / "deadbeef").mkdir()
    result = check.check(root=env["root"], templates_dir=env["templates"])
    assert QH in result.blob_mismatches and result.extra_dirs == ["deadbeef"]
    assert not result.ok


BAD_ANCHOR = """\
backend = "metal"
[[edit]]
op = "after_function"
anchor = "no_such_function_anywhere"
template = "copy.j2"
"""


@pytest.mark.parametrize(
    "failure",
    ["unknown-rev", "missing-anchor", "blob-mismatch", "dirty-outputs", "no-network-no-cache"],
)
def test_failures_write_nothing(env: dict, tmp_path: Path, failure: str) -> None:
    """Each failure is one actionable UserError and leaves outputs and clone as they were."""
    rev, expected = env["old"], UserError
    kw: dict[str, object] = {"templates_dir": env["templates"]}
    if failure in ("blob-mismatch", "dirty-outputs"):
        run_apply(env)
    if failure == "unknown-rev":
        rev, match = "0123456789abcdef", "'0123456789abcdef' is not a revision of "
    elif failure == "missing-anchor":
        kw["templates_dir"] = write_templates(tmp_path / "bad", BAD_ANCHOR, "// payload\n")
        missing = "function 'no_such_function_anywhere' not found"
        expected, match = AnchorError, f"{QH}: copy.j2: {missing}"
    elif failure == "blob-mismatch":
        p = env["root"] / "pin.toml"
        p.write_text(p.read_text().replace(PIN_QH_BLOB, "1" * 40))
        expected, match = BlobMismatchError, "pin.toml records 1111"
    elif failure == "dirty-outputs":
        git.init(env["root"])
        git.run(env["root"], "add", "--all")
        git.commit(env["root"], "outputs", date="2026-08-17T00:00:00+00:00")
        next((env["root"] / "patches").glob("*/series")).write_text("edited\n")
        match = "uncommitted changes .*commit or stash"
    else:
        kw["mlx_repo"], match = "file:///nonexistent/mlx.git", "cannot clone .* no cached copy"
    before = snapshot(env["root"])
    with pytest.raises(expected, match=match):
        apply.apply(rev, root=env["root"], **kw)
    assert snapshot(env["root"]) == before
    clone = source.clone_dir(source.source_spec(kw.get("mlx_repo")))
    assert not clone.exists() or git.list_worktrees(clone) == [clone]
    assert not list(env["root"].glob("patches/.stage.*"))


def test_clone_is_reused_offline(env: dict, upstream: dict) -> None:
    run_apply(env)
    os.rename(upstream["path"], str(upstream["path"]) + ".gone")  # the source vanishes
    spec = str(upstream["path"])
    clone = source.ensure_clone(spec)
    assert source.resolve(clone, env["old"][:10]) == env["old"]  # cached commit: no fetch
    with pytest.raises(UserError, match=r"fetching .* failed"):
        source.resolve(clone, "main-that-does-not-exist")


def test_cli_apply_check_status_json(env: dict) -> None:
    runner = CliRunner()
    args = ["--root", str(env["root"]), "--templates", str(env["templates"]), "--json"]
    res = runner.invoke(cli.main, ["apply", "--pin", env["old"], *args])
    assert res.exit_code == 0, res.output
    assert '"branch": "patchkit/' in res.output
    res = runner.invoke(cli.main, ["check", *args])
    assert res.exit_code == 0 and '"ok": true' in res.output
    res = runner.invoke(cli.main, ["status", *args])
    assert res.exit_code == 0 and '"patches_current": true' in res.output
    next((env["root"] / "patches").glob("*/series")).write_text("edited\n")
    res = runner.invoke(cli.main, ["check", *args])
    assert res.exit_code == 1 and '"ok": false' in res.output  # control: drift fails CI
    res = runner.invoke(cli.main, ["apply", "--pin", "nope", *args])
    assert res.exit_code == 1 and "'nope' is not a revision of" in res.output


def test_exported_series_reproduces_the_branch_with_git_am(env: dict, tmp_path: Path) -> None:
    """The series is a faithful export: `git am` on the pin rebuilds the branch's exact tree."""
    r = run_apply(env)
    wt = tmp_path / "am"
    git.run(None, "clone", "--quiet", str(env["path"]), str(wt))
    git.run(wt, "checkout", "--quiet", "--detach", env["old"])
    series = (r.patches_dir / "series").read_text().split()
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    git.run(wt, *ident, "am", "--quiet", *[str(r.patches_dir / s) for s in series])
    clone = source.clone_dir(str(env["path"]))
    assert git.out(wt, "rev-parse", "HEAD^{tree}") == git.out(
        clone, "rev-parse", f"{r.head}^{{tree}}"
    )


def test_apply_names_files_it_removes_from_patches(env: dict) -> None:
    run_apply(env)
    stray = env["root"] / "patches" / env["old"][:8] / "notes.local"  # e.g. git-ignored
    stray.write_text("mine\n")
    snippet = env["templates"] / QH / "copy.j2"
    snippet.write_text(snippet.read_text().replace("payload", "payload, edited"))
    r = apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    assert r.removed == ["notes.local"] and not stray.exists()
