"""The rANS decoder on the SMs: one Triton program per block, one lane per thread.

Every stream of a batch (one per chunk) is checked on the host (rans.parse: table sums, sizes),
their blocks gathered into one upload, the decode tables built on the device (a few torch ops),
then one launch decodes every block of every chunk into one uint8 buffer, chunk after chunk.
Each program runs its block's lanes step by step: table lookup, state update, and for the lanes
whose state fell below 2^16 the next 16-bit word of the block's stream, found by an exclusive
prefix sum over the lanes. A block that reads past its words, leaves words unread or ends a lane
off the encoder's start state sets its error count; the caller turns a non-zero count into a
CorruptStreamError (a stream's CRC already caught accidental damage before this).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvcodec.codecs.transform_ans.rans import PROB_BITS, PROB_SCALE, STATE_LOW, AnsParams, AnsStream
from kvcodec.restore import transform_kernels
from kvcodec.restore.triton_restore import available as available  # where the decoder runs: CUDA and Triton
from kvcodec.restore.triton_restore import triton_modules


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def rans_decode(meta_ptr, states_ptr, table_ptr, words_ptr, out_ptr, err_ptr, LANES: tl.constexpr):
        b = tl.program_id(0)
        lanes = tl.arange(0, LANES)
        out0 = tl.load(meta_ptr + b * 4)
        pos = tl.load(meta_ptr + b * 4 + 1)
        end = pos + tl.load(meta_ptr + b * 4 + 2)
        n = tl.load(meta_ptr + b * 4 + 3)
        x = tl.load(states_ptr + b * LANES + lanes).to(tl.int64) & 0xFFFFFFFF
        tbase = table_ptr + b * 4096
        bad = tl.zeros([LANES], dtype=tl.int32)
        steps = (n + LANES - 1) // LANES
        for s in range(0, steps):
            i = s * LANES + lanes
            act = i < n
            e = tl.load(tbase + (x & 4095)).to(tl.int64)
            nx = (((e >> 12) & 4095) + 1) * (x >> 12) + (e & 4095)
            x = tl.where(act, nx, x)
            need = act & (x < 65536)
            needi = need.to(tl.int64)
            at = pos + tl.cumsum(needi, 0) - needi
            inside = at < end
            w = tl.load(words_ptr + at, mask=need & inside, other=0).to(tl.int64) & 0xFFFF
            x = tl.where(need, (x << 16) | w, x)
            bad += (need & (at >= end)).to(tl.int32)
            pos += tl.sum(needi, 0)
            tl.store(out_ptr + out0 + i, ((e >> 24) & 255).to(tl.uint8), mask=act)
        bad += (x != 65536).to(tl.int32)
        tl.store(err_ptr + b, tl.sum(bad, 0) + (pos != end).to(tl.int32))

    return rans_decode


def device_tables(freqs: torch.Tensor) -> torch.Tensor:
    """(B, 4096) int32 decode tables (rans.decode_table's layout) from (B, 256) frequencies, on their device."""
    f = freqs.to(torch.int64)
    incl = torch.cumsum(f, dim=1)
    slots = torch.arange(PROB_SCALE, device=f.device, dtype=torch.int64)
    sym = torch.searchsorted(incl, slots.expand(f.shape[0], -1).contiguous(), right=True)
    fs = torch.gather(f, 1, sym)
    cs = torch.gather(incl - f, 1, sym)
    e = (sym << 24) | ((fs - 1) << 12) | (slots[None] - cs)
    return torch.where(e >= 1 << 31, e - (1 << 32), e).to(torch.int32)


def _align8(n: int) -> int:
    return -(-n // 8) * 8


def pack_batch(streams: list[AnsStream], counts: list[int], params: AnsParams) -> tuple[np.ndarray, dict]:
    """Every block of the batch in one host buffer (meta, states, freqs, words; 8-byte aligned parts)."""
    metas, offset, word_base = [], 0, 0
    for st, count in zip(streams, counts, strict=True):
        nb = st.states.shape[0]
        first = np.arange(nb, dtype=np.int64) * params.block
        metas.append(
            np.stack(
                [offset + first, word_base + st.word_starts, st.word_counts, np.minimum(params.block, count - first)],
                axis=1,
            )
        )
        offset, word_base = offset + count, word_base + int(st.words.size)
    parts = {
        "meta": np.concatenate(metas).astype(np.int64),
        "states": np.concatenate([s.states for s in streams]).view(np.int32),
        "freqs": np.concatenate([s.freqs for s in streams]).astype(np.int16),
        "words": np.concatenate([s.words for s in streams]).view(np.int16),
    }
    sizes = {k: _align8(v.nbytes) for k, v in parts.items()}
    buf = np.zeros(max(8, sum(sizes.values())), dtype=np.uint8)
    layout, at = {}, 0
    for k, v in parts.items():
        buf[at : at + v.nbytes] = v.reshape(-1).view(np.uint8)
        layout[k] = (at, v.dtype, v.shape)
        at += sizes[k]
    return buf, layout | {"total": offset}


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.int16): torch.int16}


def decode_batch(
    streams: list[AnsStream], counts: list[int], params: AnsParams, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The symbols of every stream back to back ((sum counts,) uint8 on `device`) and each block's
    error count ((blocks,) int32; all zero for a stream that decoded to its announced end). Work is
    queued on the device's current stream; nothing here waits for it."""
    buf, layout = pack_batch(streams, counts, params)
    host = torch.from_numpy(buf)
    dev = transform_kernels.upload(host, device)

    def part(name: str) -> torch.Tensor:
        at, dtype, shape = layout[name]
        n = int(np.prod(shape)) * dtype.itemsize
        return dev[at : at + n].view(_TORCH[dtype]).view(shape)

    meta, states, freqs, words = part("meta"), part("states"), part("freqs"), part("words")
    blocks = meta.shape[0]
    out = torch.empty(layout["total"], dtype=torch.uint8, device=device)
    err = torch.empty(blocks, dtype=torch.int32, device=device)
    tables = device_tables(freqs.to(torch.int32))
    if words.numel() == 0:  # a pointer must point somewhere
        words = torch.zeros(1, dtype=torch.int16, device=device)
    _kernel()[(blocks,)](meta, states, tables, words, out, err, LANES=params.lanes)
    return out, err


assert PROB_BITS == 12 and STATE_LOW == 1 << 16  # the kernel's constants
