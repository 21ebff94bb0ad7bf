#!/usr/bin/env bash
# patchkit probe on the H200: stock MLX vs the streamed kernel, block vs chain, 3B-class model.
#
# The GPU host has no package index, so MLX's CUDA runtime travels packed in two halves
# (the pack script, shared/tools/pack-mlx-cuda.sh beside the checkout: .mlxpack/a and
# .mlxpack/b, each under the 64 MiB carry limit) and the cuda_kernel header travels in the git-ignored .device/ (it holds MLX
# source; built here by scripts/cuda_jit_bundle.py or patchkit.verify.harness.cuda.build_bundle).
#
#   call 1:  bash scripts/probe_h200.sh stage            carry [".mlxpack/a"]
#   call 2:  bash scripts/probe_h200.sh run [ARGS...]    carry [".mlxpack/b", ".device"]
#
# Call 2 must follow call 1 while the machine is warm (part a is kept in /tmp). If an
# unpacked MLX 0.32.1 is already under /tmp (a warm machine from another run), call 2
# alone is enough. Results: $OUT/probe-h200.json and .md, rewritten after each (bits, arm).
set -euo pipefail
mode=${1:?usage: probe_h200.sh stage|run [probe args...]}; shift || true
SITE=/tmp/mlx-site

find_site() {  # an importable MLX 0.32.1 with the CUDA backend already unpacked under /tmp
  for d in "$SITE" /tmp/*/; do
    d=${d%/}
    if ls "$d"/mlx/core*.so >/dev/null 2>&1 && ls "$d"/mlx/lib/libmlx.so >/dev/null 2>&1 &&
       PYTHONPATH=$d python3 -c "import mlx.core as mx, sys; sys.exit(mx.__version__ != '0.32.1' or not mx.cuda.is_available())" 2>/dev/null; then
      echo "$d"; return 0
    fi
  done
  return 1
}

# MLX's CUDA libs resolve the image's CUDA 13 runtime from the torch venv's nvidia packages
# (MLX's CUDA wheels find the runtime there on such an image).
NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
LD_LIBRARY_PATH=$(ls -d "$NV"/*/lib 2>/dev/null | tr '\n' ':')/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH

case "$mode" in
  stage)
    mkdir -p /tmp/mlxpack && cp .mlxpack/a/part_* /tmp/mlxpack/ && ls -la /tmp/mlxpack ;;
  run)
    if site=$(find_site); then
      echo "reusing unpacked MLX at $site"
    else
      ls /tmp
      ls /tmp/mlxpack/part_* >/dev/null 2>&1 || { echo "no unpacked MLX and no staged part a: run 'stage' first" >&2; exit 4; }
      site=$SITE; mkdir -p "$site"
      cat /tmp/mlxpack/part_* .mlxpack/b/part_* | tar xJf - -C "$site"
      python3 -c "import zipfile,glob,sys; zipfile.ZipFile(glob.glob('.mlxpack/b/mlx-0.32.1-*.whl')[0]).extractall(sys.argv[1])" "$site"
      ln -sfn "$NV" "$site/nvidia"
    fi
    # The streamed arm's many distinct cuda_kernel graphs overflow MLX's default CUDA graph
    # cache (400) during per-op parity: "Cache thrashing is happening" then an abort.
    export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 MLX_CUDA_GRAPH_CACHE_SIZE=${MLX_CUDA_GRAPH_CACHE_SIZE:-100000}
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
    out=${OUT:-/tmp/probe-out}; mkdir -p "$out"
    python3 -m patchkit.verify.probe --size 3b --timing --repeats 3 \
      --cuda-header .device/probe/qmv_jit_header.cuh --out "$out/probe-h200.json" "$@" ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
