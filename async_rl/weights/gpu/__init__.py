"""The GPU path of weight versions: versions kept in the learner's GPU buffers and read GPU to GPU.

``slots`` (the learner's GPU slots, leased while read), ``publisher`` (filling them at a step boundary on a side
stream), ``ranks`` (several learner ranks feeding the host transport without a gather), ``encoder`` (host versions
encoded on the GPU: sparse deltas, checksums), ``checksum`` (the GPU checksums), ``cuda_ipc`` (mapping another
process's buffers) and ``reader`` (a generator copying a version GPU to GPU). Protocol: ``docs/weights.md``.

Part of :mod:`async_rl.weights` (its rule covers this room).
"""
