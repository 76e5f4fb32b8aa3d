"""The MoE token dispatcher where one rank holds every expert: no host copies of the token counts, no identity sort.

megatron-core's all-to-all dispatcher, with expert and tensor parallelism both 1, still does two things meant for
several ranks:

* it copies the tokens per expert to the host and waits for them (once per MoE layer and micro-batch), so the
  host cannot queue work ahead of the GPU there;
* it "sorts" the permuted tokens and probabilities by local expert (``sort_chunks_by_idxs``), and unsorts the
  experts' output, with a permutation that is the identity on one rank: a split into one chunk per expert and a
  concatenation of the same chunks in the same order, forward and backward. On the Qwen3-30B-A3B slice (16k-token
  micro-batches, 8 routes a token) each is a copy of a ``[131k, 2048]`` bf16 tensor.

:func:`use_local_dispatchers` makes every such dispatcher of a model skip both, only where they are no-ops: one
expert-parallel and one tensor-parallel rank, dropless (no capacity factor, no padding for quantization). The
grouped experts (:mod:`.spec`) take the token counts on the device. Anything else keeps megatron's own path.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def local_dispatcher_class():  # type: ignore[no-untyped-def]
    """megatron's all-to-all dispatcher without its one-rank no-ops (built lazily: imports megatron)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class LocalTokenDispatcher(MoEAlltoAllTokenDispatcher):
        """:class:`MoEAlltoAllTokenDispatcher` for one EP x TP rank, dropless (see the module doc)."""

        def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None
                                        ) -> torch.Tensor:  # fmt: skip
            return tokens_per_expert  # type: ignore[return-value]  # counts stay on the device; no host wait

        def dispatch_postprocess(self, global_input_tokens, global_probs):  # type: ignore[no-untyped-def]
            tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
            return global_input_tokens, tokens_per_expert, global_probs  # already in expert order

        def combine_preprocess(self, hidden_states):  # type: ignore[no-untyped-def]
            return hidden_states

    return LocalTokenDispatcher


def use_local_dispatchers(model: torch.nn.Module) -> int:
    """Swap every eligible all-to-all dispatcher of ``model`` for :func:`local_dispatcher_class` (the class only: the
    subclass adds no state); returns how many were swapped."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    local = local_dispatcher_class()
    swapped = 0
    for module in model.modules():
        d = getattr(module, "token_dispatcher", None)
        if type(d) is MoEAlltoAllTokenDispatcher and _eligible(d):
            d.__class__ = local
            swapped += 1
    return swapped


def _eligible(d) -> bool:  # type: ignore[no-untyped-def]
    c = d.config
    return (
        d.ep_size == 1 and d.tp_size == 1 and not d.drop_and_pad and c.moe_expert_capacity_factor is None
        and not c.moe_router_padding_for_quantization and not getattr(c, "moe_permute_fusion", False)
    )  # fmt: skip
