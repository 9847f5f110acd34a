#!/usr/bin/env bash
# The device check: (a) the test suite on the device, (b) `reasonkv bench` on a real model's shape
# with random weights (random:qwen3-8b by default) at long generations, full + the main methods at
# one budget, batch 1, as JSON and a Markdown table in $OUT.
#
# On a CUDA machine, from the repository root:
#   bash benchmarks/device_check.sh
# A CPU toy run (seconds):
#   MODEL=random:qwen3-0.6b:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128,head_dim=16 \
#     DEVICE=cpu DTYPE=float32 LENGTHS=64,128 bash benchmarks/device_check.sh
#
# Random weights: the numbers are speed and memory only, meaningless for fidelity.
set -euo pipefail

MODEL=${MODEL:-random:qwen3-8b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
LENGTHS=${LENGTHS:-8192,16384,32768}      # generated-token marks; the largest is the decode length
OUT=${OUT:-device-check}
METHODS=${METHODS:-full,streaming,snapkv,rkv,beaconkv}
BUDGET=${BUDGET:-512}
WINDOW=${WINDOW:-}                        # decode steps per tok/s window; empty: min(1024, shortest / 2)
TESTS=${TESTS:-auto}                      # auto: whole suite when DEVICE is not cpu, else the random-model tests; 1: whole suite; 0: none
FIXED_MEMORY=${FIXED_MEMORY:-}            # e.g. 16GiB: also bench at a fixed K/V memory (needs bench --kv-memory)
PYTHON=${PYTHON:-python}
PYTEST_ARGS=${PYTEST_ARGS:-}              # e.g. "-n 12 -x" (pytest-xdist) on a many-core machine
TEST_TIMEOUT=${TEST_TIMEOUT:-0}           # seconds for the tests (0: no limit), so a slow suite leaves time for the bench
BENCH_ARGS=${BENCH_ARGS:-}                # e.g. --interleave (every run advances step by step together)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's reasonkv, installed or not
export REASONKV_THREADS=${REASONKV_THREADS:-1}
RK=("$PYTHON" -m reasonkv.cli.main)
mkdir -p "$OUT"

if [[ -z $WINDOW ]]; then
  shortest=$(tr ',' '\n' <<<"$LENGTHS" | sort -n | head -1)
  WINDOW=$(( shortest / 2 < 1024 ? shortest / 2 : 1024 ))
  WINDOW=$(( WINDOW > 0 ? WINDOW : 1 ))
fi

{
  echo "device check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "MODEL=$MODEL DEVICE=$DEVICE DTYPE=$DTYPE LENGTHS=$LENGTHS METHODS=$METHODS BUDGET=$BUDGET WINDOW=$WINDOW"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  fi
  "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} | tee "$OUT/machine.txt"

# (a) The test suite, with the tiny test models and their prompts on $DEVICE (REASONKV_TEST_DEVICE).
# Failures are reported at the end; the benchmark runs either way.
tests_rc=0
case $TESTS in
  auto) if [[ $DEVICE == cpu ]]; then targets=(tests/core/test_random_models.py tests/cli/test_cli_random_models.py); else targets=(tests); fi ;;
  1) targets=(tests) ;;
  0) targets=() ;;
  *) echo "TESTS must be auto, 1 or 0, got $TESTS" >&2; exit 2 ;;
esac
if (( ${#targets[@]} )); then
  echo "== tests on $DEVICE: ${targets[*]}"
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of options
  (cd "$ROOT" && REASONKV_TEST_DEVICE=$DEVICE timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider \
    $PYTEST_ARGS "${targets[@]}" --junitxml="$(realpath "$OUT")/tests.xml") 2>&1 | tee "$OUT/tests.log" || tests_rc=$?
fi

# (b) Speed and memory of each method vs the full cache on identical forced tokens, batch 1.
echo "== bench $MODEL on $DEVICE ($DTYPE): $METHODS at budget $BUDGET, lengths $LENGTHS"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
"${RK[@]}" bench --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --methods "$METHODS" \
  --budgets "$BUDGET" --lengths "$LENGTHS" --window "$WINDOW" $BENCH_ARGS --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
results=("$OUT/bench.json")

# (c) Batch capacity at a fixed K/V memory (FIXED_MEMORY, e.g. 40GiB): per method, the largest
# batch whose peak K/V fits, decoded together; aggregate tok/s against the full cache's.
if [[ -n $FIXED_MEMORY ]]; then
  help=$(COLUMNS=200 "${RK[@]}" bench --help)  # not piped into grep -q: under pipefail its early exit fails the test
  if grep -q -- '--kv-memory' <<<"$help"; then
    echo "== bench at a fixed K/V memory of $FIXED_MEMORY"
    "${RK[@]}" bench --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --methods "$METHODS" \
      --budgets "$BUDGET" --lengths "$LENGTHS" --window "$WINDOW" --kv-memory "$FIXED_MEMORY" --batch auto \
      --out "$OUT/bench-fixed-memory.json" 2>&1 | tee "$OUT/bench-fixed-memory.log"
    results+=("$OUT/bench-fixed-memory.json")
  else
    echo "== FIXED_MEMORY=$FIXED_MEMORY skipped: this reasonkv bench has no --kv-memory yet" | tee -a "$OUT/machine.txt"
  fi
fi

# (d) The Markdown table.
{
  sed 's/^/    /' "$OUT/machine.txt"
  echo
  "$PYTHON" "$ROOT/benchmarks/bench_table.py" "${results[@]}"
} > "$OUT/bench.md"
echo "== $OUT/bench.md"
cat "$OUT/bench.md"
if (( tests_rc )); then
  echo "== the tests failed on $DEVICE (exit $tests_rc): see $OUT/tests.log" >&2
fi
exit "$tests_rc"
