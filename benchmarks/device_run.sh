#!/usr/bin/env bash
# One batched session on a lent GPU: install, compile every variant in parallel, then the named
# stages, each logging under $OUT (what comes back from the device machine).
#   bash benchmarks/device_run.sh tests bench            # the usual run
#   stages: tests (all gpu tests, short fuzz), quicktests (kernel grid only), fullsuite (the README's whole
#           `python -m pytest -q`, in the background: see the stage for collecting it), bench, benchquick
#           (benchmarks/bench.py through python -m cuflash bench; it exits 1 when nothing was measured),
#           features (the masks / score-options table against FlexAttention and SDPA), sanitize, fuzzlong,
#           fa4 (FlashAttention-4 for the bench, see below), ncu (one forward+backward of $NCU_CELL, default
#           D128-S4k-full, each kernel's speed-of-light, warp-state and scheduler sections), shards (on a
#           machine of several GPUs: the README's whole `python -m pytest -q` split by test file over every
#           GPU, then the four sanitizer tools one per GPU; in the foreground)
#
# FlashAttention-4 on the device machine (it reaches no package registry; ../shared/FACTS.md lists the wheels).
# The cu13 libs wheel, unzipped and xz-compressed, is ~61 MiB, the other wheels ~10 MB: together over the
# 64 MiB a call may carry, so two calls on one warm machine (the second within its ~30 s idle release):
#   call 1, carry [.whl] holding cu13x.tar.xz:  stage fa4 unpacks it into /tmp/cu13x
#   call 2, carry [.gl] holding the other wheels: stage fa4 installs them and copies /tmp/cu13x in; then bench
# (session 7: `tar cf - . | xz -9` of the unzipped cu13 wheel, 63.6 MB; `from flash_attn.cute import
# flash_attn_func` worked and the bench raced it).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cuflash-out}
mkdir -p "$OUT"
export CUFLASH_CACHE_DIR=/tmp/cuflash-cache

stamp() { echo "[$(date +%H:%M:%S)] $*"; }
# Temperature, SM clock, power and the driver's slowdown counters (cumulative since boot): printed before and
# after the stages, so a throttled machine shows (session 11: one H100 idled at 65 C and spent 95 s of its first
# 6 minutes in thermal slowdown, every implementation at 0.3-0.8x of other runs).
thermals() {
  nvidia-smi --query-gpu=temperature.gpu,clocks.sm,power.draw --format=csv,noheader
  nvidia-smi -q -d PERFORMANCE | sed -n '/Clocks Event Reasons Counters/,/^ *$/p' | tr -s ' ' | paste -sd' '
}

stamp "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
thermals | tee -a "$OUT/device.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# The tree travels without .git: the caller writes the commit to scratch/COMMIT before the run.
export CUFLASH_COMMIT=$(cat scratch/COMMIT 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
echo "commit $CUFLASH_COMMIT" | tee -a "$OUT/device.txt"

stamp "compile every variant"
# The README's whole suite (stages shards, fullsuite) includes test_build's spill check of every sm_80 variant
# too, which compiled them inside the suite's shard (session 22, 2 x H200: ~7 of that shard's minutes): those
# stages compile both arches here, on every core.
archs=""
case " $* " in *" shards "*|*" fullsuite "*) archs="--arch sm_80 --arch sm_90a" ;; esac
python3 -m cuflash compile --workers "$(nproc)" $archs > "$OUT/compile.txt" 2>&1
status=$?
head -3 "$OUT/compile.txt"; grep -c "cuflash::" "$OUT/compile.txt"
[ $status -eq 0 ] || { tail -60 "$OUT/compile.txt"; exit 1; }

for stage in "$@"; do
  stamp "stage $stage"
  case "$stage" in
    tests)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -p timeout --timeout 120 --maxfail=${MAXFAIL:-60} -rf --durations=15 ${TESTS:-tests} 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    quicktests)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_attention_gpu.py tests/test_build.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    bench)
      timeout 420 python3 -m cuflash bench --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -45 ;;
    benchquick)
      timeout ${BENCH_TIMEOUT:-180} python3 -m cuflash bench --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
    features)
      timeout ${BENCH_TIMEOUT:-240} python3 -m cuflash bench --features-only --out "$OUT/features" 2>&1 | tee "$OUT/features.log" | tail -30 ;;
    sanitize)
      timeout 420 bash benchmarks/sanitize.sh 2>&1 | tee "$OUT/sanitize.log" | tail -20 ;;
    fa4)
      if [ -f .whl/cu13x.tar.xz ] && [ ! -f /tmp/cu13x/OK ]; then
        mkdir -p /tmp/cu13x && xz -dc .whl/cu13x.tar.xz | tar -x -C /tmp/cu13x && touch /tmp/cu13x/OK
      fi
      if ls .gl/*.whl > /dev/null 2>&1 && [ -f /tmp/cu13x/OK ]; then
        python3 -m pip install -q --no-index --no-deps .gl/*.whl
        site=$(python3 -c "import site; print(site.getsitepackages()[0])")
        cp -r /tmp/cu13x/nvidia_cutlass_dsl/* "$site/nvidia_cutlass_dsl/"
        python3 -c "from flash_attn.cute import flash_attn_func; print('FlashAttention-4 importable')"
      fi 2>&1 | tee "$OUT/fa4.log" | tail -3 ;;
    ncu)
      cell=${NCU_CELL:-D128-S4k-full}
      for kernel in flash_fwd_kernel flash_bwd_dkdv_kernel flash_bwd_dq flash_bwd_preprocess; do
        timeout 120 ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
            python3 benchmarks/profile_cell.py "$cell" > "$OUT/ncu_$kernel.txt" 2>&1
        grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers|Stall|Issued Warp" "$OUT/ncu_$kernel.txt" | head -20
      done ;;
    shards)
      # Session 21 on four H200s: the suite in three shards (test_attention_gpu.py alone; options / extremes /
      # TMA / dropout / fuzz / wgmma; every other file) took 4-8 minutes, the sanitizers 3 more. Each shard runs
      # in a copy of the tree (tools/ included: test_build reads tools/gen_wgmma_sm90.py) on one GPU, all on the
      # kernel cache compiled above; GPUs beyond the shards take nothing.
      gpus=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$gpus" -ge 1 ] || gpus=1
      A="tests/test_attention_gpu.py"
      B="tests/test_options_gpu.py tests/test_extremes_gpu.py tests/test_tma_gpu.py tests/test_dropout_gpu.py tests/test_fuzz_gpu.py tests/test_wgmma_gpu.py"
      C=$(ls tests/test_*.py | grep -v -x -F -e $A $(for f in $B; do printf -- "-e %s " "$f"; done) | tr '\n' ' ')
      # Session 22 (2 x H200): A ~4.5 min, B ~2 min, C (CPU tests, build, interop, KV cache, varlen) the longest.
      if [ "$gpus" -ge 3 ]; then shards=("$A" "$B" "$C"); elif [ "$gpus" -eq 2 ]; then shards=("$A $B" "$C"); else shards=("$A $B $C"); fi
      i=0
      for S in "${shards[@]}"; do
        rm -rf /tmp/shard$i && mkdir /tmp/shard$i && cp -r cuflash cuda_src tests tools benchmarks pyproject.toml /tmp/shard$i/
        (cd /tmp/shard$i && CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout ${SHARD_TIMEOUT:-900} python3 -m pytest -q \
            -p no:cacheprovider -rf --durations=10 $S > "$OUT/shard$i.log" 2>&1; echo "exit $?" >> "$OUT/shard$i.log") &
        i=$((i + 1))
      done
      wait
      for f in "$OUT"/shard*.log; do echo "$f: $(grep -E '(passed|failed|error)' "$f" | tail -1) $(tail -1 "$f")"; done
      i=0
      for tool in memcheck racecheck synccheck initcheck; do
        rm -rf /tmp/san$i && mkdir /tmp/san$i && cp -r cuflash cuda_src benchmarks tests pyproject.toml /tmp/san$i/
        (CUDA_VISIBLE_DEVICES=$((i % gpus)) CUFLASH_SANITIZE_LOGDIR=/tmp/san_$tool CUFLASH_SANITIZE_TIMEOUT=300 \
            timeout 420 bash /tmp/san$i/benchmarks/sanitize.sh $tool > "$OUT/sanitize_$tool.log" 2>&1) &
        i=$((i + 1)); [ $((i % gpus)) -eq 0 ] && wait
      done
      wait
      for tool in memcheck racecheck synccheck initcheck; do tail -n 1 "$OUT/sanitize_$tool.log"; done ;;
    fullsuite)
      # The README's whole test command (7-9 min on an H100 with the kernels precompiled, session 12), which can
      # outlast the call that starts it: it runs in the background in a copy of the tree (every device call
      # re-syncs the working tree, and a suite reading cuda_src from it lost its sources mid-run in session 12),
      # its log under /tmp. Collect it with a second call on the still-warm machine (within its ~30 s idle
      # release), which waits for it and copies the log out (match the process by its arguments, not with
      # pgrep -f, whose pattern the call's own command line contains):
      #   p() { ps -eo pid,args | awk '$2=="python3" && $3=="-m" && $4=="pytest" {print $1}'; }
      #   while [ -n "$(p)" ]; do sleep 5; done; cp /tmp/cuflash-fullsuite.log $OUT/; tail -5 $OUT/cuflash-fullsuite.log
      rm -rf /tmp/cuflash-suite && cp -r . /tmp/cuflash-suite && rm -rf /tmp/cuflash-suite/scratch
      # Session 13: the starting call did not return before its limit although the stage had ended; the suite
      # now closes every inherited descriptor above stderr first, in case one of them is what the call waits on
      # (not yet seen to help).
      (cd /tmp/cuflash-suite && setsid nohup python3 -c 'import os; os.closerange(3, 65536); os.execvp("python3", ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider"])' > /tmp/cuflash-fullsuite.log 2>&1 < /dev/null &)
      echo "python -m pytest -q started in the background in /tmp/cuflash-suite, log /tmp/cuflash-fullsuite.log" ;;
    fuzzlong)
      CUFLASH_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-10000} CUFLASH_FUZZ_REPORT="$OUT/fuzz_count.txt" \
        timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fuzz_gpu.py 2>&1 | tee "$OUT/fuzz.log" | tail -15 ;;
    *)
      echo "unknown stage $stage" ;;
  esac
done
thermals | tee -a "$OUT/device.txt"
stamp "done"
