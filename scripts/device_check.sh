#!/usr/bin/env bash
# The accelerator check: run from the repository root on a GPU/TPU machine that has jax (with its
# accelerator plugin), flax, optax, orbax-checkpoint, safetensors, tokenizers and, for the tests,
# pytest, pytest-xdist, hypothesis, scipy, torch and transformers.
#
#   bash scripts/device_check.sh bench   # benchmark: 3B-shaped bf16 target (scenarios 3, 5),
#                                        # built-in pair (scenario 2)
#   bash scripts/device_check.sh tests   # the test suite on the accelerator
#   bash scripts/device_check.sh all     # both (stage limits: BENCH_S, TESTS_S, BUILTIN_S seconds)
#   bash scripts/device_check.sh adaptive  # gamma="auto" against autoregressive: the batch
#                                        # baseline, the built-in pair's sweep, stories260K's
#                                        # useless drafts (stage limits: ADAPTIVE_S, USELESS_S,
#                                        # SWEEP_S seconds; SW_BATCHES)
#
# Results go to $OUT (default runs/device). The tests need ../shared; where the checkout
# travels alone, a copy at .device/shared is put there first.
set -uo pipefail
mode=${1:-bench}
case "$mode" in  # (refused before anything is copied, installed or imported)
  bench|tests|all|adaptive) ;;
  *) echo "unknown mode $mode (bench | tests | all | adaptive)"; exit 2 ;;
esac
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several processes share the one accelerator
if [ ! -d ../shared ] && [ -d .device/shared ]; then cp -r .device/shared ../shared; fi
if ! python3 -c "import spec_jax.models" 2>/dev/null; then
  # a checkout never installed: models/ installs as spec_jax.models (pyproject.toml), so
  # PYTHONPATH alone does not find it (the 2026-12-04 lease lost its first call to this)
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . \
    >"$OUT/install.log" 2>&1 \
    || { echo "editable install failed (see $OUT/install.log): linking models/ instead"
         ln -sfn ../models spec_jax/models; }
fi
python3 - <<'PY' || exit 1
import jax, flax, optax, numpy
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "numpy", numpy.__version__, "backend", jax.default_backend(), jax.devices())
from spec_jax.models.builtin import load_builtin
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv

failed=0
fail() { echo "$1 failed: $2"; failed=1; }  # a stage's failure: reported, and the exit status

bench_3b() {
  # bf16 target of a few billion parameters' shape: synthetic acceptance (engine only) and the
  # roofline; compiled in threads (the accelerator machine has the cores).
  # QUICK=1: tiny sizes, to try this script on a CPU first
  local size=(--target-size 3B); [ -n "${QUICK:-}" ] && size=(--quick)
  timeout "${BENCH_S:-900}" python3 scripts/benchmark.py --scenarios 3,5 --dtype bfloat16 \
    "${size[@]}" --repeats 5 --compile-workers 12 --out "$OUT/bench3b" || fail "bench 3B" $?
  cat "$OUT/bench3b/results.md" 2>/dev/null
}
bench_builtin() {
  # the built-in pair (float32 weights): real, lossless speculation, with full-precision f32
  # matmuls (the GPU default rounds f32 matmul inputs to tf32)
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${BUILTIN_S:-600}" python3 scripts/benchmark.py \
    --scenarios 2 ${QUICK:+--quick} --repeats 5 --compile-workers 12 --out "$OUT/builtin" \
    || fail "bench builtin" $?
  cat "$OUT/builtin/results.md" 2>/dev/null
}
bench_adaptive() {
  # sized for a 15-minute lease from what the 2026-12-04 one took: on the H200 each auto
  # case's cost table took 41-84 s (compiles of its timing programs, one after another; a
  # table now times whole rounds, ~25% more to compile) and its program 30-58 s to compile,
  # so the first stage (ADAPTIVE_S) runs the batch baseline (8: ~70 s) and the built-in
  # pair's sweep at 1 and 16 rows (7: gamma 4 and auto; its two tables alone took 132 s),
  # and the second (USELESS_S) stories260K's useless drafts at batch 1 with auto (1). The
  # third lease (tables compiling in threads) ran the first stage in 200 s and the second in
  # 58 s; the useless drafts at 1 and 16 rows with 7 repeats did not finish in 200 s, nor
  # the bf16 sweep at 1 and 16 rows in 150 s (its table 45 s, its auto program 52 s to
  # compile). f32 models with full-precision matmuls (outputs are checked
  # against autoregressive). SWEEP_S > 0 adds the memory-bound target in bf16 at synthetic
  # acceptance (LOSSY, engine only; ~150 s), in a process of default precision.
  local sweep=(--set "sw_batches=${SW_BATCHES:-1,16}" --set sw_gammas=4)
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${ADAPTIVE_S:-360}" python3 scripts/benchmark.py \
    --scenarios 8,7 ${QUICK:+--quick} "${sweep[@]}" --set sw_kinds=draft_model \
    --set sw_synthetic_alpha=none --repeats 5 --compile-workers 12 --out "$OUT/adaptive" \
    || fail "bench adaptive" $?
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${USELESS_S:-180}" python3 scripts/benchmark.py \
    --scenarios 1 ${QUICK:+--quick} --set "s1_only=draft model: random,layer skip" \
    --set s1_kinds=none --set s1_gammas=4 \
    --set s1_batches=1 --set "s1_auto=draft model: random,layer skip" \
    --repeats 5 --compile-workers 12 --out "$OUT/useless" || fail "bench useless" $?
  if [ "${SWEEP_S:-0}" -gt 0 ]; then
    timeout "$SWEEP_S" python3 scripts/benchmark.py --scenarios 7 ${QUICK:+--quick} \
      "${sweep[@]}" --set sw_kinds= --dtype bfloat16 --repeats 5 --compile-workers 12 \
      --out "$OUT/sweep_bf16" || fail "bench sweep bf16" $?
  fi
  # a lease returns 8 files at most: this mode's plots stay behind
  rm -f "$OUT"/adaptive/*.png "$OUT"/useless/*.png "$OUT"/sweep_bf16/*.png
  for stage in adaptive useless sweep_bf16; do  # (a stage that did not finish has none)
    [ -f "$OUT/$stage/results.md" ] && cat "$OUT/$stage/results.md"
  done
}
run_tests() {
  # full-precision f32 matmuls: the tests' tolerances are float32's
  JAX_DEFAULT_MATMUL_PRECISION=highest OMP_NUM_THREADS=1 timeout "${TESTS_S:-1800}" \
    python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-14}" --maxprocesses "${WORKERS:-14}" --timeout 400 -rfE 2>&1 \
    | tee "$OUT/pytest.log"
}

case "$mode" in
  bench) bench_3b; bench_builtin ;;
  tests) run_tests || failed=1 ;;
  all) bench_3b; run_tests || failed=1; bench_builtin ;;
  adaptive) bench_adaptive ;;
esac
exit "$failed"
