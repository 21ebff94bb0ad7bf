"""Build the cuda_kernel header for the GPU host from the pinned ``qmv.cu`` (CPU only).

Usage: python scripts/cuda_jit_bundle.py [MLX_GIT_DIR] [COMMIT]  -> .device/cuda_jit/
MLX_GIT_DIR is a clone of ml-explore/mlx holding COMMIT (default: the pin); without
it, ``PATCHKIT_MLX_REPO`` names one.
Writes one header per x-staging variant: ``qmv_jit_header.cuh`` (``global``: x
read from global memory, the baseline arm) and ``qmv_jit_header_smem.cuh``
(``smem``, the default render; the harness sets its knobs per arm, and the
shipped shape is the arm ``smem_v24_w2_pf_async_4warps``).
The output holds upstream MLX text, so it goes to the git-ignored ``.device/``
and travels with ``run --carry .device``; it is never committed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from patchkit.carry import render, source
from patchkit.verify.harness import cuda

PIN = "9a795735ad9a42664e08f42361b405ed570bcf1a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "git_dir",
        nargs="?",
        type=Path,
        default=os.environ.get(source.ENV_REPO),
        help=f"MLX clone holding COMMIT (default: env {source.ENV_REPO})",
    )
    ap.add_argument("commit", nargs="?", default=PIN, help="MLX commit (default: the pin)")
    args = ap.parse_args()
    if args.git_dir is None:
        ap.error(f"no MLX clone: pass MLX_GIT_DIR or set {source.ENV_REPO}=/path/to/mlx")
    read = source.reader(Path(args.git_dir), args.commit)
    for variant in cuda.HEADER_NAMES:
        options = render.RenderOptions(cuda_x_staging=variant)
        print(cuda.build_bundle(read(cuda.QMV_PATH), Path(".device/cuda_jit"), options, read))


if __name__ == "__main__":
    main()
