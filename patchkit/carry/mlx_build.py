"""`patchkit build`: MLX's own build of the patched tree, in patchkit's own environment.

What it builds is what the upstream PR would merge: the ``patchkit/<pin>``
branch `patchkit apply` made (the kernel commits) with the PR's test and
benchmark files rendered on top. Where it builds and installs is patchkit's:

- a worktree of the cached clone under ``<cache>/builds/<backend>-<pin>/mlx``
  (never the user's checkout), reused so a rebuild is incremental;
- a virtual environment under ``<cache>/builds/<backend>-<pin>/venv``; the user's
  own environment is only read (to create the venv), never installed into or
  uninstalled from, unless ``--into`` names it;
- MLX's documented build with ``CMAKE_ARGS`` per backend, as a wheel whose version
  names the patch (``0.32.1+patchkit.<sha>``) in ``<cache>/builds/<backend>-<pin>/dist``.
  Online, MLX's CMake fetches its dependencies at MLX's own pins; offline, every
  configure-time download is replaced by a local source (:mod:`mlx_deps`).

Every environment step runs on every build (each is idempotent, and pip is fast when
satisfied), a broken venv is recreated, and a preflight checks the tools, system
libraries and Python packages every later step needs before the compile starts.
Then, in that environment: MLX's own ``python/tests/test_quantized.py`` (the
whole file, the PR's tests first) and ``patchkit parity`` on the fresh MLX.
:func:`plan` only reads; ``--dry-run`` prints it. :func:`execute` runs it with
every command's output in one log, and :func:`record` is the build record
(``docs/results/build-<backend>.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import unidiff
from packaging.requirements import Requirement

from patchkit.carry import export, mlx_deps, pin, pyedit, render, source, transaction
from patchkit.carry.commit import BRANCH_PREFIX
from patchkit.errors import ToolError, UserError
from patchkit.util import git, jit_pool, proc, split_unittest, staging
from patchkit.util.cache import folder as cache_folder

BACKENDS = ("metal", "cuda", "cpu")
# MLX docs/src/install.rst and setup.py (which reads CMAKE_ARGS) at the pin.
CMAKE_ARGS = {
    "metal": ["-DMLX_BUILD_METAL=ON"],
    "cuda": ["-DMLX_BUILD_CUDA=ON"],
    "cpu": ["-DMLX_BUILD_METAL=OFF"],
}
# What MLX's pyproject.toml asks for at build time (cmake comes from the system: the
# preflight checks its version), plus numpy for its tests. patchkit's own dependencies
# (pyproject.toml) join them: parity runs patchkit from the checkout in the build's venv.
BUILD_REQUIREMENTS = ("setuptools>=80", "wheel", "typing_extensions", "numpy")
# Modules the build and MLX's tests import in the venv, with the requirement that brings each.
# setuptools' bdist_wheel command moved into setuptools in 70.1; MLX's setup.py imports it.
VENV_MODULES = {
    "setuptools.command.bdist_wheel": "setuptools>=80",
    "wheel": "wheel",
    "typing_extensions": "typing_extensions",
    "numpy": "numpy",
}
# Import names whose distribution is named otherwise (for the preflight's install hint).
DISTRIBUTIONS = {"git": "GitPython", "yaml": "PyYAML", "jinja2": "Jinja2"}
# Where MLX's CMake downloads from when online (the preflight's network check).
FETCH_HOST = ("github.com", 443)
# MLX's setup.py names the version; the build puts the patch into it (a PEP 440 local
# version: it sorts with 0.32.1 and satisfies ==0.32.1 and >=0.32.1 in mlx-lm's pins).
SETUP_VERSION_LINE = "    version = get_version()\n"
TEST_FILE = "test_quantized"
# The PR-only files a build renders into its tree: every backend's tests (each skips itself
# where its backend is absent) and the benchmark.
PR_FILES_OPTIONS = render.RenderOptions(backends=("metal", "cuda"))
_NINJA = re.compile(r"^\s*\[(\d+)/(\d+)\]")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Layout:
    """Where one backend's build of one pin lives in patchkit's cache."""

    base: Path

    @property
    def worktree(self) -> Path:
        return self.base / "mlx"

    @property
    def venv(self) -> Path:
        return self.base / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def log(self) -> Path:
        return self.base / "build.log"

    @property
    def parity_json(self) -> Path:
        return self.base / "parity.json"

    @property
    def parity_default_json(self) -> Path:
        """Parity on the default route, where the claim route is another (CUDA)."""
        return self.base / "parity-default.json"

    @property
    def dist(self) -> Path:
        return self.base / "dist"

    def ptx_cache(self, version: str) -> Path:
        """MLX's CUDA JIT cache for one build (``MLX_PTX_CACHE_DIR``).

        MLX compiles its qmm kernels with NVRTC at first use, serially, 20 to 50 s each, and
        MLX's tests and parity reach dozens of them: kept beside the build, a second test or
        parity run of the same build starts warm. Per version, since another patch commit
        may change what MLX compiles at run time.
        """
        return self.base / "ptx" / version


def layout(
    backend: str, short: str, cache: Path | None = None, cmake_args: tuple[str, ...] = ()
) -> Layout:
    """The cache folders for ``backend`` at pin ``short``; a build with extra CMake arguments
    (``-DMLX_METAL_JIT=ON``, say) is another build, in its own folder beside the plain one."""
    name = f"{backend}-{short}"
    if cmake_args:
        name += "-" + hashlib.sha256("\0".join(cmake_args).encode()).hexdigest()[:8]
    return Layout((cache / "builds" if cache else cache_folder("builds")) / name)


@dataclass(frozen=True)
class Step:
    """One command of the build, with the stage it belongs to and why it is there."""

    stage: str
    why: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    ok_codes: tuple[int, ...] = (0,)

    def shell(self) -> str:
        """The step as one copy-pasteable shell line."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cd = f"cd {shlex.quote(str(self.cwd))} && "
        return cd + (env + " " if env else "") + shlex.join(self.argv)


@dataclass(frozen=True)
class BuildPlan:
    """Everything `patchkit build` will do, in order."""

    backend: str
    mlx_commit: str  # the pinned upstream commit
    patch_commit: str  # head of patchkit/<pin>: the commits the build contains
    clone: Path
    layout: Layout
    deps: dict[str, str]  # FetchContent name -> its stamp (source and revision)
    steps: list[Step]
    version: str = ""  # the wheel's version: MLX's own + the patch commit
    offline: bool = True  # dependencies from the dependency directory, not the network
    python: str = sys.executable  # the interpreter that creates the venv
    cmake_min: str = "3.25"  # MLX's cmake_minimum_required
    # Why interprocedural optimization is off (this compiler cannot link -flto), or "".
    no_lto: str = ""
    # The options a rerun repeats to get the same record (the record's "command").
    options: tuple[str, ...] = ()
    # The PR-only files (MLX's test, the benchmark) as rendered onto the patch commit:
    # rendered once, read by the plan (the PR's test methods) and written by the build.
    pr_files: dict[str, str] = field(default_factory=dict)

    @property
    def wheel_requirement(self) -> str:
        """The requirement that installs exactly this build's wheel."""
        return f"mlx=={self.version}"

    def wheel(self) -> Path | None:
        """The wheel this plan built, once it has."""
        found = sorted(self.layout.dist.glob(f"mlx-{self.version}-*.whl"))
        return found[-1] if found else None

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "mlx_commit": self.mlx_commit,
            "patch_commit": self.patch_commit,
            "clone": str(self.clone),
            "worktree": str(self.layout.worktree),
            "venv": str(self.layout.venv),
            "log": str(self.layout.log),
            "deps": self.deps,
            "offline": self.offline,
            "version": self.version,
            "dist": str(self.layout.dist),
            "preflight": preflight_checks(self),
            "no_lto": self.no_lto,
            "steps": [
                {"stage": s.stage, "why": s.why, "argv": s.argv, "cwd": str(s.cwd), "env": s.env}
                for s in self.steps
            ],
        }

    def describe(self) -> str:
        head = [
            f"# check out {self.patch_commit[:12]} in {self.layout.worktree}"
            " and render the PR's test and benchmark files into it",
            f"# setup.py's version: {self.version}",
            "# preflight: " + "; ".join(preflight_checks(self)),
        ]
        if self.no_lto:
            head.append(f"# {self.no_lto}")
        return "\n".join(head + [f"# [{s.stage}] {s.why}\n{s.shell()}" for s in self.steps])


def has_nvidia_gpu() -> bool:
    """Whether the driver lists a GPU (``nvidia-smi -L``), not whether a compiler exists."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = proc.run([smi, "-L"], check=False)
    return listed.returncode == 0 and "GPU " in listed.stdout


def detect_backend(system: str | None = None, gpu: bool | None = None) -> str:
    """Metal on macOS, CUDA where an NVIDIA GPU is present, else CPU."""
    system = system or platform.system()
    if system == "Darwin":
        return "metal"
    return "cuda" if (has_nvidia_gpu() if gpu is None else gpu) else "cpu"


def _base_has_mlx(python: str) -> bool:
    """Whether ``python`` can import mlx (then its packages must not leak into our venv)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('mlx') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True, check=False).returncode == 0


def _lent_sites(python: str) -> list[str]:
    """Folders the build's venv is pointed at by a .pth, so that parity finds numpy.

    ``venv --system-site-packages`` exposes the *base* installation's packages, not
    those of a venv ``python`` runs in itself (GPU hosts often ship PyTorch, numpy
    and cuDNN in such a venv), so those site folders are lent. So are the folders on
    ``PYTHONPATH`` (wheels carried to an offline host with ``pip install --target``) and
    the folder ``python`` imports numpy from, wherever that is: numpy may live in none of
    them, and then parity would fail only after the whole compile.
    """
    probe = (
        "import os, site, sys\n"
        "dirs = site.getsitepackages() if sys.prefix != sys.base_prefix else []\n"
        "paths = os.environ.get('PYTHONPATH', '').split(os.pathsep)\n"
        "dirs += [os.path.abspath(d) for d in paths if d]\n"
        "try:\n"
        "    import numpy\n"
        "    dirs.append(os.path.dirname(os.path.dirname(numpy.__file__)))\n"
        "except ImportError:\n"
        "    pass\n"
        "print('\\n'.join(dict.fromkeys(dirs)))"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if line.strip()]


PTH_WRITER = (
    "import pathlib, sys, sysconfig; "
    "pathlib.Path(sysconfig.get_paths()['purelib'], 'patchkit-parent-venv.pth')"
    ".write_text(sys.argv[1] + '\\n')"
)


def applied(
    root: Path, mlx_repo: str | None = None, cache: Path | None = None
) -> tuple[pin.Pin, Path, str]:
    """The pin, the cached clone and the head of its ``patchkit/<pin>`` branch, which must
    hold this checkout's series: what ``patchkit apply`` left for a build."""
    p = pin.load(root / pin.PIN_FILE)
    clone = source.clone_dir(source.source_spec(mlx_repo, p.url), cache)
    branch = BRANCH_PREFIX + p.short
    if not clone.exists() or (head := git.try_rev_parse(clone, branch)) is None:
        raise UserError(f"no branch {branch} in the cached clone; run `patchkit apply` first")
    if git.format_patch_text(clone, p.commit, head) != series_text(root, p.short):
        raise UserError(
            f"{branch} in the cached clone is not this checkout's patches/{p.short} "
            "(another patch was applied there); run `patchkit apply` first"
        )
    return p, clone, head


def write_pr_tests(
    root: Path, dest: Path, mlx_repo: str | None = None, cache: Path | None = None
) -> None:
    """MLX's ``python/tests`` into ``dest`` (new or empty) as a build's worktree holds them:
    the applied branch's tree with the PR's rendered test files. What stock MLX runs of
    the PR's tests needs no build of the PR (``bench/mlx_tests.py --patched-record``)."""
    _, clone, head = applied(root, mlx_repo, cache)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest} is not a new or empty folder")
    tests = "python/tests"
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Staged beside dest and renamed into place: a folder of tests is whole or absent.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
        git.export(clone, head, Path(tmp), [tests])
        for path, text in rendered_pr_files(root, clone, head).items():
            if path.startswith(tests + "/"):
                (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / path).write_text(text)
        if dest.exists():
            dest.rmdir()
        (Path(tmp) / tests).rename(dest)


def plan(
    root: Path,
    *,
    backend: str | None = None,
    mlx_repo: str | None = None,
    deps_dir: Path | None = None,
    offline: bool = False,
    python: str = sys.executable,
    jobs: int | None = None,
    cmake_args: tuple[str, ...] = (),
    system_site_packages: bool = False,
    cache: Path | None = None,
    run_tests: bool = True,
    test_timeout: int | None = None,
) -> BuildPlan:
    """The build's commands; reads the pin, the clone and the dependency folder, writes nothing.

    Online (the default) MLX's CMake fetches its dependencies at MLX's own pins; with
    ``offline`` (or a ``deps_dir``) every one comes from the dependency directory.
    """
    backend = backend or detect_backend()
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    p, clone, head = applied(root, mlx_repo, cache)
    read = source.reader(clone, head)
    pr_files = rendered_pr_files(root, clone, head)
    tests_path = f"python/tests/{TEST_FILE}.py"
    tests_text = pr_files.get(tests_path) or read(tests_path)
    own_tests = new_test_methods(source.reader(clone, p.commit)(tests_path), tests_text)
    declared = mlx_deps.declared(read, backend)
    offline = offline or deps_dir is not None
    if offline:
        folders = mlx_deps.resolve(declared, deps_dir or mlx_deps.deps_root())
        deps, fetch_args = mlx_deps.stamps(folders), mlx_deps.cmake_args(declared, folders)
    else:  # MLX's own FetchContent calls, untouched
        deps, fetch_args = (
            {d.name: f"{d.repo} {d.tag} (fetched by MLX's CMake)" for d in declared},
            [],
        )
    if system_site_packages and _base_has_mlx(python):
        raise UserError(
            f"{python} can import mlx, which would mix with the build in a venv that sees its "
            "packages; drop --system-site-packages or use an interpreter without MLX"
        )
    where = layout(backend, p.short, cache, cmake_args)
    sites = _lent_sites(python) if system_site_packages else []
    # The steps that import numpy also get the lent folders on PYTHONPATH, after patchkit's
    # checkout: the .pth alone has left numpy unimportable after the compile while the
    # check before it passed. No lent folder holds an mlx (_base_has_mlx above).
    version = f"{_mlx_version(read)}+patchkit.{head[:12]}"
    python_env = {"PYTHONPATH": os.pathsep.join([str(root), *sites])}
    if backend == "cuda":
        python_env["MLX_PTX_CACHE_DIR"] = str(where.ptx_cache(version))
    parity_env = {**python_env, **PARITY_ROUTE_ENV.get(backend, {})}
    no_lto = "" if lto_links(compiler()) else NO_LTO_NOTE
    lto_args = [f"-DCMAKE_PROJECT_INCLUDE={NO_IPO_CMAKE}"] if no_lto else []
    build_env = {
        "CMAKE_ARGS": " ".join([*CMAKE_ARGS[backend], *fetch_args, *lto_args, *cmake_args]),
        "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs or os.cpu_count() or 1),
    }
    if shutil.which("ninja"):
        build_env["CMAKE_GENERATOR"] = "Ninja"  # [n/N] progress lines
    how = "offline (the dependency directory)" if offline else "MLX's CMake fetching its deps"
    vpy = str(where.python)
    steps = [
        *_environment_steps(root, where, python, sites, system_site_packages),
        # Parity runs after the compile: find out now, not minutes later, that a step could
        # not start (the same interpreter, folder and environment as the parity step).
        Step("preflight", "every module the build, MLX's tests and parity import, in the venv",
             [vpy, "-c", VENV_PROBE, json.dumps(venv_modules(root))], where.base, parity_env),
        Step("build", f"MLX's documented Python build as a wheel, {backend} backend, {how}",
             [vpy, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
              "--wheel-dir", str(where.dist), "."], where.worktree, build_env),
        Step("install", "that wheel, into patchkit's venv only",
             [vpy, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
              str(where.dist), "--force-reinstall", "--no-deps", f"mlx=={version}"], root),
    ]  # fmt: skip
    route = route_words(PARITY_ROUTE_ENV.get(backend))
    steps.append(
        Step("parity", f"patchkit parity on the MLX just built{route} (exit 1 = rows differ)",
             [vpy, "-m", "patchkit.verify.mlx_parity", "--patched", "--out",
              str(where.parity_json)], where.base, parity_env, ok_codes=(0, 1))
    )  # fmt: skip
    if backend in PARITY_ROUTE_ENV:  # and the route a user gets without the overlay's switch
        steps.append(
            Step("parity", "patchkit parity on the default route (rows on stock's qmm may "
                 "differ: another summation order, stock's choice)",
                 [vpy, "-m", "patchkit.verify.mlx_parity", "--patched", "--out",
                  str(where.parity_default_json)], where.base, python_env, ok_codes=(0, 1))
        )  # fmt: skip
    # Last: the slowest step, and the one a time limit may cut short.
    # Metal: one GPU that every process would share; elsewhere the methods run side by side
    # (on CUDA most of a test's time is MLX compiling its qmm kernels, one core each).
    test_jobs = 1 if backend == "metal" else jobs or os.cpu_count() or 1
    # CUDA: a method's subtests also split, in a quarter of the slots and at most 4
    # shards: shards run at once, so each compiles the kernels its share meets.
    shards = min(4, max(1, test_jobs // 4)) if backend == "cuda" else 1
    if run_tests:
        steps.append(
            Step("test", f"MLX's own python/tests/{TEST_FILE}.py, the PR's tests first, "
                 f"one process per test method"
                 + (f" (a method with subtests: {shards}, each with a contiguous share "
                    "of them)" if shards > 1 else "")
                 + f", {test_jobs} at a time"
                 + (f", for at most {test_timeout} s" if test_timeout else "")
                 + (JIT_NOTE.format(where.ptx_cache(version)) if backend == "cuda" else ""),
                 [vpy, "-m", "patchkit.util.split_unittest", TEST_FILE, "--jobs", str(test_jobs),
                  *(["--cache-root", str(where.ptx_cache(version))] if backend == "cuda" else []),
                  *(["--deadline-s", str(test_timeout)] if test_timeout else []),
                  *(["--shards", str(shards)] if shards > 1 else []),
                  *(arg for t in own_tests for arg in ("--first", t))],
                 where.worktree / "python" / "tests", python_env, ok_codes=(0, 1))
        )  # fmt: skip
    options = (
        *(["--offline"] if offline else []),
        *(["--system-site-packages"] if system_site_packages else []),
        *(f"--cmake-arg={a}" for a in cmake_args),
        *([] if run_tests else ["--no-test"]),
        *([f"--test-timeout={test_timeout}"] if run_tests and test_timeout else []),
    )
    return BuildPlan(
        backend, p.commit, head, clone, where, deps, steps, version=version, offline=offline,
        python=python, cmake_min=_cmake_min(read), no_lto=no_lto, options=options,
        pr_files=pr_files,
    )  # fmt: skip


# Included after each project() of MLX's CMake when the compiler cannot link -flto.
NO_IPO_CMAKE = Path(__file__).with_name("no_ipo.cmake")
NO_LTO_NOTE = (
    "this compiler cannot link -flto: built without interprocedural optimization "
    "(nanobind's LTO of MLX's Python module, binding glue; no kernel changes)"
)
JIT_NOTE = (
    "; MLX compiles its qmm kernels at first use (NVRTC, tens of seconds each), into one "
    "folder per process under {}, each seeded with what ended processes compiled, so a "
    "first run takes long and a second starts warm; fewer processes at a time where the "
    "host's memory holds fewer compilers (patchkit.util.split_unittest)"
)
_LTO_PROBE = "int twice(int x) { return 2 * x; }\n"


def compiler() -> str | None:
    """The C++ compiler CMake will pick: ``CXX``, else ``c++``, ``g++`` or ``clang++``."""
    return (
        shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    )


def lto_links(cxx: str | None) -> bool:
    """Whether ``cxx`` builds a shared module with ``-flto`` as CMake does (about a second):
    a source file compiled to an object, then linked with ``-shared``.

    nanobind links MLX's Python module with LTO; a compiler whose LTO plugin cannot run
    (``could not run lto-wrapper``) would otherwise fail the build at its last link. No
    compiler: True, and the preflight names what is missing.
    """
    if cxx is None:
        return True
    with tempfile.TemporaryDirectory(prefix="patchkit-lto-") as tmp:
        src, obj, lib = (Path(tmp) / n for n in ("probe.cpp", "probe.o", "probe.so"))
        src.write_text(_LTO_PROBE)
        steps = (
            [cxx, "-flto", "-O1", "-fPIC", "-c", str(src), "-o", str(obj)],
            [cxx, "-flto", "-O1", "-shared", str(obj), "-o", str(lib)],
        )
        return all(proc.run(step, check=False).returncode == 0 for step in steps)


def _environment_steps(
    root: Path, where: Layout, python: str, sites: list[str], system_site_packages: bool
) -> list[Step]:
    """The venv and what goes into it; each step is idempotent and runs on every build."""
    vpy = str(where.python)
    venv = [python, "-m", "venv", *(["--system-site-packages"] if system_site_packages else [])]
    steps = [
        Step("environment", "patchkit's own virtual environment (yours is not touched)",
             [*venv, str(where.venv)], root),
    ]  # fmt: skip
    if sites:
        steps.append(
            Step("environment", f"the site folders of {python}'s venv and of its numpy, by a .pth",
                 [vpy, "-c", PTH_WRITER, "\n".join(sites)], root)
        )  # fmt: skip
    if not system_site_packages:  # an offline GPU host brings its own packages instead
        constraints = root / "constraints.txt"
        pins = ["-c", str(constraints)] if constraints.is_file() else []
        steps.append(
            Step("environment", "MLX's build requirements and parity's, into that environment",
                 [vpy, "-m", "pip", "install", "--quiet", *pins, *BUILD_REQUIREMENTS,
                  *_own_requirements(root)], root)
        )  # fmt: skip
    return steps


def new_test_methods(base: str, built: str) -> list[str]:
    """The test methods the build's test file (``built``: the patch's, with the PR's tests
    rendered in) adds to the pin's (``base``), in its order: they start before the others,
    so that a run cut short by ``--test-timeout`` still has their verdicts."""
    known = set(pyedit.TEST_METHOD_DEF.findall(base))
    return [name for name in pyedit.TEST_METHOD_DEF.findall(built) if name not in known]


def _own_requirements(root: Path) -> list[str]:
    """patchkit's declared dependencies (parity imports patchkit from the checkout)."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return []
    return list(tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", []))


def _mlx_version(read: Callable[[str], str]) -> str:
    """MLX's release version from the tree's ``mlx/version.h`` (what setup.py reads)."""
    text = read("mlx/version.h")
    parts = [
        re.search(rf"#define MLX_VERSION_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")
    ]
    if not all(parts):
        raise UserError("mlx/version.h at the patch commit names no MLX_VERSION_MAJOR/MINOR/PATCH")
    return ".".join(m.group(1) for m in parts if m)


def _cmake_min(read: Callable[[str], str]) -> str:
    """The tree's ``cmake_minimum_required`` version."""
    m = re.search(r"cmake_minimum_required\(VERSION\s+([\d.]+)", read("CMakeLists.txt"))
    return m.group(1) if m else "3.25"


def venv_modules(root: Path) -> dict[str, str]:
    """Every module the venv must import, with the requirement that brings it."""
    modules = dict(VENV_MODULES)
    imports = {dist: module for module, dist in DISTRIBUTIONS.items()}
    for req in _own_requirements(root):
        name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]
        modules.setdefault(imports.get(name, name.lower().replace("-", "_")), name)
    return modules


# Run by the build's venv python: imports every module (json {module: requirement}) and
# parity's own module; prints one line naming what to install, exits 1 when any is missing.
VENV_PROBE = """\
import importlib, json, sys
need, missing = json.loads(sys.argv[1]), []
for module, requirement in need.items():
    try:
        importlib.import_module(module)
    except ImportError:
        missing.append(requirement)
try:
    importlib.import_module("patchkit.verify.mlx_parity")
except ImportError as exc:
    missing.append(getattr(exc, "name", None) or str(exc))
if missing:
    pins = " ".join(repr(m) if set(m) & set("<>=") else m for m in dict.fromkeys(missing))
    print(f"preflight: the build's venv lacks {', '.join(dict.fromkeys(missing))}; "
          f"install: {sys.executable} -m pip install {pins}")
    sys.exit(1)
"""

# What the preflight asks of the machine, and what to install for each (Debian/Ubuntu, macOS).
INSTALL = {
    "compiler": ("a C++ compiler", "g++", "xcode-select --install"),
    "cmake": ("cmake", "cmake", "brew install cmake"),
    "venv": ("Python's venv module", "python3-venv", ""),
    "blas": ("BLAS/LAPACK headers and libraries (cblas.h, lapacke.h)",
             "libblas-dev liblapack-dev liblapacke-dev", ""),
    "nvcc": ("the CUDA toolkit (nvcc)", "nvidia-cuda-toolkit", ""),
    "metal": ("Xcode's metal compiler", "",
              "Xcode, then sudo xcode-select -s /Applications/Xcode.app"),
}  # fmt: skip
_BLAS_PROBE = "#include <cblas.h>\n#include <lapacke.h>\nint main() { return 0; }\n"


def preflight_checks(build: BuildPlan) -> list[str]:
    """What :func:`preflight` checks for this plan, in words (``--dry-run`` shows them)."""
    checks = ["a C++ compiler", f"cmake >= {build.cmake_min}", "Python's venv module"]
    if _needs_blas(build.backend):
        checks.append("BLAS/LAPACK headers and libraries")
    checks += {"cuda": ["nvcc"], "metal": ["xcrun metal"]}.get(build.backend, [])
    checks.append("the dependency directory" if build.offline else f"{FETCH_HOST[0]} reachable")
    return [*checks, "the venv's Python modules (a step after the environment's)"]


def _needs_blas(backend: str, system: str | None = None) -> bool:
    """MLX's CPU backend links LAPACK and BLAS on Linux (macOS: Accelerate); CUDA builds it too."""
    return (system or platform.system()) == "Linux" and backend in ("cpu", "cuda")


def missing_tools(build: BuildPlan) -> list[str]:
    """Keys of :data:`INSTALL` this machine lacks for ``build``; each check takes < 2 s."""
    missing = []
    cxx = compiler()
    if cxx is None:
        missing.append("compiler")
    have = _tool_version(["cmake", "--version"])
    if have is None or _as_tuple(have) < _as_tuple(build.cmake_min):
        missing.append("cmake")
    if not build.layout.python.exists() and _fails([build.python, "-c", "import ensurepip, venv"]):
        missing.append("venv")
    if cxx and _needs_blas(build.backend) and not _links(cxx, _BLAS_PROBE, ["-llapack", "-lblas"]):
        missing.append("blas")
    if build.backend == "cuda" and not (
        shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()
    ):
        missing.append("nvcc")
    if build.backend == "metal" and _fails(["xcrun", "-sdk", "macosx", "-f", "metal"]):
        missing.append("metal")
    return missing


def preflight(build: BuildPlan, system: str | None = None) -> None:
    """Raise one line naming what to install, or that the network is out of reach; else pass."""
    missing = missing_tools(build)
    if missing:
        mac = (system or platform.system()) == "Darwin"
        what = ", ".join(INSTALL[k][0] + (f" >= {build.cmake_min}" if k == "cmake" else "")
                         for k in missing)  # fmt: skip
        if mac:
            how = "; ".join(dict.fromkeys(INSTALL[k][2] for k in missing if INSTALL[k][2]))
        else:
            how = "apt-get install " + " ".join(INSTALL[k][1] for k in missing if INSTALL[k][1])
        raise UserError(f"preflight: missing {what}; install: {how}")
    if not build.offline and not _reachable(*FETCH_HOST):
        raise UserError(
            f"preflight: {FETCH_HOST[0]} is out of reach, where MLX's CMake fetches its "
            "dependencies; fill a dependency directory with `patchkit deps --from DIR` and "
            "build with --offline"
        )


def _tool_version(argv: list[str]) -> str | None:
    """The first x.y[.z] in ``argv``'s output, or None when it does not run."""
    if shutil.which(argv[0]) is None:
        return None
    out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10).stdout
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
    return m.group(1) if m else None


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def _fails(argv: list[str]) -> bool:
    """Whether ``argv`` is missing or exits non-zero."""
    if shutil.which(argv[0]) is None and not Path(argv[0]).exists():
        return True
    return subprocess.run(argv, capture_output=True, check=False, timeout=10).returncode != 0


def _links(cxx: str, program: str, libs: list[str]) -> bool:
    """Whether ``program`` compiles and links with ``libs`` (headers and libraries present)."""
    with tempfile.TemporaryDirectory(prefix="patchkit-preflight-") as tmp:
        argv = [cxx, "-x", "c++", "-", "-o", str(Path(tmp) / "a.out"), *libs]
        return proc.run(argv, input=program, check=False).returncode == 0


def _reachable(host: str, port: int, timeout: float = 5.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def prepare_worktree(build: BuildPlan, root: Path) -> None:
    """Check the patch commit out in the build worktree, with the overlay's files and the
    PR-only files (MLX's test, the benchmark) rendered into it.

    An existing worktree is moved to the commit in place (``checkout --force``),
    so the build folder MLX's setup.py keeps inside it survives and a rebuild is
    incremental. setup.py gets the build's version (:func:`set_version`).
    """
    wt = build.layout.worktree
    if (wt / ".git").exists():
        git.checkout_detached(wt, build.patch_commit)
    else:
        wt.parent.mkdir(parents=True, exist_ok=True)
        git.worktree_add(build.clone, wt, build.patch_commit)
    for path, rendered in build.pr_files.items():
        target = wt / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rendered)
    # The wheel is the overlay: the PR's change plus its downstream switches (each
    # off by default), so an engine can compare with stock's kernels in one build.
    overlay = export.overlay_files(root / transaction.PATCHES / build.mlx_commit[:8])
    for rel, path in overlay.items():
        (wt / rel).write_text(export.strip_header(rel, path.read_text()))
    setup = wt / "setup.py"
    setup.write_text(set_version(setup.read_text(), build.version))


def rendered_pr_files(root: Path, clone: Path, commit: str) -> dict[str, str]:
    """``{path: text}`` of the PR-only files (MLX's test, the benchmark) as the build puts
    them into its worktree: rendered from ``templates/`` onto the file at ``commit`` (read
    from the commit, not a worktree, where an earlier build left its render)."""
    out = {}
    for plan_ in render.pr_plans(root / "templates"):
        exists = git.blob_id(clone, commit, plan_.path) is not None
        text = git.show_file(clone, commit, plan_.path) if exists else None
        rendered = render.render_pr_file(plan_, text, PR_FILES_OPTIONS)
        if rendered is not None:
            out[plan_.path] = rendered
    return out


def set_version(setup_py: str, version: str) -> str:
    """MLX's setup.py with its computed version replaced by ``version`` (wheel and mx.__version__:
    setup.py hands the same string to CMake as MLX_VERSION)."""
    if setup_py.count(SETUP_VERSION_LINE) != 1:
        raise UserError(
            "MLX's setup.py has no single `version = get_version()` line; patchkit cannot "
            "name the wheel's version (has setup.py changed upstream?)"
        )
    return setup_py.replace(SETUP_VERSION_LINE, f"    version = {version!r}  # patchkit build\n")


def venv_broken(layout_: Layout) -> str | None:
    """Why the build's venv cannot be reused (a killed creation, a removed interpreter), or None."""
    if not layout_.venv.exists():
        return None
    if not layout_.python.exists():
        return f"{layout_.python} is missing"
    probe = subprocess.run([str(layout_.python), "-m", "pip", "--version"], capture_output=True,
                           text=True, check=False, timeout=60)  # fmt: skip
    if probe.returncode != 0:
        return cause((probe.stderr or probe.stdout).splitlines()) or "pip does not run"
    return None


def _run_logged(step: Step, log: TextIO, progress: Progress) -> tuple[int, list[str]]:
    """Run ``step`` with its output appended to ``log``; returns (exit code, output lines)."""
    log.write(f"\n$ {step.shell()}\n")
    log.flush()
    lines: list[str] = []
    shown = -1
    with subprocess.Popen(
        step.argv, cwd=step.cwd, env={**os.environ, **step.env}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    ) as child:  # fmt: skip
        for line in child.stdout or ():
            log.write(line)
            lines.append(line.rstrip("\n"))
            m = _NINJA.match(line)
            if m and (pct := 100 * int(m.group(1)) // int(m.group(2))) != shown:
                shown = pct  # one update per percent: readable in a CI log, live on a terminal
                progress(f"[{step.stage}] compile [{m.group(1)}/{m.group(2)}] {pct}%")
    return child.returncode, lines


def unittest_problems(lines: list[str]) -> set[str]:
    """unittest's header lines of the failing and erroring (sub)tests of one run, whole:
    name, test id and any subtest parameters (``FAIL: test_x (mod.Class.test_x) (k=64)``)."""
    return {ln.strip() for ln in lines if split_unittest.PROBLEM.match(ln)}


def unittest_counts(lines: list[str]) -> dict[str, int]:
    """passed / failed / errors / skipped tests from unittest's output.

    unittest's own tail counts failing and skipped *subtests* ("FAILED (failures=12)"
    after "Ran 1 test"), so tests are counted from its per-problem headers ("FAIL: name
    (id)") and, in a verbose run, its per-test lines ("name (id) ... skipped 'why'"), one
    per test id; its counts are kept as ``failures_reported`` / ``errors_reported`` /
    ``skipped_reported``. A test with both a failing and an erroring subtest counts as an
    error.
    """
    ran = next((int(m.group(1)) for ln in lines if (m := split_unittest.RAN.match(ln))), None)
    tail = next((m for ln in reversed(lines) if (m := split_unittest.TAIL.match(ln.strip()))), None)
    if ran is None or tail is None:
        raise UserError("MLX's test run printed no unittest summary")
    counts = {"failed": 0, "errors": 0, "skipped": 0, "expected_failures": 0}
    for key, value in split_unittest.tail_counts(tail).items():
        key = {"failures": "failed", "expected failures": "expected_failures"}.get(key, key)
        if key in counts:
            counts[key] = value
    reported = {"failures_reported": counts["failed"], "errors_reported": counts["errors"],
                "skipped_reported": counts["skipped"]}  # fmt: skip
    verbose = {
        m.group(2): m.group(3) for ln in lines if (m := split_unittest.VERBOSE.match(ln.strip()))
    }
    if verbose:  # a test skipped as a whole, once however many subtests it skipped
        counts["skipped"] = sum(v.startswith("skipped") for v in verbose.values())
    problems: dict[str, str] = {}
    for m in filter(None, map(split_unittest.PROBLEM.match, lines)):
        if problems.get(m.group(2)) != "ERROR":
            problems[m.group(2)] = m.group(1)
    if problems:  # without headers (a bare summary), the tail's counts are all there is
        counts["failed"] = sum(kind == "FAIL" for kind in problems.values())
        counts["errors"] = sum(kind == "ERROR" for kind in problems.values())
    passed = ran - counts["failed"] - counts["errors"] - counts["skipped"]
    return {"ran": ran, "passed": passed - counts["expected_failures"], **counts, **reported}


def method_results(lines: list[str]) -> dict[str, Any]:
    """The record's per-method view of a split run: each method's verdict, the headers
    of its failing subtests, the methods a deadline left unfinished, and those with a
    shard it cut off (``cut_off``; a failed one's other subtests never ran)."""
    methods = split_unittest.parse_output(lines)
    words = {"ok": "passed", "FAILED": "failed", "UNFINISHED": "unfinished"}

    def verdict(m: dict[str, Any]) -> str:
        # unittest's "ok" covers a method skipped as a whole: in every process it ran in.
        if m["verdict"] == "ok" and 0 < m.get("sections", 0) == m.get("skipped_sections", 0):
            return "skipped"
        return words.get(m["verdict"], m["verdict"])

    return {
        "per_test": {name: verdict(m) for name, m in methods.items()},
        "failing_subtests": {n: m["problems"] for n, m in methods.items() if m["problems"]},
        "unfinished": [n for n, m in methods.items() if m["verdict"] == "UNFINISHED"],
        "cut_off": [n for n, m in methods.items() if m.get("cut_off")],
    }


def series_text(root: Path, short: str) -> str:
    """The checkout's patch series (``patches/<pin>/``, in ``series`` order) as ``git
    format-patch --stdout`` prints it: the files joined by one newline ("" without one)."""
    folder = root / transaction.PATCHES / short
    try:
        names = (folder / export.SERIES).read_text().split()
        return "\n".join((folder / name).read_text() for name in names)
    except OSError:
        return ""


def series_id(root: Path, short: str) -> str:
    """sha256 over the exported patch series (``patches/<pin>/*.patch``), in file order."""
    digest = hashlib.sha256()
    for path in sorted((root / transaction.PATCHES / short).glob("*.patch")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# What each backend's build of MLX does not compile: MLX's CMake adds backend/metal only
# with MLX_BUILD_METAL and backend/cuda only with MLX_BUILD_CUDA.
UNBUILT_DIRS = {
    "metal": ("mlx/backend/cuda/",),
    "cuda": ("mlx/backend/metal/",),
    "cpu": ("mlx/backend/metal/", "mlx/backend/cuda/"),
}


def build_inputs_id(root: Path, short: str, backend: str) -> str:
    """sha256 over what a ``backend`` build compiles of the patch: each file's diff in the
    series (``series`` order) and each overlay file, outside ``UNBUILT_DIRS[backend]``.

    A build record holds while this id does: an edit the build never compiles (a Metal
    kernel, for a CUDA build) or a commit message leaves it valid, so that such a change
    does not need a GPU host to keep the other backend's records (decision 0008). The
    tests a build ran are named apart, by ``pr_files_id``.
    """
    unbuilt = UNBUILT_DIRS[backend]
    folder = root / transaction.PATCHES / short
    digest = hashlib.sha256()
    names = (
        (folder / export.SERIES).read_text().split() if (folder / export.SERIES).is_file() else []
    )
    for name in names:
        for diff in unidiff.PatchSet((folder / name).read_text()):
            if not diff.path.startswith(unbuilt):
                digest.update(b"diff\0" + diff.path.encode() + b"\0")
                digest.update("".join(str(hunk) for hunk in diff).encode())
    for rel, path in export.overlay_files(folder).items():
        if not rel.startswith(unbuilt):
            digest.update(b"overlay\0" + rel.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def valid_while(backend: str, inputs_sha256: str) -> str:
    """A results page's line naming the build inputs it holds for (decision 0008)."""
    return (
        f"- Valid while what a {backend} build compiles of the patch is unchanged: "
        f"build inputs sha256 `{inputs_sha256[:16]}` (decision 0008)"
    )


def pr_files_id(root: Path) -> str:
    """sha256 over what the PR-only files (MLX's test, the benchmark) are rendered from:
    their templates and the render context. The build renders them into its tree on top of
    the series, so a record's test results hold for these tests and no others."""
    digest = hashlib.sha256()
    context = render.pr_context(PR_FILES_OPTIONS)
    digest.update(json.dumps(context, sort_keys=True).encode())
    templates = root / "templates"
    for plan_ in render.pr_plans(templates):
        for path in sorted(p for p in plan_.template_dir.rglob("*") if p.is_file()):
            digest.update(path.relative_to(templates).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def patch_ids(root: Path, short: str, backend: str) -> dict[str, str]:
    """What a record names its patch by: the series, its sha256, what the ``backend``
    build compiles of it and the PR tests' id (``tests/test_records.py`` checks the last
    two against the checkout)."""
    return {
        "series": f"patches/{short}",
        "series_sha256": series_id(root, short),
        "build_inputs_sha256": build_inputs_id(root, short, backend),
        "pr_files_sha256": pr_files_id(root),
    }


# Lines that frame a failure without saying what it was (pip's and setuptools' wrappers).
_FRAME = re.compile(
    r"^(hint:|note:|\[end of output\]|\u00d7|╰─>|│|error: (subprocess-exited-with-error|"
    r"metadata-generation-failed|failed-wheel-build)|ERROR: (Failed (building|to build)|"
    r"Could not build wheels)|ninja: build stopped|subprocess\.CalledProcessError|"
    r"Traceback \(most recent call last\))"
)
# What a cause looks like, in order of preference: a compiler's first diagnostic, CMake's
# message, a Python exception, patchkit's own preflight, any other error line.
_CAUSES = (
    (re.compile(r"(^|: )(fatal )?error: "), "first"),
    (re.compile(r"^CMake Error"), "first"),
    (re.compile(r"^\w+(Error|Exception)\b:?"), "last"),
    (re.compile(r"^preflight: "), "last"),
    (re.compile(r"\b(error|failed|not found|missing)\b", re.I), "last"),
)


def cause(lines: list[str]) -> str:
    """The line of a step's output that says why it failed (pip's frames skipped), one line."""
    text = [ln.strip() for ln in lines if ln.strip() and not _FRAME.match(ln.strip())]
    for pattern, which in _CAUSES:
        hits = [i for i, ln in enumerate(text) if pattern.search(ln)]
        if not hits:
            continue
        i = hits[0] if which == "first" else hits[-1]
        line = text[i]
        if line.startswith("CMake Error") and i + 1 < len(text):
            line += " " + text[i + 1]  # "CMake Error at X:" names where; the next line what
        return line[:300]
    return (text[-1] if text else "")[:300]


def fail(step: Step, code: int, lines: list[str], log: Path) -> None:
    """Raise the one-line error for a failed step: its stage, its cause, the log."""
    raise UserError(f"{step.stage} failed (exit {code}: {cause(lines)}); the whole log: {log}")


def execute(build: BuildPlan, root: Path, progress: Progress) -> dict[str, Any]:
    """Run the plan; returns the build record. A failing step raises, naming its cause and log.

    Two builds of one backend and pin share a worktree, a venv and a wheel folder: the
    second waits for the first (the lock sits beside that build folder).
    """
    preflight(build)  # tools, system libraries, the network: seconds, before anything is made
    lock = build.layout.base.parent / f"{build.layout.base.name}.lock"
    with staging.exclusive(lock, on_wait=lambda: progress(f"waiting for the build holding {lock}")):
        return _execute(build, root, progress)


def _execute(build: BuildPlan, root: Path, progress: Progress) -> dict[str, Any]:
    progress(f"log: {build.layout.log}")
    if build.no_lto:
        progress(build.no_lto)
    if why := venv_broken(build.layout):
        progress(f"the build's venv is broken ({why}); recreating it")
        shutil.rmtree(build.layout.venv)
    for report in (build.layout.parity_json, build.layout.parity_default_json):
        report.unlink(missing_ok=True)  # only this run's reports count
    incremental = (build.layout.worktree / "build").is_dir()  # setup.py's build folder
    prepare_worktree(build, root)
    build.layout.log.parent.mkdir(parents=True, exist_ok=True)
    for old in build.layout.dist.glob("mlx-*.whl"):  # one wheel: this build's
        old.unlink()
    walls: dict[str, float] = {}
    outputs: dict[str, list[str]] = {}
    # CUDA: kernels MLX's JIT finds compiled when the tests start, and leaves when they end
    jit_warm = jit_left = None
    with build.layout.log.open("w") as log:
        for step in build.steps:  # every step, every time: each is idempotent
            progress(f"[{step.stage}] {step.why}")
            if step.stage == "test" and build.backend == "cuda":
                cache = build.layout.ptx_cache(build.version)
                jit_warm = jit_pool.count(cache, split_unittest.POOL, "test_")
            start = time.monotonic()
            code, lines = _run_logged(step, log, progress)
            walls[step.stage] = walls.get(step.stage, 0.0) + time.monotonic() - start
            outputs[step.stage] = lines
            if step.stage == "test" and build.backend == "cuda":
                jit_left = jit_pool.count(cache, split_unittest.POOL, "test_")
            if code not in step.ok_codes:
                fail(step, code, lines, build.layout.log)
    # Exit 1 is also how a crashed Python ends: a missing report or summary is a failure.
    parity_step = next(s for s in build.steps if s.stage == "parity")
    if not build.layout.parity_json.is_file():
        fail(parity_step, 1, outputs["parity"], build.layout.log)
    parity = json.loads(build.layout.parity_json.read_text())
    default = None
    if build.backend in PARITY_ROUTE_ENV:
        if not build.layout.parity_default_json.is_file():
            fail(parity_step, 1, outputs["parity"], build.layout.log)
        default = json.loads(build.layout.parity_default_json.read_text())
    tests = None  # --no-test: the record says the tests were not run
    if "test" in outputs:
        try:
            tests = unittest_counts(outputs["test"])
        except UserError as exc:
            raise UserError(f"{exc}; the whole log: {build.layout.log}") from exc
        tests.update(method_results(outputs["test"]))
        if jit_warm is not None:
            tests["jit_kernels_at_start"] = jit_warm
            tests["jit_kernels_at_end"] = jit_left
    rec = record(build, root, tests, parity, walls, default)
    wheel = build.wheel()
    return {**rec, "incremental": incremental, "wheel": str(wheel) if wheel else None}


def install_line(backend: str, cmake_args: tuple[str, ...] = ()) -> str:
    """The one command that puts the built wheel into a venv: ``patchkit install``, the
    same code as ``build --into`` (checked, installed, kept by the venv's pip)."""
    extra = "".join(f" --cmake-arg={shlex.quote(a)}" for a in cmake_args)
    return f"patchkit install --backend {backend}{extra} --into VENV"


# Split packages of stock MLX that ship their own libmlx: the patched wheel carries its own,
# so one of these beside it would leave two owners of the same files.
_SPLIT_PACKAGES = re.compile(r"^mlx[-_](cpu|metal|cuda(-\d+)?)$", re.I)


# Run by the target venv's Python: who there requires mlx, and that Python's marker values.
_REQUIRES_PROBE = """
import importlib.metadata as md, json, os, platform, re, sys
rows = []
for d in md.distributions():
    for r in d.requires or []:
        if re.split(r"[ ;<>=!~\\[(]", r, maxsplit=1)[0].lower() == "mlx":
            rows.append([d.metadata["Name"], d.version, r])
env = {"os_name": os.name, "sys_platform": sys.platform, "platform_system": platform.system(),
       "platform_machine": platform.machine(), "platform_release": platform.release(),
       "platform_version": platform.version(), "python_version": "%d.%d" % sys.version_info[:2],
       "python_full_version": platform.python_version(), "implementation_name":
       sys.implementation.name, "platform_python_implementation":
       platform.python_implementation(), "implementation_version": platform.python_version()}
print(json.dumps({"requires": rows, "env": env}))
"""


def requirement_conflicts(probe: dict[str, Any], version: str) -> tuple[list[str], list[str]]:
    """(conflicts, notes) of the target venv's requirements on ``mlx`` against the wheel's
    ``version``: a requirement that applies there and excludes it is a conflict; one under
    an extra (``mlx-lm[cpu]``) is a note, since pip cannot say which extras were asked for."""
    conflicts, notes = [], []
    for name, have, text in probe["requires"]:
        req = Requirement(text)
        if req.specifier.contains(version, prereleases=True):
            continue
        if req.marker is None or req.marker.evaluate({**probe["env"], "extra": ""}):
            conflicts.append(f"{name} {have} requires {req}")
        elif "extra" in str(req.marker):
            notes.append(f"{name} {have} with an extra requires {req}")
    return conflicts, notes


def _release_for(conflicts: list[str]) -> str:
    """What to build instead, from the conflicting specifiers' lower bounds."""
    lows = re.findall(r"mlx(?:\[[^\]]*\])?\s*>=\s*([\d.]+)", " ".join(conflicts))
    if not lows:
        return "a pin at a release they accept"
    need = max(lows, key=lambda v: tuple(int(p) for p in v.split(".")))
    return f"a pin at a release they accept (`patchkit rebase --to v{need}`, then build again)"


def check_into(venv: Path, python: str, version: str | None = None) -> Path:
    """The venv ``--into`` names, checked before the build; returns its python.

    It must run the Python the wheel is built with (``python``, which creates the build's
    venv), hold no stock split package (``mlx-cpu``, ``mlx-metal``, ``mlx-cuda-*``),
    whose libmlx the wheel would overwrite, and, given the wheel's ``version``, no package
    whose requirement on mlx excludes it (an engine needing a newer release).
    """
    py = venv / "bin" / "python"
    if not py.exists():
        raise UserError(f"--into {venv}: no bin/python there; pass a virtual environment's folder")
    ask = "import sys; print('%d.%d' % sys.version_info[:2])"
    mine, theirs = (
        subprocess.run([str(x), "-c", ask], capture_output=True, text=True, check=False)
        .stdout.strip()
        for x in (python, py)
    )  # fmt: skip
    if mine != theirs:
        raise UserError(f"--into {venv}: it runs Python {theirs}, the wheel would be for {mine}; "
                        "run patchkit with that venv's Python version")  # fmt: skip
    try:
        listed = proc.run([py, "-m", "pip", "list", "--format=json"])
    except ToolError as exc:
        raise UserError(f"--into {venv}: pip does not run there ({_cause(exc)})") from exc
    split = [d["name"] for d in json.loads(listed.stdout) if _SPLIT_PACKAGES.match(d["name"])]
    if split:
        raise UserError(
            f"--into {venv}: it has {', '.join(split)}, stock MLX's own library, which the patched "
            f"wheel replaces; remove it first: {py} -m pip uninstall -y {' '.join(split)}"
        )
    if version is not None:
        try:
            probe = json.loads(proc.run([py, "-c", _REQUIRES_PROBE]).stdout)
        except ToolError as exc:
            raise UserError(f"--into {venv}: its Python does not run ({_cause(exc)})") from exc
        conflicts, _ = requirement_conflicts(probe, version)
        if conflicts:
            raise UserError(
                f"--into {venv}: {'; '.join(conflicts)}, and this build is mlx {version};"
                f" build {_release_for(conflicts)}"
            )
    return py


def install_into(wheel: Path, venv: Path, python: str, version: str) -> dict[str, str]:
    """``pip install`` the wheel into ``venv`` (``--into``) and make that venv's pip keep it
    (:func:`keep_installed`); returns mlx.core's version there, what keeps it, how to undo."""
    py = check_into(venv, python)
    try:
        proc.run([py, "-m", "pip", "install", "--force-reinstall", "--no-deps", wheel])
    except ToolError as exc:
        raise UserError(f"--into {venv}: pip failed ({_cause(exc)})") from exc
    try:
        got = proc.run([py, "-c", "import mlx.core as mx; print(mx.__version__)"], cwd=venv)
    except ToolError as exc:
        raise UserError(
            f"--into {venv}: mlx.core does not import after the install ({_cause(exc)})"
        ) from exc
    return {"venv": str(venv), "mlx_version": got.stdout.strip(),
            "kept": keep_installed(venv, version), "release": release_line(venv)}  # fmt: skip


CONSTRAINT_FILE = "patchkit-constraints.txt"


def into_steps(venv: Path, dist: Path, version: str) -> list[str]:
    """What ``--into`` does after the build, as ``--dry-run`` shows it."""
    py = shlex.quote(str(venv / "bin" / "python"))
    return [
        f"# [into] the wheel into {venv}, then that venv's pip keeps it",
        f"{py} -m pip install --force-reinstall --no-deps "
        f"{shlex.quote(str(dist))}/mlx-{version}-*.whl",
        f"# {venv / CONSTRAINT_FILE}: mlx=={version}; {venv / 'pip.conf'}: "
        f"[install] constraint = {venv / CONSTRAINT_FILE}",
    ]


def keep_installed(venv: Path, version: str) -> str:
    """Make the venv's pip keep MLX at ``version``: ``pip install mlx-lm`` (which may ask for a
    newer ``mlx``) or ``pip install -U mlx`` then fail loudly instead of swapping stock back in.

    pip reads ``<venv>/pip.conf`` in every run of that venv; its ``[install] constraint``
    names a file holding ``mlx==<version>``. An existing pip.conf is only appended to, and
    not at all when it has its own ``[install]`` section (a one-line note says what to add).
    Returns what was done, for the build's summary; :func:`release_line` undoes it.
    """
    constraints = venv / CONSTRAINT_FILE
    note = "# written by patchkit build --into: keep the patched MLX\n"
    staging.atomic_write_text(constraints, f"{note}mlx=={version}\n")
    conf = venv / "pip.conf"
    entry = f"constraint = {constraints}"
    text = conf.read_text(encoding="utf-8") if conf.exists() else ""
    if entry in text:
        return f"pip in {venv} keeps mlx=={version} ({constraints})"
    if re.search(r"^\s*\[install\]", text, re.M):
        return (f"{conf} has its own [install] section: add `{entry}` to it so pip keeps "
                f"mlx=={version}")  # fmt: skip
    sep = "" if not text or text.endswith("\n") else "\n"
    staging.atomic_write_text(conf, f"{text}{sep}[install]\n{entry}\n")
    return f"pip in {venv} keeps mlx=={version} ({constraints}, named in {conf})"


def release_line(venv: Path) -> str:
    """The one command that lets ``venv``'s pip move MLX again and puts stock MLX back: the
    constraint file emptied (pip.conf still names it, so it must stay), then a reinstall."""
    py = shlex.quote(str(venv / "bin" / "python"))
    emptied = shlex.quote(str(venv / CONSTRAINT_FILE))
    return f": > {emptied} && {py} -m pip install --force-reinstall mlx"


def _cause(exc: ToolError) -> str:
    """The line of a failed tool's output that says why (see :func:`cause`)."""
    return cause((exc.stdout + exc.stderr).splitlines())


def _machine(backend: str) -> dict[str, Any]:
    """What the build ran on, for the record (no host names or paths)."""
    info: dict[str, Any] = {
        "system": platform.system(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    if backend == "cuda" and shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        info["gpu"] = proc.run(query, check=False).stdout.strip()
    return info


# The route whose claim covers parity's whole matrix, per backend: the build's `parity`.
# CUDA's default route takes the patch's kernel up to M * B = 16 for float16/bfloat16 on
# 4- and 8-bit weights on sm90, and leaves the rest of parity's matrix (float32, other
# bits, other GPUs) to stock's qmm from M * B = 8 (a different summation order) and
# qmm_sm90 where it applies; only the opt-in exact route claims M = 2..16 bit-identical
# to M = 1 across the whole matrix. So on CUDA the build runs
# parity on that route and again on the default one (`parity_default`, stock's qmm rows
# apart). Metal's default route already claims every M parity compares.
PARITY_ROUTE_ENV: dict[str, dict[str, str]] = {"cuda": {"MLX_CUDA_QMV_EXACT": "1"}}

COMPILED_NOTE = {
    "cpu": "the CPU backend compiles none of the Metal or CUDA files: this build proves the "
    "PR's Python test on MLX's Linux CI backend and that nothing else in the patch breaks "
    "MLX's build, not the kernels",
    "cuda": "the CUDA backend compiles the patched qmv.cu and quantized.cpp routing",
    "metal": "the Metal backend compiles the patched kernels into the metallib",
}


def record(
    build: BuildPlan,
    root: Path,
    tests: dict[str, int] | None,
    parity: dict[str, Any],
    walls: dict[str, float],
    parity_default: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The build record (``docs/results/build-<backend>.json``).

    ``parity`` is the route whose claim covers parity's whole matrix; ``parity_default``,
    where that route is a switch (CUDA), the route a user gets without it, by kernel path.
    """
    short = build.mlx_commit[:8]
    rec: dict[str, Any] = {
        "backend": build.backend,
        "mlx_commit": build.mlx_commit,
        "patch": {"commit": build.patch_commit, **patch_ids(root, short, build.backend)},
        "built": True,
        "compiled": COMPILED_NOTE[build.backend],
        "mlx_version": parity.get("mlx_version"),
        "wheel_version": build.version,
        "offline": build.offline,
        "deps": build.deps,
        "tests": None if tests is None else {"file": f"python/tests/{TEST_FILE}.py", **tests},
        "parity": {
            **parity_summary(parity),
            "route_env": PARITY_ROUTE_ENV.get(build.backend, {}),
        },
        "wall_s": {k: round(v, 1) for k, v in walls.items()},
        "machine": _machine(build.backend),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": shlex.join(["patchkit", "build", "--backend", build.backend, *build.options]),
    }
    if parity_default is not None:
        rec["parity_default"] = {**parity_summary(parity_default), "route_env": {}}
    if build.no_lto:
        rec["no_lto"] = build.no_lto
    return rec


def parity_summary(parity: dict[str, Any]) -> dict[str, Any]:
    """What the record keeps of one parity report."""
    return {
        "rows": parity["rows_compared"],
        "rows_differing": parity["rows_differing"],
        "rows_differing_by_path": parity.get("rows_differing_by_path", {}),
        # Rows that differed only with operands produced and read in one lazy graph.
        "graph_only_differing": sum(
            m.get("graph_only_differing", 0) for r in parity["rows"] for m in r.get("by_m", [])
        ),
        "kernel_paths": sorted({m["path"] for r in parity["rows"] for m in r.get("by_m", [])}),
        # Configurations run: the GPU-only large shapes are skipped on the CPU backend.
        "configs": sum(r["status"] != "skipped" for r in parity["rows"]),
    }


def patch_rows_differing(summary: dict[str, Any]) -> int:
    """Differing rows on every path but stock's qmm (another summation order, stock's route)."""
    return sum(n for path, n in summary["rows_differing_by_path"].items() if path not in STOCK_QMM)


# Kernel paths (patchkit.verify.dispatch) where stock sums in another order than M = 1.
STOCK_QMM = {"qmm", "qmm_sm90"}


def tests_line(t: dict[str, Any] | None) -> str:
    """The record's test result in one line (``None``: built with ``--no-test``)."""
    if t is None:
        return f"- `python/tests/{TEST_FILE}.py`: not run (`--no-test`)."
    line = (
        f"- `{t['file']}`: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
        f"{t['skipped']} skipped (of {t['ran']})"
    )
    failed = sorted(m for m, verdict in (t.get("per_test") or {}).items() if verdict == "failed")
    if failed:
        subtests = t.get("failing_subtests") or {}
        line += "; failed: " + ", ".join(
            f"{m} ({len(subtests[m])} subtests)" if subtests.get(m) else m for m in failed
        )
    if t.get("unfinished"):
        line += f"; {len(t['unfinished'])} not finished in the time given: " + ", ".join(
            t["unfinished"]
        )
    if t.get("jit_kernels_at_start"):
        line += (
            f"; the run started with {t['jit_kernels_at_start']} JIT kernels already in this "
            "version's JIT cache (the rest compiled as the tests met them)"
        )
    # Cut off while MLX's JIT compiled: say what the next run of this version starts from.
    if t.get("unfinished") and t.get("jit_kernels_at_end") is not None:
        line += (
            f"; {t['jit_kernels_at_end']} JIT kernels are left in this version's JIT cache "
            "for a later `patchkit build` to start from"
        )
    return line + "."


def route_words(env: dict[str, str] | None) -> str:
    """How the record names the route parity ran on: `` (route: A=1)``, or nothing."""
    if not env:
        return ""
    return " (route: " + " ".join(f"{k}={v}" for k, v in env.items()) + ")"


def parity_line(p: dict[str, Any]) -> str:
    """The record's claim-route parity in one line."""
    return (
        f"- `patchkit parity` on it{route_words(p.get('route_env'))}: "
        f"{p['rows_differing']} of {p['rows']} rows differ, each M also run with its operands "
        f"produced and its output read in one lazy graph ({p['configs']} configurations; "
        f"kernel paths: {', '.join(p['kernel_paths'])})."
    )


def parity_default_line(p: dict[str, Any]) -> str:
    """The default route's parity in one line, stock's qmm apart."""
    by_path = ", ".join(f"{k} {v}" for k, v in p["rows_differing_by_path"].items())
    return (
        f"- The same on the default route: {patch_rows_differing(p)} rows differ on the "
        f"patch's kernels; by kernel path: {by_path} (of {p['rows']} rows; stock's qmm sums "
        "M * B >= 8 in another order, the route stock chose)."
    )


def markdown(rec: dict[str, Any], raw: str | None = None) -> str:
    """The short page beside the record's JSON (``raw``: that file's name, linked)."""
    t, p, m = rec["tests"], rec["parity"], rec["machine"]
    walls = ", ".join(f"{k} {v:.0f} s" for k, v in rec["wall_s"].items())
    if rec.get("incremental"):
        walls += " (incremental: an earlier build of this worktree was reused)"
    return "\n".join(
        [
            f"# MLX built from the patched tree: {rec['backend']} backend, {rec['date']}",
            "",
            f"- MLX commit `{rec['mlx_commit'][:12]}` + patch commit "
            f"`{rec['patch']['commit'][:12]}` (`{rec['patch']['series']}`, series sha256 "
            f"`{rec['patch']['series_sha256'][:16]}`), MLX {rec['mlx_version']}",
            *(
                [valid_while(rec["backend"], rec["patch"]["build_inputs_sha256"])]
                if rec["patch"].get("build_inputs_sha256")
                else []
            ),
            f"- What was compiled: {rec['compiled']}.",
            tests_line(t),
            parity_line(p),
            *([parity_default_line(rec["parity_default"])] if "parity_default" in rec else []),
            *([f"- LTO: off; {rec['no_lto']}."] if rec.get("no_lto") else []),
            f"- Wall time: {walls}.",
            f"- Machine: {m['system']} {m['machine']}, {m['cpus']} CPUs, Python {m['python']}"
            + (f", {m['gpu']}" if m.get("gpu") else "")
            + ".",
            "",
            f"Command: `{rec['command']}` ("
            + (
                "the dependency directory from `patchkit deps`"
                if rec.get("offline", True)
                else "MLX's CMake fetched its dependencies"
            )
            + ")."
            + (f" The raw record: [{raw}]({raw})." if raw else ""),
            "",
        ]
    )


def write_record(rec: dict[str, Any], out_dir: Path) -> Path:
    """Write ``build-<backend>.json`` and ``.md`` into ``out_dir``, replacing the previous
    record of that backend (the date is inside); returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_record_at(rec, out_dir / f"build-{rec['backend']}.json")


def write_record_at(rec: dict[str, Any], path: Path) -> Path:
    """Write the record to ``path`` and its markdown beside it (``.md``); returns ``path``."""
    path.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    path.with_suffix(".md").write_text(markdown(rec, path.name))
    return path
