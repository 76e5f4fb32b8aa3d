#!/usr/bin/env bash
# One node, four GPUs (issue 39): the node recipe in one device call, on moe-5b (5.06B parameters: its training state,
# 18 bytes a parameter, does not fit one GPU). A Megatron learner on GPUs 0-1 (2 ranks, EP=2), a vLLM generator on
# each of GPUs 2 and 3 taking every version over CUDA IPC from the learner's GPUs; NODE_STEPS (default 60) steps.
#   source scripts/gpu/setup.sh && source scripts/gpu/vllm_unpack.sh && scripts/gpu/node.sh OUT
# The work: the copy task's prompts, every response NODE_NEW_TOKENS=128 tokens long (vllm.stop_on_eos=false: a
# random-init model's lengths would be noise), 32 prompts x 8 samples a step. NODE_MODEL and NODE_GEN_DEVICES change
# the model and the generators' GPUs (node_gpus.sh: a two-GPU rehearsal); NODE_LEARNER and NODE_GENERATOR add
# overrides (e.g. NODE_LEARNER="megatron.recompute=false"). The generators' engine cores follow the versions themselves
# (NODE_FOLLOW=core, vllm.follow; since 2026-11-28: in use 0.090 s after the snapshot at p50 against 0.144 with the
# front end following them, docs/gpus.md); NODE_FOLLOW=front gives the project's default (with it
# NODE_GENERATOR="vllm.swap=pause" gives the swap before 2026-11-28). The generators write the
# preset once into /root/arl-presets (vllm.work_dir): a second run on the same machine skips the ~80 s of building
# moe-5b's random weights on the CPU.
# Writes OUT/node-<gpu>x4-moe-5b-megatron-vllm<-NODE_TAG>-<date>.json (bench loop's summary: learner_nproc,
# generator_engine, learner_idle_frac, generator_idle_frac, learner_ and generator_tokens_per_s_per_gpu,
# version_to_applied_s), OUT/node<-NODE_TAG>.log (bench loop's output) and OUT/node<-NODE_TAG>-process-logs.txt (the
# tail of each process's log, then every "vLLM engine: version" line of the generators, "vLLM engine core: version"
# with vllm.follow=core: each swap's breakdown).
# The learner's micro-batches hold up to NODE_MICRO_BATCH_TOKENS=65536 padded tokens (half on each data-parallel
# rank): a step's 256 sequences of about 135 tokens (~36k padded) in one. At EP=2 a micro-batch of moe-5b has a cost
# that hardly shrinks with its size (24 layers, each with the MoE all-to-all's host syncs, in the forward and the
# backward): 4096-token ones made a step of 34,560 tokens take 3.3 s on two H200s, about 0.37 s each for ~2,000 tokens
# a rank (node-h200x4-moe-5b-learner2-gen1-2026-11-27.json: 4,870 tokens/s a learner GPU, recompute off). With full
# recompute (the default) a rank peaked at 61.8 GiB on four H200s (node-h200x4-moe-5b-learner2-gen2-2026-11-27.json:
# the state 46 GB, each layer's input, one layer's activations for ~18k tokens; 53 GB was the estimate), within an
# H100's 80 GB; without it (megatron.recompute=false) far more: H200 only.
# Checkpoints every NODE_CHECKPOINT_EVERY=100 steps, i.e. not within the run: a Megatron checkpoint of this model
# takes tens of seconds and the generators idle meanwhile. The generators keep NODE_GEN_MEM=0.5 of their GPU for
# vLLM (40 GB: weights 10.1 GB, graphs, the rest KV cache): the other 40 GB is room for the worker's staging (~30 GB:
# the version as received from the two learner ranks, 10.1 GB, and two slots of it assembled) and, at start, the
# checkpoint it loads once to prove the replayed load (freed before the first version).
# The staleness bound is NODE_STALENESS=4 (bench loop's own is 2): admission keeps S steps of prompts in flight
# (S + 1, less learner.admission_lag_versions=1), and they must outlast a generator's batch, or the learner waits for
# every other step. On four H200s (S=2, node-h200x4-moe-5b-learner2-gen2-2026-11-27.json) 64 prompts in flight
# were 2.2 s of training against 2.5-2.9 s for a batch's 128 decoding steps: steps alternated 1.1 s and 2.7 s
# (learner idle 0.33) while the generators idled 0.58.
# NODE_PROFILE_S=25: py-spy (scripts/gpu/fetch-extra-wheels.sh) samples gen-0's front end and vLLM engine core for that
# long from the learner's 5th step on; OUT/pyspy-gen0-front.txt and -core.txt summarise where their time goes.
# The summary's generator_gpus_per_learner_gpu says how many generator GPUs one learner GPU keeps busy (docs/gpus.md).
# It said 0.43 there, from a generator rate that counted only the heartbeats a batch ended in (fixed since: the mean
# over every heartbeat); one generator for the two learner GPUs (NODE_GEN_DEVICES=cuda:2) left the learner waiting.
# The generators take half a learner step's prompts a batch (NODE_GEN_BATCH_PROMPTS=16) and run up to NODE_GEN_BATCHES=4
# batches at once, all decoding together (vllm.max_num_seqs NODE_GEN_SEQS, default those batches' sequences: 4 x 16
# prompts x 8 samples = 512, the largest batch vLLM 0.25 captures CUDA graphs for; past it every step runs eagerly).
# Each group is pushed as soon as its samples are done (before: with its batch). With vLLM's defaults (64 prompts a
# batch, two at once, 256 sequences decoding) two steps' rollouts came at once
# (node-h100x4-moe-5b-learner2-gen1-2026-11-27.json, one generator: learner idle 0.51, generator 0.29). With 1024
# sequences (four H200s, node-h200x4-moe-5b-learner2-gen1-1024seqs-2026-11-27.json) vLLM ran past its graphs: the
# learner waited 0.58. With 512 and one generator (node-h100x4-moe-5b-learner2-gen1-512seqs-2026-11-27.json) the
# learner waited 0.55: one H100 generated 11.7-15k tokens/s of moe-5b with 512 sequences running (vLLM's line), the
# two learner GPUs train ~29k. With two generators
# (node-h100x4-moe-5b-learner2-gen2-2026-11-27.json) the learner waited 0.15 and the generators idled 0.41.
# With a request's logprobs and routes sent once, at its end (actors/generator/vllm_scheduler.py), a generator decodes
# 15-27k tokens/s: the learner waited 0.064 with two generators, 0.17 with one (NODE_GEN_DEVICES=cuda:2), on four
# H100s (...-hold-until-final-2026-11-28.json; their generator idle shares counted the final checkpoint: docs/gpus.md).
# vLLM's own throughput line (running and waiting requests, KV cache use) is logged every 5 s
# (vllm.engine_args.disable_log_stats=false) and copied into node-process-logs.txt.
# Every generator is on this node and takes versions over CUDA IPC, so the learner publishes no host copies
# (publisher.gpu_host_copies=false): with them, rank 0 would keep a whole copy of the weights (10 GB) as the base of
# the next delta and encode every version on its GPU, beside training.
# The learner runs the distributed optimizer (NODE_DIST_OPT=true; docs/megatron.md): at EP=2 on two ranks the experts
# (95 % of the parameters) have one replica each, so it shards the dense 5 % (fp32 copy and Adam state: 1.4 GB a rank saved).
set -uo pipefail
out=${1:?usage: node.sh OUT}
mkdir -p "$out"
source "$(dirname "$0")/node_gpus.sh"
day=$(date +%Y-%m-%d)
run_dir=/tmp/run-node-$(date +%s)  # a fresh one: bench loop refuses a directory that holds a run
model=${NODE_MODEL:-moe-5b}
extra=()  # NODE_LEARNER / NODE_GENERATOR: more overrides, space-separated key=value
for kv in ${NODE_LEARNER:-}; do extra+=(--learner "$kv"); done
for kv in ${NODE_GENERATOR:-}; do extra+=(--generator "$kv"); done
tag=${NODE_TAG:+-$NODE_TAG}  # NODE_TAG goes into the names of what a run writes (two runs, one OUT)
json="$out/node-$gpu-$model-megatron-vllm$tag-$day.json"
staleness=${NODE_STALENESS:-4}
batch_prompts=${NODE_GEN_BATCH_PROMPTS:-16}
batches=${NODE_GEN_BATCHES:-4}
seqs=${NODE_GEN_SEQS:-$((batches * batch_prompts * 8))}  # 8: bench loop's sampling.n
profile_gen0() {  # NODE_PROFILE_S seconds of py-spy on gen-0's front end and engine core, from the learner's 5th step
    local i n p c
    for i in $(seq 600); do  # until the learner's 5th step; not at all if bench loop ended first
        [ -e "$run_dir.ended" ] && return 0
        n=$(grep -sc "learner.loop: step" "$run_dir/learner.log")  # empty until the learner's log exists
        [ "${n:-0}" -ge 5 ] && break
        sleep 1
    done
    p=$(pgrep -f "^[^ ]*python[0-9.]* -m actors.commands generator .*generator_id=gen-0" | head -1)
    [ -n "$p" ] || { echo "node.sh: no generator gen-0 to profile" >&2; return 0; }
    c=$(pgrep -P "$p" -f EngineCore | head -1)
    for who in "front $p" "core $c"; do
        set -- $who; [ -n "${2:-}" ] || continue
        py-spy record -d "$NODE_PROFILE_S" -r 100 -p "$2" --threads -f raw -o "/tmp/gen0-$1.txt" --nonblocking \
            > "/tmp/gen0-$1-pyspy.log" 2>&1 &
    done
    wait
    for who in front core; do  # the raw files are over what a device call brings back
        python3 "$(dirname "$0")/pyspy_summary.py" "/tmp/gen0-$who.txt" > "$out/pyspy-gen0-$who.txt" 2>&1
        { echo "== py-spy's own output, its last lines"; tail -8 "/tmp/gen0-$who-pyspy.log"; } >> "$out/pyspy-gen0-$who.txt"
    done
}
[ "${NODE_PROFILE_S:-0}" -gt 0 ] && { profile_gen0 & }
timeout ${NODE_TIMEOUT:-540} python3 -m actors.commands bench loop --model "$model" "${node[@]}" \
    --steps ${NODE_STEPS:-60} --max-minutes ${NODE_MINUTES:-8} \
    --learner megatron.lr=1e-5 --learner publisher.gpu_host_copies=false \
    --learner batching.micro_batch_tokens=${NODE_MICRO_BATCH_TOKENS:-65536} \
    --learner staleness.max_staleness=$staleness \
    --learner sampling.max_new_tokens=${NODE_NEW_TOKENS:-128} --generator vllm.stop_on_eos=false \
    --generator vllm.max_batch_prompts=$batch_prompts --generator batches_in_flight=$batches \
    --generator vllm.max_num_seqs=$seqs --generator vllm.engine_args.disable_log_stats=false \
    --generator vllm.work_dir=/root/arl-presets --generator vllm.follow=${NODE_FOLLOW:-core} \
    "${extra[@]}" --json "$json" --run-dir "$run_dir" > "$out/node$tag.log" 2>&1
rc=$?
touch "$run_dir.ended"; wait  # the profile, if one is under way
tail -5 "$out/node$tag.log"
for f in "$run_dir"/*.log; do  # each log's first and last lines (start-up, then how it ended), the noise left out
    grep -v " DEBUG \|main_grad.dtype\|vLLM engine\( core\)\?: version\|warnings.warn\|Avg generation throughput" "$f" \
        > /tmp/node-log-part
    echo "== $f"; head -25 /tmp/node-log-part; echo "..."; tail -35 /tmp/node-log-part
done > "$out/node$tag-process-logs.txt"
grep -h "vLLM engine\( core\)\?: version" "$run_dir"/generator-*.log >> "$out/node$tag-process-logs.txt"
grep -H "Avg generation throughput" "$run_dir"/generator-*.log >> "$out/node$tag-process-logs.txt"
whole_tracebacks "$run_dir"/*.log >> "$out/node$tag-process-logs.txt"
tail -40 "$out/node$tag-process-logs.txt"
# The final checkpoint of moe-5b (bf16 weights, their fp32 copy and Adam's two moments: ~70 GB) stays behind
# otherwise: a second run on the same machine (two H200s, 128 GiB of disk) had its learner exit 1 at its last step,
# when it writes its own, with no traceback (2026-11-28; its line was not kept then: the summary's exit_lines, printed
# below, keeps it now).
rm -rf "$run_dir/checkpoints"
python3 - "$json" <<'PY' || true
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("outcome", "steps", "learner_nproc", "generator_engine", "steps_per_s", "train_s", "learner_idle_frac",
        "generator_idle_frac", "learner_tokens_per_s_per_gpu", "generator_tokens_per_s_per_gpu",
        "generator_gpus_per_learner_gpu", "version_to_applied_s", "peak_memory_gib", "tracebacks", "exit_lines")
print({k: s.get(k) for k in keys})
PY
exit $rc
