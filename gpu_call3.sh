#!/usr/bin/env bash
source scripts/gpu/setup.sh
o=$OUT; mkdir -p $o
(CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/megatron/profile_step.py --preset qwen3-30b-a3b-slice --top 45 > $o/cprofile.txt 2>&1; echo "cprofile rc=$?" >> $o/cprofile.txt) &
(CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m actors.commands bench backends --preset qwen3-30b-a3b-slice --default-settings-only \
    --logprob-chunk-tokens 0,4096 --profile --steps 5 --json $o/megatron-backends-h100-30b-a3b-slice-2l.json > $o/slice.log 2>&1; echo "slice rc=$?" >> $o/slice.log) &
wait
grep -v Warning $o/slice.log | grep -E "ms/step|profile|by kind|rc=|Error|error"
grep -E "step wall|rc=" $o/cprofile.txt
