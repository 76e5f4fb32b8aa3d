"""Megatron-core learner backend (tensor / pipeline / expert / context parallel MoE training with router replay).

Nothing here imports megatron-core at module import time: ``routes`` and ``convert`` are plain
numpy / torch (tested on CPU), and ``backend`` / ``replay`` / ``launch`` import megatron lazily, so the
project imports and tests on Python 3.11 without the (cp312-only) megatron-core wheel.
"""
