"""Per-token log-probabilities and entropy from logits, as both learner backends compute them.

``stats`` (``log p(target)`` and entropy in one fused pass on CUDA, plain torch elsewhere), ``kernels`` (its Triton
kernels, imported only where they run), ``chunked`` (the same from hidden states and the LM head, a chunk of tokens
at a time, so the full fp32 logits are never held).

May import: model.
"""
