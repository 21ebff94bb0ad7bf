"""MLX's configure-time downloads, made local: an offline build's dependency directory.

MLX's CMake fetches its third-party sources from GitHub at configure time
(``FetchContent_Declare``). Machines without GitHub, and air-gapped users, hand
CMake a local copy instead through ``FETCHCONTENT_SOURCE_DIR_<NAME>``. This
module owns that hand-over:

- :func:`declared` reads which sources the pinned tree asks for, and at which tag,
  from the tree's own CMake files, so a pin bump that moves a dependency is seen
  rather than remembered;
- :func:`fill` exports each one from a local git clone of its repository into the
  dependency directory (one folder per FetchContent name, stamped with its source
  and tag; all or nothing), and :func:`resolve` turns that directory into CMake
  arguments, or a one-line error naming what is missing or stale.

Only offline builds read it (``patchkit build --offline``); online, MLX's CMake
fetches the same sources itself.

Third-party sources live in the cache's ``deps`` folder, never in this repository.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from patchkit.errors import UserError
from patchkit.util import cache, git, staging

STAMP = ".patchkit-source"

# Where each backend's FetchContent calls live in MLX's tree.
CMAKE_FILES = {
    "cpu": ("CMakeLists.txt", "mlx/io/CMakeLists.txt"),
    "cuda": ("CMakeLists.txt", "mlx/io/CMakeLists.txt", "mlx/backend/cuda/CMakeLists.txt"),
    "metal": ("CMakeLists.txt", "mlx/io/CMakeLists.txt"),
}
# Declared only for a platform the offline build does not target (Windows, macOS-only
# downloads that MLX's hosted macOS CI fetches itself), so never required here.
NOT_OFFLINE = {"dlfcn-win32", "metal_cpp", "openblas"}
# Git submodules a dependency's release archive carries but its tag's tree only points at.
SUBMODULES = {"nanobind": {"ext/robin_map": "Tessil/robin-map"}}

_DECLARE = re.compile(r"FetchContent_Declare\(\s*([\w-]+)(.*?)\)", re.S)
_GITHUB = re.compile(r"github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?(?:/|$)")


@dataclass(frozen=True)
class Dependency:
    """One ``FetchContent_Declare``: its CMake name and where upstream fetches it from."""

    name: str
    repo: str  # "owner/name" on GitHub
    tag: str  # git tag or commit; for release archives, the release's tag
    archive: bool  # fetched as a release archive (URL) rather than a git checkout
    subdir: str = ""  # SOURCE_SUBDIR: the only part of the tree CMake reads

    @property
    def cmake_var(self) -> str:
        return "FETCHCONTENT_SOURCE_DIR_" + self.name.upper().replace("-", "_")

    @property
    def stamp(self) -> str:
        return f"{self.repo} {self.tag}\n"


def deps_root() -> Path:
    """The dependency directory: the cache's ``deps`` folder (``--deps`` picks another)."""
    return cache.folder("deps")


def parse_declarations(cmake_text: str) -> list[Dependency]:
    """Every GitHub-hosted ``FetchContent_Declare`` in one CMake file's text."""
    found = []
    for m in _DECLARE.finditer(cmake_text):
        name, body = m.group(1), m.group(2)
        url = re.search(r"\b(?:GIT_REPOSITORY|URL)\s+\"?([^\s\")]+)", body)
        gh = _GITHUB.search(url.group(1)) if url else None
        if gh is None:
            continue
        tag = re.search(r"\bGIT_TAG\s+([^\s)]+)", body)
        release = re.search(r"/releases/download/([^/]+)/", url.group(1))
        if tag is None and release is None:
            continue
        subdir = re.search(r"\bSOURCE_SUBDIR\s+([^\s)]+)", body)
        found.append(
            Dependency(
                name=name,
                repo=f"{gh.group(1)}/{gh.group(2)}",
                tag=tag.group(1) if tag else release.group(1),
                archive=tag is None,
                subdir=subdir.group(1) if subdir else "",
            )
        )
    return found


def declared(read: Callable[[str], str], backend: str) -> list[Dependency]:
    """What the tree's CMake files fetch for ``backend`` (``read`` returns a file's text)."""
    seen: dict[str, Dependency] = {}
    for path in CMAKE_FILES[backend]:
        for dep in parse_declarations(read(path)):
            if dep.name not in NOT_OFFLINE:
                seen.setdefault(dep.name, dep)
    return list(seen.values())


def resolve(deps: Iterable[Dependency], root: Path) -> dict[str, Path]:
    """Each dependency's folder under ``root``; UserError naming the missing or stale ones."""
    missing, stale, found = [], [], {}
    for dep in deps:
        folder = root / dep.name
        stamp = folder / STAMP
        if not stamp.is_file():
            missing.append(f"{dep.name} ({dep.repo} {dep.tag})")
        elif _stamp_source(stamp) != dep.stamp:
            stale.append(f"{dep.name} (have {_stamp_source(stamp).strip()}, need {dep.tag})")
        else:
            found[dep.name] = folder
    if missing or stale:
        what = "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else [])
            + ([f"stale {', '.join(stale)}"] if stale else [])
        )
        raise UserError(
            f"dependency directory {root}: {what}; fill it with "
            "`patchkit deps --from DIR` (local git clones) or pass --deps DIR"
        )
    return found


def _stamp_source(stamp: Path) -> str:
    """The stamp's first line (``owner/name tag``); a second line records a substitution."""
    return stamp.read_text().splitlines(keepends=True)[0]


def stamps(folders: dict[str, Path]) -> dict[str, str]:
    """Each folder's stamp, one line (``owner/name tag[, exported from REV]``), for records."""
    return {
        name: ", ".join((folder / STAMP).read_text().split("\n")).strip(", ")
        for name, folder in folders.items()
    }


def cmake_args(deps: Iterable[Dependency], folders: dict[str, Path]) -> list[str]:
    """CMake arguments that make every fetch local and forbid the rest from going online."""
    args = ["-DFETCHCONTENT_FULLY_DISCONNECTED=ON"]
    args += [f"-D{d.cmake_var}={folders[d.name]}" for d in deps]
    return args


def find_clone(repo: str, search: Path) -> Path:
    """A local git clone of ``owner/name`` under ``search``, in any of the usual layouts."""
    owner, name = repo.split("/")
    for candidate in (
        search / f"{owner}+{name}" / "repo",  # one folder per owner+name, clone inside
        search / f"{owner}+{name}",
        search / owner / f"{name}.git",
        search / owner / name,
        search / f"{name}.git",
        search / name,
    ):
        if candidate.is_dir() and git.try_rev_parse(candidate, "HEAD^{commit}") is not None:
            return candidate
    raise UserError(f"no git clone of {repo} under {search} (looked for {owner}+{name}/, {name}/)")


def _export(clone: Path, rev: str, dest: Path, subdir: str = "") -> None:
    """Write the tree of ``rev`` (only ``subdir`` and the licence, when given) into ``dest``.

    Exporting only what CMake reads also keeps a partial clone usable, one whose
    large media blobs were never fetched.
    """
    paths = [subdir, *_licences(clone, rev)] if subdir else []
    git.export(clone, rev, dest, paths)


def _licences(clone: Path, rev: str) -> list[str]:
    """Top-level licence files of ``rev``'s tree."""
    names = [e.path for e in git.ls_tree(clone, rev)]
    return [n for n in names if n.upper().startswith(("LICENSE", "COPYING"))]


def _submodule_commit(clone: Path, rev: str, path: str) -> str:
    """The commit a tag's tree records for the submodule at ``path``."""
    entries = git.ls_tree(clone, rev, [path])
    if not entries:
        raise UserError(f"{clone} at {rev} has no submodule {path}")
    return entries[0].id


def _release_layout(name: str, tree: Path) -> None:
    """Rearrange a tag's tree into the release archive's layout where the two differ.

    CCCL's release archive puts cub, thrust and libcudacxx under one ``include/``
    (MLX reads ``${cccl_SOURCE_DIR}/include``); the git tree keeps them apart.
    """
    if name != "cccl":
        return
    include = tree / "include"
    include.mkdir(exist_ok=True)
    for src in (tree / "cub" / "cub", tree / "thrust" / "thrust"):
        shutil.move(str(src), include / src.name)
    for entry in (tree / "libcudacxx" / "include").iterdir():
        shutil.move(str(entry), include / entry.name)
    # The archive holds headers only; the tree's root CMakeLists.txt would make
    # FetchContent_MakeAvailable configure all of CCCL's own project.
    for entry in tree.iterdir():
        if entry.name != "include" and not entry.name.startswith("LICENSE"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _current(root: Path, dep: Dependency, stamp: str) -> bool:
    """Whether ``root`` already holds ``dep`` exported as ``stamp`` says."""
    current = root / dep.name / STAMP
    return current.is_file() and current.read_text() == stamp


def fill(
    deps: list[Dependency],
    search: Path,
    root: Path,
    progress: Callable[[str], None] = lambda _: None,
    revs: dict[str, str] | None = None,
) -> list[str]:
    """Export each dependency from its clone under ``search`` into ``root``; returns the names.

    ``revs`` substitutes another revision for a dependency whose tag the local
    clone lacks (a partial mirror); the stamp records the substitution, and
    build records carry the stamps. All or nothing: every clone and revision is
    found first (one error names every problem), then everything is exported into
    one staging folder beside the final ones and renamed into place only when all
    exports succeeded, so a failure leaves the directory as it was.
    """
    revs = revs or {}
    unknown = sorted(set(revs) - {d.name for d in deps})
    if unknown:
        raise UserError(f"--rev names no declared dependency: {', '.join(unknown)}")
    todo = []
    for dep in deps:
        rev = revs.get(dep.name, dep.tag)
        stamp = dep.stamp + (f"exported from {rev}\n" if rev != dep.tag else "")
        if not _current(root, dep, stamp):
            todo.append((dep, rev, stamp))
    sources = _sources(todo, search)
    if not todo:
        return []
    root.mkdir(parents=True, exist_ok=True)
    # One filler at a time: a second waits, then finds the stamps current.
    with staging.exclusive(
        root.parent / f"{root.name}.lock",
        on_wait=lambda: progress(f"waiting for another patchkit run filling {root}"),
    ):
        return _fill_locked(todo, sources, search, root, progress)


def _fill_locked(
    todo: list[tuple[Dependency, str, str]],
    sources: dict[str, Path],
    search: Path,
    root: Path,
    progress: Callable[[str], None],
) -> list[str]:
    """:func:`fill` under the directory's lock: export into one stage, rename into place."""
    todo = [(d, r, s) for d, r, s in todo if not _current(root, d, s)]
    if not todo:
        return []
    stage = Path(tempfile.mkdtemp(prefix=".stage-", dir=root))
    try:
        for dep, rev, stamp in todo:
            progress(f"exporting {dep.repo} {rev}")
            out = stage / dep.name
            _export(sources[dep.name], rev, out, dep.subdir)
            for path, sub_repo in SUBMODULES.get(dep.name, {}).items():
                commit = _submodule_commit(sources[dep.name], rev, path)
                _export(find_clone(sub_repo, search), commit, out / path)
            _release_layout(dep.name, out)
            (out / STAMP).write_text(stamp)
        for dep, _, _ in todo:  # every export succeeded: swap each folder in
            if (root / dep.name).exists():
                shutil.rmtree(root / dep.name)
            (stage / dep.name).rename(root / dep.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return [dep.name for dep, _, _ in todo]


def _sources(todo: list[tuple[Dependency, str, str]], search: Path) -> dict[str, Path]:
    """Each dependency's clone, checked to hold its revision; one error naming every problem."""
    found, problems = {}, []
    for dep, rev, _ in todo:
        try:
            clone = find_clone(dep.repo, search)
        except UserError as exc:
            problems.append(str(exc))
            continue
        if git.try_rev_parse(clone, rev) is None:
            problems.append(
                f"{clone} has no {rev} (needed for {dep.name}); fetch it, or substitute a "
                f"revision the clone has with --rev {dep.name}=REV"
            )
        found[dep.name] = clone
    if problems:
        raise UserError("; ".join(problems) + "; nothing was exported")
    return found
