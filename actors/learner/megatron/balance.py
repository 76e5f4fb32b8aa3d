"""A training step's rows spread over data-parallel ranks by tokens, not by count.

The learner cuts a step into micro-batches under a padded-token budget, and the Megatron backend used to split each
micro-batch's rows over the DP ranks in contiguous runs of equal count. With RL's varied lengths that leaves one rank
with twice the tokens of another in a micro-batch of three rows (``[5114, 4643, 4278]``: 10,228 padded tokens against
5,114), and under expert parallelism every rank waits for the slowest at each layer's all-to-all. On the
Qwen3-30B-A3B slice with EP=2 (62.7k tokens a step in micro-batches of 16k) the busier rank carried 39.1k padded
tokens against 29.7k.

:func:`rebalance` regroups the step's rows, longest first, into rounds: each round gives every DP rank one
micro-batch, each row going to the rank whose micro-batch stays cheapest (``rows x longest``) within the cap, and a
round closes when no rank's micro-batch can take the next row. The cap is the learner's largest micro-batch divided
over the ranks (as before, a rank's part of a micro-batch), or one row where a row alone is longer. Similar lengths
share a round, so the ranks' micro-batches of a round cost about the same: the all-to-alls stop waiting on one rank.
A rank with nothing left in a round gets an empty micro-batch (the backend runs it as one masked row, so the
collectives stay matched).

The losses divide by step-global constants (``step_num_tokens``, ``step_num_sequences``), so which micro-batch a row
trains in changes nothing but the order of the sums. Plain torch: tested on the CPU (``tests/unit/megatron/
test_balance.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from async_rl.algorithms.batch import MicroBatch


def balanced_rounds(lengths: Sequence[int], dp_size: int, cap: int) -> list[list[list[int]]]:
    """``rounds[k][r]``: indices of ``lengths`` that DP rank ``r`` trains in its micro-batch ``k`` (see the module
    doc). Every index appears once; an empty list is an empty micro-batch."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rounds: list[list[list[int]]] = []
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    longest = [0] * dp_size
    for i in order:
        n = int(lengths[i])
        best, best_cost = -1, 0
        for r in range(dp_size):
            cost = max(longest[r], n) * (len(parts[r]) + 1)
            if (cost <= cap or not parts[r]) and (best < 0 or cost < best_cost):
                best, best_cost = r, cost
        if best < 0:  # every rank's micro-batch of this round is full
            rounds.append(parts)
            parts, longest, best = [[] for _ in range(dp_size)], [0] * dp_size, 0
        parts[best].append(i)
        longest[best] = max(longest[best], n)
    if any(parts):
        rounds.append(parts)
    return rounds


def rebalance(micro_batches: Sequence[MicroBatch], dp_size: int) -> list[list[MicroBatch]]:
    """``[round][dp rank]`` micro-batches holding every row of ``micro_batches`` once, on the host (see the module
    doc); an empty one has no rows and the width of its round."""
    if not micro_batches:
        return []
    picks = [(mb, r) for mb in micro_batches for r in range(mb.num_sequences)]
    lengths = [int(n) for mb in micro_batches for n in mb.attention_mask.sum(dim=1).tolist()]  # picks' order
    cap = max(-(-mb.num_sequences * int(mb.input_ids.shape[1]) // dp_size) for mb in micro_batches)
    out = []
    for parts in balanced_rounds(lengths, dp_size, cap):
        width = max(lengths[i] for part in parts for i in part)
        out.append([take_rows([picks[i] for i in part], like=micro_batches[0], width=width) for part in parts])
    return out


def take_rows(picks: Sequence[tuple[MicroBatch, int]], *, like: MicroBatch, width: int | None = None) -> MicroBatch:
    """One micro-batch of the rows ``picks`` (``(micro-batch, row)``, rows of any widths), right-padded to ``width``
    (default: the longest real length among them); ``like`` gives the step constants and the optional fields' presence
    (zero rows of ``width`` when ``picks`` is empty)."""
    w = width if width is not None else max((int(mb.attention_mask[r].sum()) for mb, r in picks), default=1)

    def rows(get) -> torch.Tensor:  # type: ignore[no-untyped-def]
        tensors = [_fit(get(mb)[r], w) for mb, r in picks]
        template = get(like)
        return torch.stack(tensors) if tensors else template.new_zeros((0, w))

    def opt_rows(get) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
        return None if get(like) is None else rows(get)

    return MicroBatch(
        input_ids=rows(lambda m: m.input_ids), attention_mask=rows(lambda m: m.attention_mask),
        loss_mask=rows(lambda m: m.loss_mask), behaviour_logprobs=rows(lambda m: m.behaviour_logprobs),
        advantages=rows(lambda m: m.advantages), token_versions=rows(lambda m: m.token_versions),
        routes=[mb.routes[r] for mb, r in picks], step_num_tokens=like.step_num_tokens,
        step_num_sequences=like.step_num_sequences, proximal_logprobs=opt_rows(lambda m: m.proximal_logprobs),
        reference_logprobs=opt_rows(lambda m: m.reference_logprobs),
        group_ids=[mb.group_ids[r] for mb, r in picks] if all(mb.group_ids for mb, _ in picks) and picks else [],
    )  # fmt: skip


def _fit(row: torch.Tensor, width: int) -> torch.Tensor:
    """A right-padded row cut or zero-padded to ``width`` (what lies past a row's length is padding)."""
    return row[:width] if row.shape[0] >= width else torch.nn.functional.pad(row, (0, width - row.shape[0]))
