"""The two processes of async-rl and their pluggable parts: ``generator`` (inference
engines: torch, vLLM) and ``learner`` (training backends: torch, Megatron)."""
