"""The learner process: staleness-bounded batches from the rollout stream, the loss, weight versions published.

``loop`` (the training loop), ``backend`` with ``torch_backend`` and ``megatron/`` (the training backends),
``batching`` / ``samples`` (groups into micro-batches), ``publishing`` (weight versions out), ``checkpoint``
with ``run_state`` (the run's Redis state against the checkpoint),
``evaluation`` and ``simulate`` (a generator simulated in the learner's process for benchmarks). See
``docs/learner.md``.

May import: async_rl, buffer, actors.generator (simulate runs the torch engine in the learner's process).
"""
