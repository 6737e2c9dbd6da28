"""HevcCodec: kvcodec's own ChunkCodec, KV chunks as lossless HEVC (hevc_encode / hevc_decode).

Decode options (none changes the bytes, so none changes `id`): the best decoder for the target's
device (NVDEC on CUDA where present, else FFmpeg on the CPU), a given video decoder shared by
every call, or an NvdecPool whose worker processes decode and restore whole chunks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcodec.codecs.base import ChunkInfo, EncodedChunk, Target
from kvcodec.codecs.hevc.decode import chunk_parts, decode_chunk_blob, inspect_chunk_blob, sample_decoders
from kvcodec.codecs.hevc.encode import default_encoder, encode_chunks
from kvcodec.config import SAMPLE_CODER_USES, CodecConfig
from kvcodec.container.format import FORMAT_VERSION, PLAIN, check_chunk_config
from kvcodec.errors import ConfigError, FormatError
from kvcodec.plugins import check_arguments
from kvcodec.restore import RESTORERS

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(CodecConfig))


def config_digest(config: CodecConfig) -> str:
    return hashlib.blake2b(json.dumps(config.to_dict(), sort_keys=True).encode(), digest_size=8).hexdigest()


class HevcCodec:
    """KV chunks as lossless HEVC video, configured by a CodecConfig.

    decoder: a video decoder used by every decode (e.g. ``NvdecPool(...).decoder()``); None picks
        the best one for the target's device per call. pool: an NvdecPool; chunks restored into
        tensors on its device are decoded and restored inside its workers. restore: the frame
        restorer ("auto", "torch", "triton"). encoder: a video encoder (default: NVENC where the
        GPU has one, else x265; an NVENC session that fails falls back to x265)."""

    encodes_on_device = True  # KV on a GPU is quantized and packed there (hevc_encode)

    def __init__(
        self,
        config: CodecConfig = CodecConfig(),
        *,
        decoder: Any = None,
        pool: Any = None,
        restore: str = "auto",
        encoder: Any = None,
    ) -> None:
        if not isinstance(config, CodecConfig):
            raise ConfigError(f"HevcCodec needs a CodecConfig; got {type(config).__name__}")
        if decoder is not None and pool is not None:
            raise ConfigError("give HevcCodec a decoder or a pool, not both")
        if restore not in RESTORERS:
            raise ConfigError(f"restore must be one of {', '.join(RESTORERS)}; got {restore!r}")
        if pool is not None and not all(hasattr(pool, a) for a in ("device", "restore_blobs")):
            raise ConfigError(f"pool must be an NvdecPool or NvcuvidThreads; got {type(pool).__name__}")
        self.config = config
        self.decoder = decoder
        self.pool = pool
        self.restore = restore
        self._encoder = encoder
        self._lock = threading.Lock()
        self.id = hevc_id(config)

    @classmethod
    def from_options(cls, config: CodecConfig | dict | None = None, **options: Any) -> HevcCodec:
        """make_codec("hevc", quant="int4", chunk_tokens=128, pool=pool): CodecConfig fields and
        decode options by keyword (or a whole `config`)."""
        fields = {k: options.pop(k) for k in list(options) if k in _CONFIG_FIELDS}
        if isinstance(config, dict):
            config = CodecConfig.from_dict(config)
        config = dataclasses.replace(config or CodecConfig(), **fields) if fields else (config or CodecConfig())
        check_arguments(cls, "codec 'hevc'", config, **options)
        return cls(config, **options)

    def with_config(self, config: CodecConfig) -> HevcCodec:
        """This codec with another configuration and the same decode options."""
        return HevcCodec(config, decoder=self.decoder, pool=self.pool, restore=self.restore, encoder=self._encoder)

    @property
    def chunk_tokens(self) -> int:
        return self.config.chunk_tokens

    @property
    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return self.config.resolutions

    @property
    def encoder(self) -> Any:
        with self._lock:
            if self._encoder is None:
                self._encoder = default_encoder(self.config)
            return self._encoder

    def encode_chunks(
        self,
        kv: torch.Tensor,
        *,
        first_chunk_index: int = 0,
        keys: Sequence[str] | None = None,
        on_chunk: Callable[[EncodedChunk], None] | None = None,
    ) -> list[EncodedChunk]:
        return encode_chunks(
            kv, self.config, encoder=self.encoder, on_chunk=on_chunk, first_chunk_index=first_chunk_index, keys=keys
        )

    def inspect_chunk(self, blob: bytes | memoryview) -> ChunkInfo:
        h = inspect_chunk_blob(blob)
        if h.quant not in (self.config.quant, PLAIN) or tuple(h.resolution) not in self.config.resolutions:
            raise FormatError(
                f"chunk blob is {h.quant} at {h.resolution}; this codec writes "
                f"{self.config.quant} at {list(self.config.resolutions)}"
            )
        check_chunk_config(h, self.config)  # bit widths: a header edited with its checksums recomputed
        return ChunkInfo(
            h.chunk_index, h.start_token, h.tokens, h.layers, h.kv_heads, h.head_dim, h.dtype, "hevc", h.key
        )

    def warm_up(self, device: torch.device | str, dtype: torch.dtype = torch.float16) -> None:
        """Compile the fused frame restorer for outputs of `dtype` now (CUDA with Triton, integer
        modes), so that the first fetch a server runs does not wait for it (codecs.base.WarmUp);
        pool workers warm their own process up when they start."""
        from kvcodec.restore import triton_restore

        if torch.device(device).type == "cuda" and self.restore != "torch" and triton_restore.available():
            triton_restore.warm_up(device, (dtype,))

    def decode_chunk(self, blob: bytes | memoryview, out: Target) -> Target:
        if self.pool is not None and out.device == self.pool.device:
            from kvcodec.codecs.hevc.pool import restore_in_pool

            parts = chunk_parts(blob, out)
            restore_in_pool(self.pool, [b for b, _ in parts], [t for _, t in parts], restore=self.restore)
            return out
        return decode_chunk_blob(blob, out=out, decoder=self.decoder, restore=self.restore)

    @property
    def codes_video(self) -> bool:
        """Whether some of this codec's chunks may hold a video (a driven fetch of them borrows NVDEC sessions);
        its id covers sample_coder, so a zstd codec's chunks hold none."""
        return "hevc" in SAMPLE_CODER_USES[self.config.sample_coder]

    def decoder_name(self, device: str | torch.device) -> str:
        """The decoders a decode into a target on `device` uses: zstd-host for zstd'd samples, the
        video decoder for video ("auto" codes either: both are named)."""
        video = None
        if self.pool is not None and torch.device(device) == self.pool.device:
            video = f"{getattr(self.pool, 'name', 'nvdec-pool')}:{self.pool.workers}"
        elif self.decoder is not None:
            video = str(getattr(self.decoder, "name", type(self.decoder).__name__))
        return sample_decoders(SAMPLE_CODER_USES[self.config.sample_coder], device, video)

    def __repr__(self) -> str:
        return f"HevcCodec({self.config!r}, id={self.id!r})"


def hevc_id(config: CodecConfig) -> str:
    """The id of the HEVC codec with `config` (format version and every setting)."""
    return f"hevc-v{FORMAT_VERSION}-{config_digest(config)}"
