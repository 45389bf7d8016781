nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1
export PYTHONPATH=. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
s=$SECONDS
BENCH="python3 -m deepinfer.entrypoints.cli bench"
timeout 230 $BENCH multiturn --config deepseek-v4-flash --num-layers 4 --weights bf16 --system-len 2000 --conversations 24 --turns 4 --question-len 128 --answer-len 64 --num-kv-blocks 600 --settings off,on,host,disk --kv-offload-gib 8 --kv-disk-dir /tmp/kv-disk --kv-disk-gib 16 --output-json $OUT/multiturn_tiers.json > $OUT/multiturn_tiers.log 2>&1; echo "multiturn exit $? at $((SECONDS-s))"; tail -16 $OUT/multiturn_tiers.log
for b in 1 64; do timeout 70 $BENCH decode --config deepseek-v4-flash --num-layers 4 --weights fp8+fp4 --batch-size $b --context-len 1024 --steps 16 --no-hf --no-compare-sync --profile $OUT/prof_fp8fp4_b$b.txt > $OUT/dec_fp8fp4_b$b.log 2>&1; echo "decode fp8+fp4 B=$b exit $? at $((SECONDS-s))"; grep -E "B=|floor" $OUT/dec_fp8fp4_b$b.log | tail -3; head -24 $OUT/prof_fp8fp4_b$b.txt | cut -c1-150; done
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_gemm.py tests/kernels/test_fp4_moe.py tests/gpu/test_quant_gpu.py > $OUT/quant_tests.log 2>&1; echo "quant tests exit $? at $((SECONDS-s))"; grep -E "passed|failed|FAILED|Error" $OUT/quant_tests.log | tail -12
timeout 120 python3 scripts/probes/fp8_gemm_variants.py --budget 90 > $OUT/fp8_variants.log 2>&1; echo "fp8 variants exit $? at $((SECONDS-s))"; grep -E "BEST|BAD" $OUT/fp8_variants.log | head -20
