"""Upstream's kernels stay upstream's: the patched qmv.cu adds the tensor-core kernel and
leaves every kernel of the pin with the pin's PTX.

``nvcc -ptx`` (sm_90a, MLX's flags) of the pin's ``qmv.cu`` and of the rendered one;
every ``.entry`` of the pin (all 126 ``qmv_kernel`` and 126 ``gather_qmv_kernel``
instances) must have a patched counterpart with identical text once names are
normalized (the function index in block labels, ``$L__BB<function>_<block>``, shifts
because the patched module holds more kernels). Registers, instructions and their order
are compared as they are. The negative control changes one operation of upstream's
``qmv_kernel_impl`` (the per-row reduction's ``+=`` into ``-=``) and must fail.

The same PTX also shows the tensor-core kernel's weight ring in order: every read of a
slot (``ld.shared.v4``) comes after a ``cp.async.wait_group`` with no copy committed in
between. CuTe's wait is an ``asm volatile`` without a memory clobber, so nothing in the
source language stops a compiler from hoisting a read above it; this check holds it for
every instance nvcc makes. Its control drops the wait and must fail.

Cost: four PTX compiles of the whole file (about 15 s each, in parallel), and one per
kernel experiment kept in ``bench/variants`` (each must still compile).
Skipped without nvcc, a clone holding the pin, or MLX's cutlass and fmt downloads.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support_git import PIN_SHA, mlx_clone
from support_scripts import ROOT, load_script

from patchkit.carry import mlx_deps, render, source
from patchkit.util import git
from patchkit.verify.harness import cuda

NVCC = shutil.which("nvcc")
CXXFILT = shutil.which("c++filt")
DEPS = mlx_deps.deps_root()
VARIANTS = ROOT / "bench" / "variants"

pytestmark = [
    pytest.mark.clone,
    pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (CI has none)"),
    pytest.mark.skipif(CXXFILT is None, reason="c++filt (binutils) not on PATH"),
    pytest.mark.skipif(
        mlx_clone() is None,
        reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx",
    ),
]


def entries(ptx: str) -> dict[str, str]:
    """Each ``.entry``'s text by its demangled name, with the names normalized."""
    found = {}
    for m in re.finditer(r"^\.visible \.entry (\S+)\(", ptx, re.M):
        name = m.group(1)
        end = ptx.index("\n}\n", m.start())
        body = ptx[m.start() : end + 3].replace(name, "@KERNEL")
        found[name] = re.sub(r"\$L__BB\d+_", "$L__BB@_", body)
    names = list(found)
    demangled = subprocess.run(
        [str(CXXFILT)], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return dict(zip(demangled, (found[n] for n in names), strict=True))


def mismatches(stock: dict[str, str], patched: dict[str, str]) -> list[str]:
    """The pin's entries whose patched counterpart is missing or differs."""
    return [name for name, body in stock.items() if patched.get(name) != body]


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, list[str]]:
    """The pin's reader, its ``mlx/`` tree extracted, and MLX's nvcc flags for it."""
    if missing := cuda.missing_deps(DEPS):
        pytest.skip(f"MLX's configure-time sources missing: {', '.join(missing)}")
    clone = source.ensure_clone(mlx_clone())
    read = source.reader(clone, PIN_SHA)
    root = tmp_path_factory.mktemp("mlx")
    git.export(clone, PIN_SHA, root, ["mlx"])
    return read, root, cuda.mlx_flags(read("mlx/backend/cuda/CMakeLists.txt"), root, DEPS)


def nvcc_ptx(root: Path, flags: list[str], name: str, text: str) -> str:
    """``text`` as a qmv.cu beside the pin's, compiled to sm_90a PTX; the PTX."""
    src = (root / cuda.QMV_PATH).parent / f"qmv_{name}.cu"
    src.write_text(text)
    out = src.with_suffix(".ptx")
    cmd = [str(NVCC), *flags, "-arch=sm_90a", "-ptx", str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"nvcc -ptx ({name}):\n{proc.stderr[-3000:]}"
    return out.read_text()


@pytest.fixture(scope="module")
def ptx(pinned: tuple[Any, Path, list[str]]) -> dict[str, dict[str, str]]:
    """PTX entries of the pin's qmv.cu, the patched one, and the one-operation control."""
    read, root, flags = pinned
    stock_text = read(cuda.QMV_PATH)
    plan = next(p for p in render.load_plans() if p.path == cuda.QMV_PATH)
    patched = render.render_file(plan, stock_text, render.RenderOptions())
    sums = "    sum += sums[i];\n"
    assert patched.count(sums) == 1, "the control's operation moved; update the test"
    wait = "      cute::cp_async_wait<stages - 1>();\n"
    assert patched.count(wait) == 1, "the ring's wait moved; update the test"
    sources = {
        "stock": stock_text,
        "patched": patched,
        "control": patched.replace(sums, sums.replace("+=", "-=")),
        "unwaited": patched.replace(wait, ""),
    }

    def compile_one(arm: str) -> tuple[str, dict[str, str]]:
        return arm, entries(nvcc_ptx(root, flags, arm, sources[arm]))

    with ThreadPoolExecutor(len(sources)) as pool:
        return dict(pool.map(compile_one, sources))


def test_upstream_kernels_are_the_pins(ptx: dict[str, dict[str, str]]) -> None:
    """Every kernel of the pin has a patched twin with identical PTX."""
    stock = ptx["stock"]
    assert len(stock) == 252  # 126 qmv_kernel + 126 gather_qmv_kernel instances
    assert mismatches(stock, ptx["patched"]) == []


def test_new_instances_are_the_tensor_core_ones(ptx: dict[str, dict[str, str]]) -> None:
    """The patch adds qmv_mma_kernel only, for 16-bit activations and 4/8-bit weights:
    affine 4 and 8 bits x 3 group sizes, mxfp4, nvfp4 and mxfp8, each for float16 and
    bfloat16, at three launches (8 or 4 warps over K with one tile, 4 with two)."""
    extra = [n for n in ptx["patched"] if n not in ptx["stock"]]
    assert all(n.startswith("void mlx::core::cu::qmv_mma_kernel<") for n in extra), extra
    assert len(extra) == (2 * 3 + 3) * 2 * 3
    assert all("cutlass::half_t" in n or "cutlass::bfloat16_t" in n for n in extra)


def test_control_one_operation_changes_ptx(ptx: dict[str, dict[str, str]]) -> None:
    """The negative control: one operation changed, and the identity check fails."""
    bad = mismatches(ptx["stock"], ptx["control"])
    # qmv_kernel_impl is shared: every qmv and gather instance changes.
    assert len(bad) == len(ptx["stock"])


def ring_reads(entry: str) -> tuple[int, int]:
    """(reads of a ring slot, those not after a wait): a read is waited for when the last
    cp.async instruction before it, in program text, is a ``cp.async.wait_group`` rather
    than a ``cp.async.commit_group`` (the kernel's loop is unrolled over the slots, so
    each slot's wait precedes its reads in the text)."""
    reads = unwaited = 0
    last = None
    for line in entry.splitlines():
        op = line.strip()
        if op.startswith("cp.async.wait"):
            last = "wait"
        elif op.startswith("cp.async.commit"):
            last = "commit"
        elif op.startswith("ld.shared.v4"):
            reads += 1
            unwaited += last != "wait"
    return reads, unwaited


def tensor_core_entries(arm: dict[str, str]) -> dict[str, str]:
    """The patch's own kernels (``qmv_mma_kernel`` instances) of one arm's PTX."""
    return {n: body for n, body in arm.items() if "qmv_mma_kernel<" in n}


def test_ring_reads_follow_their_wait(ptx: dict[str, dict[str, str]]) -> None:
    """Every instance reads its weight ring, and only after the copies are waited for."""
    found = {n: ring_reads(body) for n, body in tensor_core_entries(ptx["patched"]).items()}
    assert len(found) == 54  # 18 per launch (warps over K, tiles)
    assert all(reads > 0 for reads, _ in found.values()), found
    assert {n: u for n, (_, u) in found.items() if u} == {}


def test_control_unwaited_ring_reads_are_seen(ptx: dict[str, dict[str, str]]) -> None:
    """The control: the wait dropped, and the ordering check fails in every instance."""
    found = {n: ring_reads(body) for n, body in tensor_core_entries(ptx["unwaited"]).items()}
    assert len(found) == 54  # 18 per launch (warps over K, tiles)
    assert all(unwaited > 0 for _, unwaited in found.values()), found


@pytest.mark.parametrize("diff", sorted(p.name for p in VARIANTS.glob("*.diff")))
def test_kept_kernel_experiments_compile(pinned: tuple[Any, Path, list[str]], diff: str) -> None:
    """Each experiment kept in bench/variants still compiles on this checkout's templates
    (as ``bench/cuda_qmv.py build --template-variant`` would), and adds code of its own:
    a diff that applies but no longer compiles is a dead experiment."""
    read, root, flags = pinned
    bench = load_script("bench/cuda_qmv.py")
    shipped, variant = bench.rendered_qmv(read), bench.rendered_qmv(read, VARIANTS / diff)
    assert variant != shipped
    assert ".entry" in nvcc_ptx(root, flags, Path(diff).stem.replace("-", "_"), variant)
