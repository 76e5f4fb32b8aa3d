"""A recorded in-place load: vLLM's weight loaders run once, their copies are noted, and every later version is
loaded by replaying them as one batched copy while generation is paused.

Why: vLLM's layerwise ``reload_weights`` runs each tensor's weight loader through wrappers that re-inspect the
layer at every call, then reprocesses each layer: about 2 s for the 1.65B preset's 3,072 expert tensors on an
H100, all of it while generation is paused. Yet for unquantized weights on CUDA the loaders only copy slices of
the published tensors into slices of vLLM's stacked and sharded parameters, and the processing after loading
leaves them as written. So:

* **Record.** The model's ``load_weights`` runs under a dispatch mode that executes nothing into the parameters:
  each ``copy_`` into a parameter's storage is noted as a *step* (the parameter's view; the source tensor's name
  and the view of it), each constant fill (padding rows) as a :class:`Fill`. Any other write into a parameter, or a copy from a tensor that is not a view of one of the
  sources (a loader that converts or concatenates), ends the recording with the reason.
* **Verify** (:func:`verify_checkpoint`, once, at start). The checkpoint the engine loaded is recorded the same
  way, and every step's destination in the loaded model must equal its source bit for bit, and every parameter
  must be covered by steps. This is what proves that vLLM's processing after loading is the identity on this
  platform and backend; where it is not (CPU, whose linear weights are repacked; MoE backends that shuffle
  experts; quantized models), the engine keeps ``reload_weights`` and says why, once.
* **Bind** (staging, generation going on): every step's source view is taken from the version's tensors.
* **Apply** (paused): one ``torch._foreach_copy_`` per group into the parameters' own storage (CUDA graphs keep
  their addresses): 3.3 ms for the 1.65B preset's 3,121 copies (3.3 GB) on an H100 (``scripts/gpu/replay_load.py``).
  Merging the copies that stride evenly through one storage (a layer's experts into one strided copy) was measured
  slower there (4.3 ms for 81 strided copies) and is not done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]
"""``(size, stride, storage_offset)`` of a view."""
Bound = list[tuple[list[torch.Tensor], list[torch.Tensor]]]
"""A plan bound to a version: groups of ``(destinations, sources)`` views of one dtype pair, device pair and
contiguity each, so each group takes ``_foreach_copy_``'s fused path (one mismatched pair sends a whole call to
its slow path of one copy per pair: ~7 µs each, 20+ ms for the 1.65B preset's 3,121 copies)."""


class PlanRefused(Exception):
    """A loader did something a replay cannot repeat (the message says what); the engine keeps the slow load."""


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One recorded copy: ``params[param].as_strided(*dst) <- sources[source].as_strided(*src, offset + src_rel)``."""

    param: int
    dst: Geometry
    source: str
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_rel: int
    """Storage offset of the source view relative to the source tensor's own offset."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fill:
    """A recorded constant write (vLLM zeroes the padding rows of a vocabulary, for one): the same at every load,
    so a replay leaves it as the first load wrote it (checked at start)."""

    param: int
    dst: Geometry
    value: float


@dataclasses.dataclass(slots=True)
class LoadPlan:
    """The steps of one model's load, with the layout of the sources they were recorded from."""

    params: list[torch.Tensor]
    """Each written parameter's tensor (``Parameter.data``), in first-written order."""
    names: list[str]
    steps: list[Step]
    fills: list[Fill]
    layout: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]
    """Source name -> ``(shape, stride, dtype)`` when recorded: a version bound to this plan must match it."""

    def matches(self, sources: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``sources`` have the names and layout this plan was recorded from."""
        layout = self.layout
        if len(sources) < len(layout):
            return False
        for name, (shape, stride, dtype) in layout.items():
            t = sources.get(name)
            if t is None or tuple(t.shape) != shape or t.stride() != stride or t.dtype != dtype:
                return False
        return True

    def bind(self, sources: Mapping[str, torch.Tensor]) -> Bound:
        """Every step's ``(destination, source)`` views, grouped for :func:`apply`; ``sources`` must :meth:`match`."""
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for s in self.steps:
            d, v = self.view(s, sources)
            key = (d.dtype, v.dtype, d.device, v.device, d.is_contiguous() and v.is_contiguous())
            pair = groups.setdefault(key, ([], []))
            pair[0].append(d)
            pair[1].append(v)
        return list(groups.values())

    def view(self, step: Step, sources: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's ``(destination, source)`` views."""
        src = sources[step.source]
        size, stride, offset = step.dst
        return (self.params[step.param].as_strided(size, stride, offset),
                src.as_strided(step.src_size, step.src_stride, src.storage_offset() + step.src_rel))  # fmt: skip

    def num_bytes(self) -> int:
        """Bytes one replay writes."""
        return sum(int(torch.Size(s.dst[0]).numel()) * self.params[s.param].element_size() for s in self.steps)


def apply(bound: Bound) -> None:
    """Replay a bound plan: every destination view gets its source's values, one batched copy per group."""
    with torch.no_grad():
        for dsts, srcs in bound:
            torch._foreach_copy_(dsts, srcs)


def describe(bound: Bound) -> list[str]:
    """One line per group: its copies, dtypes and whether all are contiguous (for the logs)."""
    return [f"{len(d)} x {d[0].dtype}<-{s[0].dtype}{'' if d[0].is_contiguous() else ' strided'}" for d, s in bound]


def record(model: torch.nn.Module, sources: Mapping[str, torch.Tensor]) -> LoadPlan:
    """Run ``model.load_weights`` on ``sources`` without writing a parameter; the steps it would take.

    PlanRefused names the first thing a replay cannot repeat. The parameters are left untouched either way.
    """
    recorder = _Recorder(model, sources)
    with torch.no_grad(), recorder:
        model.load_weights(iter(sources.items()))  # type: ignore[operator]
    if not recorder.steps:
        raise PlanRefused("the model's loaders wrote nothing")
    layout = {n: (tuple(t.shape), t.stride(), t.dtype) for n, t in sources.items()}
    return LoadPlan(recorder.written, recorder.written_names, recorder.steps, recorder.fills, layout)


def verify_checkpoint(model: torch.nn.Module, chunks: Iterable[Mapping[str, torch.Tensor]]) -> LoadPlan:
    """Record the load of the checkpoint the model was loaded from (``chunks``: its tensors, a file at a time)
    and check every step against the loaded parameters (module docstring). Returns the plan of the last chunk
    layout merged into one (the steps of all chunks); PlanRefused says where the check failed."""
    merged: LoadPlan | None = None
    for chunk in chunks:
        plan = record(model, chunk)
        for step in plan.steps:
            dst, src = plan.view(step, chunk)
            if dst.dtype != src.dtype or not torch.equal(dst, src.to(dst.device)):
                name = plan.names[step.param]
                raise PlanRefused(f"{name} differs from {step.source} after vLLM loaded it (processed after loading)")
        for fill in plan.fills:
            size, stride, offset = fill.dst
            if not bool((plan.params[fill.param].as_strided(size, stride, offset) == fill.value).all()):
                raise PlanRefused(f"{plan.names[fill.param]}: a region the loaders set to {fill.value} holds other "
                                  "values after loading")  # fmt: skip
        merged = plan if merged is None else _merge(merged, plan)
    if merged is None:
        raise PlanRefused("the checkpoint has no tensors")
    _check_covered(model, merged)
    return merged


def _merge(a: LoadPlan, b: LoadPlan) -> LoadPlan:
    index = {name: i for i, name in enumerate(a.names)}
    params, names = list(a.params), list(a.names)
    steps, fills = list(a.steps), list(a.fills)
    writes: list[Step | Fill] = [*b.steps, *b.fills]
    for s in writes:
        name = b.names[s.param]
        if name not in index:
            index[name] = len(params)
            params.append(b.params[s.param])
            names.append(name)
        (steps if isinstance(s, Step) else fills).append(dataclasses.replace(s, param=index[name]))  # type: ignore[arg-type]
    return LoadPlan(params, names, steps, fills, {**a.layout, **b.layout})


def _check_covered(model: torch.nn.Module, plan: LoadPlan) -> None:
    """Every parameter written whole, once: else some of it comes from processing the plan cannot repeat."""
    written = [0] * len(plan.params)
    seen: set[tuple[Any, ...]] = set()
    writes: list[Step | Fill] = [*plan.steps, *plan.fills]
    for s in writes:
        key = (s.param, *s.dst)
        if key in seen:
            raise PlanRefused(f"{plan.names[s.param]}: the same region is written twice")
        seen.add(key)
        written[s.param] += int(torch.Size(s.dst[0]).numel())
    index = {name: i for i, name in enumerate(plan.names)}
    for name, param in model.named_parameters():
        i = index.get(name)
        if i is None:
            raise PlanRefused(f"{name} is not written by the loaders (vLLM derives it while processing)")
        if written[i] != param.numel():
            raise PlanRefused(f"{name}: the loaders write {written[i]} of its {param.numel()} elements")


class _Recorder(TorchDispatchMode):
    """Notes each copy into a parameter's storage instead of doing it; refuses anything else that writes one."""

    def __init__(self, model: torch.nn.Module, sources: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.storages: dict[int, tuple[str, torch.Tensor]] = {}
        for name, p in model.named_parameters():
            self.storages.setdefault(p.untyped_storage().data_ptr(), (name, p.data))
        self.sources: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, t in sources.items():
            self.sources.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))
        self.written: list[torch.Tensor] = []
        self.written_names: list[str] = []
        self._index: dict[str, int] = {}
        self.steps: list[Step] = []
        self.fills: list[Fill] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and self._param_of(args[0]) is not None:
            self._note(args[0], args[1])
            return args[0]
        if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default) and self._param_of(args[0]) is not None:
            value = 0 if func is torch.ops.aten.zero_.default else args[1]
            self._note_fill(args[0], value)
            return args[0]
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            hit = self._param_of(value) if isinstance(value, torch.Tensor) else None
            if hit is not None:
                name = hit[0]
                raise PlanRefused(f"a loader writes {name} with {func} (only plain copies replay)")
        return func(*args, **kwargs)

    def _param_of(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if t.device.type == "meta":
            return None
        return self.storages.get(t.untyped_storage().data_ptr())

    def _note(self, dst: torch.Tensor, src: Any) -> None:
        name, param = self._param_of(dst)  # type: ignore[misc]
        if dst.numel() == 0:  # a rank's empty shard (the vocabulary rows past the last on a tensor-parallel rank)
            return
        if not isinstance(src, torch.Tensor):
            raise PlanRefused(f"a loader writes {name} from a {type(src).__name__}")
        source = self._source_of(src)
        if source is None:
            raise PlanRefused(f"a loader writes {name} from a tensor that is not a view of a published one "
                              "(converted or concatenated on the way)")  # fmt: skip
        if tuple(src.shape) != tuple(dst.shape):
            if src.numel() != dst.numel() and src.numel() != 1:
                raise PlanRefused(f"a loader broadcasts into {name}")
            src = src.expand(dst.shape) if src.numel() == 1 else src.reshape(dst.shape)
            if self._source_of(src) is None:
                raise PlanRefused(f"a loader copies into {name} through a reshape that is not a view")
        src_name, base = source
        dst_geometry = (tuple(dst.shape), dst.stride(), int(dst.storage_offset()))
        src_rel = int(src.storage_offset() - base.storage_offset())
        self.steps.append(Step(param=self._index_of(name, param), dst=dst_geometry, source=src_name,
                               src_size=tuple(src.shape), src_stride=src.stride(), src_rel=src_rel))  # fmt: skip

    def _index_of(self, name: str, param: torch.Tensor) -> int:
        if name not in self._index:
            self._index[name] = len(self.written)
            self.written.append(param)
            self.written_names.append(name)
        return self._index[name]

    def _note_fill(self, dst: torch.Tensor, value: Any) -> None:
        name, param = self._param_of(dst)  # type: ignore[misc]
        if not isinstance(value, (int, float, bool)):
            raise PlanRefused(f"a loader fills {name} with a {type(value).__name__}")
        geometry = (tuple(dst.shape), dst.stride(), int(dst.storage_offset()))
        self.fills.append(Fill(param=self._index_of(name, param), dst=geometry, value=float(value)))

    def _source_of(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The source tensor ``t`` is a view of (the one whose elements contain ``t``'s first element)."""
        if t.device.type == "meta":
            return None
        found = self.sources.get(t.untyped_storage().data_ptr())
        if not found:
            return None
        off = t.storage_offset()
        for name, base in found:
            if base.storage_offset() <= off < base.storage_offset() + max(base.numel(), 1):
                return name, base
        return None
