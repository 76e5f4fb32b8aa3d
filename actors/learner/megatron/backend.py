"""MegatronBackend: the TrainingBackend on megatron-core (TP / PP / EP / CP / DP, router replay, HF export).

Calling convention (multi-rank), either of:

* leader/followers (``async-rl learner`` under torchrun): rank 0 calls the methods; every other rank
  calls :meth:`MegatronBackend.follow`, which runs the same methods on rank 0's arguments until rank 0
  calls ``close()``;
* SPMD (tests, scripts): every rank calls the same methods in the same order; rank 0's arguments are
  used and the others' ignored.

Either way only the main rank needs to read the stream. Each micro-batch's rows are split
(:mod:`actors.learner.megatron.shares`) over data-parallel ranks (contiguous, sizes differing by at most one; an empty share runs one masked
dummy row so expert-parallel all-to-alls stay matched). Results come back on every rank.

Loss scaling (see :mod:`actors.learner.backend`): the loss function returns this micro-batch's share
of the step loss with step-global denominators. We run megatron-core with
``calculate_per_token_loss=True`` (no division by the number of micro-batches, DDP gradient scaling
1.0 = a *sum* over data-parallel ranks) and a ``finalize_model_grads`` that ignores the token count
(no division by tokens), so the gradient is exactly the sum the contract asks for. With context
parallelism every CP rank computes the same full-sequence loss from all-gathered logprobs, and the
gather's backward keeps only the rank's own positions, so the CP gradient sum is exact as well.

Sequence packing: the local (non-TE) attention has no packed-sequence (THD) support, so micro-batches
are right-padded ``[B, T]`` with a causal mask (pads never influence real tokens) and padded to a
multiple of ``2*CP`` (and TP under sequence parallelism).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch

from actors.learner.megatron import optimizer_state, replay
from actors.learner.megatron.balance import rebalance
from actors.learner.megatron.build import MegatronBuild, te_available
from actors.learner.megatron.checkpoint_reader import write_rank_layout
from actors.learner.megatron.config import MegatronConfig
from actors.learner.megatron.convert import ModelArch, RankNaming, hf_to_mcore
from actors.learner.megatron.launch import init_distributed
from actors.learner.megatron.logits import CPGather, token_stats
from actors.learner.megatron.routes import (
    PipelineSplit,
    TokenSplit,
    moe_indices_on_stage,
    scatter_recorded,
)
from actors.learner.megatron.shares import Share, ShareCutter, gather_rows
from async_rl.algorithms.batch import ForwardOutput, LossFn, MicroBatch, StepResult
from async_rl.algorithms.metrics import parts_to_floats, reduce_metrics
from async_rl.model.moe import route_dtype


class MegatronBackend(MegatronBuild):
    """A megatron-core GPTModel built from a Hugging Face config, with optimizer and router replay."""

    name = "megatron"
    cfg: MegatronConfig
    arch: ModelArch
    split: PipelineSplit
    tokens: TokenSplit
    moe_idx: list[int]
    shares: ShareCutter
    """Cuts micro-batches into this rank's shares (data path: ``shares.py``)."""
    naming: RankNaming
    _reference: list[torch.Tensor] | None
    """Frozen initial parameters of this rank (the KL reference policy), or None."""
    pad_token_id: int | None
    """The HF config's pad token: its word-embedding row gets no gradient (HF's padding_idx semantics)."""
    _masked_ids: torch.Tensor
    """``cfg.masked_token_ids`` on the device (the generators' sampling mask, applied to vocab-parallel logits)."""

    def __init__(self, cfg: MegatronConfig, hf_config: object, hf_state_dict: Mapping[str, torch.Tensor] | None = None,
                 *, reference_model: bool = False) -> None:  # fmt: skip
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self._gpu_slots = self._gpu_cfg = None
        self.arch = ModelArch.from_hf_config(hf_config)
        pad = getattr(hf_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None and 0 <= int(pad) < self.arch.vocab_size else None
        init_distributed(cfg)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self._masked_ids = torch.tensor(cfg.masked_token_ids, dtype=torch.long, device=self.device)
        if cfg.spec == "te" and not te_available():
            raise ValueError("learner.megatron.spec='te' but transformer_engine is not installed")
        self.te_spec = cfg.spec == "te" or (cfg.spec == "auto" and te_available())
        if cfg.context_parallel > 1 and not self.te_spec:
            raise ValueError("learner.megatron.context_parallel > 1 needs the Transformer Engine spec (TE attention)")
        if self.arch.vocab_size % cfg.tensor_parallel:
            raise ValueError(
                f"vocab size {self.arch.vocab_size} is not divisible by tensor_parallel={cfg.tensor_parallel}"
            )
        if self.arch.num_experts and self.arch.num_experts % cfg.expert_parallel:
            raise ValueError(f"{self.arch.num_experts} experts do not split over expert_parallel={cfg.expert_parallel}")
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp_rank = ps.get_context_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.etp_size = ps.get_expert_tensor_parallel_world_size()
        self.is_first = ps.is_pipeline_first_stage()
        self.is_last = ps.is_pipeline_last_stage()
        self.split = PipelineSplit(num_layers=self.arch.num_layers, pp_size=cfg.pipeline_parallel,
                                   first_stage_layers=cfg.first_stage_layers, last_stage_layers=cfg.last_stage_layers)  # fmt: skip
        self.tokens = TokenSplit(cp_size=cfg.context_parallel, cp_rank=self.cp_rank, tp_size=cfg.tensor_parallel,
                                 tp_rank=self.tp_rank, sequence_parallel=cfg.sequence_parallel)  # fmt: skip
        self.moe_idx = moe_indices_on_stage(self.split, self.pp_rank, self.arch.moe_layers)
        self.shares = ShareCutter(
            dp_size=self.dp_size, dp_rank=self.dp_rank, tokens=self.tokens, moe_indices=self.moe_idx,
            num_moe_layers=self.arch.num_moe_layers, top_k=self.arch.top_k,
            num_experts=self.arch.num_experts if cfg.router_replay else 0, device=self.device,
        )  # fmt: skip
        local_experts = self.arch.num_experts // cfg.expert_parallel if self.arch.num_experts else 0
        self.naming = RankNaming(
            layer_offset=self.split.offset(self.pp_rank), num_local_layers=self.split.num_layers_on(self.pp_rank),
            expert_offset=self.ep_rank * local_experts, num_local_experts=local_experts, te_spec=self.te_spec,
            grouped_experts=self.te_spec, has_embedding=self.is_first, has_output=self.is_last,
        )  # fmt: skip
        self.tc = self._transformer_config()
        if cfg.router_replay and self.arch.num_experts:
            replay.check_replay_config(self.tc)
            replay.reset_instances()
        self.gpt = self._build_model()
        if self.arch.num_experts and cfg.router_replay and replay.num_routers() != len(self.moe_idx):
            raise RuntimeError(
                f"built {replay.num_routers()} routers on pipeline stage {self.pp_rank}, host-side split expects "
                f"{len(self.moe_idx)}: megatron's layer placement and PipelineSplit disagree"
            )
        if hf_state_dict is not None:
            self._load_global(hf_to_mcore(hf_state_dict, self.arch))
        # The reference policy (KL penalty): a frozen copy of this rank's initial parameters, on the same device;
        # a reference forward swaps it in and out (pointer swaps, no copies), so it costs one model's memory.
        self._reference = [p.detach().clone() for p in self.gpt.parameters()] if reference_model else None
        self._build_ddp_and_optimizer()

    # ------------------------------------------------------------------------------------------ interface

    @property
    def is_main_rank(self) -> bool:
        return torch.distributed.get_rank() == 0

    @property
    def num_moe_layers(self) -> int:
        return self.arch.num_moe_layers

    def _command(self, name: str, payload: dict) -> dict:
        """Rank 0's (``name``, ``payload``) on every rank: the one place where the main rank's data reaches the others.

        SPMD callers (every rank calls the same method) get rank 0's arguments; :meth:`follow` receives the
        name too and dispatches. Payloads travel with cloudpickle (so closures such as the learner's loss
        function, built by ``make_loss_fn``, travel as well).
        """
        if torch.distributed.get_world_size() == 1:
            return payload
        import cloudpickle

        box: list = [None]
        if self.is_main_rank:
            try:
                box[0] = cloudpickle.dumps((name, payload))
            except Exception as e:  # what cannot be pickled is the caller's mistake: say which call
                raise ValueError(f"arguments of {name}() cannot be sent to the other ranks: {e}") from e
        torch.distributed.broadcast_object_list(box, src=0)
        got_name, got = cloudpickle.loads(box[0])
        if got_name != name:
            raise RuntimeError(f"rank {torch.distributed.get_rank()} called {name}() while rank 0 called {got_name}()")
        return got

    def follow(self) -> None:
        """Non-main ranks: run the commands the main rank issues (its method calls) until it calls :meth:`close`."""
        if self.is_main_rank:
            raise RuntimeError("follow() is for the non-main ranks; the main rank calls the backend's methods")
        import cloudpickle

        while True:
            box: list = [None]
            torch.distributed.broadcast_object_list(box, src=0)
            name, payload = cloudpickle.loads(box[0])
            if name not in _FOLLOWED:
                raise RuntimeError(f"rank 0 sent unknown command {name!r}")
            result = getattr(self, f"_{name}")(**payload)
            if name == "export_weights":
                for _ in result:
                    pass
            if name == "close":
                return

    def _forward_output(self, logits: torch.Tensor, item: Share, with_entropy: bool) -> ForwardOutput:
        from megatron.core import parallel_state as ps

        lp, ent = token_stats(logits, item.labels, with_entropy, ps.get_tensor_model_parallel_group(),
                              self.cfg.tensor_parallel, temperature=self.cfg.temperature,
                              masked_ids=self._masked_ids if self.cfg.masked_token_ids else None)  # fmt: skip
        seq = item.mb.input_ids.shape[1]
        if self.cfg.context_parallel > 1:
            group = ps.get_context_parallel_group()
            lp = CPGather.apply(lp, item.positions, seq, group)
            ent = None if ent is None else CPGather.apply(ent, item.positions, seq, group)
        # position t of the logits predicts token t+1: shift right so logprobs[:, t] belongs to input_ids[:, t].
        valid = item.mb.attention_mask
        lp = torch.nn.functional.pad(lp[:, :-1], (1, 0)).masked_fill(~valid, 0.0)
        if ent is not None:
            ent = torch.nn.functional.pad(ent[:, :-1], (1, 0)).masked_fill(~valid, 0.0)
        return ForwardOutput(logprobs=lp, entropy=ent)

    def _run_schedule(self, micro_batches: Sequence[MicroBatch], loss_func, *, forward_only: bool, replaying: bool,
                      record: bool = False):  # type: ignore[no-untyped-def]  # fmt: skip
        """One megatron pipeline schedule over ``micro_batches``; replay state cleared before and after.

        Each micro-batch's share (:class:`~actors.learner.megatron.shares.ShareCutter`: host-side cutting, replay
        indices, uploads) is made when the schedule asks for it, while the GPU still runs the previous micro-batch:
        made all up front they kept the GPU idle for 190 ms of an 800 ms step on the Qwen3-30B-A3B slice (11
        micro-batches of 8k tokens)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dev = self.device
        driving = bool(self.arch.num_experts and self.cfg.router_replay)

        def forward_step(data_iterator, model):  # type: ignore[no-untyped-def]
            item = next(data_iterator)
            plan = item.replay if replaying else None
            if driving and not record:
                replay.set_forward(plan, dev)
            out = model(input_ids=item.input_ids, position_ids=item.position_ids, attention_mask=None)
            if driving and not record and not forward_only:
                out = replay.backward_switch(out, replaying=plan is not None)
            return out, partial(loss_func, item)

        # A training step's rows go to the DP ranks balanced by tokens (balance.py); a forward-only pass keeps its one
        # micro-batch's rows in order, since the outputs come back by row.
        whole = not forward_only and self.dp_size > 1
        if whole:
            micro_batches = [r[self.dp_rank] for r in rebalance(micro_batches, self.dp_size)]
        seq, rows = self.shares.schedule_shape(micro_batches, whole)
        items = (self.shares.cut(mb, replaying, whole) for mb in micro_batches)
        fb = get_forward_backward_func()
        with replay.schedule_scope() if driving else _null():
            if record:
                replay.set_record()
            result = fb(forward_step_func=forward_step, data_iterator=items, model=[self.ddp],
                        num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=rows,
                        forward_only=forward_only)  # fmt: skip
            recorded = replay.recorded() if record else None
        return result, recorded

    @torch.no_grad()
    def forward_logprobs(self, mb: MicroBatch, *, replay_routes: bool = True, with_entropy: bool = False,
                         reference: bool = False) -> ForwardOutput:  # fmt: skip
        if reference and self._reference is None:
            raise ValueError("this Megatron backend was built without a reference model (reference_model=False)")
        p = self._command("forward_logprobs", {"mb": mb, "replay_routes": replay_routes, "with_entropy": with_entropy,
                                               "reference": reference})  # fmt: skip
        return self._forward_logprobs(**p)

    def _swap_reference(self) -> None:
        """Exchange the live parameters' storage with the frozen reference copy (call twice to undo)."""
        assert self._reference is not None
        for i, p in enumerate(self.gpt.parameters()):
            live = p.data
            p.data = self._reference[i]
            self._reference[i] = live

    @torch.no_grad()
    def _forward_logprobs(self, mb: MicroBatch, replay_routes: bool, with_entropy: bool, reference: bool = False
                          ) -> ForwardOutput:  # fmt: skip
        if reference:
            self._swap_reference()
            try:
                return self._forward_logprobs(mb, replay_routes, with_entropy)
            finally:
                self._swap_reference()
        got: list[Share] = []
        outs: list[ForwardOutput] = []

        def collect(it: Share, logits: torch.Tensor):  # type: ignore[no-untyped-def]
            got.append(it)
            outs.append(self._forward_output(logits, it, with_entropy))
            return torch.zeros((), device=self.device), torch.ones((), dtype=torch.int, device=self.device), {}

        self.ddp.eval()
        try:
            self._run_schedule([mb], collect, forward_only=True, replaying=replay_routes)
        finally:
            self.ddp.train()
        return gather_rows(mb, got[0] if got else None, outs[0] if outs else None,
                           holds_rows=self.tp_rank == 0 and self.cp_rank == 0)  # fmt: skip

    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, replay_routes: bool = True,
                   with_entropy: bool = False) -> StepResult:  # fmt: skip
        p = self._command("train_step", {"micro_batches": list(micro_batches), "loss_fn": loss_fn,
                                         "replay_routes": replay_routes, "with_entropy": with_entropy})  # fmt: skip
        return self._train_step(**p)

    def _train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, replay_routes: bool, with_entropy: bool
                    ) -> StepResult:  # fmt: skip
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        start = time.perf_counter()
        metrics: list[tuple[Mapping[str, torch.Tensor | float], torch.Tensor | float]] = []
        losses: list[torch.Tensor] = []

        def loss_func(it: Share, logits: torch.Tensor):  # type: ignore[no-untyped-def]
            out = self._forward_output(logits, it, with_entropy)
            loss, m = loss_fn(out, it.mb)
            if self.tp_rank == 0 and self.cp_rank == 0 and it.rows.size:  # on the device until the step is queued
                metrics.append((m, it.mb.loss_mask.sum()))
                losses.append(loss.detach().reshape(()))  # this DP share's part of the step loss
            return loss, torch.ones((), dtype=torch.int, device=self.device), {}

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(micro_batches, loss_func, forward_only=False, replaying=replay_routes)
        self._freeze_pad_row()
        # The contract's skipped step (actors/learner/backend.py): megatron's fp16/bf16 optimizers skip on inf/nan
        # themselves, but its fp32 one steps with them (NaN weights ever after), so every rank checks first.
        if self._nonfinite_grads():
            ok, grad_norm = False, None
        else:
            ok, grad_norm, _ = self.optimizer.step()
        mine = (parts_to_floats(metrics), float(torch.stack(losses).sum()) if losses else 0.0)
        parts: list = [mine]
        if torch.distributed.get_world_size() > 1:
            parts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, mine)
        avg = reduce_metrics([m for p in parts if p for m in p[0]])
        num_tokens = sum(int(mb.num_tokens) for mb in micro_batches)
        if ok and grad_norm is None:  # an unchained optimizer without clipping reports none: compute it
            grad_norm = self.optimizer.get_grad_norm()
        gn = float(grad_norm) if ok and grad_norm is not None else math.inf
        elapsed = time.perf_counter() - start
        avg.update({
            "loss": sum(p[1] for p in parts if p), "grad_norm": gn,
            "lr": float(self.optimizer.param_groups[0]["lr"]), "step_skipped": 0.0 if ok else 1.0,
            "num_micro_batches": float(len(micro_batches)),
            "train_tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0,
            "mem_peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,  # this rank's peak so far
        })  # fmt: skip
        return StepResult(metrics=avg, grad_norm=gn, num_tokens=num_tokens)

    def _nonfinite_grads(self) -> bool:
        """True on every rank when any rank holds an inf/nan gradient (one all-reduce, one host sync)."""
        bad = torch.zeros((), device=self.device)
        for p in self.gpt.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().to(bad.dtype))
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return bool(bad.item())

    def _freeze_pad_row(self) -> None:
        """Hugging Face's pad semantics: ``nn.Embedding(padding_idx=pad)`` gives the pad token's word-embedding row
        no gradient, so it stays as loaded (zero in HF models) and is exported unchanged. Megatron's embedding has
        no padding_idx: its pad row would get the gradient of RMSNorm at x = 0 (about 1/sqrt(eps), ~1000x the rest)
        whenever a pad token sits inside a sequence, and dominate the clipped gradient norm. With untied
        embeddings the row's whole gradient is the lookup's, so zeroing it before the norm and the step is exact.
        (Tied embeddings also carry the LM head's gradient in that row, as in HF: not zeroed; see docs/megatron.md.)"""
        pad = self.pad_token_id
        if pad is None or not self.is_first or self.arch.tie_embeddings:
            return
        emb = self.gpt.embedding.word_embeddings
        lo, hi = int(emb.vocab_start_index), int(emb.vocab_end_index)
        if lo <= pad < hi:
            w = emb.weight
            grad = getattr(w, "main_grad", None)
            if grad is None:
                grad = w.grad
            if grad is not None:
                grad[pad - lo].zero_()

    @torch.no_grad()
    def record_routes(self, mb: MicroBatch) -> list[np.ndarray]:
        """This model's own routes for ``mb`` in the wire format (``[T_b, moe_layers, top_k]`` uint8/int16 per sample)."""
        if not (self.arch.num_experts and self.cfg.router_replay):
            raise ValueError("record_routes needs an MoE model built with learner.megatron.router_replay = true")
        return self._record_routes(**self._command("record_routes", {"mb": mb}))

    @torch.no_grad()
    def _record_routes(self, mb: MicroBatch) -> list[np.ndarray]:
        def collect(it: Share, logits: torch.Tensor):  # type: ignore[no-untyped-def]
            return torch.zeros((), device=self.device), torch.ones((), dtype=torch.int, device=self.device), {}

        self.ddp.eval()
        try:
            _, rec = self._run_schedule([mb], collect, forward_only=True, replaying=False, record=True)
            per_layer = [t.cpu().numpy() for t in rec]
        finally:
            self.ddp.train()
        rows = self.shares.rows(mb.num_sequences)
        seq = self.tokens.padded_length(int(mb.input_ids.shape[1]))
        mine = None
        if rows.size:
            mine = (rows, self.tokens.positions(seq), self.moe_idx, per_layer)
        parts: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, mine)
        full = np.full((mb.num_sequences, seq, self.arch.num_moe_layers, self.arch.top_k), -1, dtype=np.int64)
        for p in parts:
            if p is None:
                continue
            rows, positions, moe_idx, arrays = p
            sub = full[rows]
            scatter_recorded(arrays, batch=len(rows), positions=positions, moe_indices=moe_idx, full=sub)
            full[rows] = np.where(sub >= 0, sub, full[rows])
        dt = route_dtype(self.arch.num_experts)
        lengths = mb.attention_mask.sum(dim=1).tolist()
        out = [full[b, : int(n)].astype(dt) for b, n in enumerate(lengths)]
        if any((o < 0).any() for o in [full[b, : int(n)] for b, n in enumerate(lengths)]):
            raise RuntimeError("some positions/layers were recorded by no rank")
        return out

    def save(self, directory: Path) -> None:
        self._save(**self._command("save", {"directory": Path(directory)}))

    def _save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank()
        torch.save({"model": self.gpt.state_dict(), **optimizer_state.save_entries(self.optimizer, self.gpt)},
                   directory / f"megatron_rank{rank:05d}.pt")  # fmt: skip
        # The rank's place in the layout beside its slices: async-rl export joins every rank's on the host.
        write_rank_layout(directory, rank, self.naming, tp_rank=self.tp_rank, tp_size=self.cfg.tensor_parallel,
                          etp_rank=self.etp_rank, etp_size=self.etp_size)  # fmt: skip
        torch.distributed.barrier()

    def load(self, directory: Path) -> None:
        self._load(**self._command("load", {"directory": Path(directory)}))

    def _load(self, directory: Path) -> None:
        path = Path(directory) / f"megatron_rank{torch.distributed.get_rank():05d}.pt"
        if not path.exists():
            raise ValueError(f"no Megatron checkpoint for this rank at {path}")
        state = torch.load(path, map_location=self.device, weights_only=False)
        optimizer_state.load_entries(self.optimizer, self.gpt, state, str(path))  # refuses before any copy
        self.gpt.load_state_dict(state["model"])
        torch.distributed.barrier()

    def close(self) -> None:
        if self._closed:
            return
        self._close(**self._command("close", {}))

    def _close(self) -> None:
        self._closed = True
        if self.arch.num_experts and self.cfg.router_replay:
            replay.reset_instances()
        torch.cuda.empty_cache()

    _closed = False


_FOLLOWED = ("forward_logprobs", "train_step", "record_routes", "export_weights", "gpu_fill", "save", "load", "close")
"""Methods the main rank drives on followers (each has a ``_name`` implementation taking the payload)."""


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None
