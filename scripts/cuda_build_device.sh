#!/usr/bin/env bash
# `patchkit build --backend cuda` on a GPU host that reaches no network, in steps that fit
# a time-limited remote call: `start` prepares and launches the build in its own session,
# `wait SECONDS` follows it, `bench SECONDS` times the compiled patched MLX against the
# stock wheel (scripts/cuda_compiled_bench.py). Everything lands in $WORK; results are
# copied to OUTDIR.
#
# Carried beside the checkout (git-ignored), made on a machine with the network:
#   .device/deps.tar.xz   `patchkit deps --from MIRRORS --deps D`, then `tar cJf` of D
#   .device/mlx-pin.git   a (shallow) clone holding the pinned MLX commit
#   .whl/                 patchkit's pure-Python dependencies the host lacks
#   .mlxpack/{a,b}        the stock CUDA wheels (shared/tools/pack-mlx-cuda.sh), for `bench`
# Usage: scripts/cuda_build_device.sh start|wait|bench OUTDIR [SECONDS]
set -euo pipefail
cmd=${1:?usage: cuda_build_device.sh start|wait|bench OUTDIR [SECONDS]}
out=${2:?OUTDIR}
secs=${3:-500}
repo=$(cd "$(dirname "$0")/.." && pwd)
WORK=${PATCHKIT_DEVICE_WORK:-/tmp/patchkit-device}
ARCH=${MLX_CUDA_ARCHITECTURES:-90a}
export PYTHONPATH="$WORK/site:$repo" PYTHONUNBUFFERED=1
export PATCHKIT_CACHE_DIR="$WORK/cache" PATCHKIT_DEPS_DIR="$WORK/deps"
export PATCHKIT_MLX_REPO="$repo/.device/mlx-pin.git"
patchkit() { python3 -c "from patchkit.cli import main; main()" "$@"; }
mkdir -p "$out"

follow() {  # print the build's progress until it ends or $1 seconds pass
  local end=$((SECONDS + $1))
  while [ $SECONDS -lt $end ] && ! [ -f "$WORK/build.rc" ]; do
    sleep 20; tail -c 300 "$WORK/build.err" | tr '\r' '\n' | tail -1
  done
  if [ -f "$WORK/build.rc" ]; then
    echo "build exited $(cat "$WORK/build.rc")"
    cp "$WORK/build.out" "$out/build.json" 2>/dev/null || true
    cp "$WORK"/record/*.json "$WORK"/record/*.md "$out/" 2>/dev/null || true
    tail -c 200000 "$WORK/cache/builds/cuda-"*/build.log > "$out/build-log-tail.txt" || true
    cp "$WORK/cache/builds/cuda-"*/parity.json "$out/parity.json" 2>/dev/null || true
  else
    echo "still building"
  fi
}

case "$cmd" in
  start)
    mkdir -p "$WORK/deps" "$WORK/site"
    tar xJf "$repo/.device/deps.tar.xz" -C "$WORK/deps"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$repo"/.whl/*.whl
    nvidia-smi -L; nvcc --version | tail -1
    patchkit apply  # the deterministic patch commit; patches/ must come out unchanged
    git -C "$repo" status --short patches/ | head
    cudnn=$(python3 -c "import nvidia.cudnn as m; print(list(m.__path__)[0])")
    rm -f "$WORK/build.rc"
    setsid bash -c "python3 -c 'from patchkit.cli import main; main()' build --backend cuda \
      --system-site-packages --jobs $(nproc) --record-dir '$WORK/record' --json \
      --cmake-arg=-DMLX_CUDA_ARCHITECTURES=$ARCH --cmake-arg=-DCUDNN_INCLUDE_PATH=$cudnn/include \
      --cmake-arg=-DCUDNN_LIBRARY_PATH=$cudnn/lib > '$WORK/build.out' 2> '$WORK/build.err'; \
      echo \$? > '$WORK/build.rc'" < /dev/null &
    follow "$secs"
    ;;
  wait)
    follow "$secs"
    ;;
  bench)
    stock="$WORK/stock-site"
    if ! [ -d "$stock/mlx" ]; then
      mkdir -p "$stock"
      cat "$repo"/.mlxpack/a/part_* "$repo"/.mlxpack/b/part_* > "$WORK/m.tar.xz"
      tar xJf "$WORK/m.tar.xz" -C "$stock"
      python3 -c "import zipfile,glob,sys; zipfile.ZipFile(glob.glob('$repo/.mlxpack/b/mlx-*.whl')[0]).extractall('$stock')"
    fi
    venv_py=$(echo "$WORK"/cache/builds/cuda-*/venv/bin/python)
    python3 "$repo/scripts/cuda_compiled_bench.py" --deadline "$secs" \
      --arm "patched=$venv_py" --arm "stock=python3:$stock" --out "$out/compiled-bench.json"
    ;;
  *) echo "unknown step $cmd" >&2; exit 2 ;;
esac
