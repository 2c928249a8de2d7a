#!/usr/bin/env bash
# The real-model recipe in one command: train examples/train.py's h200 preset, capture its layers'
# q/k/v on held-out text, benchmark attention on them (kernel time, then --sustained clocks) next to
# Gaussian and activation-like inputs, and measure the model's accuracy per attention variant
# (examples/model_accuracy.py). Every step has its own timeout, so one stuck step leaves the others
# their time; a step that fails is logged and the session goes on where it can.
#
#   bash tools/real_model_session.sh [--smoke] [OUT_DIR]      (OUT_DIR default: $OUT)
#
# On the H200 the whole session stays within TOTAL_S (560 s by default, so it ends inside one
# 10-minute command; the step timeouts below are estimates from the preset's arithmetic, see
# docs/measuring.md): builds and installs jzyfa as tools/gpu_session.sh does (skipped where
# $JZYFA_SITE already holds the extension built from this tree, by its jzyfa-source.txt:
# tools/source_stamp.sh). --smoke: the same steps at CPU sizes from the checkout (under a minute on a
# CPU; tests/test_real_model_session.py).
# What comes back (at most 8 files): session.log, summary.md (every table), bench_speed.png,
# model_kl.png, model_layer_error.png, and real_model.tar.gz (every log and JSON).
# Knobs (environment): TRAIN_STEPS, TRAIN_BATCH, TRAIN_ATTENTION (jzyfa | cudnn | xla), CAPTURE_SEQ,
# SUSTAINED_S, BENCH_SHAPES (Gaussian/activation-like shapes), TOTAL_S (the session's budget),
# WORK_DIR (the checkpoint, capture and logs; default a new folder in /tmp), and
# T_BUILD, T_TRAIN, T_CAPTURE, T_BENCH, T_SUSTAINED, T_ACCURACY (seconds per step, cut to what is left).
set -uo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT_DIR=${1:-${OUT:?give an output folder}}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
# The checkpoint, the capture and every log; kept after the session, so that later commands of the
# same GPU session can read the checkpoint and the capture.
WORK=${WORK_DIR:-$(mktemp -d /tmp/real_model.XXXXXX)}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
status=0

if [ "$SMOKE" = 1 ]; then
  TRAIN_FLAGS=(--preset cpu --seq 64 --steps "${TRAIN_STEPS:-3}" --eval-batches 1 --log-every 100)
  CAPTURE_SEQ=${CAPTURE_SEQ:-128}; SUSTAINED_S=${SUSTAINED_S:-0.01}; BENCH_SHAPES=${BENCH_SHAPES:-1x64}
  BENCH_FLAGS=(--smoke --heads 2 --kv_heads 1 --head_dim 128)  # the cpu preset's attention
  IMPLS_16=jzyfa_xla; IMPLS_FP8=jzyfa_fp8_xla; ACCURACY_FLAGS=(--seq 64 --windows 1)
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  # Batch 16: the preset's 32 needs about 72 GB of temporaries, more than an H100 has.
  TRAIN_FLAGS=(--preset h200 --batch "${TRAIN_BATCH:-16}" --steps "${TRAIN_STEPS:-400}" --log-every 50)
  CAPTURE_SEQ=${CAPTURE_SEQ:-8192}; SUSTAINED_S=${SUSTAINED_S:-2}; BENCH_SHAPES=${BENCH_SHAPES:-1x8192}
  BENCH_FLAGS=(--heads 8 --kv_heads 2 --head_dim 128)  # the h200 preset's attention
  IMPLS_16=jzyfa,cudnn; IMPLS_FP8=jzyfa_fp8,jzyfa_fp8_exact_p,cudnn_fp8,jzyfa,cudnn
  ACCURACY_FLAGS=(--seq 4096 --windows 2 --ref_pairs 1)
fi
CHECKPOINT=$WORK/lm.npz
CAPTURED=$WORK/qkv.npz

# The whole session's budget: a step's timeout is cut to what is left of it (the archive at the end
# takes seconds), so the command ends inside one 10-minute call of the device tool.
TOTAL_S=${TOTAL_S:-560}
START_S=$SECONDS

# step NAME SECONDS COMMAND...: runs COMMAND under timeout, its output in $WORK/NAME.log and on stdout.
step() {
  local name=$1 seconds=$2
  shift 2
  local left=$((TOTAL_S - (SECONDS - START_S)))
  if [ "$left" -lt 15 ]; then
    echo; echo "!!! $name failed (skipped: ${left}s left of TOTAL_S=${TOTAL_S})"; status=1; return 1
  fi
  [ "$seconds" -gt "$left" ] && seconds=$left
  echo; echo "=== $name (timeout ${seconds}s) === $(date +%T)"
  timeout "$seconds" "$@" 2>&1 | tee "$WORK/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!!! $name failed (exit $rc)"; status=1; }
  return "$rc"
}

{
if [ "$SMOKE" = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  SITE=${JZYFA_SITE:-/tmp/jzyfa-site}
  # Reuse an installed extension only where it was built from this tree (tools/source_stamp.sh): a
  # warm machine's $SITE may hold another tree's build (an A/B tree of gpu_session.sh, say).
  STAMP=$(bash "$REPO/tools/source_stamp.sh" "$REPO")
  if ls "$SITE"/jzyfa/_jzyfa_ffi*.so > /dev/null 2>&1 && [ "$(cat "$SITE/jzyfa-source.txt" 2>/dev/null)" = "$STAMP" ]; then
    echo "jzyfa: reusing the build in $SITE ($STAMP)"
  else
    if [ -e "$SITE" ]; then
      echo "jzyfa: $SITE holds another build ($(cat "$SITE/jzyfa-source.txt" 2>/dev/null || echo 'no jzyfa-source.txt')); building $REPO ($STAMP)"
      rm -rf "$SITE"
    fi
    export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    step build "${T_BUILD:-240}" "$PYTHON" -m pip install --no-build-isolation --no-deps \
      -C build-dir=/tmp/jzyfa-build-real-model --target "$SITE" "$REPO" > /dev/null \
      || { echo "BUILD FAILED"; exit 1; }
    echo "$STAMP" > "$SITE/jzyfa-source.txt"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  cd /tmp  # `import jzyfa` finds the installed package with its extension
fi

step train "${T_TRAIN:-300}" "$PYTHON" "$REPO/examples/train.py" "${TRAIN_FLAGS[@]}" \
  --attention "${TRAIN_ATTENTION:-jzyfa}" --save "$CHECKPOINT" || exit 1  # nothing to measure without it
step capture "${T_CAPTURE:-90}" "$PYTHON" "$REPO/examples/capture.py" --checkpoint "$CHECKPOINT" \
  --seq "$CAPTURE_SEQ" --out "$CAPTURED" || exit 1
INPUTS="gaussian,activations,captured:$CAPTURED"
step bench_bf16 "${T_BENCH:-120}" "$PYTHON" -m jzyfa.bench "${BENCH_FLAGS[@]}" --shapes "$BENCH_SHAPES" \
  --inputs "$INPUTS" --impls "$IMPLS_16" --markdown --json_out "$WORK/bench_bf16.json" \
  --plot "$OUT_DIR/bench_speed.png"
step bench_fp8 "${T_BENCH:-120}" "$PYTHON" -m jzyfa.bench "${BENCH_FLAGS[@]}" --shapes "$BENCH_SHAPES" \
  --inputs "$INPUTS" --dtype fp8 --impls "$IMPLS_FP8" --markdown --json_out "$WORK/bench_fp8.json"
step bench_sustained "${T_SUSTAINED:-150}" "$PYTHON" -m jzyfa.bench "${BENCH_FLAGS[@]}" --shapes "$BENCH_SHAPES" \
  --inputs "activations,captured:$CAPTURED" --dtype fp8 --impls "$IMPLS_FP8" --sustained "$SUSTAINED_S" \
  --markdown --json_out "$WORK/bench_sustained.json"
step accuracy "${T_ACCURACY:-150}" "$PYTHON" "$REPO/examples/model_accuracy.py" --load "$CHECKPOINT" \
  "${ACCURACY_FLAGS[@]}" --captured "$CAPTURED" --json_out "$WORK/model_accuracy.json" --plot "$OUT_DIR"

echo; echo "=== done $(date +%T), status $status"
} 2>&1 | tee "$OUT_DIR/session.log"
status=${PIPESTATUS[0]}
[ -f "$OUT_DIR/session.log" ] && grep -q "!!! .* failed" "$OUT_DIR/session.log" && status=1

# Every table in one file; every log and JSON in one archive (the checkpoint and captures stay in /tmp).
for name in train bench_bf16 bench_fp8 bench_sustained accuracy; do
  [ -f "$WORK/$name.log" ] || continue
  printf '\n## %s\n\n' "$name"
  # Tables, their captions, the training curve's logged steps and the held-out loss.
  grep -E '^\||^[A-Za-z].*:$|\] step +[0-9]+/|held-out loss' "$WORK/$name.log"
done > "$OUT_DIR/summary.md"
tar -czf "$OUT_DIR/real_model.tar.gz" -C "$WORK" --exclude='*.npz' .
echo "wrote $OUT_DIR (work files in $WORK)"
exit "$status"
