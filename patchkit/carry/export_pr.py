"""``patchkit export-pr``: one upstream-ready PR for ml-explore/mlx (the JIT fix, the
qmm_sm90 fix, Metal or CUDA), as commits, ``git am`` patches and a PR body.

Flow: check every argument (backend, branch, title, author, push target, out folder)
-> prune what a killed run left -> resolve the base (MLX's default branch in the
cached clone, or ``--onto REV``, an earlier PR's branch for a stack) -> find which
changes the base lacks (:func:`changes_onto`: what the PR builds on, then its own)
-> per change, render its files with :func:`render.render_all` (the code path the
overlay comes from) and the test and benchmark from the ``backend = "pr"`` plans,
write them in a fresh worktree, format with the versions the base's
``.pre-commit-config.yaml`` pins and check a second pass changes nothing, commit as
the submitter, dated now -> create the branch -> ``git format-patch`` -> prove
``git am`` on the base rebuilds the tree -> write the patches and the PR body into a
fresh output folder, in one rename.

One change per commit: the JIT fix touches only the Metal host file, the Metal commit
no CUDA file and the CUDA commit no Metal file; each PR's test sits at its own anchor
and the benchmark is the Metal PR's, so Metal and CUDA apply in either order.
MLX forbids AI-written PR descriptions and asks for an AI-usage disclosure, so the
body is upstream's PR template with the description and the disclosure left empty,
followed by facts a reviewer can rerun with MLX alone: commands, MLX's own test results
on a build of the change (``templates/pr/results.toml`` names the records), and what is
still to measure on a GPU. Nothing outside the new output folder, the branch and
patchkit's own worktrees is written or deleted; nothing is pushed unless ``push`` is
given.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.carry import mlx_build, pin, render, source
from patchkit.carry.commit import BRANCH_PREFIX
from patchkit.errors import AnchorError, ToolError, UserError
from patchkit.util import cache, git, proc
from patchkit.util.split_unittest import compare_arms, ran_to_end

BACKENDS = render.BACKENDS  # the JIT fix, the qmm_sm90 fix, Metal, CUDA: one PR each
DEFAULT_BACKEND = "metal"
DEFAULT_BRANCHES = render.DEFAULT_BRANCHES  # one branch per PR
# How a record of the whole series built at once (what `patchkit build` compiles) names
# what it holds besides the PR the body is for; "Measured so far" names the series'
# branches (those export-pr makes) once, above the records.
SERIES_BUILT = "the other PRs of its series built together"
# Paths one backend's commit must not touch (the other backend's sources).
FOREIGN_PATHS = {
    "jit-fix": ("mlx/backend/cuda/", "mlx/backend/metal/kernels/", "python/", "benchmarks/"),
    "qmm-sm90": ("mlx/backend/metal/", "python/", "benchmarks/"),
    "metal": ("mlx/backend/cuda/",),
    "cuda": ("mlx/backend/metal/",),
}
# MLX's own test methods a PR fixes rather than adds (it adds none): a build record shows
# them passing or not, as it does a PR's new tests.
FIXED_TESTS = {"qmm-sm90": ("test_qmm", "test_qmv", "test_qmv_wide")}
BODY_TEMPLATE = "pr/body.md.j2"
COMMIT_TEMPLATE = "pr/commit.txt.j2"
RESULTS_MANIFEST = "pr/results.toml"
BODY_FILE = "PR_BODY.draft.md"
BENCH_FILE = "benchmarks/python/qmv_small_batch_bench.py"  # the Metal PR adds it
PR_TEMPLATE = ".github/pull_request_template.md"
PRECOMMIT = ".pre-commit-config.yaml"
CXX_SUFFIXES = (".h", ".cpp", ".metal", ".cu", ".cuh")
# Formatter hooks of MLX's .pre-commit-config.yaml: repo URL fragment -> PyPI name.
FORMATTERS = {
    "mirrors-clang-format": "clang-format",
    "black-pre-commit-mirror": "black",
    "pycqa/isort": "isort",
}
DRAFT_NOTICE = (
    "The description, the AI usage disclosure and every commit message are yours to write:"
    " MLX forbids AI-written PR descriptions and commit messages (CONTRIBUTING, AGENTS.md)."
    " The commits carry a placeholder subject until you run `git commit --amend` (or"
    " `git rebase -i` for a stack). The sections after them are facts and commands for you"
    " to check, rerun, keep or cut."
)
PLACEHOLDER_SUBJECT = "[{change}] write this commit message yourself (MLX AGENTS.md)"
# Names patchkit gives what it creates, so a later run can tell its own leftovers apart.
WORKTREE_PREFIX = "export-pr."
STAGE_PREFIX = ".patchkit-export-pr."
LOCK_SUFFIX = ".lock"
ZERO_OID = "0" * 40
AUTHOR_RE = re.compile(r"^\s*([^<>\n]*[^<>\s])\s*<([^<>\s@]+@[^<>\s@]+)>\s*$")

PR_OPTIONS = render.RenderOptions()

Read = Callable[[str], "str | None"]


@dataclass
class PrResult:
    """What export-pr did, for the CLI and ``--json``."""

    repository: Path
    backend: str
    branch: str
    commit: str
    base: str
    files: list[str]
    patch: Path
    body: Path
    formatters: dict[str, str]
    author: tuple[str, str]
    reformatted: list[str] = field(default_factory=list)
    pushed: str | None = None
    warnings: list[str] = field(default_factory=list)
    # The changes the branch carries, in order: the PR's own last, after those it builds
    # on that the base lacked (each its own commit and patch, ``patches``).
    changes: list[str] = field(default_factory=list)
    patches: list[Path] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        """A JSON-friendly summary (repository path, branch and commit first)."""
        return {
            "clone": str(self.repository),
            "backend": self.backend,
            "branch": self.branch,
            "commit": self.commit,
            "base": self.base,
            "files": self.files,
            "patch": str(self.patch),
            "body": str(self.body),
            "formatters": self.formatters,
            "reformatted": self.reformatted,
            "pushed": self.pushed,
            "author": f"{self.author[0]} <{self.author[1]}>",
            "warnings": self.warnings,
            "changes": self.changes,
            "patches": [str(p) for p in self.patches],
        }


def render_pr(
    read: Read, options: render.RenderOptions, templates_dir: Path
) -> tuple[dict[str, str | None], dict[str, str]]:
    """(upstream texts, patched texts) of every file in the PR, kernel files first.

    Kernel, instantiations and dispatch come from :func:`render.render_all` in
    the upstream flavour, the function the series and overlay export renders with.
    """

    def must_read(path: str) -> str:
        text = read(path)
        if text is None:
            raise UserError(f"{path} does not exist in the base tree; is this an MLX tree?")
        return text

    upstream_opts = dataclasses.replace(options, flavour="upstream")
    core = render.render_all(must_read, upstream_opts, templates_dir, overlay=False)
    upstream: dict[str, str | None] = dict(core.upstream)
    patched = dict(core.patched)
    for plan in render.pr_plans(templates_dir):
        before = read(plan.path)
        text = render.render_pr_file(plan, before, options)
        if text is not None:  # a new file this PR does not carry
            upstream[plan.path], patched[plan.path] = before, text
    return upstream, patched


def optional_reader(clone: Path, commit: str) -> Read:
    """``read(path)`` at ``commit`` that returns None for a missing file (new files)."""

    def read(path: str) -> str | None:
        if git.blob_id(clone, commit, path) is None:
            return None
        return git.show_file(clone, commit, path)

    return read


def formatter_versions(precommit_text: str) -> dict[str, str]:
    """``{PyPI name: version}`` of the formatter hooks in a ``.pre-commit-config.yaml``.

    Read with a regex on ``repo:``/``rev:`` pairs: the file is simple YAML and
    patchkit does not otherwise need a YAML parser.
    """
    versions = {}
    pairs = re.findall(r"repo:\s*(\S+)\s*\n\s*rev:\s*(\S+)", precommit_text)
    for url, rev in pairs:
        for fragment, name in FORMATTERS.items():
            if fragment in url:
                versions[name] = rev.lstrip("v")
    return versions


def installed_version(tool: str, exe: str | None = None) -> str | None:
    """Version ``exe`` (default: the first of :func:`candidates`) reports, or None when absent."""
    exe = exe or next(iter(candidates(tool)), None)
    if exe is None:
        return None
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    found = re.search(r"(\d+\.\d+\.\d+)", proc.stdout + proc.stderr)
    return found.group(1) if found else None


def tools_venv(wanted: dict[str, str]) -> Path:
    """patchkit's own environment for exactly these formatter versions (under the cache)."""
    key = hashlib.sha256(repr(sorted(wanted.items())).encode()).hexdigest()[:12]
    return cache.folder("tools") / f"formatters-{key}"


def candidates(tool: str, wanted: dict[str, str] | None = None) -> list[str]:
    """Where ``tool`` may live, best first: patchkit's tool venv, this interpreter's bin
    folder (a venv that is not on PATH), then PATH."""
    places = [tools_venv(wanted) / "bin" / tool] if wanted else []
    places.append(Path(sys.executable).parent / tool)
    found = [str(p) for p in places if p.is_file()]
    on_path = shutil.which(tool)
    return found + ([on_path] if on_path and on_path not in found else [])


def ensure_formatters(wanted: dict[str, str], install: bool) -> dict[str, str]:
    """``{tool: executable}`` at the versions upstream's pre-commit pins.

    A different version formats differently, and the PR would then not be what
    ``pre-commit run --all-files`` produces; so a mismatch is an error unless
    ``install`` lets patchkit install the exact versions into its own tool
    environment (:func:`tools_venv`), never into the user's.
    """
    tools, missing = {}, {}
    for tool, version in wanted.items():
        exe = next(
            (e for e in candidates(tool, wanted) if installed_version(tool, e) == version), None
        )
        if exe:
            tools[tool] = exe
        else:
            missing[tool] = version
    if not missing:
        return tools
    specs = [f"{t}=={v}" for t, v in sorted(missing.items())]
    venv = tools_venv(wanted)
    if not install:
        found = {t: installed_version(t) or "absent" for t in missing}
        raise UserError(
            f"formatters {found} differ from upstream's pre-commit pins ({' '.join(specs)}); "
            f"pass --install-formatters to install them into {venv} (your environment is not "
            f"touched), or `pip install {' '.join(specs)}` yourself"
        )
    if not (venv / "bin" / "python").is_file():
        proc.run([sys.executable, "-m", "venv", str(venv)])
    proc.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *specs])
    return ensure_formatters(wanted, install=False)


def _format_cmds(paths: Sequence[str], check: bool, tools: dict[str, str]) -> list[list[str]]:
    """Formatter commands: clang-format for C++/Metal/CUDA, isort then black for Python."""
    cxx = [p for p in paths if p.endswith(CXX_SUFFIXES)]
    py = [p for p in paths if p.endswith(".py")]
    exe = {t: tools.get(t) or t for t in ("clang-format", "isort", "black")}
    cmds = []
    if cxx:
        flags = ["--dry-run", "--Werror"] if check else ["-i"]
        cmds.append([exe["clang-format"], *flags, *cxx])
    if py:
        # isort before black, as the pre-commit config orders them; --profile=black as it says.
        cmds.append([exe["isort"], "--profile=black", *(["--check-only"] if check else []), *py])
        cmds.append([exe["black"], "--quiet", *(["--check"] if check else []), *py])
    return cmds


def run_formatters(
    worktree: Path, paths: Sequence[str], *, check: bool, tools: dict[str, str] | None = None
) -> None:
    """Format ``paths`` in place in ``worktree`` (so the tree's .clang-format and pyproject
    apply, with real include paths); with ``check``, fail if anything would change."""
    if tools is None:
        tools = {t: c[0] for t in ("clang-format", "isort", "black") if (c := candidates(t))}
    for cmd in _format_cmds(paths, check, tools):
        proc.run(cmd, cwd=worktree)


def write_and_format(
    wt: Path,
    upstream: dict[str, str | None],
    patched: dict[str, str],
    tools: dict[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """Write the patched files into ``wt``, format, verify; return (changed, reformatted)."""
    changed = sorted(p for p in patched if patched[p] != upstream[p])
    for p in changed:
        (wt / p).parent.mkdir(parents=True, exist_ok=True)
        (wt / p).write_bytes(patched[p].encode("utf-8", "surrogateescape"))
    run_formatters(wt, changed, check=False, tools=tools)
    run_formatters(wt, changed, check=True, tools=tools)
    reformatted = [p for p in changed if (wt / p).read_bytes().decode() != patched[p]]
    return changed, reformatted


# --- arguments, checked before any work ----------------------------------------------


def check_backend(backend: str) -> str:
    """``backend`` if it is one a PR can carry."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    return backend


def check_branch(branch: str) -> str:
    """``branch`` if git accepts it as a new branch name (not an option, not ``a..b``)."""
    ok = bool(branch) and not branch.startswith("-") and branch != "HEAD"
    if ok:
        proc = git.run(None, "check-ref-format", "--branch", branch, ok_codes=(0, 1, 128))
        ok = proc.returncode == 0
    if not ok:
        raise UserError(f"--branch {branch!r} is not a valid branch name; e.g. --branch my-qmv-fix")
    return branch


def check_title(title: str) -> str:
    """``title`` if it is one non-empty line (a newline would start the body or a trailer)."""
    if not title.strip() or any(c in title for c in "\r\n") or not title.isprintable():
        raise UserError(f"--title {title!r}: give one non-empty line of printable text")
    return title.strip()


def parse_author(text: str) -> tuple[str, str]:
    """``(name, email)`` from ``'Name <email>'``; anything else is refused."""
    found = AUTHOR_RE.match(text)
    if not found:
        raise UserError(f"--author {text!r}: give it as 'Name <name@example.com>'")
    return found.group(1).strip(), found.group(2)


def push_target(remote: str) -> str:
    """``remote`` as something patchkit's own clone can push to: a URL or a git repo path.

    The branch lives in patchkit's cached clone, which knows none of the user's
    remote names; a bare name would fail inside git with a confusing message.
    """
    if "://" in remote or re.match(r"^[\w.-]+@[\w.-]+:", remote):
        return remote
    path = Path(remote).expanduser()
    if path.exists():
        # A clone's top folder or a bare repository; not a file or a folder inside a clone.
        bare = (path / "HEAD").is_file() and (path / "objects").is_dir()
        if not ((path / ".git").exists() or bare):
            raise UserError(f"--push {remote}: not a git repository; give a clone's path or a URL")
        return str(path.resolve())
    raise UserError(
        f"--push {remote}: give a URL or the path of a git repository (the branch is pushed"
        f" from patchkit's own clone, which has no remote named {remote!r}),"
        " e.g. git@github.com:YOU/mlx.git"
    )


def check_out_dir(out_dir: Path) -> Path:
    """``out_dir`` resolved, if it is absent or an empty folder: export-pr never writes
    into, or deletes from, a folder that holds anything."""
    out = out_dir.expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"--out {out_dir}: exists and is not an empty folder; give a new or empty folder"
            " (nothing in it is overwritten or deleted)"
        )
    if not out.parent.is_dir():
        raise UserError(f"--out {out_dir}: its parent folder {out.parent} does not exist")
    return out


def fresh_out_dir(parent: Path, name: str) -> Path:
    """``parent/name``, or ``name-2``, ``name-3`` ... : the first that does not exist yet."""
    candidate, n = parent / name, 1
    while candidate.exists():
        n += 1
        candidate = parent / f"{name}-{n}"
    return candidate


# --- identity -------------------------------------------------------------------------


def resolve_author(repos: Sequence[Path], author: tuple[str, str] | None) -> tuple[str, str]:
    """The commit author: ``author`` if given, else the git identity the user's git
    reports in the first of ``repos`` that exists (its config, then global and system).

    There is no fallback: a PR commit must carry the submitter's name, never a placeholder.
    """
    if author is not None:
        return author
    for repo in repos:
        if repo.is_dir():
            ident = git.user_identity(repo)
            if ident is not None:
                return ident
    raise UserError(
        "no git identity for the PR commit: run git config --global user.name 'Your Name'"
        " and git config --global user.email you@example.com, or pass --author 'Name <email>'"
    )


def identity_repos(root: Path, mlx_repo: str | None) -> list[Path]:
    """Where the submitter's identity may be configured: their MLX clone (a local
    ``--mlx-repo`` / ``PATCHKIT_MLX_REPO``), then the patchkit checkout."""
    spec = mlx_repo or os.environ.get(source.ENV_REPO) or ""
    local = [Path(spec).expanduser()] if spec and "://" not in spec and "@" not in spec else []
    return [*local, root]


def now_iso() -> str:
    """The current time with the local UTC offset, as git writes an author date."""
    return datetime.datetime.now().astimezone().replace(microsecond=0).isoformat()


# --- patchkit's own worktrees and staging folders ---------------------------------------


@contextmanager
def _held(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock`` (created) for the block; remove it after."""
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_stale(lock: Path) -> bool:
    """Whether no live process holds ``lock`` (a missing lock counts as stale)."""
    try:
        fh = lock.open("r")
    except FileNotFoundError:
        return True
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def _worktrees_dir(clone: Path) -> Path:
    return clone.parent / "worktrees"


def prune_worktrees(clone: Path) -> list[Path]:
    """Remove the worktrees a killed export-pr left in patchkit's cache; return them.

    Only ``export-pr.*`` folders whose lock no live process holds: another
    command's worktrees, and a running export's, are left alone. Git may have
    left such a worktree registered and locked ("initializing"); it is unlocked
    and removed from git's list too.
    """
    parent, removed = _worktrees_dir(clone), []
    registered = set(map(str, git.list_worktrees(clone))) if clone.is_dir() else set()
    names = {p.name.removesuffix(LOCK_SUFFIX) for p in parent.glob(f"{WORKTREE_PREFIX}*")}
    for name in sorted(names):
        path, lock = parent / name, parent / f"{name}{LOCK_SUFFIX}"
        if not _is_stale(lock):
            continue
        if str(path) in registered:
            git.run(clone, "worktree", "unlock", str(path), ok_codes=(0, 128))
            git.run(clone, "worktree", "remove", "--force", "--force", str(path), ok_codes=(0, 128))
        shutil.rmtree(path, ignore_errors=True)
        lock.unlink(missing_ok=True)
        removed.append(path)
    if clone.is_dir():
        git.worktree_prune(clone)
    return removed


def prune_stages(parent: Path) -> list[Path]:
    """Remove staging folders a killed export-pr left in ``parent``; return them.

    Only ``.patchkit-export-pr.*`` folders whose lock no live process holds, and
    that hold nothing but what export-pr writes (``*.patch``, the body, the lock).
    """
    removed = []
    for stage in sorted(parent.glob(f"{STAGE_PREFIX}*")):
        if not stage.is_dir() or stage.is_symlink():
            continue
        lock = stage / LOCK_SUFFIX
        # Without its lock file a stage is being created (or is empty): leave it.
        ours = lock.is_file() and all(
            f.is_file() and (f.suffix == ".patch" or f.name in (BODY_FILE, LOCK_SUFFIX))
            for f in stage.iterdir()
        )
        if ours and _is_stale(lock):
            shutil.rmtree(stage)
            removed.append(stage)
    return removed


@contextmanager
def worktree(clone: Path, commit: str) -> Iterator[Path]:
    """A fresh detached worktree at ``commit``, locked as live while in use and always
    removed after. It moves no ref (``refs/patchkit/base`` belongs to ``apply``)."""
    parent = _worktrees_dir(clone)
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"{WORKTREE_PREFIX}{os.getpid()}.{secrets.token_hex(4)}"
    # The lock exists before the worktree, so a worktree without a held lock is stale.
    with _held(parent / f"{path.name}{LOCK_SUFFIX}"):
        git.worktree_add(clone, path, commit)
        try:
            yield path
        finally:
            git.worktree_remove(clone, path)


@contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A locked staging folder beside ``out``; renamed onto ``out`` (absent or empty)
    when the block succeeds, removed when it fails. The rename is the one commit point."""
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out.parent))
    try:
        with _held(stage / LOCK_SUFFIX):
            yield stage
        os.rename(stage, out)  # POSIX: replaces an empty folder, fails on a non-empty one
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise UserError(f"cannot write {out} ({exc.strerror}); give a new or empty --out") from exc
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


# --- the commit ---------------------------------------------------------------------


def default_branch(clone: Path) -> str | None:
    """The clone's default branch (``refs/heads/main``): what its HEAD names, or None."""
    proc = git.run(clone, "symbolic-ref", "--quiet", "HEAD", ok_codes=(0, 1, 128))
    return proc.stdout.strip() or None


def default_base(clone: Path, progress: source.Progress = source._quiet) -> str:
    """MLX's newest upstream commit: the clone's default branch (its HEAD), fetched first."""
    name = (default_branch(clone) or "HEAD").removeprefix("refs/heads/")
    return source.resolve(clone, name, progress=progress)


def backend_options(backend: str, options: render.RenderOptions) -> render.RenderOptions:
    """``options`` narrowed to the one change this PR carries, alone (the base holds what it
    builds on), in the upstream flavour."""
    return dataclasses.replace(
        options, backends=(backend,), flavour="upstream", with_required=False
    )


def upstream_below(clone: Path, base: str) -> str:
    """The newest upstream commit under ``base``: ``base`` itself, or, for a stacked export
    onto an earlier PR's branch, where that branch leaves the clone's default branch."""
    ref = default_branch(clone) or "HEAD"
    found = git.run(clone, "merge-base", base, ref, ok_codes=(0, 1)).stdout.strip()
    return found or base


def stacked_commits(clone: Path, base: str, upstream: str) -> list[dict[str, str]]:
    """The commits of earlier PRs under a stacked export (``upstream..base``, oldest first):
    their PRs go first, and this one's description names them."""
    if base == upstream:
        return []
    listed = git.out(clone, "rev-list", "--reverse", f"{upstream}..{base}").split()
    return [{"subject": git.subject(clone, c), "commit": c} for c in listed]


def changes_onto(
    read: Read, backend: str, options: render.RenderOptions, templates_dir: Path, stacked: bool
) -> list[str]:
    """The changes a PR of ``backend`` commits onto the tree ``read`` gives, in order: the
    ones it builds on (``render.REQUIRES``) that the tree lacks, then its own.

    The tree lacks a required change when the PR's own edits do not apply to it alone.
    ``stacked`` says the tree must already hold them: then that is a one-line error.
    """
    required = render.REQUIRES.get(backend, ())
    try:
        render_pr(read, backend_options(backend, options), templates_dir)
    except AnchorError as exc:
        if not required:
            raise
        if stacked:
            raise UserError(
                f"--stacked: the base lacks the {' and '.join(required)} PR the {backend} PR "
                f"builds on ({exc}); export that first and pass its branch to --onto"
            ) from exc
        return [*required, backend]
    return [backend]


def check_scope(backend: str, files: Sequence[str]) -> None:
    """UserError when the commit of ``backend`` touches another backend's sources."""
    foreign = [f for f in files if f.startswith(FOREIGN_PATHS[backend])]
    if foreign:
        raise UserError(
            f"the {backend} PR would touch {', '.join(foreign)}: another backend's files;"
            " check that file's edits.toml backend"
        )


def commit_message(title: str | None, change: str) -> str:
    """The commit's message: the submitter's ``--title``, else a placeholder that says whose
    it is to write. MLX's AGENTS.md: tools do not write commit messages for the user."""
    return f"{title or PLACEHOLDER_SUBJECT.format(change=change)}\n"


def change_facts(templates_dir: Path, backend: str) -> str:
    """What the change does and why, from ``templates/pr/commit.txt.j2``: facts for the
    submitter's own commit message and description, shown in the body's draft only."""
    return (
        render.environment(templates_dir)
        .get_template(COMMIT_TEMPLATE)
        .render(backend=backend)
        .strip("\n")
    )


def commit_pr(
    clone: Path,
    base: str,
    upstream: dict[str, str | None],
    patched: dict[str, str],
    message: str,
    author: tuple[str, str],
    *,
    date: str,
    tools: dict[str, str] | None = None,
) -> tuple[str, list[str], list[str]]:
    """One formatted commit on ``base`` in a fresh worktree; return (commit, files, reformatted).

    Author and committer are the submitter, dated ``date`` (now): never upstream's date.
    """
    with worktree(clone, base) as wt:
        changed, reformatted = write_and_format(wt, upstream, patched, tools)
        if not changed:
            raise UserError(f"the templates change nothing at {base[:8]}; nothing to export")
        git.add(wt, changed)
        head = git.commit(wt, message, date=date, author=author)
    return head, changed, reformatted


def branch_may_move(clone: Path, branch: str, force: bool) -> str | None:
    """The commit ``branch`` is at now (None: absent); UserError when it exists and
    ``force`` is off, or when it is MLX's default branch (never moved)."""
    ref = f"refs/heads/{branch}"
    old = git.try_rev_parse(clone, ref)
    if old is not None and not force:
        raise UserError(
            f"branch {branch} already exists in {clone} (at {old[:8]}); pass --force to move it"
            " or choose another --branch"
        )
    if ref in protected_branches(clone):
        raise UserError(
            f"--branch {branch} is MLX's default branch or one patchkit keeps in {clone}; "
            "choose another"
        )
    return old


# Never moved by an export, --force or not: upstream's usual default branches.
UPSTREAM_DEFAULTS = ("refs/heads/main", "refs/heads/master")


def protected_branches(clone: Path) -> set[str]:
    """Refs an export never moves: main, master, the branch the clone's HEAD names, the one
    its remote's HEAD names (the default branch, when HEAD was switched), and apply's own
    ``patchkit/<pin>`` branches, whose moves belong to apply and rebase."""
    refs = set(UPSTREAM_DEFAULTS)
    if head := default_branch(clone):
        refs.add(head)
    remote = git.run(clone, "symbolic-ref", "--quiet", "refs/remotes/origin/HEAD",
                     ok_codes=(0, 1, 128)).stdout.strip()  # fmt: skip
    if remote.startswith("refs/remotes/origin/"):
        refs.add("refs/heads/" + remote.removeprefix("refs/remotes/origin/"))
    listed = git.run(clone, "for-each-ref", "--format=%(refname)",
                     f"refs/heads/{BRANCH_PREFIX}", ok_codes=(0,)).stdout.split()  # fmt: skip
    return refs | set(listed)


def create_branch(clone: Path, branch: str, head: str, force: bool) -> None:
    """Point ``branch`` at ``head``: only when it is new, unless ``force``.

    Created with ``update-ref`` against the all-zero id, so two exports racing for
    one name cannot both win; MLX's default branch is never moved, even with force.
    """
    old = branch_may_move(clone, branch, force)
    ref, expected = f"refs/heads/{branch}", old or ZERO_OID
    proc = git.run(clone, "update-ref", ref, head, expected, ok_codes=(0, 1, 128))
    if proc.returncode != 0:
        raise UserError(f"branch {branch} changed while exporting; run export-pr again")


def format_patch(clone: Path, base: str, head: str, out_dir: Path, count: int = 1) -> list[Path]:
    """``git format-patch`` of the ``count`` commits base..head into ``out_dir`` (fresh)."""
    files = git.format_patch(clone, base, head, out_dir)
    if len(files) != count:
        raise UserError(
            f"expected {count} commits between {base[:8]} and {head[:8]}, got {len(files)}"
        )
    return files


def verify_am(clone: Path, base: str, patches: Sequence[Path], head: str) -> None:
    """Apply ``patches`` to ``base`` with plain ``git am`` and require the tree of ``head``.

    This is what a reviewer's ``git am`` / GitHub's merge does with the patch;
    a mismatch would mean the format-patch output lost something.
    """
    with worktree(clone, base) as wt:
        got = git.tree_id(wt, git.am(wt, list(patches)))
    want = git.tree_id(clone, head)
    if got != want:
        names = ", ".join(p.name for p in patches)
        raise UserError(f"{names} applied with git am give tree {got}, not {want}")


def push_branch(clone: Path, remote: str, branch: str, head: str) -> str:
    """Push ``head`` to ``remote`` as ``branch`` (only ever a remote the user named)."""
    try:
        git.push(clone, remote, f"{head}:refs/heads/{branch}")
    except ToolError as exc:
        lines = (exc.stderr or exc.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit {exc.returncode}"
        raise UserError(
            f"push of {branch} to {remote} failed ({why}); the branch is in {clone}"
        ) from exc
    return remote


# --- facts for the body ---------------------------------------------------------------


def diff_facts(clone: Path, base: str, head: str) -> dict[str, object]:
    """What the commit changes, read from its diff: lines per file, tests and scripts
    added, environment variables named in added C++ lines."""
    numstat = {}
    for line in git.out(clone, "diff", "--numstat", "--no-renames", base, head).splitlines():
        added, removed, path = line.split("\t", 2)
        numstat[path] = (int(added), int(removed))
    new_files = set(
        git.out(clone, "diff", "--name-only", "--diff-filter=A", base, head).splitlines()
    )
    diff = git.out(clone, "diff", "--no-renames", "--unified=0", base, head)
    tests, env_vars, path = [], set(), ""
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else ""
        elif line.startswith("+") and path.startswith("python/tests/"):
            tests += re.findall(r"^\+\s*def (test_\w+)\(", line)
        elif line.startswith("+") and path.endswith(CXX_SUFFIXES):
            env_vars |= set(re.findall(r'"(MLX_[A-Z0-9_]+)"', line))
    test_file = next((p for p in numstat if p.startswith("python/tests/")), None)
    return {
        "numstat": numstat,
        "tests": tests,
        "test_file": test_file,
        "benchmarks": sorted(p for p in new_files if p.startswith("benchmarks/")),
        "env_vars": sorted(env_vars),
    }


def scope_warnings(backend: str, facts: dict[str, object]) -> list[str]:
    """What issue 32 asks of an upstream PR that this commit does not meet yet."""
    notes = []
    if facts["env_vars"]:
        notes.append(f"the {backend} PR adds environment variables {facts['env_vars']}")
    if backend == "metal":
        numstat: dict[str, tuple[int, int]] = facts["numstat"]  # type: ignore[assignment]
        headers = [p for p in numstat if p.endswith(("/quantized.h", "/fp_quantized.h"))]
        net = sum(numstat[p][0] - numstat[p][1] for p in headers)
        if net > 0:
            notes.append(f"the Metal kernel headers grow by {net} lines (the goal is <= 0)")
    return notes


def _pct(x: float) -> str:
    return f"{round(100 * x)}%"


def _span(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def emulate_fact(data: dict) -> list[str]:
    """Lines for a ``patchkit emulate --json`` record: M = 1 kernels' IR, rows vs M = 1."""
    lines = []
    for family, ir in sorted((data.get("ir") or {}).items()):
        same = ir["instances"] - len(ir["differing"])
        lines.append(
            f"{family} M = 1 kernels: {same} of {ir['instances']} instances compile to the"
            " base's optimized IR at vecs_per_tg = 1 (clang -O2)"
        )
    for label, part in (("affine", data), ("fp", data.get("fp") or {})):
        chains = part.get("toolchains") or {}
        if not chains:
            continue
        rows = [c["rows_checked"] for c in chains.values()]
        diff = [c["rows_differing"] for c in chains.values()]
        wide = [v for c in chains.values() for k, v in c.items() if k.startswith("wide_div")]
        line = (
            f"{label}: {part.get('cases', '?'):,} cases; {_span(diff, str)} of"
            f" {_span(rows, lambda x: f'{x:,}')} rows differ from M = 1 in each of"
            f" {len(chains)} builds ({', '.join(sorted(chains))})"
        )
        if wide:
            line += f"; the base's wide kernel (control) differs on {_span(wide, _pct)} of cases"
        lines.append(line)
    return lines


def own_test_status(data: dict, own_tests: Sequence[str]) -> dict[str, str]:
    """``{test: passed | failed | skipped | unfinished | not run}`` for this PR's own test
    methods in a ``patchkit build`` record."""
    per_test = (data.get("tests") or {}).get("per_test") or {}
    return {t: per_test.get(t, "not run") for t in own_tests}


def build_fact(
    data: dict, own_status: dict[str, str] | None = None, fixed_status: dict[str, str] | None = None
) -> list[str]:
    """Lines for a ``patchkit build`` record: where, and MLX's own test file on that build;
    none for a build whose tests did not run (``--no-test``): a build alone is no fact a
    reviewer can use. The build holds every PR of the series at once, so its test file
    has the other PRs' tests too: the methods not run to the end are counted, and this
    PR's own methods are named with their verdicts (``own_status``, from
    :func:`own_test_status`), and so are the methods it fixes (``fixed_status``)."""
    if not data.get("tests"):
        return []
    machine = data.get("machine") or {}
    where = machine.get("gpu") or f"{machine.get('system', '?')} {machine.get('machine', '')}"
    lines = [
        f"MLX at {str(data.get('mlx_commit', '?'))[:8]} with this change and {SERIES_BUILT},"
        f" {data.get('backend')} backend, {where.strip()},"
        f" {data.get('date', '?')}"
    ]
    tests = data.get("tests") or {}
    counts = [tests.get(k) for k in ("passed", "failed", "skipped")]
    if all(isinstance(c, int) for c in counts):
        line = f"`{tests.get('file')}`: {counts[0]} passed, {counts[1]} failed, {counts[2]} skipped"
        failed = [t for t, s in (tests.get("per_test") or {}).items() if s == "failed"]
        if failed:
            line += f" (failed: {', '.join(failed)})"
        if tests.get("unfinished"):
            line += f"; {len(tests['unfinished'])} methods not run to the end in the time given"
        lines.append(line)
    if own_status:
        lines.append(
            "this PR's tests there: " + ", ".join(f"`{t}` {s}" for t, s in own_status.items())
        )
    if fixed_status:
        lines.append(
            "the tests this PR fixes there: "
            + ", ".join(f"`{t}` {s}" for t, s in fixed_status.items())
        )
    return lines  # MLX's own tests only: a reviewer reruns them, not patchkit's parity


# A test method's verdict on a tests page (bench/mlx_tests.py), as the body words it.
TEST_VERDICTS = {"ok": "ok", "FAILED": "failed", "UNFINISHED": "not run to the end"}


def tests_fact(data: dict, methods: Sequence[str] = ()) -> list[str]:
    """Lines for MLX's test file run on this branch's build and on stock side by side
    (``bench/mlx_tests.py``): each arm's verdicts, whose failures are stock's own, and
    what fails on stock and passes here (the new tests, shown failing on main). With
    ``methods`` (a PR's own tests and the MLX tests it fixes), only those of the page:
    a page of the series' build runs other PRs' tests too, which are not this PR's to
    claim; none of them there, no lines."""
    arms = data["arms"]
    if methods:
        arms = {arm: {m: r for m, r in ran.items() if m in methods} for arm, ran in arms.items()}
        if not arms["pr"]:
            return []
        data = {**data, "arms": arms, **compare_arms(arms)}

    def verdicts(arm: str) -> str:
        v = [m["verdict"] for m in arms[arm].values()]
        return (f"methods: {v.count('ok')} passed or skipped, {v.count('FAILED')} failed, "
                f"{v.count('UNFINISHED')} not run to the end")  # fmt: skip

    also, only = data["pr_failing_also_on_stock"], data["pr_failing_only_on_pr"]
    unseen = data.get("pr_failing_not_compared", 0)  # pages from before it was counted
    total = also + len(only) + unseen
    fixed = sorted(fail_on_stock_only(data, list(arms["pr"])))
    failing = ", ".join(
        f"{m} ({len(r['problems'])})" for m, r in sorted(arms["pr"].items()) if r["problems"]
    )
    compared = ""
    if data.get("only") or data.get("only_failed_in_build"):
        which = ", ".join(data.get("only") or []) or "none"
        failed = data.get("failed_in_build")
        if not data.get("only_failed_in_build"):
            why = ")"
        elif failed is None or set(failed) == set(data.get("only") or []):
            why = ", those that failed in the build's own run of the file)"
        else:
            why = (f"; failed in the build's own run of the file: {', '.join(failed) or 'none'}"
                   ", the others named to run)")  # fmt: skip
        compared = f" (methods run: {which}{why}"
    quoted = f", quoted here: {', '.join(sorted(arms['pr']))}" if methods else ""
    lines = [
        f"`python/tests/{data['module']}.py` of this branch (with {SERIES_BUILT}), "
        f"{data['hardware']['gpu']}, one process "
        f"per test method{compared}{quoted}: with this branch {verdicts('pr')}; with stock MLX "
        f"({data['mlx']['stock']}) {verdicts('stock')}",
        f"subtests failing with this branch: {total or 'none'}"
        + (f" ({failing})" if failing else "")
        + (f", of which {also} fail on stock too" if total else "")
        + ("" if not only else f"; only here: {'; '.join(only)}")
        + (f"; not compared, their method not run to the end on stock: {unseen}" if unseen else ""),
    ]
    if methods:  # a PR's own few: each one's verdict in both arms, readable at a glance
        lines.insert(1, "each, with this branch / with stock: " + "; ".join(
            f"{m} {TEST_VERDICTS[r['verdict']]} / "
            f"{TEST_VERDICTS[arms['stock'][m]['verdict']] if m in arms['stock'] else 'not run'}"
            for m, r in sorted(arms["pr"].items())))  # fmt: skip
    for arm, who in (("pr", "this branch"), ("stock", "stock")):
        if left := sorted(m for m, r in arms[arm].items() if r["verdict"] == "UNFINISHED"):
            lines.append(f"not run to the end with {who}: {', '.join(left)}")
    if fixed:
        lines.append(f"failing on stock, passing with this branch: {', '.join(fixed)}")
    return lines


# How the speed page's timed calls relate (bench/mlx_qmv.py's "calls"; runs without it
# timed independent calls).
SPEED_CALLS = {
    "chained": "each call's input made from the previous call's output (x + 0 * y[:, :1], "
    "two small elementwise ops, in both arms), so the calls run one after another, as a "
    "layer that needs the one before it does",
    "independent": "the calls do not depend on each other, so MLX's CUDA graph may overlap "
    "them: these are throughput figures, not the time a call that needs the one before "
    "waits; a kernel that leaves SMs idle on its own gains most from the overlap",
}


def speed_calls(data: dict) -> str:
    """How a speed page's timed calls related (a key of :data:`SPEED_CALLS`)."""
    return data["runs"][0].get("calls", "independent")


# A speed page's cell: (PR / stock, its run, its row).
SpeedCell = tuple[float, dict, dict]


def band_cells(data: dict, lo: int, hi: int) -> tuple[list[SpeedCell], list[SpeedCell]]:
    """The speed page's cells at M = lo..hi as ``(PR / stock, run, row)``, and those of
    them where this change is slower: at M = 8..16, where stock runs its ``qmm``, the cost
    of keeping those rows equal to M = 1, which the reviewer weighs."""
    cells = [(r["pr_us"] / r["stock_us"], run, r) for run in data["runs"] for r in run["rows"]
             if lo <= r["M"] <= hi]  # fmt: skip
    return cells, [c for c in cells if c[0] > 1.0]


def qmm_band_cells(data: dict) -> tuple[list[SpeedCell], list[SpeedCell]]:
    """:func:`band_cells` at M = 8..16, stock's ``qmm``."""
    return band_cells(data, 8, 16)


def qmv_band_slower(data: dict, where: str = "the table below") -> list[str]:
    """A line counting the cells at M = 1..7 (stock's ``qmv``) where this change is slower,
    by layer and bits and by the rounds' spread: a ratio over 1 there is either a cost of
    the new kernel or noise, and the spread is what tells them apart. The cells themselves
    go in :func:`speed_tables`."""
    cells, slower = band_cells(data, 1, 7)
    if not slower:
        return []
    head = f"slower than stock in {len(slower)} of {len(cells)} cells at M = 1..7"
    return [head + _spread_tail(slower, "stock's") + f"; by layer and bits: {_layer_counts(slower)}"
            + f"; each in {where}"]  # fmt: skip


def _spread_tail(cells: list[SpeedCell], other: str) -> str:
    """How many slower cells lie beyond the rounds' spread (this change's fastest round
    slower than ``other`` slowest, :func:`_rounds_overlap`), as the tail of a count; no word
    of a spread where the page kept one round a cell."""
    parts = _spread_parts(cells)
    if parts is None:
        return ""
    beyond, within = parts
    if not beyond or not within:
        word, test = ("beyond", "slower than") if beyond else ("within", "no slower than")
        return (f", all {word} the rounds' spread (this change's fastest round {test} "
                f"{other} slowest)")  # fmt: skip
    return (f", {len(beyond)} of them beyond the rounds' spread (this change's fastest round "
            f"slower than {other} slowest)")  # fmt: skip


def _by_layer(cells: list[SpeedCell]) -> dict[tuple[int, int, int], list[SpeedCell]]:
    """Cells grouped by (K, N, bits), smallest layer first: a route that kept `qmm` for
    some shapes would be a condition on the layer and bits, so that is what leads."""
    layers: dict[tuple[int, int, int], list[SpeedCell]] = {}
    for cell in sorted(cells, key=lambda c: (c[2]["K"] * c[2]["N"], c[2]["K"], c[2]["bits"])):
        layers.setdefault((cell[2]["K"], cell[2]["N"], cell[2]["bits"]), []).append(cell)
    return layers


def _layer_counts(cells: list[SpeedCell], spread: bool = True) -> str:
    """Cells counted by layer and bits, as "4096x1024 8-bit 12 (2 beyond the spread),
    ...", the count beyond the rounds' spread only where the page kept rounds (and
    ``spread``: not for cells all beyond it)."""
    spread = spread and _kept_rounds(cells)

    def count(group: list[SpeedCell]) -> str:
        beyond = sum(not _rounds_overlap(c[2]) for c in group)
        return f"{len(group)}" + (f" ({beyond} beyond the spread)" if spread and beyond else "")

    layers = _by_layer(cells).items()
    return ", ".join(f"{k}x{n} {bits}-bit {count(g)}" for (k, n, bits), g in layers)


def _spread_parts(cells: list[SpeedCell]) -> tuple[list[SpeedCell], list[SpeedCell]] | None:
    """Slower cells parted by the rounds' spread: those beyond it (this change's fastest
    round slower than stock's slowest, :func:`_rounds_overlap`) and those within it; None
    where the page kept one round a cell in both arms, which has no spread to part by."""
    if not _kept_rounds(cells):
        return None
    return ([c for c in cells if not _rounds_overlap(c[2])],
            [c for c in cells if _rounds_overlap(c[2])])  # fmt: skip


def _kept_rounds(cells: list[SpeedCell]) -> bool:
    """Whether the page kept two or more rounds of some cell in some arm: without, there
    is no spread to speak of."""
    return any(len(_rounds(c[2], arm)) > 1 for c in cells for arm in ("pr", "stock"))


def _slower_text(ratio: float) -> str:
    """A slower cell's ratio, as "1.10x"; three decimals where two would read 1.00x, so a
    cell named slower never reads as level."""
    return f"{ratio:.3f}x" if f"{ratio:.2f}" == "1.00" else f"{ratio:.2f}x"


def _rounds(r: dict, arm: str) -> list[float]:
    """A cell's rounds in one arm (``pr`` or ``stock``); its median alone where the page
    kept no rounds."""
    return r.get(f"{arm}_rounds_us") or [r[f"{arm}_us"]]


def _rounds_overlap(r: dict) -> bool:
    """Whether a cell's fastest round of this change is no slower than stock's slowest:
    then "slower" rests on medians of rounds that disagree."""
    return min(_rounds(r, "pr")) <= max(_rounds(r, "stock"))


def speed_tables(data: dict) -> list[dict]:
    """The cells a speed page's lines count, one table each: those at M = 1..7 where this
    change is slower than stock's ``qmv`` (slowest first: the reviewer weighs costs), and
    those at M = 8..16 where it is slower than stock's ``qmm`` (by layer and bits: what a
    route by shape would test); in both, those beyond the rounds' spread first. Each row
    gives both arms' rounds, sorted, so the middle one of three is the median the ratio is
    of; the body folds each table under a summary line (HTML there: no Markdown)."""
    how = ROUTE_CALLS[speed_calls(data)]
    tables = []
    # (band, the other arm in a column, in the summary: HTML there, no Markdown)
    for lo, hi, other, than in (
        (1, 7, "stock", "stock"),
        (8, 16, "`qmm`", "stock's <code>qmm</code>"),
    ):
        slower = band_cells(data, lo, hi)[1]
        if not slower:
            continue
        cells = (sorted(slower, key=lambda c: -c[0]) if lo == 1
                 else [c for group in _by_layer(slower).values() for c in group])  # fmt: skip
        spread = _kept_rounds(slower)
        if spread:
            cells.sort(key=lambda c: _rounds_overlap(c[2]))  # stable: beyond the spread first
        header = ["K x N", "bits", "dtype", "group", "M", f"this change / {other}",
                  "this change's rounds, µs", f"{other}'s rounds, µs"]  # fmt: skip
        rows = []
        for ratio, run, r in cells:
            row = [f"{r['K']}x{r['N']}", str(r["bits"]), run["dtype"], str(run["group_size"]),
                   str(r["M"]), _slower_text(ratio), _rounds_text(r, "pr"),
                   _rounds_text(r, "stock")]  # fmt: skip
            rows.append(row + (["no" if _rounds_overlap(r) else "yes"] if spread else []))
        tables.append({
            "summary": f"The {len(slower)} cells at M = {lo}..{hi} where this change is slower "
                       f"than {than}, {how}",
            "header": header + (["beyond the rounds' spread"] if spread else []),
            "rows": rows,
        })  # fmt: skip
    return tables


def _rounds_text(r: dict, arm: str) -> str:
    """A cell's rounds in one arm, fastest first, as "19.4, 26.0, 28.0" (µs)."""
    return ", ".join(f"{x:.1f}" for x in sorted(_rounds(r, arm)))


def untimed_ms(data: dict) -> list[int]:
    """The M from 2 to 16 that no run of a speed page timed."""
    timed = {r["M"] for run in data["runs"] for r in run["rows"]}
    return [m for m in range(2, 17) if m not in timed]


# Layers of fewer rows (N) than this are owed where no speed page timed one: the CUDA
# kernel's grid has a block per 16 rows and never splits K, so it fills less of the GPU
# the fewer rows a layer has (the speed bench's layers include one of 1024 rows).
SMALL_LAYER_N = 4096


def speed_layers(data: dict) -> list[str]:
    """The layers a speed page timed, as "KxN", in the order its rows first name them."""
    rows = (r for run in data["runs"] for r in run["rows"])
    return list(dict.fromkeys(f"{r['K']}x{r['N']}" for r in rows))


def untimed_layers(data: dict) -> list[str]:
    """The kinds of layer no run of a speed page timed that this change launches otherwise
    than the layers it did: a grid too small to fill the GPU (every M, M = 1 included), and
    a group spanning K, which main sends to ``qmm_sm90`` from M * B = 2."""
    cells = [(run, r) for run in data["runs"] for r in run["rows"]]
    owed = []
    if all(r["N"] >= SMALL_LAYER_N for _, r in cells):
        owed.append(f"fewer than {SMALL_LAYER_N} rows (N), where the new kernel's grid (a "
                    "block per 16 rows, K never split) fills less of the GPU than on the "
                    "layers above (M = 1 included: every sm90 decode step takes it)")  # fmt: skip
    if all(r["K"] > run["group_size"] for run, r in cells):
        owed.append("one group a row (K <= group size), which main sends to `qmm_sm90` "
                    "from M * B = 2")  # fmt: skip
    return owed


def band_text(rows: list[dict], lo: int, hi: int) -> str:
    """The Ms a band holds in a page's rows, as "M = 2..7" or "M = 8, 12, 16"."""
    ms = sorted({r["M"] for r in rows if lo <= r["M"] <= hi})
    if not ms:
        return f"M = {lo}..{hi}"
    if len(ms) > 2 and ms == list(range(ms[0], ms[-1] + 1)):
        return f"M = {ms[0]}..{ms[-1]}"
    return "M = " + ", ".join(map(str, ms))


# How a speed page's calls related, as the route section names it.
ROUTE_CALLS = {"chained": "with each call waiting for the one before",
               "independent": "with calls MLX's CUDA graph may overlap"}  # fmt: skip


def route_line(data: dict) -> str | None:
    """What one speed page says of the route at M = 8..16, for the route section: how
    its calls related, and in how many cells stock's ``qmm`` is faster, and in how many of
    those beyond the rounds' spread; None for a page that timed no M there."""
    cells, slower = qmm_band_cells(data)
    if not cells:
        return None
    rows = [r for run in data["runs"] for r in run["rows"]]
    where = f"{len(cells)} cells at {band_text(rows, 8, 16)}"
    how = ROUTE_CALLS[speed_calls(data)]
    if not slower:
        span = _span([c[0] for c in cells], lambda x: f"{x:.2f}")
        return f"{how}: no slower than `qmm` in any of the {where} ({span}x `qmm`'s time)"
    head = f"{how}: slower than `qmm` in {len(slower)} of the {where}"
    parts = _spread_parts(slower)
    if parts is None:
        return head  # one round a cell: no spread to speak of
    beyond = parts[0]
    where = f": {_layer_counts(beyond, spread=False)}" if beyond else ""
    return (f"{head}, {len(beyond)} of them beyond the rounds' spread (this change's "
            f"fastest round slower than `qmm`'s slowest){where}")  # fmt: skip


def speed_fact(data: dict, release: str = "") -> list[str]:
    """Lines for the speed page through ``mx.quantized_matmul`` (``bench/mlx_qmv.py page``):
    the patched build's time over stock's per band of M (M = 1 per bits), how it was timed,
    and the page's notes on its runs."""
    runs = data["runs"]
    first = runs[0]
    rows = [r for run in runs for r in run["rows"]]
    layers = sorted({(r["K"], r["N"]) for r in rows}, key=lambda kn: (kn[0] * kn[1], kn))
    sizes = [k * n for k, n in layers]
    bits = sorted({r["bits"] for r in rows})
    pairs = ", ".join(f"{r['dtype']} group {r['group_size']}" for r in runs)

    def band(lo: int, hi: int) -> str:
        return band_text(rows, lo, hi)

    def ratio(lo: int, hi: int, b: int | None = None) -> str:
        picked = [r["pr_us"] / r["stock_us"] for r in rows
                  if lo <= r["M"] <= hi and b in (None, r["bits"])]  # fmt: skip
        return _span(picked, lambda x: f"{x:.2f}") + "x" if picked else "not timed"

    ones = "; ".join(f"M = 1, {b}-bit: {ratio(1, 1, b)}" for b in bits)
    cells, slower = qmm_band_cells(data)
    # Where the cells a line counts lie: the tables follow the lines in band order.
    both = bool(band_cells(data, 1, 7)[1]) and bool(slower)
    where = (
        ("the first table below", "the second table below") if both else ("the table below",) * 2
    )
    slow = []
    if slower:
        close = sum(round(c[0], 2) <= 1.1 for c in slower)  # as the cells below show them
        near = f", {close} of them at 1.10x or less" if close else ""
        slow.append(f"slower than stock's `qmm` in {len(slower)} of {len(cells)} cells at "
                    f"{band(8, 16)}{near}, at most {_worst_text(slower)}")  # fmt: skip

        # Every such cell, so that a route keeping `qmm` there can be read off them.
        slow.append("those cells by layer and bits" + _spread_tail(slower, "`qmm`'s")
                    + f": {_layer_counts(slower)}; each in {where[1]}")  # fmt: skip
    elif cells:
        slow.append(f"no slower than stock's `qmm` in any of {len(cells)} cells at {band(8, 16)}")
    link = _link_text(data) if speed_calls(data) == "chained" else ""
    return [
        f"{SPEED_SETUP_HEAD}{first['hardware']['gpu'].split(',')[0]}: stock MLX "
        f"{first['mlx']['stock']} (release wheels{_release_text(first['mlx']['stock'], release)}) "
        "and MLX built from the pinned commit with "
        f"this change and {SERIES_BUILT} (compiler and build flags may differ between the "
        f"two besides the changes: main built the same way is owed below), taking turns; "
        f"{len(layers)} layers (K x N: {', '.join(f'{k}x{n}' for k, n in layers)}) "
        f"of {sizes[0]:,} to {sizes[-1]:,} weights, {'- and '.join(map(str, bits))}-bit, "
        f"{pairs}",
        f"timing: {first['repeats']} calls evaluated together (one `mx.eval`) after a "
        f"warm-up, each reading a cold copy of the weights (the copies add up to well over "
        f"the L2), median of "
        f"{first['rounds']} rounds per arm; {SPEED_CALLS[speed_calls(data)]}{link}",
        f"time with this change over stock's (below 1: this change is faster): {ones}; "
        f"{band(2, 7)}: {ratio(2, 7)}; "
        f"{band(8, 16)}: {ratio(8, 16)} (stock runs `qmm` from M = 8)",
        *m1_error_fact(rows, bits),
        *qmv_band_slower(data, where[0]),
        *slow,
        *(f"note: {n}" for n in data.get("notes") or []),
    ]


def _release_text(stock: str, release: str) -> str:
    """Where stock's version is the pin's release (``pin.toml``: the release whose copies of
    the files this change touches are the pinned commit's), that fact, so the reviewer
    knows the arms differ there by this change alone."""
    if not release or stock != release:
        return ""
    return f"; {release}'s copies of the files this change touches are the pinned commit's"


def _worst_text(slower: list[SpeedCell]) -> str:
    """The slowest of the slower cells, and where its rounds overlap the other arm's, the
    slowest beyond the rounds' spread too: a worst case that is noise is not the cost."""

    def cell(c: SpeedCell) -> str:
        ratio, run, r = c
        return (f"{ratio:.2f}x ({r['bits']}-bit {r['K']}x{r['N']}, {run['dtype']} group "
                f"{run['group_size']}, M = {r['M']}")  # fmt: skip

    worst = max(slower, key=lambda c: c[0])
    parts = _spread_parts(slower)
    if parts is None:
        return cell(worst) + ")"
    if not _rounds_overlap(worst[2]):
        return cell(worst) + ", beyond the rounds' spread)"
    beyond = parts[0]
    tail = f"; beyond it at most {cell(max(beyond, key=lambda c: c[0]))})" if beyond else ""
    return cell(worst) + ", within the rounds' spread)" + tail


def _link_text(data: dict) -> str:
    """For chained calls, what the link to the call before takes alone, in both arms (the
    page's ``link_us``): part of every time the page gives, it pulls ratios toward 1."""
    links = [v for run in data["runs"] for v in (run.get("link_us") or {}).values()]
    if not links:
        return ""
    span = _span(links, lambda x: f"{x:.0f}")
    return (
        f"; the link alone takes {span} µs a call in both arms (timed in the same runs), "
        "part of every time below, which it pulls toward 1x on the smaller layers"
    )


def m1_error_fact(rows: list[dict], bits: list[int]) -> list[str]:
    """The speed page's M = 1 error against float32, this change's over stock's per bits
    (``bench/mlx_qmv.py``'s ``m1_error``), where its runs measured it: M = 1 is a new
    kernel, and its bits may differ from stock's, so the reviewer reads in which direction."""
    cells = [r for r in rows if "pr_m1_error" in r and "stock_m1_error" in r]
    if not cells:
        return []

    def ratios(b: int) -> str:
        picked = [r["pr_m1_error"] / r["stock_m1_error"] if r["stock_m1_error"] else math.inf
                  for r in cells if r["bits"] == b]  # fmt: skip
        return _span(picked, lambda x: f"{x:.2f}") + "x" if picked else "not measured"

    return [M1_ERROR_HEAD + "; ".join(f"{b}-bit {ratios(b)}" for b in bits)]


M1_ERROR_HEAD = (
    "M = 1's largest error against a float32 reference computed on the CPU from the same "
    "quantized weights, over the largest output, this change's over stock's (the same "
    "weights and vector in both): "
)

# The speed lines a second page repeats word for word, and what they read as there.
SPEED_SETUP_HEAD = "`mx.quantized_matmul` on "
AS_ABOVE = {
    M1_ERROR_HEAD: "M = 1's error against a float32 reference: as above",
    SPEED_SETUP_HEAD: "the GPU, the two arms, the layers, bits, dtypes and groups: as above",
}


def said_once(found: list[dict]) -> None:
    """A later result's line that reads as an earlier one's, word for word, says so instead:
    two speed pages of one build share the GPU, arms, layers and runs, and draw the same
    weights and vectors for M = 1's error (untimed)."""
    seen: set[str] = set()
    for result in found:
        lines = result["lines"]
        for i, line in enumerate(lines):
            head = next((h for h in AS_ABOVE if line.startswith(h)), None)
            if head is not None:
                if line in seen:
                    lines[i] = AS_ABOVE[head]
                seen.add(line)


def sanitizer_fact(data: dict) -> list[str]:
    """Lines for compute-sanitizer's runs on the build (``ci/cuda_controls.py``'s record):
    what each tool reported in the new kernel with the change as it is, and that racecheck
    reports it with a barrier taken out (what makes "no report" worth something)."""
    runs = data.get("sanitizer") or []
    clean = [r for r in runs if r["switch"] == "none"]
    caught = [r for r in runs if r["switch"] == "no-barrier"]
    if not clean or not all(r.get("ok") for r in runs):
        return []
    tools = ", ".join(r["tool"] for r in clean)
    if all(r.get("kernel_only") for r in clean):
        # Each tool checked the kernel alone: its summary counts every report there.
        claim = "each tool checked `qmv_mma_kernel` alone and counted no report in it"
    else:
        # A tool with reports: how many its summary counts and how many its log printed
        # (the tool prints the first ones only), so that "none names the kernel" is read
        # as "none of those printed" where it printed fewer than it counted.
        seen = []
        for r in clean:
            if count := r.get("summary"):
                printed = r.get("kernel_reports", 0) + r.get("other_reports", 0)
                shown = ("all printed, each in another kernel" if printed >= count
                         else f"the first {printed:,} printed")  # fmt: skip
                seen.append(f"{r['tool']} counts {count:,} reports, {shown}")
        claim = "no printed report names `qmv_mma_kernel`" + (
            f" ({'; '.join(seen)})" if seen else ""
        )
    lines = [
        f"compute-sanitizer ({tools}) over `mx.quantized_matmul` calls at every M * B <= 16 "
        "(bfloat16, 4- and 8-bit; tails in K and N, batched and broadcast weights), the "
        f"switches off ({data.get('machine', '?')}): {claim}, and every row equals its "
        "M = 1 call under each tool",
    ]
    if caught:
        lines.append("control: with the barrier before the warps' partial sums are added "
                     "taken out, racecheck reports `qmv_mma_kernel`")  # fmt: skip
    if any(r["switch"] == "uninit-read" and r.get("kernel_reports") for r in runs):
        lines.append("control: with a read of memory never written put in, initcheck "
                     "reports `qmv_mma_kernel`")  # fmt: skip
    lines.append("to rerun on this PR's test: `compute-sanitizer --tool racecheck "
                 "--kernel-name kns=qmv_mma_kernel python "
                 "python/tests/test_quantized.py "
                 "TestQuantized.test_qmv_tensor_cores_match_single_vector`")  # fmt: skip
    return lines


def parity_fact(data: dict) -> list[str]:
    """Lines for a ``patchkit parity --json`` report."""
    device = (data.get("device") or {}).get("name", "?")
    return [
        f"{device}, MLX {data.get('mlx_version')}: {data.get('rows_differing')} of"
        f" {data.get('rows_compared', 0):,} rows differ from M = 1"
    ]


def bench_fact(data: dict, arm: str, base: str, m_range: Sequence[int]) -> list[str]:
    """Lines for a compiled benchmark record: ``arm``'s time over ``base``'s per cell."""
    results = data.get("results") or {}
    base_cells = {
        (c["K"], c["N"], c["bits"], r["M"]): r["us"] for c in results[base] for r in c["by_m"]
    }
    ratios, differing = [], 0
    for cfg in results[arm]:
        for r in cfg["by_m"]:
            differing += r.get("rows_differing", 0)
            if m_range[0] <= r["M"] <= m_range[1]:
                ratios.append(r["us"] / base_cells[(cfg["K"], cfg["N"], cfg["bits"], r["M"])])
    above = sum(x > 1.0 for x in ratios)
    gpu = (data.get("host") or {}).get("gpu", "?")
    return [
        f"{gpu}: {len(results[arm])} layer configurations, M = {m_range[0]}..{m_range[1]}:"
        f" {_span(ratios, lambda x: f'{x:.2f}')}x the base's time ({above} of {len(ratios)}"
        f" cells above 1.00); {differing} rows differ from M = 1",
        f"command: `{data.get('command', '?')}`",
    ]


def read_results(root: Path, entries: Sequence[dict]) -> dict[str, dict | Exception]:
    """{file: its JSON, or why it could not be read} for each entry of the manifest, read
    once: the staleness check and the facts both use them."""
    out: dict[str, dict | Exception] = {}
    for entry in entries:
        try:
            out[entry["file"]] = json.loads((root / entry["file"]).read_text())
        except (OSError, ValueError) as exc:
            out[entry["file"]] = exc
    return out


# current_build_inputs' key for the id of the PR's tests as templates/ renders them now.
PR_TESTS = "pr tests"


def checkout_pin(root: Path) -> pin.Pin | None:
    """The checkout's pin (``pin.toml``); None where it has none, as a bare template tree
    in the tests: what the records are compared against and stock's release come from it."""
    return pin.load(root / pin.PIN_FILE) if (root / pin.PIN_FILE).is_file() else None


def current_build_inputs(root: Path) -> dict[str, str] | None:
    """``{backend: mlx_build.build_inputs_id}`` of what ``patches/`` holds now, once per
    backend, and the PR tests' id (``PR_TESTS``); None where the checkout has no pin file
    (nothing to compare against)."""
    if (pinned := checkout_pin(root)) is None:
        return None
    ids = {b: mlx_build.build_inputs_id(root, pinned.short, b) for b in mlx_build.BACKENDS}
    return {**ids, PR_TESTS: mlx_build.pr_files_id(root)}


def is_current_build(data: dict, inputs: dict[str, str]) -> bool:
    """Whether a build or tests record names what its backend compiles of ``patches/``
    now."""
    return data.get("patch", {}).get("build_inputs_sha256") == inputs.get(data.get("backend"))


def stale_reason(data: dict, kind: str, inputs: dict[str, str] | None) -> str | None:
    """Why a result measured another patch than the one exported, or None: a build or
    tests record names what its build compiled of the series, a speed page what the build
    it timed compiled (``bench/mlx_qmv.py page --build-record``). Quoting either for this
    patch would present another kernel's numbers as this one's. ``inputs`` None: no check."""
    if inputs is None:
        return None
    built = kind in ("build", "tests") and data.get("backend") in inputs
    if built and not is_current_build(data, inputs):
        return "built from another patch series than patches/ holds now (rebuild it)"
    ran = data.get("tests") is not None or data.get("arms") is not None
    if built and ran and data.get("patch", {}).get("pr_files_sha256") != inputs[PR_TESTS]:
        return "ran other PR tests than templates/ renders now (rerun it)"
    if kind == "sanitizer" and data.get("build_inputs_sha256") != inputs.get("cuda"):
        return "ran on a build of another patch series than patches/ holds now (rerun it)"
    if kind == "speed":
        build = data.get("build")
        if not isinstance(build, dict):
            return "names no build it timed (remake it with bench/mlx_qmv.py page --build-record)"
        if build.get("build_inputs_sha256") != inputs.get(build.get("backend", "")):
            return "timed a build of another patch series than patches/ holds now (rerun it)"
    return None


def shown_passing(results: list[dict], key: str) -> bool:
    """Whether one result's verdicts under ``key`` (``own_tests`` or ``fixed_tests``, from
    :func:`measured_results`) are all "passed": none listed is no proof."""
    return any(r.get(key) and set(r[key].values()) == {"passed"} for r in results)


def measured_results(
    root: Path, templates_dir: Path, backend: str, own_tests: Sequence[str] = ()
) -> tuple[list[dict], list[str]]:
    """([{title, lines, source, own_tests, fixed_tests}], warnings) from the files
    ``templates/pr/results.toml`` names for ``backend``: numbers are read from the files,
    never written in code. ``own_tests`` names this PR's test methods; a build record's
    entry carries their verdicts, from which the body says whether they are shown passing;
    the same for the MLX tests the PR fixes (:data:`FIXED_TESTS`)."""
    manifest = templates_dir / RESULTS_MANIFEST
    if not manifest.is_file():
        return [], [f"no {manifest}: the PR body lists no measured results"]
    entries = tomllib.loads(manifest.read_text()).get(backend, {}).get("result", [])
    found, notes = [], []
    results = read_results(root, entries)
    inputs = current_build_inputs(root)
    # The release whose copies of the touched files are the pin's (stock's arm on a speed page).
    release = pinned.release if (pinned := checkout_pin(root)) else ""
    for entry in entries:
        own: dict[str, str] = {}
        fixed: dict[str, str] = {}
        try:
            data = results[entry["file"]]
            if isinstance(data, Exception):
                raise data
            kind = entry["kind"]
            if stale := stale_reason(data, kind, inputs):
                notes.append(f"{entry['file']}: {stale}; left out of the body")
                continue
            if kind == "emulate":
                lines = emulate_fact(data)
            elif kind == "build":
                own = own_test_status(data, own_tests)
                fixed = own_test_status(data, FIXED_TESTS.get(backend, ()))
                lines = build_fact(data, own, fixed)
            elif kind == "parity":
                lines = parity_fact(data)
            elif kind == "tests":
                lines = tests_fact(data, [*FIXED_TESTS.get(backend, ()), *own_tests])
            elif kind == "speed":
                lines = speed_fact(data, release)
            elif kind == "sanitizer":
                lines = sanitizer_fact(data)
            else:
                lines = bench_fact(data, entry["arm"], entry["base"], entry["m"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            notes.append(
                f"{entry.get('file')}: cannot read the result ({exc}); left out of the body"
            )
            continue
        if not lines:
            why = (
                "runs none of this PR's tests or of MLX's it fixes"
                if kind == "tests"
                else "holds no fact a reviewer can rerun (a build whose tests did not run)"
            )
            notes.append(f"{entry['file']}: {why}; left out of the body")
            continue
        found.append(
            {
                "title": entry["title"],
                "lines": lines,
                "source": entry["file"],
                "own_tests": own,
                "fixed_tests": fixed,
                "whole_file": kind == "build" and file_run_whole(data),
                "main_whole_file": kind == "tests" and stock_run_whole(data),
                # This PR's tests a tests page shows failing on stock and passing here.
                "own_fail_on_stock": fail_on_stock_only(data, own_tests) if kind == "tests" else [],
                # And those it shows passing on both (a new test of what main already does).
                "own_pass_on_stock": pass_on_both(data, own_tests) if kind == "tests" else [],
                "calls": speed_calls(data) if kind == "speed" else None,
                # Cells at M = 8..16 where stock's qmm is faster (None: not a speed page).
                "qmm_faster": len(qmm_band_cells(data)[1]) if kind == "speed" else None,
                # What the page says of the route at M = 8..16, in one line.
                "route": route_line(data) if kind == "speed" else None,
                # The cells those lines count, as tables under the result's lines.
                "tables": speed_tables(data) if kind == "speed" else [],
                # The M of 2..16 a speed page did not time, owed in "Still to measure".
                "untimed_ms": untimed_ms(data) if kind == "speed" else None,
                "untimed_layers": untimed_layers(data) if kind == "speed" else None,
                # The layers (K x N) a speed page timed: the benchmark command takes them.
                "layers": speed_layers(data) if kind == "speed" else [],
            }
        )
    said_once(found)
    return found, notes


def owed_by_all(lists: list[list[str]]) -> list[str]:
    """The items every list holds, in the first list's order: what no page measured."""
    return [item for item in lists[0] if all(item in each for each in lists[1:])] if lists else []


def file_run_whole(data: dict) -> bool:
    """Whether a build record's run of MLX's test file took every method to its end."""
    tests = data.get("tests") or {}
    return bool(tests.get("ran")) and tests.get("unfinished") == []


def stock_run_whole(data: dict) -> bool:
    """Whether a tests page (``bench/mlx_tests.py``) ran every method of MLX's test file on
    stock MLX to its end: no methods picked (``--only``), none cut off by its deadline."""
    stock = (data.get("arms") or {}).get("stock") or {}
    picked = data.get("only") or data.get("only_failed_in_build")
    return bool(stock) and not picked and all(map(ran_to_end, stock.values()))


def _with_verdicts(data: dict, methods: Sequence[str], pr: str, stock: str) -> list[str]:
    """Those of ``methods`` whose verdict on a tests page is ``pr`` on the build and
    ``stock`` on stock (a method an arm did not run has none)."""
    arms = data.get("arms") or {}

    def verdict(arm: str, method: str) -> str | None:
        return ((arms.get(arm) or {}).get(method) or {}).get("verdict")

    return [m for m in methods if verdict("pr", m) == pr and verdict("stock", m) == stock]


def fail_on_stock_only(data: dict, methods: Sequence[str]) -> list[str]:
    """Those of ``methods`` a tests page shows failing on stock and passing on the build:
    new tests shown failing on main's code (stock's wheels of the pin's sources)."""
    return _with_verdicts(data, methods, pr="ok", stock="FAILED")


def pass_on_both(data: dict, methods: Sequence[str]) -> list[str]:
    """Those of ``methods`` a tests page shows passing on stock and on the build: new tests
    of what main's code already does (stock's wheels of the pin's sources)."""
    return _with_verdicts(data, methods, pr="ok", stock="ok")


def template_has_description(template: str) -> bool:
    """Whether upstream's PR template has its own place for the description."""
    return re.search(r"^#+\s*(Proposed changes|Description)", template, re.M | re.I) is not None


def body_context(
    backend: str,
    base: str,
    branch: str,
    template: str,
    facts: dict[str, object],
    results: list[dict],
    carries: list[dict[str, str]] | None = None,
    upstream_base: str | None = None,
    change_text: str = "",
    bench_on_branch: bool = False,
    stacked_on: list[dict[str, str]] | None = None,
    records_commit: str = "",
) -> dict[str, object]:
    """Everything the body template states, each value computed or read, none written here.
    ``records_commit``: the MLX commit the checkout's records are built on (the pin)."""
    return {
        "notice": DRAFT_NOTICE,
        "backend": backend,
        "change_facts": change_text,
        "base": base,
        "branch": branch,
        "template": template,
        "template_has_description": template_has_description(template),
        "files": facts["numstat"],
        "tests": facts["tests"],
        "test_file": facts["test_file"],
        "benchmarks": facts["benchmarks"],
        "env_vars": facts["env_vars"],
        "results": results,
        # Whether a build record shows every new test of this PR passing.
        "tests_shown_passing": shown_passing(results, "own_tests"),
        # Whether a build record shows every MLX test this PR fixes passing.
        "fixed_tests_shown_passing": shown_passing(results, "fixed_tests"),
        # Whether a build record ran every method of MLX's test file to its end.
        "test_file_run_whole": any(r.get("whole_file") for r in results),
        # Whether a tests page ran every method of that file to its end on stock (main).
        "main_run_whole": any(r.get("main_whole_file") for r in results),
        # The quoted speed pages' layers, for the benchmark command (main against the PR).
        "speed_layers": list(dict.fromkeys(x for r in results for x in r.get("layers") or ())),
        "own_shown_failing_on_stock": sorted(
            {t for r in results for t in r.get("own_fail_on_stock") or ()}
        ),
        "own_shown_passing_on_stock": sorted(
            {t for r in results for t in r.get("own_pass_on_stock") or ()}
        ),
        # Whether the speed quoted timed independent calls (overlapped by MLX's graph).
        "speed_calls_independent": any(r.get("calls") == "independent" for r in results),
        # Whether a speed page is quoted, and whether it has stock's qmm faster somewhere.
        "speed_quoted": any(r.get("qmm_faster") is not None for r in results),
        "speed_calls_chained": any(r.get("calls") == "chained" for r in results),
        # The M up to 16 the quoted speed page left untimed, owed in "Still to measure".
        "speed_untimed_ms": sorted({m for r in results for m in r.get("untimed_ms") or []}),
        # Kinds of layer no quoted speed page timed (owed only while every page leaves them).
        "speed_untimed_layers": owed_by_all(
            [r["untimed_layers"] for r in results if r.get("untimed_layers") is not None]
        ),
        "qmm_faster_somewhere": any(r.get("qmm_faster") for r in results),
        # One line a speed page, for the route section.
        "route_lines": [r["route"] for r in results if r.get("route")],
        # Commits of the changes this PR builds on, carried before its own.
        "carries": carries or [],
        # Commits of earlier PRs the base holds (a stacked export), not in upstream's main.
        "stacked_on": stacked_on or [],
        # The changes this one builds on (render.REQUIRES): the only PRs it depends on.
        "builds_on": list(render.REQUIRES.get(backend, ())),
        "bench_file": BENCH_FILE,
        # Whether the branch holds the script without adding it (stacked on the Metal PR).
        "bench_on_branch": bench_on_branch,
        "metal_branch": DEFAULT_BRANCHES["metal"],
        "qmm_sm90_branch": DEFAULT_BRANCHES["qmm-sm90"],
        # The series' branches, this PR's as exported (its --branch), the others' defaults.
        "series_branches": [branch if b == backend else d for b, d in DEFAULT_BRANCHES.items()],
        # The upstream commit under the PR (below any earlier PR of a stack): "main".
        "upstream_base": upstream_base or base,
        # Whether the records were built on another commit than that (a PR onto main), or
        # on one the checkout does not name (no pin file): the body then says so.
        "records_commit": records_commit,
        "records_elsewhere": not records_commit
        or not (upstream_base or base).startswith(records_commit),
    }


def render_body(templates_dir: Path, context: dict[str, object]) -> str:
    """The PR body from ``templates/pr/body.md.j2``."""
    return render.environment(templates_dir).get_template(BODY_TEMPLATE).render(**context)


# --- the command ----------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """export-pr's arguments, checked (see :func:`check_request`)."""

    backend: str
    branch: str
    title: str | None
    author: tuple[str, str]
    push: str | None
    out: Path | None
    force: bool


def check_request(
    root: Path,
    *,
    backend: str,
    branch: str | None,
    title: str | None,
    author: str | tuple[str, str] | None,
    push: str | None,
    out_dir: Path | None,
    mlx_repo: str | None,
    force: bool,
) -> Request:
    """Every argument checked before any work: the first bad one is one UserError."""
    backend = check_backend(backend)
    branch = check_branch(DEFAULT_BRANCHES[backend] if branch is None else branch)
    title = None if title is None else check_title(title)
    if isinstance(author, str):
        author = parse_author(author)
    return Request(
        backend=backend,
        branch=branch,
        title=title,
        author=resolve_author(identity_repos(root, mlx_repo), author),
        push=push_target(push) if push is not None else None,
        out=check_out_dir(out_dir) if out_dir is not None else None,
        force=force,
    )


def export_pr(
    *,
    root: Path,
    backend: str = DEFAULT_BACKEND,
    onto: str | None = None,
    branch: str | None = None,
    title: str | None = None,
    push: str | None = None,
    out_dir: Path | None = None,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = PR_OPTIONS,
    author: str | tuple[str, str] | None = None,
    force: bool = False,
    date: str | None = None,
    install_formatters: bool = False,
    stacked: bool = False,
    progress: source.Progress = source._quiet,
) -> PrResult:
    """Build one backend's PR branch, its patches and the body; see the module doc.

    ``author`` defaults to the user's git identity; ``date`` to now. A change that builds on
    another (Metal on the JIT fix) carries it as a first commit where the base lacks it,
    unless ``stacked`` says the base must hold it.
    """
    req = check_request(
        root,
        backend=backend,
        branch=branch,
        title=title,
        author=author,
        push=push,
        out_dir=out_dir,
        mlx_repo=mlx_repo,
        force=force,
    )
    clone = source.open_source(mlx_repo, progress=progress)
    for stale in prune_worktrees(clone):
        progress(f"removed {stale.name}, left by an interrupted export-pr")
    branch_may_move(clone, req.branch, req.force)
    base = source.resolve(clone, onto, progress=progress) if onto else default_base(clone, progress)
    read = optional_reader(clone, base)
    wanted = formatter_versions(read(PRECOMMIT) or "")
    tools = ensure_formatters(wanted, install_formatters)
    changes = changes_onto(read, req.backend, options, templates_dir, stacked)
    head, files, reformatted = base, [], []
    carries: list[dict[str, str]] = []  # the commits before the PR's own
    for change in changes:
        if head != base:
            carries.append({"subject": git.subject(clone, head), "commit": head})
        progress(f"rendering the {change} change onto {head[:8]}; formatting and committing")
        here = optional_reader(clone, head)
        upstream, patched = render_pr(here, backend_options(change, options), templates_dir)
        check_scope(change, [p for p in patched if patched[p] != upstream[p]])
        message = commit_message(req.title if change == req.backend else None, change)
        own_base = head
        head, files, reformatted = commit_pr(
            clone, head, upstream, patched, message, req.author, date=date or now_iso(),
            tools=tools,
        )  # fmt: skip
    facts = diff_facts(clone, own_base, head)
    results, notes = measured_results(root, templates_dir, req.backend, facts["tests"])
    notes = scope_warnings(req.backend, facts) + notes
    if req.title is None or carries:
        notes.append(
            "commit messages are placeholders: write your own before pushing "
            "(git commit --amend; git rebase -i for the carried commits)"
        )
    upstream = upstream_below(clone, base)
    context = body_context(
        req.backend, base, req.branch, read(PR_TEMPLATE) or "", facts, results, carries,
        upstream, change_facts(templates_dir, req.backend),
        git.blob_id(clone, head, BENCH_FILE) is not None, stacked_commits(clone, base, upstream),
        pinned.commit if (pinned := checkout_pin(root)) else "",
    )  # fmt: skip
    out = req.out or fresh_out_dir(root / "build" / "pr", f"{req.backend}-{base[:8]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in prune_stages(out.parent):
        progress(f"removed {stale}, left by an interrupted export-pr")
    with staging(out) as stage:
        patches = format_patch(clone, base, head, stage, len(changes))
        progress("checking the patches with git am")
        verify_am(clone, base, patches, head)
        (stage / BODY_FILE).write_text(render_body(templates_dir, context))
    create_branch(clone, req.branch, head, req.force)
    pushed = push_branch(clone, req.push, req.branch, head) if req.push else None
    return PrResult(
        repository=clone,
        backend=req.backend,
        branch=req.branch,
        commit=head,
        base=base,
        files=files,
        patch=out / patches[-1].name,
        body=out / BODY_FILE,
        formatters=wanted,
        author=req.author,
        reformatted=reformatted,
        pushed=pushed,
        warnings=notes,
        changes=changes,
        patches=[out / p.name for p in patches],
    )
