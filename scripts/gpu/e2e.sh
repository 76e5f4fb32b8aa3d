#!/usr/bin/env bash
# The whole loop on GPUs, reproducible: `async-rl bench loop` on the 107M-parameter benchmark MoE (8 layers,
# hidden 512, 32 experts top-4), embedded servers, two torch-engine generators, the copy task; one summary JSON
# per run in OUT_DIR (steps/s, training time, publish share of the step, generator fetch time, swap pause,
# reward curve, tokens by staleness, peak memory, tracebacks). Runs from a checkout (no console script needed).
#   scripts/gpu/e2e.sh OUT_DIR [STEPS]
# One GPU: learner (Megatron, then torch) and generators share it. Two or more: the learner under torchrun on
# GPUs 0-1 with EP=2 and then PP=2, the generators on the last GPU.
set -euo pipefail
out=${1:?usage: e2e.sh OUT_DIR [STEPS]}
steps=${2:-40}
mkdir -p "$out"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 1 ] || { echo "e2e.sh: no CUDA GPU" >&2; exit 2; }
gpu_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
loop() { python3 -m actors.commands bench loop --model moe-107m --device cuda --steps "$steps" --max-minutes 4 "$@"; }
rc=0
if [ "$ngpu" -eq 1 ]; then
    loop --backend megatron --json "$out/loop-${gpu_name}x1-megatron.json" --run-dir "$out/run-megatron" || rc=1
    loop --backend torch --json "$out/loop-${gpu_name}x1-torch.json" --run-dir "$out/run-torch" || rc=1
else
    gen_gpu=$((ngpu - 1))
    for layout in "megatron.expert_parallel=2" "megatron.pipeline_parallel=2"; do
        tag=${layout#megatron.}; tag=${tag%%=*}
        loop --backend megatron --learner-nproc 2 --learner "$layout" --generator "torch.device=cuda:$gen_gpu" \
            --json "$out/loop-${gpu_name}x${ngpu}-megatron-${tag}.json" --run-dir "$out/run-$tag" || rc=1
    done
fi
exit $rc
