"""kvcodec itself behind the baseline interface ("kvcodec-exact", "kvcodec-int8", ...), so benches
iterate over one list of codecs. Calls `kvcodec.encode(kv, CodecConfig(quant=...))` and
`kvcodec.decode(data, device=...)`; the bytes are kvcodec's own container (it carries its own
header and checksums), not wrapped again. A kvcodec file stores every chunk at each resolution of
its config and a fetch reads one: `size_breakdown` gives the bytes per resolution, which is what
to compare with the baselines' sizes.
"""

from __future__ import annotations

import importlib

import torch

from kvbench.baselines.base import check_kv


def _api():
    """(encode, decode, CodecConfig) from the kvcodec package, or None while they have not landed."""
    try:
        pkg = importlib.import_module("kvcodec")
        encode = getattr(pkg, "encode", None)
        decode = getattr(pkg, "decode", None)
        config = getattr(pkg, "CodecConfig", None)
        if encode is None or decode is None:
            mod = importlib.import_module("kvcodec.codec")
            encode, decode = mod.encode, mod.decode
        if config is None:
            config = importlib.import_module("kvcodec.config").CodecConfig
    except (ImportError, AttributeError):
        return None
    return encode, decode, config


class KVCodecAdapter:
    def __init__(self, name: str, quant: str, **config) -> None:
        self.name = name
        self.quant = quant
        self.lossless = quant == "exact"
        self.config = config

    @staticmethod
    def is_available() -> bool:
        return _api() is not None

    def _require(self):
        api = _api()
        if api is None:
            from kvcodec.errors import BackendUnavailableError

            raise BackendUnavailableError("kvcodec.encode/decode are not available in this build")
        return api

    def encode(self, kv: torch.Tensor) -> bytes:
        check_kv(kv)
        encode, _, config = self._require()
        return bytes(encode(kv, config(quant=self.quant, **self.config)))

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        _, decode, _ = self._require()
        return decode(data, device=device)

    def size_breakdown(self, data: bytes) -> dict[str, int]:
        """Bytes a fetch moves at each stored resolution (a kvcodec file keeps every chunk at every
        resolution of its config; a fetch reads one), from `kvcodec.inspect`."""
        import kvcodec

        info = kvcodec.inspect(data)
        out = {"file": int(info["file_bytes"])}
        for res, r in info["resolutions"].items():
            out[f"at_{res}"] = int(r["bytes"])
        return out
