"""The size search's measurements: the entropy per token of a few sampled chunks' integers at a
distortion level, and the coder's real bits on them (TransformCodec._level).

The sampled chunks' coefficients are computed once (every dimension: the level decides which are
coded) and quantized at each level the search tries: the same integers as the chunks' encode
(_symbols: sink tokens zero, the finer step on the fine tokens), each chunk its own order-0 model."""

from __future__ import annotations

import torch

from kvcodec.transform import rate
from kvcodec.transform.calibration import all_variances

SAMPLE_CHUNKS = 2  # chunks the size search measures entropy on


class SampleRate:
    """Bits per token of the sampled chunks of kv (codec: a TransformCodec) at a level theta.
    y: every coefficient of kv (TransformCodec.coefficients), or None to transform the sampled
    chunks alone."""

    def __init__(self, codec, y: torch.Tensor | None, kv: torch.Tensor, first_position: int):  # noqa: ANN001
        T, ct = kv.shape[2], codec.chunk_tokens
        starts = list(range(0, T, ct))
        self.codec, self.kv, self.first, self.total = codec, kv, first_position, T
        self.starts = [starts[i * len(starts) // SAMPLE_CHUNKS] for i in range(min(SAMPLE_CHUNKS, len(starts)))]
        self.raw = [self._coefficients(y, s, min(ct, T - s)) for s in self.starts]  # concatenated order
        order = _variance_order(codec).to(self.raw[0].device)
        self.rank = torch.argsort(order)  # dimension -> position in the widest-first order
        self.chunks = [z.index_select(1, order) for z in self.raw]  # a level's coded columns: a leading slice
        self.tokens = sum(z.shape[0] for z in self.chunks)
        self.fine = min(codec.fine_tokens, T) if codec.fine_bits else 0

    def _coefficients(self, y: torch.Tensor | None, s: int, t: int) -> torch.Tensor:
        """The chunk's coefficients, its sink tokens' rows zero (their integers are 0)."""
        z = self.codec.coefficients(self.kv[:, :, s : s + t], self.first + s) if y is None else y[s : s + t]
        sink = max(0, min(self.codec.sink_tokens - (self.first + s), t))
        if sink:
            z = z.clone()
            z[:sink] = 0
        return z

    def entropy(self, theta: float, fine_bits: int = 0) -> float:
        """Order-0 bits per token of the sampled chunks at level theta, every token's step
        2^fine_bits times finer."""
        dp = self.codec.device_plan(theta, self.chunks[0].device)
        n, pos = dp.columns.numel(), self.rank[dp.columns]
        steps = dp.steps * 2.0**-fine_bits  # exact: y / steps as the encode's quantize.scaled
        if n and int(pos.max()) == n - 1:  # the coded columns lead the widest-first order (a PCA basis)
            steps = torch.empty_like(steps).index_copy_(0, pos, steps)
            parts = (z[:, :n] for z in self.chunks)
        else:
            parts = (z.index_select(1, pos) for z in self.chunks)
        return sum(rate.column_entropy_bits(_rounded(z / steps)) for z in parts) / self.tokens

    def bits_per_token(self, theta: float, fine: bool = True) -> float:
        """The estimated size per token of all of kv: the last `fine_tokens` tokens' cost (finer
        step) measured on the same sampled tokens; fine=False: every token at the coarse step."""
        coarse = self.entropy(theta)
        if not fine or not self.fine:
            return coarse
        return ((self.total - self.fine) * coarse + self.fine * self.entropy(theta, self.codec.fine_bits)) / self.total

    def coded_bits_per_token(self, theta: float) -> float:
        """The coder's real bits per token on the sampled chunks (a trial encode, sinks left out)."""
        bits = sum(
            8.0 * self.codec._payload_bytes(z, self.kv[:, :, s : s + z.shape[0]], theta, self.first + s)
            for s, z in zip(self.starts, self.raw)
        )
        return bits / self.tokens


def _variance_order(codec) -> torch.Tensor:  # noqa: ANN001
    """Every dimension, concatenated (group, kind) order, by weighted calibrated variance, widest
    first: a level codes the dimensions whose weighted variance exceeds it."""
    return torch.argsort(all_variances(codec.cal).to(torch.float64) * codec._weights(), descending=True, stable=True)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """Integers of x, those beyond the sample range kept beyond it (rate counts them as escapes)."""
    return torch.round(x).clamp_(-129, 128).to(torch.int32)
