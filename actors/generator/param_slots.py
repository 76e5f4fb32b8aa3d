"""Where each named weight tensor of a Hugging Face checkpoint goes inside a live transformers model.

Weights arrive by Hugging Face name in one of two forms, and both are accepted:

* the in-memory ``state_dict`` names of transformers 5 (fused expert tensors:
  ``model.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``...experts.down_proj`` ``[E, H, I]``);
* the checkpoint names that ``save_pretrained`` writes and vLLM loads (one tensor per expert:
  ``model.layers.0.mlp.experts.3.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj``), which map onto
  slices of the fused tensors (``gate_up_proj[e] = cat(gate_proj, up_proj)``).

:class:`ParamSlots` maps every accepted name to a view of the model's parameter, checks a
whole version for unknown names, wrong shapes, duplicates and missing coverage before any byte
is copied, then copies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from torch import nn

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(slots=True)
class _Slot:
    root: str
    """Name of the model parameter this slot lives in."""
    view: torch.Tensor
    """The destination view."""


class ParamSlots:
    """Accepted weight names of one model instance -> destination views (see the module docstring)."""

    slots: dict[str, _Slot]
    root_numel: dict[str, int]
    tied: set[str]
    """Names that alias another parameter's storage (tied embeddings)."""

    def __init__(self, model: nn.Module) -> None:
        self.slots = {}
        self.root_numel = {}
        self.tied = set()
        owner: dict[tuple[int, tuple[int, ...]], str] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
            key = (data.data_ptr(), tuple(data.shape))
            if key in owner:
                # A tied weight (lm_head sharing the embedding): accepted under either name, needed under one.
                self.slots[name] = _Slot(owner[key], data)
                self.tied.add(name)
                continue
            owner[key] = name
            self.root_numel[name] = data.numel()
            self.slots[name] = _Slot(name, data)
            m = _FUSED_EXPERTS.match(name)
            if m is None or data.dim() != 3:
                continue
            prefix, kind = m["prefix"], m["kind"]
            for e in range(data.shape[0]):
                if kind == "down_proj":
                    self.slots[f"{prefix}.{e}.down_proj.weight"] = _Slot(name, data[e])
                else:
                    half = data.shape[1] // 2
                    self.slots[f"{prefix}.{e}.gate_proj.weight"] = _Slot(name, data[e, :half])
                    self.slots[f"{prefix}.{e}.up_proj.weight"] = _Slot(name, data[e, half:])

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming what is wrong unless ``tensors`` is exactly one complete set of weights."""
        unknown = sorted(n for n in tensors if n not in self.slots)
        if unknown:
            raise ValueError(
                f"unknown weight name(s) for this model: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
            )
        covered = dict.fromkeys(self.root_numel, 0)
        for name, t in tensors.items():
            slot = self.slots[name]
            if tuple(t.shape) != tuple(slot.view.shape):
                raise ValueError(f"weight {name} has shape {tuple(t.shape)}, the model needs {tuple(slot.view.shape)}")
            if t.dtype.is_floating_point != slot.view.dtype.is_floating_point:
                raise ValueError(f"weight {name} has dtype {t.dtype}, the model holds {slot.view.dtype}")
            if name in self.tied and slot.root in tensors:
                continue  # both names of a tied weight were sent: count it once
            covered[slot.root] += slot.view.numel()
        wrong = sorted(n for n, c in covered.items() if c != self.root_numel[n])
        if wrong:
            detail = ", ".join(f"{n} ({covered[n]}/{self.root_numel[n]} elements)" for n in wrong[:5])
            raise ValueError(f"incomplete or duplicated weights: {detail}{' ...' if len(wrong) > 5 else ''}")

    @torch.no_grad()
    def copy_(self, tensors: Mapping[str, torch.Tensor], pool: Executor | None = None) -> None:
        """Copy checked ``tensors`` into the model (dtype cast and device move included), on ``pool``'s threads
        when one is given (CPU: each copy releases the GIL)."""
        if pool is None:
            pairs = [(self.slots[name].view, t) for name, t in tensors.items()]
            if pairs and pairs[0][0].device.type == "cuda":
                # A GPU-held version, GPU to GPU: the like-for-like copies in one call (one GIL hold instead of one
                # per tensor, against a decode thread that launches kernels all the time); casts and moves below.
                same = [(v, t) for v, t in pairs if v.device == t.device and v.dtype == t.dtype]
                if same:
                    torch._foreach_copy_([v for v, _ in same], [t for _, t in same], non_blocking=True)
                pairs = [(v, t) for v, t in pairs if not (v.device == t.device and v.dtype == t.dtype)]
            for v, t in pairs:
                v.copy_(t, non_blocking=True)
            return

        def one(item: tuple[str, torch.Tensor]) -> None:
            with torch.no_grad():  # per thread: the caller's does not reach the pool's threads
                self.slots[item[0]].view.copy_(item[1])

        for _ in pool.map(one, tensors.items()):  # raises the first failure
            pass
