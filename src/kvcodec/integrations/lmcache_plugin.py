"""The kvcodec serde as LMCache sees it: Serializer / Deserializer subclasses, the factory, its
registration under "kvcodec" (on import), and a launcher that registers it and starts LMCache's
own command line (`python -m kvcodec.integrations.lmcache_plugin server ...`). With kvcodec's L2
adapter (kvcodec.integrations.lmcache_store) no launcher is needed: importing the adapter
registers the serde.

Coding lives in kvcodec.integrations.lmcache_serde (no LMCache import there).
"""

from __future__ import annotations

import json
import sys

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    SerdeProcessor,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.memory_management import MemoryObj

from kvcodec.errors import ShapeError
from kvcodec.integrations.lmcache_serde import SERDE_NAME, KVCodecCoder, SerdeOptions, object_parts, size_bound


class KVCodecSerializer(Serializer):
    """KV-shaped MemoryObj -> kvcodec bytes in LMCache's temp byte buffer."""

    def __init__(self, coder: KVCodecCoder) -> None:
        self._coder = coder

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        data = self._coder.encode(object_parts(src), key_bytes(key))
        out = dst.tensor
        if out is None or out.numel() < len(data):
            raise ShapeError(f"LMCache serde buffer holds {0 if out is None else out.numel()} bytes; need {len(data)}")
        out.reshape(-1)[: len(data)].copy_(_bytes_tensor(data))
        return len(data)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return size_bound(layout_desc.shapes, layout_desc.dtypes)


class KVCodecDeserializer(Deserializer):
    """kvcodec bytes -> the KV-shaped destination MemoryObj (NVDEC where configured and present)."""

    def __init__(self, coder: KVCodecCoder) -> None:
        self._coder = coder

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        data = src.tensor
        if data is None:
            raise ShapeError("LMCache gave the kvcodec serde an invalidated source buffer")
        self._coder.decode_into(memoryview(data.reshape(-1).numpy()), object_parts(dst), key_bytes(key))


def key_bytes(key: ObjectKey) -> bytes:
    """Every field of an LMCache ObjectKey, injectively: the serde binds each object to its key, so
    a store that serves another key's object is refused, not read as this key's KV."""
    fields = [key.model_name, key.kv_rank, key.object_group_id, key.cache_salt, key.chunk_hash.hex()]
    return json.dumps(fields).encode()


def _bytes_tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def create_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache serde factory: the adapter's `"serde"` dict (less "type") -> a SerdeProcessor."""
    options = SerdeOptions.from_kwargs(kwargs)
    coder = KVCodecCoder(options)
    return AsyncSerdeProcessor(KVCodecSerializer(coder), KVCodecDeserializer(coder), max_workers=options.max_workers)


def register() -> None:
    """Register the "kvcodec" serde type with LMCache (idempotent)."""
    if SERDE_NAME not in get_registered_serde_types():
        register_serde_factory(SERDE_NAME, create_serde)


register()


def main(argv: list[str] | None = None) -> None:
    """`lmcache` (LMCache's own command line) with the kvcodec serde registered first."""
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache", *(sys.argv[1:] if argv is None else argv)]
    lmcache_main()


if __name__ == "__main__":
    main()
