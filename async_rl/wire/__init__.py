"""Wire format of stream entries: :class:`GroupRecord` (rollouts) and :class:`PromptSpec` (prompts).

Encoding: MessagePack through ``msgspec`` (measured here on a realistic group of 8 samples x
2,048 tokens with 48x8 uint8 routes, 7.3 MB: msgspec encodes in 1.3 ms against 17.6 ms for
``msgpack.packb``, and its typed decoder returns ``memoryview`` slices of the input, 0.03 ms
against 1.4 ms). Every array travels as ``[dtype, shape, raw little-endian bytes]`` and is
decoded zero-copy with ``np.frombuffer``: decoded arrays are read-only views into the bytes
given to :func:`decode_group` (copy one before writing to it). Per-token weight versions travel
run-length encoded (``[[version, length], ...]``) when that is shorter. A sample of an episode of several
turns carries a loss mask (``mask``, uint8, 1 on the model's tokens); it is left out when every token is
the model's. Schema version 2 added it; version-1 records still decode (``loss_mask=None``).

Layout of a group record (a msgpack map; short keys because every entry carries them)::

    {v: schema version, gid, pid, gen, t: created_at, prompt: ARR, meta: {...},
     samples: [{ids: ARR, lp: ARR, ver: ARR | nil, ver_runs: ARR | nil, rw: reward,
                fin: finish reason, routes: ARR | nil, info: {name: float}, mask: ARR | nil}]}
    ARR = [dtype string ("<i4", "<f4", "|u1", "<i2"), shape, bin]

Both :func:`encode_group` and :func:`decode_group` validate; every problem raises
:class:`WireError` naming the field (``samples[3].logprobs: ...``). Decoding is bounded: every
declared size (an array's shape, a run-length's total) is checked against the bytes received
before anything is allocated from it, and metadata nests at most :data:`MAX_META_DEPTH` deep.

May import: model.
"""

from async_rl.wire.codec import MAX_META_DEPTH, WireError
from async_rl.wire.groups import compact_routes, decode_group, encode_group, encode_group_into
from async_rl.wire.prompts import PROMPT_SCHEMA_VERSION, PromptSpec, decode_prompt, encode_prompt
from async_rl.wire.types import READ_SCHEMA_VERSIONS, SCHEMA_VERSION

__all__ = [
    "MAX_META_DEPTH",
    "PROMPT_SCHEMA_VERSION",
    "READ_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "PromptSpec",
    "WireError",
    "compact_routes",
    "decode_group",
    "decode_prompt",
    "encode_group",
    "encode_group_into",
    "encode_prompt",
]
