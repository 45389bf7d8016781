#!/usr/bin/env bash
# Batch-invariant mode on CUDA in one device call of under ten minutes (the tests took over 200 s
# on an H100):
#   1. the GPU tests (tests/gpu/test_batch_invariant_gpu.py: Llama, Qwen3-MoE, tiny DeepSeek-V4 and
#      the embedded V4.1 alone / batched / chunked / eager vs CUDA graphs / prefix hit / preempted,
#      bitwise; the op-level negative control) and the interpreter-free kernel tests of the mode;
#   2. bench curve (decode at B = 1, 16, 64, context 1,024) and bench prefill of 4,096 tokens at
#      DeepSeek-V4-Flash widths on 4 layers, each process measuring the normal mode and then the
#      batch-invariant mode (the slowdown lines);
#   3. bench decode at B = 1 with --profile: both modes' kernels by device time.
# Under ten minutes only with SKIP_TESTS=1 after a first call (tests 144 s, curve and prefill
# ~110 s on an H100).
# Logs go to $OUT; summaries are printed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
start=$SECONDS
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 270 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -s tests/gpu/test_batch_invariant_gpu.py \
    tests/kernels/test_batch_invariant_ops.py > "$OUT/tests.log" 2>&1
echo "pytest exit $? after $((SECONDS - start)) s"
grep -E "passed|failed|FAILED|Error|normal mode differs" "$OUT/tests.log" | tail -15
BENCH="python3 -m deepinfer.entrypoints.cli bench"
COMMON="--config deepseek-v4-flash --num-layers 4 --weights bf16 --no-hf --batch-invariant"
# One process for the three decode points in both modes (one engine a mode), one for prefill.
timeout 200 $BENCH curve $COMMON --batch-sizes 1,16,64 --context-len 1024 --warmup 2 --steps 8 \
    --output-json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
echo "decode curve exit $?"; grep -E "^B=[0-9]+: " "$OUT/decode.log" | head -6
timeout 90 $BENCH prefill $COMMON --prompt-len 4096 --warmup 1 --iters 2 --output-json "$OUT/prefill.json" \
    > "$OUT/prefill.log" 2>&1
echo "prefill 4096 exit $?: $(grep -E "batch-invariant mode" "$OUT/prefill.log" | head -1)"
# B = 1 in both modes, each profiled (the mode's extra time at one token, by kernel).
timeout 120 $BENCH decode $COMMON --batch-size 1 --context-len 1024 --steps 16 --no-compare-sync \
    --profile "$OUT/profile_b1.txt" > "$OUT/decode_b1.log" 2>&1
echo "B=1 profiles exit $?"; head -12 "$OUT/profile_b1.txt"; head -12 "$OUT/profile_b1.batch-invariant.txt"
echo "total $((SECONDS - start)) s"
