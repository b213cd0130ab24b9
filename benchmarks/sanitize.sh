#!/usr/bin/env bash
# compute-sanitizer over every cuflash kernel family (benchmarks/sanitize_driver.py has the cases).
#
#   benchmarks/sanitize.sh                 # memcheck, racecheck, synccheck, initcheck
#   benchmarks/sanitize.sh racecheck       # just the tools named
#
# Prints one line per tool ("memcheck: 0 errors (...)") and exits non-zero if any tool reported an
# error, hit its time limit, or the driver itself failed. Full logs go to $CUFLASH_SANITIZE_LOGDIR
# (default /tmp/cuflash-sanitize). Environment: PYTHON (default python3), COMPUTE_SANITIZER (default:
# the one on PATH, else /usr/local/cuda/bin/compute-sanitizer), CUFLASH_SANITIZE_TIMEOUT (seconds per
# tool, default 95: four tools fit a 7-minute run), CUFLASH_SANITIZE_ARGS (extra driver arguments, e.g. --quick).
#
# The driver runs once without a sanitizer first: that compiles the kernels (and CuPy's own) into the
# disk caches, so the instrumented runs only load them, and it fails fast if the driver is broken.
# Memory notes: the driver disables CuPy's pool, so every array is an exact-size cudaMalloc
# (memcheck catches overruns past any array; initcheck sees fresh memory), and all inputs are copied
# from the host, fully initialized; the NaN check reads every output, so an unwritten element is an
# initcheck error rather than a silent pass.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
logdir=${CUFLASH_SANITIZE_LOGDIR:-/tmp/cuflash-sanitize}
limit=${CUFLASH_SANITIZE_TIMEOUT:-95}
read -r -a driver_args <<< "${CUFLASH_SANITIZE_ARGS:-}"
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$sanitizer" ]; then
  echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck initcheck)
mkdir -p "$logdir"

echo "== warm-up run without a sanitizer"
if ! "$py" benchmarks/sanitize_driver.py ${driver_args[@]+"${driver_args[@]}"} > "$logdir/warmup.log" 2>&1; then
  echo "sanitize.sh: the driver fails without a sanitizer; see $logdir/warmup.log" >&2
  tail -n 30 "$logdir/warmup.log" >&2
  exit 1
fi
tail -n 2 "$logdir/warmup.log"

status=0
summary=()
for tool in "${tools[@]}"; do
  log="$logdir/$tool.log"
  start=$(date +%s)
  # initcheck does not see the stores of the bulk copies (cp.async.bulk, the async proxy): where the dK/dV kernel
  # stores a query block's first dQ that way, it reports the convert's reads of dq_accum as uninitialized (session
  # 36: every row of a fresh dq_accum at D64, none with TMA off, the same dq bits both ways). So initcheck runs
  # with TMA off (CUFLASH_TMA=0: cp.async loads, the pre-pass zeroes dq_accum); the NaN-poisoned GPU tests cover
  # the first stores (tests/test_tma_gpu.py).
  tma_env=(); [ "$tool" = initcheck ] && tma_env=(CUFLASH_TMA=0)
  env ${tma_env[@]+"${tma_env[@]}"} timeout "$limit" "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 50 \
      "$py" benchmarks/sanitize_driver.py ${driver_args[@]+"${driver_args[@]}"} > "$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | tail -n 1 | grep -Eo '[0-9]+')
  if [ -z "$errors" ]; then  # racecheck's own summary line: "... (N errors, M warnings)"
    errors=$(grep -Eo 'RACECHECK SUMMARY: .*\(([0-9]+) error' "$log" | tail -n 1 | grep -Eo '\(([0-9]+)' | tr -d '(')
  fi
  # racecheck reports intra-warp hazards (e.g. a missing __syncwarp) as warnings: count them too.
  hazards=$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazards' "$log" | tail -n 1 | grep -Eo '[0-9]+')
  if [ -n "$hazards" ] && [ "$hazards" != "0" ]; then
    errors=$(( ${errors:-0} + hazards ))
  fi
  note=""
  if [ "$rc" -eq 124 ]; then
    note=", TIMED OUT after ${limit} s"
  elif [ "$rc" -ne 0 ] && [ "${errors:-0}" = "0" ]; then
    note=", driver failed"
  fi
  [ ${#tma_env[@]} -gt 0 ] && note="$note, TMA off"
  line="$tool: ${errors:-?} errors (exit $rc, ${seconds} s${note}; log $log)"
  summary+=("$line")
  echo "$line"
  if [ "$rc" -ne 0 ] || [ "${errors:-1}" != "0" ]; then
    status=1
    grep -E '^=========' "$log" | head -n 40
    tail -n 5 "$log"
  fi
done

echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
