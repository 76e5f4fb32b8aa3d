"""Small real models and batches for the Megatron checks (GPU tests, layout script, benchmark).

A transformers ``Qwen3MoeForCausalLM`` of a chosen size with a seeded random init (same weights on
every rank: initialised on the CPU), right-padded micro-batches of random tokens, a token-level
negative log-likelihood loss that follows the backend loss-scaling contract, and the HF model's own
expert routes in the wire format (the last token of each sequence never run, as in a generator).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from async_rl.algorithms.batch import ForwardOutput, MicroBatch
from async_rl.model.hf_routes import record_routes


def toy_config(*, num_layers: int = 4, dense_first: bool = True, vocab_size: int = 512, hidden_size: int = 256,
               num_experts: int = 8, top_k: int = 2, moe_ffn: int = 128, heads: int = 4, kv_heads: int = 2,
               head_dim: int = 64, norm_topk_prob: bool = True, max_len: int = 1024) -> Qwen3MoeConfig:  # fmt: skip
    """A Qwen3-MoE config; ``dense_first`` makes layer 0 a dense MLP (DeepSeek-style)."""
    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * moe_ffn, moe_intermediate_size=moe_ffn,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_experts=num_experts, num_experts_per_tok=top_k, mlp_only_layers=[0] if dense_first else [],
        norm_topk_prob=norm_topk_prob, max_position_embeddings=max_len, tie_word_embeddings=False,
        router_aux_loss_coef=0.0, output_router_logits=False,
    )  # fmt: skip


def build_hf(cfg: Qwen3MoeConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cuda"
             ) -> Qwen3MoeForCausalLM:  # fmt: skip
    """The HF model with a seeded init (on the CPU, so every rank gets the same weights)."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen3MoeForCausalLM(cfg)
    # Router weights of a random init are tiny (std 0.02): widen them so routing is decisive, not near-tied.
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "weight"):
                gate.weight.normal_(0.0, 0.5)
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def make_batch(cfg: Qwen3MoeConfig, lengths: list[int], *, prompt_len: int = 8, seed: int = 0,
               step_num_tokens: int | None = None) -> MicroBatch:  # fmt: skip
    """A right-padded micro-batch of random tokens; responses are the tokens after ``prompt_len``."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.bool)
    loss = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, cfg.vocab_size, (n,), generator=g)
        attn[i, :n] = True
        loss[i, prompt_len:n] = True
    z = torch.zeros(b, t)
    n_resp = int(loss.sum())
    return MicroBatch(
        input_ids=ids, attention_mask=attn, loss_mask=loss, behaviour_logprobs=z.clone(), advantages=loss.float(),
        token_versions=torch.zeros(b, t, dtype=torch.long), routes=[None] * b,
        step_num_tokens=step_num_tokens or n_resp, step_num_sequences=b,
    )  # fmt: skip


def nll_loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-summed NLL over response tokens divided by the step's response tokens (the backend contract); metrics
    stay on the device, as the learner's losses keep them (no wait on the GPU per micro-batch)."""
    mask = mb.loss_mask.to(out.logprobs.device)
    nll = -(out.logprobs * mask).sum() / mb.step_num_tokens
    n = mask.sum().float()
    return nll, {"nll_per_token": -(out.logprobs.detach() * mask).sum() / n.clamp(min=1.0), "loss_tokens_count": n}


@torch.no_grad()
def hf_routes(model: Qwen3MoeForCausalLM, mb: MicroBatch) -> list[np.ndarray]:
    """The HF model's own routes per sample, ``[T_b - 1, moe_layers, top_k]`` uint8 (last token never run)."""
    dev = next(model.parameters()).device
    with record_routes(model) as rec:
        model(input_ids=mb.input_ids.to(dev), attention_mask=mb.attention_mask.to(dev))
    full = rec.take()[0].cpu().numpy()  # [B, T, L, k]
    lengths = mb.attention_mask.sum(dim=1).tolist()
    return [full[b, : int(n) - 1].astype(np.uint8) for b, n in enumerate(lengths)]


def with_routes(mb: MicroBatch, routes: Sequence[np.ndarray | None]) -> MicroBatch:
    """``mb`` with its routes replaced."""
    return MicroBatch(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, loss_mask=mb.loss_mask,
        behaviour_logprobs=mb.behaviour_logprobs, advantages=mb.advantages, token_versions=mb.token_versions,
        routes=list(routes), step_num_tokens=mb.step_num_tokens, step_num_sequences=mb.step_num_sequences,
    )  # fmt: skip


def random_routes(mb: MicroBatch, num_moe_layers: int, top_k: int, num_experts: int, seed: int = 1) -> list[np.ndarray]:
    """Random distinct experts per token (different from any learned routing)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in mb.attention_mask.sum(dim=1).tolist():
        r = np.argsort(rng.random((int(n) - 1, num_moe_layers, num_experts)), axis=-1)[..., :top_k]
        out.append(r.astype(np.uint8))
    return out
