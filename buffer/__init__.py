"""The Redis streams between the processes: the prompt queue, the rollout buffer, staleness, dead letters, the audit.

``prompts`` (issuing prompts under admission control), ``rollout_writer`` / ``rollouts`` (the rollout stream's two
sides: back-pressure, ack after commit), ``audit`` (every prompt's fate, written with its ack) and the checks every
entry passes before it reaches a batch. Guarantees and figures: ``docs/buffer.md``.

May import: async_rl.
"""
