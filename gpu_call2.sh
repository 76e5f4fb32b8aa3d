#!/usr/bin/env bash
source scripts/gpu/setup.sh
o=$OUT; mkdir -p $o
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 300 python3 -m actors.commands bench backends --preset qwen3-30b-a3b-slice --default-settings-only \
    --logprob-chunk-tokens 0,4096 --profile --steps 4 --json $o/megatron-backends-h100-30b-a3b-slice-2l.json > $o/slice.log 2>&1
  echo "slice rc=$?" >> $o/slice.log
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_logit_stats_gpu.py > $o/logit_stats_gpu.txt 2>&1
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_backend.py tests/gpu/test_megatron_export.py tests/gpu/test_torch_backend_gpu.py tests/gpu/test_chunked_logprobs_gpu.py > $o/gpu_tests.txt 2>&1
  timeout 150 python3 -m actors.commands bench backends --default-settings-only --layers 16 --hidden 1024 --experts 64 --top-k 8 \
    --moe-ffn 512 --heads 16 --kv-heads 4 --head-dim 64 --dense-first 0 --vocab 32768 --seq 1024 --batch 8 \
    --micro-batches 2 --logprob-chunk-tokens 0,4096 --profile --steps 4 --json $o/megatron-backends-h100-1.6b.json > $o/1.6b.log 2>&1
  echo "1.6b rc=$?" >> $o/1.6b.log
) &
wait
grep -E "passed|failed|Error|logit stats|extra peak" $o/logit_stats_gpu.txt $o/gpu_tests.txt | head -20
grep -v Warning $o/slice.log | grep -E "ms/step|profile|by kind|rc=|Error|error" ; grep -v Warning $o/1.6b.log | grep -E "ms/step|profile|by kind|rc=|Error|error"
