"""MLX source trees: a cached bare clone per upstream, and one fresh worktree per operation.

Where the source comes from: ``--mlx-repo PATH_OR_URL``, else env
``PATCHKIT_MLX_REPO``, else the upstream URL in ``pin.toml``. Whatever it is,
patchkit works in its *own* bare clone under the user cache directory (local
paths are hard-linked by git, so this is cheap), so branches, refs and worktrees
patchkit creates never land in the user's checkout.

The clone is made in a staging directory and renamed into place, so an
interrupted clone never leaves a half-populated cache. It is reused offline: a
revision already present is used without touching the network, and a fetch that
fails is only an error when the revision is still unknown afterwards. Read-only
commands pass ``fetch=False`` and get the fetch as advice instead.

Commands that move refs in the clone hold its lock (:func:`locked_clone`); under
it, what killed runs left (worktrees, ref ``.lock`` files) is cleared first.
Worktree folders carry their owner's process id, so any run can prune those
whose process is gone.
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

from patchkit.carry.pin import UPSTREAM_URL
from patchkit.errors import BusyError, ToolError, UserError
from patchkit.util import cache, git, staging

ENV_REPO = "PATCHKIT_MLX_REPO"
ENV_CACHE = cache.ENV
BASE_REF = "refs/patchkit/base"

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    """Default progress sink: say nothing."""


# Scripts outside the package still reach the cache root through this name.


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
    return (root / "clones" if root else cache.folder("clones")) / f"{name}-{digest}.git"


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
            f" --mlx-repo PATH to a local MLX clone (git said: {_git_said(exc)})"
        ) from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _git_said(exc: ToolError) -> str:
    """git's first line that says something (not "Cloning into ..."): the cause, usually."""
    for line in (exc.stderr or exc.stdout).splitlines():
        line = line.strip()
        if line and not line.startswith(("Cloning into", "warning: You appear")):
            return line
    return f"exit {exc.returncode}"


def _looks_like_sha(rev: str) -> bool:
    return re.fullmatch(r"[0-9a-fA-F]{4,40}", rev) is not None


def resolve(clone: Path, rev: str, *, progress: Progress = _quiet, fetch: bool = True) -> str:
    """Full commit id of ``rev``; fetches only when needed, works offline when it can.

    A hex id already in the cache is used as is (commits are immutable); a
    branch or tag name is refreshed first so "main" means upstream's main now.
    ``fetch=False`` (check, status) never fetches: an unknown ``rev`` is an error
    whose message gives the fetch to run.
    """
    if _looks_like_sha(rev):
        found = git.try_rev_parse(clone, rev)
        if found:
            return found
        _refuse_ambiguous(clone, rev)
    if not fetch:
        found = git.try_rev_parse(clone, rev)
        if found:
            return found
        raise UserError(
            f"{rev} is not in patchkit's cached clone {clone} and this command does not fetch;"
            f" run `patchkit apply` (or `git -C {clone} fetch --tags origin"
            " '+refs/heads/*:refs/heads/*'`), then retry"
        )
    if not git.has_commits(clone):
        raise UserError(
            f"{git.remote_url(clone) or clone} is an empty repository (cached in {clone});"
            " point --mlx-repo or PATCHKIT_MLX_REPO at a clone of MLX"
        )
    fetch_error = None
    progress(f"fetching {rev}")
    try:
        git.fetch(clone)
    except ToolError as exc:
        fetch_error = _git_said(exc)
    found = git.try_rev_parse(clone, rev)
    if found:
        if fetch_error and not _looks_like_sha(rev):
            progress(f"offline: '{rev}' is the cached {found[:8]}, which may be stale")
        return found
    if _looks_like_sha(rev):
        _refuse_ambiguous(clone, rev)
    origin = git.remote_url(clone) or str(clone)
    if fetch_error:
        raise UserError(
            f"'{rev}' is not in the cached clone {clone} and fetching {origin} failed"
            f" ({fetch_error}); check the network, or pass --mlx-repo PATH to a clone that has it"
        )
    raise UserError(
        f"'{rev}' is not a revision of {origin} (cached in {clone}); check the name, or point"
        " --mlx-repo or PATCHKIT_MLX_REPO at a clone that has it"
    )


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
    parent = worktrees_dir(clone)
    parent.mkdir(parents=True, exist_ok=True)
    prune_worktrees(clone)  # what a killed run left registered
    # The process id in the name tells a later run whether the owner is still alive.
    path = Path(tempfile.mkdtemp(prefix=f"{commit[:8]}.{os.getpid()}.", dir=parent))
    path.rmdir()  # git worktree add wants to create it
    git.worktree_add(clone, path, commit)
    try:
        if base_ref is not None:
            git.update_ref(clone, base_ref, commit)
        yield path
    finally:
        git.worktree_remove(clone, path)


def worktrees_dir(clone: Path) -> Path:
    """Where :func:`worktree` puts its worktrees."""
    return clone.parent / "worktrees"


_OWNED = re.compile(r"[0-9a-f]{8}\.(\d+)\.")


def prune_worktrees(clone: Path) -> list[Path]:
    """Remove the worktrees of ``clone`` that killed runs left; return their paths.

    A worktree of ours whose process is gone is removed with its folder; one whose
    folder is gone is forgotten even when ``git worktree add`` left it locked.
    Worktrees of live runs, and any outside :func:`worktrees_dir`, are left alone.
    """
    parent = worktrees_dir(clone).resolve()
    removed = []
    for wt in git.worktrees(clone)[1:]:
        if wt.path.parent.resolve() != parent:
            continue
        m = _OWNED.match(wt.path.name)
        if wt.path.exists() and not (m and not staging.alive(int(m.group(1)))):
            continue
        if wt.path.exists():
            git.worktree_remove(clone, wt.path)
        elif wt.locked:
            git.worktree_unlock(clone, wt.path)
        removed.append(wt.path)
    git.worktree_prune(clone)
    return removed


def clear_stale_ref_locks(clone: Path) -> list[Path]:
    """Delete ref ``.lock`` files in ``clone``; only under :func:`locked_clone`.

    The clone is patchkit's own cache and every patchkit run that moves its refs
    holds the clone's lock, so a ref lock seen by the holder was left by a run
    that was killed inside git.
    """
    found = [*(clone / "refs").rglob("*.lock"), clone / "packed-refs.lock"]
    stale = [p for p in found if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


@contextmanager
def locked_clone(clone: Path, *, wait: bool = True, progress: Progress = _quiet) -> Iterator[Path]:
    """Hold ``clone``'s lock for a command that moves its refs; clear what killed runs left."""
    lock = clone / "patchkit.lock"
    try:
        with staging.exclusive(
            lock,
            wait=wait,
            on_wait=lambda: progress(f"waiting for another patchkit run using {clone}"),
        ):
            for path in clear_stale_ref_locks(clone):
                progress(f"removed {path}, which a killed git left")
            for path in prune_worktrees(clone):
                progress(f"removed the worktree {path}, which a killed run left")
            yield clone
    except staging.Busy:
        raise BusyError(
            f"another patchkit run is using the clone {clone} (lock {lock});"
            " retry when it ends, or drop --no-wait to wait for it"
        ) from None


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


def tree_blobs(clone: Path, commit: str, paths: list[str]) -> dict[str, str]:
    """Blob id of each path at ``commit``; a missing file is a :class:`UserError`."""
    blobs = {}
    for p in paths:
        blob = git.blob_id(clone, commit, p)
        if blob is None:
            raise UserError(
                f"{p} does not exist at {commit[:8]}; the templates target another tree"
            )
        blobs[p] = blob
    return blobs
