"""The front door of the HEVC codec as functions: a KV tensor <-> a kvcodec file (.kvc) or chunk
blobs. The implementation lives in kvcodec.codecs (hevc_encode, hevc_decode, hevc_file); the
ChunkCodec object for stores and fetchers is kvcodec.codecs.hevc.codec.HevcCodec."""

from kvcodec.codecs.base import EncodedChunk
from kvcodec.codecs.hevc.decode import decode_chunk_blob, inspect_chunk_blob
from kvcodec.codecs.hevc.encode import CodingPlan, check_kv, encode_chunks, plan_coding
from kvcodec.codecs.hevc.file import decode, encode, file_chunks, inspect, read_file_header
from kvcodec.dtypes import DTYPE_NAMES, DTYPES

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "CodingPlan",
    "EncodedChunk",
    "check_kv",
    "decode",
    "decode_chunk_blob",
    "encode",
    "encode_chunks",
    "file_chunks",
    "inspect",
    "inspect_chunk_blob",
    "plan_coding",
    "read_file_header",
]
