"""Loss reductions against hand-computed values; renormalisation; micro-batch sums equal the step loss."""

from __future__ import annotations

import pytest
import torch

from async_rl.algorithms import reduce_loss

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])
KEEP = torch.tensor([[True, False, True, False], [True, False, False, False]])  # token 1 removed by a mask


@pytest.mark.parametrize(
    ("mode", "renormalize", "expected"),
    [
        ("token_mean", False, (1 + 3 + 4) / 4),
        ("token_mean", True, (1 + 3 + 4) / 3),
        ("seq_mean_token_mean", False, ((1 + 3) / 3 + 4 / 1) / 2),
        ("seq_mean_token_mean", True, ((1 + 3) / 2 + 4 / 1) / 2),
        ("seq_mean_token_sum", False, (4 + 4) / 2),
        ("seq_mean_token_sum", True, (4 + 4) / 2),
        ("token_sum_norm", False, (1 + 3 + 4) / (2 * 4)),
    ],
)
def test_hand_computed(mode: str, renormalize: bool, expected: float) -> None:
    out = reduce_loss(PER_TOKEN, KEEP, MASK, mode=mode, step_num_tokens=4, step_num_sequences=2,
                      renormalize=renormalize, max_tokens=4)  # fmt: skip
    assert out.item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"])
def test_micro_batches_sum_to_the_step_loss(mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    per_token = torch.randn(6, 7, dtype=torch.float64, generator=g)
    lengths = torch.tensor([7, 3, 1, 5, 0, 2])
    mask = torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)
    kw = dict(mode=mode, step_num_tokens=int(mask.sum()), step_num_sequences=6, max_tokens=7)
    full = reduce_loss(per_token, mask, mask, **kw)
    parts = sum(reduce_loss(per_token[i : i + 2], mask[i : i + 2], mask[i : i + 2], **kw) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(full.item(), rel=1e-12)


def test_renormalize_gives_the_same_total_weight_when_masks_are_uniform() -> None:
    # every micro-batch loses half its tokens: renormalised pieces sum to the mean over survivors
    per_token = torch.tensor([[2.0, 100.0], [4.0, 100.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    keep = torch.tensor([[True, False], [True, False]])
    kw = dict(mode="token_mean", step_num_tokens=4, step_num_sequences=2, renormalize=True)
    total = reduce_loss(per_token[:1], keep[:1], mask[:1], **kw) + reduce_loss(per_token[1:], keep[1:], mask[1:], **kw)
    assert total.item() == pytest.approx(3.0)


def test_all_masked_micro_batch_is_zero_not_nan() -> None:
    per_token = torch.full((2, 3), float("nan"))
    none = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"):
        for renorm in (False, True) if mode != "token_sum_norm" else (False,):
            out = reduce_loss(per_token, none, none, mode=mode, step_num_tokens=0, step_num_sequences=0,
                              renormalize=renorm, max_tokens=3)  # fmt: skip
            assert out.item() == 0.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="algorithm.loss.reduction must be one of"):
        reduce_loss(PER_TOKEN, KEEP, MASK, mode="mean", step_num_tokens=4, step_num_sequences=2)
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        reduce_loss(PER_TOKEN, KEEP, MASK, mode="token_sum_norm", step_num_tokens=4, step_num_sequences=2)
    with pytest.raises(ValueError, match="step_num_tokens"):
        reduce_loss(PER_TOKEN, KEEP, MASK, mode="token_mean", step_num_tokens=-1, step_num_sequences=2)
    with pytest.raises(ValueError, match="same"):
        reduce_loss(PER_TOKEN[:, :2], KEEP, MASK, mode="token_mean", step_num_tokens=4, step_num_sequences=2)
