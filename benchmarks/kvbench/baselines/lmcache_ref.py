"""LMCache's own CacheGen implementation behind the baseline interface ("lmcache-cachegen").

Available only where the `lmcache` package imports with a compute backend: with CUDA it uses
LMCache's compiled kernels; on a CPU machine LMCache (>= 0.5) falls back to numba versions of the
same arithmetic coder. LMCache is not a kvcodec dependency (it pins numpy <= 2.2 and pulls a large
tree); install it separately to cross-check the CacheGen-style codec (benchmarks/BASELINES.md).

Like LMCache's serializer, tokens go through `encode_function` in chunks of 256 with LMCache's
default bins. Its output objects (CDF int16 tables, int32 stream lengths, byte streams, fp16
per-token maxima) are stored with safetensors instead of pickle; the size differs from LMCache's
pickle by a few hundred bytes of framing per chunk.
"""

from __future__ import annotations

import functools
import json

import torch

from kvbench.baselines.base import check_kv, pack, unpack
from kvbench.baselines.cachegen import CHUNK_TOKENS, default_bins
from kvcodec.errors import CorruptStreamError


@functools.cache
def _lmcache():
    import logging

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    import lmcache

    if not hasattr(lmcache, "device_ops"):
        raise ImportError("lmcache has no compute backend here")
    from lmcache.storage_backend.serde import cachegen_basics as basics
    from lmcache.storage_backend.serde import cachegen_decoder as dec
    from lmcache.storage_backend.serde import cachegen_encoder as enc

    return enc, dec, basics


class LMCacheCacheGen:
    lossless = False

    def __init__(self, name: str = "lmcache-cachegen", chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.name = name
        self.chunk_tokens = chunk_tokens

    @staticmethod
    def is_available() -> bool:
        try:
            _lmcache()
        except Exception:
            return False
        return True

    @staticmethod
    def _device():
        import lmcache

        return lmcache.torch_device_type

    def _bins(self, n_layers: int):
        k, v = default_bins(n_layers)
        dev = self._device()
        return torch.tensor(k, dtype=torch.float32, device=dev), torch.tensor(v, dtype=torch.float32, device=dev)

    def encode(self, kv: torch.Tensor) -> bytes:
        from safetensors.torch import save

        check_kv(kv)
        enc, _, basics = _lmcache()
        Lr, _, T, H, D = kv.shape
        kb, vb = self._bins(Lr)
        cfg = basics.CacheGenConfig(nlayers=Lr, kspecs=[], vspecs=[])
        tensors: dict[str, torch.Tensor] = {}
        meta = []
        for ci, s in enumerate(range(0, T, self.chunk_tokens)):
            part = kv[:, :, s : s + self.chunk_tokens].contiguous().to(self._device())
            n = part.shape[2]
            out = enc.encode_function(part, cfg, kb, vb, n)
            tensors[f"{ci}.cdf"] = out.cdf.cpu()
            tensors[f"{ci}.kmax"] = out.max_tensors_key.cpu()
            tensors[f"{ci}.vmax"] = out.max_tensors_value.cpu()
            subs = []
            for j, dc in enumerate(out.data_chunks):
                tensors[f"{ci}.{j}.bytes"] = dc.bytestream.cpu()
                tensors[f"{ci}.{j}.lengths"] = dc.bytestream_lengths.cpu()
                subs.append(int(dc.ntokens))
            meta.append({"n": n, "subs": subs})
        blob = save(tensors, metadata={"chunks": json.dumps(meta)})
        return pack(self.name, kv, blob)

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        from safetensors.torch import load

        header, payload = unpack(data, self.name)
        _, dec, basics = _lmcache()
        Lr, _, T, H, D = header.shape
        try:
            tensors = load(bytes(payload))
            meta = json.loads(_metadata(bytes(payload))["chunks"])
        except Exception as e:
            raise CorruptStreamError(f"lmcache-cachegen payload does not parse: {e}") from e
        kb, vb = self._bins(Lr)
        dev = self._device()
        parts = []
        for ci, m in enumerate(meta):
            n = m["n"]
            chunks = [
                basics.CacheGenGPUBytestream(
                    bytestream=tensors[f"{ci}.{j}.bytes"].to(dev),
                    bytestream_lengths=tensors[f"{ci}.{j}.lengths"].to(dev),
                    ntokens=nt,
                )
                for j, nt in enumerate(m["subs"])
            ]
            cdf = tensors[f"{ci}.cdf"].to(dev)
            buf = torch.zeros((n, 2 * Lr * H * D), dtype=torch.uint8, device=dev)
            k, v = dec.decode_function_gpu(cdf, chunks, Lr, n, buf)
            k = dec.do_dequantize(k, kb, tensors[f"{ci}.kmax"].to(dev))
            v = dec.do_dequantize(v, vb, tensors[f"{ci}.vmax"].to(dev))
            parts.append(torch.stack([k, v], dim=1).reshape(Lr, 2, n, H, D))
        return torch.cat(parts, dim=2).to(header.dtype).to(device)

    def size_breakdown(self, data: bytes) -> dict[str, int]:
        """Bytes of LMCache's parts: arithmetic-coded streams, int16 CDF tables, int32 stream lengths,
        per-token maxima; "framing" is the safetensors header (LMCache's pickle has its own)."""
        from safetensors.torch import load

        _, payload = unpack(data, self.name)
        tensors = load(bytes(payload))
        out = {"container": len(data) - len(payload), "streams": 0, "tables": 0, "lengths": 0, "maxes": 0}
        kinds = {"bytes": "streams", "cdf": "tables", "lengths": "lengths", "kmax": "maxes", "vmax": "maxes"}
        for key, t in tensors.items():
            out[kinds[key.rsplit(".", 1)[1]]] += t.numel() * t.element_size()
        out["framing"] = len(payload) - sum(v for k, v in out.items() if k != "container")
        return out


def _metadata(blob: bytes) -> dict:
    import struct

    (n,) = struct.unpack_from("<Q", blob, 0)
    return json.loads(blob[8 : 8 + n])["__metadata__"]
