"""Many transform-coded chunks at once on NvcuvidThreads: NVDEC decodes on the sessions of one
CUDA context, the math (transform_decode.TransformRestorer.finish) runs batched over all chunks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcodec.codecs.base import Target
from kvcodec.codecs.transform_decode import check_target


def threads_decode_into(codec) -> Callable:
    """The `decode_into` NvcuvidThreads.restore_blobs takes, for a TransformCodec: each chunk
    restored with the NVDEC session the worker thread was lent.

        with NvcuvidThreads(7) as dec:
            dec.restore_blobs(blobs, outs, decode_into=threads_decode_into(codec))
    """

    def decode_into(blob, out, decoder, restore: str = "auto") -> None:
        codec.decode_chunk(blob, out, decoder=decoder)

    return decode_into


def restore_chunks(codec, blobs: Sequence, outs: Sequence[Target], threads=None) -> None:
    """Many transform chunks into their targets: NVDEC decodes them in parallel on the sessions of
    `threads` (an NvcuvidThreads; None: one after another on this thread), then the math runs
    batched over all of them in a few kernels on the caller's current stream. Returns once the
    work is queued; a chunk that fails raises its error after the others are decoded."""
    if len(blobs) != len(outs):
        raise ValueError("restore_chunks needs one output per blob")
    r = codec._restorer
    decoded: list = [None] * len(blobs)

    def first_half(blob, i, decoder, restore="auto"):
        h, streams = codec._read(blob)
        check_target(h, outs[i])
        decoded[i] = r.decode_samples(h, streams, outs[i].device, decoder)

    if threads is None:
        for i, blob in enumerate(blobs):
            first_half(blob, i, None)
    else:
        threads.restore_blobs(blobs, list(range(len(blobs))), decode_into=first_half)
    r.finish(decoded, list(outs))
