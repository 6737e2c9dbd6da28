"""The transform chunk codec: KV decorrelated by a calibrated .kvt basis, quantized and coded as lossless HEVC.

Modules: codec (TransformCodec), header (the KVTC chunk header), decode (one chunk back to KV), batch (a
fetch's chunks staged and finished together on the GPU), file (the KVTF file)."""
