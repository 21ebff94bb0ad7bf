"""Build the cuda_kernel header for the GPU host from the pinned ``qmv.cu`` (CPU only).

Usage: python scripts/cuda_jit_bundle.py [MLX_GIT_DIR] [COMMIT]  -> .device/cuda_jit/
Writes one header per x-staging variant: ``qmv_jit_header.cuh`` (``global``: x
read from global memory, session 1's kernel, the baseline arm) and
``qmv_jit_header_smem.cuh`` (``smem``, the default render since session 2; the
harness sets its knobs per arm, and the shipped shape is the arm
``smem_v24_w2_pf_async_4warps``).
The output holds upstream MLX text, so it goes to the git-ignored ``.device/``
and travels with ``run --carry .device``; it is never committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from patchkit.carry import render, source
from patchkit.verify.harness import cuda

PIN = "9a795735ad9a42664e08f42361b405ed570bcf1a"
DEFAULT_GIT = "/work/.mirror/ml-explore+mlx/repo"


def main() -> None:
    git_dir = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GIT
    commit = sys.argv[2] if len(sys.argv) > 2 else PIN
    read = source.reader(Path(git_dir), commit)
    for variant in cuda.HEADER_NAMES:
        options = render.RenderOptions(cuda_x_staging=variant)
        print(cuda.build_bundle(read(cuda.QMV_PATH), Path(".device/cuda_jit"), options, read))


if __name__ == "__main__":
    main()
