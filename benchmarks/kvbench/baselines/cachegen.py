"""CacheGen-style codec (Liu et al., SIGCOMM'24), modelled on LMCache's `cachegen` serializer.

What it does, as LMCache (v0.5.x) does it:

* Per-token absmax quantization: for every (layer, K/V, token) the maximum |x| over all
  kv_heads * head_dim channels is kept (in the KV dtype) and the values become integers
  q = round(x * C / max + C) in [0, 2C], with C = bins // 2 - 1.
* Layer-dependent bins (LMCache's defaults for a model it has no entry for): with 10 or more
  layers, keys use 32 bins in layers 0-9 and 16 after, values 32 bins in layers 0-1 and 16
  after; a model with fewer than 10 layers uses 32 everywhere.
* Tokens are coded in chunks of 256 (LMCache's CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK); within a chunk
  every (layer, K/V, channel) is one independent stream with its own symbol frequency table
  (16-bit precision) computed from that chunk, and the per-stream byte lengths are stored so a
  GPU decodes one stream per thread.

Differences from LMCache (see benchmarks/BASELINES.md): the entropy coder is rANS with 16-bit
words (kvbench.baselines.rans) rather than LMCache's bitwise 32-bit arithmetic coder (same model,
same compression to within a few bits per stream); frequency tables hold only the layer's
alphabet (31 or 15 entries) rather than 33 int16 CDF entries; stream lengths are u16 rather than
int32; the container is a checked binary layout rather than a pickle. `table="zstd"` additionally
zstd-compresses the side information (tables, lengths, maxima) ("cachegen-compact").

Error bound: |x - decode(encode(x))| <= max / (2C) per (layer, K/V, token), plus the rounding of
the output dtype.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from kvbench.baselines import rans
from kvbench.baselines.base import BITS_VIEW, check_kv, pack, unpack
from kvcodec.errors import ConfigError, CorruptStreamError

CHUNK_TOKENS = 256  # LMCache: CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK


def default_bins(n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """LMCache's default (key_bins, value_bins) per layer for a model of n_layers layers."""
    if n_layers < 10:
        return (32,) * n_layers, (32,) * n_layers
    k = tuple(32 if i < 10 else 16 for i in range(n_layers))
    v = tuple(32 if i < 2 else 16 for i in range(n_layers))
    return k, v


# --- the quantization math (pure functions; property-tested) ----------------------------------------


def half_range(bins: torch.Tensor) -> torch.Tensor:
    """C = bins // 2 - 1: integers run over [0, 2C], i.e. 2C + 1 = bins - 1 symbols."""
    return bins.to(torch.int64) // 2 - 1


def token_absmax(kv: torch.Tensor) -> torch.Tensor:
    """(layers, 2, tokens, heads, dim) -> (layers, 2, tokens): max |x| over all channels of a token,
    in the KV dtype (exact: a maximum of values of that dtype)."""
    return kv.abs().amax(dim=(3, 4))


def quantize(kv: torch.Tensor, maxes: torch.Tensor, bins_lk: torch.Tensor) -> torch.Tensor:
    """Integers q in [0, 2C] (uint8, shape of kv). bins_lk: (layers, 2) bins of each layer's K and V."""
    c = half_range(bins_lk).to(torch.float32).to(kv.device)[:, :, None, None, None]
    m = maxes.float().to(kv.device)[:, :, :, None, None]
    safe = torch.where(m > 0, m, torch.ones_like(m))
    q = torch.round(kv.float() * (c / safe) + c)
    q = torch.where(m > 0, q, c.expand_as(q))
    return torch.minimum(q.clamp_(min=0), 2 * c).to(torch.uint8)


def dequantize(q: torch.Tensor, maxes: torch.Tensor, bins_lk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    c = half_range(bins_lk).to(torch.float32).to(q.device)[:, :, None, None, None]
    m = maxes.float().to(q.device)[:, :, :, None, None]
    return ((q.float() - c) / c * m).to(dtype)


def error_bound(maxes: torch.Tensor, bins_lk: torch.Tensor) -> torch.Tensor:
    """Half a quantization step per (layer, K/V, token): max / (2C)."""
    c = half_range(bins_lk).to(torch.float32)[:, :, None]
    return maxes.float() / (2 * c)


# --- container ------------------------------------------------------------------------------------------

# chunk_tokens, table mode, n_layers; then per layer key bins and value bins (u8 each)
_PARAMS = struct.Struct("<IBH")
_TABLE_MODES = {"raw": 0, "zstd": 1}


@dataclass
class _Chunk:
    start: int
    n: int


def _chunks(n_tokens: int, chunk: int) -> list[_Chunk]:
    return [_Chunk(s, min(chunk, n_tokens - s)) for s in range(0, n_tokens, chunk)]


def _lanes(q: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """(layers, 2, tokens, H, D) -> (layers * 2 * H * D, n) symbols of one token chunk, lane order
    (layer, K/V, channel)."""
    Lr, _, _, H, D = q.shape
    return q[:, :, start : start + n].permute(0, 1, 3, 4, 2).reshape(Lr * 2 * H * D, n)


class CacheGenCodec:
    """CacheGen-style lossy codec. Encode on the CPU (or any torch device); decode on the CPU with
    vectorised torch code, or on CUDA with a one-thread-per-stream kernel when CuPy is present."""

    lossless = False

    def __init__(
        self,
        name: str = "cachegen",
        key_bins: tuple[int, ...] | None = None,
        value_bins: tuple[int, ...] | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        table: str = "raw",
    ) -> None:
        if table not in _TABLE_MODES:
            raise ConfigError(f"table must be one of {sorted(_TABLE_MODES)}; got {table!r}")
        if not 1 <= chunk_tokens <= 65533:
            raise ConfigError(f"chunk_tokens must be in 1..65533; got {chunk_tokens}")
        for b in (key_bins or ()) + (value_bins or ()):
            if not 4 <= b <= 254 or b % 2:
                raise ConfigError(f"bins must be even and in 4..254; got {b}")
        self.name = name
        self.key_bins = key_bins
        self.value_bins = value_bins
        self.chunk_tokens = chunk_tokens
        self.table = table

    @staticmethod
    def is_available() -> bool:
        return True

    def bins_for(self, n_layers: int) -> torch.Tensor:
        """(layers, 2) bins of each layer's K and V."""
        dk, dv = default_bins(n_layers)
        k = self.key_bins or dk
        v = self.value_bins or dv
        if len(k) != n_layers or len(v) != n_layers:
            raise ConfigError(f"bins given for {len(k)}/{len(v)} layers, KV has {n_layers}")
        return torch.tensor([k, v], dtype=torch.int64).T.contiguous()

    # -- encode --

    def encode(self, kv: torch.Tensor) -> bytes:
        check_kv(kv)
        Lr, _, T, H, D = kv.shape
        bins = self.bins_for(Lr)
        kv = kv.detach()
        maxes = token_absmax(kv)
        q = quantize(kv, maxes, bins)
        alphabet_lk = (2 * half_range(bins) + 1).to(kv.device)  # (layers, 2)
        lane_alpha = alphabet_lk[:, :, None].expand(Lr, 2, H * D).reshape(-1)
        A = int(alphabet_lk.max())
        tables, lengths, words = [], [], []
        for ch in _chunks(T, self.chunk_tokens):
            sym = _lanes(q, ch.start, ch.n).to(torch.int64)
            counts = torch.zeros(sym.shape[0], A, dtype=torch.int64, device=sym.device)
            counts.scatter_add_(1, sym, torch.ones_like(sym))
            freq = rans.normalize_freqs(counts, lane_alpha)
            w, nw = rans.encode(sym, freq)
            tables.append(_pack_tables(freq, lane_alpha))
            lengths.append(nw.cpu().numpy().astype("<u2"))
            words.append(w.cpu().numpy().astype("<u2"))
        side = (
            b"".join(tables)
            + b"".join(x.tobytes() for x in lengths)
            + maxes.contiguous().cpu().view(BITS_VIEW[kv.dtype]).numpy().tobytes()
        )
        if self.table == "zstd":
            import zstandard

            side = zstandard.ZstdCompressor(level=19).compress(side)
        params = (
            _PARAMS.pack(self.chunk_tokens, _TABLE_MODES[self.table], Lr) + bins.T.numpy().astype(np.uint8).tobytes()
        )
        body = b"".join(x.tobytes() for x in words)
        return pack(self.name, kv, params + struct.pack("<Q", len(side)) + side + body)

    # -- decode --

    def parse(self, data: bytes):
        """Check the container and split it: (header, bins, maxes, chunks) where chunks is a list of
        (start, n, freq (lanes, A) int64, nwords (lanes,), words (int32 tensor))."""
        header, bins, maxes, chunks, freq, nwords, words = self._parse_batched(data)
        lanes = freq.shape[0] // len(chunks)
        ends = torch.cumsum(nwords.reshape(len(chunks), lanes).sum(1), 0).tolist()
        out = []
        for i, ch in enumerate(chunks):
            w0 = ends[i - 1] if i else 0
            sl = slice(i * lanes, (i + 1) * lanes)
            out.append((ch.start, ch.n, freq[sl], nwords[sl], words[w0 : ends[i]]))
        return header, bins, maxes, out

    def _parse_batched(self, data: bytes, device: str | torch.device = "cpu"):
        """(header, bins, maxes, chunks, freq, nwords, words): the tables, word counts and words of
        all chunks concatenated in chunk order ((chunks * lanes, A), (chunks * lanes,), words),
        unpacked on `device` (raw bytes cross to it in two copies)."""
        header, payload = unpack(data, self.name)
        Lr, _, T, H, D = header.shape
        try:
            chunk_tokens, mode, n_layers = _PARAMS.unpack_from(payload, 0)
            off = _PARAMS.size
            if n_layers != Lr or chunk_tokens < 1 or mode not in _TABLE_MODES.values():
                raise CorruptStreamError("CacheGen parameters disagree with the header")
            bins = torch.from_numpy(np.frombuffer(payload[off : off + 2 * Lr], np.uint8).copy()).to(torch.int64)
            bins = bins.reshape(2, Lr).T.contiguous()
            off += 2 * Lr
            if bool((bins < 4).any()) or bool((bins % 2 != 0).any()):
                raise CorruptStreamError("CacheGen bins are invalid")
            (side_len,) = struct.unpack_from("<Q", payload, off)
            off += 8
            side = bytes(payload[off : off + side_len])
            if len(side) != side_len:
                raise CorruptStreamError("CacheGen side information is truncated")
            off += side_len
        except (struct.error, RuntimeError) as e:
            raise CorruptStreamError(f"CacheGen payload is too short: {e}") from e
        alphabet_lk = 2 * half_range(bins) + 1
        lane_alpha = alphabet_lk[:, :, None].expand(Lr, 2, H * D).reshape(-1)
        A = int(alphabet_lk.max())
        lanes = lane_alpha.numel()
        per_table = int(lane_alpha.sum()) * 2
        chunks = _chunks(T, chunk_tokens)
        nch = len(chunks)
        expect = nch * (per_table + 2 * lanes) + Lr * 2 * T * header.itemsize
        if mode == _TABLE_MODES["zstd"]:
            import zstandard

            try:
                side = zstandard.ZstdDecompressor().decompress(side, max_output_size=expect)
            except zstandard.ZstdError as e:
                raise CorruptStreamError(f"CacheGen side information does not decode: {e}") from e
        if len(side) != expect:
            raise CorruptStreamError(f"CacheGen side information has {len(side)} bytes, expected {expect}")
        dev = torch.device(device)
        tab_end = nch * per_table
        len_end = tab_end + 2 * nch * lanes
        side_t = torch.from_numpy(np.frombuffer(side, np.uint8, count=len_end).copy()).to(dev)
        vals = _u16(side_t[:tab_end])
        mask = (torch.arange(A, device=dev).unsqueeze(0) < lane_alpha.to(dev).unsqueeze(1)).repeat(nch, 1)
        freq = torch.zeros((nch * lanes, A), dtype=torch.int64, device=dev)
        freq[mask] = vals
        nwords = _u16(side_t[tab_end:len_end])
        mraw = np.frombuffer(side, np.uint8, offset=len_end).copy()
        maxes = torch.from_numpy(mraw).view(BITS_VIEW[header.dtype]).view(header.dtype).reshape(Lr, 2, T)
        body_len = len(payload) - off
        total = int(nwords.sum())
        if body_len != 2 * total:
            raise CorruptStreamError(f"CacheGen streams hold {body_len} bytes, lengths say {2 * total}")
        body = torch.from_numpy(np.frombuffer(payload, np.uint8, offset=off).copy()).to(dev)
        words = _u16(body).to(torch.int32)
        return header, bins, maxes, chunks, freq, nwords, words

    def size_breakdown(self, data: bytes) -> dict[str, int]:
        """Bytes of each part of an encoded KV: entropy-coded streams, frequency tables, stream
        lengths, per-token maxima (the last three together when the side information is zstd'd)."""
        header, payload = unpack(data, self.name)
        Lr, _, T, H, D = header.shape
        _, mode, _ = _PARAMS.unpack_from(payload, 0)
        off = _PARAMS.size + 2 * Lr
        (side_len,) = struct.unpack_from("<Q", payload, off)
        out = {"container": len(data) - len(payload), "params": off + 8, "streams": len(payload) - off - 8 - side_len}
        if mode == _TABLE_MODES["zstd"]:
            out["side_zstd"] = side_len
            return out
        _, bins, _, chunks = self.parse(data)
        out["tables"] = sum(int((f > 0).sum()) * 2 for _, _, f, _, _ in chunks)
        out["lengths"] = sum(2 * nw.numel() for _, _, _, nw, _ in chunks)
        out["maxes"] = Lr * 2 * T * header.itemsize
        return out

    def decode_symbols(self, data: bytes, device: str | torch.device = "cpu"):
        """(header, bins, maxes, q) with q the (layers, 2, tokens, H, D) uint8 integers on device.

        All full chunks are decoded in one pass (one kernel launch on CUDA), the shorter last chunk
        in a second one; tables and words move to the device in one copy each."""
        dev = torch.device(device)
        header, bins, maxes, chunks, freq, nwords, words = self._parse_batched(data, dev)
        Lr, _, T, H, D = header.shape
        lanes = freq.shape[0] // len(chunks)
        decode = rans.decode
        if dev.type == "cuda":
            from kvbench.baselines import cachegen_cuda

            if cachegen_cuda.is_available():
                decode = cachegen_cuda.decode_lanes
        q = torch.empty((Lr, 2, T, H, D), dtype=torch.uint8, device=dev)
        groups = [(0, len(chunks) - 1), (len(chunks) - 1, len(chunks))]
        if chunks[-1].n == chunks[0].n:
            groups = [(0, len(chunks))]
        w_start = 0
        for c0, c1 in groups:
            if c1 <= c0:
                continue
            n = chunks[c0].n
            nw = nwords[c0 * lanes : c1 * lanes]
            w_end = w_start + int(nw.sum())
            sym = decode(words[w_start:w_end], nw, freq[c0 * lanes : c1 * lanes], n)
            w_start = w_end
            # (chunks, layers, 2, H, D, n) -> (layers, 2, chunks * n, H, D)
            sym = sym.reshape(c1 - c0, Lr, 2, H, D, n).permute(1, 2, 0, 5, 3, 4).reshape(Lr, 2, (c1 - c0) * n, H, D)
            q[:, :, chunks[c0].start : chunks[c0].start + (c1 - c0) * n] = sym.to(torch.uint8)
        return header, bins, maxes, q

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        header, bins, maxes, q = self.decode_symbols(data, device)
        c = half_range(bins).to(q.device)
        if bool((q > (2 * c)[:, :, None, None, None]).any()):
            raise CorruptStreamError("CacheGen stream decoded to symbols outside the layer's alphabet")
        return dequantize(q, maxes.to(q.device), bins.to(q.device), header.dtype).contiguous()


def _u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian u16 values of a uint8 tensor (even length), as int64, on its device."""
    return b.view(torch.int16).to(torch.int64) & 0xFFFF


def _pack_tables(freq: torch.Tensor, lane_alpha: torch.Tensor) -> bytes:
    """Frequencies of each lane's alphabet, u16, lanes concatenated. A frequency of 65536 (the whole
    range) cannot occur: every alphabet has >= 3 symbols, each with frequency >= 1."""
    A = freq.shape[1]
    mask = torch.arange(A, device=freq.device).unsqueeze(0) < lane_alpha.to(freq.device).unsqueeze(1)
    return freq[mask].cpu().numpy().astype("<u2").tobytes()
