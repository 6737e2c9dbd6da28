"""The transform codec with its integers entropy-coded for the SMs (issue 21's alternative to NVDEC):
rans (interleaved rANS, pure numpy), gpu (the Triton decoder), header (the KVTA chunk header),
codec (TransformAnsCodec, registered as "transform-ans")."""

from kvcodec.codecs.transform_ans.codec import TransformAnsCodec, make_transform_ans_codec

__all__ = ["TransformAnsCodec", "make_transform_ans_codec"]
