"""What the CUDA PR's ``qmv.cu`` adds to MLX's library and build time: no GPU needed.

    python3 bench/cuda_compile_cost.py run [--arch 90a-real ...] [--deps DIR] \
        [--out docs/results/cuda-compile-cost]
    python3 bench/cuda_compile_cost.py page docs/results/cuda-compile-cost.json

``run`` exports the pinned tree from the MLX clone (``PATCHKIT_MLX_REPO``, else pin.toml's
URL), renders the series' CUDA files into a copy of it, and compiles both trees' ``qmv.cu``
for every architecture MLX's wheels ship (or those given), with MLX's nvcc flags and
includes and MLX's configure-time sources from ``patchkit deps``'s folder
(``patchkit.verify.harness.cuda_compile`` says what is measured and what is a proxy).
The objects are compiled MLX code: they stay in a temporary folder. ``page`` remakes the
Markdown from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patchkit.verify.harness import cuda, cuda_compile

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = "mlx/backend/cuda/"


def trees(work: Path, deps: Path) -> tuple[dict[str, Path], dict[str, list[str]], list[str], str]:
    """Both arms' trees under ``work``: ({arm: qmv.cu}, {arm: nvcc flags}, the wheel's
    architectures, the pinned commit)."""
    from patchkit.carry import pin, render, source
    from patchkit.util import git

    if missing := cuda.missing_deps(deps):
        raise SystemExit(f"MLX's configure-time sources missing: {', '.join(missing)} "
                         "(`patchkit deps --backend cuda`)")  # fmt: skip
    sha = pin.load(ROOT / pin.PIN_FILE).commit
    clone = source.ensure_clone(os.environ.get("PATCHKIT_MLX_REPO") or pin.UPSTREAM_URL)
    read = source.reader(clone, sha)
    roots = {arm: work / arm for arm in cuda_compile.ARMS}
    git.export(clone, sha, roots["stock"], ["mlx"])
    shutil.copytree(roots["stock"], roots["patched"], symlinks=True)
    options = render.RenderOptions()
    for plan in render.load_plans():
        if plan.path.startswith(CUDA_DIR):
            (roots["patched"] / plan.path).write_text(
                render.render_file(plan, read(plan.path), options)
            )
    cmake = read(cuda_compile.CUDA_CMAKE)
    flags = {arm: cuda.mlx_flags(cmake, roots[arm].resolve(), deps) for arm in roots}
    sources = {arm: roots[arm] / cuda.QMV_PATH for arm in roots}
    return sources, flags, cuda_compile.wheel_archs(read(cuda_compile.SETUP_PY)), sha


def run(out: Path, archs: list[str], deps: Path | None = None) -> None:
    """Measure, then write ``out``.json and .md. ``deps``: MLX's configure-time sources
    (default: ``patchkit deps``'s folder in the cache)."""
    from patchkit.carry import mlx_build, mlx_deps, pin

    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc not on PATH")
    with tempfile.TemporaryDirectory(prefix="patchkit-compile-cost-") as tmp:
        sources, flags, shipped, sha = trees(Path(tmp), deps or mlx_deps.deps_root())
        if unknown := sorted(set(archs) - set(shipped)):
            raise SystemExit(f"--arch {', '.join(unknown)}: MLX's wheels ship {', '.join(shipped)}")
        rows = cuda_compile.measure(sources, flags, archs or shipped, Path(tmp))
    short = pin.load(ROOT / pin.PIN_FILE).short
    command = " ".join(["python3 bench/cuda_compile_cost.py run",
                        *(f"--arch {a}" for a in archs), f"--out {out.as_posix()}"])  # fmt: skip
    meta = {"command": command, "name": out.name, "mlx_commit": sha,
            "build_inputs_sha256": mlx_build.build_inputs_id(ROOT, short, "cuda"),
            "shipped_archs": shipped, "host": cuda_compile.host()}  # fmt: skip
    cuda_compile.write(cuda_compile.record(rows, meta), out)
    print(out.with_suffix(".md").read_text(), end="")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--arch", action="append", default=[],
                   help="one of setup.py's cuda_archs (repeat; default: all of them)")  # fmt: skip
    r.add_argument("--out", type=Path, default=Path("docs/results/cuda-compile-cost"))
    r.add_argument("--deps", type=Path, help="MLX's configure-time sources (`patchkit deps`)")
    p = sub.add_parser("page")
    p.add_argument("json", type=Path)
    args = ap.parse_args()
    if args.cmd == "page":
        try:
            data = json.loads(args.json.read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"{args.json}: {err}") from None
        sys.stdout.write(cuda_compile.page(data))
        return 0
    run(args.out, args.arch, args.deps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
