"""MLX source trees: a cached bare clone per upstream, and one fresh worktree per operation.

Where the source comes from: ``--mlx-repo PATH_OR_URL``, else env
``PATCHKIT_MLX_REPO``, else the upstream URL in ``pin.toml``. Whatever it is,
patchkit works in its *own* bare clone under the user cache directory (local
paths are hard-linked by git, so this is cheap), so branches, refs and worktrees
patchkit creates never land in the user's checkout.

The clone is made in a staging directory and renamed into place, so an
interrupted clone never leaves a half-populated cache. It is reused offline: a
revision already present is used without touching the network, and a fetch that
fails is only an error when the revision is still unknown afterwards.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs

from patchkit.carry.pin import UPSTREAM_URL
from patchkit.errors import ToolError, UserError
from patchkit.util import git

ENV_REPO = "PATCHKIT_MLX_REPO"
ENV_CACHE = "PATCHKIT_CACHE_DIR"
BASE_REF = "refs/patchkit/base"

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    """Default progress sink: say nothing."""


def cache_root() -> Path:
    """patchkit's cache directory (``PATCHKIT_CACHE_DIR`` overrides the platform default)."""
    override = os.environ.get(ENV_CACHE)
    return Path(override) if override else platformdirs.user_cache_path("patchkit")


def source_spec(mlx_repo: str | None, default_url: str = UPSTREAM_URL) -> str:
    """The source to clone from: the option, else ``PATCHKIT_MLX_REPO``, else ``default_url``."""
    spec = mlx_repo or os.environ.get(ENV_REPO) or default_url
    if "://" not in spec and not spec.startswith("git@"):
        path = Path(spec).expanduser()
        if not path.exists() and not clone_dir(str(path.resolve())).exists():
            raise UserError(f"--mlx-repo {spec}: no such path; give a git clone of MLX or a URL")
        return str(path.resolve())  # gone but cached: ensure_clone says it uses the cache
    return spec


def clone_dir(spec: str, root: Path | None = None) -> Path:
    """Cache location for ``spec``: readable name plus a hash, so two sources never collide."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "+", spec.rstrip("/").split("://")[-1])[-60:]
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return (root or cache_root()) / "clones" / f"{name}-{digest}.git"


def ensure_clone(spec: str, *, root: Path | None = None, progress: Progress = _quiet) -> Path:
    """Return the cached bare clone of ``spec``, cloning it (staged, then renamed) if absent.

    Cloning holds a lock on the clones folder, so two cold starts at once do not
    race on the rename; under the lock, staging folders a killed clone left are
    removed.
    """
    dest = clone_dir(spec, root)
    if dest.exists() and spec.startswith("/") and not Path(spec).exists():
        progress(f"{spec} no longer exists; using patchkit's cached clone of it")
    if not dest.exists():
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"cannot create the clone cache {dest.parent} ({exc.strerror}); "
                f"set {ENV_CACHE} to a writable folder"
            ) from exc
        with _locked(dest.parent / ".lock"):
            for leftover in dest.parent.glob(".clone.*"):
                shutil.rmtree(leftover, ignore_errors=True)
            if not dest.exists():  # another process may have cloned while we waited
                _clone(spec, dest, progress)
    if git.try_rev_parse(dest, "HEAD") is None and not (dest / "objects").is_dir():
        raise UserError(
            f"{dest} is not a git clone (foreign or damaged cache); remove it and retry"
        )
    return dest


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if needed) for the block."""
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clone(spec: str, dest: Path, progress: Progress) -> None:
    progress(f"cloning {spec}")
    stage = Path(tempfile.mkdtemp(prefix=".clone.", dir=dest.parent))
    try:
        git.clone_bare(spec, stage / "repo.git")
        os.replace(stage / "repo.git", dest)
    except ToolError as exc:
        raise UserError(
            f"cannot clone {spec} and no cached copy exists; check the network or pass"
            f" --mlx-repo PATH to a local MLX clone (git said: {_last_line(exc)})"
        ) from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _last_line(exc: ToolError) -> str:
    lines = (exc.stderr or exc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {exc.returncode}"


def _looks_like_sha(rev: str) -> bool:
    return re.fullmatch(r"[0-9a-fA-F]{4,40}", rev) is not None


def resolve(clone: Path, rev: str, *, progress: Progress = _quiet) -> str:
    """Full commit id of ``rev``; fetches only when needed, works offline when it can.

    A hex id already in the cache is used as is (commits are immutable); a
    branch or tag name is refreshed first so "main" means upstream's main now.
    """
    if _looks_like_sha(rev):
        found = git.try_rev_parse(clone, rev)
        if found:
            return found
        _refuse_ambiguous(clone, rev)
    fetch_error = None
    progress(f"fetching {rev}")
    try:
        git.fetch(clone)
    except ToolError as exc:
        fetch_error = _last_line(exc)
    found = git.try_rev_parse(clone, rev)
    if found:
        if fetch_error and not _looks_like_sha(rev):
            progress(f"offline: '{rev}' is the cached {found[:8]}, which may be stale")
        return found
    if _looks_like_sha(rev):
        _refuse_ambiguous(clone, rev)
    why = f"; fetching failed ({fetch_error})" if fetch_error else ""
    raise UserError(f"unknown revision '{rev}' in {clone}{why}; check the name or the network")


def _refuse_ambiguous(clone: Path, rev: str) -> None:
    """UserError when the hex prefix ``rev`` names several commits (git calls that unknown)."""
    commits = [oid for oid in git.disambiguate(clone, rev) if git.try_rev_parse(clone, oid)]
    if len(commits) > 1:
        raise UserError(
            f"'{rev}' is ambiguous in {clone} ({len(commits)} commits start with it); "
            "give more hex digits"
        )


@contextmanager
def worktree(clone: Path, commit: str, *, base_ref: str | None = BASE_REF) -> Iterator[Path]:
    """A fresh detached worktree at ``commit``, with ``base_ref`` (if any) recording the base.

    The worktree is always removed on exit, success or failure, so nothing is
    left half-applied; results must be kept as commits/branches in the clone.
    """
    parent = clone.parent / "worktrees"
    parent.mkdir(parents=True, exist_ok=True)
    git.worktree_prune(clone)  # forget worktrees a killed run left registered
    path = Path(tempfile.mkdtemp(prefix=f"{commit[:8]}.", dir=parent))
    path.rmdir()  # git worktree add wants to create it
    git.worktree_add(clone, path, commit)
    try:
        if base_ref is not None:
            git.update_ref(clone, base_ref, commit)
        yield path
    finally:
        git.worktree_remove(clone, path)


def reader(clone: Path, commit: str) -> Callable[[str], str]:
    """``read(path) -> text`` at ``commit``; a missing file is a :class:`UserError`."""

    def read(path: str) -> str:
        if git.blob_id(clone, commit, path) is None:
            raise UserError(f"{path} does not exist at {commit[:8]}; is this an MLX tree?")
        return git.show_file(clone, commit, path)

    return read


def open_source(
    mlx_repo: str | None, default_url: str = UPSTREAM_URL, *, progress: Progress = _quiet
) -> Path:
    """Resolve the source spec and return its cached clone."""
    return ensure_clone(source_spec(mlx_repo, default_url), progress=progress)
