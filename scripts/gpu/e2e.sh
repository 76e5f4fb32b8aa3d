#!/usr/bin/env bash
# The whole loop on GPUs, reproducible: `async-rl bench loop` on the benchmark MoEs, embedded servers, two
# torch-engine generators, the copy task; one summary JSON per run in OUT_DIR (steps/s, training time, publish
# share of the step, snapshot-to-applied per generator, generator fetch time, swap pause, reward curve, tokens by
# staleness, peak memory, tracebacks). Runs from a checkout (no console script needed).
#   scripts/gpu/e2e.sh OUT_DIR [STEPS] [MODELS]
# MODELS (default "moe-107m moe-1.6b"): moe-107m (8 layers, hidden 512, 32 experts top-4) and moe-1.6b (16 layers,
# hidden 1024, 64 experts top-8, 3.3 GB in bf16). One GPU: the learner (Megatron, then torch) and the generators
# share it. Two or more: moe-107m under torchrun on GPUs 0-1 with EP=2 and then PP=2 (every rank publishes its own
# pieces), generators on the last GPU; moe-1.6b with the torch learner on GPU 0 and a generator on GPUs 0 and 1.
set -euo pipefail
out=${1:?usage: e2e.sh OUT_DIR [STEPS] [MODELS]}
steps=${2:-40}
models=${3:-moe-107m moe-1.6b}
mkdir -p "$out"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 1 ] || { echo "e2e.sh: no CUDA GPU" >&2; exit 2; }
gpu_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
loop() {  # MODEL ...
    local model=$1; shift
    python3 -m actors.commands bench loop --model "$model" --device cuda --steps "$steps" --max-minutes 4 \
        --generator torch.model.dtype=bfloat16 "$@"
}
rc=0
for model in $models; do
    tag=${model#moe-}
    if [ "$ngpu" -eq 1 ]; then
        for backend in megatron torch; do
            loop "$model" --backend $backend --json "$out/loop-${gpu_name}x1-$tag-$backend.json" \
                --run-dir "$out/run-$tag-$backend" || rc=1
        done
    elif [ "$model" = moe-107m ]; then
        gen_gpu=$((ngpu - 1))
        for layout in "megatron.expert_parallel=2" "megatron.pipeline_parallel=2"; do
            lt=${layout#megatron.}; lt=${lt%%=*}
            loop "$model" --backend megatron --learner-nproc 2 --learner "$layout" --generator "torch.device=cuda:$gen_gpu" \
                --json "$out/loop-${gpu_name}x${ngpu}-$tag-megatron-${lt}.json" --run-dir "$out/run-$tag-$lt" || rc=1
        done
    else
        loop "$model" --backend torch --generators 2 --generator-devices cuda:0,cuda:1 \
            --json "$out/loop-${gpu_name}x${ngpu}-$tag-torch.json" --run-dir "$out/run-$tag-torch" || rc=1
    fi
done
exit $rc
