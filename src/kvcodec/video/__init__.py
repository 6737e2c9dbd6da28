"""Video backends: lossless HEVC encoders and decoders behind the protocols of kvcodec.video.base."""

from kvcodec.video.base import VideoDecoder, VideoEncoder
from kvcodec.video.registry import available_backends, get_decoder, get_encoder

__all__ = ["VideoDecoder", "VideoEncoder", "available_backends", "get_decoder", "get_encoder"]
