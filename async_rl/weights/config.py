"""Configs of the weight publisher (learner) and reader (generators); torch-free so configs load fast."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from async_rl.weights.checksums import CHECKSUMS
from async_rl.weights.transport import MAX_BUCKET_BYTES

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
"""dtypes a GPU-held version may be published in (names of async_rl.weights.manifest.DTYPES)."""
MAX_GPU_SLOTS = 4
"""Most versions a learner keeps in GPU buffers (``publisher.gpu_slots``): readers keep this many versions' buffers
mapped (:data:`async_rl.weights.gpu.cuda_ipc.VERSIONS_KEPT`)."""
# zstd's highest compression level (the zstandard package is not imported here: configs stay light).
ZSTD_MAX_LEVEL = 22


@dataclass(kw_only=True, slots=True)
class PublisherConfig:
    """How the learner publishes weight versions."""

    bucket_bytes: int = 256 << 20
    """Target bucket size; a tensor larger than this gets a bucket of its own."""
    keep_versions: int = 3
    """Complete versions kept visible; older ones are deleted once no reader holds a lease on them."""
    checksum: str = ""
    """Bucket checksum ('xxh3_64' or 'crc32'); empty picks the fastest available (xxh3_64)."""
    secret_file: str = ""
    """File holding the run secret that signs every manifest (HMAC-SHA256); empty: $ASYNC_RL_RUN_SECRET_FILE, else
    $ASYNC_RL_RUN_SECRET, else manifests are not signed (async_rl/weights/signing.py)."""
    background: bool = True
    """The training loop waits only for a snapshot of the weights into reused host buffers; encoding, checksums
    and transfer run in the background while the next steps train. A step that ends while a version is still
    going out publishes nothing (its version is skipped: generators move to the newest complete one). False: the
    loop waits for every version to be published (the path before issue 17)."""
    delta: bool = True
    """Publish a version as the change from the previous published one (XOR + zstd per piece, each piece only
    where that is smaller; async_rl/weights/delta.py). Generators check every tensor bit for bit."""
    full_every: int = 10
    """With ``delta``: every this many published versions one is full (and whenever a generator asks for one);
    1 makes every version full. Pruning keeps the newest full version and the deltas after it."""
    zstd_level: int = 1
    """zstd level of delta payloads (1-22; 1 measured smallest per second of CPU here, docs/weights.md)."""
    gpu: Literal["auto", "on", "off"] = "auto"
    """Keep each version in GPU buffers that generators on the same host copy over CUDA IPC in milliseconds
    (async_rl/weights/gpu/publisher.py): 'auto' where the learner's weights are on a CUDA GPU, 'on' refuses to
    start otherwise, 'off' publishes through the host transport only."""
    gpu_slots: int = 2
    """Versions kept in GPU buffers (2 to :data:`MAX_GPU_SLOTS`, each the size of the weights in ``gpu_dtype``): the
    newest is never overwritten, another only when no reader holds a lease on it; with none free a step's version is
    skipped."""
    gpu_bucket_bytes: int = 1 << 30
    """Target size of one GPU bucket (one CUDA IPC handle and one checksum each)."""
    gpu_dtype: str = ""
    """Floating-point dtype of the GPU-held versions (the generators' dtype, e.g. 'bfloat16'); '' keeps the
    learner's."""
    gpu_host_copies: bool = True
    """With the GPU path on, also publish versions through the host transport (as many as it sustains, never
    blocking a step) for generators on other hosts or that cannot map the learner's GPU."""
    gpu_encode: bool = True
    """With the GPU path on (one rank's slots, or every rank's on rank 0's host): the host transport's versions are
    encoded on the GPU (a delta of the changed elements where that is faster at the link's measured rate, checksums there too;
    async_rl/weights/gpu/encoder.py). It keeps one more copy of the weights on the GPU, the base of the next delta,
    when ``delta`` is on. False: they are snapshot to host memory and encoded on the CPU (XOR + zstd)."""
    link_gbps: float = 0.0
    """The rate, in Gbit/s, at which host versions reach generators, for the choice between a delta and a whole
    version made on the GPU (``gpu_encode``); 0: measured (the peer transport's streams to children, or the bucket
    writes of a transport whose writes cross the link, e.g. Redis)."""
    gpu_retry_s: float = 0.05
    """At a flush that finds every GPU slot leased: wait this long before trying again."""

    def __post_init__(self) -> None:
        if not 0 < self.bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(f"weights.bucket_bytes must be in (0, {MAX_BUCKET_BYTES}]")
        if self.keep_versions < 1:
            raise ValueError("weights.keep_versions must be >= 1")
        if self.checksum and self.checksum not in CHECKSUMS:
            raise ValueError(f"weights.checksum must be one of {sorted(CHECKSUMS)}, got {self.checksum!r}")
        if self.full_every < 1:
            raise ValueError(f"weights.full_every must be >= 1, got {self.full_every}")
        if not 1 <= self.zstd_level <= ZSTD_MAX_LEVEL:
            raise ValueError(f"weights.zstd_level must be in [1, {ZSTD_MAX_LEVEL}], got {self.zstd_level}")
        if self.gpu not in ("auto", "on", "off"):
            raise ValueError(f"publisher.gpu must be 'auto', 'on' or 'off', got {self.gpu!r}")
        if not 2 <= self.gpu_slots <= MAX_GPU_SLOTS:
            raise ValueError(f"publisher.gpu_slots must be in [2, {MAX_GPU_SLOTS}] (the newest version is never "
                             f"overwritten; readers keep {MAX_GPU_SLOTS} versions mapped), got {self.gpu_slots}")  # fmt: skip
        if self.gpu_bucket_bytes <= 0:
            raise ValueError("publisher.gpu_bucket_bytes must be > 0")
        if self.gpu_dtype and self.gpu_dtype not in FLOAT_DTYPES:
            raise ValueError(f"publisher.gpu_dtype must be one of {list(FLOAT_DTYPES)} or '', got {self.gpu_dtype!r}")
        if self.link_gbps < 0:
            raise ValueError(f"publisher.link_gbps must be >= 0 (0: measured), got {self.link_gbps}")
        if self.gpu_retry_s <= 0:
            raise ValueError("publisher.gpu_retry_s must be > 0")



@dataclass(kw_only=True, slots=True)
class ReaderConfig:
    """How a generator reads weight versions."""

    lease_ttl_s: float = 60.0
    """Lease on a version being read, renewed every third of it; the publisher will not delete a leased version."""
    prefetch_buckets: int = 1
    """Buckets requested ahead of the one being verified (transfer overlaps the checksum)."""
    gpu_lease_ttl_s: float = 2.0
    """Lease on a GPU-held version while its buckets are copied over CUDA IPC (milliseconds of work), renewed every
    third of it while the copy is under way: the learner refills no leased slot, and a reader whose copy outlasts
    the lease discards it. Short, so that a reader killed mid-copy holds a slot no longer than this."""
    gpu_lease_max_s: float = 10.0
    """How long a live reader may keep renewing its lease on a GPU-held version while its copy has not read the
    learner's buffers yet (a vLLM worker starts it at its engine's next step boundary); a copy later than this is
    discarded. It bounds how long one slow reader holds one of the learner's slots."""
    secret_file: str = ""
    """File holding the run secret: only versions whose manifest HMAC checks are applied. Empty:
    $ASYNC_RL_RUN_SECRET_FILE, else $ASYNC_RL_RUN_SECRET, else manifests are not checked."""

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0:
            raise ValueError("weights.reader.lease_ttl_s must be > 0")
        if self.prefetch_buckets < 0:
            raise ValueError("weights.reader.prefetch_buckets must be >= 0")
        if self.gpu_lease_ttl_s <= 0:
            raise ValueError("weight_sync.reader.gpu_lease_ttl_s must be > 0")
        if self.gpu_lease_max_s < self.gpu_lease_ttl_s:
            raise ValueError(f"weight_sync.reader.gpu_lease_max_s ({self.gpu_lease_max_s}) must be >= "
                             f"gpu_lease_ttl_s ({self.gpu_lease_ttl_s})")  # fmt: skip
