#!/usr/bin/env bash
# Every learner rank publishes its own pieces (two GPUs): the bit-for-bit check of what a same-host reader assembles
# against the gathered export (EP=2, PP=2, TP=2; scripts/megatron/check_gpu_export.py), then `bench loop` with the
# 2-rank Megatron learner (moe-107m, EP=2 and PP=2) on the GPU path, generators on the last GPU.
#   scripts/gpu/ranks.sh OUT_DIR [STEPS]
set -uo pipefail
out=${1:?usage: ranks.sh OUT_DIR [STEPS]}
steps=${2:-30}
mkdir -p "$out"
gpu_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
rc=0
for layout in "ep 2" "pp 2" "tp 2"; do
    set -- $layout
    timeout 150 torchrun --standalone --nproc-per-node 2 scripts/megatron/check_gpu_export.py --$1 $2 \
        --out "$out/gpu-export-$1$2.json" > "$out/gpu-export-$1$2.log" 2>&1 || { rc=1; tail -20 "$out/gpu-export-$1$2.log"; }
    tail -1 "$out/gpu-export-$1$2.log"
done
for layout in "megatron.expert_parallel=2" "megatron.pipeline_parallel=2"; do
    tag=${layout#megatron.}; tag=${tag%%=*}
    dir=/tmp/runs/ranks-$tag-$(date +%s)
    timeout 200 python3 -m actors.commands bench loop --model moe-107m --device cuda --backend megatron --steps "$steps" \
        --max-minutes 3 --learner-nproc 2 --learner "$layout" --learner publisher.gpu_host_copies=false \
        --generator torch.device=cuda:1 --generator torch.model.dtype=bfloat16 \
        --json "$out/loop-${gpu_name}x2-megatron-$tag-gpu.json" --run-dir "$dir" > "$out/loop-$tag.log" 2>&1 || rc=1
    for f in "$dir"/*.log; do echo "== $f"; grep -v " DEBUG " "$f" | tail -12; done >> "$out/loop-$tag.log"
    python3 -c "
import json, sys
s = json.load(open('$out/loop-${gpu_name}x2-megatron-$tag-gpu.json'))
print('$tag', {k: s.get(k) for k in ('outcome', 'steps', 'steps_per_s', 'train_s', 'step_interval_s', 'publish_block_frac',
      'version_to_applied_s', 'gpu_publish_latency_s', 'learner_idle_frac', 'generator_idle_frac', 'tracebacks')})" || true
done
exit $rc
