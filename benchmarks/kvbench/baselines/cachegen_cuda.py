"""CUDA decoder for the CacheGen-style rANS lanes: one GPU thread per (layer, K/V, channel) stream,
the way LMCache's CacheGen kernel spends the GPU's SMs on decoding. Built at first use with CuPy's
RawKernel (NVRTC); without CuPy or CUDA, `is_available()` is False and callers fall back to the
vectorised torch decoder (which also runs on CUDA, one kernel launch per symbol position).
"""

from __future__ import annotations

import functools
import warnings

import torch

from kvcodec.errors import CorruptStreamError

MAX_ALPHABET = 256

_SOURCE = r"""
#define MAXA %(maxa)d
extern "C" __global__
void rans_decode_lanes(const int* __restrict__ words, const long long* __restrict__ starts,
                       const long long* __restrict__ nwords, const int* __restrict__ freq,
                       const int A, const int n, const int lanes,
                       unsigned char* __restrict__ out, int* __restrict__ bad)
{
    const int lane = blockIdx.x * blockDim.x + threadIdx.x;
    if (lane >= lanes) return;
    unsigned int f[MAXA];
    unsigned int cum[MAXA + 1];
    const int* fl = freq + (long long)lane * A;
    cum[0] = 0;
    for (int s = 0; s < A; ++s) { f[s] = (unsigned int)fl[s]; cum[s + 1] = cum[s] + f[s]; }
    if (cum[A] != 65536u) { atomicOr(bad, 1); return; }
    long long p = starts[lane];
    const long long end = p + nwords[lane];
    if (nwords[lane] < 2) { atomicOr(bad, 1); return; }
    unsigned int x = ((unsigned int)words[p] << 16) | (unsigned int)words[p + 1];
    p += 2;
    for (int t = 0; t < n; ++t) {
        const unsigned int slot = x & 0xFFFFu;
        int s = 0;
        while (s < A - 1 && cum[s + 1] <= slot) ++s;
        out[(long long)t * lanes + lane] = (unsigned char)s;
        x = f[s] * (x >> 16) + slot - cum[s];
        if (x < 65536u) {
            const unsigned int w = (p < end) ? (unsigned int)words[p] : 0u;
            x = (x << 16) | w;
            ++p;
        }
    }
    if (p != end || x != 65536u) atomicOr(bad, 1);
}
"""


@functools.cache
def is_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _kernel():
    import cupy

    return cupy.RawKernel(_SOURCE % {"maxa": MAX_ALPHABET}, "rans_decode_lanes")


def decode_lanes(words: torch.Tensor, nwords: torch.Tensor, freq: torch.Tensor, n: int) -> torch.Tensor:
    """Same contract as kvbench.baselines.rans.decode, on a CUDA device: (lanes, n) symbols (uint8)."""
    import cupy

    lanes, A = freq.shape
    if A > MAX_ALPHABET:
        raise ValueError(f"alphabet of {A} symbols exceeds the kernel's {MAX_ALPHABET}")
    dev = freq.device
    nwords = nwords.to(dev, torch.int64).contiguous()
    if int(nwords.sum()) != words.numel():
        raise CorruptStreamError("rANS word counts do not match the words present")
    starts = (torch.cumsum(nwords, 0) - nwords).contiguous()
    words = words.to(dev, torch.int32).contiguous()
    freq32 = freq.to(dev, torch.int32).contiguous()
    out = torch.empty((n, lanes), dtype=torch.uint8, device=dev)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    threads = 128
    blocks = (lanes + threads - 1) // threads
    with cupy.cuda.Device(dev.index or 0):
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream)
        with stream:
            _kernel()(
                (blocks,),
                (threads,),
                (
                    cupy.asarray(words),
                    cupy.asarray(starts),
                    cupy.asarray(nwords),
                    cupy.asarray(freq32),
                    cupy.int32(A),
                    cupy.int32(n),
                    cupy.int32(lanes),
                    cupy.asarray(out),
                    cupy.asarray(bad),
                ),
            )
    if int(bad.item()):
        raise CorruptStreamError("rANS lanes do not end where their headers say (corrupt stream)")
    return out.T
