"""``shm://``: weight buckets as files under a tmpfs on one host; readers map them (zero copies after the writer's)."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import shutil
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlparse

from async_rl.run.names import Names
from async_rl.weights.transport import BucketMissing, BucketTransport, TransportConfig, register_transport


class SharedMemoryTransport(BucketTransport):
    """Buckets as files under a tmpfs (``/dev/shm/<prefix>/v<version>/<index>``); readers map them."""

    name: ClassVar[str] = "shm"
    root: Path

    def __init__(self, names: Names, root: str | Path = "/dev/shm") -> None:
        self.root = Path(root) / f"async-rl-{names.prefix}"

    def _path(self, version: int, index: int) -> Path:
        return self.root / f"v{version}" / f"{index}.bin"

    async def put(self, version: int, index: int, data: memoryview) -> None:
        path = self._path(version, index)

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)

        await asyncio.to_thread(write)

    async def get(self, version: int, index: int, nbytes: int | None = None) -> memoryview:
        path = self._path(version, index)

        def open_map() -> memoryview:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    return memoryview(b"")
                return memoryview(mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ))

        try:
            return await asyncio.to_thread(open_map)
        except FileNotFoundError:
            raise BucketMissing(f"bucket {index} of weights version {version} is missing ({path})") from None

    async def delete(self, version: int, num_buckets: int) -> None:
        def remove() -> None:
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)
            with contextlib.suppress(OSError):  # not empty (other versions) or gone already
                self.root.rmdir()

        await asyncio.to_thread(remove)


def _from_config(url: str, cfg: TransportConfig, redis_url: str, names: Names) -> SharedMemoryTransport:
    return SharedMemoryTransport(names, root=urlparse(url).path)


register_transport("shm", _from_config)
