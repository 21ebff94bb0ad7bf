"""``patchkit vendor``: put the exported patch into the user's own MLX checkout.

Two flavours, both from ``patches/<pin>/``:

- ``series``: ``git am`` of the format-patch series, so the checkout gains the
  same commits ``patchkit apply`` made (what an upstream PR carries);
- ``overlay``: the touched files copied whole over the checkout's (for engines
  that vendor MLX's sources), left uncommitted for the user to review.

Either way the checkout must be at the pinned commit and clean: the series
would not apply elsewhere, and an overlay over other changes would silently
drop them. ``dry_run`` checks all of that and says what would change, touching
nothing. Vendor holds the patchkit checkout's lock, so it reads ``patches/``
whole, never while an apply or rebase is replacing it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.carry import export, pin, transaction
from patchkit.errors import UserError
from patchkit.util import git

FLAVOURS = ("series", "overlay")


@dataclass
class VendorResult:
    """What vendor did (or, for a dry run, would do)."""

    checkout: Path
    flavour: str
    files: list[str] = field(default_factory=list)  # series: patch files; overlay: paths
    head: str = ""
    dry_run: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "checkout": str(self.checkout),
            "flavour": self.flavour,
            "files": self.files,
            "head": self.head,
            "dry_run": self.dry_run,
        }


def _require_pinned_clean_checkout(checkout: Path, p: pin.Pin) -> None:
    head = git.try_rev_parse(checkout, "HEAD")
    if head is None:
        raise UserError(f"{checkout} is not a git checkout of MLX (no HEAD)")
    if head != p.commit:
        raise UserError(
            f"{checkout} is at {head[:8]}, the patch is for {p.short}: "
            f"`git -C {checkout} checkout {p.short}` (or rebase the patch with patchkit rebase)"
        )
    if git.status_porcelain(checkout).strip():
        raise UserError(f"{checkout} has uncommitted changes; commit or stash them and retry")


def vendor(
    root: Path,
    checkout: Path,
    flavour: str,
    *,
    dry_run: bool = False,
    wait: bool = True,
    progress: Callable[[str], None] = lambda _: None,
) -> VendorResult:
    """Apply ``patches/<pin>/`` to ``checkout`` as ``flavour``; see the module doc."""
    if flavour not in FLAVOURS:
        raise UserError(f"unknown flavour {flavour!r}; choose from {', '.join(FLAVOURS)}")
    with transaction.writer(root, wait=wait, progress=progress):
        return _vendor(root, checkout, flavour, dry_run)


def _vendor(root: Path, checkout: Path, flavour: str, dry_run: bool) -> VendorResult:
    """The work of :func:`vendor`, under the checkout's lock."""
    p = pin.load(root / pin.PIN_FILE)
    patches = root / transaction.PATCHES / p.short
    if not patches.is_dir():
        raise UserError(f"{patches} does not exist; run `patchkit apply` first")
    checkout = checkout.resolve()
    _require_pinned_clean_checkout(checkout, p)
    result = VendorResult(checkout, flavour, dry_run=dry_run)
    if flavour == "series":
        series = sorted(patches.glob("*.patch"))
        result.files = [s.name for s in series]
        # The whole series, in order, on a throwaway index: nothing is touched unless it all
        # applies (the Metal patch edits what the JIT fix's wrote).
        git.apply_check_series(checkout, series)
        if not dry_run:
            committer = git.user_identity(checkout) or git.FIXED_AUTHOR
            git.am(checkout, series, committer=committer)
    else:
        overlay = patches / export.OVERLAY
        result.files = list(export.overlay_files(patches))
        for rel in result.files:
            if not (checkout / rel).is_file():
                raise UserError(f"{checkout} has no {rel}; is it an MLX checkout?")
        if not dry_run:
            for rel in result.files:
                shutil.copyfile(overlay / rel, checkout / rel)
    result.head = git.rev_parse(checkout, "HEAD")
    return result
