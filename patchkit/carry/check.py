"""``patchkit check`` and ``patchkit status``: is what is committed what the tool would produce?

``check`` re-renders for the pinned commit into a scratch directory and compares
it byte for byte with ``patches/<short>/``, and compares the blob ids recorded in
``pin.toml`` with the tree. It is the CI drift check: a hand-edited patch, a
template changed without re-running apply, or a clone that is not the pinned
tree all make it fail, each named.

``status`` is the read-mostly summary for a person: what is pinned, where the
patch is applied (the branch in the cached clone) and whether ``patches/`` is
current.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.carry import export, pin, render, source, workspace
from patchkit.util import git
from patchkit.util.staging import same_tree


@dataclass
class CheckResult:
    """Outcome of a drift check; ``ok`` is what CI gates on."""

    commit: str
    blob_mismatches: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    touched_drift: dict[str, list[str]] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)
    extra_dirs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when pin.toml matches the tree and patches/ matches a fresh render."""
        return not (self.blob_mismatches or self.touched_drift or self.stale or self.extra_dirs)

    def problems(self) -> list[str]:
        """One line per problem, for the CLI."""
        lines = [
            f"blob mismatch: {p} is {actual or 'missing'} at {self.commit[:8]},"
            f" pin.toml records {rec}"
            for p, (rec, actual) in self.blob_mismatches.items()
        ]
        for kind, paths in self.touched_drift.items():
            lines += [f"pin.toml blobs {kind}: {p}" for p in paths]
        lines += [f"stale: patches/{self.commit[:8]}/{p}" for p in self.stale]
        lines += [f"not for the pinned commit: patches/{d}" for d in self.extra_dirs]
        return lines

    def to_json(self) -> dict[str, object]:
        """A JSON-friendly summary."""
        return {
            "ok": self.ok,
            "commit": self.commit,
            "blob_mismatches": {p: list(v) for p, v in self.blob_mismatches.items()},
            "touched_drift": self.touched_drift,
            "stale": self.stale,
            "extra_dirs": self.extra_dirs,
        }


def check(
    *,
    root: Path,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = workspace.DEFAULT_OPTIONS,
    progress: source.Progress = source._quiet,
) -> CheckResult:
    """Compare ``pin.toml`` with the tree and ``patches/`` with a fresh render; never writes."""
    p = pin.load(root / pin.PIN_FILE)
    clone = source.open_source(mlx_repo, p.url, progress=progress)
    commit = source.resolve(clone, p.commit, progress=progress)
    result = CheckResult(commit)
    result.blob_mismatches = pin.mismatches(p, lambda path: git.blob_id(clone, commit, path))
    touched = workspace.touched(options, templates_dir)
    missing, extra = sorted(set(touched) - set(p.blobs)), sorted(set(p.blobs) - set(touched))
    result.touched_drift = {k: v for k, v in (("missing", missing), ("extra", extra)) if v}
    progress("rendering")
    # A throwaway directory outside the checkout and no ref moved: check and
    # status only read (they run on read-only checkouts and in CI).
    stage = Path(tempfile.mkdtemp(prefix="patchkit-check."))
    try:
        info = export.PinInfo(p.url, commit, p.release)
        workspace.build(clone, commit, options, templates_dir, info, stage, move_refs=False)
        result.stale = same_tree(stage, root / workspace.PATCHES / p.short)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    result.extra_dirs = sorted(
        d.name
        for d in (root / workspace.PATCHES).iterdir()
        if d.is_dir() and not d.name.startswith(".") and d.name != p.short
    )
    return result


def status(
    *,
    root: Path,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = workspace.DEFAULT_OPTIONS,
    progress: source.Progress = source._quiet,
) -> dict[str, object]:
    """What is pinned, where it is applied, and whether ``patches/`` is current."""
    p = pin.load(root / pin.PIN_FILE)
    clone = source.open_source(mlx_repo, p.url, progress=progress)
    branch = workspace.BRANCH_PREFIX + p.short
    result = check(
        root=root,
        mlx_repo=mlx_repo,
        templates_dir=templates_dir,
        options=options,
        progress=progress,
    )
    head = git.try_rev_parse(clone, f"refs/heads/{branch}")
    return {
        "upstream_commit": p.commit,
        "upstream_url": p.url,
        "release": p.release,
        "bumps": len(p.history),
        "touched": sorted(p.blobs),
        "clone": str(clone),
        "branch": branch,
        "branch_head": head,
        "base_ref": git.try_rev_parse(clone, source.BASE_REF),
        "patches_dir": str(root / workspace.PATCHES / p.short),
        "patches_current": result.ok,
        "problems": result.problems(),
    }
