"""`kvcodec ingest --ray ADDRESS`: the same job on a Ray cluster (the optional `ray` extra).

Prefill actors (one per GPU of the cluster, or CPU actors on a cluster without GPUs) tokenize each
document, skip those already stored and prefill the others; the KV goes into Ray's object store and
an encode task on CPUs codes and writes it to the shared store (Redis, Redis Cluster, a folder every
node mounts). Tokens, keys and chunk bytes are those of a one-machine `ingest` with the same model,
codec and options: the stored objects are byte-identical.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvcodec.errors import ConfigError
from kvcodec.ingest.run import (
    FAILED,
    SKIPPED,
    STORED,
    DocResult,
    IngestReport,
    _Cut,
    _prefill,
    _stored_already,
    _why,
)
from kvcodec.ingest.sources import Document
from kvcodec.models.registry import token_limit

INSTALL_HINT = "kvcodec ingest --ray needs Ray: pip install 'kvcodec[ray]'"


@dataclasses.dataclass(frozen=True)
class RayJob:
    """What every actor and task of a job needs to rebuild its part (sent to the cluster)."""

    model: str  # registered name, model folder or .gguf file, readable on every node
    store_url: str
    codec: str
    codec_options: tuple[tuple[str, Any], ...] = ()
    max_tokens: int | None = None
    prefill_chunk_tokens: int | None = 2048
    encode_cpus: int = 4  # CPUs an encode task takes (its chunk threads)
    threads: int | None = None  # torch threads of a CPU prefill actor (None: Ray's default)
    dtype: str | None = None  # the prefill's dtype by name (None: kvcodec.models.run_dtype's rule)

    def make_codec(self):  # noqa: ANN201 - a ChunkCodec
        from kvcodec.codecs import make_codec

        return make_codec(self.codec, **dict(self.codec_options))

    def open_cache(self, model_id: str, device: Any = "cpu") -> tuple[Any, Any]:
        """(store, PrefixCache) as the engine opens them for this codec and model."""
        from kvcodec.engine.config import EngineConfig
        from kvcodec.fetcher import PrefixCache
        from kvcodec.store import open_store

        cfg = EngineConfig(store_url=self.store_url)
        store = open_store(self.store_url)
        return store, PrefixCache(store, model_id, self.make_codec(), device, store_partial=cfg.store_partial)


def import_ray():  # noqa: ANN201 - the ray module
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"{INSTALL_HINT} ({e})") from None
    return ray


class Prefiller:
    """A prefill actor: the model on this actor's GPU (or the CPU), the tokenizer, a store handle
    for the resume lookups."""

    def __init__(self, job: RayJob) -> None:
        import torch

        from kvcodec.engine.tokens import Tokens
        from kvcodec.ingest.run import load_for_ingest
        from kvcodec.models import model_id

        if job.threads:
            torch.set_num_threads(job.threads)
        self.job = job
        device = "cuda" if torch.cuda.is_available() else "cpu"
        run_dtype = getattr(torch, job.dtype) if job.dtype else None
        self.model, tokenizer, self.device = load_for_ingest(job.model, device, run_dtype)
        self.tokens = Tokens(tokenizer)
        self.model_id = model_id(self.model)
        self.store, self.cache = job.open_cache(self.model_id)
        self.cut = _Cut(token_limit(self.model, job.max_tokens), given=job.max_tokens is not None)

    def prefill(self, doc: Document) -> tuple[tuple[DocResult, list[int] | None, str], Any]:
        """((result, token ids to store or None, model id), KV on the CPU or None)."""
        if doc.error:
            return (DocResult(doc.id, FAILED, error=doc.error), None, self.model_id), None
        try:
            ids = self.cut(self.tokens.encode(doc.text))
            if not ids:
                raise ConfigError("the document tokenizes to no tokens")
            if _stored_already(self.cache, ids):
                return (DocResult(doc.id, SKIPPED, len(ids)), None, self.model_id), None
            t = time.perf_counter()
            kv = _prefill(self.model, ids, self.job.prefill_chunk_tokens).to("cpu")
            result = DocResult(doc.id, STORED, len(ids), prefill_s=time.perf_counter() - t)
            return (result, ids, self.model_id), kv
        except Exception as e:  # noqa: BLE001 - reported per document
            return (DocResult(doc.id, FAILED, error=_why(e)), None, self.model_id), None


def store_kv(job: RayJob, model_id: str, ids: list[int], kv: Any) -> tuple[int, float]:
    """An encode task: code `kv` and write it under the engine's keys; (chunks written, seconds)."""
    t = time.perf_counter()
    os.environ["KVCODEC_ENCODE_WORKERS"] = str(job.encode_cpus)
    store, cache = job.open_cache(model_id)
    try:
        written = int(cache.put(ids, kv) or 0)
    finally:
        if hasattr(store, "close"):
            store.close()
    return written, time.perf_counter() - t


def cluster_gpus(ray: Any) -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def ingest_on_ray(
    documents: Iterable[Document],
    job: RayJob,
    *,
    actors: int | None = None,
    on_result: Callable[[DocResult], None] | None = None,
) -> IngestReport:
    """Run `job` over `documents` on the Ray cluster this process is connected to (ray.init).
    actors: prefill actors (default: one per GPU of the cluster, or one on the CPU without GPUs).
    At most two documents per actor wait for prefill and two encodes per actor run at once."""
    ray = import_ray()
    gpus = cluster_gpus(ray)
    n = actors or max(1, gpus)
    node_cpus = max((int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")), default=0)
    total_cpus = int(ray.cluster_resources().get("CPU", 0))
    if total_cpus - (0 if gpus else n) < 1:
        raise ConfigError(
            f"the Ray cluster has {total_cpus} CPUs and no GPU: {n} prefill actors on the CPU leave none for encoding"
        )
    # a task must fit a node (a CPU actor holds one CPU of its node)
    job = dataclasses.replace(job, encode_cpus=max(1, min(job.encode_cpus, node_cpus - (0 if gpus else 1))))
    per_actor = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    remote_actor = ray.remote(Prefiller).options(**per_actor)
    pool = [remote_actor.remote(job) for _ in range(n)]
    encode = ray.remote(store_kv).options(num_cpus=job.encode_cpus)
    results: list[DocResult] = []
    prefills: dict[Any, Any] = {}  # meta ref -> its actor
    stores: dict[Any, DocResult] = {}  # store ref -> the document's result so far
    queue = collections.deque(documents)
    idle = collections.deque(a for a in pool for _ in range(2))  # two documents in flight per actor

    def done(r: DocResult) -> None:
        results.append(r)
        if on_result:
            on_result(r)

    t0 = time.perf_counter()
    while queue or prefills or stores:
        while queue and idle and len(stores) < 2 * n:
            actor = idle.popleft()
            meta, kv = actor.prefill.options(num_returns=2).remote(queue.popleft())
            prefills[meta] = (actor, kv)
        ready, _ = ray.wait([*prefills, *stores], num_returns=1)
        ref = ready[0]
        if ref in prefills:
            actor, kv = prefills.pop(ref)
            idle.append(actor)
            result, ids, model_id = _get(ray, ref)
            if ids is None:
                done(result)
            else:
                stores[encode.remote(job, model_id, ids, kv)] = result
        else:
            result = stores.pop(ref)
            try:
                chunks, store_s = _get(ray, ref)
                done(dataclasses.replace(result, chunks=chunks, store_s=store_s, status=STORED if chunks else SKIPPED))
            except Exception as e:  # noqa: BLE001 - one document's failure is reported, the job goes on
                done(dataclasses.replace(result, status=FAILED, error=_why(e)))
    for actor in pool:
        ray.kill(actor)
    return IngestReport(tuple(results), time.perf_counter() - t0)


def _get(ray: Any, ref: Any) -> Any:
    """ray.get, with a task's own exception raised as itself (a KVCodecError keeps its message)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        raise (cause if isinstance(cause, BaseException) else e) from None
