#!/usr/bin/env bash
# `patchkit build --backend cuda` on a GPU host that reaches no network, then parity and the
# compiled timing grid, as one pipeline that outlives the time-limited remote calls:
#   start OUTDIR SECONDS    unpack what was carried, launch the pipeline in its own session,
#                           follow it for SECONDS
#   follow OUTDIR SECONDS   follow it again (the next back-to-back call), copying results out
# The pipeline: build (`patchkit build --no-test`: `parity`, on the exact route, runs inside
# it), with the peers' sources compiled beside it -> MLX's test_quantized.py in the
# background (one process per test, the PR's first; TESTS="test_a test_b" runs only those;
# SHARDS="test_qmm=6" runs a test as 6 processes, scripts/mlx_test_shard.py)
# -> quick parity with the default routing, in the background too -> full parity with the
# exact route on (MLX_CUDA_QMV_EXACT=1) -> the peers swapped in and relinked -> the stock
# wheel unpacked once a call has carried its second half -> the tests waited for (TEST_WAIT s
# at most; what is left is stopped) -> scripts/cuda_compiled_bench.py twice (resumable; both
# within BENCH_DEADLINE s): every arm on PEER_BENCH's subset of the grid (default: the 8-bit
# headline; "skip"), then stock and patched on BASE_BENCH's (default: the whole grid; "skip") ->
# optional kernel-only times (KERNEL_TIMES: scripts/cuda_kernel_times.py) -> the stopped
# tests and parity again, with the failed tests on the stock wheel beside them (the base to
# read a failure against) -> the verdicts into the build record.
# Everything lands in $WORK; results are copied to OUTDIR.
#
# Carried beside the checkout (git-ignored; name these paths, not all of .device/):
#   .device/deps.tar.xz   the dependency directory (`patchkit deps`), tarred
#   .device/mlx-pin.git   a shallow clone holding the pin and the patchkit/<pin> branch
#   .whl/                 patchkit's pure-Python dependencies the host lacks (GitPython,
#                         gitdb, smmap, unidiff, tomlkit, platformdirs: `pip download`)
#   .mlxpack/{a,b}        the stock CUDA wheels (shared/tools/pack-mlx-cuda.sh), one per call
#   .peer/<name>/mlx/...  optional: another version of some MLX source files (a peer's
#                         kernel), built into another arm: its .cu/.cpp files compiled beside the
#                         build with the build's own commands and swapped in as objects
#                         (other files swapped in as sources and rebuilt); "// bench-arm:
#                         NAME KEY=VALUE..." lines in those sources make one arm each on that
#                         build
# `prepare` makes the first two here, after `patchkit apply` and `patchkit deps`.
# Usage: scripts/cuda_build_device.sh prepare|start|follow OUTDIR [SECONDS]
# (`source scripts/cuda_build_device.sh functions` only defines the steps, for the tests.)
set -euo pipefail
cmd=${1:?usage: cuda_build_device.sh prepare|start|follow|pipeline OUTDIR [SECONDS]}
out=${2:-$PWD}
secs=${3:-500}
repo=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
shard_runner=$repo/scripts/mlx_test_shard.py  # the pipeline runs from a copy in $WORK

if [ "$cmd" = prepare ]; then  # here, not on the GPU host, with this machine's settings
  py() { python3 -c "$1"; }
  short=$(py "from patchkit.carry import pin; print(pin.load(__import__('pathlib').Path('$repo/pin.toml')).short)")
  clone=$(py "from patchkit.carry import source; print(source.clone_dir(source.source_spec(None)))")
  deps=$(py "from patchkit.carry import mlx_deps; print(mlx_deps.deps_root())")
  mkdir -p "$repo/.device"
  # Without the documentation and test suites no configure step reads (json adds its tests
  # only as the main project, CCCL's are its own CTest targets): the first call carries this
  # beside the stock wheel's first half, within the 64 MiB a call carries.
  (cd "$deps" && tar cf - --exclude=./cccl/docs --exclude=./cccl/libcudacxx/test \
    --exclude=./json/docs --exclude=./json/tests --exclude=./nvtx3/docs .) \
    | xz -T0 -6 > "$repo/.device/deps.tar.xz.tmp"
  mv "$repo/.device/deps.tar.xz.tmp" "$repo/.device/deps.tar.xz"
  rm -rf "$repo/.device/mlx-pin.git" && git init -q --bare "$repo/.device/mlx-pin.git"
  git -C "$repo/.device/mlx-pin.git" fetch -q --depth 3 "file://$clone" \
    "+refs/heads/patchkit/$short:refs/heads/patchkit/$short"
  # A peer of another project, such as mlxcel's qmv.cu, is placed in .peer/<name>/ by hand.
  du -sh "$repo/.device/deps.tar.xz" "$repo/.device/mlx-pin.git" "$repo/.peer" 2>/dev/null || true
  # Every folder in .peer/ travels and becomes an arm, this run's kinds or not.
  echo "arms from .peer/: $(ls "$repo/.peer" 2>/dev/null | tr '\n' ' ')"
  exit 0
fi

WORK=${PATCHKIT_DEVICE_WORK:-/tmp/patchkit-device}
ARCH=${MLX_CUDA_ARCHITECTURES:-90a}
export PYTHONPATH="$WORK/site:$repo" PYTHONUNBUFFERED=1
export PATCHKIT_CACHE_DIR="$WORK/cache" PATCHKIT_DEPS_DIR="$WORK/deps"
export PATCHKIT_MLX_REPO="$repo/.device/mlx-pin.git"
mkdir -p "$out" "$WORK"
log() { echo "[$(date +%T)] $*" >> "$WORK/pipeline.log"; }
built() { echo "$WORK"/cache/builds/cuda-*/$1; }  # a path in what `patchkit build` made here

build_tree() {  # the CMake build folder (build.ninja's), once configured; fails before
  local f
  f=$(find "$(built mlx/build)" -maxdepth 3 -name build.ninja 2>/dev/null | head -1) || true
  [ -n "$f" ] && dirname "$f"
}

gather_carried() {  # copy what a call carried into $WORK: a path a later call does not name
  # is not kept on the host (.peer/ was gone in the second call once)
  local d
  mkdir -p "$WORK/pack"
  for d in a b; do
    [ -d "$repo/.mlxpack/$d" ] && cp -p "$repo/.mlxpack/$d"/* "$WORK/pack/"
  done
  if [ -d "$repo/.peer" ] && ! [ -d "$WORK/peer-src" ]; then  # whole, or not at all
    rm -rf "$WORK/peer-src.tmp" && cp -rp "$repo/.peer" "$WORK/peer-src.tmp" \
      && mv "$WORK/peer-src.tmp" "$WORK/peer-src"
  fi
  if ls "$WORK"/pack/part_aa "$WORK"/pack/mlx-*.whl > /dev/null 2>&1; then touch "$WORK/pack-ready"; fi
  return 0
}

follow() {  # print progress until the pipeline ends or $1 seconds pass; copy results out
  local end=$((SECONDS + $1))
  gather_carried
  while [ $SECONDS -lt $end ] && ! [ -f "$WORK/pipeline.rc" ]; do
    sleep 15
    { tail -c 300 "$WORK/build.err" 2>/dev/null | tr '\r' '\n' | tail -1; } || true
    tail -1 "$WORK/bench.log" 2>/dev/null || true
  done
  [ -f "$WORK/pipeline.rc" ] && echo "pipeline exited $(cat "$WORK/pipeline.rc")"
  tail -5 "$WORK/pipeline.log" 2>/dev/null || true
  # A call brings back at most 8 files: the JSON results and the log one by one, every
  # other log and the build record in one tarball.
  cp "$WORK"/pipeline.log "$WORK"/parity-exact.json "$WORK"/parity-default.json \
    "$WORK"/bench.json "$WORK"/bench-peers.json "$WORK"/kernel-times.json "$out/" 2>/dev/null || true
  tail -c 300000 "$(built build.log)" > "$WORK/build-log-tail.txt" 2>/dev/null || true
  (cd "$WORK" && tar czf "$out/logs.tar.gz" --ignore-failed-read record build-log-tail.txt \
    pipeline.out build.out build.err parity-*.log bench*.log kernel-times.log test-*.log \
    tests.txt stock-tests.txt peer-*.log 2>/dev/null) || true
}

peer_objects() {  # compile the peers' .cu/.cpp files while the build runs (see peer_build)
  local tdir wt src name rel obj cmd peer_src out
  until tdir=$(build_tree); do
    [ -f "$WORK/build.done" ] && return 0
    sleep 5
  done
  command -v ninja > /dev/null || { log "no ninja here: the peers rebuild after the build"; return 0; }
  wt=$(built mlx)
  for src in "$WORK"/peer-src/*/; do
    [ -d "$src/mlx" ] || continue
    name=$(basename "$src")
    if [ -n "$(cd "$src" && find mlx -type f ! -name '*.cu' ! -name '*.cpp')" ]; then
      log "peer $name: carries headers too (its objects would need them): rebuilt after the build"
      continue
    fi
    for rel in $(cd "$src" && find mlx -type f \( -name '*.cu' -o -name '*.cpp' \)); do
      obj="CMakeFiles/mlx.dir/$rel.o"
      cmd=$(ninja -C "$tdir" -t commands "$obj" 2>/dev/null | tail -1) || cmd=
      if [[ "$cmd" != *"$wt/$rel"* || "$cmd" != *"-o $obj"* || "$cmd" == *.rsp* ]]; then
        log "peer $name: no build command for $rel here; it rebuilds after the build"
        continue
      fi
      # The file beside the one it replaces (its relative includes resolve the same way),
      # compiled by the build's own command with only the source and output paths changed.
      peer_src="${rel%.*}.peer-$name.${rel##*.}"
      out="$WORK/peer-obj/$name/$rel.o"
      mkdir -p "$(dirname "$out")"
      cp "$src/$rel" "$wt/$peer_src"
      cmd=${cmd//"$wt/$rel"/"$wt/$peer_src"}
      cmd=${cmd//"$obj"/"$out"}
      log "peer $name: compiling $rel beside the build"
      (cd "$tdir" && eval "$cmd" >> "$WORK/peer-$name.log" 2>&1 && touch "$out.ok"
        rm -f "$wt/$peer_src"
        log "peer $name: $rel $([ -f "$out.ok" ] && echo compiled || echo FAILED to compile)") &
    done
  done
  wait
}

peer_build() {  # $1: a folder mirroring MLX's tree; prints the site folder of the peer arm
  # A peer's .cu and .cpp files compiled during the build (peer_objects: the build's own
  # command for the file each replaces) are swapped in as objects, and the build only
  # relinks; its other files (and sources that did not compile there) are swapped in as
  # sources and rebuilt incrementally (one nvcc process per .cu file, 5-10 minutes). A
  # swapped object keeps the patched one's mtime: a newer one would make ninja's deps log
  # stale and rebuild it from the tree's source; libmlx.so is removed instead, so it is
  # relinked.
  local src=$1 name wt tdir venv_site site stamp rel lib libroot swapped=()
  name=$(basename "$src")
  wt=$(built mlx)
  tdir=$(build_tree)
  venv_site=$(built 'venv/lib/python3*/site-packages')
  site="$WORK/peer-$name"
  stamp="$WORK/peer-$name.stamp"; touch "$stamp"; sleep 1
  for rel in $(cd "$src" && find mlx -type f); do
    if [ -f "$WORK/peer-obj/$name/$rel.o.ok" ]; then
      obj="$tdir/CMakeFiles/mlx.dir/$rel.o"
      [ -f "$obj.patched" ] || cp -p "$obj" "$obj.patched"
      cp "$WORK/peer-obj/$name/$rel.o" "$obj" && touch -r "$obj.patched" "$obj"
      swapped+=("$rel")
    else
      cp "$src/$rel" "$wt/$rel"
    fi
  done
  log "peer $name: objects ${swapped[*]:-none}; sources $(cd "$wt" && git status --short mlx | tr '\n' ' ')"
  rm -f "$tdir"/libmlx.so*
  echo "--- peer $name: relink/rebuild" >> "$WORK/peer-$name.log"
  cmake --build "$tdir" --target install -j "$(nproc)" > "$WORK/peer-$name.build.log" 2>&1
  local rc=$?
  cat "$WORK/peer-$name.build.log" >> "$WORK/peer-$name.log"
  for rel in "${swapped[@]}"; do  # the patched objects back, for the next peer's relink
    obj="$tdir/CMakeFiles/mlx.dir/$rel.o"
    cp -p "$obj.patched" "$obj"
    # A swapped object must not have been rebuilt from the patched source.
    if grep -Eq "Building [A-Z]+ object CMakeFiles/mlx.dir/$rel.o" "$WORK/peer-$name.build.log"; then
      log "peer $name: $rel was recompiled from the build tree's source: not the peer"
      rc=1
    fi
  done
  [ ${#swapped[@]} = 0 ] || rm -f "$tdir"/libmlx.so*  # the next build relinks the patched one
  [ "$rc" = 0 ] || { git -C "$wt" checkout -- mlx; return 1; }
  rm -rf "$site" && mkdir -p "$site" && cp -a "$venv_site/mlx" "$site/"
  lib=$(find "$wt/build" -path '*/mlx/lib/libmlx.so' -newer "$stamp" | head -1)
  [ -n "$lib" ] || { log "peer $name: no relinked libmlx.so"; git -C "$wt" checkout -- mlx; return 1; }
  libroot=$(dirname "$lib")/..
  (cd "$libroot" && find . -name '*.so*' -newer "$stamp") | while read -r rel; do
    cp "$libroot/$rel" "$site/mlx/$rel"; log "peer $name: $rel"
  done
  git -C "$wt" checkout -- mlx
  echo "$site"
}

tests_run() {  # $1: a name for this batch, $2: a file of unittest names; one process each,
  # TEST_JOBS at once (MLX's tests spend minutes on the host side, one core each), in the
  # build's test folder; each test's log is test-<batch>-<name>.log. $3, optional: a folder
  # holding another MLX (the stock wheel), run with python3 in place of the build's venv.
  local batch=$1 tdir py pre=
  tdir=$(built mlx/python/tests)
  py=$(built venv/bin/python)
  if [ -n "${3:-}" ]; then py=python3; pre="PYTHONPATH='$3':\$PYTHONPATH"; fi
  xargs -a "$2" -P "${TEST_JOBS:-6}" -I{} sh -c "cd '$tdir' && $pre exec timeout ${TEST_LIMIT:-1200} \
    '$py' '$shard_runner' {} > '$WORK/test-$batch-{}.log' 2>&1" &
  echo $! > "$WORK/test-$batch.pid"
  wait "$(cat "$WORK/test-$batch.pid")" || true
  touch "$WORK/test-$batch.done"
}

tests_stop() {  # stop a batch: no new test starts, the running ones end
  kill "$(cat "$WORK/test-$1.pid")" 2>/dev/null || true
  pkill -f "mlx_test_shard.py test_quantized" || true
}

tests_sharded() {  # the unittest names on stdin, each test SHARDS names ("test_qmm=6
  # test_qvm=4") as that many shards (name@IofN: scripts/mlx_test_shard.py runs every N-th
  # point of its parameter grid), one process each: such a test outlasts a lease in one
  # process. A name already a shard stays as it is.
  local t short n i
  while read -r t; do
    short=${t##*.} n=
    for kv in ${SHARDS:-}; do [ "${kv%%=*}" = "$short" ] && n=${kv#*=}; done
    if [ -z "$n" ] || [ "$n" -le 1 ]; then echo "$t"; continue; fi
    for ((i = 1; i <= n; i++)); do echo "$t@${i}of$n"; done
  done
}

test_names() {  # the unittest names of MLX's test file $1, the PR's own tests first: a
  # batch the timing stops must not be the one that loses them
  grep -oP '^    def \Ktest_\w+' "$1" | sed 's/^/test_quantized.TestQuantized./' \
    | awk '/small_batch_matches_single_vector/ { print; next } { rest[++n] = $0 }
           END { for (i = 1; i <= n; i++) print rest[i] }'
}

tests_chosen() {  # the unittest names on stdin that TESTS names (short names, space-separated;
  # unset: all), in stdin's order: a lease can finish what an earlier one left unfinished
  local t
  while read -r t; do
    if [ -z "${TESTS:-}" ] || [[ " $TESTS " == *" ${t##*.} "* ]]; then echo "$t"; fi
  done
}

ran_to_end() {  # whether batch $1's log of test $2 reached unittest's summary
  grep -qs '^Ran 1 test' "$WORK/test-$1-$2.log"
}

tests_unfinished() {  # the names in file $1 that no log of the patched build's batches
  # reports as run to its end
  local t
  while read -r t; do
    ran_to_end first "$t" || ran_to_end again "$t" || echo "$t"
  done < "$1"
}

tests_summary() {  # one line per test of file $1: its verdict, from the last of the batches
  # $2 (default: the patched build's "first again") whose log ran it to its end
  local t log b
  while read -r t; do
    log=
    for b in ${2:-first again}; do
      if ran_to_end "$b" "$t"; then log="$WORK/test-$b-$t.log"; fi
    done
    if [ -z "$log" ]; then echo "${t##*.}: unfinished"; continue; fi
    echo "${t##*.}: $(tail -1 "$log") ($(grep -c '\.\.\. FAIL$' "$log") FAIL lines)"
  done < "$1"
}

tests_into_record() {  # the same verdicts as tests.txt, and the stock wheel's beside them
  # (tests.on_stock), into the build record's tests entry (record/ travels in logs.tar.gz):
  # after the last test of either build has ended
  local rec
  rec=$(ls "$WORK"/record/*.json 2>/dev/null | head -1) || true
  if [ -n "$rec" ]; then
    python3 "$repo/scripts/cuda_tests_record.py" "$rec" "$WORK/test-names" "$WORK" \
      >> "$WORK/pipeline.log" 2>&1 || log "tests into the build record: exit $?"
  fi
}

parity_default() {  # the quick matrix, default routing (stock qmm at M >= 8)
  local rc=0
  timeout "${PARITY_DEFAULT_LIMIT:-900}" "$(built venv/bin/python)" \
    -m patchkit.verify.mlx_parity --patched --out "$WORK/parity-default.json" \
    > "$WORK/parity-default.log" 2>&1 || rc=$?
  echo "$rc" > "$WORK/parity-default.rc"
}

tests_wait_and_rerun() {  # the patched build's tests and parity, to the end
  # The first batch may still be running (no timing stopped it): wait for it alone, not for
  # every job (the stock tests run beside this).
  if ! [ -f "$WORK/test-first.done" ] && [ -n "${tests_first_pid:-}" ]; then
    wait "$tests_first_pid" || true
  fi
  tests_unfinished "$WORK/test-names" > "$WORK/test-names-left"
  if [ -s "$WORK/test-names-left" ]; then
    log "tests stopped for the timing, run again: $(tr '\n' ' ' < "$WORK/test-names-left")"
    tests_run again "$WORK/test-names-left"
  fi
  tests_summary "$WORK/test-names" > "$WORK/tests.txt"
  cat "$WORK/tests.txt" >> "$WORK/pipeline.log"
  if ! [ -s "$WORK/parity-default.json" ]; then
    log "parity with the default routing stopped for the timing, run again"
    parity_default
    tail -2 "$WORK/parity-default.log" >> "$WORK/pipeline.log"
  fi
}

pipeline() {
  local cudnn venv_py stock tests names peer site arms=() waited=0 build_failed=
  cudnn=$(python3 -c "import nvidia.cudnn as m; print(list(m.__path__)[0])")
  # The host's numpy for the steps run here with the build's venv (patchkit build lends its
  # folder to that venv's parity step too).
  PYTHONPATH="$PYTHONPATH:$(python3 -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')"
  export PYTHONPATH
  log "build"
  # Includes on the nvcc command line, not in a response file ninja writes only while it runs
  # the command: peer_objects reruns that command by itself (same flags, same code).
  rm -f "$WORK/build.done"
  peer_objects &
  local peers_pid=$!
  [ -n "${SKIP_BUILD:-}" ] || python3 -c 'from patchkit.cli import main; main()' build --backend cuda \
    --system-site-packages --jobs "$(nproc)" --record-dir "$WORK/record" --json --no-test \
    --cmake-arg=-DMLX_CUDA_ARCHITECTURES="$ARCH" --cmake-arg=-DCUDNN_INCLUDE_PATH="$cudnn/include" \
    --cmake-arg=-DCUDNN_LIBRARY_PATH="$cudnn/lib" \
    --cmake-arg=-DCMAKE_CUDA_USE_RESPONSE_FILE_FOR_INCLUDES=OFF \
    > "$WORK/build.out" 2> "$WORK/build.err" || build_failed=1
  touch "$WORK/build.done"
  venv_py=$(built venv/bin/python)
  # Objects peer_build kept aside belong to an earlier build of this tree, not to this one.
  [ -n "${SKIP_BUILD:-}" ] || find "$(built mlx/build)" -name '*.o.patched' -delete 2>/dev/null \
    || true
  if [ -n "${build_failed:-}" ]; then
    log "build failed: $(tail -1 "$WORK/build.err")"
    # Failed after MLX was installed (its own parity step): the rest runs on that install.
    "$venv_py" -c "import mlx.core" 2>/dev/null || return 1
    log "MLX is installed in the build's venv: the pipeline goes on without a build record"
  fi
  tests=$(built mlx/python/tests/test_quantized.py)
  # MLX's test_quantized.py now, beside parity and the peer builds (the GPU is only checked
  # for correctness until the timing).
  names="$WORK/test-names"
  test_names "$tests" | tests_chosen | tests_sharded > "$names"
  log "MLX's test_quantized.py: $(wc -l < "$names") tests, one process each, ${TEST_JOBS:-6} at once"
  tests_run first "$names" &
  tests_first_pid=$!
  log "parity, quick matrix, default routing (stock qmm at M >= 8), in the background"
  parity_default &
  log "parity, full matrix, MLX_CUDA_QMV_EXACT=1"
  MLX_CUDA_QMV_EXACT=1 "$venv_py" -m patchkit.verify.mlx_parity --patched --full \
    --out "$WORK/parity-exact.json" > "$WORK/parity-exact.log" 2>&1 || log "parity-exact: rows differ"
  tail -2 "$WORK/parity-exact.log" >> "$WORK/pipeline.log"
  arms+=(--arm "patched=$venv_py" --arm-env patched:MLX_CUDA_QMV_EXACT=1)
  local base=("${arms[@]}")
  wait "$peers_pid" || true
  for src in "$WORK"/peer-src/*/; do
    [ -d "$src/mlx" ] || continue
    peer=$(basename "$src")
    if site=$(peer_build "${src%/}"); then
      # "// bench-arm: NAME KEY=VALUE..." lines in its sources: one arm each on this build.
      grep -rh '^// bench-arm: ' "$src/mlx" | cut -d' ' -f3- > "$WORK/arms-$peer" || true
      if [ -s "$WORK/arms-$peer" ]; then
        while read -r arm kvs; do
          log "arm $arm on $peer: $kvs"
          arms+=(--arm "$arm=$venv_py:$site" --arm-env "$arm:MLX_CUDA_QMV_EXACT=1")
          for kv in $kvs; do arms+=(--arm-env "$arm:$kv"); done
        done < "$WORK/arms-$peer"
      else  # a peer as it ships: M >= 8 goes to qmm, as stock sends it
        arms+=(--arm "$peer=$venv_py:$site")
      fi
    else
      log "peer $peer failed to build; see peer-$peer.log"
      tail -20 "$WORK/peer-$peer.log" >> "$WORK/pipeline.log"
    fi
  done
  log "waiting for the stock wheel (.mlxpack/b)"
  while ! [ -f "$WORK/pack-ready" ] && [ $waited -lt "${PACK_WAIT:-1800}" ]; do
    sleep 5; waited=$((waited + 5))
  done
  waited=0
  if ! [ -f "$WORK/pack-ready" ]; then
    log "no stock wheel after ${PACK_WAIT:-1800} s: no timing, no stock test_qmm"
    tests_wait_and_rerun
    tests_into_record
    return 0
  fi
  stock="$WORK/stock-site"
  mkdir -p "$stock"
  cat "$WORK"/pack/part_* | xz -d | tar xf - -C "$stock"
  python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('$WORK/pack/mlx-*.whl')[0]).extractall('$stock')"
  # STOCK_EARLY=1: STOCK_TESTS start on the stock wheel now, beside the patched build's
  # tests, for a lease with no time left to run them after the timing.
  local stock_early_pid=
  if [ -n "${STOCK_EARLY:-}" ]; then stock_tests "$stock" /dev/null & stock_early_pid=$!; fi
  # The timing runs alone on the GPU: wait for the tests (up to TEST_WAIT s), then stop
  # what is left and run it again after the timing.
  while [ $waited -lt "${TEST_WAIT:-180}" ] && ! { [ -f "$WORK/test-first.done" ] \
      && [ -f "$WORK/parity-default.rc" ]; }; do
    sleep 5; waited=$((waited + 5))
  done
  tests_stop first
  pkill -f "mlx_parity --patched --out $WORK/parity-default.json" || true
  tail -2 "$WORK/parity-default.log" >> "$WORK/pipeline.log"
  local bench_start=$SECONDS deadline=${BENCH_DEADLINE:-540}
  if [ ${#arms[@]} -gt ${#base[@]} ] && [ "${PEER_BENCH:-}" != skip ]; then
    log "bench, every arm on ${PEER_BENCH:---headline --bits 8}: ${arms[*]}"
    # shellcheck disable=SC2086  # PEER_BENCH is a list of options
    python3 "$repo/scripts/cuda_compiled_bench.py" --arm "stock=python3:$stock" "${arms[@]}" \
      ${PEER_BENCH:---headline --bits 8} --resume --deadline "$deadline" \
      --out "$WORK/bench-peers.json" > "$WORK/bench-peers.log" 2>&1 || log "bench exited $?"
    tail -1 "$WORK/bench-peers.log" >> "$WORK/pipeline.log"
  fi
  if [ "${BASE_BENCH:-}" != skip ]; then
    log "bench, the grid${BASE_BENCH:+ ($BASE_BENCH)}: ${base[*]}"
    # shellcheck disable=SC2086  # BASE_BENCH is a list of options
    local left=$((deadline - (SECONDS - bench_start)))
    python3 "$repo/scripts/cuda_compiled_bench.py" --arm "stock=python3:$stock" "${base[@]}" \
      ${BASE_BENCH:-} --resume --deadline $((left > 1 ? left : 1)) \
      --out "$WORK/bench.json" > "$WORK/bench.log" 2>&1 || log "bench exited $?"
    tail -1 "$WORK/bench.log" >> "$WORK/pipeline.log"
  fi
  # Kernel-only times (Nsight Compute; weights from HBM) for every arm, where wall time reads
  # the host: KERNEL_TIMES holds scripts/cuda_kernel_times.py's --config options, e.g. the
  # small shapes either side of the routing floor.
  if [ -n "${KERNEL_TIMES:-}" ]; then
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1 || true)
    log "kernel times with ${ncu:-no ncu}: $KERNEL_TIMES"
    # shellcheck disable=SC2086  # KERNEL_TIMES is a list of options
    [ -z "$ncu" ] || timeout "${KERNEL_TIMES_LIMIT:-420}" python3 "$repo/scripts/cuda_kernel_times.py" \
      --ncu "$ncu" --arm "stock=python3:$stock" "${arms[@]}" $KERNEL_TIMES \
      --out "$WORK/kernel-times.json" > "$WORK/kernel-times.log" 2>&1 || log "kernel times stopped"
  fi
  # What the timing stopped runs again on the patched build; beside it, the tests that
  # failed in the first batch (and STOCK_TESTS) run on the stock wheel, so that a failure is
  # read as the patch's or as stock's within this lease; then any test that failed only in
  # the rerun.
  tests_summary "$WORK/test-names" first > "$WORK/tests-first.txt"
  # Early stock tests the timing stopped run again here, not beside themselves.
  [ -z "$stock_early_pid" ] || wait "$stock_early_pid" || true
  stock_tests "$stock" "$WORK/tests-first.txt" &
  local stock_pid=$!
  tests_wait_and_rerun
  wait "$stock_pid" || true
  stock_tests "$stock" "$WORK/tests.txt"
  tests_into_record
}

stock_tests() {  # $1: the stock wheel's site folder, $2: a tests summary (tests_summary's
  # lines). Each test that FAILED there runs on stock MLX (the same test file), with the
  # tests STOCK_TESTS names (default: test_qmv and test_qmv_wide, which fail on sm90 where
  # stock's qmm_sm90 applies). A test that ran to its end on stock is not run again; one
  # stopped (by the timing, with STOCK_EARLY) runs once more, never a third time.
  local t tries names="$WORK/stock-test-names.new"
  {
    grep ': FAILED' "$2" 2>/dev/null | cut -d: -f1 || true
    for t in ${STOCK_TESTS-test_qmv test_qmv_wide}; do echo "$t"; done
  } | sed 's/^/test_quantized.TestQuantized./' | tests_sharded | sort -u | while read -r t; do
    tries=$(grep -cxF "$t" "$WORK/stock-test-runs" 2>/dev/null || true)
    ran_to_end stock "$t" || [ "${tries:-0}" -ge 2 ] || echo "$t"
  done > "$names"
  [ -s "$names" ] || return 0
  cat "$names" >> "$WORK/stock-test-runs"
  while read -r t; do
    grep -qxsF "$t" "$WORK/stock-test-names" || echo "$t" >> "$WORK/stock-test-names"
  done < "$names"
  log "on the stock wheel (at most ${STOCK_TEST_LIMIT:-600} s each): $(tr '\n' ' ' < "$names")"
  TEST_LIMIT=${STOCK_TEST_LIMIT:-600} tests_run stock "$names" "$1"
  tests_summary "$WORK/stock-test-names" stock | sed 's/^/stock /' > "$WORK/stock-tests.txt"
  sed 's/^/stock /' < <(tests_summary "$names" stock) >> "$WORK/pipeline.log"
}

case "$cmd" in
  functions) return 0 ;;
  start)
    if [ -f "$WORK/pipeline.pid" ] && kill -0 "$(cat "$WORK/pipeline.pid")" 2>/dev/null; then
      echo "a pipeline is running in $WORK (pid $(cat "$WORK/pipeline.pid")): follow it" >&2
      exit 1
    fi
    # This run's results only: an earlier run's in the same $WORK (SKIP_BUILD=1) would be
    # resumed, counted as finished, or copied back as this one's. The build and the stock
    # wheel's parts stay; the peers' objects stay only for SKIP_BUILD (the same build).
    (cd "$WORK" 2>/dev/null && rm -rf ./*.json ./*.done ./*.rc ./*.pid ./test-* ./arms-* \
      ./pack-ready ./tests.txt ./bench*.log ./parity-*.log ./kernel-times.log ./stock-test* \
      ./peer-*.log ./peer-*.build.log ./stock-site) || true
    [ -n "${SKIP_BUILD:-}" ] || rm -rf "$WORK/peer-obj"
    mkdir -p "$WORK/deps" "$WORK/site"
    tar xJf "$repo/.device/deps.tar.xz" -C "$WORK/deps"
    # MLX links its Python module with LTO (nanobind's LTO option). A host whose compiler
    # cannot run its LTO plugin fails only at that last link; probe it, and where it fails
    # build that module without LTO (it is binding glue: no kernel or arithmetic changes).
    if ! echo 'int main() { return 0; }' | "${CXX:-g++}" -flto -x c++ - -o "$WORK/lto-probe" 2>/dev/null; then
      sed -i '/^function (nanobind_lto name)/,/^endfunction/{/set_target_properties\|INTERPROCEDURAL/d}' \
        "$WORK/deps/nanobind/cmake/nanobind-config.cmake"
      log "g++ -flto does not link here: nanobind's LTO turned off for MLX's Python module"
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" \
      "$repo"/.whl/*.whl
    [ -d "$repo/.peer" ] && rm -rf "$WORK/peer-src"  # this call's .peer/ replaces an earlier one
    gather_carried
    nvidia-smi -L; nvcc --version | tail -1
    # The carried clone holds the pin and the patchkit/<pin> branch `patchkit apply` made.
    python3 -c "from patchkit.carry import source; print(source.ensure_clone(source.source_spec(None)))"
    rm -f "$WORK/pipeline.rc"
    # From a copy: the next call's checkout may replace this file while bash still reads it.
    cp "$0" "$WORK/pipeline.sh"
    setsid bash -c "REPO='$repo' bash '$WORK/pipeline.sh' pipeline '$out'; \
      echo \$? > '$WORK/pipeline.rc'" < /dev/null > "$WORK/pipeline.out" 2>&1 &
    echo $! > "$WORK/pipeline.pid"
    follow "$secs"
    ;;
  follow) follow "$secs" ;;
  pipeline) pipeline ;;
  *) echo "unknown step $cmd" >&2; exit 2 ;;
esac
