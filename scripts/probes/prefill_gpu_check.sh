#!/bin/bash
# DeepSeek-V4-Flash prefill speed in one device call, from the repository root on an H200 (about 6
# minutes): the GPU tests of the prefill kernels, the probes that time them against their
# alternatives in one process, and `bench prefill` with a profile taken with PDL off (with
# PDL on, the profiler charges each kernel with part of the previous one's run).
#   bash scripts/probes/prefill_gpu_check.sh 2>&1 | tail -120     # the profile lands in $OUT
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp}
echo "=== GPU tests"
timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_sparse_attention_gluon.py tests/kernels/test_fused_moe.py \
    tests/kernels/test_router.py tests/kernels/test_hyper_connection.py tests/kernels/test_indexer.py \
    tests/kernels/test_topk.py 2>&1 | tail -6
echo "=== indexer: per-token vs token blocks, top-k early exit"
if [ -d .git ]; then
    timeout 120 python3 scripts/probes/indexer_prefill_ab.py 2>&1 | tail -60
else   # the device's copy of the tree has no .git: the old kernels must come as files
    echo "skipped: no .git here; run indexer_prefill_ab.py with a directory of the old indexer.py/topk.py"
fi
echo "=== sparse attention: Triton vs Gluon"
timeout 120 python3 scripts/probes/sparse_attention_gluon_check.py 2>&1 | tail -10
echo "=== routed experts: stacked vs packed weights"
timeout 120 python3 scripts/probes/fused_moe_packed.py 2>&1 | tail -12
echo "=== hc_pre: the block's RMSNorm fused into the collapse vs hc_pre + rms_norm"
timeout 60 python3 scripts/probes/hc_norm_fuse.py 2>&1 | tail -20
echo "=== bench prefill, profile with PDL off"
DEEPINFER_PDL=0 timeout 200 python3 -m deepinfer.entrypoints.cli bench prefill --config deepseek-v4-flash \
    --prompt-len 4096 --no-hf --profile "$OUT/prefill_profile.txt" 2>&1 | tail -8
head -40 "$OUT/prefill_profile.txt" | cut -c1-100,150-200
