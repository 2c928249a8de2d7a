#!/usr/bin/env bash
# One GPU session on a bare Hopper machine without network (CUDA, JAX, nanobind, CMake,
# scikit-build-core present): build and install jzyfa from this working tree, read the
# kernels' resource report and SASS, run the GPU tests, the example and the benchmark.
# Everything lands in the folder given as $1 (default $OUT).
#
#   bash tools/gpu_session.sh /path/to/logs [extra bench flags...]
set -uo pipefail
OUT_DIR=${1:-${OUT:?give an output folder}}
shift || true
REPO=$(cd "$(dirname "$0")/.." && pwd)
SITE=${JZYFA_SITE:-/tmp/jzyfa-site}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# Multi-GPU kinds: NVLink multicast must stay off (it can take the host's shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
step() { echo; echo "=== $* === $(date +%T)"; }

step "machine"
{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv;
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"; } \
  2>&1 | tee "$OUT_DIR/machine.txt"

step "build + install (pip, no network)"
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
rm -rf "$SITE"
# JZYFA_MEASURE=<name> builds A as a measuring variant (tools/measure/<name>.h: timeline,
# softmax_ablation, no_tile_groups, hd256_80_keys, nomask_176_keys,
# prmt_transpose; CMakeLists.txt reads it at configure time). Unset: the product build.
[ -n "${JZYFA_MEASURE:-}" ] && echo "MEASURING build: tools/measure/${JZYFA_MEASURE}.h"
export JZYFA_MEASURE=${JZYFA_MEASURE:-}
# One build directory per CUDAFLAGS and variant: with pyproject's fixed build/ a change finds "no work to do".
BUILD_DIR=/tmp/jzyfa-build-$(printf '%s' "${CUDAFLAGS:-} ${JZYFA_MEASURE}" | md5sum | cut -c1-8)
# build_into SITE TREE BUILD_DIR LOG NAME: pip-installs TREE into SITE, or stops the session.
build_into() {
  rm -rf "$1"
  python3 -m pip install -v --no-build-isolation --no-deps -C build-dir="$3" --target "$1" "$2" > "$4" 2>&1 \
    || { echo "$5 FAILED"; tail -60 "$4"; exit 1; }
}
# JZYFA_PREBUILT_SITE: an installed jzyfa (a folder holding jzyfa/ with its extension, and the
# jzyfa-source.txt that tools/source_stamp.sh printed for the tree it was built from), carried in to save
# the device the build's minutes. It is used only where that stamp is this tree's and its extension
# loads here; else the tree is built as usual. (JZYFA_AB_PREBUILT_SITE: the same for build B.)
# install_prebuilt PREBUILT TREE SITE [stamp variables...]: PREBUILT's jzyfa into SITE if it fits TREE;
# where it does not, says why (the caller then builds).
install_prebuilt() {
  local prebuilt=$1 tree=$2 site=$3 want have
  shift 3
  [ -n "$prebuilt" ] || return 1
  want=$(env "$@" bash "$REPO/tools/source_stamp.sh" "$tree")
  have=$(cat "$prebuilt/jzyfa-source.txt" 2>/dev/null)
  [ "$have" = "$want" ] || { echo "prebuilt $prebuilt: built from '$have', this tree is '$want'"; return 1; }
  rm -rf "$site" && mkdir -p "$site" && cp -r "$prebuilt/jzyfa" "$site"/ \
    && (cd /tmp && PYTHONPATH="$site" python3 -c "
import sys, jzyfa
sys.exit(0) if jzyfa.kernel_available() else sys.exit('prebuilt extension does not load: %s' % jzyfa.kernel_unavailable_reason())")
}
PREBUILT=${JZYFA_PREBUILT_SITE:+$REPO/$JZYFA_PREBUILT_SITE}
if install_prebuilt "$PREBUILT" "$REPO" "$SITE"; then
  echo "prebuilt extension from $JZYFA_PREBUILT_SITE (no build here)" | tee "$OUT_DIR/build.log"
else
  build_into "$SITE" "$REPO" "$BUILD_DIR" "$OUT_DIR/build.log" BUILD
fi
# At most 8 files come back from the device tool: keep resources and SASS counts in one.
grep -E "registers|spill|stack frame|C75" "$OUT_DIR/build.log" | sort | uniq -c | tee "$OUT_DIR/summary.txt"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
SO=$(ls "$SITE"/jzyfa/_jzyfa_ffi*.so)
# What the build is made from, for tools/real_model_session.sh's reuse of this build.
bash "$REPO/tools/source_stamp.sh" "$REPO" > "$SITE/jzyfa-source.txt"
cuobjdump --dump-sass "$SO" > /tmp/jzyfa_sass.txt 2>&1
grep -oE "\b(HGMMA|QGMMA|UTMALDG|UTMASTG|MUFU\.EX2|LDL|STL|WARPGROUP\.ARRIVE)[.A-Z0-9x_]*" /tmp/jzyfa_sass.txt \
  | sort | uniq -c | tee -a "$OUT_DIR/summary.txt"

# Run from outside the tree so `import jzyfa` finds the installed package with its extension.
cd /tmp
step "extension"
python3 -c "import jzyfa; print('kernel_available', jzyfa.kernel_available(), jzyfa.kernel_unavailable_reason())"

step "GPU tests"
# JZYFA_GPU_TESTS narrows the run (paths relative to the repository), e.g. tests/test_kernel_gpu.py.
read -ra gpu_tests <<< "${JZYFA_GPU_TESTS:-tests}"
# JZYFA_PYTEST_FLAGS adds pytest flags, e.g. "-v" so a run cut by the time limit still names each result.
read -ra pytest_flags <<< "${JZYFA_PYTEST_FLAGS:-}"
# JZYFA_PYTEST_K: one -k expression, spaces allowed (e.g. "lean and 8192").
[ -n "${JZYFA_PYTEST_K:-}" ] && pytest_flags+=(-k "$JZYFA_PYTEST_K")
timeout "${JZYFA_GPU_TESTS_TIMEOUT:-480}" python3 -m pytest -q -rs -p no:cacheprovider "${pytest_flags[@]}" \
  "${gpu_tests[@]/#/$REPO/}" -m gpu 2>&1 | tee "$OUT_DIR/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ -z "${JZYFA_SKIP_EXAMPLE:-}" ]; then
  step "example"
  python3 "$REPO/examples/prefill.py" 2>&1 | tee "$OUT_DIR/example.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${JZYFA_PIPE_RATES:-}" ]; then
  # Instruction rates per SM per clock (tools/pipe_rates.cu, docs/fp8.md 10.25): a few seconds.
  step "pipe rates"
  { "$CUDACXX" -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/pipe_rates "$REPO/tools/pipe_rates.cu" \
      && /tmp/pipe_rates; } 2>&1 | tee "$OUT_DIR/pipe_rates.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${JZYFA_INT8_PROBE:-}" ]; then
  # s8 against e4m3 wgmma rates and int32 -> float conversions for an INT8 kernel
  # (tools/int8_wgmma_probe.cu, docs/int8.md): seconds. The SASS's GMMA mnemonics go in the same file.
  step "INT8 wgmma probe"
  { "$CUDACXX" -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/int8_wgmma_probe \
        "$REPO/tools/int8_wgmma_probe.cu" \
      && /tmp/int8_wgmma_probe \
      && { cuobjdump -sass /tmp/int8_wgmma_probe | grep -o '[A-Z0-9]*GMMA[.A-Z0-9x]*' | sort | uniq -c || true; }; } \
    2>&1 | tee "$OUT_DIR/int8_probe.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${JZYFA_SOFTMAX_PROBE:-}" ]; then
  # The FP8 softmax's cycles per block beside tensor-core work (tools/softmax_interference.cu,
  # docs/fp8.md 10.33): seconds.
  step "softmax interference probe"
  { python3 "$REPO/asm/gen_ptx.py" --out /tmp/probe_gen/jzyfa_ptx.h \
      && "$CUDACXX" -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
           -I"$REPO/ffi" -I/tmp/probe_gen -o /tmp/softmax_interference "$REPO/tools/softmax_interference.cu" \
      && /tmp/softmax_interference; } 2>&1 | tee "$OUT_DIR/softmax_interference.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${JZYFA_MULTI_GPU:-}" ]; then
  # Sharded prefill over all GPUs (issue 8), e.g. JZYFA_MULTI_GPU="--seqs 32768,65536".
  step "multi-GPU prefill: ${JZYFA_MULTI_GPU}"
  # shellcheck disable=SC2086
  timeout "${JZYFA_MULTI_GPU_TIMEOUT:-300}" python3 "$REPO/tools/multi_gpu_prefill.py" ${JZYFA_MULTI_GPU} 2>&1 \
    | tee "$OUT_DIR/multi_gpu.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${JZYFA_OVERHEAD:-}" ]; then
  # Host time per call above the kernel, jzyfa next to cuDNN (issue 6), e.g. JZYFA_OVERHEAD="--seq 512".
  step "call overhead: ${JZYFA_OVERHEAD}"
  # shellcheck disable=SC2086
  timeout 240 python3 -m jzyfa.bench.overhead --markdown ${JZYFA_OVERHEAD} 2>&1 | tee "$OUT_DIR/overhead.md"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${JZYFA_TIMELINE_RUNS:-}" ]; then
  # Where a key block's time goes (needs JZYFA_MEASURE=timeline for the build above), e.g.
  # JZYFA_TIMELINE_RUNS="--dtype fp8 --seq 32768;--dtype bf16 --seq 16384".
  IFS=';' read -ra timeline_runs <<< "${JZYFA_TIMELINE_RUNS}"
  for run in "${timeline_runs[@]}"; do
    step "kernel timeline: $run"
    # shellcheck disable=SC2086
    timeout 120 python3 "$REPO/tools/kernel_timeline.py" $run 2>&1 | grep -v "Unable to initialize backend" \
      | tee -a "$OUT_DIR/timeline.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi

if [ -n "${JZYFA_NCU_RUNS:-}" ]; then
  # Nsight Compute on one attention call each (warp stall reasons, per-instruction samples), e.g.
  # JZYFA_NCU_RUNS="--dtype fp8 --seq 16384;--dtype bf16 --seq 16384". One tarball of reports.
  # JZYFA_NCU_KERNEL: which kernel, a regex over demangled names (default FlashFwd; BwdDkdv for
  # the backward's dK/dV kernel with "--dtype bf16 --direction bwd" runs).
  IFS=';' read -ra ncu_runs <<< "${JZYFA_NCU_RUNS}"
  mkdir -p /tmp/ncu
  for i in "${!ncu_runs[@]}"; do
    step "ncu: ${ncu_runs[$i]}"
    # shellcheck disable=SC2086
    timeout 300 ncu --clock-control none --kernel-name-base demangled \
      -k "regex:${JZYFA_NCU_KERNEL:-FlashFwd}" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
      --section SourceCounters --import-source no -f -o "/tmp/ncu/run$i" \
      python3 "$REPO/tools/profile_call.py" ${ncu_runs[$i]} 2>&1 | tail -5 | tee -a "$OUT_DIR/ncu.log"
    ncu --import "/tmp/ncu/run$i.ncu-rep" --print-details all > "/tmp/ncu/run$i.details.txt" 2>&1
    ncu --import "/tmp/ncu/run$i.ncu-rep" --page raw --csv > "/tmp/ncu/run$i.raw.csv" 2>&1
    ncu --import "/tmp/ncu/run$i.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu/run$i.sass.csv" 2>&1
    grep -iE "stall|issue|ipc|warp cycles|eligible|throughput" "/tmp/ncu/run$i.details.txt" | head -80 \
      | tee -a "$OUT_DIR/ncu.log"
  done
  tar czf "$OUT_DIR/ncu.tar.gz" -C /tmp ncu
fi

if [ -n "${JZYFA_AB_CUDAFLAGS:-}${JZYFA_AB_TREE:-}${JZYFA_AB_ENV:-}${JZYFA_AB_MEASURE:-}" ]; then
  # A second build (B; the build above is A): a measuring variant (JZYFA_AB_MEASURE=<name>,
  # tools/measure/<name>.h) and/or other CUDAFLAGS, e.g.
  # JZYFA_AB_MEASURE=prmt_transpose JZYFA_AB_GPU_TESTS=tests/test_fp8_kernel_gpu.py
  # JZYFA_AB_BENCH="--dtype fp8 --impls jzyfa_fp8 --shapes 16x1024,4x4096": B's GPU tests, then each
  # ";"-separated bench run on A and B in turn (A, B, A, B: clocks drift within a call).
  # JZYFA_AB_TREE: B built from another source tree (a path relative to the repository, e.g. an
  # untracked `git archive` of the commit to compare with) instead of, or as well as, other flags.
  # JZYFA_AB_ENV: environment settings for B's runs (e.g. "JZYFA_FP8_KEY_BLOCK=192", which the Python
  # side passes as the kernel's key_block attribute); alone, B is A's
  # build run under them (no second build).
  read -ra env_b <<< "${JZYFA_AB_ENV:-}"
  SITE_B=$SITE
  if [ -n "${JZYFA_AB_CUDAFLAGS:-}${JZYFA_AB_TREE:-}${JZYFA_AB_MEASURE:-}" ]; then
    TREE_B=$REPO${JZYFA_AB_TREE:+/$JZYFA_AB_TREE}
    FLAGS_B=${JZYFA_AB_CUDAFLAGS-${CUDAFLAGS:-}}
    MEASURE_B=${JZYFA_AB_MEASURE-${JZYFA_MEASURE}}
    step "A/B: build B from ${TREE_B} with CUDAFLAGS=${FLAGS_B} JZYFA_MEASURE=${MEASURE_B}"
    SITE_B=/tmp/jzyfa-site-b
    PREBUILT_B=${JZYFA_AB_PREBUILT_SITE:+$REPO/$JZYFA_AB_PREBUILT_SITE}
    if install_prebuilt "$PREBUILT_B" "$TREE_B" "$SITE_B" CUDAFLAGS="$FLAGS_B" JZYFA_MEASURE="$MEASURE_B"; then
      echo "B: prebuilt extension from $JZYFA_AB_PREBUILT_SITE (no build here)" | tee "$OUT_DIR/build_b.log"
    else
      CUDAFLAGS="$FLAGS_B" JZYFA_MEASURE="$MEASURE_B" build_into "$SITE_B" "$TREE_B" \
        "/tmp/jzyfa-build-b-$(printf '%s' "$TREE_B $FLAGS_B $MEASURE_B" | md5sum | cut -c1-8)" \
        "$OUT_DIR/build_b.log" "BUILD B"
    fi
    grep -E "registers|spill|stack frame" "$OUT_DIR/build_b.log" | sort | uniq -c | tee -a "$OUT_DIR/summary.txt"
  fi
  step "A/B: B runs with environment: ${env_b[*]:-(none)}"
  if [ -n "${JZYFA_AB_GPU_TESTS:-}" ]; then
    step "A/B: GPU tests on B"
    read -ra ab_tests <<< "${JZYFA_AB_GPU_TESTS}"
    # JZYFA_AB_PYTEST_FLAGS: pytest flags for B's tests only, e.g. "-kstaged" (the kernels B changes).
    read -ra ab_pytest_flags <<< "${JZYFA_AB_PYTEST_FLAGS:-}"
    [ -n "${JZYFA_AB_PYTEST_K:-}" ] && ab_pytest_flags+=(-k "$JZYFA_AB_PYTEST_K")
    env "${env_b[@]}" PYTHONPATH="$SITE_B" timeout "${JZYFA_AB_GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider \
      "${ab_pytest_flags[@]}" "${ab_tests[@]/#/$REPO/}" -m gpu 2>&1 | tee "$OUT_DIR/gpu_tests_b.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  # JZYFA_AB_TOOLS: ";"-separated tool runs (a script under the repository and its flags) on A and B in
  # turn, e.g. JZYFA_AB_TOOLS="tools/fp8_lse_bias.py --seq 4096" with B from a tree whose
  # ffi/tile_size.h promotes every 4 blocks (JZYFA_AB_TREE).
  IFS=';' read -ra ab_tools <<< "${JZYFA_AB_TOOLS:-}"
  for tool in "${ab_tools[@]}"; do
    for build in A B; do
      site=$SITE env_run=(); [ "$build" = B ] && site=$SITE_B env_run=("${env_b[@]}")
      step "A/B tool, build $build: $tool"
      # shellcheck disable=SC2086
      env "${env_run[@]}" PYTHONPATH="$site" timeout 300 python3 "$REPO"/$tool 2>&1 | grep -v "Unable to initialize backend" \
        | sed "s/^/$build /" | tee -a "$OUT_DIR/ab_tools.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
  done
  IFS=';' read -ra ab_runs <<< "${JZYFA_AB_BENCH:-}"
  for run in "${ab_runs[@]}"; do
    for round in 1 2; do
      for build in A B; do
        site=$SITE env_run=(); [ "$build" = B ] && site=$SITE_B env_run=("${env_b[@]}")
        step "A/B bench, build $build, round $round: $run"
        # shellcheck disable=SC2086
        env "${env_run[@]}" PYTHONPATH="$site" timeout "${JZYFA_BENCH_TIMEOUT:-900}" python3 -m jzyfa.bench --markdown $run \
          2>>"$OUT_DIR/bench_progress.log" | sed "s/^/$build$round /" | tee -a "$OUT_DIR/ab.md"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done
    done
  done
fi

[ -n "${JZYFA_SKIP_BENCH:-}" ] && exit $status
step "benchmark"
timeout "${JZYFA_BENCH_TIMEOUT:-900}" python3 -m jzyfa.bench --markdown --json_out "$OUT_DIR/bench.json" "$@" \
  2>"$OUT_DIR/bench_progress.log" \
  | tee "$OUT_DIR/bench.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# More configurations, one bench call each: JZYFA_BENCH_EXTRA="--nocausal;--heads 32 --kv_heads 8 --shapes 1x16384"
IFS=';' read -ra extra_runs <<< "${JZYFA_BENCH_EXTRA:-}"
for i in "${!extra_runs[@]}"; do
  step "benchmark extra $i: ${extra_runs[$i]}"
  # shellcheck disable=SC2086
  timeout "${JZYFA_BENCH_TIMEOUT:-900}" python3 -m jzyfa.bench --markdown --json_out "/tmp/bench_extra$i.json" \
    ${extra_runs[$i]} \
    2>>"$OUT_DIR/bench_progress.log" | tee -a "$OUT_DIR/bench.md"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
