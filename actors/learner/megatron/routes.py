"""Host-side cutting of recorded expert routes to one Megatron rank (pure numpy, no megatron-core import).

Routes arrive ragged per sample, ``[T_run, moe_layers, top_k]`` (see :mod:`async_rl.wire.types`).
megatron-core's ``RouterReplay`` wants, for every router instance that exists on *this* rank (in
construction order), an int64 ``[tokens_seen_by_this_router, top_k]`` tensor whose rows are in the
router's own token order: the decoder works in ``[seq, batch, hidden]``, so row ``s * B + b`` is
position ``s`` of sample ``b`` *of the local sequence*. This module computes, without a GPU:

* which decoder layers live on a pipeline stage (:class:`PipelineSplit`, a re-implementation of
  megatron-core's ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` for the non-virtual
  cases: even split, uneven first/last stage, embedding/loss counted as layers), and which of those
  are MoE layers (dense layers have no router: mapped by global layer number, never by position);
* which sequence positions a rank's routers see (:class:`TokenSplit`): context parallelism cuts each
  padded sequence into ``2 * cp`` chunks and rank ``r`` keeps chunk ``r`` and its mirror ``2cp-1-r``;
  sequence parallelism then keeps a contiguous ``1/tp`` of that local sequence;
* the replay tensors themselves (:func:`replay_indices`), with positions the engine never ran
  (``>= T_run``) and padding rows filled with *distinct* dummy experts spread over the experts, and a
  mask saying which rows carry real recorded routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PipelineSplit:
    """How megatron-core spreads ``num_layers`` decoder layers over ``pp_size`` stages (no virtual stages)."""

    num_layers: int
    """Decoder layers of the model."""
    pp_size: int = 1
    """Pipeline-parallel stages."""
    first_stage_layers: int | None = None
    """Layers on the first stage (megatron ``num_layers_in_first_pipeline_stage``), None for an even split."""
    last_stage_layers: int | None = None
    """Layers on the last stage (megatron ``num_layers_in_last_pipeline_stage``), None for an even split."""
    account_for_embedding: bool = False
    """Count the embedding as one layer of the first stage (megatron ``account_for_embedding_in_pipeline_split``)."""
    account_for_loss: bool = False
    """Count the loss as one layer of the last stage (megatron ``account_for_loss_in_pipeline_split``)."""

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {self.num_layers}")
        if self.pp_size <= 0:
            raise ValueError(f"pipeline size must be > 0, got {self.pp_size}")
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if uneven and (self.account_for_embedding or self.account_for_loss):
            raise ValueError("uneven first/last stages cannot be combined with account_for_embedding/loss")
        if uneven and self.pp_size == 1:
            raise ValueError("first/last stage layer counts need pipeline size > 1")
        for name, v in (("first_stage_layers", self.first_stage_layers), ("last_stage_layers", self.last_stage_layers)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if uneven:
            rest, stages = self._middle()
            if rest < 0:
                raise ValueError(
                    f"first_stage_layers + last_stage_layers exceed num_layers ({self.first_stage_layers}, "
                    f"{self.last_stage_layers}, {self.num_layers})"
                )
            if stages > 0 and rest % stages:
                raise ValueError(f"{rest} middle layers do not divide evenly over {stages} middle stages")
            if stages == 0 and rest:
                raise ValueError(f"{rest} layers are left over with no middle stage to hold them")
        else:
            total = self.num_layers + int(self.account_for_embedding) + int(self.account_for_loss)
            if total % self.pp_size:
                raise ValueError(f"{total} layers (embedding/loss counted) are not divisible by {self.pp_size} stages")

    def _middle(self) -> tuple[int, int]:
        first, last = self.first_stage_layers or 0, self.last_stage_layers or 0
        stages = self.pp_size - (self.first_stage_layers is not None) - (self.last_stage_layers is not None)
        return self.num_layers - first - last, stages

    def _check_rank(self, pp_rank: int) -> None:
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pipeline rank {pp_rank} out of range [0, {self.pp_size})")

    def num_layers_on(self, pp_rank: int) -> int:
        """Decoder layers built on stage ``pp_rank`` (megatron ``get_num_layers_to_build``)."""
        self._check_rank(pp_rank)
        if self.pp_size == 1:
            return self.num_layers
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            if pp_rank == 0 and self.first_stage_layers is not None:
                return self.first_stage_layers
            if pp_rank == self.pp_size - 1 and self.last_stage_layers is not None:
                return self.last_stage_layers
            rest, stages = self._middle()
            return rest // stages if stages else 0
        total = self.num_layers + int(self.account_for_embedding) + int(self.account_for_loss)
        n = total // self.pp_size
        if self.account_for_embedding and pp_rank == 0:
            n -= 1
        if self.account_for_loss and pp_rank == self.pp_size - 1:
            n -= 1
        return n

    def offset(self, pp_rank: int) -> int:
        """Global index of the first layer on stage ``pp_rank`` (megatron ``get_transformer_layer_offset``)."""
        self._check_rank(pp_rank)
        if self.pp_size == 1:
            return 0
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            if pp_rank == 0:
                return 0
            rest, stages = self._middle()
            per = rest // stages if stages else 0
            middle_rank = pp_rank if self.first_stage_layers is None else pp_rank - 1
            return middle_rank * per + (self.first_stage_layers or 0)
        total = self.num_layers + int(self.account_for_embedding) + int(self.account_for_loss)
        off = pp_rank * (total // self.pp_size)
        if self.account_for_embedding and pp_rank != 0:
            off -= 1
        return off

    def layers_on(self, pp_rank: int) -> range:
        """Global (0-based) decoder layer indices on stage ``pp_rank``."""
        start = self.offset(pp_rank)
        return range(start, start + self.num_layers_on(pp_rank))

    def stage_of(self, layer: int) -> int:
        """Stage that holds global layer ``layer``."""
        for r in range(self.pp_size):
            if layer in self.layers_on(r):
                return r
        raise ValueError(f"layer {layer} is on no stage of {self}")


def moe_indices_on_stage(split: PipelineSplit, pp_rank: int, moe_layers: Sequence[bool]) -> list[int]:
    """Positions among the MoE layers (the routes' middle axis) of the MoE layers on stage ``pp_rank``.

    ``moe_layers[i]`` says whether global decoder layer ``i`` is an MoE layer. The list is in
    construction order, i.e. the order of the stage's ``RouterReplay`` instances.
    """
    if len(moe_layers) != split.num_layers:
        raise ValueError(f"moe_layers has {len(moe_layers)} entries for a model of {split.num_layers} layers")
    moe_pos = np.cumsum([bool(m) for m in moe_layers]) - 1
    return [int(moe_pos[i]) for i in split.layers_on(pp_rank) if moe_layers[i]]


@dataclass(frozen=True, slots=True)
class TokenSplit:
    """Which positions of a (padded) sequence the routers of one rank see, in their order."""

    cp_size: int = 1
    """Context-parallel size."""
    cp_rank: int = 0
    """This rank's context-parallel rank."""
    tp_size: int = 1
    """Tensor-parallel size."""
    tp_rank: int = 0
    """This rank's tensor-parallel rank."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: each TP rank holds a contiguous ``1/tp`` of the (CP-local) sequence."""

    def __post_init__(self) -> None:
        if self.cp_size <= 0 or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"context-parallel rank {self.cp_rank} out of range for size {self.cp_size}")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {self.tp_rank} out of range for size {self.tp_size}")

    @property
    def multiple(self) -> int:
        """Padded sequence lengths must be multiples of this."""
        m = 2 * self.cp_size if self.cp_size > 1 else 1
        return m * (self.tp_size if self.sequence_parallel else 1)

    def padded_length(self, length: int) -> int:
        """``length`` rounded up to :attr:`multiple`."""
        if length <= 0:
            raise ValueError(f"sequence length must be > 0, got {length}")
        m = self.multiple
        return -(-length // m) * m

    def cp_positions(self, seq_len: int) -> np.ndarray:
        """Positions held by this CP rank, in local order: chunk ``r`` then chunk ``2cp-1-r``."""
        if self.cp_size == 1:
            return np.arange(seq_len, dtype=np.int64)
        chunks = 2 * self.cp_size
        if seq_len % chunks:
            raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {chunks}")
        c = seq_len // chunks
        a, b = self.cp_rank, chunks - 1 - self.cp_rank
        return np.concatenate([np.arange(a * c, (a + 1) * c), np.arange(b * c, (b + 1) * c)]).astype(np.int64)

    def positions(self, seq_len: int) -> np.ndarray:
        """Positions seen by this rank's routers, in the router's sequence order."""
        pos = self.cp_positions(seq_len)
        if self.sequence_parallel and self.tp_size > 1:
            if pos.size % self.tp_size:
                raise ValueError(f"local sequence length {pos.size} is not divisible by tp = {self.tp_size}")
            n = pos.size // self.tp_size
            pos = pos[self.tp_rank * n : (self.tp_rank + 1) * n]
        return pos


def dummy_experts(num_rows: int, top_k: int, num_experts: int) -> np.ndarray:
    """``[num_rows, top_k]`` distinct experts per row, rows spread round-robin so no expert gets all padding."""
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} exceeds num_experts {num_experts}")
    r = np.arange(num_rows, dtype=np.int64)[:, None]
    return (r * top_k + np.arange(top_k, dtype=np.int64)[None, :]) % num_experts


def check_routes(routes: np.ndarray, *, index: int, seq_len: int, num_moe_layers: int, top_k: int, num_experts: int
                 ) -> None:  # fmt: skip
    """Raise ValueError naming sample ``index`` if its routes do not fit the model and sequence."""
    if routes.ndim != 3 or routes.shape[1:] != (num_moe_layers, top_k):
        raise ValueError(
            f"routes of sample {index} have shape {routes.shape}; expected [T_run, {num_moe_layers}, {top_k}]"
        )
    if routes.shape[0] > seq_len:
        raise ValueError(f"routes of sample {index} cover {routes.shape[0]} positions, sequence has {seq_len}")
    if not np.issubdtype(routes.dtype, np.integer):
        raise ValueError(f"routes of sample {index} have dtype {routes.dtype}; expected an integer dtype")
    if routes.size and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(f"routes of sample {index} hold experts outside [0, {num_experts})")


@dataclass(slots=True)
class ReplayPlan:
    """Replay tensors for one micro-batch on one rank."""

    indices: np.ndarray
    """int64 ``[stage_moe_layers, num_rows, top_k]``: layer ``j`` feeds the ``j``-th router of this rank."""
    replayed: np.ndarray
    """bool ``[num_rows]``: True where the row carries a recorded route (False: padding / never-run positions)."""

    def per_layer(self) -> list[np.ndarray]:
        """One contiguous ``[num_rows, top_k]`` array per router, in construction order."""
        return [np.ascontiguousarray(self.indices[j]) for j in range(self.indices.shape[0])]


def replay_indices(
    routes: Sequence[np.ndarray | None],
    *,
    seq_len: int,
    positions: np.ndarray,
    moe_indices: Sequence[int],
    num_moe_layers: int,
    top_k: int,
    num_experts: int,
    lengths: Sequence[int] | None = None,
) -> ReplayPlan:
    """Cut ragged per-sample routes to one rank's routers.

    ``routes[b]`` is sample ``b``'s ``[T_run, num_moe_layers, top_k]`` array (or None: no recorded
    routes); the batch is right-padded to ``seq_len``; ``positions`` are the local positions in router
    order (:meth:`TokenSplit.positions`); ``moe_indices`` the stage's MoE layers
    (:func:`moe_indices_on_stage`). ``lengths[b]`` (optional) is sample ``b``'s real length, checked
    against its route count. Rows are ``s_local * B + b``.
    """
    batch = len(routes)
    if batch == 0:
        raise ValueError("replay_indices needs at least one sample")
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= seq_len):
        raise ValueError(f"positions fall outside the padded sequence of length {seq_len}")
    for j in moe_indices:
        if not 0 <= j < num_moe_layers:
            raise ValueError(f"MoE layer index {j} out of range [0, {num_moe_layers})")
    num_rows = positions.size * batch
    out = dummy_experts(num_rows, top_k, num_experts).reshape(positions.size, batch, top_k)
    out = np.broadcast_to(out[None], (len(moe_indices), positions.size, batch, top_k)).copy()
    replayed = np.zeros((positions.size, batch), dtype=bool)
    layer_sel = np.asarray(list(moe_indices), dtype=np.int64)
    for b, r in enumerate(routes):
        if r is None:
            continue
        limit = seq_len if lengths is None else int(lengths[b])
        check_routes(r, index=b, seq_len=limit, num_moe_layers=num_moe_layers, top_k=top_k, num_experts=num_experts)
        covered = positions < r.shape[0]
        if not covered.any():
            continue
        src = r[positions[covered]][:, layer_sel, :].astype(np.int64)  # [n, L_stage, k]
        out[:, covered, b, :] = np.transpose(src, (1, 0, 2))
        replayed[covered, b] = True
    return ReplayPlan(indices=out.reshape(len(moe_indices), num_rows, top_k), replayed=replayed.reshape(num_rows))


def scatter_recorded(
    per_layer: Sequence[np.ndarray],
    *,
    batch: int,
    positions: np.ndarray,
    moe_indices: Sequence[int],
    full: np.ndarray,
) -> None:
    """Inverse of :func:`replay_indices`: write one rank's recorded ``[rows, top_k]`` per router into ``full``.

    ``full`` is ``[batch, seq_len, num_moe_layers, top_k]``; rows are ``s_local * batch + b``.
    """
    if len(per_layer) != len(moe_indices):
        raise ValueError(f"{len(per_layer)} recorded layers for {len(moe_indices)} MoE layers on this stage")
    positions = np.asarray(positions, dtype=np.int64)
    for arr, j in zip(per_layer, moe_indices, strict=True):
        a = np.asarray(arr).reshape(positions.size, batch, -1)
        full[:, positions, j, :] = np.transpose(a, (1, 0, 2))
