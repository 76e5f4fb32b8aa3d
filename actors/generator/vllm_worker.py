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
  above, and
  loaded in place from those pages (:meth:`arl_apply_staged`, while the engine is paused) through
  vLLM's layerwise ``reload_weights``, which feeds the model's ``load_weights``. On CPU the experts
  kernel's ``process_weights_after_loading`` (its prepack into the grouped-GEMM layout) is then run
  again on every fused-MoE layer: vLLM runs it only on the first load, so a reload alone leaves the
  raw new weights where the kernel expects prepacked ones (wrong expert outputs).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

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


class ArlWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``); all names start with ``arl_``."""

    def arl_setup(self, capture_routes: bool, num_experts: int, model_dir: str) -> dict[str, int]:
        """Install the route capture (when asked); return what the engine needs to know."""
        from pathlib import Path

        from actors.generator.model_facts import read_model_facts
        from actors.generator.vllm_weights import CheckpointWeights

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        self._arl_staged: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._arl_routes: _RouteCapture | None = None
        self._arl_weights = CheckpointWeights(read_model_facts(Path(model_dir)))
        self._arl_ipc: Any = None
        if capture_routes:
            dtype = route_dtype(num_experts)
            self._arl_routes = _RouteCapture(self.model_runner, model, dtype)  # type: ignore[attr-defined]
            return {"num_layers": self._arl_routes.num_layers, "top_k": self._arl_routes.top_k}
        return {"num_layers": 0, "top_k": 0}

    def arl_take_routes(self, external_ids: list[str]) -> dict[str, tuple[bytes, list[int], str]]:
        """Routes ``[T_run, moe_layers, top_k]`` of finished requests, by external request id, forgotten here.

        Each as ``(raw bytes, shape, numpy dtype string)``: vLLM's RPC results carry plain values reliably.
        """
        routes = getattr(self, "_arl_routes", None)
        if routes is None:
            return {}
        return {rid: (a.tobytes(), list(a.shape), a.dtype.str) for rid, a in routes.take(external_ids).items()}

    def _arl_keep(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Hold ``version`` staged until :meth:`arl_apply_staged`; only the newest :data:`STAGED_KEPT` stay."""
        staged = self._arl_staged
        staged[version] = named
        for old in sorted(staged)[:-STAGED_KEPT]:
            del staged[old]

    def arl_stage_weights(self, handle: Handle, version: int) -> float:
        """Map a full weight version the engine packed in memory (no copy, see :mod:`.weight_handover`) and keep
        it until :meth:`arl_apply_staged`. Returns seconds spent."""
        t0 = time.perf_counter()
        self._arl_keep(version, map_weights(handle))
        return time.perf_counter() - t0

    def arl_copy_ipc(self, manifest: bytes, version: int) -> dict[str, Any]:
        """Copy a GPU-held version from the learner's buffers onto this worker's GPU and keep it staged (module
        docstring). Returns ``{"sums": [wsum64 per bucket], "s": seconds}``, or ``{"unavailable": why}`` when this
        worker cannot map the buffers (another host or namespace, a device it cannot see)."""
        from async_rl.weights.gpu.cuda_ipc import IpcMapper, IpcUnavailable
        from async_rl.weights.gpu.reader import assemble, copy_buckets
        from async_rl.weights.manifest import Manifest

        t0 = time.perf_counter()
        m = Manifest.decode(manifest)
        device = torch.device("cuda", torch.cuda.current_device())
        if self._arl_ipc is None:
            self._arl_ipc = (IpcMapper(), torch.cuda.Stream(device=device))
        mapper, stream = self._arl_ipc
        try:
            buffers, sums = copy_buckets(m, device, mapper, stream)
        except IpcUnavailable as exc:
            return {"unavailable": str(exc)}
        tensors = self._arl_weights.prepare(assemble(m, buffers, device))
        self._arl_keep(version, list(tensors.items()))
        return {"sums": sums, "s": time.perf_counter() - t0}

    def arl_apply_staged(self, version: int) -> float:
        """Load the staged version in place (call with the engine paused); returns seconds spent."""
        staged = self._arl_staged
        if version not in staged:
            raise RuntimeError(f"weight version {version} is not staged in the worker (staged: {sorted(staged)})")
        t0 = time.perf_counter()
        named = staged.pop(version)
        for old in [v for v in staged if v < version]:
            del staged[old]
        self.model_runner.reload_weights(weights_iterator=iter(named))  # type: ignore[attr-defined]
        self._arl_reprocess_moe()
        return time.perf_counter() - t0

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
