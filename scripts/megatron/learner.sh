#!/usr/bin/env bash
# Start the Megatron learner under torchrun on one host: rank 0 reads the rollout stream and publishes
# weights, the other ranks follow it (MegatronBackend.follow()).
#   scripts/megatron/learner.sh NPROC --config run.toml learner.backend=megatron \
#       learner.megatron.pipeline_parallel=2 learner.megatron.expert_parallel=2 ...
# Several hosts: run torchrun yourself with --nnodes/--node-rank/--rdzv-endpoint and the same arguments.
set -euo pipefail
nproc=${1:?usage: learner.sh NPROC [async-rl learner arguments...]}
shift
exec torchrun --standalone --nproc-per-node "$nproc" --no-python async-rl learner "$@"
