"""The worker side of :class:`~actors.generator.vllm_engine.VLLMEngine`: a vLLM worker extension.

vLLM mixes this class into its worker (``worker_extension_cls``), so its methods run in the
worker process that holds the model and are called from the engine with
``collective_rpc("arl_...")``. It does two things vLLM's CPU build cannot do by itself:

* **Routes.** vLLM's own routed-experts output needs Model Runner V2 (Triton). Here each MoE
  layer's router gets a capture callback (the same ``set_capture_fn`` hook vLLM's own capturer
  uses, so the ids are exactly the experts the fused-MoE kernel ran), and a forward hook on the
  model files each forward's ids under ``(request, position)`` using the runner's batch layout
  (request order and ``query_start_loc``) and the ``positions`` the model was called with. Eager
  mode only (a compiled graph would not call back into Python). The last sampled token of a
  request is never run through the model, so its routes cover one token fewer than
  prompt + response; positions served from the prefix cache are not run either, so the engine
  turns prefix caching off when it captures routes this way.
* **GPU versions straight from the learner.** On the learner's host, :meth:`arl_copy_ipc` maps the learner's
  buffers from the manifest's CUDA IPC handles (:mod:`async_rl.weights.gpu.cuda_ipc`, kept mapped across
  versions), copies the version onto this worker's GPU, computes every bucket's wsum64 there and returns them: the
  engine's process holds the lease and checks them against the signed manifest before it asks for the swap. With
  tensor parallelism every rank copies the whole version (vLLM's loaders cut each rank's shard from it).
* **In-place weight loads.** A new version is mapped from the engine's anonymous memory file
  (:meth:`arl_stage_weights`, while generation goes on; :mod:`actors.generator.weight_handover`) or copied as
  above, then loaded in place while the engine is paused (:meth:`arl_apply_staged`). On CUDA, where start-up
  proved it exact (:mod:`actors.generator.vllm_load_plan`), the load replays vLLM's own loaders as one batched
  copy, bound to the version's tensors while it was staged: milliseconds. Elsewhere it goes through vLLM's
  layerwise ``reload_weights``, which feeds the model's ``load_weights``; on CPU the experts kernel's
  ``process_weights_after_loading`` (its prepack into the grouped-GEMM layout) is then run again on every
  fused-MoE layer: vLLM runs it only on the first load, so a reload alone leaves the raw new weights where the
  kernel expects prepacked ones (wrong expert outputs).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np
import torch

from actors.generator.vllm_load_plan import Bound, LoadPlan, PlanRefused, apply, describe, record, verify_checkpoint
from actors.generator.weight_handover import Handle, map_weights
from async_rl.model.moe import route_dtype

ROUTE_CHUNK_TOKENS = 256
"""Per-request route buffers grow in steps of this many positions (a few KB each for small models)."""
STAGED_KEPT = 2
"""Versions a worker holds staged at most: the one waiting for its swap and a newer one arriving meanwhile (a GPU
version costs one model's memory on the worker's GPU each)."""


class _RequestRoutes:
    """Routes of one request, filed by position."""

    __slots__ = ("data", "filled")

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype) -> None:
        self.data = np.zeros((ROUTE_CHUNK_TOKENS, num_layers, top_k), dtype=dtype)
        self.filled = np.zeros(ROUTE_CHUNK_TOKENS, dtype=bool)

    def put(self, positions: np.ndarray, ids: np.ndarray) -> None:
        need = int(positions.max()) + 1
        if need > self.data.shape[0]:
            size = -(-need // ROUTE_CHUNK_TOKENS) * ROUTE_CHUNK_TOKENS
            data = np.zeros((size, *self.data.shape[1:]), dtype=self.data.dtype)
            data[: self.data.shape[0]] = self.data
            filled = np.zeros(size, dtype=bool)
            filled[: self.filled.shape[0]] = self.filled
            self.data, self.filled = data, filled
        self.data[positions] = ids
        self.filled[positions] = True

    def prefix(self) -> np.ndarray:
        """Routes of positions ``0..T-1`` where ``T`` is the first position never run."""
        holes = np.flatnonzero(~self.filled)
        end = int(holes[0]) if holes.size else self.filled.shape[0]
        return self.data[:end].copy()


class _RouteCapture:
    """Collects the experts of every forward and files them per request (see the module docstring)."""

    def __init__(self, runner: Any, model: torch.nn.Module, dtype: np.dtype) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.runner = runner
        moe = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not moe:
            raise ValueError(f"{type(model).__name__} has no fused-MoE layer whose routes could be captured")
        self.layer_slot = {int(m.layer_id): i for i, m in enumerate(sorted(moe, key=lambda m: int(m.layer_id)))}
        self.num_layers = len(moe)
        self.top_k = int(moe[0].router.top_k) if hasattr(moe[0].router, "top_k") else 0
        self.dtype = dtype
        self.step: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.requests: dict[str, _RequestRoutes] = {}
        self.handles: list[Any] = []
        for m in moe:
            if not hasattr(m.router, "set_capture_fn"):
                raise ValueError(f"router {type(m.router).__name__} of layer {m.layer_id} takes no capture callback")
            m.router.set_capture_fn(self._make_capture(self.layer_slot[int(m.layer_id)]))
        self.handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self.handles.append(model.register_forward_hook(self._post_forward))

    def _make_capture(self, slot: int):
        def capture(topk_ids: torch.Tensor) -> None:
            n, k = topk_ids.shape
            if self.step is None or self.step.shape[0] < n or self.step.shape[2] != k:
                self.step = torch.zeros((max(n, 64), self.num_layers, k), dtype=torch.int32)
                self.top_k = k
            self.step[:n, slot] = topk_ids.to(device="cpu", dtype=torch.int32)

        return capture

    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.positions = None if positions is None else positions.detach()

    def _post_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        batch = self.runner.input_batch
        num_reqs = int(batch.num_reqs)
        if num_reqs == 0 or self.positions is None or self.step is None:
            return
        qsl = np.asarray(self.runner.query_start_loc.np[: num_reqs + 1])
        total = int(qsl[-1])
        positions = self.positions[:total].to("cpu").numpy()
        ids = self.step[:total].numpy().astype(self.dtype)
        for r, req_id in enumerate(batch.req_ids[:num_reqs]):
            lo, hi = int(qsl[r]), int(qsl[r + 1])
            if hi <= lo:
                continue
            rec = self.requests.get(req_id)
            if rec is None:
                rec = self.requests[req_id] = _RequestRoutes(self.num_layers, self.top_k, self.dtype)
            rec.put(positions[lo:hi], ids[lo:hi])

    def take(self, external_ids: list[str]) -> dict[str, np.ndarray]:
        """Routes of the named requests (vLLM's internal ids are ``<external>-<8 random chars>``), forgotten."""
        wanted = set(external_ids)
        out: dict[str, np.ndarray] = {}
        for req_id in list(self.requests):
            ext = req_id if req_id in wanted else req_id.rsplit("-", 1)[0]
            if ext in wanted:
                out[ext] = self.requests.pop(req_id).prefix()
        return out


class _Staged(NamedTuple):
    """A version held in the worker: its tensors, their views bound to the replayed load (None: reload), and the
    staging slot holding them (-1: none, a host version)."""

    named: list[tuple[str, torch.Tensor]]
    bound: Bound | None
    slot: int


class _Slot(NamedTuple):
    """GPU buffers a version copied from the learner lands in, kept for the next version of the same layout."""

    layout: tuple
    buffers: list[torch.Tensor]
    """The buckets as copied (none for a version published in pieces: its buckets are received into buffers both
    slots share, and every tensor is assembled into ``assembled``)."""
    named: list[tuple[str, torch.Tensor]]
    bound: Bound | None
    plan: LoadPlan | None
    """The plan ``bound`` was bound to (a re-recorded plan invalidates it)."""
    views: bool
    """Every one of ``named`` is a view of ``buffers`` or ``assembled`` (so the next copy and assembly into them
    refresh it)."""
    assembled: dict[str, torch.Tensor]
    """A version published in pieces: all its tensors, assembled (the next one of the layout is assembled into
    them)."""


def _layout(m: Any) -> tuple:
    """What makes two versions' buffers interchangeable: bucket sizes and every tensor's place in them."""
    return (tuple(b.nbytes for b in m.buckets),
            tuple((t.name, t.dtype, tuple(t.shape), tuple((p.bucket, p.offset, p.nbytes, p.dim, p.start, p.length,
                                                           p.encoding) for p in t.pieces)) for t in m.tensors))  # fmt: skip


class ArlWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``); all names start with ``arl_``."""

    def arl_setup(self, capture_routes: bool, num_experts: int, model_dir: str, swap_load: str = "reload") -> dict:
        """Install the route capture (when asked) and, with ``swap_load='auto'`` on CUDA, prove the replayed load
        (:mod:`.vllm_load_plan`); on CUDA, make the GPU copy path ready
        (:func:`~async_rl.weights.gpu.reader.copy_stream`); return what the engine needs to know."""
        from pathlib import Path

        from actors.generator.model_facts import read_model_facts
        from actors.generator.vllm_weights import CheckpointWeights

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        self._arl_staged: dict[int, _Staged] = {}
        self._arl_routes: _RouteCapture | None = None
        self._arl_weights = CheckpointWeights(read_model_facts(Path(model_dir)))
        self._arl_ipc: Any = None
        self._arl_plan: LoadPlan | None = None
        self._arl_slots: dict[int, _Slot] = {}
        self._arl_receive: tuple[tuple, list[torch.Tensor]] | None = None
        self._arl_assembly: dict[int, Any] = {}
        """Slot -> the :class:`~async_rl.weights.gpu.reader.BucketAssembly` from the shared buckets into its tensors."""
        self._arl_read: tuple[Any, torch.cuda.Event] | None = None
        self._arl_load_timed: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        info: dict[str, Any] = {"num_layers": 0, "top_k": 0}
        if capture_routes:
            dtype = route_dtype(num_experts)
            self._arl_routes = _RouteCapture(self.model_runner, model, dtype)  # type: ignore[attr-defined]
            info.update(num_layers=self._arl_routes.num_layers, top_k=self._arl_routes.top_k)
        info["load"], info["load_check_s"] = self._arl_prove_replay(model, Path(model_dir), swap_load)
        if next(model.parameters()).device.type == "cuda":
            self._arl_copy_path()  # the first copy's one-time costs now, outside any version's lease
        return info

    def _arl_copy_path(self) -> tuple[Any, torch.cuda.Stream]:
        """The mapper of the learner's buffers and the stream a same-host GPU version is copied on (made once)."""
        from async_rl.weights.gpu.cuda_ipc import IpcMapper
        from async_rl.weights.gpu.reader import copy_stream

        self._arl_ipc = (IpcMapper(), copy_stream(torch.device("cuda", torch.cuda.current_device())))
        return self._arl_ipc

    def _arl_prove_replay(self, model: torch.nn.Module, model_dir: Any, swap_load: str) -> tuple[str, float]:
        """``('replay', s)`` when the recorded load reproduces what vLLM loaded from ``model_dir``, else
        ``('reload: <why>', s)``."""
        from vllm.platforms import current_platform

        if swap_load != "auto":
            return "reload: asked for (vllm.swap_load=reload)", 0.0
        if not current_platform.is_cuda():
            return "reload: the replayed load is proven on CUDA only", 0.0
        from safetensors import safe_open

        t0 = time.perf_counter()
        device = f"cuda:{torch.cuda.current_device()}"

        def chunks() -> Any:
            for f in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt", device=device) as st:
                    yield dict(self._arl_weights.convert({k: st.get_tensor(k) for k in st.keys()}))

        try:
            self._arl_plan = verify_checkpoint(model, chunks())
        except PlanRefused as exc:
            return f"reload: {exc}", time.perf_counter() - t0
        finally:
            torch.cuda.empty_cache()
        return "replay", time.perf_counter() - t0

    def arl_take_routes(self, external_ids: list[str]) -> dict[str, tuple[bytes, list[int], str]]:
        """Routes ``[T_run, moe_layers, top_k]`` of finished requests, by external request id, forgotten here.

        Each as ``(raw bytes, shape, numpy dtype string)``: vLLM's RPC results carry plain values reliably.
        """
        routes = getattr(self, "_arl_routes", None)
        if routes is None:
            return {}
        return {rid: (a.tobytes(), list(a.shape), a.dtype.str) for rid, a in routes.take(external_ids).items()}

    def _arl_keep(self, version: int, named: list[tuple[str, torch.Tensor]], slot: int = -1) -> dict[str, Any]:
        """Hold ``version`` staged until :meth:`arl_apply_staged` (bound to the replayed load where there is one);
        only the newest :data:`STAGED_KEPT` stay. Returns how it will load."""
        staged = self._arl_staged
        bound, how = None, "reload"
        plan = self._arl_plan
        if plan is not None:
            tensors = dict(named)
            if not plan.matches(tensors):
                try:  # another layout of the same weights (another publisher): the loaders are recorded again
                    plan = self._arl_plan = record(self.model_runner.get_model(), tensors)  # type: ignore[attr-defined]
                except PlanRefused as exc:
                    plan, how = None, f"reload: {exc}"
            if plan is not None:
                bound = plan.bind(tensors)
                how = f"replay ({', '.join(describe(bound))})"
        staged[version] = _Staged(named, bound, slot)
        for old in sorted(staged)[:-STAGED_KEPT]:
            del staged[old]
        return {"load": how}

    def arl_stage_weights(self, handle: Handle, version: int) -> float:
        """Map a full weight version the engine packed in memory (no copy, see :mod:`.weight_handover`) and keep
        it until :meth:`arl_apply_staged`. Returns seconds spent."""
        t0 = time.perf_counter()
        named = map_weights(handle)
        if self._arl_plan is not None:  # the replay copies GPU to GPU: the pages go onto the GPU now, not paused
            device = torch.device("cuda", torch.cuda.current_device())
            named = [(n, t.to(device)) for n, t in named]
        self._arl_keep(version, named)
        return time.perf_counter() - t0

    def arl_copy_ipc(self, manifest: bytes, version: int) -> dict[str, Any]:
        """Copy a GPU-held version from the learner's buffers onto this worker's GPU and keep it staged (module
        docstring). Returns ``{"sums": [wsum64 per bucket], "copied_at": time.monotonic() once the learner's
        buffers were read, "s": seconds, "copy_s", "prepare_s", "load"}``, or
        ``{"unavailable": why}`` when this worker cannot map the buffers (another host or namespace, a device it
        cannot see).

        The copies land in one of two staging slots, the one not holding the newest staged version (a version
        staged there before is dropped: a newer one is staged already). A slot whose last version had the same
        layout keeps its buffers and its tensors' views, checked and bound to the replayed load: a version then
        costs its copy and checksums only. Names are converted into views (:mod:`.vllm_weights`). A version that
        several learner ranks publish in pieces is received into buckets both slots share and assembled, every
        tensor, into tensors the slot keeps (one version's memory a slot, plus the shared buckets, instead of the
        buckets and the assembled tensors each), assembled again in place for the next one: bucket by bucket as
        each arrives, beside the copies still under way, one batched copy a bucket (``copy_s`` then counts it;
        moe-5b's 10.1 GB from two ranks took 8-13 ms to assemble after the copies on four H200s, p50 11). A version
        with any other tensor of its own (a conversion that had to copy) is converted, checked and bound again each
        time."""
        from async_rl.weights.gpu.cuda_ipc import IpcUnavailable
        from async_rl.weights.gpu.reader import BucketAssembly, assemble, copy_buckets
        from async_rl.weights.manifest import Manifest

        t0 = time.perf_counter()
        m = Manifest.decode(manifest)
        device = torch.device("cuda", torch.cuda.current_device())
        mapper, stream = self._arl_ipc or self._arl_copy_path()
        staged = self._arl_staged
        newest = staged[max(staged)].slot if staged else None
        slot = 1 if newest == 0 else 0
        for v in [v for v, item in staged.items() if item.slot == slot]:
            del staged[v]
        layout = _layout(m)
        held = self._arl_slots.get(slot)
        same = held if held is not None and held.layout == layout else None
        pieced = not all(t.whole for t in m.tensors)  # every tensor assembled into the slot; buckets received shared
        if pieced:
            receive = self._arl_receive
            into = receive[1] if receive is not None and receive[0] == layout else None
            if into is None:  # new shared buckets: the assemblies' views are of the old ones
                self._arl_assembly.clear()
                into = [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in m.buckets]
        else:
            into = None if same is None else same.buffers
            self._arl_assembly.clear()
        steady = same is not None and same.views and same.plan is self._arl_plan
        then = None
        if steady and pieced:  # each bucket's pieces into the slot's tensors as it arrives, beside the other copies
            assert same is not None and into is not None
            then = self._arl_assembly.get(slot)
            if then is None or not then.serves(into, same.assembled):
                then = self._arl_assembly[slot] = BucketAssembly(m, into, same.assembled)
        self._arl_after(stream)
        try:
            buffers, sums = copy_buckets(m, device, mapper, stream, into=into, then=then)
        except IpcUnavailable as exc:
            return {"unavailable": str(exc)}
        self._arl_receive = (layout, buffers) if pieced else None
        t1, copied_at = time.perf_counter(), time.monotonic()  # the learner's buffers are read (copy_buckets waited)
        if steady:
            assert same is not None
            staged[version] = _Staged(same.named, same.bound, slot)
            how = {"load": "replay (staged before)" if same.bound is not None else "reload"}
        else:
            self._arl_slots.pop(slot, None)
            self._arl_assembly.pop(slot, None)
            full = assemble(m, buffers, device, into=None if same is None else same.assembled, own=pieced)
            assembled = full if pieced else {}
            kept = [] if pieced else buffers
            tensors = self._arl_weights.prepare(full, views=True)
            how = self._arl_keep(version, list(tensors.items()), slot)
            item = staged[version]
            ptrs = {b.untyped_storage().data_ptr() for b in [*kept, *assembled.values()]}
            views = all(t.untyped_storage().data_ptr() in ptrs for _, t in item.named)
            self._arl_slots[slot] = _Slot(layout, kept, item.named, item.bound, self._arl_plan, views, assembled)
        done = torch.cuda.Event()
        done.record()  # the assembly, on this thread's stream: the next copy's stream waits for it (_arl_after)
        self._arl_read = (None, done)
        t2 = time.perf_counter()
        return {"sums": sums, "copied_at": copied_at, "s": t2 - t0, "copy_s": t1 - t0, "prepare_s": t2 - t1, **how}

    def arl_apply_staged(self, version: int) -> float:
        """Load the staged version in place (call with the engine paused); returns seconds spent."""
        staged = self._arl_staged
        if version not in staged:
            raise RuntimeError(f"weight version {version} is not staged in the worker (staged: {sorted(staged)})")
        t0 = time.perf_counter()
        item = staged.pop(version)
        for old in [v for v in staged if v < version]:
            del staged[old]
        if item.bound is not None:
            apply(item.bound)
            torch.cuda.current_stream().synchronize()  # the staged buffers are freed on return
        else:
            self.model_runner.reload_weights(weights_iterator=iter(item.named))  # type: ignore[attr-defined]
            self._arl_reprocess_moe()
        return time.perf_counter() - t0

    def arl_apply_ordered(self, version: int) -> dict[str, Any]:
        """Load the staged version in place without waiting for anything (``vllm.swap="boundary"``, called between the
        engine core's steps): on CUDA the load is queued on this thread's stream, the one the steps run on, after the
        steps launched so far; the next copy into a staging slot waits for it on the GPU (:meth:`_arl_after`).
        Returns ``{"s": host seconds, "gpu_s": GPU seconds of the last earlier load that has finished (None: none
        finished since the last call)}``."""
        staged = self._arl_staged
        if version not in staged:
            raise RuntimeError(f"weight version {version} is not staged in the worker (staged: {sorted(staged)})")
        t0 = time.perf_counter()
        gpu_s = None
        timed = self._arl_load_timed
        if timed is not None and timed[1].query():
            gpu_s, self._arl_load_timed = timed[0].elapsed_time(timed[1]) / 1e3, None
        item = staged.pop(version)
        for old in [v for v in staged if v < version]:
            del staged[old]
        if item.bound is None or not torch.cuda.is_available():
            self.model_runner.reload_weights(weights_iterator=iter(item.named))  # type: ignore[attr-defined]
            self._arl_reprocess_moe()
            s = time.perf_counter() - t0
            return {"s": s, "gpu_s": s if gpu_s is None and not torch.cuda.is_available() else gpu_s}
        stream = steps_stream()
        if item.slot < 0:  # a host version's own tensors, maybe made on another stream (vllm_follow.py): freed after
            for _, t in item.named:  # the load, their memory must wait for this stream
                t.record_stream(stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            apply(item.bound)
            end.record()
        self._arl_read = (item, end)  # its buffers stay referenced until a copy after it waited for the load
        if self._arl_load_timed is None:
            self._arl_load_timed = (start, end)
        return {"s": time.perf_counter() - t0, "gpu_s": gpu_s}

    def _arl_after(self, stream: Any) -> None:
        """``stream`` (a copy's) waits on the GPU for the last work of the steps' stream that read staging buffers
        (an assembly, an ordered load): nothing on that stream waited for them."""
        read = self._arl_read
        if read is not None:
            stream.wait_event(read[1])
            self._arl_read = None

    def arl_param_digest(self) -> dict[str, str]:
        """A SHA-1 of every parameter's bytes as loaded on this rank (tests check weight loads bit for bit)."""
        import hashlib

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {name: hashlib.sha1(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()).hexdigest()
                for name, p in model.named_parameters()}  # fmt: skip

    def _arl_reprocess_moe(self) -> None:
        """Re-run the CPU experts' prepack, which vLLM runs only on the first load (see the module docstring)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            for module in model.modules():
                if not isinstance(module, MoERunner):
                    continue
                experts = module.routed_experts
                kernel = getattr(experts.quant_method, "moe_kernel", None)
                fused = getattr(kernel, "fused_experts", None)
                if fused is not None:
                    fused.process_weights_after_loading(experts)


def steps_stream() -> Any:
    """The stream this thread's steps run on, as vLLM picks it (``vllm.utils.torch_utils.current_stream``: on CUDA a
    stream of its own per thread, made and set current at its first call, not the default stream): where the engine
    is eager, a load before that call would otherwise go to the default stream, which the new stream does not wait
    for. Made here, it waits for the work queued so far (vLLM 0.32 does that itself, 0.25.1 does not)."""
    from vllm.utils.torch_utils import current_stream

    before = torch.cuda.current_stream()
    stream = current_stream()
    if stream != before:
        stream.wait_stream(before)
    return stream
