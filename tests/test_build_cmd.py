"""`patchkit build` and `patchkit deps`: the plan (online: MLX's own pins; offline: the
dependency directory), the preflight, the user's env untouched unless asked.

The planning tests run on a tiny MLX-shaped repository (real git, CMake files
declaring the same FetchContent sources as MLX); the real build is behind
``--mlx-build`` because it compiles MLX (about 15 minutes on 2 cores cold).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from support_git import mlx_clone

from patchkit.carry import export, mlx_build, mlx_deps, source
from patchkit.cli import main
from patchkit.errors import UserError
from patchkit.util import cache, git

ROOT = Path(__file__).resolve().parents[1]

TOP_CMAKE = """\
cmake_minimum_required(VERSION 3.25)
FetchContent_Declare(
  json
  URL https://github.com/nlohmann/json/releases/download/v3.11.3/json.tar.xz)
FetchContent_Declare(
    fmt
    GIT_REPOSITORY https://github.com/fmtlib/fmt.git
    GIT_TAG 12.1.0
    EXCLUDE_FROM_ALL)
FetchContent_Declare(dlfcn-win32 GIT_REPOSITORY https://github.com/dlfcn-win32/dlfcn-win32.git
  GIT_TAG v1.4.2)
"""
IO_CMAKE = """\
FetchContent_Declare(
    gguflib
    GIT_REPOSITORY https://github.com/antirez/gguf-tools/
    GIT_TAG 8fa6eb65236618e28fd7710a0fba565f7faa1848)
"""
VERSION_H = """\
#define MLX_VERSION_MAJOR 0
#define MLX_VERSION_MINOR 32
#define MLX_VERSION_PATCH 1
"""
SETUP_PY = """\
if __name__ == "__main__":
    version = get_version()
"""
TESTS_PY = """\
class TestQuantized:
    def test_qmv(self):
        pass
"""
CUDA_CMAKE = """\
FetchContent_Declare(
  cutlass
  GIT_REPOSITORY https://github.com/NVIDIA/cutlass.git
  GIT_TAG v4.4.2
  GIT_SHALLOW TRUE
  SOURCE_SUBDIR include EXCLUDE_FROM_ALL)
"""


def _commit(repo: Path, files: dict[str, str], message: str = "c") -> str:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git.add(repo, list(files))
    return git.commit(repo, message, date="2026-08-17T00:00:00+00:00")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A patchkit root pinned to a tiny MLX-shaped repo whose clone has the patch branch."""
    upstream = tmp_path / "mlx"
    upstream.mkdir()
    git.init(upstream)
    files = {"CMakeLists.txt": TOP_CMAKE, "mlx/io/CMakeLists.txt": IO_CMAKE,
             "mlx/backend/cuda/CMakeLists.txt": CUDA_CMAKE, "setup.py": SETUP_PY,
             "mlx/version.h": VERSION_H, "python/tests/test_quantized.py": TESTS_PY}  # fmt: skip
    commit = _commit(upstream, files)
    root = tmp_path / "project"
    root.mkdir()
    (root / "pin.toml").write_text(
        f'[upstream]\nurl = "{upstream}"\ncommit = "{commit}"\n\n[blobs]\n'
    )
    monkeypatch.setenv(source.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(source.ENV_REPO, raising=False)
    clone = source.ensure_clone(str(upstream))
    git.branch_force(clone, "patchkit/" + commit[:8], commit)
    return {"root": root, "upstream": upstream, "clone": clone, "deps": tmp_path / "deps"}


def _fill_stamps(deps: Path, names: dict[str, str]) -> None:
    """Dependency folders as `patchkit deps` leaves them (stamp only; content is not read)."""
    for name, stamp in names.items():
        (deps / name).mkdir(parents=True)
        (deps / name / mlx_deps.STAMP).write_text(stamp)


CPU_STAMPS = {
    "json": "nlohmann/json v3.11.3\n",
    "fmt": "fmtlib/fmt 12.1.0\n",
    "gguflib": "antirez/gguf-tools 8fa6eb65236618e28fd7710a0fba565f7faa1848\n",
}


@pytest.mark.parametrize(
    ("system", "gpu", "backend"),
    [("Darwin", False, "metal"), ("Darwin", True, "metal"), ("Linux", True, "cuda"),
     ("Linux", False, "cpu")],
)  # fmt: skip
def test_backend_detection_asks_for_a_gpu_not_a_compiler(
    system: str, gpu: bool, backend: str
) -> None:
    assert mlx_build.detect_backend(system, gpu) == backend


def test_no_gpu_listed_means_no_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # nvcc on PATH (this machine has one) but nvidia-smi finds no device.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/local/cuda/bin:/usr/bin:/bin")
    assert not mlx_build.has_nvidia_gpu()
    assert mlx_build.detect_backend("Linux") == "cpu"


def test_declarations_come_from_the_trees_cmake() -> None:
    deps = {d.name: d for d in mlx_deps.parse_declarations(TOP_CMAKE + IO_CMAKE + CUDA_CMAKE)}
    assert deps["json"] == mlx_deps.Dependency("json", "nlohmann/json", "v3.11.3", archive=True)
    assert deps["fmt"].tag == "12.1.0" and not deps["fmt"].archive
    assert deps["gguflib"].repo == "antirez/gguf-tools"
    assert deps["cutlass"].subdir == "include"
    assert deps["fmt"].cmake_var == "FETCHCONTENT_SOURCE_DIR_FMT"


def test_plan_is_online_by_default_with_mlxs_own_pins(project: dict[str, Path]) -> None:
    """With network, MLX's CMake fetches its dependencies: no FetchContent override at all."""
    plan = mlx_build.plan(project["root"], backend="cpu")
    assert not plan.offline
    build = next(s for s in plan.steps if s.stage == "build")
    assert "FETCHCONTENT" not in build.env["CMAKE_ARGS"]
    assert build.env["CMAKE_ARGS"].split() == ["-DMLX_BUILD_METAL=OFF"]
    # The record names the pins MLX's own CMake files declare (dlfcn-win32 is Windows-only).
    assert plan.deps == {
        "json": "nlohmann/json v3.11.3 (fetched by MLX's CMake)",
        "fmt": "fmtlib/fmt 12.1.0 (fetched by MLX's CMake)",
        "gguflib": "antirez/gguf-tools 8fa6eb65236618e28fd7710a0fba565f7faa1848 "
        "(fetched by MLX's CMake)",
    }
    assert f"{mlx_build.FETCH_HOST[0]} reachable" in mlx_build.preflight_checks(plan)
    assert not plan.layout.base.exists(), "planning must not create anything"


def test_plan_offline_is_isolated_and_writes_nothing(project: dict[str, Path]) -> None:
    _fill_stamps(project["deps"], CPU_STAMPS)
    plan = mlx_build.plan(project["root"], backend="cpu", deps_dir=project["deps"])
    assert plan.offline  # a dependency directory given means offline
    assert set(plan.deps) == {"json", "fmt", "gguflib"}  # dlfcn-win32 is Windows-only
    build = next(s for s in plan.steps if s.stage == "build")
    args = build.env["CMAKE_ARGS"].split()
    assert "-DFETCHCONTENT_FULLY_DISCONNECTED=ON" in args
    assert f"-DFETCHCONTENT_SOURCE_DIR_FMT={project['deps'] / 'fmt'}" in args
    assert "-DMLX_BUILD_METAL=OFF" in args
    # Every pip runs in patchkit's venv under the cache; the user's Python only creates it.
    venv = plan.layout.venv
    assert venv.is_relative_to(cache.folder("builds"))
    for step in plan.steps:
        assert "uninstall" not in step.argv
        if "pip" in step.argv:
            assert step.argv[0] == str(venv / "bin" / "python"), step.argv
    assert plan.steps[0].argv == [sys.executable, "-m", "venv", str(venv)]
    # The wheel: named with the patch, built into the build's dist/, installed from there only.
    assert plan.version == f"0.32.1+patchkit.{plan.patch_commit[:12]}"
    assert build.argv[-3:] == ["--wheel-dir", str(plan.layout.dist), "."]
    install = next(s for s in plan.steps if s.stage == "install")
    assert install.argv[-1] == f"mlx=={plan.version}" and "--no-index" in install.argv
    assert not plan.layout.base.exists(), "planning must not create anything"


def test_plan_installs_the_build_and_parity_requirements(project: dict[str, Path]) -> None:
    """parity runs patchkit from the checkout in the build's venv: patchkit's own
    dependencies go in with MLX's build requirements, and the preflight imports them all."""
    (project["root"] / "pyproject.toml").write_text(
        '[project]\ndependencies = ["Jinja2>=3.1,<4", "GitPython>=3.1", "unidiff"]\n'
    )
    plan = mlx_build.plan(project["root"], backend="cpu")
    pip = next(s for s in plan.steps if "pip" in s.argv and "install" in s.argv)
    assert pip.stage == "environment"
    assert {"setuptools>=80", "numpy", "Jinja2>=3.1,<4", "GitPython>=3.1"} <= set(pip.argv)
    modules = mlx_build.venv_modules(project["root"])
    assert modules["jinja2"] == "Jinja2" and modules["git"] == "GitPython"
    assert modules["setuptools.command.bdist_wheel"] == "setuptools>=80"
    stages = [s.stage for s in plan.steps]
    assert stages.index("preflight") < stages.index("build")


def test_missing_dependency_source_is_one_line(project: dict[str, Path]) -> None:
    _fill_stamps(project["deps"], {"json": CPU_STAMPS["json"], "fmt": "fmtlib/fmt 11.0.0\n"})
    with pytest.raises(UserError) as err:
        mlx_build.plan(project["root"], backend="cpu", deps_dir=project["deps"])
    msg = str(err.value)
    assert "\n" not in msg and "missing gguflib" in msg and "stale fmt" in msg
    assert "patchkit deps --from" in msg


def test_no_patch_branch_says_run_apply(project: dict[str, Path]) -> None:
    git.run(project["clone"], "branch", "-D", next(iter(_branches(project["clone"]))))
    with pytest.raises(UserError, match="run `patchkit apply` first"):
        mlx_build.plan(project["root"], backend="cpu", deps_dir=project["deps"])


def test_a_branch_of_another_patch_is_refused(project: dict[str, Path]) -> None:
    """The build compiles the cached clone's patchkit/<pin>; when that is not the checkout's
    patches/<pin> (another checkout, or an older patch, applied there), the build would
    carry another patch's commit and version: refused. Control: the same branch with the
    checkout's series written from it plans."""
    clone, root = project["clone"], project["root"]
    branch = next(iter(_branches(clone)))
    base = git.rev_parse(clone, branch)
    wt = project["root"].parent / "wt"
    git.worktree_add(clone, wt, base)
    head = _commit(wt, {"mlx/version.h": VERSION_H + "// patched\n"}, "a patch")
    git.branch_force(clone, branch, head)
    with pytest.raises(UserError, match="is not this checkout's patches/"):
        mlx_build.plan(root, backend="cpu", deps_dir=project["deps"])
    dest = root / "patches" / base[:8]
    dest.mkdir(parents=True)
    export.write_series(clone, base, head, dest)
    _fill_stamps(project["deps"], CPU_STAMPS)
    assert mlx_build.plan(root, backend="cpu", deps_dir=project["deps"]).patch_commit == head


def _branches(clone: Path) -> list[str]:
    return [b for b in git.out(clone, "branch", "--format=%(refname:short)").split() if "/" in b]


def test_system_site_packages_refused_where_mlx_is_importable(
    project: dict[str, Path], tmp_path: Path
) -> None:
    _fill_stamps(project["deps"], CPU_STAMPS)
    fake = tmp_path / "python-with-mlx"
    fake.write_text("#!/bin/sh\nexit 0\n")  # find_spec('mlx') succeeded
    fake.chmod(0o755)
    with pytest.raises(UserError, match="can import mlx"):
        mlx_build.plan(
            project["root"], backend="cpu", deps_dir=project["deps"], python=str(fake),
            system_site_packages=True,
        )  # fmt: skip


def test_a_base_interpreter_in_a_venv_lends_its_packages(
    project: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU hosts ship numpy and cuDNN in a venv: ``venv --system-site-packages`` made from
    its interpreter does not see them, so the plan adds a .pth naming them, and it works."""
    import subprocess

    _fill_stamps(project["deps"], CPU_STAMPS)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # its folders are lent too (below)
    parent = tmp_path / "parent"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(parent)], check=True)
    parent_py = str(parent / "bin" / "python")
    sites = mlx_build._lent_sites(parent_py)
    assert sites and all(s.startswith(str(parent)) for s in sites)
    # Not a venv: at most the folder its numpy comes from.
    base_py = sys.base_prefix + "/bin/python3"
    has_numpy = subprocess.run([base_py, "-c", "import numpy"], check=False).returncode == 0
    assert len(mlx_build._lent_sites(base_py)) == int(has_numpy)
    build = mlx_build.plan(
        project["root"], backend="cpu", deps_dir=project["deps"], python=parent_py,
        system_site_packages=True, cache=tmp_path / "cache",
    )  # fmt: skip
    env_steps = [s for s in build.steps if s.stage == "environment"]
    assert len(env_steps) == 2 and "--system-site-packages" in env_steps[0].argv
    for step in env_steps[:2]:  # run them: the child venv must see the parent's site folder
        subprocess.run([str(a) for a in step.argv], cwd=step.cwd, check=True)
    seen = subprocess.run(
        [str(build.layout.python), "-c", "import sys; print('\\n'.join(sys.path))"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert set(sites) <= set(seen)


def test_a_numpy_found_another_way_is_lent_too(
    project: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interpreter that imports numpy from a folder ``venv --system-site-packages``
    does not expose (here: through PYTHONPATH) lends that folder, so the build's venv
    imports it without that variable (the parity step runs with PYTHONPATH=<checkout>)."""
    import subprocess

    _fill_stamps(project["deps"], CPU_STAMPS)
    parent = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(parent)], check=True)
    lib = tmp_path / "elsewhere"
    (lib / "numpy").mkdir(parents=True)
    (lib / "numpy" / "__init__.py").write_text("WHERE = 'elsewhere'\n")
    # Wheels carried to an offline host: `pip install --target carried`, on PYTHONPATH.
    carried = tmp_path / "carried"
    (carried / "carried_pkg").mkdir(parents=True)
    (carried / "carried_pkg" / "__init__.py").write_text("WHERE = 'carried'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(lib), str(carried)]))
    build = mlx_build.plan(
        project["root"], backend="cpu", deps_dir=project["deps"],
        python=str(parent / "bin" / "python"), system_site_packages=True,
        cache=tmp_path / "cache",
    )  # fmt: skip
    env_steps = [s for s in build.steps if s.stage == "environment"]
    assert str(lib) in env_steps[1].argv[-1].splitlines()
    for step in env_steps[:2]:
        subprocess.run([str(a) for a in step.argv], cwd=step.cwd, check=True)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run(
        [str(build.layout.python), "-c",
         "import numpy, carried_pkg; print(numpy.WHERE, carried_pkg.WHERE)"],
        capture_output=True, text=True, check=True, env=clean,
    ).stdout.strip()  # fmt: skip
    assert got == "elsewhere carried"
    # Control: a venv without the lent folders imports neither.
    plain = subprocess.run([str(parent / "bin" / "python"), "-c", "import carried_pkg"],
                           capture_output=True, text=True, env=clean)  # fmt: skip
    assert plain.returncode == 1 and "carried_pkg" in plain.stderr
    # The preflight step checks parity's imports before the compile, in parity's folder
    # and with the PYTHONPATH parity itself gets (the checkout, then the lent folders,
    # which a .pth alone may not make importable); without numpy it
    # fails, in seconds, with one line naming what to install.
    check = next(s for s in build.steps if s.stage == "preflight")
    parity = next(s for s in build.steps if s.stage == "parity")
    assert check.argv[1:3] == ["-c", mlx_build.VENV_PROBE]
    assert (check.cwd, check.env) == (parity.cwd, parity.env)
    assert check.env["PYTHONPATH"].split(os.pathsep)[0] == str(project["root"])
    assert str(lib) in check.env["PYTHONPATH"].split(os.pathsep)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    refused = subprocess.run(
        [str(bare / "bin" / "python"), *check.argv[1:]], capture_output=True, text=True,
        env={**clean, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert refused.returncode == 1
    line = refused.stdout.strip()
    assert "\n" not in line and line.startswith("preflight: the build's venv lacks")
    assert "numpy" in line and "'setuptools>=80'" in line and "-m pip install" in line
    assert mlx_build.cause(refused.stdout.splitlines()) == line


def test_cuda_parity_checks_the_exact_route_and_the_record_says_so(
    project: dict[str, Path], tmp_path: Path
) -> None:
    """On CUDA the build's parity runs with MLX_CUDA_QMV_EXACT=1 (the route that claims every
    M parity compares; the default route leaves float32 and other bits to stock's qmm from
    M * B = 8), and so does its pre-compile check; MLX's own tests run the default route,
    as users get it."""
    _fill_stamps(project["deps"], {**CPU_STAMPS, "cutlass": "NVIDIA/cutlass v4.4.2\n"})
    build = mlx_build.plan(
        project["root"], backend="cuda", deps_dir=project["deps"], cache=tmp_path / "cache"
    )
    parity = next(s for s in build.steps if s.stage == "parity")
    check = next(s for s in build.steps if s.stage == "preflight")
    tests = next(s for s in build.steps if s.stage == "test")
    assert parity.env["MLX_CUDA_QMV_EXACT"] == "1" and check.env == parity.env
    assert "MLX_CUDA_QMV_EXACT" not in tests.env
    # MLX's NVRTC cache lives beside this build (per version), shared by tests and parity
    ptx = Path(tests.env["MLX_PTX_CACHE_DIR"])
    assert ptx == build.layout.base / "ptx" / build.version and str(ptx) in tests.why
    assert all(s.env["MLX_PTX_CACHE_DIR"] == str(ptx) for s in build.steps if s.stage == "parity")
    cpu = mlx_build.plan(
        project["root"], backend="cpu", deps_dir=project["deps"], cache=tmp_path / "cache"
    )
    assert "MLX_CUDA_QMV_EXACT" not in next(s for s in cpu.steps if s.stage == "parity").env
    assert not any("MLX_PTX_CACHE_DIR" in (s.env or {}) for s in cpu.steps)
    report = {"rows_compared": 8, "rows_differing": 0, "mlx_version": "0.32.1", "rows": []}
    rec = mlx_build.record(build, project["root"], None, report, {"build": 1.0})
    assert rec["parity"]["route_env"] == {"MLX_CUDA_QMV_EXACT": "1"}
    assert "parity` on it (route: MLX_CUDA_QMV_EXACT=1): 0 of 8" in mlx_build.markdown(rec)
    # the record names what a CUDA build compiled, and its page says so
    inputs = mlx_build.build_inputs_id(project["root"], build.mlx_commit[:8], "cuda")
    assert rec["patch"]["build_inputs_sha256"] == inputs
    assert f"build inputs sha256 `{inputs[:16]}`" in mlx_build.markdown(rec)


# Parity before MLX's tests: the claim first, then the slow step a --test-timeout may cut.
STAGES = ["environment", "environment", "preflight", "build", "install", "parity", "test"]


def test_dry_run_cli_prints_the_commands(
    project: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill_stamps(project["deps"], CPU_STAMPS)
    (project["root"] / "templates").mkdir()
    (project["root"] / "pyproject.toml").write_text("")
    monkeypatch.chdir(project["root"])
    r = CliRunner().invoke(main, ["build", "--backend", "cpu", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and [s["stage"] for s in plan["steps"]] == STAGES
    assert not plan["offline"] and plan["version"].startswith("0.32.1+patchkit.")
    quick = CliRunner().invoke(main, ["build", "--backend", "cpu", "--dry-run", "--json",
                                      "--no-test"])  # fmt: skip
    assert [s["stage"] for s in json.loads(quick.stdout)["steps"]] == [
        s for s in STAGES if s != "test"
    ]
    assert mlx_build.tests_line(None).endswith("not run (`--no-test`).")
    timed = CliRunner().invoke(main, ["build", "--backend", "cpu", "--dry-run", "--json",
                                      "--test-timeout", "600"])  # fmt: skip
    test_argv = next(s["argv"] for s in json.loads(timed.stdout)["steps"] if s["stage"] == "test")
    assert test_argv[-2:] == ["--deadline-s", "600"] and "--deadline-s" not in str(plan)
    # `patchkit --json build ...` is the same as `patchkit build ... --json`
    lead = CliRunner().invoke(main, ["--json", "build", "--backend", "cpu", "--dry-run"])
    assert lead.exit_code == 0 and json.loads(lead.stdout) == plan
    # --dry-run shows --into's step too, and touches nothing there
    user = project["root"].parent / "user-venv"
    user.mkdir()
    into = CliRunner().invoke(main, ["build", "--backend", "cpu", "--dry-run", "--into", str(user)])
    assert into.exit_code == 0 and f"# [into] the wheel into {user}" in into.stdout
    assert f"mlx=={plan['version']}" in into.stdout and not any(user.iterdir())
    online = CliRunner().invoke(main, ["build", "--backend", "cpu", "--dry-run"])
    assert "FETCHCONTENT" not in online.stdout and "# preflight: " in online.stdout
    deps = ["--deps", str(project["deps"])]  # implies --offline
    human = CliRunner().invoke(main, ["build", "--backend", "cpu", "--dry-run", *deps])
    assert "FETCHCONTENT_FULLY_DISCONNECTED=ON" in human.stdout
    offline = CliRunner().invoke(main, ["build", "--backend", "cpu", "--dry-run", "--offline"])
    assert offline.exit_code == 1 and "patchkit deps --from" in offline.output  # default dir empty
    bad = CliRunner().invoke(main, ["build", "--backend", "cpu", "--deps", "/nonexistent"])
    assert bad.exit_code == 1 and "missing" in bad.output and "Traceback" not in bad.output


def test_fill_exports_tags_from_local_clones(tmp_path: Path) -> None:
    search = tmp_path / "mirrors"
    repo = search / "fmtlib+fmt" / "repo"
    repo.mkdir(parents=True)
    git.init(repo)
    _commit(repo, {"include/fmt/core.h": "// v12\n", "LICENSE": "MIT\n"})
    git.run(repo, "tag", "12.1.0")
    _commit(repo, {"include/fmt/core.h": "// later\n"})
    dep = mlx_deps.Dependency("fmt", "fmtlib/fmt", "12.1.0", archive=False)
    out = tmp_path / "deps"
    assert mlx_deps.fill([dep], search, out) == ["fmt"]
    assert (out / "fmt" / "include" / "fmt" / "core.h").read_text() == "// v12\n"
    assert mlx_deps.resolve([dep], out) == {"fmt": out / "fmt"}
    assert mlx_deps.fill([dep], search, out) == []  # current: nothing to do
    missing = mlx_deps.Dependency("json", "nlohmann/json", "v3.11.3", archive=True)
    with pytest.raises(UserError, match="no git clone of nlohmann/json"):
        mlx_deps.fill([missing], search, out)
    with pytest.raises(UserError, match="--rev fmt=REV"):
        mlx_deps.fill([mlx_deps.Dependency("fmt", "fmtlib/fmt", "13.0.0", False)], search, out)
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no staging left behind"


UNITTEST_OK = ["test_a ... ok", "", "-" * 70, "Ran 38 tests in 168.2s", "", "OK (skipped=2)"]
UNITTEST_FAIL = ["Ran 10 tests in 1.0s", "", "FAILED (failures=2, errors=1, skipped=3)"]


def test_unittest_summary_parsed() -> None:
    assert mlx_build.unittest_counts(UNITTEST_OK) == {
        "ran": 38, "passed": 36, "failed": 0, "errors": 0, "skipped": 2, "expected_failures": 0,
        "failures_reported": 0, "errors_reported": 0, "skipped_reported": 2,
    }  # fmt: skip
    fail = mlx_build.unittest_counts(UNITTEST_FAIL)
    assert (fail["passed"], fail["failed"], fail["errors"], fail["skipped"]) == (4, 2, 1, 3)
    # Subtests: unittest counts 12 failures for 1 test; the record counts the test once.
    one = "FAIL: test_qmv (test_quantized.TestQuantized.test_qmv) (shape=({}, 256, 64))"
    subtests = [
        "Ran 3 tests in 53.5s", *(one.format(b) for b in (0, 3, 8)),
        "ERROR: test_qmm (test_quantized.TestQuantized.test_qmm) (bits=4)",
        "FAIL: test_qmm (test_quantized.TestQuantized.test_qmm) (bits=8)",
        "", "FAILED (failures=4, errors=1)",
    ]  # fmt: skip
    got = mlx_build.unittest_counts(subtests)
    assert (got["ran"], got["passed"], got["failed"], got["errors"]) == (3, 1, 1, 1)
    assert (got["failures_reported"], got["errors_reported"]) == (4, 1)
    # Skipped subtests: unittest's tail counts each; a test skipped as a whole counts once,
    # and a test whose subtests skipped but which ran still passed.
    verbose = [
        "test_a (m.T.test_a) ... skipped 'not here'",
        "test_b (m.T.test_b) ... ",
        "  test_b (m.T.test_b) (i=0) ... skipped 'no'",
        "  test_b (m.T.test_b) (i=1) ... skipped 'no'",
        "test_c (m.T.test_c) ... ok",
        "Ran 3 tests in 0.1s", "", "OK (skipped=3)",
    ]  # fmt: skip
    got = mlx_build.unittest_counts(verbose)
    assert (got["passed"], got["skipped"], got["skipped_reported"]) == (2, 1, 3)
    # Control: the tail alone (no verbose lines) can only give unittest's own count.
    assert mlx_build.unittest_counts(verbose[-3:])["skipped"] == 3
    with pytest.raises(UserError):
        mlx_build.unittest_counts(["Traceback (most recent call last):"])


@pytest.mark.mlx_build
@pytest.mark.skipif(mlx_clone() is None, reason="needs a full MLX clone: set PATCHKIT_MLX_REPO")
def test_real_cpu_build_offline(tmp_path: Path) -> None:
    """The whole thing, offline: build the wheel, MLX's test_quantized.py, parity (needs
    `patchkit deps --backend cpu` filled), then the wheel into a fresh venv of the user's."""
    plan = mlx_build.plan(ROOT, backend="cpu", mlx_repo=mlx_clone(), offline=True)
    test = next(s for s in plan.steps if s.stage == "test")
    first = [a for flag, a in zip(test.argv, test.argv[1:], strict=False) if flag == "--first"]
    assert "test_qmv_tensor_cores_match_single_vector" in first  # the PR's tests, rendered
    rec = mlx_build.execute(plan, ROOT, lambda _: None)
    assert rec["built"] and rec["tests"]["failed"] == 0 and rec["tests"]["errors"] == 0
    assert rec["tests"]["passed"] > 30
    assert rec["parity"]["rows"] > 0 and rec["parity"]["rows_differing"] == 0
    assert rec["mlx_version"] == plan.version == rec["wheel_version"]
    assert mlx_build.write_record(rec, tmp_path) == tmp_path / "build-cpu.json"
    user = tmp_path / "user-venv"
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", str(user)], check=True)
    done = mlx_build.install_into(Path(rec["wheel"]), user, plan.python, plan.version)
    assert done["mlx_version"] == plan.version and "keeps mlx==" in done["kept"]


def test_a_failing_step_is_one_line_naming_the_log(
    project: dict[str, Path], tmp_path: Path
) -> None:
    """A compile that fails ends the build with one line: the stage, the last output, the log."""
    _fill_stamps(project["deps"], CPU_STAMPS)
    plan = mlx_build.plan(project["root"], backend="cpu", deps_dir=project["deps"])
    failing = mlx_build.Step("build", "a compile that fails", ["sh", "-c",
                             "echo compiling; echo 'error: boom' ; exit 3"], tmp_path)  # fmt: skip
    plan = mlx_build.BuildPlan(
        plan.backend, plan.mlx_commit, plan.patch_commit, plan.clone, plan.layout, plan.deps,
        [failing],
    )  # fmt: skip
    plan.layout.python.parent.mkdir(parents=True)
    with pytest.raises(UserError) as err:
        for step in plan.steps:  # execute's loop, without the worktree preparation
            with plan.layout.log.open("a") as log:
                code, lines = mlx_build._run_logged(step, log, lambda _: None)
            assert code == 3 and lines[-1] == "error: boom"
            mlx_build.fail(step, code, lines, plan.layout.log)
    msg = str(err.value)
    assert "\n" not in msg and "build failed (exit 3: error: boom)" in msg
    assert str(plan.layout.log) in msg and "error: boom" in plan.layout.log.read_text()


# What pip printed when MLX's setup.py met a setuptools without bdist_wheel (the log's tail).
PIP_SETUPTOOLS = [
    "  Traceback (most recent call last):",
    '    File "<string>", line 2, in <module>',
    "  ModuleNotFoundError: No module named 'setuptools.command.bdist_wheel'",
    "  [end of output]",
    "  note: This error originates from a subprocess, and is likely not a problem with pip.",
    "error: metadata-generation-failed",
    "\u00d7 Encountered error while generating package metadata.",
    "╰─> See above for output.",
    "note: This is an issue with the package mentioned above, not pip.",
    "hint: See above for details.",
]
CMAKE_BLAS = [
    "  -- Found LAPACK: /usr/lib/x86_64-linux-gnu/liblapack.so",
    "  CMake Error at /usr/share/cmake-3.25/Modules/FPHSA.cmake:230 (message):",
    "    Could NOT find BLAS (missing: BLAS_LIBRARIES)",
    "  Call Stack (most recent call first):",
    "  subprocess.CalledProcessError: Command '['cmake', '/src']' returned non-zero exit status 1.",
    "  error: subprocess-exited-with-error",
    "ERROR: Failed building wheel for mlx",
]
COMPILE = [
    "  [12/128] Building CXX object CMakeFiles/mlx.dir/mlx/array.cpp.o",
    "  FAILED: CMakeFiles/mlx.dir/mlx/backend/cpu/quantized.cpp.o",
    "  /src/mlx/backend/cpu/quantized.cpp:42:7: error: 'qmv_streamed' was not declared",
    "  /src/mlx/backend/cpu/quantized.cpp:50:1: error: expected '}' at end of input",
    "  ninja: build stopped: subcommand failed.",
    "  subprocess.CalledProcessError: Command '['cmake', '--build', '.']' returned non-zero exit",
    "hint: See above for details.",
]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (PIP_SETUPTOOLS, "ModuleNotFoundError: No module named 'setuptools.command.bdist_wheel'"),
        # CMake's "at FILE:LINE" with the message on the next line
        (CMAKE_BLAS, "CMake Error at /usr/share/cmake-3.25/Modules/FPHSA.cmake:230 (message): "
                     "Could NOT find BLAS (missing: BLAS_LIBRARIES)"),
        # the compiler's first error, not the cascade after it
        (COMPILE, COMPILE[2].strip()),
        (["compiling", "error: boom"], "error: boom"),
    ],
)  # fmt: skip
def test_a_failed_steps_cause_is_named_not_see_above(lines: list[str], expected: str) -> None:
    assert mlx_build.cause(lines) == expected
    step = mlx_build.Step("build", "b", ["true"], Path("."))
    with pytest.raises(UserError) as err:
        mlx_build.fail(step, 1, lines, Path("/x/build.log"))
    msg = str(err.value)
    assert "\n" not in msg and expected in msg and "See above" not in msg
    assert msg.endswith("the whole log: /x/build.log")


def _tools(tmp_path: Path, **scripts: str) -> str:
    """A PATH of fake tools (name -> shell body) and nothing else."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    return str(bin_)


def test_preflight_names_every_missing_tool_in_one_line(
    project: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old cmake and a compiler that cannot link BLAS/LAPACK: one line naming both and
    the packages that bring them, before anything is created."""
    plan = mlx_build.plan(project["root"], backend="cpu")
    path = _tools(tmp_path, cmake="echo 'cmake version 3.18.4'", **{"c++": "exit 1"})
    monkeypatch.setenv("PATH", path)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(UserError) as err:
        mlx_build.preflight(plan, system="Linux")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("preflight: missing cmake >= 3.25, BLAS/LAPACK")
    assert msg.endswith("install: apt-get install cmake libblas-dev liblapack-dev liblapacke-dev")
    assert mlx_build.missing_tools(plan) == ["cmake", "blas"]
    monkeypatch.setenv("PATH", _tools(tmp_path / "none"))
    assert mlx_build.missing_tools(plan)[:2] == ["compiler", "cmake"]
    with pytest.raises(UserError, match="; install: xcode-select --install; brew install cmake"):
        mlx_build.preflight(plan, system="Darwin")
    assert not plan.layout.base.exists()


def test_preflight_online_without_network_says_use_offline(
    project: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(mlx_build, "FETCH_HOST", ("127.0.0.1", port))
    monkeypatch.setattr(mlx_build, "missing_tools", lambda _: [])
    with pytest.raises(UserError, match=r"out of reach.*`patchkit deps --from DIR`.*--offline"):
        mlx_build.preflight(mlx_build.plan(project["root"], backend="cpu"))
    _fill_stamps(project["deps"], CPU_STAMPS)
    offline = mlx_build.plan(project["root"], backend="cpu", deps_dir=project["deps"])
    mlx_build.preflight(offline)  # offline builds never ask for the network


def test_a_broken_venv_is_detected(tmp_path: Path) -> None:
    """A venv whose creation was killed before pip (or whose python is gone) is not reused."""
    import subprocess

    where = mlx_build.Layout(tmp_path / "b")
    assert mlx_build.venv_broken(where) is None  # none yet: nothing to recreate
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where.venv)], check=True)
    assert "No module named pip" in (mlx_build.venv_broken(where) or "")
    where.python.unlink()
    assert mlx_build.venv_broken(where) == f"{where.python} is missing"


def test_setup_py_gets_the_builds_version() -> None:
    text = "def get_version():\n    ...\n\n" + SETUP_PY
    out = mlx_build.set_version(text, "0.32.1+patchkit.abc")
    assert "    version = '0.32.1+patchkit.abc'  # patchkit build\n" in out
    assert out.count("version = get_version()") == 0 and "def get_version" in out
    with pytest.raises(UserError, match="no single `version = get_version\\(\\)` line"):
        mlx_build.set_version("setup()\n", "1")


def test_the_records_command_repeats_the_options_that_shape_it(
    project: dict[str, Path],
) -> None:
    """The record's command is one a rerun can type: the test window and site packages
    it ran with (not the compile jobs, which only change how long it took)."""
    _fill_stamps(project["deps"], CPU_STAMPS)
    plan = mlx_build.plan(
        project["root"], backend="cpu", deps_dir=project["deps"], jobs=16, test_timeout=450
    )
    report = {"rows_compared": 8, "rows_differing": 0, "mlx_version": plan.version, "rows": []}
    rec = mlx_build.record(plan, project["root"], None, report, {"build": 1.0})
    assert rec["command"] == "patchkit build --backend cpu --offline --test-timeout=450"


def test_the_record_replaces_the_previous_one(project: dict[str, Path], tmp_path: Path) -> None:
    _fill_stamps(project["deps"], CPU_STAMPS)
    plan = mlx_build.plan(project["root"], backend="cpu", deps_dir=project["deps"])
    report = {"rows_compared": 8, "rows_differing": 0, "mlx_version": plan.version, "rows": []}
    out = tmp_path / "docs" / "results"
    for walls in ({"build": 1.0}, {"build": 2.0}):
        path = mlx_build.write_record(
            mlx_build.record(plan, project["root"], None, report, walls), out
        )
    assert sorted(p.name for p in out.iterdir()) == ["build-cpu.json", "build-cpu.md"]
    rec = json.loads(path.read_text())
    assert rec["wall_s"] == {"build": 2.0} and rec["wheel_version"] == plan.version
    assert rec["offline"] and "--offline" in rec["command"]
    assert "[build-cpu.json](build-cpu.json)" in (out / "build-cpu.md").read_text()  # beside it


def _clone_with_tag(search: Path, repo: str, tag: str, files: dict[str, str]) -> None:
    owner, name = repo.split("/")
    path = search / f"{owner}+{name}" / "repo"
    path.mkdir(parents=True)
    git.init(path)
    _commit(path, files)
    git.run(path, "tag", tag)


def test_fill_is_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing clone is found before anything is exported, and an export that fails
    half-way leaves the dependency directory exactly as it was: no partial folder."""
    search, out = tmp_path / "mirrors", tmp_path / "deps"
    _clone_with_tag(search, "fmtlib/fmt", "12.1.0", {"include/fmt/core.h": "// v12\n"})
    fmt = mlx_deps.Dependency("fmt", "fmtlib/fmt", "12.1.0", archive=False)
    json_dep = mlx_deps.Dependency("json", "nlohmann/json", "v3.11.3", archive=True)
    gguf = mlx_deps.Dependency("gguflib", "antirez/gguf-tools", "v1", archive=False)
    with pytest.raises(UserError) as err:
        mlx_deps.fill([fmt, json_dep, gguf], search, out)
    msg = str(err.value)
    assert "nlohmann/json" in msg and "antirez/gguf-tools" in msg and "nothing was exported" in msg
    assert not out.exists()
    _clone_with_tag(search, "nlohmann/json", "v3.11.3", {"single_include/json.hpp": "//\n"})

    def broken(name: str, tree: Path) -> None:
        if name == "json":
            raise OSError("disk full")

    monkeypatch.setattr(mlx_deps, "_release_layout", broken)
    with pytest.raises(OSError):
        mlx_deps.fill([fmt, json_dep], search, out)
    assert list(out.iterdir()) == [], "fmt was exported but must not land without json"
    monkeypatch.undo()
    assert mlx_deps.fill([fmt, json_dep], search, out) == ["fmt", "json"]
    assert sorted(p.name for p in out.iterdir()) == ["fmt", "json"]


def test_deps_cli_fetches_only_the_chosen_backends_sources(
    project: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU machine's `patchkit deps` asks for no CUDA source (cutlass): CPU's are enough."""
    search = tmp_path / "mirrors"
    _clone_with_tag(search, "fmtlib/fmt", "12.1.0", {"include/fmt/core.h": "//\n"})
    _clone_with_tag(search, "nlohmann/json", "v3.11.3", {"single_include/json.hpp": "//\n"})
    gguf = search / "antirez+gguf-tools" / "repo"
    gguf.mkdir(parents=True)
    git.init(gguf)
    _commit(gguf, {"gguflib.c": "//\n"})
    (project["root"] / "templates").mkdir()
    (project["root"] / "pyproject.toml").write_text("")
    monkeypatch.chdir(project["root"])
    monkeypatch.setattr(mlx_build, "detect_backend", lambda *a, **k: "cpu")
    # The gguf clone here lacks upstream's commit: the stamp records the substitute.
    sub = f"gguflib={git.rev_parse(gguf, 'HEAD')}"
    r = CliRunner().invoke(main, ["deps", "--from", str(search), "--deps", str(project["deps"]),
                                  "--rev", sub, "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["backends"] == ["cpu"] and got["declared"] == ["fmt", "gguflib", "json"]
    assert sorted(p.name for p in project["deps"].iterdir()) == ["fmt", "gguflib", "json"]
    cuda = CliRunner().invoke(main, ["deps", "--from", str(search), "--deps",
                                     str(project["deps"]), "--backend", "cuda"])  # fmt: skip
    assert cuda.exit_code == 1 and "NVIDIA/cutlass" in cuda.output
    assert "cutlass" not in {p.name for p in project["deps"].iterdir()}


# A C++ compiler whose LTO cannot run: any -flto fails, as a host's broken plugin does.
BAD_LTO_CXX = """#!/bin/sh
for a in "$@"; do
  case "$a" in -flto*) echo "ld: error: could not run lto-wrapper" >&2; exit 1;; esac
done
exec g++ "$@"
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_compiler_that_cannot_link_lto_builds_without_it(
    project: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe finds a compiler whose -flto link fails (as a host's broken LTO plugin
    does) in a second, and the plan hands MLX's CMake the include that empties the IPO
    flags, saying so; a working compiler gets neither (control)."""
    bad = tmp_path / "bad-c++"
    bad.write_text(BAD_LTO_CXX)
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    assert not mlx_build.lto_links(mlx_build.compiler())
    plan = mlx_build.plan(project["root"], backend="cpu")
    build = next(s for s in plan.steps if s.stage == "build")
    assert f"-DCMAKE_PROJECT_INCLUDE={mlx_build.NO_IPO_CMAKE}" in build.env["CMAKE_ARGS"]
    assert plan.no_lto and plan.no_lto in plan.describe()
    monkeypatch.setenv("CXX", shutil.which("g++") or "g++")
    assert mlx_build.lto_links(mlx_build.compiler())
    plan = mlx_build.plan(project["root"], backend="cpu")
    assert not plan.no_lto and "CMAKE_PROJECT_INCLUDE" not in plan.steps[-1].env.get(
        "CMAKE_ARGS", ""
    )


@pytest.mark.skipif(
    not (shutil.which("cmake") and shutil.which("ninja") and shutil.which("g++")),
    reason="needs cmake, ninja and g++",
)
def test_the_no_ipo_include_links_an_lto_target_without_lto(tmp_path: Path) -> None:
    """A target asking for IPO (as nanobind_add_module(... LTO) does) fails to link with
    that compiler, and links with the include. Control: without it, the link fails."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(t CXX)\n"
        "add_library(m MODULE m.cpp)\n"
        "set_target_properties(m PROPERTIES INTERPROCEDURAL_OPTIMIZATION_RELEASE ON)\n"
    )
    (tmp_path / "src" / "m.cpp").write_text("int f() { return 1; }\n")
    bad = tmp_path / "bad-c++"
    bad.write_text(BAD_LTO_CXX)
    bad.chmod(0o755)
    env = {**os.environ, "CXX": str(bad)}

    def build(folder: str, *extra: str) -> int:
        configure = ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / folder)]
        configure += ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *extra]
        subprocess.run(configure, env=env, check=True, capture_output=True)
        done = subprocess.run(["cmake", "--build", str(tmp_path / folder)], env=env,
                              capture_output=True)  # fmt: skip
        return done.returncode

    assert build("with-lto") != 0
    assert build("no-lto", f"-DCMAKE_PROJECT_INCLUDE={mlx_build.NO_IPO_CMAKE}") == 0


def _wheel(
    folder: Path, name: str, version: str, requires: tuple[str, ...] = (),
    extra: dict[str, str] | None = None,
) -> Path:  # fmt: skip
    """A minimal pure-Python wheel: what a package index would serve, for pip's resolver."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files = {
        f"{name.replace('-', '_')}/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}.dist-info/METADATA": meta + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
        **(extra or {}),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    out = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def test_the_patched_mlx_survives_pip_install_of_an_engine(tmp_path: Path) -> None:
    """After --into, the venv's pip keeps the patched MLX: an engine needing a newer mlx fails
    loudly and `pip install -U mlx` keeps it. A local wheel folder stands in for the index
    (a newer stock mlx, an mlx-lm that requires it). Control: without the constraint,
    pip swaps stock back in silently."""
    import subprocess

    patched, index = "0.32.1+patchkit.933be83c5fd1", tmp_path / "index"
    (tmp_path / "ours").mkdir()
    index.mkdir()
    ours = _wheel(tmp_path / "ours", "mlx", patched)
    _wheel(index, "mlx", "0.32.4")
    _wheel(index, "mlx-lm", "0.32.2", requires=("mlx>=0.32.2",))

    def venv(name: str, keep: bool) -> Callable[..., subprocess.CompletedProcess[str]]:
        where = tmp_path / name
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)

        def pip(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(where / "bin" / "python"), "-m", "pip", "--disable-pip-version-check",
                 *args, *(["-q", "--no-index", "--find-links", str(index)]
                          if args[0] == "install" else [])],
                capture_output=True, text=True, check=False, timeout=300,
            )  # fmt: skip

        assert pip("install", str(ours)).returncode == 0
        if keep:
            assert "keeps mlx==" in mlx_build.keep_installed(where, patched)
            assert "keeps mlx==" in mlx_build.keep_installed(where, patched)  # idempotent
            assert (where / "pip.conf").read_text().count("constraint =") == 1
        return pip

    def version(pip: Callable[..., subprocess.CompletedProcess[str]]) -> str:
        shown = pip("show", "mlx").stdout
        return next(line.split(": ", 1)[1] for line in shown.splitlines()
                    if line.startswith("Version:"))  # fmt: skip

    kept = venv("kept", keep=True)
    engine = kept("install", "mlx-lm")
    assert engine.returncode != 0 and "mlx" in engine.stderr and version(kept) == patched
    kept("install", "-U", "mlx")
    assert version(kept) == patched
    control = venv("control", keep=False)
    assert control("install", "mlx-lm").returncode == 0 and version(control) == "0.32.4"


def test_keep_installed_leaves_a_users_own_install_section_alone(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[install]\nno-compile = yes\n")
    said = mlx_build.keep_installed(tmp_path, "0.32.1+patchkit.abc")
    assert conf.read_text() == "[install]\nno-compile = yes\n" and "add `constraint = " in said
    assert (tmp_path / mlx_build.CONSTRAINT_FILE).read_text().endswith("mlx==0.32.1+patchkit.abc\n")
    assert mlx_build.release_line(tmp_path).startswith(": > ")


ENV_LINUX = {"os_name": "posix", "sys_platform": "linux", "platform_system": "Linux",
             "platform_machine": "x86_64", "python_version": "3.12"}  # fmt: skip


def test_requirement_conflicts_weigh_markers_and_extras() -> None:
    """mlx-lm's real requirements: mlx>=0.32.2 on macOS, in its extras elsewhere."""
    probe = {"env": ENV_LINUX, "requires": [
        ["mlx-lm", "0.32.2", 'mlx>=0.32.2; platform_system == "Darwin"'],
        ["mlx-lm", "0.32.2", 'mlx[cpu]>=0.32.2; extra == "cpu"'],
        ["engine", "1.0", "mlx>=0.30"],
    ]}  # fmt: skip
    version = "0.32.1+patchkit.933be83c5fd1"
    conflicts, notes = mlx_build.requirement_conflicts(probe, version)
    assert conflicts == [] and notes == [
        'mlx-lm 0.32.2 with an extra requires mlx[cpu]>=0.32.2; extra == "cpu"'
    ]
    mac = {**probe, "env": {**ENV_LINUX, "sys_platform": "darwin", "platform_system": "Darwin"}}
    conflicts, _ = mlx_build.requirement_conflicts(mac, version)
    assert conflicts == ['mlx-lm 0.32.2 requires mlx>=0.32.2; platform_system == "Darwin"']
    # the local version label is the release's: ==0.32.1 accepts the patched build
    same = {"env": ENV_LINUX, "requires": [["engine", "1.0", "mlx==0.32.1"]]}
    assert mlx_build.requirement_conflicts(same, version) == ([], [])


def test_into_refuses_a_venv_whose_engine_needs_another_release(tmp_path: Path) -> None:
    """Before any build: one line naming the package, its requirement and the release to
    build. Control: the same venv with an engine that accepts the build passes."""
    import subprocess

    venv = tmp_path / "engine"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    strict = _wheel(wheels, "mlx-lm", "0.32.2", requires=("mlx>=0.32.2",))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, str(strict)], check=True)
    version = "0.32.1+patchkit.933be83c5fd1"
    with pytest.raises(UserError) as err:
        mlx_build.check_into(venv, sys.executable, version)
    line = str(err.value)
    assert "mlx-lm 0.32.2 requires mlx>=0.32.2" in line and "\n" not in line
    assert "patchkit rebase --to v0.32.2" in line
    lenient = _wheel(wheels, "mlx-lm", "0.32.3", requires=("mlx>=0.30",))
    subprocess.run([*pip, str(lenient)], check=True)
    assert mlx_build.check_into(venv, sys.executable, version) == venv / "bin" / "python"


def test_install_puts_the_built_wheel_in_as_build_into_does(
    project: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`patchkit install --into VENV` (the line build prints) is build --into's code: the
    wheel installed and kept. Control: before a build there is no wheel, one line."""
    import subprocess

    (project["root"] / "templates").mkdir()
    (project["root"] / "pyproject.toml").write_text("")
    monkeypatch.chdir(project["root"])
    plan = mlx_build.plan(project["root"], backend="cpu")
    venv = tmp_path / "engine"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    args = ["install", "--backend", "cpu", "--into", str(venv), "--json"]
    none = CliRunner().invoke(main, args)
    assert none.exit_code == 1 and "run `patchkit build --backend cpu` first" in none.output
    plan.layout.dist.mkdir(parents=True)
    core = {"mlx/core.py": f"__version__ = {plan.version!r}\n"}
    _wheel(plan.layout.dist, "mlx", plan.version, extra=core)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    done = json.loads(r.stdout)
    assert done["mlx_version"] == plan.version and "keeps mlx==" in done["kept"]
    assert (venv / mlx_build.CONSTRAINT_FILE).read_text().endswith(f"mlx=={plan.version}\n")
    assert mlx_build.install_line("cpu") == "patchkit install --backend cpu --into VENV"


def test_a_plain_build_keeps_its_record_out_of_the_checkout(
    project: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`patchkit build` writes its record beside the build in the cache, so a fresh clone's
    `git status` stays clean; `--record-dir` is how the project refreshes docs/results."""
    (project["root"] / "templates").mkdir()
    (project["root"] / "pyproject.toml").write_text("")
    monkeypatch.chdir(project["root"])
    plan = mlx_build.plan(project["root"], backend="cpu")
    parity = {"rows_differing": 0, "rows": 8, "kernel_paths": ["qmv"]}
    monkeypatch.setattr(mlx_build, "execute", lambda *a, **k: {
        "wheel": None, "tests": None, "parity": parity, "mlx_version": plan.version,
        "backend": "cpu"})  # fmt: skip
    written: list[Path] = []
    monkeypatch.setattr(mlx_build, "write_record",
                        lambda rec, out: written.append(out) or out / "build-cpu.json")  # fmt: skip
    for args, where in (([], plan.layout.base), (["--record-dir", "docs/results"],
                                                 Path("docs/results"))):  # fmt: skip
        r = CliRunner().invoke(main, ["build", "--backend", "cpu", *args])
        assert r.exit_code == 0, r.output
        assert written[-1] == where


def test_the_patchs_own_tests_start_first(project: dict[str, Path]) -> None:
    """The methods the patch adds to MLX's test file start before all others, so a run cut
    short by --test-timeout still has their verdicts; the pin's own methods are not named
    (here the patch adds none: control)."""
    patched = TESTS_PY + "\n    def test_new_b(self):\n        pass\n\n    def test_new_a(self):\n"
    assert mlx_build.new_test_methods(TESTS_PY, patched) == [
        "test_new_b", "test_new_a",
    ]  # fmt: skip
    plan = mlx_build.plan(project["root"], backend="cpu")
    test = next(s for s in plan.steps if s.stage == "test")
    assert "--first" not in test.argv


def test_pr_tests_folder_is_the_applied_branchs_without_a_build(
    project: dict[str, Path], tmp_path: Path
) -> None:
    """What stock runs of the PR's tests: the applied branch's python/tests, written whole
    into a new or empty folder; anything else is refused and left as it was."""
    dest = tmp_path / "out" / "tests"
    mlx_build.write_pr_tests(project["root"], dest)
    assert sorted(p.name for p in dest.iterdir()) == ["test_quantized.py"]
    assert (dest / "test_quantized.py").read_text() == TESTS_PY
    assert [p.name for p in dest.parent.iterdir()] == ["tests"]  # no staging left behind
    (dest / "test_quantized.py").write_text("mine")
    with pytest.raises(UserError, match="not a new or empty folder"):
        mlx_build.write_pr_tests(project["root"], dest)
    assert (dest / "test_quantized.py").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    mlx_build.write_pr_tests(project["root"], empty)
    assert (empty / "test_quantized.py").read_text() == TESTS_PY
    assert not (mlx_build.layout("cpu", "x").base.exists())  # nothing built


@pytest.mark.skipif(mlx_clone() is None, reason="needs a full MLX clone: set PATCHKIT_MLX_REPO")
def test_pr_tests_folder_holds_the_prs_rendered_tests(tmp_path: Path) -> None:
    """On MLX itself, after ``patchkit apply`` (of a copy of this checkout): the folder has
    MLX's test files and the PR's tests rendered into test_quantized.py, as a build's
    worktree has them (control: the pin's own file lacks them)."""
    from patchkit.carry import pin

    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copyfile(ROOT / "pin.toml", root / "pin.toml")
    for name in ("templates", "patches"):
        shutil.copytree(ROOT / name, root / name)
    p = pin.load(root / pin.PIN_FILE)
    done = CliRunner().invoke(main, ["apply", "--pin", p.short, "--root", str(root),
                                     "--mlx-repo", mlx_clone()])  # fmt: skip
    assert done.exit_code == 0, done.output
    mlx_build.write_pr_tests(root, tmp_path / "tests", mlx_clone())
    text = (tmp_path / "tests" / "test_quantized.py").read_text()
    assert "def test_qmv_tensor_cores_match_single_vector" in text
    clone = source.clone_dir(source.source_spec(mlx_clone(), p.url))
    pinned = git.show_file(clone, p.commit, "python/tests/test_quantized.py")
    assert "def test_qmv_tensor_cores_match_single_vector" not in pinned
    assert (tmp_path / "tests" / "mlx_tests.py").is_file()
