"""Project-agnostic git layer over GitPython: one small function per verb.

Contract: every function takes the repository path first and runs ``git -C repo``
through GitPython's command wrapper (:class:`git.cmd.Git`) with an argument list
(never a shell string) and a fixed environment. It returns text decoded byte for
byte (no newline translation, nothing stripped unless the function says so) or a
simple value, and raises :class:`ToolError` carrying the command, exit code and
both output streams when git fails. Nothing here knows about patchkit, pins or
templates, so the module can be tested against any repository, and no other
module runs git.

Output-shaping flags carry a comment saying why they are there.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

# GitPython refuses to import without a git executable (a traceback before any command
# can say so); quiet, it imports, and a missing git is a one-line ToolError at the first
# call (:func:`_execute`).
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

from git.cmd import Git
from git.exc import CommandError

from patchkit.errors import GitLockError, ToolError, UserError

# Pinned identity for commits patchkit makes, so the same tree + parent + message
# always gives the same commit id and re-running is a true no-op.
FIXED_AUTHOR = ("patchkit", "patchkit@users.noreply.github.com")

_BASE_ENV = {
    # Never prompt for credentials: a missing network must fail, not hang.
    "GIT_TERMINAL_PROMPT": "0",
    # Ignore the user's and system's config (aliases, hooks paths, signing,
    # autocrlf) so outputs are the same on every machine.
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    # Stable, untranslated messages for error matching and reports.
    "LC_ALL": "C",
    # Reads (status, diff) take no index.lock: a killed patchkit cannot leave one
    # behind in the user's checkout to fail their next git commit.
    "GIT_OPTIONAL_LOCKS": "0",
}


@dataclass(frozen=True)
class Result:
    """A finished git command: what ran, its exit code and both output streams."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str


def _text(raw: bytes) -> str:
    # Decoded without newline translation and with surrogateescape: file texts
    # must round-trip byte for byte or blob ids would not match.
    return raw.decode("utf-8", "surrogateescape")


def _execute(
    repo: Path | str | None,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    input: bytes | None = None,
    ok_codes: Sequence[int] = (0,),
    isolated: bool = True,
) -> tuple[list[str], int, bytes, str]:
    """Run ``git [-C repo] args`` through GitPython; ``(cmd, code, raw stdout, stderr)``.

    The one place where git failures become :class:`ToolError`. GitPython's own
    ``GitCommandError`` quotes and decorates the streams for display and cannot
    let an expected non-zero code through (merge-file's conflict count), so the
    wrapper runs with exceptions off and raw stdout, and the exit code is judged
    here; what GitPython still raises (git missing) is converted here too.
    ``isolated=False`` drops the fixed environment, for reading the user's config.
    """
    if shutil.which("git") is None:
        raise UserError(
            "git is not on PATH; install it (Debian/Ubuntu: apt-get install git;"
            " macOS: xcode-select --install)"
        )
    # -C rather than a working directory: the command in an error can be re-run as is.
    cmd = ["git"] + (["-C", str(repo)] if repo is not None else []) + list(args)
    full_env = {**(_BASE_ENV if isolated else {}), **(env or {})}
    try:
        # GitPython hands stdin to the process as a file, so input goes through one.
        with tempfile.TemporaryFile() if input is not None else nullcontext() as stdin:
            if stdin is not None:
                stdin.write(input)
                stdin.seek(0)
            code, stdout, stderr = Git().execute(
                cmd,
                istream=stdin,
                env=full_env,
                with_extended_output=True,
                with_exceptions=False,
                # Bytes, and the trailing newline kept: callers decide what to strip.
                stdout_as_string=False,
                strip_newline_in_stdout=False,
            )
    except CommandError as exc:
        raise ToolError(cmd, 127, "", str(exc)) from exc
    if code not in ok_codes:
        _raise_lock(stderr)
        raise ToolError(cmd, code, _text(stdout), stderr)
    return cmd, code, stdout, stderr


_LOCK = re.compile(r"Unable to create '([^']+\.lock)': File exists")


def _raise_lock(stderr: str) -> None:
    """One line instead of git's paragraph when a ``.lock`` file blocked the command."""
    m = _LOCK.search(stderr or "")
    if m:
        raise GitLockError(
            f"git lock file {m.group(1)} exists: another git process is using that"
            " repository, or a killed one left the file; if none is running, delete it and retry"
        )


def run(
    repo: Path | str | None,
    *args: str,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    ok_codes: Sequence[int] = (0,),
) -> Result:
    """Run ``git [-C repo] args`` (for commands with no verb here); raise ToolError on failure."""
    data = None if input is None else input.encode("utf-8", "surrogateescape")
    cmd, code, stdout, stderr = _execute(repo, args, env=env, input=data, ok_codes=ok_codes)
    return Result(cmd, code, _text(stdout), stderr)


def out(repo: Path | str | None, *args: str, env: Mapping[str, str] | None = None) -> str:
    """Stdout of a git command, with the trailing newline removed."""
    return run(repo, *args, env=env).stdout.rstrip("\n")


def init(path: Path, *, bare: bool = False) -> None:
    """Create an empty repository whose first branch is ``main``."""
    run(None, "init", "--quiet", "--initial-branch=main", *(["--bare"] if bare else []), str(path))


def clone_bare(url: str, dest: Path) -> None:
    """Bare clone of ``url`` into ``dest`` (local paths are hard-linked by git)."""
    run(None, "clone", "--bare", "--quiet", url, str(dest))


def fetch(repo: Path, remote: str = "origin") -> None:
    """Fetch branches and tags from ``remote`` into the same ref names (bare-clone layout)."""
    # Explicit refspec: a bare clone has none configured, and "+" lets upstream
    # force-pushes through instead of failing the whole fetch.
    run(repo, "fetch", "--quiet", "--tags", remote, "+refs/heads/*:refs/heads/*")


def rev_parse(repo: Path, rev: str) -> str:
    """Full object id of ``rev`` peeled to a commit."""
    # --verify: exactly one object or an error; ^{commit}: tags resolve to commits.
    return out(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")


def try_rev_parse(repo: Path, rev: str) -> str | None:
    """Like :func:`rev_parse` but ``None`` when ``rev`` does not name a commit."""
    proc = run(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", ok_codes=(0, 1, 128))
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_path(repo: Path, name: str) -> Path | None:
    """``name`` inside ``repo``'s git directory (per worktree), or None outside a repository."""
    proc = run(repo, "rev-parse", "--git-path", name, ok_codes=(0, 128))
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return Path(repo) / proc.stdout.strip()  # relative to repo unless git made it absolute


def has_commits(repo: Path) -> bool:
    """Whether any ref of ``repo`` names a commit (an empty repository has none)."""
    return bool(out(repo, "rev-list", "--all", "--max-count=1"))


def remote_url(repo: Path, remote: str = "origin") -> str | None:
    """The URL configured for ``remote`` in ``repo``, or None."""
    proc = run(repo, "config", "--get", f"remote.{remote}.url", ok_codes=(0, 1))
    return proc.stdout.strip() or None


def disambiguate(repo: Path, prefix: str) -> list[str]:
    """Ids of every object whose id starts with the hex ``prefix`` (empty when none does)."""
    # Exit 1/128: git found no object, or the prefix is too short or not hex.
    text = run(repo, "rev-parse", f"--disambiguate={prefix}", ok_codes=(0, 1, 128)).stdout
    return text.split()


def blob_id(repo: Path, rev: str, path: str) -> str | None:
    """Blob id of ``path`` at ``rev``, or ``None`` when the file does not exist there."""
    proc = run(repo, "rev-parse", "--verify", "--quiet", f"{rev}:{path}", ok_codes=(0, 1, 128))
    return proc.stdout.strip() if proc.returncode == 0 else None


def show_file(repo: Path, rev: str, path: str) -> str:
    """Text of ``path`` at ``rev``, byte-exact (no textconv, no EOL conversion)."""
    return run(repo, "cat-file", "blob", f"{rev}:{path}").stdout


def tree_id(repo: Path, rev: str) -> str:
    """Object id of the tree ``rev`` records (equal trees: equal contents)."""
    return out(repo, "rev-parse", "--verify", f"{rev}^{{tree}}")


@dataclass(frozen=True)
class TreeEntry:
    """One ``ls-tree`` line: mode, object type (blob, tree, commit), object id, path."""

    mode: str
    type: str
    id: str
    path: str


def ls_tree(repo: Path, rev: str, paths: Sequence[str] = ()) -> list[TreeEntry]:
    """Entries of ``rev``'s top-level tree (or just those at ``paths``), in git's order."""
    # -z: paths unquoted and NUL-terminated; --full-tree: paths from the root of the
    # tree whichever directory -C names.
    text = run(repo, "ls-tree", "-z", "--full-tree", rev, "--", *paths).stdout
    entries = []
    for record in filter(None, text.split("\0")):
        meta, path = record.split("\t", 1)
        mode, kind, oid = meta.split()
        entries.append(TreeEntry(mode, kind, oid, path))
    return entries


def archive(repo: Path, rev: str, paths: Sequence[str] = ()) -> bytes:
    """A tar of ``rev``'s tree (or only ``paths`` in it), as bytes."""
    # --format=tar: the format must not depend on an output file name or config.
    return _execute(repo, ["archive", "--format=tar", rev, "--", *paths])[2]


def export(repo: Path, rev: str, dest: Path, paths: Sequence[str] = ()) -> None:
    """Write ``rev``'s tree (or only ``paths`` in it) into ``dest``, as ``git archive``
    gives it; a member that would land outside ``dest`` is a UserError, nothing written.

    Every member is checked before any is written: no name and no link that resolves
    outside ``dest``, nothing but files, folders and links. tarfile's ``data`` filter
    checks again where Python has it (3.11.4 on; Debian 12's 3.11.2 has not).
    """
    with tarfile.open(fileobj=io.BytesIO(archive(repo, rev, paths))) as tar:
        root = Path(dest).resolve()
        for member in tar.getmembers():
            path = (root / member.name).resolve()
            target = path
            if member.issym():
                target = (path.parent / member.linkname).resolve()
            elif member.islnk():
                target = (root / member.linkname).resolve()
            kind_ok = member.isfile() or member.isdir() or member.issym() or member.islnk()
            if not (kind_ok and path.is_relative_to(root) and target.is_relative_to(root)):
                raise UserError(f"{rev}: {member.name!r} would be written outside {dest}")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)


def hash_object(repo: Path | None, text: str, *, write: bool = False) -> str:
    """Git blob id of ``text`` (optionally stored in ``repo``)."""
    args = ["hash-object", "--stdin"] + (["-w"] if write else [])
    return run(repo, *args, input=text).stdout.strip()


def commit_date(repo: Path, rev: str) -> str:
    """Committer date of ``rev`` in strict ISO 8601, used as a reproducible timestamp."""
    return out(repo, "show", "-s", "--format=%cI", rev)


def subject(repo: Path, rev: str) -> str:
    """First line of ``rev``'s message."""
    return out(repo, "show", "-s", "--format=%s", rev)


def is_ancestor(repo: Path, ancestor: str, rev: str) -> bool:
    """Whether ``ancestor`` is reachable from ``rev``."""
    return run(repo, "merge-base", "--is-ancestor", ancestor, rev, ok_codes=(0, 1)).returncode == 0


def worktree_add(repo: Path, path: Path, rev: str) -> None:
    """Check ``rev`` out, detached, in a new worktree at ``path``."""
    # --detach: never move or create a branch in the repository by checking out.
    run(repo, "worktree", "add", "--quiet", "--detach", str(path), rev)


def worktree_remove(repo: Path, path: Path) -> None:
    """Remove a worktree and its administrative files, even if it has changes or is locked."""
    # --force twice: a worktree `git worktree add` left locked ("initializing") when it
    # was killed goes too.
    run(repo, "worktree", "remove", "--force", "--force", str(path))
    worktree_prune(repo)


@dataclass(frozen=True)
class Worktree:
    """One registered worktree: its path, and whether it is locked."""

    path: Path
    locked: bool


def worktrees(repo: Path) -> list[Worktree]:
    """Every worktree registered in ``repo`` (the main one first), with its lock state."""
    found: list[Worktree] = []
    for record in out(repo, "worktree", "list", "--porcelain").split("\n\n"):
        lines = record.splitlines()
        paths = [ln[len("worktree ") :] for ln in lines if ln.startswith("worktree ")]
        if paths:
            locked = any(ln == "locked" or ln.startswith("locked ") for ln in lines)
            found.append(Worktree(Path(paths[0]), locked))
    return found


def worktree_unlock(repo: Path, path: Path) -> None:
    """Unlock a registered worktree (so prune may forget it when its folder is gone)."""
    run(repo, "worktree", "unlock", str(path))


def worktree_prune(repo: Path) -> None:
    """Forget worktrees whose directories are gone (a killed process leaves them registered)."""
    run(repo, "worktree", "prune")


def update_ref(repo: Path, ref: str, rev: str) -> None:
    """Point ``ref`` at ``rev`` (creating it if needed)."""
    run(repo, "update-ref", ref, rev)


def branch_force(repo: Path, name: str, rev: str) -> None:
    """Create or move branch ``name`` to ``rev`` without checking it out."""
    run(repo, "branch", "--force", "--no-track", name, rev)


def checkout_detached(repo: Path, rev: str) -> None:
    """Move the worktree ``repo`` to ``rev``, detached, overwriting changes to tracked files."""
    # --force: local edits to tracked files must not block the move; untracked
    # files (a build folder, say) are left where they are.
    run(repo, "checkout", "--quiet", "--force", "--detach", rev)


def status_porcelain(repo: Path, paths: Sequence[str] = ()) -> str:
    """Machine-readable working-tree status (of ``paths`` only, when given); empty when clean."""
    # --porcelain=v1: stable format across git versions; untracked files count as dirt.
    return run(repo, "status", "--porcelain=v1", "--untracked-files=all", "--", *paths).stdout


def add(repo: Path, paths: Sequence[str]) -> None:
    """Stage ``paths`` exactly as they are in the worktree."""
    run(repo, "add", "--", *paths)


def commit(repo: Path, message: str, *, date: str, author: tuple[str, str] = FIXED_AUTHOR) -> str:
    """Commit the index with a fixed identity and date; return the new commit id."""
    name, email = author
    env = {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": date,
    }
    # --no-verify: hooks of the repository must not alter generated commits;
    # --cleanup=verbatim: the message is ours, keep it byte for byte.
    run(repo, "commit", "--quiet", "--no-verify", "--cleanup=verbatim", "-m", message, env=env)
    return rev_parse(repo, "HEAD")


def am(repo: Path, patches: Sequence[Path], *, committer: tuple[str, str] = FIXED_AUTHOR) -> str:
    """Apply mailbox ``patches`` on top of HEAD with ``git am``; return the new HEAD."""
    # The committer is given, not read from config (which the fixed environment
    # hides); the author comes from each patch, as it does for a reviewer.
    name, email = committer
    env = {"GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email}
    run(repo, "am", "--quiet", *map(str, patches), env=env)
    return rev_parse(repo, "HEAD")


def apply_check(repo: Path, patch: Path) -> None:
    """Raise ToolError, with git's reasons, unless ``patch`` applies cleanly to the worktree."""
    run(repo, "apply", "--check", str(patch))


def apply_check_series(repo: Path, patches: Sequence[Path]) -> None:
    """Raise ToolError, with git's reasons, unless ``patches`` apply one after another to
    HEAD (a later one may edit what an earlier one wrote).

    They are applied to a throwaway index, never to the worktree or the repository's
    index; git stores the resulting blobs as unreferenced objects, which its gc removes.
    """
    with tempfile.TemporaryDirectory(prefix="patchkit-apply-check-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        run(repo, "read-tree", "HEAD", env=env)
        for patch in patches:
            run(repo, "apply", "--cached", str(patch), env=env)


def push(repo: Path, remote: str, refspec: str) -> None:
    """Push ``refspec`` to ``remote``."""
    run(repo, "push", remote, refspec)


def user_config(repo: Path, key: str) -> str | None:
    """``key`` as the user's own git resolves it in ``repo`` (repository, global and
    system config, unlike every other function here), or None when it is unset."""
    # Exit code 1: the key is not set.
    _, code, stdout, _ = _execute(repo, ["config", "--get", key], ok_codes=(0, 1), isolated=False)
    value = _text(stdout).strip()
    return value if code == 0 and value else None


def user_identity(repo: Path) -> tuple[str, str] | None:
    """``(user.name, user.email)`` as the user's git resolves them in ``repo``, or None.

    Built on :func:`user_config`, not the isolated verbs, which hide the user's
    global config on purpose: here the user's identity is exactly what is wanted.
    """
    name, email = (user_config(repo, key) for key in ("user.name", "user.email"))
    return (name, email) if name and email else None


# git format-patch's options for a carried series, byte-identical on every re-export.
FORMAT_PATCH_ARGS = (
    # The parent commit id is not useful in a carried patch and changes on
    # every re-commit; zero it so re-export is byte-identical.
    "--zero-commit",
    # Full blob ids in "index" lines let `git am -3` find the base blobs.
    "--full-index",
    # The signature holds the git version: it would churn with the tool.
    "--no-signature",
    # The diffstat is derived data and noisy in review of patch changes.
    "--no-stat",
    # Plain "Subject: [PATCH n/m]" numbering, independent of user config.
    "--numbered",
    # Rename detection depends on config; keep what git writes explicit.
    "--no-renames",
    # No encoding guesswork: write what the commit holds.
    "--encoding=UTF-8",
)


def format_patch(repo: Path, base: str, head: str, outdir: Path) -> list[Path]:
    """Write ``base..head`` as a patch series into ``outdir``; return the files in order."""
    proc = run(repo, "format-patch", *FORMAT_PATCH_ARGS, "-o", str(outdir), f"{base}..{head}")
    return [Path(line) for line in proc.stdout.splitlines() if line.strip()]


def format_patch_text(repo: Path, base: str, head: str) -> str:
    """``base..head`` as :func:`format_patch` writes it, the files joined by one newline
    (``--stdout``)."""
    return run(repo, "format-patch", *FORMAT_PATCH_ARGS, "--stdout", f"{base}..{head}").stdout


def diff_blobs(repo: Path, old_blob: str, new_blob: str) -> str:
    """Unified diff between two stored blobs (read for its hunks, not applied)."""
    return run(
        repo,
        "diff",
        # Fixed context and algorithm: hunk boundaries must not depend on config.
        "--unified=3",
        "--diff-algorithm=myers",
        "--no-color",
        "--no-ext-diff",
        old_blob,
        new_blob,
    ).stdout


def merge_file(
    repo: Path | None,
    current: Path,
    base: Path,
    other: Path,
    labels: tuple[str, str, str] = ("overlay", "old-upstream", "new-upstream"),
) -> int:
    """3-way merge ``base -> other`` into ``current`` in place; return the conflict count."""
    # -L sets the conflict-marker labels so the report names each side; rc > 0
    # is the number of conflicts (capped at 127), rc < 0 / >127 is an error.
    proc = run(
        repo,
        "merge-file",
        "-L",
        labels[0],
        "-L",
        labels[1],
        "-L",
        labels[2],
        str(current),
        str(base),
        str(other),
        ok_codes=range(0, 128),
    )
    return proc.returncode


def list_worktrees(repo: Path) -> list[Path]:
    """Paths of all worktrees of ``repo`` (the main one included)."""
    text = out(repo, "worktree", "list", "--porcelain")
    return [
        Path(line[len("worktree ") :]) for line in text.splitlines() if line.startswith("worktree ")
    ]
