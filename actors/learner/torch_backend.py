"""Plain PyTorch training backend: a Hugging Face causal LM (dense or MoE) on the CPU or one GPU.

Forward passes replay the generators' recorded MoE routes (R3) through :mod:`async_rl.model.hf_routes`
when asked: positions the engine ran use the recorded experts, later positions and padding the
model's own routing. Logprobs come from the last hidden states and the LM head in chunks of
``logprob_chunk_tokens`` real tokens (:mod:`async_rl.logprobs.chunked`), not from full ``[B, T, V]``
fp32 logits. Gradients of the micro-batches are summed (the loss functions already
divide by step-global denominators, see :mod:`actors.learner.backend`), clipped, and applied by
AdamW. Weights are exported under their Hugging Face names.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from actors.learner.backend import TrainingBackend
from actors.learner.config import TorchBackendConfig
from actors.learner.lr_schedule import lr_factor
from async_rl.algorithms.batch import ForwardOutput, LossFn, MicroBatch, StepResult
from async_rl.algorithms.metrics import parts_to_floats, reduce_metrics
from async_rl.logprobs.chunked import chunked_token_logprobs
from async_rl.logprobs.stats import token_stats
from async_rl.model.hf_routes import find_moe_layers, pack_routes, replay_routes

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Accepted ``dtype`` names."""


def resolve_device(device: str) -> torch.device:
    """``learner.torch.device`` as a torch device (``auto``: the first GPU when there is one, else the CPU)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"torch.device is {device!r} but no CUDA device is available")
    return torch.device(device)

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULE_FILE = "schedule.json"
"""Optimizer steps taken: where the lr schedule continues after a resume."""


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, with_entropy: bool,
    temperature: float = 1.0, masked_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``[B, T]`` float32 logprob of ``input_ids[:, t]`` from ``logits[:, t - 1]`` (0 at t = 0 and on padding),
    and the entropy of that predictive distribution, after the sampling mask and the temperature
    (:func:`async_rl.logprobs.stats.token_stats`: fused kernels on CUDA, no fp32 copy of the logits)."""
    lp, ent = token_stats(logits[:, :-1], input_ids[:, 1:], temperature=temperature, masked_ids=masked_ids,
                          with_entropy=with_entropy)  # fmt: skip
    valid = attention_mask[:, 1:]
    zero = lp.new_zeros(lp.shape[0], 1)
    logprobs = torch.cat([zero, lp.masked_fill(~valid, 0.0)], dim=1)
    entropy = None
    if with_entropy and ent is not None:
        entropy = torch.cat([zero, ent.masked_fill(~valid, 0.0)], dim=1)
    return logprobs, entropy


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config keys of Hugging Face models whose logits are more than ``lm_head(hidden)``: such models take the full logits."""


def linear_head(model: nn.Module) -> nn.Linear | None:
    """The bias-free LM head when ``model``'s logits are exactly ``head(base_model(...).last_hidden_state)``, else None."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear) or head.bias is not None or getattr(model, "base_model", model) is model:
        return None
    cfg = getattr(model, "config", None)
    for key in LOGIT_TRANSFORMS:
        value = getattr(cfg, key, None)
        if value is not None and value != 1 and value != 1.0:
            return None
    return head


def chunked_forward(
    model: nn.Module, head: nn.Linear, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, chunk_tokens: int,
    temperature: float, masked_ids: torch.Tensor | None, with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """:func:`token_logprobs`' ``[B, T]`` outputs from the last hidden states of the real positions, through
    :func:`async_rl.logprobs.chunked.chunked_token_logprobs` (no ``[B, T, V]`` logits)."""
    base: nn.Module = getattr(model, "base_model")  # noqa: B009 - nn.Module's __getattr__ types it as a Tensor
    hidden = base(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False)[0]
    valid = attention_mask[:, 1:].bool()
    lp, ent = chunked_token_logprobs(hidden[:, :-1][valid], head.weight, input_ids[:, 1:][valid],
                                     chunk_tokens=chunk_tokens, temperature=temperature, masked_ids=masked_ids,
                                     with_entropy=with_entropy)  # fmt: skip

    def place(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(valid.shape).masked_scatter(valid, x)
        return torch.cat([x.new_zeros(valid.shape[0], 1), out], dim=1)

    return place(lp), None if ent is None else place(ent)


def aggregate_metrics(parts: Sequence[tuple[Mapping[str, torch.Tensor | float], torch.Tensor | float]]
                      ) -> dict[str, float]:  # fmt: skip
    """Merge per-micro-batch metrics by :func:`async_rl.algorithms.metrics.reduce_metrics`' naming convention
    (``_max`` / ``_min``: max / min, ``_count`` / ``_sum``: summed, others token-weighted); the weight of a
    micro-batch is its ``loss_tokens_count`` metric, or the given response-token count when the loss omits it.
    Values on the device come to the host in one copy (:func:`~async_rl.algorithms.metrics.parts_to_floats`)."""
    return reduce_metrics(parts_to_floats(parts))


class TorchBackend(TrainingBackend):
    """One HF causal LM and its AdamW optimizer on one device (see the module docstring)."""

    name = "torch"
    config: TorchBackendConfig
    device: torch.device
    model: nn.Module
    reference_model: nn.Module | None
    optimizer: torch.optim.AdamW
    optimizer_steps: int
    """Optimizer steps taken (skipped non-finite steps excluded): the lr schedule's clock, saved with the model."""
    _num_moe_layers: int
    _top_k: int
    _masked_ids: torch.Tensor
    """``config.masked_token_ids`` on the device (the generators' sampling mask)."""
    _fused: bool
    """AdamW with the fused kernels (every parameter a float on the GPU)."""

    def __init__(
        self, model: nn.Module, config: TorchBackendConfig, *, reference_model: nn.Module | bool | None = None
    ) -> None:
        """``reference_model``: a frozen model for reference logprobs, or True for a frozen copy of ``model``."""
        self.config = config
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        dtype = DTYPES[config.dtype]
        self.model = model.to(device=self.device, dtype=dtype)
        self.model.eval()
        if config.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # the transformers 5.x name
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
        if reference_model is True:
            reference_model = copy.deepcopy(self.model)
        self.reference_model = None
        if isinstance(reference_model, nn.Module):
            self.reference_model = reference_model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        layers = find_moe_layers(self.model)
        self._num_moe_layers = len(layers)
        self._top_k = layers[0].top_k if layers else 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        # On the GPU the fused kernels (one launch per group) rather than the default multi-tensor ones: the
        # optimizer's tail is what a GPU-held weight version waits behind (24 ms of the 1.65B MoE's step).
        self._fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
        self.optimizer = torch.optim.AdamW(
            params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
            fused=self._fused or None,
        )  # fmt: skip
        self.optimizer_steps = 0
        self._masked_ids = torch.tensor(config.masked_token_ids, dtype=torch.long, device=self.device)

    def lr_at(self, step: int) -> float:
        """The lr of optimizer step ``step`` (1-based) under ``config.lr_schedule``."""
        c = self.config
        return c.lr * lr_factor(step, schedule=c.lr_schedule, warmup_steps=c.lr_warmup_steps,
                                decay_steps=c.lr_decay_steps, min_ratio=c.lr_min_ratio)  # fmt: skip

    @property
    def is_main_rank(self) -> bool:
        return True

    @property
    def num_moe_layers(self) -> int:
        return self._num_moe_layers

    def _replay(self, model: nn.Module, mb: MicroBatch, replay: bool):
        if not replay or all(r is None for r in mb.routes):
            return nullcontext()
        if self._num_moe_layers == 0:
            raise ValueError(
                "micro-batch carries MoE routes but the model has no router async_rl.model.hf_routes can replay "
                "(dense model, or an unsupported MoE router); pass replay_routes=False or drop the routes"
            )
        routes = pack_routes(mb.routes, int(mb.input_ids.shape[1]), self._num_moe_layers, self._top_k,
                             device=self.device)  # fmt: skip
        return replay_routes(model, routes)

    def _forward(self, model: nn.Module, mb: MicroBatch, with_entropy: bool) -> ForwardOutput:
        head = linear_head(model) if self.config.logprob_chunk_tokens > 0 else None
        if head is not None:
            logprobs, entropy = chunked_forward(
                model, head, mb.input_ids, mb.attention_mask, chunk_tokens=self.config.logprob_chunk_tokens,
                temperature=self.config.temperature, masked_ids=self._masked_ids if self.config.masked_token_ids
                else None, with_entropy=with_entropy,
            )  # fmt: skip
            return ForwardOutput(logprobs=logprobs, entropy=entropy)
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask.long(), use_cache=False)
        logprobs, entropy = token_logprobs(
            out.logits, mb.input_ids, mb.attention_mask, with_entropy=with_entropy, temperature=self.config.temperature,
            masked_ids=self._masked_ids if self.config.masked_token_ids else None,
        )  # fmt: skip
        return ForwardOutput(logprobs=logprobs, entropy=entropy)

    def forward_logprobs(
        self, mb: MicroBatch, *, replay_routes: bool = True, with_entropy: bool = False, reference: bool = False
    ) -> ForwardOutput:
        model = self.model
        if reference:
            if self.reference_model is None:
                raise ValueError("forward_logprobs(reference=True) needs a backend built with a reference model")
            model = self.reference_model
        dev = mb.to(self.device)
        model.eval()
        with torch.no_grad(), self._replay(model, dev, replay_routes):
            out = self._forward(model, dev, with_entropy)
        return ForwardOutput(
            logprobs=out.logprobs.float().cpu(),
            entropy=None if out.entropy is None else out.entropy.float().cpu(),
        )

    def train_step(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, replay_routes: bool = True,
        with_entropy: bool = False,
    ) -> StepResult:  # fmt: skip
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        start = time.perf_counter()
        # Eval mode (no dropout, no router jitter) so that train and forward_logprobs agree; HF checkpointing
        # only runs in train mode.
        self.model.train(self.config.gradient_checkpointing)
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[tuple[Mapping[str, torch.Tensor | float], torch.Tensor | float]] = []
        num_tokens = 0
        losses: list[torch.Tensor] = []  # on the device until the step is queued: no wait per micro-batch
        try:
            for mb in micro_batches:
                dev = mb.to(self.device)
                # Backward inside the replay context: activation recompute must see the same routes.
                with self._replay(self.model, dev, replay_routes):
                    out = self._forward(self.model, dev, with_entropy)
                    loss, metrics = loss_fn(out, dev)
                    if loss.dim() != 0:
                        raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
                    loss.backward()
                losses.append(loss.detach())
                parts.append((metrics, float(mb.loss_mask.sum())))  # the host copy's count: no device wait
                num_tokens += mb.num_tokens
        finally:
            self.model.eval()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        finite = math.isfinite(grad_norm)
        lr = self.lr_at(self.optimizer_steps + 1)
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics = aggregate_metrics(parts)
        elapsed = time.perf_counter() - start
        metrics.update({
            "loss": float(torch.stack(losses).sum()) if losses else 0.0, "grad_norm": grad_norm, "lr": lr,
            "step_skipped": 0.0 if finite else 1.0, "num_micro_batches": float(len(micro_batches)),
            "train_tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0,
        })  # fmt: skip
        if self.device.type == "cuda":  # the process's peak so far (what an operator sizes a GPU by)
            metrics["mem_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return StepResult(metrics=metrics, grad_norm=grad_norm, num_tokens=num_tokens)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.snapshot_source():
            yield name, tensor.to("cpu").contiguous()

    @property
    def publish_device(self) -> str:
        if self.device.type != "cuda":
            return str(self.device)
        return f"cuda:{self.device.index if self.device.index is not None else torch.cuda.current_device()}"

    def snapshot_source(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if self.config.export_format == "checkpoint":
            from transformers.core_model_loading import revert_weight_conversion

            state = revert_weight_conversion(self.model, state)  # type: ignore[arg-type]
        yield from state.items()

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), directory / MODEL_FILE)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        (directory / SCHEDULE_FILE).write_text(json.dumps({"optimizer_steps": self.optimizer_steps}))

    def load(self, directory: Path) -> None:
        for f in (MODEL_FILE, OPTIMIZER_FILE):
            if not (directory / f).is_file():
                raise ValueError(f"checkpoint {directory} lacks {f}")
        state = torch.load(directory / MODEL_FILE, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state, strict=True)
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=self.device,
                                                  weights_only=True))  # fmt: skip
        # The config, not the checkpoint, sets the hyper-parameters (load_state_dict restores the saved ones).
        for group in self.optimizer.param_groups:
            group.update(betas=self.config.betas, eps=self.config.eps, weight_decay=self.config.weight_decay)
            if self._fused and not group.get("fused"):  # saved by the multi-tensor optimizer: its steps on the host
                group.update(fused=True, foreach=None)
                for p in group["params"]:
                    st = self.optimizer.state.get(p, {})
                    if "step" in st:
                        st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
        schedule = directory / SCHEDULE_FILE
        if schedule.is_file():
            self.optimizer_steps = int(json.loads(schedule.read_text())["optimizer_steps"])
        else:  # a checkpoint from before the schedule: the most steps Adam took on any parameter
            steps = [int(st["step"]) for st in self.optimizer.state.values() if "step" in st]
            self.optimizer_steps = max(steps, default=0)

    def follow(self) -> None:
        raise RuntimeError("the torch backend runs on one rank, the main one: there is nothing to follow")

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
