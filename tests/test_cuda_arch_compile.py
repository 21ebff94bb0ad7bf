"""The patched ``qmv.cu`` compiles for every architecture MLX's CUDA wheels ship.

A real compile per architecture (``nvcc -c``: cicc, then ptxas on the result),
with MLX's own nvcc flags and include directories as its CMake build uses them:

* the architectures come from the pinned ``setup.py`` (``cuda_archs``), and the
  flags from the pinned ``mlx/backend/cuda/CMakeLists.txt`` (every
  ``$<$<COMPILE_LANGUAGE:CUDA>:...>`` option), so a pin bump carries its own;
* the sources are the pinned tree (``git archive`` of ``mlx/``), the patched
  ``qmv.cu`` rendered into it;
* MLX's configure-time downloads come from the dependency directory
  (the user cache's ``deps`` folder, ``patchkit deps``; one folder per FetchContent
  name): ``cutlass`` and ``fmt`` are required, ``cccl`` is used when present
  (else the toolkit's bundled CCCL).

The stock file compiled for sm_75 is the control: it must pass too, so a
failure of ours is ours. A ``*-virtual`` entry is compiled to SASS as well
(``code=sm_XX``), so ptxas checks that PTX the way a driver JIT would.

Cost: each architecture is a minute or more of one core (every qmv
instantiation). The default run compiles sm_75 (MLX's CUDA CI, the one without
cp.async) and sm_90a (the H200); ``--wide`` adds the rest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support_git import PIN_SHA, mlx_clone

from patchkit.carry import mlx_deps, render, source
from patchkit.util import git
from patchkit.verify.harness import cuda, cuda_compile
from patchkit.verify.harness.cuda_compile import wheel_archs

QMV = cuda.QMV_PATH
NVCC = shutil.which("nvcc")
# The default run's architectures; the rest of setup.py's list runs with --wide.
DEFAULT_ARCHS = ("75-real", "90a-real")
# What the pinned setup.py ships (Linux adds the last three); the test reads it
# from the pin and checks this list against it, so it cannot go stale silently.
WHEEL_ARCHS = (
    "75-real",
    "80-real",
    "120a-real",
    "120-virtual",
    "90a-real",
    "100a-real",
    "121a-real",
)


def deps_root() -> Path:
    """MLX's configure-time downloads, one folder per FetchContent name: the user's
    (``patchkit deps``), which the suite's own fresh cache root does not hold; read only."""
    user = os.environ.get("PATCHKIT_TEST_USER_DEPS")
    return Path(user) if user else mlx_deps.deps_root()


def test_wheel_archs_and_flags_parse() -> None:
    """The parsers on text shaped like the pin's (no clone needed)."""
    setup = """
            cuda_archs = [
                "75-real",
                "120-virtual",
            ]
            if platform.system() == "Linux":
                cuda_archs += ["90a-real"]
            cmake_args += [f"-DMLX_CUDA_ARCHITECTURES={';'.join(cuda_archs)}"]
    """
    assert wheel_archs(setup) == ["75-real", "120-virtual", "90a-real"]
    assert cuda_compile.gencode("90a-real") == "arch=compute_90a,code=sm_90a"
    assert cuda_compile.gencode("120-virtual") == "arch=compute_120,code=sm_120"
    cmake = (
        'target_compile_options(mlx\n  PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:--extended-lambda>")\n'
        "target_compile_options(\n  mlx\n"
        '  PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcudafe="--diag_suppress=186,2908">)\n'
    )
    assert cuda.cuda_flags(cmake) == ["--extended-lambda", '-Xcudafe="--diag_suppress=186,2908"']


needs_clone = pytest.mark.skipif(
    mlx_clone() is None,
    reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The pinned mlx/ tree on disk, the stock and patched qmv.cu beside each other."""
    clone = source.ensure_clone(mlx_clone())
    read = source.reader(clone, PIN_SHA)
    root = tmp_path_factory.mktemp("mlx")
    git.export(clone, PIN_SHA, root, ["mlx"])
    plan = next(p for p in render.load_plans() if p.path == QMV)
    patched = render.render_file(plan, read(QMV), render.RenderOptions(backends=("cuda",)))
    (root / QMV).with_name("qmv_patched.cu").write_text(patched)
    return {"root": root, "read": read}


def _nvcc(tree: dict[str, object], arch: str, name: str, tmp_path: Path) -> None:
    """nvcc -c of ``name`` (beside qmv.cu in the pinned tree) for one architecture, as
    ``bench/cuda_compile_cost.py`` compiles it; skips naming a missing download."""
    root: Path = tree["root"]  # type: ignore[assignment]
    read = tree["read"]
    if missing := cuda.missing_deps(deps_root()):
        pytest.skip(
            f"MLX's configure-time sources missing: {', '.join(missing)}; export cutlass "
            "v4.4.2's include/ and fmt 12.1.0 there (`patchkit deps --from DIR --backend cuda`)"
        )
    flags = cuda.mlx_flags(read(cuda_compile.CUDA_CMAKE), root, deps_root())  # type: ignore[operator]
    source = (root / QMV).with_name(name)
    out = tmp_path / f"{name}.{arch}.o"
    cmd = cuda_compile.object_command(flags, source, arch, out, nvcc=str(NVCC))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 0, f"{arch}: {len(errors)} error lines, e.g.\n" + "\n".join(
        errors[:20] or proc.stderr.splitlines()[-40:]
    )


@needs_clone
@pytest.mark.clone
def test_wheel_archs_are_the_pins(tree: dict[str, object]) -> None:
    """WHEEL_ARCHS is what the pinned setup.py builds; MLX's flags are found."""
    read = tree["read"]
    assert tuple(wheel_archs(read("setup.py"))) == WHEEL_ARCHS  # type: ignore[operator]
    cmake = read(cuda_compile.CUDA_CMAKE)  # type: ignore[operator]
    assert "--expt-relaxed-constexpr" in cuda.cuda_flags(cmake)


@needs_clone
@needs_nvcc
@pytest.mark.clone
def test_stock_qmv_compiles_for_sm75(tree: dict[str, object], tmp_path: Path) -> None:
    """The control: unpatched qmv.cu with the same command, for MLX's CI architecture."""
    _nvcc(tree, "75-real", "qmv.cu", tmp_path)


@needs_clone
@needs_nvcc
@pytest.mark.clone
@pytest.mark.parametrize(
    "arch",
    [a if a in DEFAULT_ARCHS else pytest.param(a, marks=pytest.mark.wide) for a in WHEEL_ARCHS],
)
def test_patched_qmv_compiles(tree: dict[str, object], tmp_path: Path, arch: str) -> None:
    """The patched qmv.cu (default render) compiles for ``arch``: cicc and ptxas, no errors."""
    _nvcc(tree, arch, "qmv_patched.cu", tmp_path)
