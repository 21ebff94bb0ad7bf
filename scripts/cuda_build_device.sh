#!/usr/bin/env bash
# `patchkit build --backend cuda` on a GPU host that reaches no network, in steps that fit
# a time-limited remote call: `start` prepares and launches the build in its own session,
# `wait SECONDS` follows it, `bench SECONDS` times the compiled patched MLX against the
# stock wheel (scripts/cuda_compiled_bench.py). Everything lands in $WORK; results are
# copied to OUTDIR.
#
# Carried beside the checkout (git-ignored; name these paths, not all of .device/):
#   .device/deps.tar.xz   the dependency directory (`patchkit deps`), tarred
#   .device/mlx-pin.git   a shallow clone holding the pin and the patchkit/<pin> branch
#   .whl/                 patchkit's pure-Python dependencies the host lacks (GitPython,
#                         gitdb, smmap, unidiff, tomlkit, platformdirs: `pip download`)
#   .mlxpack/{a,b}        the stock CUDA wheels (shared/tools/pack-mlx-cuda.sh), for `bench`
# `prepare` makes the first two here, after `patchkit apply` and `patchkit deps`.
# Usage: scripts/cuda_build_device.sh prepare|start|wait|bench OUTDIR [SECONDS]
#
# Seen on one H200 host (16 cores, MLX_CUDA_ARCHITECTURES=90a): configure takes seconds
# offline, and 100 of 242 build steps were done after about 4 minutes: plan two or three
# back-to-back calls for the build, then `wait`, then `bench`.
set -euo pipefail
cmd=${1:?usage: cuda_build_device.sh prepare|start|wait|bench OUTDIR [SECONDS]}
out=${2:-$PWD}
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
    cp "$WORK/cache/builds/cuda-"*/parity.json "$out/parity.json" 2>/dev/null || true
  else
    echo "still building"
  fi
  tail -c 200000 "$WORK/cache/builds/cuda-"*/build.log > "$out/build-log-tail.txt" 2>/dev/null || true
  cp "$WORK/build.err" "$out/build-progress.txt" 2>/dev/null || true
}

case "$cmd" in
  prepare)  # here, not on the GPU host
    short=$(python3 -c "from patchkit.carry import pin; print(pin.load(__import__('pathlib').Path('$repo/pin.toml')).short)")
    clone=$(python3 -c "from patchkit.carry import source; print(source.clone_dir(source.source_spec(None)))")
    deps=$(python3 -c "from patchkit.carry import mlx_deps; print(mlx_deps.deps_root())")
    mkdir -p "$repo/.device"
    (cd "$deps" && tar cf - .) | xz -T0 -6 > "$repo/.device/deps.tar.xz"
    rm -rf "$repo/.device/mlx-pin.git" && git init -q --bare "$repo/.device/mlx-pin.git"
    git -C "$repo/.device/mlx-pin.git" fetch -q --depth 3 "file://$clone" \
      "+refs/heads/patchkit/$short:refs/heads/patchkit/$short"
    du -sh "$repo/.device/deps.tar.xz" "$repo/.device/mlx-pin.git"
    ;;
  start)
    mkdir -p "$WORK/deps" "$WORK/site"
    tar xJf "$repo/.device/deps.tar.xz" -C "$WORK/deps"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$repo"/.whl/*.whl
    nvidia-smi -L; nvcc --version | tail -1
    # The carried clone holds the pin and the patchkit/<pin> branch `patchkit apply` made.
    python3 -c "from patchkit.carry import source; print(source.ensure_clone(source.source_spec(None)))"
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
