"""Interleaved rANS for byte symbols, laid out for decoding on a GPU's SMs (pure numpy).

The symbols are cut into blocks of `block` symbols; each block has its own static frequency
table (12-bit precision: the frequencies of the symbols present sum to 4096) and `lanes`
independent 32-bit states. Symbol i of a block belongs to lane i % lanes, step i // lanes, so a
GPU decodes a block with one thread per lane, all blocks at once. States live in [2^16, 2^32);
renormalization moves one 16-bit word at a time (at most one per symbol). A block's lanes share
one word stream, read in decode order (step, then lane): a decoder finds each lane's next word
from the exclusive prefix sum of the lanes that need one at that step.

Stream bytes (little-endian), for nb = ceil(count / block) blocks:
    states       uint32 [nb, lanes]   the decoder's initial states (the encoder's final ones)
    word_counts  uint32 [nb]          16-bit words of each block
    present      uint8  [nb, 32]      bitmap of the symbols each block's table holds (bit k of byte j: 8j + k)
    freqs        uint16 [sum present] their frequencies, block by block, symbol order
    words        uint16 [sum word_counts]
Encoding starts every lane at state 2^16, so a decoder that ends a block anywhere else, or
with words left or missing, has read a damaged stream.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvcodec.errors import ConfigError, CorruptStreamError

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 16  # L: states live in [L, 2^32)
WORD_BITS = 16
ALPHABET = 256
X_MAX_SHIFT = 16 - PROB_BITS + WORD_BITS  # a state is renormalized before coding s when >= freq(s) << 20


@dataclasses.dataclass(frozen=True)
class AnsParams:
    """How a stream is cut: symbols per block (each with its own table) and lanes per block."""

    block: int = 1 << 16
    lanes: int = 32

    def __post_init__(self) -> None:
        if not (1 <= self.lanes <= 1024 and self.lanes & (self.lanes - 1) == 0):
            raise ConfigError(f"lanes must be a power of two in 1..1024; got {self.lanes}")
        if not (self.lanes <= self.block <= 1 << 24 and self.block % self.lanes == 0):
            raise ConfigError(f"block must be a multiple of lanes={self.lanes} up to 2^24; got {self.block}")

    def blocks(self, count: int) -> int:
        return -(-count // self.block)


@dataclasses.dataclass(frozen=True, eq=False)
class AnsStream:
    """A parsed, checked stream: dense tables and the words, ready for a decoder."""

    freqs: np.ndarray  # (nb, 256) uint32, every row sums to PROB_SCALE
    states: np.ndarray  # (nb, lanes) uint32, each >= STATE_LOW
    word_counts: np.ndarray  # (nb,) int64
    words: np.ndarray  # (sum word_counts,) uint16

    @property
    def word_starts(self) -> np.ndarray:
        """(nb,) index of each block's first word."""
        return np.concatenate([[0], np.cumsum(self.word_counts)[:-1]]).astype(np.int64)


def normalize_freqs(counts: np.ndarray) -> np.ndarray:
    """(256,) uint32 frequencies summing to PROB_SCALE, > 0 exactly where counts > 0, close to
    counts' proportions; counts must not be all zero."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total <= 0 or counts.shape != (ALPHABET,) or int(counts.min()) < 0:
        raise ConfigError("normalize_freqs needs 256 non-negative counts, not all zero")
    f = np.where(counts > 0, np.maximum(1, (counts * PROB_SCALE) // total), 0)
    diff = PROB_SCALE - int(f.sum())
    if diff > 0:  # the floors lost some: give them to the most frequent symbol
        f[int(np.argmax(counts))] += diff
    while diff < 0:  # the minimum of 1 overshot (many rare symbols): take from the largest, keeping >= 1
        i = int(np.argmax(f))
        take = min(-diff, int(f[i]) - 1)
        f[i] -= take
        diff += take
    return f.astype(np.uint32)


def _padded(symbols: np.ndarray, params: AnsParams) -> tuple[np.ndarray, np.ndarray]:
    """(nb, steps, lanes) symbols (0 past the end) and the mask of real ones."""
    n, nb = symbols.size, params.blocks(symbols.size)
    steps = -(-min(n, params.block) // params.lanes)  # a single short block needs only its own steps
    padded = np.zeros((nb, params.block), dtype=np.uint8)
    padded.reshape(-1)[:n] = symbols
    valid = np.zeros((nb, params.block), dtype=bool)
    valid.reshape(-1)[:n] = True
    shape = (nb, steps, params.lanes)
    cut = steps * params.lanes
    return padded[:, :cut].reshape(shape), valid[:, :cut].reshape(shape)


def block_freqs(symbols: np.ndarray, params: AnsParams) -> np.ndarray:
    """(nb, 256) normalized frequency tables of the blocks of `symbols`."""
    nb = params.blocks(symbols.size)
    block_of = np.arange(symbols.size, dtype=np.int64) // params.block
    counts = np.bincount(block_of * ALPHABET + symbols, minlength=nb * ALPHABET).reshape(nb, ALPHABET)
    return np.stack([normalize_freqs(c) for c in counts])


def encode(symbols: np.ndarray, params: AnsParams = AnsParams()) -> bytes:
    """The stream of uint8 `symbols` (at least one), vectorized over every lane of every block."""
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8).reshape(-1)
    if symbols.size == 0:
        raise ConfigError("nothing to encode")
    freqs = block_freqs(symbols, params)
    cums = np.cumsum(freqs, axis=1) - freqs
    sym, valid = _padded(symbols, params)
    nb, steps, lanes = sym.shape
    rows = np.arange(nb)[:, None, None]
    # step-major copies, so that each step's slices are contiguous; padding: freq 1, cum 0, masked out
    f_all = np.ascontiguousarray(np.where(valid, freqs[rows, sym], 1).astype(np.int64).transpose(1, 0, 2))
    c_all = np.ascontiguousarray(np.where(valid, cums[rows, sym], 0).astype(np.int64).transpose(1, 0, 2))
    act_all = np.ascontiguousarray(valid.transpose(1, 0, 2))
    x_max = f_all << X_MAX_SHIFT
    x = np.full((nb, lanes), STATE_LOW, dtype=np.int64)
    words = np.zeros((steps, nb, lanes), dtype=np.uint16)
    emitted = np.zeros((steps, nb, lanes), dtype=bool)
    q, r = np.empty_like(x), np.empty_like(x)
    for s in range(steps - 1, -1, -1):  # encode in reverse decode order
        act = act_all[s]
        need = emitted[s]
        np.greater_equal(x, x_max[s], out=need)
        need &= act
        words[s] = x
        np.right_shift(x, WORD_BITS, out=x, where=need)
        np.divmod(x, f_all[s], out=(q, r))
        q <<= PROB_BITS
        q += r
        q += c_all[s]
        np.copyto(x, q, where=act)
    words, emitted = words.transpose(1, 0, 2), emitted.transpose(1, 0, 2)
    # a decoder reads the words in its own order (step, then lane): the reverse of the pushes
    counts = emitted.reshape(nb, -1).sum(axis=1).astype(np.uint32)
    present = np.packbits(freqs > 0, axis=1, bitorder="little")
    parts = [
        x.astype("<u4").tobytes(),
        counts.astype("<u4").tobytes(),
        present.tobytes(),
        freqs[freqs > 0].astype("<u2").tobytes(),
        words[emitted].astype("<u2").tobytes(),
    ]
    return b"".join(parts)


def parse(data: bytes | memoryview, count: int, params: AnsParams = AnsParams()) -> AnsStream:
    """A stream of `count` symbols, its layout and tables checked (CorruptStreamError otherwise)."""
    buf = memoryview(data).cast("B")
    nb, lanes = params.blocks(count), params.lanes
    head = nb * lanes * 4 + nb * 4 + nb * 32
    if count < 1 or len(buf) < head:
        raise CorruptStreamError(f"ANS stream of {len(buf)} bytes is too short for {nb} blocks")
    states = np.frombuffer(buf, "<u4", nb * lanes, 0).reshape(nb, lanes)
    word_counts = np.frombuffer(buf, "<u4", nb, nb * lanes * 4).astype(np.int64)
    present = np.unpackbits(np.frombuffer(buf, np.uint8, nb * 32, nb * lanes * 4 + nb * 4).reshape(nb, 32), axis=1,
                            bitorder="little").astype(bool)  # fmt: skip
    n_freqs, n_words = int(present.sum()), int(word_counts.sum())
    if len(buf) != head + 2 * n_freqs + 2 * n_words:
        raise CorruptStreamError(
            f"ANS stream holds {len(buf)} bytes; its tables and word counts say {head + 2 * n_freqs + 2 * n_words}"
        )
    freqs = np.zeros((nb, ALPHABET), dtype=np.uint32)
    freqs[present] = np.frombuffer(buf, "<u2", n_freqs, head)
    if bool((freqs.sum(axis=1) != PROB_SCALE).any()) or bool((present & (freqs == 0)).any()):
        raise CorruptStreamError(f"an ANS block's frequency table does not sum to {PROB_SCALE}")
    if bool((states < STATE_LOW).any()):
        raise CorruptStreamError("an ANS lane starts below the state range")
    per_block = np.minimum(params.block, count - np.arange(nb, dtype=np.int64) * params.block)
    if bool((word_counts > per_block).any()):
        raise CorruptStreamError("an ANS block announces more words than symbols")
    words = np.frombuffer(buf, "<u2", n_words, head + 2 * n_freqs)
    return AnsStream(freqs, states, word_counts, words)


def decode_table(freqs: np.ndarray) -> np.ndarray:
    """(nb, 4096) int32 slot -> symbol << 24 | (freq - 1) << 12 | (slot - cum): one lookup per
    symbol decoded (the GPU decoder builds the same table)."""
    cums = np.cumsum(freqs, axis=1) - freqs
    slots = np.arange(PROB_SCALE)
    sym = np.stack([np.searchsorted(np.cumsum(f), slots, side="right") for f in freqs]).astype(np.int64)
    f = np.take_along_axis(freqs.astype(np.int64), sym, axis=1)
    c = np.take_along_axis(cums.astype(np.int64), sym, axis=1)
    return ((sym << 24) | ((f - 1) << 12) | (slots[None] - c)).astype(np.uint32).view(np.int32)


def decode(stream: AnsStream, count: int, params: AnsParams = AnsParams()) -> np.ndarray:
    """The reference decoder: `count` uint8 symbols, vectorized over every lane of every block;
    CorruptStreamError where a block's words or final states do not check out."""
    nb, lanes = stream.states.shape[0], params.lanes
    table = decode_table(stream.freqs).view(np.uint32)
    _, valid = _padded(np.zeros(count, np.uint8), params)
    steps = valid.shape[1]
    rows = np.arange(nb)[:, None]
    x = stream.states.astype(np.int64)
    pos = stream.word_starts.copy()
    end = pos + stream.word_counts
    words = np.concatenate([stream.words.astype(np.int64), [0]])  # a read past the end lands on the pad
    out = np.zeros((nb, steps, lanes), dtype=np.uint8)
    bad = np.zeros(nb, dtype=bool)
    for s in range(steps):
        act = valid[:, s]
        e = table[rows, x & (PROB_SCALE - 1)].astype(np.int64)
        out[:, s] = e >> 24
        nx = (((e >> 12) & 0xFFF) + 1) * (x >> PROB_BITS) + (e & 0xFFF)
        x = np.where(act, nx, x)
        need = act & (x < STATE_LOW)
        at = pos[:, None] + np.cumsum(need, axis=1) - need
        bad |= (need & (at >= end[:, None])).any(axis=1)
        w = words[np.minimum(at, words.size - 1)]
        x = np.where(need, (x << WORD_BITS) | w, x)
        pos += need.sum(axis=1)
    bad |= (pos != end) | (x != STATE_LOW).any(axis=1)
    if bool(bad.any()):
        raise CorruptStreamError(f"ANS block {int(np.argmax(bad))} does not decode to its announced end")
    return out.reshape(-1)[:count]
