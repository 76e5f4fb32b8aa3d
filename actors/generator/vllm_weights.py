"""What a vLLM engine loads: a version's tensors under the checkpoint's names, checked against the model.

vLLM's ``load_weights`` takes the names and shapes ``save_pretrained`` writes (one tensor per expert). A learner
may publish transformers' in-memory names instead (fused experts, transformers 5): those are converted here with
transformers' own ``revert_weight_conversion`` on a meta-device model. Used by the engine (host versions, in its
process) and by its worker extension (GPU versions copied straight from the learner, in vLLM's worker).

The worker asks for views (``views=True``): transformers' conversion makes each chunk of a fused tensor contiguous
(its ``Chunk`` op), a copy of nearly every expert weight each version, which the worker would have to hold beside
the version it copied and make again for the next one. With views the converted tensors share the published
tensors' memory, so a staging slot refreshed in place by the next version's copy refreshes them too
(:meth:`~actors.generator.vllm_worker.ArlWorkerExtension.arl_copy_ipc`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from actors.generator.model_facts import ModelFacts
from async_rl.model.presets import load_model_config


class CheckpointWeights:
    """Converts and checks the weights of one model (thread-safe)."""

    facts: ModelFacts
    _meta_model: Any
    """The HF model on the meta device (built on first use): maps in-memory names to checkpoint names."""
    _lock: threading.Lock

    def __init__(self, facts: ModelFacts) -> None:
        self.facts = facts
        self._meta_model = None
        self._lock = threading.Lock()

    def convert(self, tensors: Mapping[str, torch.Tensor], views: bool = False) -> Mapping[str, torch.Tensor]:
        """``tensors`` under the checkpoint's names: transformers' in-memory names (fused experts) are converted;
        with ``views``, into views of ``tensors`` where the conversion only splits (module docstring)."""
        if set(tensors) <= set(self.facts.shapes):
            return tensors
        from transformers import AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion

        with self._lock:
            if self._meta_model is None:
                with torch.device("meta"):
                    self._meta_model = AutoModelForCausalLM.from_config(load_model_config(self.facts.directory))
            meta = self._meta_model
        if set(tensors) != set(meta.state_dict()):
            return tensors  # neither naming: check() says what is wrong
        try:
            if views:
                with _KeepViews():
                    return revert_weight_conversion(meta, dict(tensors))
            return revert_weight_conversion(meta, dict(tensors))
        except Exception as exc:  # a shape or dtype the conversion cannot take
            raise ValueError(f"staged weights could not be converted to the checkpoint's names: {exc!r}") from exc

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming the first tensor whose name or shape the model does not have, or a missing one."""
        shapes = self.facts.shapes
        unknown = sorted(set(tensors) - set(shapes))
        if unknown:
            raise ValueError(f"staged weights name tensors the model does not have: {unknown[:5]}")
        missing = sorted(set(shapes) - set(tensors))
        if missing:
            raise ValueError(f"staged weights miss {len(missing)} tensors of the model, e.g. {missing[:5]}")
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"staged weight {name} is a {type(t).__name__}, not a torch.Tensor")
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"staged weight {name} has shape {tuple(t.shape)}, the model needs {shapes[name]}")

    def prepare(self, tensors: Mapping[str, torch.Tensor], views: bool = False) -> Mapping[str, torch.Tensor]:
        """:meth:`convert`, then :meth:`check`."""
        tensors = self.convert(tensors, views)
        self.check(tensors)
        return tensors


class _KeepViews(TorchFunctionMode):
    """``Tensor.contiguous()`` returns the tensor itself: a split stays a view of what it split (a view that is not
    contiguous stays so; vLLM's loaders copy from any strides)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))
