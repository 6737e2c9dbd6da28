"""Batched restore of transform-coded chunks: every (layer group, K|V) block, and every chunk
of a batch, in one GEMM.

The per-group path of codecs/transform/decode.py runs one GEMM per block and a dozen small ops
per block; on a GPU that is launch and indexing overhead, not arithmetic. Here the 8-bit samples
(layout order) of N chunks that share a coordinate plan go through a fixed sequence of about ten
kernels whatever the groups and however many chunks:

    gather:   samples (N, C, t) -> (J, n, N t)  each block's coded coordinates, padded to n
    (recon)   q -= sign(q) delta; q *= scale    only for chunks restored at bin centroids or with
                                                finer tail tokens (quantize.dequantize's rule)
    GEMM:     x = mean' + basis' @ samples      one baddbmm over the J blocks; the steps and the
                                                sample offset (128) are folded into basis', mean'
    rows:     (J, d, N t) -> (L, 2, H, D, N t)  one index_select puts every layer's rows in place
    RoPE:     keys * cos + keys[partner] * sin  (tables precomputed on the device, any position)
    emit:     per chunk, permute + cast into its dense slice (or a staging tensor for PagedKV)

Escapes (coefficients beyond the 8-bit samples) are written into the gathered samples
(EscapeSlots: the index arithmetic on the host, once for the whole batch; two pinned uploads, two
more for escapes beyond +-HALF_MAX).
Nothing waits on the GPU: no host synchronisation per chunk.

The GEMM multiplies the decode basis (transform.inverse: each block's step-scaled basis rounded
to float16 under a power-of-two scale, as every restore path rounds it) with the integers as they
are: one float16 GEMM on tensor cores, float32 accumulation, every product exact. An escape
beyond +-HALF_MAX (outlier coefficients: Qwen2.5's KV has hundreds a chunk at 5x) goes into it
clipped, and the rest of it times its basis column is added after it (overflow_terms), so such KV
keeps the float16 GEMM and the fused kernels instead of falling back to the float32 GEMM.

restore_into is the entry point: on CUDA with Triton, where the float16 GEMM serves, the gather and
everything after the GEMM run as two kernels of restore.transform_triton instead (half the GPU time
on a 7-8B model's chunks); these kernels stay its fallback and the tests' reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.restore import transform_triton
from kvcodec.transform.calibration import KINDS, Calibration
from kvcodec.transform.inverse import HALF_MAX
from kvcodec.transform.quantize import OFFSET, recon_offset, step_ratio
from kvcodec.transform.rope import RopeSpec, inv_freq

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class BatchedPlan:
    """Device tensors for one (calibration, coordinate plan, device)."""

    gather: torch.Tensor  # (J * n,) int64 layout row of each block slot (row 0 for padding)
    half: torch.Tensor  # (J, d, n) float16 bases / scales, exactly (transform.inverse.DecodeBlock); padding zero
    scales: torch.Tensor  # (J, 1, 1) float32 power-of-two scale of each block
    centred_means: torch.Tensor  # (J, d, 1) float32 means for centred samples (q, not q + 128)
    rows: torch.Tensor  # (L * 2 * H * D,) int64 row of J * d holding each (layer, kind, head, dim)
    slot_of_row: np.ndarray  # (C,) int64 host: block slot (j * n + k) of each layout row
    n: int  # padded coefficients per block
    ratios: torch.Tensor | None = None  # (J * n,) float32 step / calibrated deviation per slot (0: padding)
    units: torch.Tensor | None = None  # (L * 2 * H,) int64 the fused epilogue's first row of each head (unit_table)
    pairs: torch.Tensor | None = None  # (3, P) int32 the epilogue's channel pairs (transform_triton.channel_pairs)
    halves: bool = False  # the pairs are (c, c + P): the epilogue computes them without the table
    _used_on: set = dataclasses.field(default_factory=set, repr=False)  # streams recorded (used_on)

    @property
    def blocks(self) -> int:
        return self.half.shape[0]

    def used_on(self, stream: torch.cuda.Stream) -> None:
        """Keep the plan's device memory from reuse until the work `stream` has queued when the plan
        is freed is done: a plan evicted by another level's while a fetch's kernels on its own
        stream still read it would otherwise hand its memory to the next allocation. Once per stream
        (the float32 GEMM's operands, made on first use, are recorded where they are read)."""
        if stream in self._used_on:
            return
        self._used_on.add(stream)
        for t in (
            self.gather,
            self.half,
            self.scales,
            self.centred_means,
            self.rows,
            self.ratios,
            self.units,
            self.pairs,
        ):
            if t is not None and t.device.type == "cuda":
                t.record_stream(stream)

    # The float32 GEMM's operands (a reconstruction other than the bin centres) are made from the float16 basis on first use: most plans never need them,
    # and each would hold twice the float16 basis's memory on the device.
    # Made on the plan-building stream and waited for there, as the plan itself: any stream may read them.
    @functools.cached_property
    def bases(self) -> torch.Tensor:
        """(J, d, n) float32 basis columns scaled by their steps (the decode basis, exactly)."""
        with _own_stream(self.half.device):
            return self.half.float() * self.scales

    @functools.cached_property
    def means(self) -> torch.Tensor:
        """(J, d, 1) float32 mean - OFFSET * bases @ 1: the means for samples (q + 128)."""
        bases = self.bases
        with _own_stream(self.half.device):
            return (self.centred_means.double() - OFFSET * bases.double().sum(2, keepdim=True)).float()


GEMM_ALIGN = 8  # float16 elements in 16 bytes: the GEMM's leading dimensions are multiples of it


def _aligned(size: int) -> int:
    """`size` rounded up to GEMM_ALIGN. cuBLAS picks its tensor-core kernels for aligned leading
    dimensions only: with n = the widest block's count (any number) the float16 GEMM ran a generic
    unaligned kernel at ~40 TFLOP/s, the largest share of a 7-8B model's restore on the SMs (a traced
    fetch: 1.8 ms a batch). Padding slots gather row 0 and meet zero basis columns: the same sums."""
    return -(-size // GEMM_ALIGN) * GEMM_ALIGN


def block_layout(counts, group_sizes, layer_dim: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Pure index arithmetic of the batched layout. counts[j]: coded coordinates of block j
    (block j = group j // 2, kind j % 2, concatenated order); group_sizes[g]: layers of group g.
    Returns (offset of each block in concatenated order, rows, n, d) where rows[i] is the
    row of the (J * d) GEMM output that holds output element i of (layer, kind, layer_dim)
    order, n the padded coefficient count and d the padded block height."""
    counts = np.asarray(counts, dtype=np.int64)
    n = _aligned(max(1, int(counts.max(initial=0))))
    d = _aligned(max(group_sizes) * layer_dim)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    rows = []
    for g, size in enumerate(group_sizes):
        for lpos in range(size):
            for kind in range(2):
                j = 2 * g + kind
                rows.append(j * d + lpos * layer_dim + np.arange(layer_dim))
    return offsets, np.concatenate(rows).astype(np.int64), n, d


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceCalibration:
    """A calibration's bases and means stacked per block (group j // 2, kind j % 2) and zero-padded,
    on one device: what build_plan scales by a level's steps. Made once per device, so that a
    new level costs a few kernels there, not seconds of float64 arithmetic on the host."""

    bases: torch.Tensor  # (J, d, m) float32 synthesis columns, d and m padded to GEMM_ALIGN
    means: torch.Tensor  # (J, d) float32


def device_calibration(cal: Calibration, device) -> DeviceCalibration:  # noqa: ANN001
    blocks = [cal.basis(j // 2, KINDS[j % 2]) for j in range(2 * len(cal.groups))]
    d = _aligned(max(len(g) for g in cal.groups) * cal.layer_dim)
    m = _aligned(max(b.basis.shape[1] for b in blocks))
    bases = torch.zeros((len(blocks), d, m), dtype=torch.float32)
    means = torch.zeros((len(blocks), d), dtype=torch.float32)
    for j, b in enumerate(blocks):
        rows, cols = b.basis.shape
        bases[j, :rows, :cols] = b.basis
        means[j, :rows] = b.mean
    device = torch.device(device)
    with _own_stream(device):
        return DeviceCalibration(bases.to(device), means.to(device))


# float64 scratch of half_bases per slice of blocks (it stays in the building stream's pool)
SCALE_SLICE_BYTES = 16 << 20


def half_bases(stacked: DeviceCalibration, counts, steps: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(J, d, n) float16 decode bases and (J, 1, 1) float32 scales on the calibration's device:
    block j's leading counts[j] columns times their steps (concatenated order), rounded as
    transform.inverse.half_basis rounds them (the same values, computed on the device in float64)."""
    J, d, m = stacked.bases.shape
    device = stacked.bases.device
    padded = torch.zeros((J, n), dtype=torch.float64)
    off = 0
    for j, c in enumerate(int(c) for c in counts):
        padded[j, :c] = steps[off : off + c].to(torch.float64)
        off += c
    padded = padded.to(device)
    half = torch.zeros((J, d, n), dtype=torch.float16, device=device)
    scales = torch.ones((J,), dtype=torch.float64, device=device)
    width = min(n, m)  # columns past the calibration's are padding (zero)
    per = max(1, SCALE_SLICE_BYTES // max(1, d * width * 8))
    for j0 in range(0, J, per):
        j1 = min(J, j0 + per)
        scaled = stacked.bases[j0:j1, :, :width].to(torch.float64).mul_(padded[j0:j1, None, :width])
        top = torch.maximum(scaled.amax(dim=(1, 2)), scaled.amin(dim=(1, 2)).neg_())
        scale = torch.where(top > 0, torch.exp2(torch.frexp(top).exponent.to(torch.float64)), 1.0)
        half[j0:j1, :, :width] = scaled.div_(scale[:, None, None])  # rounded as .to(float16) rounds
        scales[j0:j1] = scale
    return half, scales.float().view(J, 1, 1)


def build_plan(
    cal: Calibration,
    counts,
    steps: torch.Tensor,
    inverse: torch.Tensor,
    device,
    sigmas: torch.Tensor | None = None,
    stacked: DeviceCalibration | None = None,
) -> BatchedPlan:
    """steps (C,), inverse (C,: concatenated index -> layout row) and sigmas (C,, for the
    "laplace" reconstruction) as in codecs.transform.CoordPlan; stacked: device_calibration(cal,
    device), where the caller keeps it (made here otherwise). On CUDA the plan's tensors are
    ready when it returns (built on a stream of its own), so any stream may use them."""
    stacked = stacked if stacked is not None else device_calibration(cal, device)
    group_sizes = [len(g) for g in cal.groups]
    offsets, rows, n, d = block_layout(counts, group_sizes, cal.layer_dim)
    J = 2 * len(cal.groups)
    inverse = inverse.to(torch.int64).cpu()
    gather = torch.zeros((J, n), dtype=torch.int64)
    slot_of_row = np.zeros(inverse.numel(), dtype=np.int64)
    ratios = torch.zeros((J, n), dtype=torch.float32)
    for j in range(J):
        c, o = int(counts[j]), int(offsets[j])
        gather[j, :c] = inverse[o : o + c]
        slot_of_row[inverse[o : o + c].numpy()] = j * n + np.arange(c)
        if sigmas is not None:
            ratios[j, :c] = step_ratio(steps[o : o + c].to(torch.float64), sigmas[o : o + c].to(torch.float64)).float()
    shape = (cal.layers, cal.kv_heads, cal.head_dim)
    partners = None if cal.rope is None else _rotating_partners(cal.rope)
    units, pairs = transform_triton.unit_table(rows, shape, partners)
    device = torch.device(device)
    with _own_stream(device):
        half, scales = half_bases(stacked, counts, steps, n)
        plan = BatchedPlan(
            gather.reshape(-1).to(device),
            half,
            scales,
            stacked.means[:, :, None],
            torch.from_numpy(rows).to(device),
            slot_of_row,
            n,
            ratios.reshape(-1).to(device) if sigmas is not None else None,
            torch.from_numpy(units).to(device),
            torch.from_numpy(pairs).to(device),
            transform_triton.halves(pairs, cal.head_dim),
        )
    return plan


def indexed(device) -> torch.device:  # noqa: ANN001
    """`device` with its index: CUDA's current device where it names none."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


_BUILD_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_BUILD_STREAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def _own_stream(device: torch.device):  # noqa: ANN202
    """CUDA: the block's work on the device's plan-building stream, waited for at its end (a plan
    is shared by threads on other streams); elsewhere nothing. One stream per device, not one per
    plan: the caching allocator reuses a freed block only for its own stream's allocations."""
    if device.type != "cuda":
        yield
        return
    device = indexed(device)
    with _BUILD_STREAMS_LOCK:
        stream = _BUILD_STREAMS.get(device)
        if stream is None:
            stream = _BUILD_STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield
    stream.synchronize()


def _rotating_partners(spec: RopeSpec) -> tuple[np.ndarray, np.ndarray]:
    partner, _, sign = rope_partner(spec)
    return partner, sign != 0


HALF_GEMM = True  # the inverse transform on float16 tensor cores where the values allow it
OUT_DTYPE_BMM = True  # torch.bmm(out_dtype=float32) of float16 operands (torch >= 2.8 on CUDA)


def rope_partner(spec: RopeSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(partner channel, frequency index, sign) per head channel: rotated = x * cos(f) +
    x[partner] * sign * sin(f); channels beyond the rotary dims have partner itself, sign 0."""
    D, r = spec.head_dim, spec.rotary
    ch = np.arange(D)
    if spec.style == "half":
        partner = np.where(ch < r // 2, ch + r // 2, ch - r // 2)
        freq = ch % (r // 2)
        sign = np.where(ch < r // 2, -1.0, 1.0)
    else:
        partner, freq, sign = ch ^ 1, ch // 2, np.where(ch % 2 == 0, -1.0, 1.0)
    rest = ch >= r
    partner, freq, sign = np.where(rest, ch, partner), np.where(rest, 0, freq), np.where(rest, 0.0, sign)
    return partner.astype(np.int64), freq.astype(np.int64), sign


MAX_TABLE_POSITIONS = 1 << 20  # beyond: a window's cos / sin are computed for its positions only


class RopeTables:
    """cos / signed sin per (channel, position) on one device, grown to the positions asked for
    up to MAX_TABLE_POSITIONS (thread-safe: the pair is replaced whole, under a lock); a window
    past them is computed on its own (so a chunk's start position never sizes an allocation)."""

    def __init__(self, spec: RopeSpec, device):
        self.spec, self.device = spec, torch.device(device)
        partner, self._freq, self._sign = rope_partner(spec)
        self.partner = torch.from_numpy(partner).to(self.device)
        self._rest = torch.from_numpy(np.arange(spec.head_dim) >= spec.rotary)
        self._lock = threading.Lock()
        self._tables = (*self._make(0, 4096), set())  # cos, sin, the streams recorded on them (covering)

    def window(self, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(D, tokens) float32 cos and signed sin for positions start .. start + tokens - 1."""
        end = start + tokens
        if end > MAX_TABLE_POSITIONS:
            return self._make(start, end)
        cos, sin = self.covering(end)
        return cos[:, start:end], sin[:, start:end]

    def covering(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(D, T >= end) float32 cos and signed sin from position 0 (end <= MAX_TABLE_POSITIONS), for
        the current stream's kernels: a pair that a longer request replaces keeps its memory until
        the work every stream that read it had queued is done."""
        cos, sin, streams = self._tables
        if end > cos.shape[1]:
            with self._lock:
                if end > self._tables[0].shape[1]:
                    grown = min(max(end, 2 * self._tables[0].shape[1]), MAX_TABLE_POSITIONS)
                    self._tables = (*self._make(0, grown), set())
                cos, sin, streams = self._tables
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if stream not in streams:
                streams.add(stream)
                for table in (cos, sin, self.partner):
                    table.record_stream(stream)
        return cos, sin

    def _make(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the same float64 angles -> float32 as transform.rope.apply_rope
        angles = torch.arange(start, end, dtype=torch.float64)[:, None] * inv_freq(self.spec)[None, :]
        cos = torch.cos(angles)[:, self._freq].T
        sin = (torch.sin(angles)[:, self._freq] * torch.from_numpy(self._sign)).T
        cos[self._rest] = 1.0
        return cos.float().contiguous().to(self.device), sin.float().contiguous().to(self.device)


@dataclasses.dataclass(frozen=True, eq=False)
class EscapeSlots:
    """Every escape of a batch of N chunks, on the host: its flat position in the (J * n, N, t)
    gathered samples and its true integer."""

    flat: np.ndarray  # int64
    values: np.ndarray  # int64

    def __len__(self) -> int:
        return self.flat.size

    def fit_half(self) -> bool:
        """float16 holds every value exactly."""
        return not self.values.size or int(np.abs(self.values).max()) <= HALF_MAX

    def split_half(self) -> tuple[EscapeSlots, EscapeSlots]:
        """(every escape clipped to +-HALF_MAX, which float16 holds exactly; the rest of those
        beyond it): the float16 GEMM takes the first, overflow_terms adds the second's products."""
        if self.fit_half():
            return self, NO_ESCAPES
        clipped = np.clip(self.values, -HALF_MAX, HALF_MAX)
        rest = self.values - clipped
        beyond = rest != 0
        return EscapeSlots(self.flat, clipped), EscapeSlots(self.flat[beyond], rest[beyond])

    def sample_values(self, dtype: torch.dtype, shift: float = 0.0) -> torch.Tensor:
        """The values + shift as a host tensor of `dtype` (shift OFFSET: sample-equivalents)."""
        return torch.from_numpy(self.values.astype(np.float32) + shift).to(dtype)


def escape_slots(plan: BatchedPlan, escapes, tokens: int, rows: int) -> EscapeSlots:
    """The EscapeSlots of N chunks of `rows` x `tokens` samples. escapes[i]: chunk i's (flat
    indices in its (rows, tokens) layout, true integers), host tensors."""
    counts = [int(idx.numel()) for idx, _ in escapes]
    if not any(counts):
        return NO_ESCAPES
    idx = np.concatenate([i.numpy() for i, _ in escapes])
    if idx.min() < 0 or idx.max() >= rows * tokens:
        raise CorruptStreamError("escape list names samples outside the chunk")
    chunk = np.repeat(np.arange(len(escapes), dtype=np.int64), counts)
    flat = plan.slot_of_row[idx // tokens] * (len(escapes) * tokens) + chunk * tokens + idx % tokens
    return EscapeSlots(flat, np.concatenate([v.numpy() for _, v in escapes]).astype(np.int64, copy=False))


NO_ESCAPES = EscapeSlots(np.zeros(0, np.int64), np.zeros(0, np.int64))


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory, so the copy does not wait for
    the GPU's queued work (a pageable upload synchronises the stream first)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _write_escapes(q: torch.Tensor, slots: EscapeSlots, shift: float = 0.0) -> None:
    """The escapes' values + shift written into the gathered q (J * n, N, t) or its (J * n, N t)
    view, cast to q's dtype on the host (no cast kernel on the device). Slots and values are two
    uploads of their own: packed with the kernels' table into one pinned block, they grew what a
    warmed-up fetch pins (session 68)."""
    if len(slots):
        at = upload(torch.from_numpy(slots.flat), q.device)
        q.view(-1).index_put_((at,), upload(slots.sample_values(q.dtype, shift), q.device))


def restore(
    plan: BatchedPlan,
    samples: torch.Tensor,
    escapes,
    shape: tuple[int, int, int],
    rope: RopeTables | None,
    starts,
    *,
    recon: str = "centre",
    token_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 KV (L, 2, H, D, N * t) of N chunks of t tokens (same plan) from their samples
    (N, C, t) uint8 in layout order, their escapes (per chunk: flat index, true integer, on the
    host) and first positions; recon and token_scales ((N, t) step multipliers on the device,
    None: all 1) as in quantize.dequantize. Chunk i is [..., i * t : (i + 1) * t]; emit() writes it out."""
    N, C, t = samples.shape
    return _restore(plan, samples, escape_slots(plan, escapes, t, C), shape, rope, starts, recon, token_scales)


def _restore(plan, samples, slots, shape, rope, starts, recon, token_scales) -> torch.Tensor:  # noqa: ANN001
    L, H, D = shape
    N, C, t = samples.shape
    x = None
    if _half_fits(plan, recon):
        try:
            x = _half_gemm(plan, samples, slots, token_scales)
        except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError is newer than torch 2.4)
            raise  # the device's memory, not a torch without the float16 GEMM
        except (TypeError, RuntimeError, NotImplementedError) as e:  # a torch without float16 -> float32 bmm
            _half_unavailable(e)
    if x is None:
        x = _float_gemm(plan, samples, slots, recon, token_scales)
    y = x.view(-1, N * t).index_select(0, plan.rows).view(L, 2, H, D, N * t)
    if rope is not None:
        windows = [rope.window(s, t) for s in starts]
        cos = windows[0][0] if N == 1 else torch.cat([w[0] for w in windows], dim=1)
        sin = windows[0][1] if N == 1 else torch.cat([w[1] for w in windows], dim=1)
        k = y[:, 0]
        rotated = k.index_select(2, rope.partner).mul_(sin)
        y[:, 0] = rotated.addcmul_(k, cos)
    return y


def _half_unavailable(error: BaseException) -> None:
    global HALF_GEMM
    HALF_GEMM = False
    log.warning("float16 GEMM unavailable (%s: %s): restoring with the float32 GEMM", type(error).__name__, error)


def _half_fits(plan: BatchedPlan, recon: str) -> bool:
    """The float16 GEMM restores the chunks: centre reconstruction (escapes beyond HALF_MAX are
    clipped in its operand and their rest added by overflow_terms)."""
    return HALF_GEMM and plan.half is not None and recon == "centre"


def _gathered(plan: BatchedPlan, samples: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(J * n, N, t) of `dtype`: each block's coded coordinates of every chunk (sample values)."""
    N, C, t = samples.shape
    if not C:  # a level so coarse that nothing is coded: every slot is padding (the chunk is the mean)
        return torch.full((plan.gather.numel(), N, t), OFFSET, dtype=dtype, device=samples.device)
    g = torch.empty((plan.gather.numel(), N, t), dtype=dtype, device=samples.device)
    g.copy_(samples.index_select(1, plan.gather).permute(1, 0, 2))
    return g


def _half_gemm(plan: BatchedPlan, samples: torch.Tensor, slots: EscapeSlots, token_scales) -> torch.Tensor:
    """x (J, d, N t) float32 through the float16 GEMM over centred integers q."""
    N, _, t = samples.shape
    J = plan.blocks
    x = _half_products(plan, samples, slots).mul_(plan.scales)
    if token_scales is not None:
        x.view(J, -1, N, t).mul_(token_scales[None, None])
    return x.add_(plan.centred_means)


def _half_products(plan: BatchedPlan, chunks, slots: EscapeSlots, table: torch.Tensor | None = None) -> torch.Tensor:
    """(J, d, N t) float32 half @ q of N chunks (an (N, C, t) tensor or N (C, t) ones): the basis
    products of the centred integers, before the blocks' scales, the token scales and the means
    (float16 tensor cores on CUDA; the same values in float32 on the CPU, for the tests: _half_gemm_of). `table`:
    the chunks' addresses on the device where the caller uploaded them (the fused path's meta)."""
    C = chunks[0].shape[0]
    fit, beyond = slots.split_half()
    on_gpu = chunks[0].device.type == "cuda"
    q = _gathered_fused(plan, chunks, fit, table) if on_gpu and C else None
    if q is None:
        stacked = chunks if isinstance(chunks, torch.Tensor) else torch.stack(list(chunks))
        q = _centred(plan, stacked, fit, torch.float16 if on_gpu else torch.float32)
    x = _half_gemm_of(plan, q)
    return overflow_terms(plan, x, beyond)


def overflow_terms(plan: BatchedPlan, x: torch.Tensor, beyond: EscapeSlots) -> torch.Tensor:
    """x (J, d, N t) float32 products of the float16 GEMM plus, for each escape it held clipped,
    the rest of the escape times its block's basis column (float32, in place): KV with a few
    huge coefficients (outlier channels) keeps the float16 GEMM and the fused kernels."""
    if not len(beyond):
        return x
    slot, column = np.divmod(beyond.flat, x.shape[2])
    block, k = np.divmod(slot, plan.n)
    pairs, which = np.unique(np.stack([block, column]), axis=1, return_inverse=True)  # (block, column) once each
    at = upload(torch.from_numpy(np.concatenate([block, k, which.ravel(), pairs.ravel()])), x.device).split(
        [block.size, block.size, block.size, pairs.shape[1], pairs.shape[1]]
    )
    rest = upload(torch.from_numpy(beyond.values.astype(np.float32)), x.device)
    terms = plan.half[at[0], :, at[1]].float().mul_(rest[:, None])  # (escapes, d)
    summed = torch.zeros((pairs.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
    summed.index_put_((at[2],), terms, accumulate=True)  # sorted, not atomic: the same sums every run
    # no index twice: a plain indexed write (an accumulating one sorts an index per (escape, row) on CUDA)
    x[at[3], :, at[4]] = x[at[3], :, at[4]] + summed
    return x


def _half_gemm_of(plan: BatchedPlan, q: torch.Tensor) -> torch.Tensor:
    """(J, d, N t) float32: the float16 GEMM of the decode basis with q (J * n, N t) float16 on CUDA;
    where torch has none into float32 (before 2.8: no out_dtype; while torch's float16-accumulation
    setting is on, which refuses it), the same products by a float32 GEMM of the same operands (every
    float16 value exact in float32; its cost beside the float16 GEMM is not measured)."""
    global OUT_DTYPE_BMM
    q = q.view(plan.blocks, plan.n, -1)
    if _float16_gemm_offered(q):
        try:
            return torch.bmm(plan.half, q, out_dtype=torch.float32)
        except (TypeError, NotImplementedError) as e:  # no such argument / no such kernel: not a device error
            OUT_DTYPE_BMM = False
            log.warning("torch.bmm has no float16 -> float32 GEMM here (%s): a float32 GEMM of the same operands", e)
    return torch.bmm(plan.half.float(), q.float())


def _float16_gemm_offered(q: torch.Tensor) -> bool:
    """Whether to ask torch for the float16 GEMM into float32 for q: on CUDA, unless it was refused
    before or torch's float16-accumulation setting refuses it now (it can be set at any time)."""
    return OUT_DTYPE_BMM and q.is_cuda and not getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False)


def _gathered_fused(plan: BatchedPlan, chunks, slots: EscapeSlots, table: torch.Tensor | None) -> torch.Tensor | None:
    """q (J * n, N t) float16 by the fused gather (transform_triton.gather_centred), escapes
    written in; None where the fused kernels do not serve. `table`: the chunks' addresses on the
    device (None: uploaded here)."""
    if not transform_triton.FUSED or transform_triton.triton_modules() is None:
        return None
    chunks = [c.contiguous() for c in chunks]
    if table is None:
        table = upload(torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64), chunks[0].device)
    return _gathered_at(plan, chunks, table, slots)


def _gathered_at(plan: BatchedPlan, chunks: list, table: torch.Tensor, slots: EscapeSlots) -> torch.Tensor | None:
    """The fused gather of chunks (C, t) each, read where `table` (int64 on the device) says they
    are, escapes written in (uploaded once the gather ran: a failed one falls back, which uploads them)."""
    t = chunks[0].shape[1]
    q = transform_triton.gather_centred(table, plan.gather, t, len(chunks), transform_triton.gather_aligned(chunks))
    if q is not None:
        _write_escapes(q, slots)
    return q


def _centred(plan: BatchedPlan, samples: torch.Tensor, slots: EscapeSlots, dtype: torch.dtype) -> torch.Tensor:
    """(J * n, N, t) centred integers q of every block's coded coordinates, escapes written in."""
    q = _gathered(plan, samples, dtype).sub_(OFFSET)
    _write_escapes(q, slots)
    return q


def _float_gemm(plan: BatchedPlan, samples: torch.Tensor, slots: EscapeSlots, recon: str, token_scales) -> torch.Tensor:
    """x (J, d, N t) float32 through the float32 GEMM (any reconstruction, any escape)."""
    N, C, t = samples.shape
    device = samples.device
    if C:
        g = torch.empty((plan.gather.numel(), N, t), dtype=torch.float32, device=device)
        g.copy_(samples.index_select(1, plan.gather).permute(1, 0, 2))
    else:  # a level so coarse that nothing is coded: every slot is padding (the chunk is the mean)
        g = torch.zeros((plan.gather.numel(), N, t), dtype=torch.float32, device=device)
    _write_escapes(g, slots, OFFSET)
    if recon != "centre" or token_scales is not None:
        _reconstruct(plan, g, recon, token_scales)
    means, bases = plan.means, plan.bases
    if device.type == "cuda":  # the very tensors read here (two threads may each have made a pair on first use)
        for operand in (means, bases):
            operand.record_stream(torch.cuda.current_stream(device))
    return torch.baddbmm(means, bases, g.view(plan.blocks, plan.n, N * t))  # (J, d, N t)


def _reconstruct(plan: BatchedPlan, g: torch.Tensor, recon: str, token_scales: torch.Tensor | None) -> None:
    """In place on the gathered sample-equivalents g (J * n, N, t): q = g - OFFSET becomes
    (q - sign(q) * delta) * scale, then the OFFSET goes back (the plan's means subtract it)."""
    q = g.sub_(OFFSET)
    if recon == "laplace":
        if plan.ratios is None:
            raise ValueError("the laplace reconstruction needs a plan built with sigmas")
        ratio = plan.ratios[:, None, None]
        ratio = ratio if token_scales is None else ratio * token_scales[None]
        q.sub_(torch.sign(q).mul_(recon_offset(ratio)))
    elif recon != "centre":
        raise ValueError(f"unknown reconstruction {recon!r}")
    if token_scales is not None:
        q.mul_(token_scales[None])
    q.add_(OFFSET)


def restore_into(
    plan, samples, escapes, shape, rope, starts, outs, *, recon="centre", token_scales=None, sinks=None
) -> None:  # noqa: ANN001
    """restore() of N chunks (same arguments) straight into their dense outputs outs[i]
    (L, 2, t, H, D): by the fused kernels (restore.transform_triton) where they serve, else
    restore() and emit(). samples: each chunk's (C, t) uint8 samples (or one (N, C, t) tensor);
    sinks: per chunk None or its first tokens kept exact, (L, 2, s, H, D) float16 on the outputs'
    device, written over the restored ones."""
    sinks = list(sinks) if sinks is not None else [None] * len(outs)
    chunks = list(samples)
    slots = escape_slots(plan, escapes, chunks[0].shape[1], chunks[0].shape[0])
    if _fused(plan, chunks, slots, shape, rope, starts, outs, recon, token_scales, sinks):
        return
    stacked = samples if isinstance(samples, torch.Tensor) else torch.stack(chunks)
    y = _restore(plan, stacked, slots, shape, rope, starts, recon, token_scales)
    t = stacked.shape[2]
    for i, out in enumerate(outs):
        emit(y, i, t, out)
        if sinks[i] is not None:
            out[:, :, : sinks[i].shape[2]] = sinks[i]


def _fused(plan, chunks, slots, shape, rope, starts, outs, recon, token_scales, sinks) -> bool:  # noqa: ANN001
    t = chunks[0].shape[1]
    end = max(starts) + t
    if plan.units is None or not _half_fits(plan, recon) or (rope is not None and end > MAX_TABLE_POSITIONS):
        return False
    device = chunks[0].device
    if not transform_triton.supports(outs, shape, t, device):
        return False
    if rope is not None:
        cos, sin = rope.covering(end)
    else:
        cos = sin = torch.zeros((1, 1), dtype=torch.float32, device=device)
    chunks = [c.contiguous() for c in chunks]
    sinks = [None if s is None else s.to(device, torch.float16).contiguous() for s in sinks]
    meta = upload(transform_triton.meta_table(starts, outs, chunks, sinks), device)
    x = _half_products(plan, chunks, slots, table=meta[2 * len(chunks) : 3 * len(chunks)])
    run = transform_triton.Launch(
        x=x,
        cos=cos,
        sin=sin,
        token_scales=None if token_scales is None else token_scales.float().contiguous(),
        meta=meta,
        tokens=t,
        out_strides=tuple(outs[0].stride()),
        heads=shape[1],
        out_dtype=outs[0].dtype,
        sinks=any(s is not None for s in sinks),
        regular=transform_triton.regular(t, outs),
    )
    return transform_triton.launch(plan, run)


def emit(y: torch.Tensor, i: int, t: int, out: torch.Tensor) -> torch.Tensor:
    """Chunk i of y (L, 2, H, D, N * t) into out (L, 2, t, H, D): one permuting, casting copy
    (chunk i of y clamped to out's range first)."""
    return out.copy_(clamp_to_range_(y[..., i * t : (i + 1) * t], out.dtype).permute(0, 1, 4, 2, 3))


def clamp_to_range_(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y, clamped in place to `dtype`'s finite range where y's dtype is wider: a lossy
    reconstruction of values near float16's largest can overshoot it, and the cast would make
    them inf. NaN stays NaN."""
    top = torch.finfo(dtype).max
    return y.clamp_(-top, top) if torch.finfo(y.dtype).max > top else y
