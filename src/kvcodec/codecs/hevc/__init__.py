"""The hevc chunk codec: KV chunks quantized to integers and coded as lossless HEVC video.

Modules: codec (HevcCodec), encode (chunk -> video streams), decode (streams -> KV), file (the .kvc file
writer and reader), pool (decoder sessions shared by a fetch)."""
