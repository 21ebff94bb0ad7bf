"""``patchkit apply``: render the templates against a pinned MLX tree, commit, export.

Flow: resolve REV in the cached clone -> check the touched files' blob ids
against ``pin.toml`` -> render in a fresh detached worktree -> one commit per
backend with a fixed author and the upstream commit's date -> branch
``patchkit/<short>`` -> export ``patches/<short>/`` (series + overlay) ->
``pin.toml``. Outputs are staged and renamed into place only after every step
succeeded, and the worktree is always removed, so a failure leaves nothing
half-applied. Because every input is fixed, running apply twice produces the
same commit ids and byte-identical ``patches/``, committed to git or not.

Apply holds the checkout's lock and then the clone's for the whole run, so two
applies at once run one after the other (the second waits, or with ``wait=False``
is refused); under the lock, an interrupted earlier write is finished or rolled
back first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from patchkit.carry import export, pin, render, source
from patchkit.carry.commit import BRANCH_PREFIX
from patchkit.carry.transaction import (
    PATCHES,
    begin_outputs,
    ensure_outputs_clean,
    write_outputs,
    writer,
)
from patchkit.errors import BlobMismatchError, UserError
from patchkit.util import git


@dataclass
class ApplyResult:
    """What apply did, for the CLI and ``--json``."""

    upstream: str
    head: str
    branch: str
    clone: Path
    patches_dir: Path
    files: list[str]
    patches_changed: bool
    pin_changed: bool
    blobs: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)  # files apply does not produce, dropped

    def to_json(self) -> dict[str, object]:
        """A JSON-friendly summary."""
        return {
            "upstream_commit": self.upstream,
            "head": self.head,
            "branch": self.branch,
            "clone": str(self.clone),
            "patches_dir": str(self.patches_dir),
            "files": self.files,
            "patches_changed": self.patches_changed,
            "pin_changed": self.pin_changed,
            "blobs": self.blobs,
            "removed": self.removed,
        }


def apply(
    rev: str | None,
    *,
    root: Path,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = render.DEFAULT_OPTIONS,
    release: str | None = None,
    progress: source.Progress = source._quiet,
    wait: bool = True,
) -> ApplyResult:
    """Apply the patch at ``rev`` and export ``root/patches/<short>``; see the module doc."""
    if release:
        pin.check_release(release)
    with writer(root, wait=wait, progress=progress):
        ensure_outputs_clean(root)
        pin_path = root / pin.PIN_FILE
        old = pin.load(pin_path) if pin_path.exists() else None
        if rev is None and old is None:
            raise UserError(f"no {pin_path} yet: pass --pin REV for the first apply")
        url = old.url if old else pin.UPSTREAM_URL
        clone = source.open_source(mlx_repo, url, progress=progress)
        with source.locked_clone(clone, wait=wait, progress=progress):
            return _apply(
                rev or old.commit, old, clone, root, templates_dir, options, release, progress
            )


def _apply(
    rev: str,
    old: pin.Pin | None,
    clone: Path,
    root: Path,
    templates_dir: Path,
    options: render.RenderOptions,
    release: str | None,
    progress: source.Progress,
) -> ApplyResult:
    """The work of :func:`apply`, under its locks."""
    upstream = source.resolve(clone, rev, progress=progress)
    if old and old.commit != upstream:
        raise UserError(
            f"pin.toml pins {old.short}, not {upstream[:8]}; move the pin with"
            f" `patchkit rebase --to {rev}`"
        )
    paths = render.touched(options, templates_dir)
    blobs = source.tree_blobs(clone, upstream, paths)
    if old:
        bad = pin.mismatches(old, lambda p: git.blob_id(clone, upstream, p))
        if bad:
            path, (recorded, actual) = next(iter(bad.items()))
            raise BlobMismatchError(
                f"{path} at {upstream[:8]} is blob {actual or 'missing'}, pin.toml records"
                f" {recorded}; the clone is not the pinned tree"
            )
    new_pin = pin.Pin(
        commit=upstream,
        blobs=blobs,
        url=old.url if old else pin.UPSTREAM_URL,
        release=release if release is not None else (old.release if old else ""),
        history=old.history if old else (pin.Bump("", upstream, pin.today(), "initial pin"),),
    )
    progress("rendering")
    txn = begin_outputs(root)
    try:
        staged = txn.stage / new_pin.short
        info = export.PinInfo(new_pin.url, upstream, new_pin.release)
        rendered = render.render_all(source.reader(clone, upstream), options, templates_dir)
        head, files = export.export_patch(clone, upstream, rendered, info, staged)
        # patches/<short>/ holds only what apply writes; anything else there (git-ignored
        # files included) goes with the old folder, and the result says so.
        patches_changed, pin_changed, removed = write_outputs(root, new_pin, txn, staged)
    except BaseException:
        txn.abort()
        raise
    return ApplyResult(
        upstream,
        head,
        BRANCH_PREFIX + upstream[:8],
        clone,
        root / PATCHES / new_pin.short,
        files,
        patches_changed,
        pin_changed,
        blobs,
        removed,
    )
