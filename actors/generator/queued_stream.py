"""A weight version handed to an engine's loader thread in parts (:meth:`Engine.open_stage`): a queue of parts,
ended by ``finish`` or ``abort``, checked against the names the engine accepted up front."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping

import torch

from actors.generator.engine import StagingStream


class StreamAborted(Exception):
    """A streamed version was abandoned by its producer."""


_END = object()
_ABORT = object()


class QueuedStream(StagingStream):
    """Parts of a version on their way from the weight sync to the loader thread (see :meth:`Engine.open_stage`)."""

    __slots__ = ("_names", "_queue")

    def __init__(self, layout: Mapping[str, torch.Tensor]) -> None:
        self._names = set(layout)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._queue.put(dict(tensors))

    def finish(self) -> None:
        self._queue.put(_END)

    def abort(self) -> None:
        self._queue.put(_ABORT)

    def parts(self) -> Iterator[Mapping[str, torch.Tensor]]:
        """The parts as they come (loader thread); StreamAborted when abandoned, ValueError when the parts were not
        exactly the layout's names."""
        seen: set[str] = set()
        while True:
            item = self._queue.get()
            if item is _ABORT:
                raise StreamAborted
            if item is _END:
                break
            unknown = [n for n in item if n not in self._names or n in seen]
            if unknown:
                raise ValueError(f"streamed weights outside the staged layout or sent twice: {sorted(unknown)[:5]}")
            seen.update(item)
            yield item
        missing = self._names - seen
        if missing:
            raise ValueError(f"streamed version ended without {len(missing)} weight(s): {sorted(missing)[:5]}")
