"""Codec configuration: a frozen dataclass that fully determines how a KV cache is coded."""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

from kvcodec.errors import ConfigError

_INT_QUANT = re.compile(r"^int([2-8])$")
SAMPLE_CODERS = ("hevc", "zstd", "auto")
SAMPLE_CODER_USES = {"hevc": ("hevc",), "zstd": ("zstd",), "auto": ("zstd", "hevc")}  # what each may code chunks with
QUANT_MODES = ("exact",) + tuple(f"int{b}" for b in range(2, 9))

# Frame sizes (width, height) of the planes each chunk is stored at. All multiples of 16 and
# >= 144 so that NVDEC can decode them; with several, the fetcher picks one per chunk from the
# bandwidth. One by default: on real KV the candidates differ by under 0.3% in size (int modes)
# while every extra one costs its full size and encode time again; 512x512 is never more than
# 0.3% from the smallest and smallest in exact mode (benchmarks/results/resolution-default-cpu.md).
DEFAULT_RESOLUTIONS: tuple[tuple[int, int], ...] = ((512, 512),)


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """How to code a KV cache.

    quant: "exact" (every bit of fp16/bf16/fp32 restored) or "int2".."int8" (per-channel min-max
        integer quantization, error <= half a step).
    chunk_tokens: tokens per independently decodable chunk.
    resolutions: frame plane sizes (width, height) each chunk is stored at (one by default;
        more only pay where a measured decode profile shows the fetcher gains by choosing).
    layer_bits: optional per-layer bit widths overriding quant's width (layer-wise allocation);
        empty means every layer uses quant's width.
    x265_preset: x265 speed preset for the lossless encode.
    search_layout: pick the tile layout per resolution by trial encodes on the first chunk
        (otherwise the first candidate is used).
    sample_coder: how the 8-bit sample planes are coded: "hevc" (lossless video, decoded by NVDEC
        on GPUs), "zstd" (byte coder, decoded on the host's cores and uploaded), or "auto" (the
        default: whichever codes the first chunk in fewer bytes, decided once per model shape and
        kept with the coding plan; zstd on SmolLM2's and Qwen2.5's int8, int4 and exact KV).
    video_bits: how many top bits of each sample go through the video stream; the remaining low
        bits (near-random on real KV) are stored as packed bit planes (kvcodec.quant.bitsplit).
        8 puts every bit in the video; "auto" picks by trial encodes on the first chunk.
    plain_fallback: a chunk whose coded blob is not smaller than its values (a few tokens) is
        stored plain instead: its values' own bytes, zstd-coded, restored bit for bit
        (kvcodec.container.plain). False always keeps the coded blob.
    streams_per_chunk: each chunk as this many independent HEVC streams, one per contiguous
        range of layers (at most one per layer), so one chunk decodes on several NVDEC engines at
        once (kvcodec.container.split); 1 (the default) keeps one stream per chunk.
    """

    quant: str = "int8"
    chunk_tokens: int = 256
    resolutions: tuple[tuple[int, int], ...] = DEFAULT_RESOLUTIONS
    layer_bits: tuple[int, ...] = ()
    x265_preset: str = "ultrafast"
    search_layout: bool = True
    sample_coder: str = "auto"
    video_bits: int | str = "auto"
    plain_fallback: bool = True
    streams_per_chunk: int = 1

    def __post_init__(self) -> None:
        if self.quant not in QUANT_MODES:
            raise ConfigError(f"quant must be one of {', '.join(QUANT_MODES)}; got {self.quant!r}")
        if self.sample_coder not in SAMPLE_CODERS:
            raise ConfigError(f"sample_coder must be one of {', '.join(SAMPLE_CODERS)}; got {self.sample_coder!r}")
        if self.video_bits != "auto" and (
            isinstance(self.video_bits, bool) or not isinstance(self.video_bits, int) or not 1 <= self.video_bits <= 8
        ):
            raise ConfigError(f"video_bits must be 'auto' or an integer in 1..8; got {self.video_bits!r}")
        if not isinstance(self.plain_fallback, bool):
            raise ConfigError(f"plain_fallback must be True or False; got {self.plain_fallback!r}")
        if isinstance(self.streams_per_chunk, bool) or not isinstance(self.streams_per_chunk, int):
            raise ConfigError(f"streams_per_chunk must be an integer; got {self.streams_per_chunk!r}")
        if not 1 <= self.streams_per_chunk <= 64:
            raise ConfigError(f"streams_per_chunk must be in 1..64; got {self.streams_per_chunk}")
        object.__setattr__(self, "chunk_tokens", whole_number(self.chunk_tokens, "chunk_tokens"))
        if self.chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be >= 1; got {self.chunk_tokens}")
        object.__setattr__(self, "resolutions", video_frame_sizes(self.resolutions))
        object.__setattr__(self, "layer_bits", whole_numbers(self.layer_bits, "layer_bits"))
        for b in self.layer_bits:
            if not 2 <= b <= 8:
                raise ConfigError(f"layer_bits entries must be in 2..8; got {b}")
        if self.layer_bits and self.quant == "exact":
            raise ConfigError("layer_bits applies to integer quantization, not quant='exact'")

    @property
    def is_exact(self) -> bool:
        return self.quant == "exact"

    @property
    def bits(self) -> int:
        """Bit width of integer modes (8 for exact, whose high bytes are coded as 8-bit samples)."""
        m = _INT_QUANT.match(self.quant)
        return int(m.group(1)) if m else 8

    def bits_for_layer(self, layer: int) -> int:
        if self.layer_bits:
            return self.layer_bits[layer]
        return self.bits

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["resolutions"] = [list(r) for r in self.resolutions]
        d["layer_bits"] = list(self.layer_bits)
        if self.streams_per_chunk == 1:
            del d["streams_per_chunk"]  # single-stream configs keep their earlier dict (and codec ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown CodecConfig fields: {sorted(unknown)}")
        kw = dict(d)
        if "resolutions" in kw:
            kw["resolutions"] = tuple(tuple(r) for r in kw["resolutions"])
        if "layer_bits" in kw:
            kw["layer_bits"] = tuple(kw["layer_bits"])
        return cls(**kw)


# ---- option values as a caller may give them: typed, or as the text of a --codec-option


def whole_number(value: Any, name: str) -> int:
    """`value` as an int: an integer (not a bool) or its text; ConfigError naming `name` otherwise. Pure."""
    wrong = ConfigError(f"{name} must be an integer; got {value!r}")
    if isinstance(value, bool):
        raise wrong
    try:
        return int(value) if isinstance(value, str) else operator.index(value)  # text as int() reads it
    except (TypeError, ValueError):
        raise wrong from None


def whole_numbers(value: Any, name: str) -> tuple[int, ...]:
    """A sequence of integers, or their comma-separated text ("8,6,4"), as a tuple of ints. Pure."""
    items = [v for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    try:
        return tuple(whole_number(v, name) for v in items)
    except TypeError:  # not iterable
        raise ConfigError(f"{name} must be integers; got {value!r}") from None


def real_number(value: Any, name: str) -> float:
    """`value` as a number: an int or float as given (not a bool; codec ids print them), else the
    float of its text; ConfigError naming `name` otherwise. Pure."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{name} must be a number; got {value!r}")


MIN_FRAME, MAX_FRAME = 144, 8192  # the frame sides NVDEC decodes (H200); x265 fails on larger frames too


def video_frame_sizes(value: Any, name: str = "resolutions", least: int = MIN_FRAME) -> tuple[tuple[int, int], ...]:
    """resolution_pairs that NVDEC can decode: at least one, none twice, each side a multiple of 16
    in least..MAX_FRAME; ConfigError naming `name` otherwise. Pure. (least=16, x265's smallest
    frame, makes frames that only the CPU decodes: small tests.)"""
    pairs = resolution_pairs(value, name)
    if not pairs:
        raise ConfigError(f"{name}: at least one frame size is needed")
    for w, h in pairs:
        if not (least <= w <= MAX_FRAME and least <= h <= MAX_FRAME) or w % 16 or h % 16:
            raise ConfigError(
                f"{name} {w}x{h}: width and height must be multiples of 16 in {least}..{MAX_FRAME} (NVDEC)"
            )
    if len(set(pairs)) != len(pairs):
        raise ConfigError(f"{name}: duplicate frame sizes in {pairs}")
    return pairs


def resolution_pairs(value: Any, name: str = "resolutions") -> tuple[tuple[int, int], ...]:
    """(width, height) pairs from pairs or their text ("512x512" or "256x256,512x512"); ConfigError
    naming `name` for anything else. Pure."""
    wrong = ConfigError(f"{name} must be (width, height) pairs or WxH text such as 512x512; got {value!r}")
    if isinstance(value, str):
        value = [part.strip().lower().split("x") for part in value.split(",") if part.strip()]
    try:
        pairs = [tuple(p) for p in value]
        if any(len(p) != 2 for p in pairs):
            raise wrong
        return tuple((whole_number(w, name), whole_number(h, name)) for w, h in pairs)
    except (TypeError, ConfigError):
        raise wrong from None


def one_resolution(text: Any, name: str = "resolution") -> tuple[int, int]:
    """One WIDTHxHEIGHT (text "256x256" or a pair); ConfigError naming `name` otherwise. Pure."""
    try:
        ((w, h),) = resolution_pairs(str(text) if not isinstance(text, (tuple, list)) else (text,), name)
    except (ConfigError, ValueError) as e:  # not WxH, or not exactly one
        raise ConfigError(f"{name} must look like 256x256; got {text!r}") from e
    return w, h


def torch_device(value: Any, name: str = "device"):  # noqa: ANN201 - a torch.device
    """`value` ("cpu", "cuda:1", a torch.device) as a torch.device this machine has; ConfigError
    naming `name` for anything else (kvcodec restores on CPUs and CUDA GPUs), or a CUDA device
    where torch has no CUDA."""
    import torch

    wrong = ConfigError(f"{name} must be cpu or a CUDA device such as cuda:0; got {value!r}")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise wrong from None
    if dev.type not in ("cpu", "cuda"):
        raise wrong
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{name} {value!r}: this torch has no CUDA device (use cpu)")
    return dev
