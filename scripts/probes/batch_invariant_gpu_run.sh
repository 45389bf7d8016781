#!/usr/bin/env bash
# Batch-invariant mode on CUDA in one device call of under six minutes:
#   1. the GPU tests (tests/gpu/test_batch_invariant_gpu.py: Llama, Qwen3-MoE, tiny DeepSeek-V4 and
#      the embedded V4.1 alone / batched / chunked / eager vs CUDA graphs / prefix hit / preempted,
#      bitwise; the op-level negative control) and the interpreter-free kernel tests of the mode;
#   2. bench decode at B = 1, 16, 64 and bench prefill of 4,096 tokens at DeepSeek-V4-Flash widths on
#      4 layers, each run measuring the normal mode and then the batch-invariant mode in one process
#      (the slowdown line).
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
timeout 190 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -s tests/gpu/test_batch_invariant_gpu.py \
    tests/kernels/test_batch_invariant_ops.py > "$OUT/tests.log" 2>&1
echo "pytest exit $? after $((SECONDS - start)) s"
grep -E "passed|failed|FAILED|Error|normal mode differs" "$OUT/tests.log" | tail -15
BENCH="python3 -m deepinfer.entrypoints.cli bench"
COMMON="--config deepseek-v4-flash --num-layers 4 --no-hf --batch-invariant"
for b in 1 16 64; do
    timeout 38 $BENCH decode $COMMON --batch-size $b --warmup 2 --steps 10 --output-json "$OUT/decode_b$b.json" \
        > "$OUT/decode_b$b.log" 2>&1
    echo "decode B=$b exit $?: $(grep -E "batch-invariant mode" "$OUT/decode_b$b.log" | head -1)"
done
timeout 50 $BENCH prefill $COMMON --prompt-len 4096 --warmup 1 --iters 2 --output-json "$OUT/prefill.json" \
    > "$OUT/prefill.log" 2>&1
echo "prefill 4096 exit $?: $(grep -E "batch-invariant mode" "$OUT/prefill.log" | head -1)"
echo "total $((SECONDS - start)) s"
