"""KV descriptions beyond one uniform tensor: sliding-window layers, MLA latent caches, mixed shapes.

See spec.py (KVSpec, groups), tensors.py (GroupedKV) and hf.py (transformers caches)."""

from kvcodec.kvspec.hf import build_cache, end_recording, recording_cache, spec_from_cache, split_cache
from kvcodec.kvspec.spec import GroupSpec, KVSpec, LayerSpec, group_layers
from kvcodec.kvspec.tensors import GroupedKV, pack_groups, unpack_groups

__all__ = [
    "GroupSpec",
    "GroupedKV",
    "KVSpec",
    "LayerSpec",
    "build_cache",
    "end_recording",
    "recording_cache",
    "group_layers",
    "pack_groups",
    "split_cache",
    "spec_from_cache",
    "unpack_groups",
]
