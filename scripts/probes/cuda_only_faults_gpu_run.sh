#!/usr/bin/env bash
# Results that differ on CUDA and nowhere else, in one device call of under ten minutes, the one
# that decides an issue first:
#   1. the tiny DeepSeek-V4 DSpark engine's seeded tokens with the drafter's CUDA graphs against
#      eager in the batch-invariant mode (tests/gpu/test_drafter_graphs.py; in the normal mode
#      they differed, with the target's graphs alone matching eager bitwise);
#   2. the probe of 1 (logprobs at the first difference), then the quantised V4.1 release
#      checkpoint on CUDA against the CPU references with two prompts: as the test has it (graphs
#      captured), eager, without side streams (DEEPINFER_SIDE_STREAM=0), and with every
#      uninitialised allocation filled with NaN (--poison: a read of memory nothing wrote shows);
#   3. in the time left, the eager drift probe under compute-sanitizer memcheck.
# QUICK=1 stops after 1. Logs go to $OUT; summaries are printed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_drafter_graphs.py -k "v4 and seeded" \
    > "$OUT/drafter_graphs.log" 2>&1
echo "V4 seeded drafter graphs exit $?: $(grep -E "passed|failed" "$OUT/drafter_graphs.log" | tail -1)"
[ "${QUICK:-0}" = 1 ] && exit 0           # QUICK=1: only the check that decides an issue
timeout 100 python3 scripts/probes/v4_dspark_seeded_graphs.py > "$OUT/seeded.log" 2>&1
echo "seeded probe exit $?"; grep -E "^==|differs" "$OUT/seeded.log" | head -12
for run in "default:" "eager:--eager" "no side stream:" "poisoned:--poison"; do
    name=${run%%:*}; flags=${run#*:}
    side=1; [ "$name" = "no side stream" ] && side=0
    DEEPINFER_SIDE_STREAM=$side timeout 90 python3 scripts/probes/v41_quant_drift_cuda_vs_cpu.py $flags \
        > "$OUT/drift_${name// /_}.log" 2>&1
    echo "drift ($name) exit $?: $(head -3 "$OUT/drift_${name// /_}.log" | tr '\n' ' ')"
done
# Last, in what time the call has left: out-of-bounds or uninitialised device reads under
# compute-sanitizer (no caching allocator, so a read past a tensor's end leaves its allocation).
if command -v compute-sanitizer > /dev/null; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 8 \
        python3 scripts/probes/v41_quant_drift_cuda_vs_cpu.py --eager > "$OUT/drift_memcheck.log" 2>&1
    echo "drift under memcheck exit $?: $(grep -E "ERROR SUMMARY|Invalid" "$OUT/drift_memcheck.log" | head -4 | tr '\n' ' ')"
else
    echo "no compute-sanitizer on this machine"
fi
