#!/usr/bin/env bash
# KV-cache tiers and prefill/decode hand-over on one GPU, in one device call:
#   1. scripts/probes/pd_cuda_check.py: a prompt's blocks from one engine's device cache into
#      another's pinned host tier (inline bytes, and CUDA IPC to a decode engine in another process);
#   2. `bench multiturn` at DeepSeek-V4-Flash widths (4 layers) with the device cache held small,
#      prefix caching off / on / with the host tier / with the disk tier after a restart (~4 minutes).
# Logs and JSON go to $OUT; summaries are printed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 200 python3 scripts/probes/pd_cuda_check.py > "$OUT/pd_cuda.log" 2>&1
echo "pd_cuda_check exit $?"; grep -E "ok|FAILED|OK|Error" "$OUT/pd_cuda.log" | tail -8
# bf16 weights (the figure is the cache's, not the weight kernels'); 600 blocks held the whole
# working set of 24 conversations (no lower-tier hits on an H100), so the cache is held to 200.
timeout 330 python3 -m deepinfer.entrypoints.cli bench multiturn --config deepseek-v4-flash --num-layers 4 \
    --weights bf16 --system-len 2000 --conversations 24 --turns 4 --question-len 128 --answer-len 64 --num-kv-blocks 200 \
    --settings off,on,host,disk --kv-offload-gib 8 --kv-disk-dir /tmp/kv-disk --kv-disk-gib 16 \
    --output-json "$OUT/multiturn_tiers.json" > "$OUT/multiturn_tiers.log" 2>&1
echo "multiturn exit $?"; tail -25 "$OUT/multiturn_tiers.log"
