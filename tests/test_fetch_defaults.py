"""The fetch defaults (issue 21): every NVDEC engine on CUDA without flags, an in-flight limit that
never caps the staged batch there, the CPU's settings unchanged, and a decode profile that needs no
encoder and is never re-calibrated per fetch after a failure."""

from __future__ import annotations

import dataclasses

import torch

from kvcodec.codecs.raw import RawCodec
from kvcodec.engine.config import EngineConfig
from kvcodec.errors import BackendUnavailableError, ConfigError
from kvcodec.fetcher import PrefixCache, blob_key
from kvcodec.fetcher.pipeline import default_decode_workers, default_max_inflight, default_net_workers
from kvcodec.fetcher.profile import CalibrationError, load_or_calibrate
from kvcodec.store import open_store
from kvcodec.store.deadline import DeadlineStore
from kvcodec.store.redis_store import RedisStore
from kvcodec.video.nvcuvid_threads import DEFAULT_ENGINES, engines_for_name

RES = ((256, 256), (512, 512))


def make_kv(tokens=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (2, 2, tokens, 2, 32), generator=g).half()


class NoEncoder:
    """A real raw/zstd codec on a machine where encoding fails (a serving machine without an
    encoder: the one fault here that cannot be caused for real); counts the encodes tried."""

    def __init__(self, chunk_tokens=16, seed=0):
        self.inner = RawCodec(("raw", "zstd"), chunk_tokens=chunk_tokens, resolutions=RES)
        self.id, self.chunk_tokens, self.resolutions = f"{self.inner.id}-seed{seed}", chunk_tokens, RES
        self.encodes, self.can_encode = 0, True

    def encode_chunks(self, kv, **kw):
        self.encodes += 1
        if not self.can_encode:
            raise BackendUnavailableError("no encoder here")
        return self.inner.encode_chunks(kv, **kw)

    def inspect_chunk(self, blob):
        return dataclasses.replace(self.inner.inspect_chunk(blob), codec=self.id)

    def decode_chunk(self, blob, out):
        return self.inner.decode_chunk(blob, out)


def test_nvdec_engines_by_gpu_name():
    assert engines_for_name("NVIDIA H200") == engines_for_name("NVIDIA H100 80GB HBM3") == 7
    assert engines_for_name("NVIDIA A100-SXM4-80GB") == 5
    assert engines_for_name("NVIDIA L40S") == 3 and engines_for_name("NVIDIA L4") == 4
    assert engines_for_name("NVIDIA A10") == 2 and engines_for_name("some future GPU") == DEFAULT_ENGINES


def test_device_defaults():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert default_decode_workers(cpu) == 1 and default_max_inflight(cpu, 1) == 4
    assert default_max_inflight(cuda, 7) >= 64  # never caps a staged batch of 7 engines' chunks
    assert default_max_inflight(cuda, 32) >= 4 * 32
    memory, redis = open_store("memory://"), RedisStore.__new__(RedisStore)  # no server needed: its class says
    assert default_net_workers(cuda, redis) == 2  # the link busy while a chunk's host work begins
    assert default_net_workers(cpu, redis) == default_net_workers(cuda, memory) == 1
    assert default_net_workers(cuda, DeadlineStore(redis, None)) == 2  # a view of a store keeps what it says
    if not torch.cuda.is_available():
        assert default_decode_workers(cuda) == 1  # no NVDEC to count: one decode thread


def test_prefix_cache_and_engine_defaults():
    cache = PrefixCache("memory://", "m", RawCodec(), "cpu")
    assert (cache.decode_workers, cache.max_inflight, cache.net_workers) == (1, 4, 1)
    cache = PrefixCache("memory://", "m", RawCodec(), "cpu", decode_workers=3, max_inflight=9, net_workers=2)
    assert (cache.decode_workers, cache.max_inflight, cache.net_workers) == (3, 9, 2)
    for bad in ({"decode_workers": 0}, {"max_inflight": 0}):
        try:
            PrefixCache("memory://", "m", RawCodec(), "cpu", **bad)
        except ConfigError:
            continue
        raise AssertionError(f"{bad} accepted")
    assert EngineConfig().decode_workers is None  # the fetcher's default for the engine's device
    try:
        EngineConfig(decode_workers=0)
    except ConfigError:
        return
    raise AssertionError("decode_workers=0 accepted")


def test_adaptive_profile_from_stored_blobs_needs_no_encoder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path))
    codec, kv, ids = NoEncoder(seed=1), make_kv(), list(range(64))
    store = open_store("memory://")
    PrefixCache(store, "m", codec, "cpu").put(ids, kv)
    codec.can_encode, codec.encodes = False, 0
    cache = PrefixCache(store, "m", codec, "cpu")  # adaptive policy, no profile given
    r = cache.fetch(ids)
    assert r.ok and torch.equal(r.kv, kv)
    assert cache.profile is not None and cache.profile.source == "calibrated" and codec.encodes == 0


def test_failed_calibration_is_not_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path))
    codec = NoEncoder(seed=2)
    codec.can_encode = False
    try:
        load_or_calibrate(codec, "cpu", (2, 2, 32), directory=tmp_path)
    except BackendUnavailableError:
        pass
    assert codec.encodes == 1
    try:
        load_or_calibrate(codec, "cpu", (2, 2, 32), directory=tmp_path)
    except CalibrationError:
        pass
    assert codec.encodes == 1  # remembered: the second call did not try again

    codec, kv, ids = NoEncoder(seed=3), make_kv(), list(range(64))
    store = open_store("memory://")
    PrefixCache(store, "m", codec, "cpu").put(ids, kv)
    keys = PrefixCache(store, "m", codec, "cpu").keys(ids)
    store.delete(blob_key(keys[0], 1))  # no stored chunk to calibrate on: the synthetic one needs an encoder
    codec.can_encode, codec.encodes = False, 0
    cache = PrefixCache(store, "m", codec, "cpu")
    for _ in range(3):
        cache.fetch(ids, policy=None)
    assert codec.encodes == 1 and cache.profile is None
