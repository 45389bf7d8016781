#!/usr/bin/env bash
# The KV host tier's slab and batched loads on one GPU, in one device call (~3 minutes):
#   1. the CUDA round-trip test (two entry sizes through pinned slab buffers, bit-exact);
#   2. scripts/probes/kv_host_slab_bench.py: save / load GB/s of 128-block batches, by the
#      store's counters and by wall time, the first round growing the slab;
#   3. `bench multiturn --settings host` at DeepSeek-V4-Flash widths (4 layers, 200 blocks), the
#      figure the transfers were measured at before (device_to_host 1.18 GB/s, host_to_device 1.34).
# Logs and JSON go to $OUT; summaries are printed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 120 python3 -m pytest -q -m gpu tests/unit/test_kv_host_slab.py > "$OUT/slab_gpu_test.log" 2>&1
echo "gpu test exit $?"; tail -3 "$OUT/slab_gpu_test.log"
timeout 120 python3 scripts/probes/kv_host_slab_bench.py --out "$OUT" > "$OUT/slab_bench.log" 2>&1
echo "slab bench exit $?"; tail -8 "$OUT/slab_bench.log"
timeout 300 python3 -m deepinfer.entrypoints.cli bench multiturn --config deepseek-v4-flash --num-layers 4 \
    --weights bf16 --system-len 2000 --conversations 24 --turns 4 --question-len 128 --answer-len 64 --num-kv-blocks 200 \
    --settings host --kv-offload-gib 8 --output-json "$OUT/multiturn_host.json" > "$OUT/multiturn_host.log" 2>&1
echo "multiturn exit $?"; tail -8 "$OUT/multiturn_host.log"
