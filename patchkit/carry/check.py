"""``patchkit check`` and ``patchkit status``: is what is committed what the tool would produce?

``check`` re-renders for the pinned commit into a scratch directory and compares
it byte for byte with ``patches/<short>/``, and compares the blob ids recorded in
``pin.toml`` with the tree. It is the CI drift check: a hand-edited patch, a
template changed without re-running apply, or a clone that is not the pinned
tree all make it fail, each named.

``status`` is the summary for a person: what is pinned, where the patch is
applied (the branch in the cached clone) and whether ``patches/`` is current.

Both only read: they never fetch, move a ref or touch the checkout (a revision
missing from the cache is an error whose message gives the fetch to run). When
a killed apply or rebase left a write half done, they read the state it left,
old or new (see :func:`patchkit.util.staging.view`), and say which.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.carry import export, pin, render, source, transaction
from patchkit.carry.commit import BRANCH_PREFIX
from patchkit.errors import UserError
from patchkit.util import git, staging
from patchkit.util.staging import same_tree

_INTERRUPTED = {
    "new": "a killed apply or rebase left patches/{txn} committed: the new state stands and"
    " the next `patchkit apply` finishes moving its files",
    "old": "a killed apply or rebase left patches/{txn} uncommitted: the old state stands and"
    " the next `patchkit apply` removes the leftover",
}


@dataclass
class CheckResult:
    """Outcome of a drift check; ``ok`` is what CI gates on."""

    commit: str
    blob_mismatches: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    touched_drift: dict[str, list[str]] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)
    extra_dirs: list[str] = field(default_factory=list)
    missing: bool = False  # patches/<short>/ is not there at all
    interrupted: str | None = None  # "old" or "new": the state a killed write left

    @property
    def ok(self) -> bool:
        """True when pin.toml matches the tree and patches/ matches a fresh render."""
        return not (
            self.blob_mismatches
            or self.touched_drift
            or self.stale
            or self.extra_dirs
            or self.interrupted
        )

    @property
    def only_interrupted(self) -> bool:
        """A killed write is the one thing found: not stale, but not done either."""
        return bool(self.interrupted) and dataclasses.replace(self, interrupted=None).ok

    def problems(self) -> list[str]:
        """One line per problem, for the CLI."""
        lines = [
            f"blob mismatch: {p} is {actual or 'missing'} at {self.commit[:8]},"
            f" pin.toml records {rec}"
            for p, (rec, actual) in self.blob_mismatches.items()
        ]
        for kind, paths in self.touched_drift.items():
            lines += [f"pin.toml blobs {kind}: {p}" for p in paths]
        if self.missing:
            lines.append(f"stale: patches/{self.commit[:8]}/ is missing")
        else:
            lines += [f"stale: patches/{self.commit[:8]}/{p}" for p in self.stale]
        lines += [f"not for the pinned commit: patches/{d}" for d in self.extra_dirs]
        if self.interrupted:
            lines.append(_INTERRUPTED[self.interrupted].format(txn=transaction.TXN_DIR))
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
            "missing": self.missing,
            "interrupted": self.interrupted,
        }


def load_pin(root: Path) -> pin.Pin:
    """``pin.toml`` as the checkout's current state has it (a killed write's new one included)."""
    if not root.is_dir():
        raise UserError(f"{root} is not a folder; pass --root PATCHKIT_CHECKOUT")
    target = root / pin.PIN_FILE
    return pin.load(transaction.output_path(root, target) or target)


def check(
    *,
    root: Path,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = render.DEFAULT_OPTIONS,
    progress: source.Progress = source._quiet,
) -> CheckResult:
    """Compare ``pin.toml`` with the tree and ``patches/`` with a fresh render; never writes."""
    p = load_pin(root)
    clone = source.open_source(mlx_repo, p.url, progress=progress)
    commit = source.resolve(clone, p.commit, progress=progress, fetch=False)
    result = CheckResult(commit, interrupted=transaction.outputs_state(root))
    result.blob_mismatches = pin.mismatches(p, lambda path: git.blob_id(clone, commit, path))
    touched = render.touched(options, templates_dir)
    missing, extra = sorted(set(touched) - set(p.blobs)), sorted(set(p.blobs) - set(touched))
    result.touched_drift = {k: v for k, v in (("missing", missing), ("extra", extra)) if v}
    progress("rendering")
    # A throwaway directory outside the checkout and no ref moved: check and
    # status only read (they run on read-only checkouts and in CI).
    staging.prune_scratch()
    patches = transaction.output_path(root, root / transaction.PATCHES / p.short)
    result.missing = patches is None
    with staging.scratch("check") as stage:
        info = export.PinInfo(p.url, commit, p.release)
        rendered = render.render_all(source.reader(clone, commit), options, templates_dir)
        export.export_patch(clone, commit, rendered, info, stage, move_refs=False)
        result.stale = same_tree(stage, patches or root / transaction.PATCHES / p.short)
    result.extra_dirs = _other_dirs(root, p.short)
    return result


def _other_dirs(root: Path, short: str) -> list[str]:
    """Folders in patches/ besides ``patches/<short>``, as the current state has them."""
    folder = root / transaction.PATCHES
    installed, removed = staging.journal_targets(
        root, folder / transaction.TXN_DIR, transaction.OUTPUTS
    )
    here = {d for d in folder.iterdir() if d.is_dir()} if folder.is_dir() else set()
    names = {d.name for d in (here | {t for t in installed if t.parent == folder}) - set(removed)}
    return sorted(n for n in names if not n.startswith(".") and n != short)


def status(
    *,
    root: Path,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = render.DEFAULT_OPTIONS,
    progress: source.Progress = source._quiet,
) -> dict[str, object]:
    """What is pinned, where it is applied, and whether ``patches/`` is current."""
    p = load_pin(root)
    clone = source.open_source(mlx_repo, p.url, progress=progress)
    branch = BRANCH_PREFIX + p.short
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
        "patches_dir": str(root / transaction.PATCHES / p.short),
        "patches_current": result.ok,
        "interrupted": result.interrupted,
        "problems": result.problems(),
    }
