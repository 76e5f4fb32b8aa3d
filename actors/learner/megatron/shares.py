"""A rank's share of a micro-batch: the Megatron backend's data path, and the reassembly of per-row outputs.

Each micro-batch's rows are split over data-parallel ranks (contiguous, sizes differing by at most one; an
empty share runs one fully masked dummy row so expert-parallel all-to-alls stay matched), right-padded to the
length context and sequence parallelism need, cut to this CP rank's positions, with the routes to replay turned
into per-router indices on the host (:func:`~actors.learner.megatron.routes.replay_indices`). :class:`ShareCutter`
does this on the host and uploads the result; the schedule asks for each share when it reaches that micro-batch,
so the host work overlaps the GPU's work on the previous one. :func:`gather_rows` puts the rows of every DP
replica's outputs back together on every rank.

Plain torch and numpy: tested on the CPU (``tests/unit/megatron/test_shares.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actors.learner.megatron.routes import TokenSplit, replay_indices
from async_rl.algorithms.batch import ForwardOutput, MicroBatch


@dataclass(slots=True)
class Share:
    """One rank's share of one micro-batch, on the device, ready for the forward step."""

    rows: np.ndarray
    """Row indices of the original micro-batch held here (empty for a dummy share)."""
    mb: MicroBatch
    """The share as a padded micro-batch on the device (full sequence length ``T``)."""
    input_ids: torch.Tensor
    """int64 ``[b, T_local]``: this CP rank's positions."""
    position_ids: torch.Tensor
    """int64 ``[b, T_local]``."""
    labels: torch.Tensor
    """int64 ``[b, T_local]``: next token of each local position (0 past the end)."""
    positions: torch.Tensor
    """int64 ``[T_local]``: global positions of this CP rank, in local order."""
    replay: list[torch.Tensor] | None
    """Per-router ``[rows, top_k]`` indices to replay, on the device, or None (free routing)."""


@dataclass(frozen=True, slots=True)
class ShareCutter:
    """Cuts micro-batches into this rank's shares (see the module docstring)."""

    dp_size: int
    dp_rank: int
    tokens: TokenSplit
    """This rank's CP/TP split of the sequence dimension (padding, positions)."""
    moe_indices: Sequence[int]
    """Indices among the model's MoE layers of the routers on this pipeline stage."""
    num_moe_layers: int
    top_k: int
    num_experts: int
    """Experts per MoE layer; 0 where there is nothing to replay (a dense model, or router replay off)."""
    device: torch.device

    def rows(self, num_sequences: int, whole: bool = False) -> np.ndarray:
        """Row indices of a micro-batch this DP rank takes: contiguous, shares differing by at most one (``whole``:
        every row, for a micro-batch that is already this rank's own, as :func:`~actors.learner.megatron.balance.
        rebalance` makes them)."""
        if whole:
            return np.arange(num_sequences)
        return np.array_split(np.arange(num_sequences), self.dp_size)[self.dp_rank]

    def schedule_shape(self, micro_batches: Sequence[MicroBatch], whole: bool = False) -> tuple[int, int]:
        """(local sequence length, rows) of this rank's largest share of these micro-batches (a dummy share has one
        row): what megatron's schedule is told before any share is cut."""
        seq = max(len(self.tokens.cp_positions(self.tokens.padded_length(int(mb.input_ids.shape[1]))))
                  for mb in micro_batches)  # fmt: skip
        return seq, max(max(len(self.rows(mb.num_sequences, whole)), 1) for mb in micro_batches)

    def cut(self, mb: MicroBatch, replay_routes: bool, whole: bool = False) -> Share:
        """This rank's DP share of ``mb`` (``whole``: all of it; none: a dummy share), padded for CP/SP, with its
        replay indices (when ``replay_routes`` and the share carries routes), uploaded to the device."""
        rows = self.rows(mb.num_sequences, whole)
        t_real = int(mb.input_ids.shape[1])
        seq = self.tokens.padded_length(t_real)
        share = _rows_of(mb, rows, seq - t_real) if rows.size else _dummy(mb, seq)
        ids = share.input_ids
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        pos_t = torch.from_numpy(self.tokens.cp_positions(seq))
        plan = None
        if replay_routes and self.num_experts and any(r is not None for r in share.routes):
            lengths = share.attention_mask.sum(dim=1).tolist()
            plan = replay_indices(share.routes, seq_len=seq, positions=self.tokens.positions(seq),
                                  moe_indices=list(self.moe_indices), num_moe_layers=self.num_moe_layers,
                                  top_k=self.top_k, num_experts=self.num_experts, lengths=lengths).per_layer()  # fmt: skip
        dev = self.device

        def up(t: torch.Tensor) -> torch.Tensor:  # (pinning these small tensors first cost 0.6 ms each on the host)
            return t.to(dev, non_blocking=True)

        return Share(
            rows=rows, mb=share.to(dev), input_ids=up(ids[:, pos_t]), labels=up(labels[:, pos_t]),
            position_ids=up(pos_t.unsqueeze(0).expand(ids.shape[0], -1)), positions=up(pos_t),
            replay=None if plan is None else [up(torch.from_numpy(np.ascontiguousarray(a))) for a in plan],
        )  # fmt: skip


def _rows_of(mb: MicroBatch, rows: np.ndarray, pad: int) -> MicroBatch:
    """Rows ``rows`` (contiguous) of ``mb``, right-padded by ``pad`` positions."""
    idx = slice(int(rows[0]), int(rows[-1]) + 1)  # array_split shares are contiguous: a view, no copy

    def cut(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t[idx], (0, pad)) if pad else t[idx]

    def cut_opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else cut(t)

    return MicroBatch(
        input_ids=cut(mb.input_ids), attention_mask=cut(mb.attention_mask), loss_mask=cut(mb.loss_mask),
        behaviour_logprobs=cut(mb.behaviour_logprobs), advantages=cut(mb.advantages),
        token_versions=cut(mb.token_versions), routes=[mb.routes[i] for i in rows],
        step_num_tokens=mb.step_num_tokens, step_num_sequences=mb.step_num_sequences,
        proximal_logprobs=cut_opt(mb.proximal_logprobs), reference_logprobs=cut_opt(mb.reference_logprobs),
        group_ids=[mb.group_ids[i] for i in rows] if mb.group_ids else [],
    )  # fmt: skip


def _dummy(mb: MicroBatch, seq: int) -> MicroBatch:
    """An empty share still runs (matched all-to-alls): one fully masked row of length ``seq``."""
    z = torch.zeros(1, seq)
    return MicroBatch(
        input_ids=z.long(), attention_mask=z.bool(), loss_mask=z.bool(), behaviour_logprobs=z.clone(),
        advantages=z.clone(), token_versions=z.long(), routes=[None], step_num_tokens=mb.step_num_tokens,
        step_num_sequences=mb.step_num_sequences,
        proximal_logprobs=None if mb.proximal_logprobs is None else z.clone(),
        reference_logprobs=None if mb.reference_logprobs is None else z.clone(),
    )  # fmt: skip


def gather_rows(mb: MicroBatch, share: Share | None, out: ForwardOutput | None, *, holds_rows: bool
                ) -> ForwardOutput:  # fmt: skip
    """Reassemble ``[B, T]`` outputs of ``mb`` on every rank from the ranks that computed them (``out`` of this
    rank's ``share``; ``holds_rows``: this rank's copy is the one to send, as TP rank 0 and CP rank 0 of the last
    pipeline stage). One ``all_gather_object`` over the world."""
    t = int(mb.input_ids.shape[1])
    mine = None
    if out is not None and share is not None and holds_rows and share.rows.size:
        ent = None if out.entropy is None else out.entropy[:, :t].float().cpu()
        mine = (share.rows, out.logprobs[:, :t].float().cpu(), ent)
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    lp = torch.zeros(mb.num_sequences, t)
    ent = None
    for p in parts:
        if p is None:
            continue
        rows, plp, pent = p
        lp[torch.from_numpy(rows)] = plp
        if pent is not None:
            ent = torch.zeros(mb.num_sequences, t) if ent is None else ent
            ent[torch.from_numpy(rows)] = pent
    return ForwardOutput(logprobs=lp, entropy=ent)
