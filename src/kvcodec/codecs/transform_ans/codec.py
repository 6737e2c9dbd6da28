"""TransformAnsCodec: the transform codec (same .kvt, level, quantization, escapes and sink
tokens) with its integer samples entropy-coded by interleaved rANS (rans.py) instead of HEVC,
so that a restore decodes them on the SMs (gpu.py, one Triton launch per batch of chunks) rather
than on NVDEC; on the CPU the numpy reference decodes them.

A fetch on CUDA restores in two halves (base.StagedDecode): `stage` checks a chunk on the host
(header, stream CRCs, rANS tables and sizes, escapes, sink tokens); `finish` decodes every staged
chunk's samples in one launch, runs the transform's batched inverse transform on them, then checks
the decoder's per-block end states (one wait per batch) and raises CorruptStreamError on a stream
that did not decode to its announced end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvcodec.codecs.base import Target
from kvcodec.codecs.transform.codec import TRANSFORM_VERSION, TransformCodec
from kvcodec.codecs.transform.decode import Decoded, TransformRestorer, check_target, unzstd
from kvcodec.codecs.transform.header import check_named, sink_count
from kvcodec.codecs.transform_ans import gpu, rans
from kvcodec.codecs.transform_ans.header import ANS_VERSION, CHUNK_MAGIC, STREAM_CODECS, AnsChunkHeader
from kvcodec.container.format import crc32, read_parsed, split_streams, write_object
from kvcodec.errors import ConfigError, CorruptStreamError, FormatError
from kvcodec.plugins import check_arguments
from kvcodec.transform import quantize
from kvcodec.transform.calibration import Calibration


def _check_decoded(err: torch.Tensor) -> None:
    bad = int((err != 0).sum())  # waits for the launch
    if bad:
        raise CorruptStreamError(
            f"{bad} rANS block(s) did not decode to their announced end (a forged or damaged stream)"
        )


class AnsRestorer(TransformRestorer):
    """The transform restore path with the samples from the rANS stream (SMs on CUDA, numpy elsewhere)."""

    def __init__(self, cal: Calibration, plan, use_gpu: bool | None = None):
        super().__init__(cal, plan)
        self.use_gpu = use_gpu  # None: on a CUDA device whenever Triton loads

    def gpu_for(self, device: torch.device) -> bool:
        return device.type == "cuda" and (self.use_gpu if self.use_gpu is not None else gpu.available())

    def _samples(self, h: dict, streams: dict, count: int, device: torch.device, decoder=None) -> torch.Tensor:
        params = rans.AnsParams(h["block"], h["lanes"])
        stream = rans.parse(streams["ans"], count, params)
        if self.gpu_for(device):
            out, err = gpu.decode_batch([stream], [count], params, device)
            _check_decoded(err)
            return out
        return torch.from_numpy(rans.decode(stream, count, params)).to(device)


@dataclasses.dataclass(frozen=True, eq=False)
class Staged:
    """A chunk checked on the host, its samples not decoded yet (TransformAnsCodec.stage)."""

    h: dict
    stream: rans.AnsStream
    escapes: tuple[torch.Tensor, torch.Tensor]
    sink: torch.Tensor | None


class TransformAnsCodec(TransformCodec):
    """A ChunkCodec: TransformCodec's options (transform, size, fine tail, recon, chunk_tokens,
    resolutions: recorded, a chunk is the same whatever the frame size) plus `block` and `lanes`
    of the rANS stream (rans.AnsParams); `gpu`: decode on the SMs on CUDA (None: when Triton loads)."""

    stage_stream = None  # no NVDEC stream to feed: the fetch stages chunk by chunk and finishes in batches
    STREAM_NAMES = frozenset(STREAM_CODECS)

    def __init__(self, transform: str | Path | Calibration, *, block: int = 1 << 16, lanes: int = 32,
                 gpu: bool | None = None, **options):  # fmt: skip
        if options.get("coder", "ans") != "ans":
            raise ConfigError(f"the transform-ans codec codes its samples with rANS; got coder={options['coder']!r}")
        options.pop("coder", None)
        check_arguments(TransformCodec, "codec 'transform-ans'", transform, coder="zstd", **options)
        super().__init__(transform, coder="zstd", **options)
        self.params = rans.AnsParams(int(block), int(lanes))
        self.coder = "ans"
        head = f"transform{TRANSFORM_VERSION}-{self.kvt_hash[:16]}-zstd-"
        rest = self.id.removeprefix(head)
        self.id = f"transform-ans{ANS_VERSION}-{self.kvt_hash[:16]}-b{self.params.block}l{self.params.lanes}-{rest}"
        self._restorer = AnsRestorer(self.cal, self.plan, gpu)

    # ------------------------------------------------------------------------------ encode

    def _pending(self, samples, streams, escapes, fine, resolution, coder) -> tuple[dict, dict, np.ndarray]:  # noqa: ANN001
        """The side streams, the header counts and the chunk's samples on the host (rANS-coded by _coded)."""
        flat = samples.reshape(-1).cpu().numpy()
        return streams, {"escapes": escapes, "fine_tokens": fine, "samples": int(flat.size)}, flat

    def _coded(self, streams, counts, flat, resolution, encoder) -> tuple[dict[str, bytes], dict]:
        return {**streams, "ans": rans.encode(flat, self.params)}, counts

    def _write(self, streams, counts, kv, theta, start, index, resolution, key) -> bytes:
        names = [n for n in ("escapes", "sink", "ans") if n in streams]
        L, _, t, H, D = kv.shape
        header = AnsChunkHeader(
            kvt=self.kvt_hash,
            codec=self.id,
            index=index,
            start_token=start,
            tokens=t,
            shape=(L, H, D),
            dtype=str(kv.dtype).replace("torch.", ""),
            theta=theta,
            key_weight=self.key_weight,
            sink=sink_count(self.sink_tokens, start, t),
            fine_tokens=counts["fine_tokens"],
            fine_bits=self.fine_bits,
            recon=self.recon,
            resolution=tuple(resolution),
            escapes=counts["escapes"],
            samples=counts["samples"],
            block=self.params.block,
            lanes=self.params.lanes,
            streams=tuple(_entry(n, streams[n]) for n in names),
            key=key,
        )
        return write_object(CHUNK_MAGIC, header.to_json(), [streams[n] for n in names])

    def transcode(self, h: dict, samples: np.ndarray, escapes: bytes, sink: bytes | None) -> bytes:
        """A transform chunk (its verified header `h`, samples, zstd escape and sink streams) as
        this codec's chunk: the same integers, rANS instead of HEVC (benchmarks compare the two)."""
        streams = {"escapes": bytes(escapes), "ans": rans.encode(samples, self.params)}
        if sink is not None:
            streams["sink"] = bytes(sink)
        names = [n for n in ("escapes", "sink", "ans") if n in streams]
        fields = {k: h[k] for k in ("index", "start_token", "tokens", "dtype", "theta", "key_weight", "sink")}
        fields |= {k: h[k] for k in ("fine_tokens", "fine_bits", "recon", "escapes", "key")}
        header = AnsChunkHeader(
            kvt=self.kvt_hash, codec=self.id, shape=tuple(h["shape"]), resolution=tuple(h["resolution"]),
            samples=int(samples.size), block=self.params.block, lanes=self.params.lanes,
            streams=tuple(_entry(n, streams[n]) for n in names), **fields,
        )  # fmt: skip
        return write_object(CHUNK_MAGIC, header.to_json(), [streams[n] for n in names])

    # ------------------------------------------------------------------------------ decode

    def _read(self, blob, deferred: frozenset[str] = frozenset()) -> tuple[dict, dict]:
        ah, payload = read_parsed(blob, CHUNK_MAGIC, "transform-ANS chunk", AnsChunkHeader.from_json)
        if ah.kvt != self.kvt_hash:
            raise ConfigError(
                f"chunk was coded with transform {ah.kvt[:16]}, this codec holds {self.kvt_hash[:16]}: "
                "decode it with the .kvt it was encoded with"
            )
        L, H, D = ah.shape
        self.cal.check_shape((L, 2, ah.tokens, H, D))
        h = ah.restorer_fields()
        if ah.samples != self._restorer.sample_count(h):
            raise FormatError(
                f"transform-ANS chunk {ah.index} announces {ah.samples} samples; its level codes "
                f"{self._restorer.sample_count(h)}"
            )
        if ah.escapes > ah.samples:
            raise FormatError(f"transform-ANS chunk announces {ah.escapes} escapes, more than it has samples")
        check_named(h)  # its settings, those its codec names
        return h, split_streams(payload, ah.streams, f"transform-ANS chunk {ah.index}", deferred)

    def stage(self, blob: bytes | memoryview, out: Target) -> Staged:
        h, streams = self._read(blob)
        check_target(h, out)
        stream = rans.parse(streams["ans"], h["samples"], rans.AnsParams(h["block"], h["lanes"]))
        escapes = quantize.unpack_escapes(unzstd(streams["escapes"], "escapes", 4 + 8 * int(h["escapes"])))
        sink = self._restorer._sink(h, streams, torch.device("cpu")) if h["sink"] else None
        return Staged(h, stream, escapes, sink)

    def finish(self, staged: Sequence[Staged], outs: Sequence[Target]) -> None:
        """Every staged chunk's samples in one launch (per block/lanes setting), then the batched math."""
        staged, outs = list(staged), list(outs)
        if not staged:
            return
        device = outs[0].device
        decoded, errors = [None] * len(staged), []
        groups: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(staged):
            groups.setdefault((s.h["block"], s.h["lanes"]), []).append(i)
        for (block, lanes), members in groups.items():
            params, counts = rans.AnsParams(block, lanes), [staged[i].h["samples"] for i in members]
            if self._restorer.gpu_for(device):
                flat, err = gpu.decode_batch([staged[i].stream for i in members], counts, params, device)
                errors.append(err)
            else:
                flat = torch.from_numpy(
                    np.concatenate([rans.decode(staged[i].stream, c, params) for i, c in zip(members, counts)])
                ).to(device)
            off = 0
            for i, c in zip(members, counts):
                s = staged[i]
                decoded[i] = Decoded(
                    s.h, flat[off : off + c].view(c // s.h["tokens"], s.h["tokens"]), s.escapes, s.sink
                )
                off += c
        self._restorer.finish(decoded, outs)
        for err in errors:
            _check_decoded(err)


def _entry(name: str, data: bytes) -> tuple:
    from kvcodec.container.format import StreamEntry

    return StreamEntry(name, STREAM_CODECS[name], len(data), crc32(data))


def make_transform_ans_codec(transform: str | Path | Calibration, *, target_quality: str | None = None, **options):  # noqa: ANN201
    """The registered "transform-ans" codec over a plain (one-group) .kvt; target_quality as for
    "transform" (the calibration's held-out report measured HEVC-coded chunks: the same integers)."""
    if target_quality is not None:
        from kvcodec.codecs.transform.codec import kvt_info
        from kvcodec.transform.quality import ratio_for

        if isinstance(transform, Calibration):
            raise ConfigError("target_quality needs a .kvt file (its quality report)")
        if options.get("target_ratio") is not None or options.get("preset") is not None:
            raise ConfigError("give target_quality or target_ratio / preset, not both")
        options["target_ratio"] = ratio_for(kvt_info(transform).get("quality"), target_quality)
    if not isinstance(transform, Calibration):
        from kvcodec.transform.grouped_kvt import is_grouped_kvt

        try:
            grouped = is_grouped_kvt(Path(transform).read_bytes())
        except OSError as e:
            raise ConfigError(f"transform file {transform}: {e.strerror or e}") from e
        if grouped:
            raise ConfigError("transform-ans codes one-group (uniform) caches; this .kvt has several layer groups")
    return TransformAnsCodec(transform, **options)
