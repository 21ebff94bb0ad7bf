"""``patchkit export-pr``: one upstream-ready commit for ml-explore/mlx, plus a draft PR body.

Flow: resolve the base (the pin, or ``--onto REV``) in the cached clone ->
render the kernel, instantiations and dispatch with :func:`workspace.render_all`
(the same templates and code path the overlay comes from) and the test and
benchmark files from the ``backend = "pr"`` plans via :mod:`patchkit.carry.pyedit`
-> write them in a fresh worktree -> format with the formatter versions the
base's ``.pre-commit-config.yaml`` names and verify a second pass changes nothing
-> commit once -> branch -> ``git format-patch`` -> prove it applies to the base
with ``git am`` and rebuilds the same tree -> render the PR body draft.

Scope by default: Metal only. The test asserts what the Metal change delivers;
CUDA is being measured separately and can join with ``--backend cuda``.

MLX's contribution policy asks that humans write PR descriptions (and, from
057cdc9e on, commit messages) and disclose AI use, so the commit carries only a
title and the PR body is a DRAFT of facts for the submitter to rewrite. This
module never pushes unless ``push`` names a remote explicitly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.carry import pin, render, source, workspace
from patchkit.errors import AnchorError, ToolError, UserError
from patchkit.util import git

PR_BACKEND = "pr"
DEFAULT_TITLE = "Add order-preserving streamed qmv for small batches"
DEFAULT_BRANCH = "order-preserving-qmv"
DEFAULT_BACKENDS = ("metal",)
PR_OPTIONS = render.RenderOptions(DEFAULT_BACKENDS)
# Largest M the test asserts: the smallest qmv batch limit for K, N <= 2048 on any
# Apple GPU generation is 13, and M >= limit goes to qmm, which sums differently.
TEST_MAX_M = 12
# Benchmark shapes (K x N) the PR body names: a 4096-wide model's attention and MLP
# projections, the sizes a speculative-decoding verify forward runs at small M.
BENCH_SIZES = ((4096, 4096), (4096, 14336), (14336, 4096))
BODY_TEMPLATE = "pr/body.md.j2"
PR_TEMPLATE = ".github/pull_request_template.md"
CHECKLIST_HEADING = "## Checklist"
PRECOMMIT = ".pre-commit-config.yaml"
CXX_SUFFIXES = (".h", ".cpp", ".metal", ".cu", ".cuh")
# Formatter hooks of MLX's .pre-commit-config.yaml: repo URL fragment -> PyPI name.
FORMATTERS = {
    "mirrors-clang-format": "clang-format",
    "black-pre-commit-mirror": "black",
    "pycqa/isort": "isort",
}
DRAFT_NOTICE = (
    "DRAFT for the submitter to rewrite in their own words: MLX's CONTRIBUTING forbids"
    " AI-written PR descriptions and asks contributors to disclose AI use."
)

Read = Callable[[str], "str | None"]


class NoGitIdentityWarning(UserWarning):
    """No git user.name/user.email is set: the PR commit falls back to patchkit's identity."""


@dataclass
class PrResult:
    """What export-pr did, for the CLI and ``--json``."""

    repository: Path
    branch: str
    commit: str
    base: str
    files: list[str]
    patch: Path
    body: Path
    formatters: dict[str, str]
    reformatted: list[str] = field(default_factory=list)
    pushed: str | None = None
    author: tuple[str, str] = git.FIXED_AUTHOR
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        """A JSON-friendly summary (repository path, branch and commit first)."""
        return {
            "clone": str(self.repository),
            "branch": self.branch,
            "commit": self.commit,
            "base": self.base,
            "files": self.files,
            "patch": str(self.patch),
            "body": str(self.body),
            "body_is_draft": True,
            "formatters": self.formatters,
            "reformatted": self.reformatted,
            "pushed": self.pushed,
            "author": f"{self.author[0]} <{self.author[1]}>",
            "warnings": self.warnings,
        }


def pr_plans(templates_dir: Path) -> list[render.FilePlan]:
    """The plans only the PR carries (tests, benchmarks): ``backend = "pr"`` in edits.toml."""
    return [p for p in render.load_plans(templates_dir) if p.backend == PR_BACKEND]


def pr_context(options: render.RenderOptions) -> dict[str, object]:
    """Jinja context for the PR-only snippets: which backends the PR covers, test bounds."""
    return {
        "backends": list(options.backends),
        "routing": options.routing,
        "flavour": "upstream",
        "max_m": TEST_MAX_M,
        "bench_sizes": ",".join(f"{k}x{n}" for k, n in BENCH_SIZES),
    }


def render_pr_file(plan: render.FilePlan, text: str | None, options: render.RenderOptions) -> str:
    """Patched text of one PR-only file (``text`` is None for a file new upstream)."""
    try:
        return render.render_file(plan, text, options, pr_context(options))
    except AnchorError as exc:
        raise AnchorError(f"{plan.path}: {exc}") from exc


def render_pr(
    read: Read, options: render.RenderOptions, templates_dir: Path
) -> tuple[dict[str, str | None], dict[str, str]]:
    """(upstream texts, patched texts) of every file in the PR, kernel files first.

    Kernel, instantiations and dispatch come from :func:`workspace.render_all` in
    the upstream flavour, the function the overlay export also renders with.
    """

    def must_read(path: str) -> str:
        text = read(path)
        if text is None:
            raise UserError(f"{path} does not exist in the base tree; is this an MLX tree?")
        return text

    upstream_opts = dataclasses.replace(options, flavour="upstream")
    core = workspace.render_all(must_read, upstream_opts, templates_dir)
    upstream: dict[str, str | None] = dict(core.upstream)
    patched = dict(core.patched)
    for plan in pr_plans(templates_dir):
        upstream[plan.path] = read(plan.path)
        patched[plan.path] = render_pr_file(plan, upstream[plan.path], options)
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
    return source.cache_root() / "tools" / f"formatters-{key}"


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
        _pip_step([sys.executable, "-m", "venv", str(venv)])
    _pip_step([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *specs])
    return ensure_formatters(wanted, install=False)


def _pip_step(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ToolError(cmd, proc.returncode, proc.stdout, proc.stderr)


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
        proc = subprocess.run(cmd, cwd=worktree, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ToolError(cmd, proc.returncode, proc.stdout, proc.stderr)


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


def commit_pr(
    clone: Path,
    base: str,
    upstream: dict[str, str | None],
    patched: dict[str, str],
    title: str,
    author: tuple[str, str],
    tools: dict[str, str] | None = None,
) -> tuple[str, list[str], list[str]]:
    """One formatted commit on ``base`` in a fresh worktree; return (commit, files, reformatted)."""
    with source.worktree(clone, base) as wt:
        changed, reformatted = write_and_format(wt, upstream, patched, tools)
        if not changed:
            raise UserError(f"the templates change nothing at {base[:8]}; nothing to export")
        git.add(wt, changed)
        head = git.commit(wt, title + "\n", date=git.commit_date(clone, base), author=author)
    return head, changed, reformatted


def verify_am(clone: Path, base: str, patch: Path, head: str) -> None:
    """Apply ``patch`` to ``base`` with plain ``git am`` and require the tree of ``head``.

    This is what a reviewer's ``git am`` / GitHub's merge does with the patch;
    a mismatch would mean the format-patch output lost something.
    """
    with source.worktree(clone, base, base_ref="refs/patchkit/pr-am-base") as wt:
        got = git.tree_id(wt, git.am(wt, [patch]))
    want = git.tree_id(clone, head)
    if got != want:
        raise UserError(f"{patch} applied with git am gives tree {got}, not {want}")


def format_patch(clone: Path, base: str, head: str, out_dir: Path) -> Path:
    """``git format-patch`` of the single commit into ``out_dir``; return the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.patch"):
        old.unlink()
    files = git.format_patch(clone, base, head, out_dir)
    if len(files) != 1:
        raise UserError(f"expected one commit between {base[:8]} and {head[:8]}, got {len(files)}")
    return files[0]


def render_body(templates_dir: Path, context: dict[str, object]) -> str:
    """The PR body draft from ``templates/pr/body.md.j2``."""
    return render.environment(templates_dir).get_template(BODY_TEMPLATE).render(**context)


def template_sections(template: str) -> tuple[str, str]:
    """(what precedes upstream's ``## Checklist``, the checklist section verbatim).

    The body fills the template's first section with the draft and keeps the
    checklist as upstream wrote it; without that heading, the whole template is
    carried as the second part.
    """
    at = template.find(CHECKLIST_HEADING)
    if at < 0:
        return "", template
    return template[:at], template[at:]


def body_context(
    root: Path, read: Read, base: str, files: list[str], options: render.RenderOptions
) -> dict[str, object]:
    """Facts the body draft states: base, files, scope, routing, upstream template's checklist."""
    _, checklist = template_sections(read(PR_TEMPLATE) or "")
    return {
        "notice": DRAFT_NOTICE,
        "base": base,
        "pin": base == _pinned(root),
        "files": files,
        "backends": list(options.backends),
        "routing": options.routing,
        "max_m": TEST_MAX_M,
        "bench_sizes": [f"{k}x{n}" for k, n in BENCH_SIZES],
        "pr_checklist": checklist,
    }


def _pinned(root: Path) -> str | None:
    path = root / pin.PIN_FILE
    return pin.load(path).commit if path.exists() else None


def resolve_author(root: Path, author: tuple[str, str] | None) -> tuple[tuple[str, str], list[str]]:
    """The commit author: ``author`` if given, else the user's git identity, else
    patchkit's fixed identity with a warning (the PR must carry the submitter's name)."""
    if author is not None:
        return author, []
    ident = git.user_identity(root)
    if ident is not None:
        return ident, []
    msg = (
        "no git user.name/user.email is set; the PR commit is authored by"
        f" {git.FIXED_AUTHOR[0]} <{git.FIXED_AUTHOR[1]}>. Set your identity"
        " (git config --global user.name/user.email) or pass an author."
    )
    warnings.warn(msg, NoGitIdentityWarning, stacklevel=3)
    return git.FIXED_AUTHOR, [msg]


def push_target(remote: str) -> str:
    """``remote`` as something patchkit's own clone can push to: a URL or a path.

    The branch lives in patchkit's cached clone, which knows none of the user's
    remote names; a bare name would fail inside git with a confusing message.
    """
    if "://" in remote or remote.startswith("git@") or Path(remote).expanduser().exists():
        return str(Path(remote).expanduser()) if Path(remote).expanduser().exists() else remote
    raise UserError(
        f"--push {remote}: give a URL or a path (the branch is pushed from patchkit's own "
        f"clone, which has no remote named {remote!r}), e.g. git@github.com:YOU/mlx.git"
    )


def push_branch(clone: Path, remote: str, branch: str, head: str) -> str:
    """Push ``head`` to ``remote`` as ``branch`` (only ever a remote the user named)."""
    git.push(clone, remote, f"{head}:refs/heads/{branch}")
    return remote


def export_pr(
    *,
    root: Path,
    onto: str | None = None,
    branch: str = DEFAULT_BRANCH,
    title: str = DEFAULT_TITLE,
    push: str | None = None,
    out_dir: Path | None = None,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = PR_OPTIONS,
    author: tuple[str, str] | None = None,
    install_formatters: bool = False,
    progress: source.Progress = source._quiet,
) -> PrResult:
    """Build the PR branch, its patch and the body draft; see the module doc.

    ``author`` defaults to the user's git identity (see :func:`resolve_author`).
    """
    push = push_target(push) if push else None  # before any work: a bad target fails fast
    author, notes = resolve_author(root, author)
    pinned = _pinned(root)
    rev = onto or pinned
    if rev is None:
        raise UserError(f"no {pin.PIN_FILE} in {root}; pass --onto REV")
    clone = source.open_source(mlx_repo, progress=progress)
    base = source.resolve(clone, rev, progress=progress)
    read = optional_reader(clone, base)
    wanted = formatter_versions(read(PRECOMMIT) or "")
    tools = ensure_formatters(wanted, install_formatters)
    progress("rendering")
    upstream, patched = render_pr(read, options, templates_dir)
    progress("formatting and committing")
    head, files, reformatted = commit_pr(clone, base, upstream, patched, title, author, tools)
    git.branch_force(clone, branch, head)
    out = (out_dir or root / "build" / "pr" / base[:8]).resolve()
    patch = format_patch(clone, base, head, out)
    progress("checking the patch with git am")
    verify_am(clone, base, patch, head)
    body = out / "PR_BODY.draft.md"
    body.write_text(render_body(templates_dir, body_context(root, read, base, files, options)))
    pushed = push_branch(clone, push, branch, head) if push else None
    return PrResult(
        clone, branch, head, base, files, patch, body, wanted, reformatted, pushed, author, notes
    )
