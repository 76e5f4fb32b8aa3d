"""Record and replay the expert routes of a Hugging Face MoE causal LM (the torch side of R3).

Supported routers are the softmax-top-k family of transformers 5.x (``Qwen3MoeTopKRouter``,
``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``, ``OlmoeTopKRouter``, ``Qwen3NextTopKRouter``, ...):
a module ``gate`` inside the sparse MoE block whose ``forward(flat_hidden)`` returns
``(router_logits [N, E], routing_weights [N, K], expert_indices [N, K])`` with the weights
``softmax(logits)[indices]``, renormalised over the top-k when the router says so.

* :class:`RouteRecorder` (``with record_routes(model) as rec``) captures, for every forward
  pass, the top-k expert indices of every MoE layer as one ``[batch, seq, moe_layers, top_k]``
  tensor; with a KV cache each decode step is one forward of ``seq == 1``, so a generation
  loop concatenates the per-forward tensors along ``seq``.
* :class:`RouteReplay` (``with replay_routes(model, routes)``) forces given indices: the
  routing weights are still computed from the router's own logits (softmax, gathered at the
  replayed experts, renormalised like the router does), so gradients reach the router. A row of
  ``-1`` (a padding row, or a position the engine never ran) keeps the model's own routing;
  each token is routed on its own, so such rows cannot change any other token.

Both use forward hooks on the router modules (no patched methods); hooks are removed on exit.
With activation checkpointing the backward recompute must run inside the same replay context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import torch
from torch import nn

NO_ROUTE = -1
"""Route entry meaning "use the model's own routing for this token" (padding, unrun positions)."""

_WEIGHT_CHECK_ATOL = 1e-6
"""Tolerance of the one-time check that our weight recomputation matches the router's own (fp32 maths)."""


@dataclass(frozen=True, slots=True)
class MoELayer:
    """One MoE layer of a model: its sparse block and router."""

    index: int
    """Position among the model's MoE layers (the middle dimension of the routes)."""
    name: str
    """Module path of the sparse MoE block (e.g. ``model.layers.3.mlp``)."""
    block: nn.Module
    """The sparse MoE block (called with ``[batch, seq, hidden]``)."""
    router: nn.Module
    """Its router (``block.gate``), called with ``[batch * seq, hidden]``."""
    num_experts: int
    """Routed experts of this layer."""
    top_k: int
    """Experts per token."""


def _is_router(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("TopKRouter")
        and isinstance(getattr(module, "top_k", None), int)
        and isinstance(getattr(module, "num_experts", None), int)
    )


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of ``model`` in layer order (dense layers have no router and are skipped)."""
    layers: list[MoELayer] = []
    for name, module in model.named_modules():
        gate = getattr(module, "gate", None)
        if isinstance(gate, nn.Module) and _is_router(gate):
            layers.append(
                MoELayer(index=len(layers), name=name, block=module, router=gate,
                         num_experts=int(gate.num_experts), top_k=int(gate.top_k))  # type: ignore[arg-type]
            )  # fmt: skip
    return layers


def _router_normalises(router: nn.Module) -> bool:
    # Qwen2/Qwen3-MoE, OLMoE, Qwen3-Next carry a norm_topk_prob flag; Mixtral-style routers always renormalise.
    flag = getattr(router, "norm_topk_prob", None)
    return True if flag is None else bool(flag)


class _Hooks:
    """Owns the hook handles of one context; removes them on exit."""

    __slots__ = ("handles",)

    def __init__(self) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class RouteRecorder:
    """Records each forward's top-k expert ids of every MoE layer as ``[batch, seq, moe_layers, top_k]`` int64."""

    layers: list[MoELayer]
    forwards: list[torch.Tensor]
    """One tensor per completed forward pass, on the model's device, in call order."""
    _pending: list[torch.Tensor | None]
    _shape: tuple[int, int] | None
    _hooks: _Hooks

    def __init__(self, model: nn.Module) -> None:
        self.layers = find_moe_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoE router to record (dense model?)")
        self.forwards = []
        self._pending = [None] * len(self.layers)
        self._shape = None
        self._hooks = _Hooks()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def top_k(self) -> int:
        return self.layers[0].top_k

    def __enter__(self) -> RouteRecorder:
        for layer in self.layers:
            self._hooks.handles.append(layer.block.register_forward_pre_hook(self._block_pre_hook, with_kwargs=True))
            self._hooks.handles.append(layer.router.register_forward_hook(self._make_router_hook(layer.index)))
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.remove()

    def _block_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self._shape = (int(hidden.shape[0]), int(hidden.shape[1]))

    def _make_router_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            assert self._shape is not None, "router ran outside its MoE block"
            if index == 0:
                self._pending = [None] * len(self.layers)
            b, s = self._shape
            self._pending[index] = output[2].detach().reshape(b, s, -1)
            if index == len(self.layers) - 1:
                if any(p is None for p in self._pending):
                    raise RuntimeError("MoE layers ran out of order; cannot assemble the routes of this forward")
                self.forwards.append(torch.stack(self._pending, dim=2))  # type: ignore[arg-type]
                self._pending = [None] * len(self.layers)

        return hook

    def take(self) -> list[torch.Tensor]:
        """The recorded per-forward tensors, clearing them."""
        out, self.forwards = self.forwards, []
        return out


def record_routes(model: nn.Module) -> RouteRecorder:
    """``with record_routes(model) as rec: model(...)`` then ``rec.take()``."""
    return RouteRecorder(model)


class RouteReplay:
    """Forces the expert ids of every MoE layer from a ``[batch, seq, moe_layers, top_k]`` tensor.

    Entries of ``-1`` (whole rows) keep the model's own routing for that token and layer.
    The tensor may be swapped between forwards with :meth:`set_routes`.
    """

    layers: list[MoELayer]
    _routes: torch.Tensor | None
    _checked: set[int]
    _hooks: _Hooks

    def __init__(self, model: nn.Module, routes: torch.Tensor | None = None) -> None:
        self.layers = find_moe_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoE router to replay (dense model?)")
        self._routes = None
        self._checked = set()
        self._hooks = _Hooks()
        if routes is not None:
            self.set_routes(routes)

    def set_routes(self, routes: torch.Tensor | None) -> None:
        """Validate and install ``routes`` (None: own routing everywhere)."""
        if routes is None:
            self._routes = None
            return
        num_layers, top_k = len(self.layers), self.layers[0].top_k
        num_experts = min(layer.num_experts for layer in self.layers)
        if routes.dim() != 4 or routes.shape[2] != num_layers or routes.shape[3] != top_k:
            raise ValueError(
                f"routes must be [batch, seq, {num_layers} moe_layers, {top_k} top_k], got {tuple(routes.shape)}"
            )
        if routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise ValueError(f"routes must be an integer tensor, got {routes.dtype}")
        r = routes.long()
        if r.numel():
            lo, hi = int(r.min()), int(r.max())
            if lo < NO_ROUTE or hi >= num_experts:
                raise ValueError(f"routes hold expert ids in [{lo}, {hi}], allowed are -1 and [0, {num_experts})")
            unset = r == NO_ROUTE
            if bool((unset.any(-1) & ~unset.all(-1)).any()):
                raise ValueError("routes rows must be all -1 (own routing) or all expert ids, got a mixed row")
            srt = r.sort(dim=-1).values
            if bool(((srt[..., 1:] == srt[..., :-1]) & ~unset[..., 1:]).any()):
                raise ValueError("routes rows must name distinct experts, got a repeated expert in a row")
        self._routes = r

    def __enter__(self) -> RouteReplay:
        for layer in self.layers:
            self._hooks.handles.append(layer.router.register_forward_hook(self._make_router_hook(layer)))
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.remove()

    def _make_router_hook(self, layer: MoELayer):
        normalise = _router_normalises(layer.router)

        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            routes = self._routes
            if routes is None:
                return None
            logits, scores, own = output
            n = logits.shape[0]
            if routes.shape[0] * routes.shape[1] != n:
                raise ValueError(
                    f"replay routes cover {routes.shape[0]}x{routes.shape[1]} tokens but MoE layer {layer.index} "
                    f"({layer.name}) routes {n} tokens"
                )
            forced = routes[:, :, layer.index, :].reshape(n, -1).to(own.device)
            keep_own = forced[:, :1] == NO_ROUTE
            idx = torch.where(keep_own, own, forced)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            if layer.index not in self._checked:
                # Our recomputation must reproduce the router's own weights for its own choice, or the model's
                # router is of a kind this module does not know.
                with torch.no_grad():  # outside autograd: an activation recompute (which skips this) must match
                    mine = _weights(probs, own, normalise).to(scores.dtype)
                if not torch.allclose(mine.float(), scores.float(), atol=_WEIGHT_CHECK_ATOL, rtol=1e-5):
                    raise RuntimeError(f"router {type(module).__name__} at {layer.name} is not a softmax top-k router")
                self._checked.add(layer.index)
            return logits, _weights(probs, idx, normalise).to(scores.dtype), idx

        return hook


def _weights(probs: torch.Tensor, idx: torch.Tensor, normalise: bool) -> torch.Tensor:
    w = probs.gather(-1, idx)
    return w / w.sum(dim=-1, keepdim=True) if normalise else w


def replay_routes(model: nn.Module, routes: torch.Tensor | None = None) -> RouteReplay:
    """``with replay_routes(model, routes): model(...)`` (routes ``[batch, seq, moe_layers, top_k]``, -1 = own)."""
    return RouteReplay(model, routes)


def pack_routes(
    routes: Sequence[np.ndarray | None], seq_len: int, num_layers: int, top_k: int, *,
    layers: slice | None = None, device: torch.device | str = "cpu",
) -> torch.Tensor:  # fmt: skip
    """Right-padded ``[batch, seq_len, num_layers, top_k]`` int64 tensor from ragged per-sequence routes.

    ``routes[b]`` is ``[T_run, all_moe_layers, top_k]`` for positions ``< T_run`` (or None: no replay);
    ``layers`` picks this rank's MoE layers. Positions ``>= T_run`` and padding rows hold ``-1``.
    """
    out = np.full((len(routes), seq_len, num_layers, top_k), NO_ROUTE, dtype=np.int64)
    for b, r in enumerate(routes):
        if r is None:
            continue
        if r.ndim != 3:
            raise ValueError(f"routes[{b}] must be [tokens, moe_layers, top_k], got shape {r.shape}")
        if layers is not None:
            r = r[:, layers]
        if r.shape[1] != num_layers or r.shape[2] != top_k:
            raise ValueError(f"routes[{b}] has {r.shape[1:]} (layers, top_k), model needs ({num_layers}, {top_k})")
        if r.shape[0] > seq_len:
            raise ValueError(f"routes[{b}] covers {r.shape[0]} tokens, more than the sequence length {seq_len}")
        out[b, : r.shape[0]] = r
    return torch.from_numpy(out).to(device)
