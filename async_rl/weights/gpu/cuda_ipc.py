"""CUDA IPC between the processes of one host: a GPU buffer exported once, opened by any process at any time.

The learner allocates its version buffers once (:mod:`.gpu_slots`) and exports each with torch's own sharing
call (``UntypedStorage._share_cuda_``: the cudaIpc memory handle, the buffer's offset in its allocation, and
torch's reference-counter and event handles). The handle is plain bytes and travels in the weight manifest
(msgpack, HMAC-signed), never pickled. A reader opens it with ``UntypedStorage._new_shared_cuda`` on the
device with the same UUID in its own numbering (``CUDA_VISIBLE_DEVICES`` may renumber them; a device it
cannot see means no IPC) and keeps the mapping for as long as the handle keeps appearing in manifests, so a
version costs one GPU-to-GPU copy and no open after the first.

No collective and no rendezvous: whoever reads the manifest on the same host (:func:`host_key`) can join.
:func:`host_key` counts another network or IPC namespace as another host, so a generator in a container of
its own, or in a namespace that simulates another machine, takes the host transport instead.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import deque
from dataclasses import dataclass

import torch

from async_rl.weights.config import MAX_GPU_SLOTS

VERSIONS_KEPT = MAX_GPU_SLOTS
"""A mapper keeps the handles of the last this many versions it opened mapped (:meth:`IpcMapper.open_all`), and
closes the others: every slot of the learner's (``publisher.gpu_slots``, at most this many) stays mapped whatever the
model's size, and a restarted learner's old buffers are let go (a mapping keeps the memory of a process that died)."""


GIL_SWITCH_INTERVAL_S = 0.0005
"""Python's thread switch interval in processes on the GPU path. A version crosses threads several times (the
training or decode thread, the event loop, worker threads waiting on CUDA events); at the default 5 ms each hand-off
can wait that long for the GIL while the training or decode thread launches kernels, which showed in
snapshot-to-applied times of 90 ms of which the GPU's copies took under 10."""


COPY_PRIORITY = -1
"""The CUDA priority of the GPU path's side streams (lower is higher; torch's default is 0): the learner's snapshot
into its slots and a reader's copies, with their checksums and assembly, get the SMs before the blocks of other work
queued meanwhile (training, decoding). On a GPU busy with memory-bound work, as a decoding generator's is, moe-5b's
10.1 GB took 109 ms to copy, check and assemble at the default priority and 42 at this one (28 ms the copy alone, on
the copy engines either way; scripts/gpu/copy_costs.py, four H200s)."""


def fast_thread_handoffs() -> None:
    """Lower this process's thread switch interval to :data:`GIL_SWITCH_INTERVAL_S` (never raise it)."""
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


class IpcUnavailable(RuntimeError):
    """This process cannot map the buffer (another host, a device it cannot see, no CUDA, a handle gone)."""


@dataclass(slots=True)
class IpcHandle:
    """What a process on the same host needs to map one exported GPU buffer."""

    device_uuid: str
    """UUID of the GPU holding the buffer (device numbers differ between processes; UUIDs do not)."""
    handle: bytes
    """torch's cudaIpc memory handle of the allocation holding the buffer."""
    storage_bytes: int
    """Size of the exported storage."""
    storage_offset: int
    """Byte offset of the storage inside that allocation."""
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def encode(self) -> list:
        return [self.device_uuid, self.handle, self.storage_bytes, self.storage_offset, self.ref_counter_handle,
                self.ref_counter_offset, self.event_handle, self.event_sync_required]  # fmt: skip

    @classmethod
    def decode(cls, raw: list) -> IpcHandle:
        uuid, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = raw
        if not isinstance(handle, bytes) or not isinstance(rc_handle, bytes) or not isinstance(ev_handle, bytes):
            raise ValueError("IPC handle fields must be bytes")
        return cls(str(uuid), handle, int(size), int(offset), rc_handle, int(rc_offset), ev_handle, bool(ev_sync))


@functools.cache
def host_key() -> str:
    """Who may map this process's exports: the boot (same kernel, same machine) and the network and IPC namespaces."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    namespaces = []
    for ns in ("net", "ipc"):
        try:
            namespaces.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            namespaces.append("?")
    return "/".join([boot, *namespaces])


def device_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


@functools.cache
def _local_devices() -> dict[str, int]:
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


def local_device(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid`` (None: not visible here)."""
    if not torch.cuda.is_available():
        return None
    return _local_devices().get(uuid)


def export(buf: torch.Tensor) -> IpcHandle:
    """Export ``buf`` (a whole CUDA storage, e.g. from ``torch.empty``) for other processes; call once per buffer and
    keep ``buf`` alive for as long as readers may map it."""
    if buf.device.type != "cuda":
        raise ValueError(f"CUDA IPC exports CUDA tensors, not {buf.device}")
    storage = buf.untyped_storage()
    if buf.storage_offset() != 0 or storage.nbytes() != buf.numel() * buf.element_size():
        raise ValueError("CUDA IPC: export a buffer that is its whole storage")
    _device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()  # type: ignore[attr-defined]
    return IpcHandle(device_uuid(buf.device), handle, int(size), int(offset), rc_handle, int(rc_offset), ev_handle,
                     bool(ev_sync))  # fmt: skip


class IpcMapper:
    """Opens handles once and keeps them mapped while they are among the last :data:`VERSIONS_KEPT` versions' handles."""

    opened: int
    """Handles mapped so far (a handle mapped again after it was closed counts again)."""
    _open: dict[tuple[bytes, int], torch.Tensor]
    _recent: deque[set[tuple[bytes, int]]]

    def __init__(self) -> None:
        self.opened = 0
        self._open = {}
        self._recent = deque(maxlen=VERSIONS_KEPT)

    @property
    def mapped(self) -> int:
        """Handles mapped now."""
        return len(self._open)

    def open_all(self, handles: list[IpcHandle], sizes: list[int]) -> list[torch.Tensor]:
        """One version's buffers: the first ``sizes[i]`` bytes of each exported buffer as a uint8 tensor on its device
        (in this process's numbering); :class:`IpcUnavailable` when one cannot be mapped here. Handles of none of the
        last :data:`VERSIONS_KEPT` versions are closed."""
        out = [self._open_one(h, n) for h, n in zip(handles, sizes, strict=True)]
        self._recent.append({(h.handle, h.storage_offset) for h in handles})
        keep = set().union(*self._recent)
        for key in [k for k in self._open if k not in keep]:
            del self._open[key]  # unmapped once the views handed out are gone too
        return out

    def _open_one(self, h: IpcHandle, nbytes: int) -> torch.Tensor:
        key = (h.handle, h.storage_offset)
        buf = self._open.get(key)
        if buf is None:
            index = local_device(h.device_uuid)
            if index is None:
                raise IpcUnavailable(f"GPU {h.device_uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")
            try:
                storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                    index, h.handle, h.storage_bytes, h.storage_offset, h.ref_counter_handle, h.ref_counter_offset,
                    h.event_handle, h.event_sync_required,
                )  # fmt: skip
            except RuntimeError as exc:  # the exporter is gone, another IPC namespace, a driver refusal
                raise IpcUnavailable(f"cannot map the learner's GPU buffer: {exc}") from exc
            buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
            buf.set_(storage, 0, (h.storage_bytes,), (1,))
            self.opened += 1
            self._open[key] = buf
        if nbytes > buf.numel():
            raise IpcUnavailable(f"the learner's GPU buffer holds {buf.numel()} bytes, the manifest needs {nbytes}")
        return buf[:nbytes]

    def close(self) -> None:
        self._open.clear()
        self._recent.clear()
