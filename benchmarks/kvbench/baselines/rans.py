"""A static-model rANS entropy coder vectorised across many independent streams ("lanes").

Each lane codes its own symbol sequence with its own frequency table, the way CacheGen codes
one stream per (layer, channel): lanes step through their symbols together, so the CPU runs a
few dozen torch operations per symbol position instead of a Python loop per symbol, and the
same code runs unchanged on a CUDA device. A CUDA kernel with one thread per lane decodes the
same format (kvbench.baselines.cachegen_cuda).

Format of one lane: 32-bit state (written as two 16-bit words, high first), then the 16-bit
renormalisation words in the order the decoder reads them. Parameters: probability precision
16 bits (frequencies sum to 2**16), state interval [2**16, 2**32), 16-bit output words. With these
each symbol emits or reads at most one word, and a lane of n symbols takes at most n + 2 words.
The decoder checks that every lane ends in the initial state having read exactly its words.

rANS (Duda, 2013) reaches the same compression as arithmetic/range coding with a static model
(within ~0.01 bit/symbol here); it replaces LMCache's bitwise 32-bit arithmetic coder only as
the entropy-coding engine.
"""

from __future__ import annotations

import contextlib

import torch

from kvcodec.errors import CorruptStreamError

PREC = 16
M = 1 << PREC  # frequencies of a lane sum to M
L = 1 << 16  # lower end of the state interval
MASK16 = 0xFFFF


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """The per-symbol loops run thousands of small ops; on the CPU, intra-op threads only add
    synchronisation (10x slower on a busy 2-core machine), so run them on one thread."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def normalize_freqs(counts: torch.Tensor, alphabet: torch.Tensor) -> torch.Tensor:
    """Frequencies summing to exactly M per lane, >= 1 for every symbol below the lane's alphabet
    size (so any symbol of the alphabet stays codable) and 0 above it.

    counts: (lanes, A) int64 symbol counts; alphabet: (lanes,) int64 alphabet sizes (<= A).
    """
    lanes, A = counts.shape
    counts = counts.to(torch.int64)
    alphabet = alphabet.to(torch.int64).to(counts.device)
    valid = torch.arange(A, device=counts.device).unsqueeze(0) < alphabet.unsqueeze(1)
    counts = torch.where(valid, counts, torch.zeros_like(counts))
    n = counts.sum(1, keepdim=True).clamp_(min=1)
    budget = (M - alphabet).unsqueeze(1)
    freq = torch.where(valid, 1 + counts * budget // n, torch.zeros_like(counts))
    deficit = M - freq.sum(1)
    top = counts.argmax(1)  # a valid symbol (index 0 when the lane is empty)
    freq[torch.arange(lanes, device=counts.device), top] += deficit
    return freq


def cumulative(freq: torch.Tensor) -> torch.Tensor:
    """(lanes, A) frequencies -> (lanes, A + 1) exclusive cumulative frequencies."""
    cum = torch.zeros(freq.shape[0], freq.shape[1] + 1, dtype=torch.int64, device=freq.device)
    cum[:, 1:] = torch.cumsum(freq, 1)
    return cum


def encode(symbols: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Code each lane's symbols with its table.

    symbols: (lanes, n) integers, every one with a nonzero frequency in its lane's table.
    freq: (lanes, A) int64 frequencies from normalize_freqs.
    Returns (words, nwords): the lanes' words concatenated in lane order as int32 values in
    [0, 65535], and the word count of each lane (int64).
    """
    with _one_thread(symbols.device):
        return _encode(symbols, freq)


def _encode(symbols: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lanes, n = symbols.shape
    dev = symbols.device
    sym = symbols.to(torch.int64)
    f_all = freq.gather(1, sym)  # (lanes, n)
    c_all = cumulative(freq)[:, :-1].gather(1, sym)
    if bool((f_all == 0).any()):
        raise ValueError("a symbol has zero frequency in its lane's table")
    x = torch.full((lanes,), L, dtype=torch.int64, device=dev)
    # Words in emission order. Every lane writes its low half at its pointer each step and only
    # advances the pointer when it really emits, so no masked scatter is needed (one spare column).
    emitted = torch.zeros((lanes, n + 1), dtype=torch.int64, device=dev)
    ptr = torch.zeros(lanes, dtype=torch.int64, device=dev)
    rows = torch.arange(lanes, device=dev)
    for t in range(n - 1, -1, -1):
        f = f_all[:, t]
        emit = x >= (f << 16)
        emitted[rows, ptr] = x & MASK16
        ptr += emit.to(torch.int64)
        x = torch.where(emit, x >> 16, x)
        x = ((x // f) << 16) + (x % f) + c_all[:, t]
    # Decoder reads: state high, state low, then the emitted words last-first.
    nwords = ptr + 2
    width = n + 2
    j = torch.arange(width, device=dev).unsqueeze(0)
    src = (ptr.unsqueeze(1) - 1 - (j - 2)).clamp(min=0, max=max(n - 1, 0))
    table = emitted.gather(1, src) if n else torch.zeros((lanes, width), dtype=torch.int64, device=dev)
    table[:, 0] = x >> 16
    table[:, 1] = x & MASK16
    mask = j < nwords.unsqueeze(1)
    return table[mask].to(torch.int32), nwords


def decode(words: torch.Tensor, nwords: torch.Tensor, freq: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of encode: (lanes, n) int64 symbols. Raises CorruptStreamError when the words do not
    form valid lanes of n symbols under these tables."""
    with _one_thread(freq.device):
        return _decode(words, nwords, freq, n)


def _decode(words: torch.Tensor, nwords: torch.Tensor, freq: torch.Tensor, n: int) -> torch.Tensor:
    lanes, A = freq.shape
    dev = freq.device
    words = words.to(torch.int64).to(dev)
    nwords = nwords.to(torch.int64).to(dev)
    if int(nwords.sum()) != words.numel() or bool((nwords < 2).any()):
        raise CorruptStreamError("rANS word counts do not match the words present")
    if n and bool((freq.sum(1) != M).any()):
        raise CorruptStreamError("rANS frequency table does not sum to 2**16")
    cum = cumulative(freq)
    upper = cum[:, 1:].contiguous()  # (lanes, A): symbol s covers [cum[s], cum[s+1])
    start = torch.cumsum(nwords, 0) - nwords
    end = start + nwords
    last = max(words.numel() - 1, 0)
    x = (words[start] << 16) | words[start + 1]
    pos = start + 2
    out = torch.empty((lanes, n), dtype=torch.int64, device=dev)
    for t in range(n):
        slot = x & MASK16
        s = torch.searchsorted(upper, slot.unsqueeze(1), right=True).squeeze(1).clamp_(max=A - 1)
        out[:, t] = s
        f = freq.gather(1, s.unsqueeze(1)).squeeze(1)
        c = cum.gather(1, s.unsqueeze(1)).squeeze(1)
        x = f * (x >> 16) + slot - c
        need = x < L
        w = words[pos.clamp(max=last)]
        x = torch.where(need, (x << 16) | w, x)
        pos = pos + need.to(torch.int64)
    if bool((pos != end).any()) or bool((x != L).any()):
        raise CorruptStreamError("rANS lanes do not end where their headers say (corrupt stream)")
    return out
