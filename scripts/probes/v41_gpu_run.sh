#!/usr/bin/env bash
# DeepSeek-V4.1 on the GPU in device calls of under ten minutes each:
#   check:   the GPU tests of the V4.1 kernels (packed KV records, pair pooling, candidate
#            blocks, engram gate and row gather, sparse attention, indexer), then the tiny
#            reference checkpoint through the engine on CUDA (v41_cuda_check.py: reference
#            greedy, packed records against the unpacked torch path, host-memory engram tables);
#   decode:  bench decode at B = 1, 16, 64 on 4 layers (ratio-2 source, reuse, ratio-1 source,
#            reindex);
#   prefill: bench prefill of 4,096 tokens on the same 4 layers with prefill truncation full,
#            exact and compact, and full with one layer fewer (the last layer's time by
#            difference); then `bench multiturn` (prefix caching on and off) at
#            DeepSeek-V4-Flash widths.
# NUM_LAYERS (default 4, about 113 GB in bf16: an H200) changes the V4.1 depth. Logs and JSON go
# to $OUT (the device returns at most eight files a call: summaries are printed).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.
# The expert packing briefly holds a layer's gate_up weights twice: without expandable segments
# two layers OOM on an H100 from fragmentation.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
phase=${1:-check}
layers=${NUM_LAYERS:-4}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
BENCH="python3 -m deepinfer.entrypoints.cli bench"
steady() { grep -E "engine, steady|engine, round|^  B=" "$1" | head -3; }
if [ "$phase" = check ]; then
    timeout 200 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider --continue-on-collection-errors tests/kernels/test_kv_records.py \
        tests/kernels/test_pool_window.py tests/kernels/test_candidate_blocks.py tests/kernels/test_engram_gate.py \
        tests/kernels/test_engram_gather.py tests/kernels/test_sparse_attention.py tests/kernels/test_indexer.py \
        > "$OUT/tests.log" 2>&1
    echo "pytest exit $?"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -12
    timeout 380 python3 scripts/probes/v41_cuda_check.py > "$OUT/cuda_check.log" 2>&1
    echo "cuda check exit $?"; tail -22 "$OUT/cuda_check.log"
elif [ "$phase" = decode ]; then
    for b in 1 16 64; do
        timeout 100 $BENCH decode --config deepseek-v4.1-flash --num-layers "$layers" --batch-size $b --no-hf \
            > "$OUT/decode_b$b.log" 2>&1
        steady "$OUT/decode_b$b.log"; grep -E "GPU busy" "$OUT/decode_b$b.log" | head -1
    done
else
    for mode in full exact compact; do
        DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=$mode timeout 100 $BENCH prefill --config deepseek-v4.1-flash \
            --num-layers "$layers" --prompt-len 4096 --no-hf --warmup 2 --iters 3 > "$OUT/prefill_$mode.log" 2>&1
        echo "$mode:"; steady "$OUT/prefill_$mode.log"
    done
    # One layer fewer (the last layer is then a KV source, so nothing is truncated): the
    # difference to the runs above is the last layer's prefill time in each mode.
    timeout 100 $BENCH prefill --config deepseek-v4.1-flash --num-layers $((layers - 1)) --prompt-len 4096 --no-hf \
        --warmup 2 --iters 3 > "$OUT/prefill_full_fewer.log" 2>&1
    echo "full, $((layers - 1)) layers:"; steady "$OUT/prefill_full_fewer.log"
    timeout 200 $BENCH multiturn --config deepseek-v4-flash --num-layers 4 \
        --output-json "$OUT/multiturn_v4flash.json" > "$OUT/multiturn_v4flash.log" 2>&1
    echo "multiturn exit $?"; tail -10 "$OUT/multiturn_v4flash.log"
fi
