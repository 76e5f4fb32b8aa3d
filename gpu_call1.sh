#!/usr/bin/env bash
# one-off device call: profile (issue 28) in parallel with the GPU tests (issues 25, 27, 28)
source scripts/gpu/setup.sh
o=$OUT; mkdir -p $o
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 280 python3 -m actors.commands bench backends --preset qwen3-30b-a3b-slice --default-settings-only \
    --logprob-chunk-tokens 0,4096 --profile --steps 4 --json $o/megatron-backends-h100-30b-a3b-slice-2l.json > $o/slice.log 2>&1
  echo "slice rc=$?" >> $o/slice.log
  timeout 150 python3 -m actors.commands bench backends --default-settings-only --layers 16 --hidden 1024 --experts 64 --top-k 8 \
    --moe-ffn 512 --heads 16 --kv-heads 4 --head-dim 64 --dense-first 0 --vocab 32768 --seq 1024 --batch 8 \
    --micro-batches 2 --logprob-chunk-tokens 0,4096 --profile --steps 4 --json $o/megatron-backends-h100-1.6b.json > $o/1.6b.log 2>&1
  echo "1.6b rc=$?" >> $o/1.6b.log
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for t in tests/gpu/test_chunked_logprobs_gpu.py tests/gpu/test_megatron_export.py tests/gpu/test_megatron_backend.py tests/gpu/test_torch_backend_gpu.py; do
    name=$(basename "$t" .py)
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider "$t" > "$o/$name.txt" 2>&1
    echo "$name: $(tail -1 "$o/$name.txt")" >> $o/tests.log
  done
) &
wait
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_weights.py > $o/test_gpu_weights.txt 2>&1
echo "test_gpu_weights: $(tail -1 $o/test_gpu_weights.txt)" >> $o/tests.log
timeout 110 torchrun --standalone --nproc-per-node 2 scripts/megatron/check_gpu_export.py --ep 2 --out $o/gpu-export-ep2.json > $o/gpu-export-ep2.log 2>&1
echo "gpu-export ep2: $(tail -1 $o/gpu-export-ep2.log | cut -c1-200)" >> $o/tests.log
cat $o/tests.log; grep -v Warning $o/slice.log | tail -60; grep -v Warning $o/1.6b.log | tail -45
