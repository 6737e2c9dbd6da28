"""Frame-by-frame restoration of decoded frames into the KV tensor.

A decoded frame holds the (top bits of the) centered integer samples of `tokens_per_frame` tokens,
tiled by a LayoutPlan. Restoring it means: gather the samples out of their tiles, merge the low bit
planes back, undo the per-channel centering, dequantize (or join the exact mode's byte planes) and
write the values into their slice of the output KV tensor. `ChunkTerms` holds what a chunk's header
and side streams say; a `FrameRestorer` does the per-frame work. Two restorers:

* `TorchRestorer`: torch operations, any device, every quant mode (the reference).
* `TritonRestorer`: one fused Triton kernel per frame on CUDA for the integer modes: no
  temporaries beyond the frame itself, one launch instead of about ten.

`restorer_for(terms)` picks the fused kernel where it applies and the reference otherwise;
`restore_frames` restores a chunk's frames held in one buffer (one launch where the restorer can).
"""

from kvcodec.restore.terms import ChunkTerms, FrameRestorer
from kvcodec.restore.torch_restore import TorchRestorer

RESTORERS = ("auto", "torch", "triton")


def restorer_for(terms: ChunkTerms, prefer: str = "auto") -> FrameRestorer:
    """The restorer for `terms`: "auto" (the fused kernel where available), "torch" or "triton"."""
    from kvcodec.restore import triton_restore

    if prefer == "torch":
        return TorchRestorer(terms)
    if prefer == "triton" or (prefer == "auto" and triton_restore.supports(terms)):
        return triton_restore.TritonRestorer(terms)
    if prefer != "auto":
        raise ValueError(f"unknown restorer {prefer!r}: use one of {', '.join(RESTORERS)}")
    return TorchRestorer(terms)


def restore_frames(restorer: FrameRestorer, frames, tokens: int, out) -> None:
    """Tokens [0, tokens) of a chunk from its frames, (F, 3, H, W) uint8 (frame k holds tokens
    from k * tokens_per_frame), into `out` (as FrameRestorer.restore): in one call where the
    restorer has restore_frames (the fused kernel), else frame by frame."""
    whole = getattr(restorer, "restore_frames", None)
    if whole is not None:
        whole(frames, tokens, out)
        return
    tpf = restorer.terms.plan.tokens_per_frame
    for k in range(frames.shape[0]):
        restorer.restore(frames[k], k * tpf, min(tpf, tokens - k * tpf), out)


__all__ = ["ChunkTerms", "FrameRestorer", "TorchRestorer", "restore_frames", "restorer_for"]
