#!/usr/bin/env bash
# The vLLM engine on GPUs, in device calls (vLLM 0.25.1 staged in /root/vstage first: ../shared/gpu/vllm/README.md).
# Each part writes into OUT (at most 8 files come back): the summary JSONs and the tail of each log.
#   source scripts/gpu/setup.sh && source scripts/gpu/vllm_unpack.sh && scripts/gpu/vllm.sh PART OUT
# PART: tests   tests/gpu/test_vllm_gpu.py (TP=2 where two GPUs are visible), figures in OUT/vllm-gpu-report.json
#       generate  bench generate on moe-1.6b: torch engine, the project's vLLM engine, plain LLM.generate (GEN_MODEL,
#                 GEN_ENGINES, GEN_PROMPTS, GEN_NEW_TOKENS change them; the node's generator, 512 sequences of 128
#                 tokens on moe-5b, routes on and off: GEN_MODEL=moe-5b GEN_ENGINES=vllm,vllm-noroutes,vllm-raw
#                 GEN_PROMPTS=512 GEN_NEW_TOKENS=128; vllm-per-step: logprobs and routes sent every step, as vLLM's
#                 own scheduler does; GEN_PROFILE=1: where plain vLLM's decoding time goes). A preset's weights
#                 are written once into /root/arl-presets, where node.sh's generators keep theirs: a run after
#                 node.sh on the same machine skips building them (moe-5b: about 80 s on the CPU)
#       loop      bench loop on moe-1.6b: Megatron learner on GPU 0, a vLLM generator on GPU 1 (checkpoints every
#                 LOOP_CHECKPOINT_EVERY=100 steps: a Megatron checkpoint of this model takes ~40 s, the generator idles;
#                 LOOP_GENERATOR adds the generator's overrides, e.g. "vllm.follow=core"; LOOP_TAG goes into the names)
#       mismatch  scripts/gpu/mismatch.py on moe-107m: each engine's logprobs against each learner backend's
#       swap      scripts/gpu/vllm_swap.py on moe-1.6b: the engine's swaps over CUDA IPC while it generates, one GPU
#                 (each vllm.swap mode in turn on one engine, then follow-core: vllm.follow=core; SWAP_MODES=pause,boundary
#                 picks)
set -uo pipefail
part=${1:?usage: vllm.sh PART OUT}
out=${2:?usage: vllm.sh PART OUT}
mkdir -p "$out"
gpu=$(python3 -c "import torch; n=torch.cuda.device_count(); print(torch.cuda.get_device_name(0).split()[1].lower() + 'x' + str(n))")
day=$(date +%Y-%m-%d)
case "$part" in
tests)
    ARL_GPU_REPORT="$out/vllm-gpu-report-$gpu-$day.json" timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -q -s -p no:cacheprovider \
        -o addopts="" tests/gpu/test_vllm_gpu.py > "$out/test_vllm_gpu.txt" 2>&1
    rc=$?; tail -40 "$out/test_vllm_gpu.txt"; exit $rc ;;
generate)
    model=${GEN_MODEL:-moe-1.6b}
    timeout ${GEN_TIMEOUT:-580} python3 -m actors.commands bench generate --model "$model" \
        --engines ${GEN_ENGINES:-torch,vllm,vllm-raw} --prompts ${GEN_PROMPTS:-256} \
        --new-tokens ${GEN_NEW_TOKENS:-200} --work-dir /root/arl-presets \
        ${GEN_PROFILE:+--profile} \
        --json "$out/generate-$gpu-$model-$day.json" > "$out/generate.log" 2>&1
    rc=$?; tail -30 "$out/generate.log"; exit $rc ;;
loop)
    extra=(); for kv in ${LOOP_GENERATOR:-}; do extra+=(--generator "$kv"); done
    run_dir=/tmp/run-loop-vllm-$(date +%s)  # a fresh one: bench loop refuses a directory that holds a run
    tag=${LOOP_TAG:+-$LOOP_TAG}
    timeout ${LOOP_TIMEOUT:-590} python3 -m actors.commands bench loop --model moe-1.6b --device cuda --backend megatron --steps ${LOOP_STEPS:-50} \
        --max-minutes ${LOOP_MINUTES:-8} --generators 1 --generator-engine vllm --generator-devices cuda:1 --learner megatron.lr=1e-5 --learner checkpoint.every=${LOOP_CHECKPOINT_EVERY:-100} \
        "${extra[@]}" --json "$out/loop-$gpu-1.6b-megatron-vllm$tag-$day.json" --run-dir "$run_dir" \
        > "$out/loop$tag.log" 2>&1
    rc=$?; tail -5 "$out/loop$tag.log"; for f in "$run_dir"/*.log; do echo "== $f"; tail -8 "$f"; done \
        > "$out/loop$tag-process-logs.txt"
    # each swap's breakdown (staged, paused, of which vLLM's in-place load), from the generator's log
    grep -h "vLLM engine\( core\)\?: version" "$run_dir"/generator-*.log >> "$out/loop$tag-process-logs.txt"
    rm -rf "$run_dir/checkpoints"  # moe-1.6b's final checkpoint, ~20 GB: a machine's disk holds few
    tail -40 "$out/loop$tag-process-logs.txt"; exit $rc ;;
mismatch)
    timeout 580 python3 scripts/gpu/mismatch.py --model moe-107m --engines ${MISMATCH_ENGINES:-vllm,vllm-fp32,torch} --json "$out/mismatch-$gpu-moe-107m-$day.json" \
        > "$out/mismatch.log" 2>&1
    rc=$?; tail -30 "$out/mismatch.log"; exit $rc ;;
swap)
    timeout ${SWAP_TIMEOUT:-580} python3 scripts/gpu/vllm_swap.py ${SWAP_MODES:+--modes $SWAP_MODES} --json "$out/vllm-swap-$gpu-moe-1.6b-$day.json" > "$out/vllm-swap.log" 2>&1
    rc=$?; tail -30 "$out/vllm-swap.log"; exit $rc ;;
*) echo "vllm.sh: unknown part $part" >&2; exit 2 ;;
esac
