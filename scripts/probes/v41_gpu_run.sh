#!/usr/bin/env bash
# DeepSeek-V4.1 on the GPU in two device calls of under ten minutes each:
#   check:   the tiny reference checkpoint through the engine on CUDA (v41_cuda_check.py), then
#            bench prefill of 4,096 tokens at V4.1-Flash widths (4 layers: ratio-2 source, reuse,
#            ratio-1 source, reindex) with prefill truncation full, exact and compact;
#            and bench prefill full with one layer fewer (the last layer's time by difference);
#   decode:  bench decode at B = 1, 16, 64 on the same 4 layers.
# NUM_LAYERS (default 4, about 113 GB in bf16: an H200) changes the depth. Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.
# The expert packing briefly holds a layer's gate_up weights twice: without expandable segments
# two layers OOM on an H100 from fragmentation.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
phase=${1:-check}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
BENCH="python3 -m deepinfer.entrypoints.cli bench"
if [ "$phase" = check ]; then
    timeout 240 python3 scripts/probes/v41_cuda_check.py > "$OUT/cuda_check.log" 2>&1 || { tail -40 "$OUT/cuda_check.log"; exit 1; }
    tail -5 "$OUT/cuda_check.log"
    for mode in full exact compact; do
        DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=$mode timeout 150 $BENCH prefill --config deepseek-v4.1-flash \
            --num-layers ${NUM_LAYERS:-4} --prompt-len 4096 --no-hf --warmup 2 --iters 3 \
            --output-json "$OUT/prefill_$mode.json" > "$OUT/prefill_$mode.log" 2>&1
        tail -4 "$OUT/prefill_$mode.log"
    done
    # One layer fewer (the last layer is then a KV source, so nothing is truncated): the
    # difference to the runs above is the last layer's prefill time in each mode.
    n=$(( ${NUM_LAYERS:-4} - 1 ))
    timeout 150 $BENCH prefill --config deepseek-v4.1-flash --num-layers $n --prompt-len 4096 --no-hf \
        --warmup 2 --iters 3 --output-json "$OUT/prefill_full_${n}layers.json" > "$OUT/prefill_full_${n}layers.log" 2>&1
    tail -4 "$OUT/prefill_full_${n}layers.log"
else
    for b in 1 16 64; do
        timeout 180 $BENCH decode --config deepseek-v4.1-flash --num-layers ${NUM_LAYERS:-4} --batch-size $b --no-hf \
            --output-json "$OUT/decode_b$b.json" > "$OUT/decode_b$b.log" 2>&1
        tail -4 "$OUT/decode_b$b.log"
    done
fi
