"""The generator process: prompts in, scored groups out, weights swapped in while it generates.

``process`` (the loop: read prompts, generate, score, write groups), the engines behind ``engine.Engine``
(``torch_engine``; ``vllm_engine`` with ``vllm_worker`` inside vLLM's worker), ``episodes`` (multi-turn
environments), ``scoring`` (a reward or environment that raises costs its group, not the process), ``weight_sync`` / ``weight_swap`` (fetching and applying weight versions) and ``join`` (the check
against the run's facts before anything heavy starts). See ``docs/generator.md``.

May import: async_rl, buffer.
"""
